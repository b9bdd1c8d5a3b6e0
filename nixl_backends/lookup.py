"""Leading-run lookups above a :class:`~nixl_backends.store.KVStore`: a cache of present chunks, and waiting for saves.

Chunks are content-addressed and immutable, so a chunk found present stays
present (until a lifecycle rule removes it, which a load then reports as a
failed chunk): positive answers are remembered, negative ones never are. The
connector's scheduler and the router share :class:`PresentChunks`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from nixl_backends.store import KVStore


class PresentChunks:
    """How many of ``keys``, from the first, are stored: remembered answers first, then the store."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._present: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def known_run(self, keys: Sequence[str]) -> int:
        """Leading keys remembered as present (no store round trip)."""
        with self._lock:
            known = 0
            while known < len(keys) and keys[known] in self._present:
                self._present.move_to_end(keys[known])
                known += 1
        return known

    def remember(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._present[key] = None
                self._present.move_to_end(key)
            while len(self._present) > self.capacity:
                self._present.popitem(last=False)

    def forget(self, keys: Sequence[str]) -> None:
        """Drop remembered answers (a load of them failed: the store is asked again)."""
        with self._lock:
            for key in keys:
                self._present.pop(key, None)

    def leading_present(self, store: KVStore, keys: Sequence[str]) -> int:
        """The leading run of ``keys`` present; asks ``store`` only past the remembered run.

        Store errors propagate: the caller decides what an outage means.
        """
        known = self.known_run(keys)
        if known == len(keys):
            return known
        found = store.lookup(keys[known:])
        self.remember(keys[known : known + found])
        return known + found


def wait_stored(store: KVStore, keys: Sequence[str], timeout_s: float, poll_s: float = 0.05) -> None:
    """Block until every key is stored (saves are asynchronous); TimeoutError naming a missing key.

    Polls the store: object stores and file systems have no notification to
    wait on. Saves land in step order, so the last key is asked first; once it
    is there the rest usually is too.
    """
    deadline = time.monotonic() + timeout_s
    remaining = list(keys[-1:]) + list(keys[:-1])
    while remaining:
        remaining = remaining[store.lookup(remaining) :]
        if not remaining:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"chunk {remaining[0]} not stored within {timeout_s}s")
        time.sleep(poll_s)
