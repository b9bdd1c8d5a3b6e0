"""Stats as the worker's data path records them: plain dicts, no vLLM import.

``StatsRecorder.take`` hands over the data dict; ``stats.DualPathStats`` wraps it
for vLLM. Kept apart so the data path (and the GPU scripts, which run where vLLM
is not installed) can record without importing vLLM.
"""

from __future__ import annotations

import threading
from typing import Any

from dualpath_connector.protocol import COUNTERS, SIZES, TIMINGS

# Distributions: per-event samples, exported as histograms.
SAMPLED = (*TIMINGS, *SIZES)


def empty_stats() -> dict[str, Any]:
    data: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
    data.update({name: [] for name in SAMPLED})
    # Latest values only; absent until set.
    data["gauges"] = {}
    return data


def stats_empty(data: dict[str, Any]) -> bool:
    return not any(data[name] for name in COUNTERS) and not any(data[n] for n in SAMPLED) and not data["gauges"]


class StatsRecorder:
    """Thread-safe accumulation on the worker; ``take`` hands over the data and resets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty_stats()

    def add(self, **counters: int) -> None:
        with self._lock:
            for name, value in counters.items():
                self._data[name] += value

    def gauge(self, **values: float) -> None:
        with self._lock:
            self._data["gauges"].update(values)

    def sample(self, name: str, value: float) -> None:
        """One observation of a distribution (TIMINGS: seconds, SIZES: bytes)."""
        with self._lock:
            self._data[name].append(value)

    def take(self) -> dict[str, Any] | None:
        """What was recorded since the last call, or None when nothing was."""
        with self._lock:
            if stats_empty(self._data):
                return None
            taken, self._data = self._data, empty_stats()
        return taken
