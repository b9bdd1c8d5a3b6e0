"""Leading-run lookups above a :class:`~nixl_backends.store.KVStore`: a cache of present chunks, and waiting for saves.

Chunks are content-addressed and immutable, so a chunk found present stays
present until something deletes it (``dualpath-kv gc``, an S3 lifecycle rule):
positive answers are remembered, negative ones never are. A remembered answer
is dropped when a load of it fails (:meth:`PresentChunks.forget`) and, with
``ttl_s``, once it is older than that, so a cache that nobody loads through (the
router's) stops answering "present" for a deleted chunk. The connector's
scheduler and the router share :class:`PresentChunks`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from nixl_backends.store import KVStore


class PresentChunks:
    """How many of ``keys``, from the first, are stored: remembered answers first, then the store.

    ``ttl_s``: a remembered answer expires this long after the store gave it
    (None: never). Using an answer does not extend it: a chunk deleted while it
    is hot must still be asked about again. ``clock``: monotonic seconds.
    """

    def __init__(
        self, capacity: int, *, ttl_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        # key -> when the store last said it is present; oldest use first.
        self._present: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def known_run(self, keys: Sequence[str]) -> int:
        """Leading keys remembered as present (no store round trip); expired answers are dropped."""
        oldest = None if self.ttl_s is None else self._clock() - self.ttl_s
        with self._lock:
            known = 0
            while known < len(keys):
                confirmed = self._present.get(keys[known])
                if confirmed is None:
                    break
                if oldest is not None and confirmed <= oldest:
                    del self._present[keys[known]]
                    break
                self._present.move_to_end(keys[known])
                known += 1
        return known

    def remember(self, keys: Sequence[str]) -> None:
        now = self._clock()
        with self._lock:
            for key in keys:
                self._present[key] = now
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
