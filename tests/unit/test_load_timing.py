"""StepLoadTiming: the stall and hidden-fraction arithmetic, on marks with known times."""

from __future__ import annotations

from dualpath_connector.cache.copy_stream import Mark
from dualpath_connector.load.load_timing import StepLoadTiming
from dualpath_connector.metrics.stats_recorder import StatsRecorder


class At(Mark):
    """A mark at a known time; ``reached`` as told (a copy still queued is not)."""

    def __init__(self, at: float, reached: bool = True) -> None:
        self.at, self._reached = at, reached

    def reached(self) -> bool:
        return self._reached

    def wait(self) -> None:
        self._reached = True

    def seconds_until(self, later: Mark) -> float:
        return later.at - self.at


def _report(timing: StepLoadTiming) -> dict:
    stats = StatsRecorder()
    timing.report(stats)
    data = stats.take()
    return {"wait": data["layer_wait_seconds"], "load": data["layer_load_seconds"], **data["gauges"]}


def test_device_stall_counts_only_layers_whose_bytes_came_after_the_forward_reached_them():
    # Copies run from t=0 to t=4, layer l ready at l+1; the forward reaches layer l at 2l.
    ready = [At(1.0), At(2.0), At(3.0), At(4.0)]
    timing = StepLoadTiming(device_loads=[(At(0.0), ready[-1])],
                            device_waits=[(At(2.0 * layer), [mark]) for layer, mark in enumerate(ready)])  # fmt: skip
    # Layer 0 waits 1 s, layer 1 waits 0 (both at 2), later layers are ahead: 1 s of 4 s stalled.
    assert _report(timing) == {"wait": [1.0], "load": [4.0], "layer_load_hidden_fraction": 0.75}


def test_a_layer_waiting_on_two_copies_stalls_until_the_later_one():
    timing = StepLoadTiming(device_loads=[(At(0.0), At(3.0))], device_waits=[(At(1.0), [At(3.0), At(2.0)])])
    assert _report(timing)["wait"] == [2.0]


def test_host_waits_and_loads_combine_with_device_ones():
    # The CPU path: every copy in the forward's own time, nothing hidden.
    assert _report(StepLoadTiming(host_wait_s=0.5, host_load_s=0.5))["layer_load_hidden_fraction"] == 0.0
    # READs from a DE seen in after 2 s, of which the forward waited 0.5 s.
    assert _report(StepLoadTiming(host_wait_s=0.5, host_load_s=2.0))["layer_load_hidden_fraction"] == 0.75


def test_timing_is_read_only_once_every_mark_was_reached():
    pending = At(4.0, reached=False)
    timing = StepLoadTiming(device_loads=[(At(0.0), pending)], device_waits=[(At(0.0), [pending])])
    assert not timing.resolved()
    pending.wait()
    assert timing.resolved()


def test_no_load_time_sets_no_fraction():
    assert "layer_load_hidden_fraction" not in _report(StepLoadTiming())
