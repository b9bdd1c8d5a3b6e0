"""Hit length of a prompt: the leading run of its claimable chunks present in the store.

Only chunks the engine can claim count (:meth:`StoreKeySpace.claimable_keys`:
never the last prompt token, vLLM computes it itself for its logits). Present
chunks are remembered (:class:`PresentChunks`: chunks are immutable); a store
that cannot be reached makes every hit 0, never a failed request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence

from nixl_backends.layout import isolated_chain
from nixl_backends.lookup import PresentChunks
from nixl_backends.registry import make_store, shared_tier
from nixl_backends.store import KVStore

from dualpath_connector.protocol import StoreKeySpace

logger = logging.getLogger(__name__)

_OUTAGE_LOG_INTERVAL_S = 30.0
# After a failed lookup the store is left alone this long: a store that
# hangs must not add its timeouts to every request's latency.
_OUTAGE_BACKOFF_S = 5.0


class HitLookup:
    def __init__(self, store_config: object | None, cache_chunks: int, cache_ttl_s: float | None = None) -> None:
        self._store_config = store_config
        self._present = PresentChunks(cache_chunks, ttl_s=cache_ttl_s)
        self._store_lock = threading.Lock()  # opening the store (may block on the network)
        self._store: KVStore | None = None
        self._last_outage_log = float("-inf")
        self._skip_store_until = float("-inf")
        self.namespace: StoreKeySpace | None = None

    @property
    def enabled(self) -> bool:
        return self._store_config is not None

    async def hit_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Tokens at the start of the prompt whose KV the store holds for its salt; store trouble counts as a miss.

        A salted prompt is looked up in its salt's chain only (as the engines store it): never a hit from
        another salt's chunks or from unsalted ones.
        """
        if not self.enabled or self.namespace is None:
            return 0
        namespace = self.namespace
        return await asyncio.to_thread(self._hit_tokens_blocking, token_ids, namespace, cache_salt)

    def _hit_tokens_blocking(self, token_ids: Sequence[int], namespace: StoreKeySpace, cache_salt: str | None) -> int:
        # A TP engine's namespace lists every rank's shard of each chunk: a chunk counts when all are stored.
        chain = isolated_chain(namespace.chain_digest, cache_salt=cache_salt)
        keys = namespace.claimable_keys(token_ids, chain)
        known = self._present.known_run(keys)
        if known == len(keys) or time.monotonic() < self._skip_store_until:
            return known // namespace.keys_per_chunk * namespace.chunk_tokens
        try:
            found = self._present.leading_present(self._open_store(namespace), keys)
        except Exception as exc:  # any store failure: a miss past the remembered run, never a failed request
            self._skip_store_until = time.monotonic() + _OUTAGE_BACKOFF_S
            self._log_outage(exc)
            found = known
        return found // namespace.keys_per_chunk * namespace.chunk_tokens

    def _open_store(self, namespace: StoreKeySpace) -> KVStore:
        layout = namespace.layout
        with self._store_lock:
            if self._store is None or self._store.layout != layout:
                # No NIXL agent: lookup only. Opened lazily so that a store
                # down at start-up is an outage, not a failed start.
                # A tiered store: its shared tier (the local ones are on the engines' nodes).
                self._store = make_store(shared_tier(self._store_config), layout)
            return self._store

    def _log_outage(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._last_outage_log >= _OUTAGE_LOG_INTERVAL_S:
            self._last_outage_log = now
            logger.warning("store lookup failed, counting hits as 0 (logged every %.0fs): %s",
                           _OUTAGE_LOG_INTERVAL_S, exc)
