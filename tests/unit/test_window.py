"""nixl_backends/window.py: requests in flight follow the link's bandwidth-delay product.

A modelled link on a fake clock: each request takes the round trip plus its bytes at the link's rate, shared
by the requests in flight (a latency, then a bandwidth limit). Requests are posted as the window allows and
end in order, as a store's would.
"""

from __future__ import annotations

import heapq

import pytest

from nixl_backends.window import MEMORY_S, InFlightWindow

OBJECT = 64 << 10


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(window: InFlightWindow, clock: Clock, requests: int, round_trip_s: float, link_bytes_s: float) -> float:
    """Serve ``requests`` objects through ``window`` over the modelled link; the seconds it took."""
    started, posted, ends, last = clock.now, 0, [], clock.now
    while posted < requests or ends:
        while posted < requests and len(ends) < window.size():
            # Bytes share the link: a request posted behind others ends after their bytes too.
            last = max(clock.now + round_trip_s, last) + OBJECT / link_bytes_s
            heapq.heappush(ends, (last, posted, window.posted()))
            posted += 1
        finish, _, stamp = heapq.heappop(ends)
        clock.now = finish
        window.ended(stamp, OBJECT, True)
    return clock.now - started


def test_a_far_store_opens_the_window_to_its_bandwidth_delay_product_and_that_is_faster():
    # 20 ms away, 100 MB/s: the link holds 2 MB, 31 objects of 64 KiB.
    clock = Clock()
    window = InFlightWindow(8, 128, clock)
    adaptive = run(window, clock, 2000, 0.020, 100e6)
    bdp = 0.020 * 100e6 / OBJECT
    assert bdp <= window.size() <= 2.5 * bdp  # the gain's headroom, not the ceiling
    # Control: the same link through the fixed floor (what ran before) takes several times as long.
    fixed = run(InFlightWindow(8, 8, Clock()), Clock(), 2000, 0.020, 100e6)
    assert fixed > 3 * adaptive


def test_a_near_store_keeps_the_floor():
    # 50 us away, 1 GB/s: the link holds under 2 objects; the floor already covers them twice over.
    clock = Clock()
    window = InFlightWindow(8, 128, clock)
    run(window, clock, 2000, 0.00005, 1e9)
    assert window.size() == 8


def test_the_ceiling_bounds_a_link_with_no_bandwidth_limit_and_failures_measure_nothing():
    clock = Clock()
    window = InFlightWindow(4, 16, clock)
    run(window, clock, 500, 0.050, 1e15)  # a latency only: more in flight is always faster
    assert window.size() == 16
    stamp = window.posted()
    clock.now += 1.0  # a request that failed after a second says nothing of the link
    window.ended(stamp, OBJECT, False)
    assert window.size() == 16


def test_measurements_are_forgotten_and_the_window_returns_to_the_floor():
    clock = Clock()
    window = InFlightWindow(8, 128, clock)
    run(window, clock, 500, 0.020, 100e6)
    assert window.size() > 8
    clock.now += MEMORY_S + 1
    assert window.size() == 8  # nothing measured lately: what runs before any measurement


@pytest.mark.parametrize("floor, ceiling", [(0, 4), (5, 4), (-1, -1)])
def test_a_window_needs_a_floor_within_its_ceiling(floor, ceiling):
    with pytest.raises(ValueError, match="floor"):
        InFlightWindow(floor, ceiling)
