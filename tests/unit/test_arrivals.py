"""LayerArrivals (the read lane lands layers, the forward waits for them) and ComputeWindow (the measured
per-layer compute time declared to the store).

Waits are driven by threads and Events, never by sleeping; the compute window
by a fake clock, so its numbers are exact.
"""

from __future__ import annotations

import threading
import time
import types

import pytest

from dualpath_connector.worker import compute_window
from dualpath_connector.load.arrivals import LayerArrivals
from dualpath_connector.worker.compute_window import EWMA_ALPHA, ComputeWindow

# Long enough never to expire in a passing test; a wait that must not block is asserted well under it.
PATIENT_S = 30.0


def _waiting(arrivals: LayerArrivals, layer: int) -> tuple[threading.Thread, list[int]]:
    """A thread blocked in ``arrivals.wait(layer)``; its result lands in the list."""
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(arrivals.wait(layer, PATIENT_S)), daemon=True)
    thread.start()
    return thread, result


def test_landed_layers_are_waited_for_with_their_good_counts():
    arrivals = LayerArrivals(3)
    arrivals.land(0, 4)
    arrivals.land(1, 2)
    assert arrivals.wait(0, PATIENT_S) == 4 and arrivals.wait(1, PATIENT_S) == 2
    assert not arrivals.complete(2)
    arrivals.land(2, 2)
    assert arrivals.complete(2) and not arrivals.complete(3)


def test_layers_land_in_order_only():
    arrivals = LayerArrivals(3)
    with pytest.raises(RuntimeError, match="layer 1 landed after 0 layers"):
        arrivals.land(1, 4)
    arrivals.land(0, 4)
    with pytest.raises(RuntimeError):
        arrivals.land(0, 4)


def test_a_waiter_wakes_when_its_layer_lands_not_before():
    arrivals = LayerArrivals(2)
    thread, result = _waiting(arrivals, 1)
    arrivals.land(0, 3)
    thread.join(0.2)
    assert thread.is_alive() and result == []  # layer 0 is not the layer it waits for
    arrivals.land(1, 3)
    thread.join(PATIENT_S)
    assert result == [3]


def test_a_layer_that_does_not_land_in_time_is_zero_good_chunks():
    arrivals = LayerArrivals(2)
    arrivals.land(0, 3)
    started = time.monotonic()
    assert arrivals.wait(1, 0.05) == 0
    assert 0.04 <= time.monotonic() - started < 5.0
    # Landing later still counts for a later wait.
    arrivals.land(1, 3)
    assert arrivals.wait(1, 0.0) == 3


@pytest.mark.parametrize("error", ["gateway died", None])
def test_end_wakes_waiters_with_zero_at_once(error):
    arrivals = LayerArrivals(3)
    arrivals.land(0, 2)
    thread, result = _waiting(arrivals, 2)
    started = time.monotonic()
    arrivals.end(error)
    thread.join(PATIENT_S)
    assert result == [0] and time.monotonic() - started < 5.0
    # A layer that landed before the end still counts; after the end nothing waits.
    started = time.monotonic()
    assert arrivals.wait(0, PATIENT_S) == 2 and arrivals.wait(1, PATIENT_S) == 0
    assert time.monotonic() - started < 5.0
    assert not arrivals.complete(1)


def test_when_ended_runs_each_callback_once_on_end():
    arrivals = LayerArrivals(1)
    calls: list[str] = []
    arrivals.when_ended(lambda: calls.append("a"))
    arrivals.when_ended(lambda: calls.append("b"))
    arrivals.land(0, 1)
    assert calls == []  # every layer landed, but the store may still be writing until the read ends
    arrivals.end()
    assert calls == ["a", "b"]
    arrivals.end()  # a second end runs nothing again
    assert calls == ["a", "b"]


def test_when_ended_after_the_end_runs_at_once():
    arrivals = LayerArrivals(1)
    arrivals.end("failed")
    calls: list[str] = []
    arrivals.when_ended(lambda: calls.append("late"))
    assert calls == ["late"]


def test_when_ended_waits_for_an_abandoned_reads_transfers_to_end():
    arrivals = LayerArrivals(2)
    calls: list[str] = []
    arrivals.when_ended(lambda: calls.append("before"))
    arrivals.end("timed out", abandoned=True)
    arrivals.when_ended(lambda: calls.append("after"))
    assert calls == []  # NIXL may still write the slots
    # Waiters are still woken: the forward fails the hit, it does not hang.
    assert arrivals.wait(0, PATIENT_S) == 0
    arrivals.transfers_ended()  # the reaper saw every handle end
    assert calls == ["before", "after"]
    arrivals.when_ended(lambda: calls.append("later"))
    assert calls == ["before", "after", "later"]


def test_last_landed_at_follows_the_landings():
    arrivals = LayerArrivals(2)
    assert arrivals.last_landed_at() is None
    before = time.perf_counter()
    arrivals.land(0, 1)
    first = arrivals.last_landed_at()
    arrivals.land(1, 1)
    assert before <= first <= arrivals.last_landed_at() <= time.perf_counter()


# -- ComputeWindow -------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(compute_window, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def _forward(window: ComputeWindow, clock: FakeClock, waits: list[float], computes: list[float]) -> None:
    """One forward: per layer, ``waits[l]`` in the load wait, then ``computes[l]`` of compute."""
    last = len(waits) - 1
    for layer, (wait, compute) in enumerate(zip(waits, computes)):
        window.entered(layer)
        clock.now += wait
        window.left(layer, layer == last)
        clock.now += compute


def test_the_window_is_the_mean_compute_between_layers_not_the_waits(clock):
    window = ComputeWindow()
    assert window.seconds is None
    # Computes of layers 0 and 1 are measured (2 and 4: mean 3); the last layer's compute is not (no next
    # layer entered), nor are the waits (5 each, which would move the mean if counted).
    _forward(window, clock, waits=[5.0, 5.0, 5.0], computes=[2.0, 4.0, 100.0])
    assert window.seconds == 3.0


def test_later_forwards_fold_in_with_the_ewma_weight(clock):
    window = ComputeWindow()
    _forward(window, clock, waits=[0.0, 0.0, 0.0], computes=[3.0, 3.0, 0.0])
    _forward(window, clock, waits=[1.0, 1.0, 1.0], computes=[8.0, 8.0, 0.0])
    assert window.seconds == 3.0 + EWMA_ALPHA * (8.0 - 3.0)
    # One outlier forward moves it by alpha of the difference, not to the outlier.
    _forward(window, clock, waits=[0.0, 0.0, 0.0], computes=[1000.0, 1000.0, 0.0])
    expected = 3.0 + EWMA_ALPHA * (8.0 - 3.0)
    assert window.seconds == expected + EWMA_ALPHA * (1000.0 - expected)


def test_a_one_layer_forward_measures_nothing(clock):
    window = ComputeWindow()
    _forward(window, clock, waits=[1.0], computes=[7.0])
    assert window.seconds is None
    _forward(window, clock, waits=[1.0, 1.0], computes=[2.0, 0.0])
    assert window.seconds == 2.0


def test_a_new_forward_does_not_count_the_time_since_the_last(clock):
    window = ComputeWindow(alpha=0.5)
    _forward(window, clock, waits=[0.0, 0.0], computes=[2.0, 0.0])
    clock.now += 1000.0  # idle between steps
    _forward(window, clock, waits=[0.0, 0.0], computes=[4.0, 0.0])
    assert window.seconds == 3.0
