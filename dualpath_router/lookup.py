"""Hit length of a prompt: the leading run of its chunks present in the store.

Only chunks the engine can claim count: ``(len(tokens) - 1) // chunk_tokens``,
because vLLM always computes the last prompt token itself (it needs its
logits). Chunks are immutable, so "present" answers are cached; a store that
cannot be reached makes every hit 0, never a failed request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from nixl_backends.layout import BlockLayout, chunk_hashes, chunk_key
from nixl_backends.registry import make_store
from nixl_backends.store import KVStore

from dualpath_router.config import StoreNamespace

logger = logging.getLogger(__name__)

_OUTAGE_LOG_INTERVAL_S = 30.0
# After a failed lookup the store is left alone this long: a store that
# hangs must not add its timeouts to every request's latency.
_OUTAGE_BACKOFF_S = 5.0


class HitLookup:
    def __init__(self, store_config: object | None, cache_chunks: int) -> None:
        self._store_config = store_config
        self._cache_chunks = cache_chunks
        self._present: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()  # the present-chunk cache
        self._store_lock = threading.Lock()  # opening the store (may block on the network)
        self._store: KVStore | None = None
        self._store_layout: BlockLayout | None = None
        self._last_outage_log = float("-inf")
        self._skip_store_until = float("-inf")
        self.namespace: StoreNamespace | None = None

    @property
    def enabled(self) -> bool:
        return self._store_config is not None

    def claimable_keys(self, token_ids: Sequence[int]) -> list[str]:
        ns = self.namespace
        if ns is None:
            return []
        claimable = (len(token_ids) - 1) // ns.chunk_tokens
        if claimable <= 0:
            return []
        hashes = chunk_hashes(ns.digest, token_ids[: claimable * ns.chunk_tokens], ns.chunk_tokens)
        return [chunk_key(ns.key_prefix, ns.digest, h) for h in hashes]

    async def hit_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens at the start of the prompt whose KV the store holds; 0 on any store trouble."""
        if not self.enabled or self.namespace is None:
            return 0
        namespace = self.namespace
        return await asyncio.to_thread(self._hit_tokens_blocking, token_ids, namespace)

    def _hit_tokens_blocking(self, token_ids: Sequence[int], namespace: StoreNamespace) -> int:
        keys = self.claimable_keys(token_ids)
        with self._lock:
            cached = 0
            while cached < len(keys) and keys[cached] in self._present:
                self._present.move_to_end(keys[cached])
                cached += 1
        if cached == len(keys) or time.monotonic() < self._skip_store_until:
            return cached * namespace.chunk_tokens
        try:
            found = self._open_store(namespace).lookup(keys[cached:])
        except Exception as exc:  # any store failure: a miss, never a failed request
            self._skip_store_until = time.monotonic() + _OUTAGE_BACKOFF_S
            self._log_outage(exc)
            found = 0
        with self._lock:
            for key in keys[cached : cached + found]:
                self._present[key] = None
            while len(self._present) > self._cache_chunks:
                self._present.popitem(last=False)
        return (cached + found) * namespace.chunk_tokens

    def _open_store(self, namespace: StoreNamespace) -> KVStore:
        layout = BlockLayout(namespace.num_layers, namespace.layer_block_bytes)
        with self._store_lock:
            if self._store is None or self._store_layout != layout:
                # No NIXL agent: lookup only. Opened lazily so that a store
                # down at start-up is an outage, not a failed start.
                self._store = make_store(self._store_config, layout)
                self._store_layout = layout
            return self._store

    def _log_outage(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._last_outage_log >= _OUTAGE_LOG_INTERVAL_S:
            self._last_outage_log = now
            logger.warning("store lookup failed, counting hits as 0 (logged every %.0fs): %s",
                           _OUTAGE_LOG_INTERVAL_S, exc)
