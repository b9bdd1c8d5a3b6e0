"""The event loop: a heap of (time, sequence) ordered callbacks in simulated seconds."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventLoop:
    """Runs callbacks in time order; callbacks due at the same time run in the order they were scheduled.

    The sequence number breaks ties, so a run is deterministic and the heap never compares callbacks.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._sequence = itertools.count()
        self.processed = 0

    def at(self, when: float, callback: Callable[[Any], None], argument: Any = None) -> None:
        if when < self.now:
            raise ValueError(f"cannot schedule in the past: {when} < now {self.now}")
        heapq.heappush(self._heap, (when, next(self._sequence), callback, argument))

    def clock(self) -> float:
        return self.now

    def run(self) -> float:
        """Until no event is left; returns the time of the last one."""
        heap = self._heap
        while heap:
            self.now, _, callback, argument = heapq.heappop(heap)
            self.processed += 1
            callback(argument)
        return self.now
