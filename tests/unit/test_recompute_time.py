"""A load's deadline: the worker's recompute-time estimate and the context that carries the deadline to the store."""

from __future__ import annotations

import threading
import time

import pytest

from dualpath_connector.worker import recompute_time
from dualpath_connector.worker.recompute_time import RecomputeTime
from nixl_backends.deadlines import load_deadline, seconds_left


def _step(estimate: RecomputeTime, tokens: int, seconds: float, clock: list[float]) -> None:
    estimate.step_started(tokens)
    clock[0] += seconds
    estimate.step_ended()


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(recompute_time.time, "perf_counter", lambda: now[0])
    return now


def test_the_rate_comes_from_prefill_steps_only(clock):
    estimate = RecomputeTime(min_step_tokens=256)
    assert estimate.seconds(1000) is None  # nothing learnt: no deadline
    _step(estimate, 8, 0.5, clock)  # a decode step: 16 tokens/s would make a recompute look 60x longer
    assert estimate.seconds(1000) is None
    _step(estimate, 2000, 1.0, clock)
    assert estimate.seconds(1000) == pytest.approx(0.5)
    estimate.step_ended()  # vLLM skips wait_for_save on a step without a forward: a lone end teaches nothing
    assert estimate.seconds(1000) == pytest.approx(0.5)


def test_a_step_that_never_ended_is_replaced_by_the_next(clock):
    estimate = RecomputeTime(min_step_tokens=256)
    estimate.step_started(4000)
    clock[0] += 100.0  # no forward ran (no wait_for_save)
    _step(estimate, 1000, 1.0, clock)
    assert estimate.seconds(1000) == pytest.approx(1.0)


def test_the_deadline_is_the_blocks_own_and_unset_outside_it():
    assert seconds_left() is None
    with load_deadline(time.monotonic() + 10):
        assert 9 < seconds_left() <= 10
        with load_deadline(None):
            assert seconds_left() is None
        assert seconds_left() > 9
        seen = []
        other = threading.Thread(target=lambda: seen.append(seconds_left()))  # another lane's thread
        other.start()
        other.join()
        assert seen == [None]
    assert seconds_left() is None
    with load_deadline(time.monotonic() - 1):
        assert seconds_left() < 0  # past it
