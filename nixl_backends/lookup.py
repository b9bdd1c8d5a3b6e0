"""Leading-run lookups above a :class:`~nixl_backends.store.KVStore`: a cache of present chunks, and waiting for saves.

Chunks are content-addressed and immutable, so a chunk found present stays
present until something deletes it (``dualpath-kv gc``, an S3 lifecycle rule):
positive answers are remembered. A remembered answer is dropped when a load of
it fails (:meth:`PresentChunks.forget`) and, with ``ttl_s``, once it is older
than that, so a cache that nobody loads through (the router's) stops answering
"present" for a deleted chunk. Negative answers turn true as soon as some
engine saves the chunk, so they are remembered only with ``absent_ttl_s``, for
a short while (a burst of requests with one prefix asks the store once). The
connector's scheduler and the router share :class:`PresentChunks`.
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
    is hot must still be asked about again. ``absent_ttl_s``: how long the first
    absent key of a lookup is remembered as absent (None: not at all).
    ``clock``: monotonic seconds.
    """

    def __init__(
        self,
        capacity: int,
        *,
        ttl_s: float | None = None,
        absent_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        for name, value in (("ttl_s", ttl_s), ("absent_ttl_s", absent_ttl_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value}")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.absent_ttl_s = absent_ttl_s
        self._clock = clock
        # key -> when the store last said it is present; oldest use first.
        self._present: OrderedDict[str, float] = OrderedDict()
        # key -> when the store said it is absent; oldest first (entries are never refreshed in place).
        self._absent: OrderedDict[str, float] = OrderedDict()
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
                self._absent.pop(key, None)
            while len(self._present) > self.capacity:
                self._present.popitem(last=False)

    def forget(self, keys: Sequence[str]) -> None:
        """Drop remembered answers, present or absent (a load failed, a chunk is being saved: ask again)."""
        with self._lock:
            for key in keys:
                self._present.pop(key, None)
                self._absent.pop(key, None)

    def settled_run(self, keys: Sequence[str]) -> int | None:
        """The leading run of ``keys`` present if remembered answers settle it (every key present, or the run
        ends at a key remembered absent); None when only the store can tell."""
        known = self.known_run(keys)
        if known == len(keys) or self._known_absent(keys[known]):
            return known
        return None

    def leading_present(self, store: KVStore, keys: Sequence[str]) -> int:
        """The leading run of ``keys`` present; asks ``store`` only past what remembered answers settle.

        Store errors propagate: the caller decides what an outage means.
        """
        known = self.known_run(keys)
        if known == len(keys) or self._known_absent(keys[known]):
            return known
        found = store.lookup(keys[known:])
        self.remember(keys[known : known + found])
        if known + found < len(keys) and self.absent_ttl_s is not None:
            self._remember_absent(keys[known + found])
        return known + found

    def _known_absent(self, key: str) -> bool:
        if self.absent_ttl_s is None:
            return False
        with self._lock:
            said = self._absent.get(key)
            if said is None:
                return False
            if said <= self._clock() - self.absent_ttl_s:
                del self._absent[key]
                return False
            return True

    def _remember_absent(self, key: str) -> None:
        now = self._clock()
        with self._lock:
            self._absent.pop(key, None)
            self._absent[key] = now
            # Oldest first: expired entries leave from the front, and the size stays bounded.
            while self._absent and (len(self._absent) > self.capacity
                                    or next(iter(self._absent.values())) <= now - self.absent_ttl_s):
                self._absent.popitem(last=False)


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
