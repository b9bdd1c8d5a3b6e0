"""Saves: a step's completed chunks leave the KV cache in that step and reach the store on the save lane.

Chunks are copied out in ``wait_for_save`` of the very step that computed
them, before the scheduler can hand their blocks to anyone else (preemption,
finish), so a reused block is never stored; the store write runs on the save
lane, so the forward never waits on storage. Saving is best effort: a full
save buffer or a failed write is a future miss, never a stall. Each object
is sealed with its integrity trailer on the save lane, just before the write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from nixl_backends.buffers import HostBufferPool, PoolExhausted
from nixl_backends.integrity import ChunkIntegrity
from nixl_backends.abandoned import retire_slots
from nixl_backends.store import KVStore, TransferAbandoned

from dualpath_connector.cache.copy_stream import CopyStream, Mark
from dualpath_connector.cache.device_copies import DeviceCopier
from dualpath_connector.lanes.io_lanes import IOLane
from dualpath_connector.cache.kv_cache_view import KVCacheView
from dualpath_connector.metadata import SaveSpec
from dualpath_connector.protocol import StoreKeySpace
from dualpath_connector.metrics.stats_recorder import StatsRecorder

logger = logging.getLogger(__name__)


class ChunkSaver:
    def __init__(
        self,
        *,
        view: KVCacheView,
        pool: HostBufferPool,
        store: KVStore,
        key_space: StoreKeySpace,
        integrity: ChunkIntegrity,
        blocks_per_chunk: int,
        lane: IOLane,
        stats: StatsRecorder,
        save_stream: CopyStream | None = None,
        on_written: Callable[[list[str], list[bool]], None] | None = None,
    ) -> None:
        self.view = view
        self.pool = pool
        self.store = store
        self.key_space = key_space
        self.integrity = integrity
        self.blocks_per_chunk = blocks_per_chunk
        self.lane = lane
        self.stats = stats
        # Told which chunks each write stored (True) or not, once it finished and its stats are recorded
        # (KV events; the scheduler's count of writes in flight).
        self.on_written = on_written
        self._host = view.host_blocks(pool.array, pool.num_slots, blocks_per_chunk)
        self.device = DeviceCopier(view, self._host, save_stream) if save_stream is not None else None

    def save(self, specs: list[SaveSpec]) -> None:
        """Copy each spec's chunks out now; write them to the store on the save lane."""
        for spec in specs:
            try:
                slots = self.pool.acquire(len(spec.chunk_hashes))
            except PoolExhausted:
                logger.debug("request %s: save buffer full, skipping %d chunks", spec.req_id, len(spec.chunk_hashes))
                self.stats.add(save_skipped_chunks=len(spec.chunk_hashes))
                self._written(spec, [False] * len(spec.chunk_hashes))
                continue
            bpc = self.blocks_per_chunk
            plan = self.view.plan(
                np.repeat(slots, bpc), np.tile(np.arange(bpc), len(slots)), np.ravel(spec.block_ids),
                on_device=self.device is None,
            )  # fmt: skip
            copied = None
            if self.device is not None:
                copied = self.device.post_saves(plan)
            else:
                self.view.copy_out(self._host, plan)
            self.lane.submit(lambda spec=spec, slots=slots, copied=copied: self._write(spec, slots, copied))

    def _write(self, spec: SaveSpec, slots: list[int], copied: Mark | None) -> None:
        started = time.perf_counter()
        if copied is not None:
            copied.wait()  # the device's copies into these slots (on this lane, never the forward)
        keys = [self.key_space.key(h) for h in spec.chunk_hashes]
        for chunk_hash, slot in zip(spec.chunk_hashes, slots):
            self.integrity.seal(self.key_space.object_hash(chunk_hash), self.pool.slot_view(slot))
        present = 0
        try:
            ok, present = self._write_keys(spec, keys, slots)
        except TransferAbandoned as exc:
            retire_slots(exc, self.pool, slots, f"request {spec.req_id}: a write")  # NIXL may still read them
            ok = [False] * len(keys)
        except Exception:
            logger.exception("request %s: store write failed", spec.req_id)
            ok = [False] * len(keys)
            self.pool.release(slots)
        else:
            self.pool.release(slots)
        written = sum(ok) - present
        self.stats.add(
            saved_chunks=written,
            save_skipped_chunks=len(ok) - written - present,
            bytes_written=written * self.key_space.layout.full_block_bytes,
        )
        self.stats.sample("save_seconds", time.perf_counter() - started)
        # Last: once told, the engine may go idle, so the stats above must already be recorded.
        self._written(spec, ok)

    def _write_keys(self, spec: SaveSpec, keys: list[str], slots: list[int]) -> tuple[list[bool], int]:
        """The store write: which chunks are stored, and how many of them already were (``only_missing``:
        only the chunks the store lacks are written)."""
        todo = list(range(len(keys)))
        if spec.only_missing:
            todo = [i for i in todo if not self.store.lookup([keys[i]])]
        present = len(keys) - len(todo)
        self.stats.add(resave_present_chunks=present)
        ok = [True] * len(keys)
        written = self.store.write([keys[i] for i in todo], [self.pool.slot_addr(slots[i]) for i in todo]) if todo else []
        for i, result in zip(todo, written):
            ok[i] = result
        return ok, present

    def _written(self, spec: SaveSpec, ok: list[bool]) -> None:
        if self.on_written is not None:
            self.on_written(spec.chunk_hashes, ok)
