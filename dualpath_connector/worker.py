"""Worker half: reads hit chunks into the host pool and copies them into the KV cache; saves new chunks.

All bytes between the host pool and the store move through NIXL; between the
pool and the KV cache they move as one indexed tensor copy per layer (a
contiguous copy per block per layer underneath), never in a Python loop.

Loads are asynchronous in vLLM's sense: they run on the I/O thread and the
request is reported in ``finished_recving`` once its KV is in the cache. vLLM
keeps those blocks away from every other request until then, so the I/O
thread may write them while forwards of other requests run.

Saves copy a step's completed chunks out of the KV cache in ``wait_for_save``
of the very step that computed them, before the scheduler can hand the blocks
to anyone else (preemption, finish), and write them to the store on the I/O
thread: the forward never waits on storage, and a reused block is never stored.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from nixl_backends.buffers import HostBufferPool, PoolExhausted
from nixl_backends.layout import BlockLayout, chunk_key
from nixl_backends.store import TransferAbandoned, make_store

from dualpath_connector.config import ChunkGeometry, DualPathConfig, namespace_for
from dualpath_connector.metadata import DualPathMetadata, LoadSpec, SaveSpec
from dualpath_connector.stats import DualPathStats, StatsRecorder

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

_LOAD_PRIORITY, _SAVE_PRIORITY, _STOP_PRIORITY = 0, 1, 2


class _IOThread:
    """One thread runs every NIXL job; loads jump ahead of queued saves."""

    def __init__(self) -> None:
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._run, name="dualpath-io", daemon=True)
        self._thread.start()

    def submit(self, priority: int, job: Callable[[], None]) -> None:
        self._queue.put((priority, next(self._order), job))

    def _run(self) -> None:
        while True:
            priority, _, job = self._queue.get()
            if priority == _STOP_PRIORITY:
                return
            try:
                job()
            except Exception:  # a job reports its own failures; this keeps the thread alive
                logger.exception("dualpath I/O job failed")

    def stop(self, timeout_s: float) -> bool:
        """Finish queued work and stop; False if the thread is still running after ``timeout_s``."""
        # Queued after every pending save, so those still reach the store.
        self.submit(_STOP_PRIORITY, lambda: None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def _physical_block_view(kv: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A uint8 view ``[outer, num_blocks, block_bytes]`` of one layer's KV cache.

    Layouts are accepted as allocated: block-major (``[B, ...]``, CPU) gives
    ``outer == 1`` and one contiguous region per block; K/V-split layouts
    (``[2, B, ...]``) give ``outer == 2``.
    """
    order = sorted(range(kv.dim()), key=lambda d: kv.stride(d), reverse=True)
    physical = kv.permute(order)
    if not physical.is_contiguous():
        raise ValueError(f"KV cache tensor with strides {kv.stride()} is not a permutation of a dense layout")
    block_dims = [d for d, size in enumerate(physical.shape) if size == num_blocks]
    if not block_dims:
        raise ValueError(f"no dimension of size num_blocks={num_blocks} in KV cache shape {tuple(kv.shape)}")
    dim = block_dims[0]
    outer = math.prod(physical.shape[:dim])
    return physical.reshape(outer, num_blocks, -1).view(torch.uint8)


class DualPathWorker:
    def __init__(self, vllm_config: VllmConfig, config: DualPathConfig) -> None:
        from nixl._api import nixl_agent, nixl_agent_config
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        self.config = config
        self.geometry = ChunkGeometry.of(config, vllm_config)
        self.namespace = namespace_for(
            vllm_config, config, self.geometry.chunk_tokens, get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
        )
        self._digest = self.namespace.digest()
        self.layout = BlockLayout(self.namespace.num_layers, self.namespace.layer_block_bytes)
        agent_name = f"dualpath-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = nixl_agent(agent_name, nixl_agent_config(backends=[]))
        # The backend must exist before the pools register memory with the agent.
        self.store = make_store(config.store_config, self.layout, self.agent)
        self.load_pool = HostBufferPool(self.agent, self.layout.full_block_bytes, config.load_buffer_chunks)
        self.save_pool = HostBufferPool(self.agent, self.layout.full_block_bytes, config.save_buffer_chunks)
        self.stats = StatsRecorder()
        self._io = _IOThread()
        self._lock = threading.Lock()
        self._done_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._reported_failed_blocks: set[int] = set()
        self._layers: list[torch.Tensor] = []

    # -- KV cache views -------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != self.layout.num_layers:
            raise ValueError(f"expected {self.layout.num_layers} KV cache layers, got {len(names)}")
        self._layers = [_physical_block_view(kv_caches[name], num_blocks) for name in names]
        outer, _, block_bytes = self._layers[0].shape
        layer_block_bytes = outer * block_bytes * self.geometry.blocks_per_chunk
        if layer_block_bytes != self.layout.layer_block_bytes:
            raise ValueError(
                f"KV cache holds {layer_block_bytes} bytes per layer per chunk, the namespace "
                f"expects {self.layout.layer_block_bytes}: unsupported KV cache layout"
            )
        logger.info(
            "DualPath worker: %d layers, %d-byte Layer Blocks, namespace %s",
            len(names),
            layer_block_bytes,
            self.namespace.digest(),
        )

    def _slot_blocks(self, pool: HostBufferPool) -> torch.Tensor:
        """The pool as ``[slot, layer, sub_block, outer, block_bytes]`` (a view, no copy)."""
        outer, _, block_bytes = self._layers[0].shape
        return torch.from_numpy(pool.array).view(
            pool.num_slots, self.layout.num_layers, self.geometry.blocks_per_chunk, outer, block_bytes
        )

    # -- loads ----------------------------------------------------------------

    def start_load_kv(self, meta: DualPathMetadata) -> None:
        for spec in meta.loads:
            self._io.submit(_LOAD_PRIORITY, lambda spec=spec: self._load(spec))

    def _load(self, spec: LoadSpec) -> None:
        started = time.perf_counter()
        good = 0  # leading chunks whose KV is in the cache
        try:
            slots = self.load_pool.acquire(len(spec.chunks))
            try:
                keys = [self._key(c.chunk_hash) for c in spec.chunks]
                ok = self.store.read(keys, [self.load_pool.slot_addr(s) for s in slots])
            except TransferAbandoned:
                # NIXL may still write these slots: they never return to the pool.
                logger.error("request %s: store read abandoned; %d load slots retired", spec.req_id, len(slots))
                raise
            try:
                # The hit ends at the first bad chunk; later chunks are not used
                # even if they arrived, so the loaded prefix stays contiguous.
                readable = next((i for i, flag in enumerate(ok) if not flag), len(ok))
                self._inject(spec, slots[:readable])
                good = readable
            finally:
                self.load_pool.release(slots)
        except Exception:
            # Whatever went wrong, the request must still be reported, or it
            # would wait in WAITING_FOR_REMOTE_KVS forever.
            logger.exception("request %s: load failed", spec.req_id)
        failed = [b for chunk in spec.chunks[good:] for b in chunk.block_ids]
        loaded_blocks = sum(len(chunk.block_ids) for chunk in spec.chunks[:good])
        if failed:
            logger.warning(
                "request %s: chunk %s unreadable; hit shortened by %d blocks",
                spec.req_id,
                self._key(spec.chunks[good].chunk_hash),
                len(failed),
            )
        self.stats.add(
            loaded_tokens=loaded_blocks * self.geometry.block_size,
            load_failed_tokens=len(failed) * self.geometry.block_size,
            bytes_read=good * self.layout.full_block_bytes,
        )
        self.stats.time("load_seconds", time.perf_counter() - started)
        with self._lock:
            self._failed_blocks.update(failed)
            self._done_loads.add(spec.req_id)

    def _inject(self, spec: LoadSpec, slots: list[int]) -> None:
        if not slots:
            return
        slot_index, sub_index, block_index = [], [], []
        for chunk, slot in zip(spec.chunks, slots):
            for i, block_id in enumerate(chunk.block_ids):
                slot_index.append(slot)
                sub_index.append(chunk.first_sub_block + i)
                block_index.append(block_id)
        slot_t, sub_t, block_t = (torch.tensor(x, dtype=torch.long) for x in (slot_index, sub_index, block_index))
        host = self._slot_blocks(self.load_pool)
        device = self._layers[0].device
        block_t = block_t.to(device)
        for layer, kv in enumerate(self._layers):
            # host[...] is [n, outer, bytes]; the cache view wants [outer, n, bytes].
            kv.index_copy_(1, block_t, host[slot_t, layer, sub_t].transpose(0, 1).to(device))
        if device.type != "cpu":
            # Reported loads must be in the cache, not merely queued on a stream.
            torch.accelerator.synchronize(device)

    def _key(self, chunk_hash: str) -> str:
        return chunk_key(self.config.key_prefix, self._digest, chunk_hash)

    def get_finished(self) -> set[str] | None:
        with self._lock:
            done, self._done_loads = self._done_loads, set()
            # Failed blocks are reported in the same pass as their request.
            self._reported_failed_blocks |= self._failed_blocks
            self._failed_blocks = set()
        return done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        reported, self._reported_failed_blocks = self._reported_failed_blocks, set()
        return reported

    # -- saves ----------------------------------------------------------------

    def wait_for_save(self, meta: DualPathMetadata) -> None:
        for spec in meta.saves:
            try:
                slots = self.save_pool.acquire(len(spec.chunk_hashes))
            except PoolExhausted:
                # Best effort: a dropped save is a future miss, never a stall.
                logger.debug("request %s: save buffer full, skipping %d chunks", spec.req_id, len(spec.chunk_hashes))
                self.stats.add(save_skipped_chunks=len(spec.chunk_hashes))
                continue
            self._copy_out(spec, slots)
            self._io.submit(_SAVE_PRIORITY, lambda spec=spec, slots=slots: self._save(spec, slots))

    def _copy_out(self, spec: SaveSpec, slots: list[int]) -> None:
        bpc = self.geometry.blocks_per_chunk
        slot_t = torch.tensor(slots, dtype=torch.long).repeat_interleave(bpc)
        sub_t = torch.arange(bpc, dtype=torch.long).repeat(len(slots))
        block_t = torch.tensor([b for blocks in spec.block_ids for b in blocks], dtype=torch.long)
        host = self._slot_blocks(self.save_pool)
        block_t = block_t.to(self._layers[0].device)
        for layer, kv in enumerate(self._layers):
            host[slot_t, layer, sub_t] = kv.index_select(1, block_t).transpose(0, 1).cpu()

    def _save(self, spec: SaveSpec, slots: list[int]) -> None:
        started = time.perf_counter()
        keys = [self._key(h) for h in spec.chunk_hashes]
        try:
            ok = self.store.write(keys, [self.save_pool.slot_addr(s) for s in slots])
        except TransferAbandoned:
            # NIXL may still read these slots: they never return to the pool.
            logger.error("request %s: store write abandoned; %d save slots retired", spec.req_id, len(slots))
            ok = [False] * len(keys)
        except Exception:
            logger.exception("request %s: store write failed", spec.req_id)
            ok = [False] * len(keys)
            self.save_pool.release(slots)
        else:
            self.save_pool.release(slots)
        written = sum(ok)
        self.stats.add(
            saved_chunks=written,
            save_skipped_chunks=len(ok) - written,
            bytes_written=written * self.layout.full_block_bytes,
        )
        self.stats.time("save_seconds", time.perf_counter() - started)

    # -- lifecycle ------------------------------------------------------------

    def get_stats(self) -> DualPathStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        if not self._io.stop(timeout_s=60.0):
            # A transfer is still running: its memory stays registered.
            logger.warning("DualPath I/O thread still busy at shutdown; host buffers left registered")
            return
        self.load_pool.close()
        self.save_pool.close()
        self.store.close()
