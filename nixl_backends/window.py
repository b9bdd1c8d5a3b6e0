"""Requests in flight to a remote store, sized from the link's measured bandwidth-delay product.

A store across a network answers each request after a round trip (5-50 ms to
the first byte on S3-compatible services). With a fixed number of requests in
flight a read moves at most ``window * object size / round trip``: a window
that fills a local store's link leaves a remote one idle most of the time.
So the window follows the link, as BBR sizes a TCP flow's (Cardwell et al.,
2016), from two measurements over the last :data:`MEMORY_S` seconds:

- the bottleneck rate: the most bytes per second the link delivered, each
  request's sample being the bytes that ended between its posting and its
  end, over that time (many requests in flight: the link's rate, not one
  request's);
- the round trip: the least time a request took, posting to end.

Their product is the bytes the link holds in flight; the window is
:data:`GAIN` times that in requests (so a rate that would still grow with
more requests in flight can show it), within ``[floor, ceiling]``: the
floor is what the store ran before (nothing measured yet: the configured
minimum), the ceiling the NIXL OBJ plugin's threads. A local store, quick
and CPU-bound, keeps the floor; one 20 ms away opens up to the ceiling.
Measurements older than :data:`MEMORY_S` are dropped, so a link that got
slower (or faster) is followed within that time.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable

MEMORY_S = 10.0
GAIN = 2.0


class InFlightWindow:
    """One store's requests in flight (:meth:`size`), fed by every request it ends (:meth:`posted`, :meth:`ended`).

    Thread-safe: the reads and writes of one store (several lanes) share it.
    """

    def __init__(self, floor: int, ceiling: int, clock: Callable[[], float] = time.monotonic) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError(f"window floor {floor} and ceiling {ceiling}: need 1 <= floor <= ceiling")
        self.floor, self.ceiling = floor, ceiling
        self._clock = clock
        self._lock = threading.Lock()
        self._delivered = 0  # bytes of every request that ended, ever
        self._rate = _SlidingExtreme(max)
        self._round_trip = _SlidingExtreme(min)
        self._request_bytes = 0

    def posted(self) -> tuple[float, int]:
        """A request is posted now: the stamp :meth:`ended` takes back."""
        with self._lock:
            return self._clock(), self._delivered

    def ended(self, stamp: tuple[float, int], nbytes: int, ok: bool) -> None:
        """The request posted at ``stamp`` ended; a failed one (``ok`` false) delivered nothing and measures nothing."""
        if not ok:
            return
        posted_at, delivered_before = stamp
        with self._lock:
            now = self._clock()
            self._delivered += nbytes
            self._request_bytes = nbytes
            took = now - posted_at
            if took > 0:
                self._rate.add(now, (self._delivered - delivered_before) / took)
                self._round_trip.add(now, took)

    def size(self) -> int:
        """Requests to keep in flight now."""
        with self._lock:
            now = self._clock()
            rate, round_trip = self._rate.value(now), self._round_trip.value(now)
            if rate is None or round_trip is None or not self._request_bytes:
                return self.floor
            wanted = math.ceil(GAIN * rate * round_trip / self._request_bytes)
            return max(self.floor, min(self.ceiling, wanted))


class _SlidingExtreme:
    """The max (or min) of the values added in the last :data:`MEMORY_S` seconds, in O(1) amortized per value:
    a value that a newer one beats can never be the extreme again, so it is dropped as the newer one comes."""

    def __init__(self, pick: Callable[[float, float], float]) -> None:
        self._pick = pick
        self._kept: collections.deque[tuple[float, float]] = collections.deque()  # (when, value), oldest first

    def add(self, when: float, value: float) -> None:
        while self._kept and self._pick(self._kept[-1][1], value) == value:
            self._kept.pop()
        self._kept.append((when, value))

    def value(self, now: float) -> float | None:
        while self._kept and self._kept[0][0] < now - MEMORY_S:
            self._kept.popleft()
        return self._kept[0][1] if self._kept else None
