"""vLLM KV events for the store: ``BlockStored`` once a chunk is durably written, ``BlockRemoved`` once gc deleted it.

KV-event routers (llm-d's precise prefix-cache scorer, Dynamo's KV router)
index which engine holds which blocks from vLLM's KV events. vLLM publishes
its own GPU-tier events; the scheduler half adds the store's, medium
``STORAGE``, through ``take_events()``, which vLLM's scheduler calls every step
and publishes with its own in one batch.

- **Stored, once durable.** When the scheduler plans a save it snapshots what
  the event needs while the request is alive: for each vLLM block of each
  chunk, vLLM's own block hash (``request.block_hashes``, the hashes vLLM's
  GPU-tier events carry, so consumers join the two tiers), the parent block's
  hash and the block's token ids. The event is queued only when every rank
  reported the chunk written (:class:`~dualpath_connector.metadata.SavedChunks`,
  through vLLM's worker metadata), one ``BlockStored`` per vLLM block, once per
  chunk while it is known stored. A failed or skipped write drops the snapshot.
- **Removed, once gone.** ``dualpath-kv gc`` runs elsewhere and leaves removal
  records in the store (:mod:`nixl_backends.removals`). A watcher thread reads
  the new ones every ``kv_events_gc_poll_s``; a bad record is counted and
  skipped, and even a good one is only a hint: a chunk this engine announced
  is reported removed only when the store's own lookup no longer finds it.
- **Bounded.** At most ``kv_events_max_queued`` events wait between steps and
  as many chunks wait for their writes; beyond that they are dropped and
  counted (``dualpath_kv:kv_events_dropped``). Announced chunks are remembered
  up to ``lookup_cache_chunks`` (oldest forgotten first: their removal then
  goes unannounced).

Events reach consumers when the engine steps: a write that finishes after an
idle engine's last step is announced with its next step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nixl_backends.removals import RecordError, RemovalLog
from nixl_backends.store import KVStore

from dualpath_connector.metadata import SavedChunks
from dualpath_connector.metrics.stats_recorder import StatsRecorder

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# The ownership of the store's events: who holds the announced copies (vLLM keys a block's residencies by medium
# and ownership, so ours never end another tier's).
OWNERSHIP = "dualpath-kv"


@dataclass(frozen=True)
class _Block:
    """What one vLLM block's ``BlockStored`` carries (hashes as vLLM publishes them)."""

    block_hash: Any
    parent_block_hash: Any
    token_ids: tuple[int, ...]
    # vLLM's untagged extra keys of the block (the adapter's name, the salt on a prompt's first block), as its
    # own events carry them: the keys its block hash was computed with.
    extra_keys: tuple[Any, ...] | None = None
    lora_name: str | None = None
    lora_id: int | None = None


@dataclass
class _PendingChunk:
    blocks: tuple[_Block, ...]
    ranks_written: int = 0


class StorageEvents:
    """The scheduler half's event bookkeeping; single-threaded but for the removal watcher's questions."""

    def __init__(
        self,
        *,
        block_size: int,
        blocks_per_chunk: int,
        world_size: int,
        max_queued: int,
        tracked_chunks: int,
        stats: StatsRecorder,
        token_ids: bool = True,
        locality: str | None = None,
        spec_kind: str | None = None,
    ) -> None:
        self.block_size = block_size
        # As vLLM's own storage tiers tag their events: the store's locality (kv_events_locality), the owner of
        # the copies announced (this connector: a removal undoes only its own residency), the cache's spec kind.
        self.locality = locality
        self.spec_kind = spec_kind
        self.blocks_per_chunk = blocks_per_chunk
        self.world_size = world_size
        self.max_queued = max_queued
        self.tracked_chunks = tracked_chunks
        # False: BlockStored without token ids (kv_events_token_ids).
        self.token_ids = token_ids
        self.stats = stats
        self._pending: OrderedDict[str, _PendingChunk] = OrderedDict()
        self._queue: deque[KVCacheEvent] = deque()
        # Announced chunks -> their vLLM block hashes, for BlockRemoved; read by the watcher thread too.
        self._announced: OrderedDict[str, tuple[Any, ...]] = OrderedDict()
        self._lock = threading.Lock()

    # -- stores ---------------------------------------------------------------

    def planned(self, request: Request, first_chunk: int, chunk_hashes: Sequence[str]) -> None:
        """A save of ``chunk_hashes`` (chunks ``first_chunk``... of ``request``) goes to the workers this step."""
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            maybe_convert_block_hash,
            to_event_extra_keys,
        )

        bpc, size = self.blocks_per_chunk, self.block_size
        block_hashes = request.block_hashes
        if len(block_hashes) < (first_chunk + len(chunk_hashes)) * bpc:
            # vLLM hashes every full block as its tokens arrive; a gap means nothing to join with.
            logger.debug("request %s: vLLM block hashes missing; no KV events for its saves", request.request_id)
            return
        tokens = request.all_token_ids
        lora = request.lora_request
        lora_name, lora_id = (lora.lora_name, lora.lora_int_id) if lora is not None else (None, None)

        def extra_keys(block: int) -> tuple[Any, ...] | None:
            # Saved requests carry no images or embeddings (not cacheable), so vLLM's multimodal index stays 0.
            keys, _ = generate_block_hash_extra_keys(request, block * size, (block + 1) * size, 0)
            return (to_event_extra_keys([keys]) or [None])[0]

        for offset, chunk_hash in enumerate(chunk_hashes):
            if chunk_hash in self._pending:
                continue  # another request saves the same chunk: one announcement
            first_block = (first_chunk + offset) * bpc
            blocks = tuple(
                _Block(
                    block_hash=maybe_convert_block_hash(block_hashes[b]),
                    parent_block_hash=maybe_convert_block_hash(block_hashes[b - 1]) if b > 0 else None,
                    token_ids=tuple(tokens[b * size : (b + 1) * size]),
                    extra_keys=extra_keys(b),
                    lora_name=lora_name,
                    lora_id=lora_id,
                )
                for b in range(first_block, first_block + bpc)
            )
            if len(self._pending) >= self.max_queued:
                self._pending.popitem(last=False)
                self.stats.add(kv_events_dropped=1)
            self._pending[chunk_hash] = _PendingChunk(blocks)

    def saved(self, saved: SavedChunks | None) -> None:
        """The workers' report of finished writes: announce the chunks every rank wrote."""
        if saved is None:
            return
        for chunk_hash in saved.failed:
            self._pending.pop(chunk_hash, None)
        for chunk_hash, ranks in saved.stored.items():
            pending = self._pending.get(chunk_hash)
            if pending is None:
                continue
            pending.ranks_written += ranks
            if pending.ranks_written < self.world_size:
                continue
            del self._pending[chunk_hash]
            self._announce_stored(chunk_hash, pending.blocks)

    def _announce_stored(self, chunk_hash: str, blocks: tuple[_Block, ...]) -> None:
        from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored

        with self._lock:
            if chunk_hash in self._announced:
                self._announced.move_to_end(chunk_hash)
                return
        if len(self._queue) + len(blocks) > self.max_queued:
            self.stats.add(kv_events_dropped=len(blocks))
            return  # not remembered as announced: a later save of it is announced
        for block in blocks:
            self._queue.append(
                BlockStored(
                    block_hashes=[block.block_hash],
                    parent_block_hash=block.parent_block_hash,
                    token_ids=list(block.token_ids) if self.token_ids else [],
                    block_size=self.block_size,
                    lora_id=block.lora_id,
                    medium=MEDIUM_STORAGE,
                    lora_name=block.lora_name,
                    extra_keys=[block.extra_keys] if block.extra_keys is not None else None,
                    group_idx=0,
                    kv_cache_spec_kind=self.spec_kind,
                    locality=self.locality,
                    ownership=OWNERSHIP,
                )
            )
        self.stats.add(kv_events_stored_blocks=len(blocks))
        with self._lock:
            self._announced[chunk_hash] = tuple(block.block_hash for block in blocks)
            if len(self._announced) > self.tracked_chunks:
                self._announced.popitem(last=False)

    # -- removals -------------------------------------------------------------

    def announced(self, chunk_hashes: Sequence[str]) -> list[str]:
        """Which of ``chunk_hashes`` this engine announced as stored (any thread)."""
        with self._lock:
            return [h for h in chunk_hashes if h in self._announced]

    def has_announced(self) -> bool:
        with self._lock:
            return bool(self._announced)

    def removed(self, chunk_hashes: Sequence[str]) -> None:
        """These chunks are gone from the store: one ``BlockRemoved`` each that was announced."""
        from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved

        for chunk_hash in chunk_hashes:
            with self._lock:
                block_hashes = self._announced.pop(chunk_hash, None)
            if block_hashes is None:
                continue
            if len(self._queue) >= self.max_queued:
                self.stats.add(kv_events_dropped=1)
                continue
            self._queue.append(BlockRemoved(block_hashes=list(block_hashes), medium=MEDIUM_STORAGE, group_idx=0,
                                            locality=self.locality, ownership=OWNERSHIP))
            self.stats.add(kv_events_removed_blocks=len(block_hashes))

    def take(self) -> list[KVCacheEvent]:
        events = list(self._queue)
        self._queue.clear()
        return events


class RemovalWatcher:
    """Reads gc's new removal records on a thread and confirms with the store which announced chunks are gone."""

    def __init__(
        self,
        log: RemovalLog,
        namespace: str,
        store: KVStore,
        key: Callable[[str], str],
        events: StorageEvents,
        stats: StatsRecorder,
        interval_s: float,
    ) -> None:
        self.log = log
        self.namespace = namespace
        self.store = store
        self.key = key
        self.events = events
        self.stats = stats
        self.interval_s = interval_s
        self._seen: set[str] = set()
        self._confirmed: deque[str] = deque()
        self._stop = threading.Event()
        self._last_error_log = 0.0
        self._thread = threading.Thread(target=self._run, name="dualpath-gc-records", daemon=True)
        self._thread.start()

    def take_removed(self) -> list[str]:
        """Chunk hashes confirmed gone since the last call."""
        taken = []
        while self._confirmed:
            taken.append(self._confirmed.popleft())
        return taken

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as exc:  # the store is down: try again next interval
                now = time.monotonic()
                if now - self._last_error_log > 60.0:
                    self._last_error_log = now
                    logger.warning("reading gc removal records failed: %s", exc)

    def poll(self) -> None:
        """One look at the records: read the unseen ones and confirm the announced chunks they name."""
        keys = self.log.keys(self.namespace)
        new = [k for k in keys if k not in self._seen]
        # Records listed no more were pruned; a key is never reused (time and nonce).
        self._seen.intersection_update(keys)
        if not self.events.has_announced():
            # Nothing announced, nothing to take back: a chunk stored after
            # this record was written is present again anyway.
            self._seen.update(new)
            return
        for key in new:
            try:
                record = self.log.read(key, self.namespace)
            except RecordError as exc:
                self.stats.add(gc_records_rejected=1)
                logger.warning("ignoring gc removal record %s: %s", key, exc)
                self._seen.add(key)
                continue
            if record is not None:
                self._confirm(self.events.announced(record.chunk_hashes))
            self._seen.add(key)

    def _confirm(self, chunk_hashes: list[str]) -> None:
        # The record is a hint; the store is the truth (a chunk may have been stored again since).
        gone = [h for h in chunk_hashes if self.store.lookup([self.key(h)]) == 0]
        self._confirmed.extend(gone)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30.0)
