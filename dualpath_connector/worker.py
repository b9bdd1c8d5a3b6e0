"""Worker half: reads hit chunks, moves them into the KV cache, saves new chunks; PD transfers.

All bytes between host buffers and the store, and between engines, move
through NIXL; between a host buffer and the KV cache they move as one indexed
tensor copy per layer, never in a Python loop.

NIXL jobs run on three I/O lanes, one thread each, because they use three
different links and must not wait for each other: store reads (the storage
NIC's receive side), store writes (its send side) and pulls between engines
(the compute network). On one thread a DE's reads for a PE held up its saves
and its pulls of prefilled prompts, and the agents' next turns waited for them.

Loads are asynchronous in vLLM's sense. The *read* runs on the read lane:
from the store into this engine's pool (read side ``pe``), or, asked over the
side channel, by the DE into its own pool (read side ``de``); a DE that does
not answer in time makes this engine read the store itself. The *injection*
into the KV cache then depends on ``load_mode``:

- ``bulk``: on the thread that read it, every layer at once, before the load is reported;
- ``layerwise``: the load is reported as soon as the bytes sit in a buffer, and
  the next forward injects layer ``l`` of every such hit right before attention
  layer ``l`` (a local indexed copy, or a NIXL READ from the DE's buffer posted
  for all layers at the first one, so later layers move while earlier ones
  compute). vLLM schedules a loaded request only after the report, so no
  attention layer reads a block before its layer is in; a request that ends
  before that forward has its injection dropped.

PD roles: a DE pulls a prefilled prompt's blocks straight from the PE's KV
cache (NIXL READ, whose completion notifies the PE to free them); the PE holds
them until then or until the lease expires (:mod:`dualpath_connector.peer`).

Saves copy a step's completed chunks out of the KV cache in ``wait_for_save``
of the very step that computed them, before the scheduler can hand the blocks
to anyone else (preemption, finish), and write them to the store on the save
lane: the forward never waits on storage, and a reused block is never stored.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nixl_backends.buffers import HostBufferPool, PoolExhausted
from nixl_backends.layout import BlockLayout, chunk_key
from nixl_backends.registry import make_store
from nixl_backends.store import TransferAbandoned
from nixl_backends.transport import UCX, PeerRead, add_ucx_backend, mem_type, post_read

from dualpath_connector.affinity import kv_transfer_cores, pin_current_thread, threads_started_on
from dualpath_connector.config import ChunkGeometry, DualPathConfig, namespace_for
from dualpath_connector.metadata import ChunkLoad, DualPathMetadata, LoadSpec, PullSpec, SaveSpec
from dualpath_connector.peer import PULLED, RELEASE, PeerKV, PeerLink
from dualpath_connector.read_queue import StoreReadQueue
from dualpath_connector.side_channel import PeerBusy
from dualpath_connector.stats import DualPathStats, StatsRecorder

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

# A repair blocks a forward, so it jumps its lane's queue.
_REPAIR_PRIORITY, _JOB_PRIORITY, _STOP_PRIORITY = -1, 0, 1


class _IOLane:
    """One thread that runs NIXL jobs in order (repairs first)."""

    def __init__(self, name: str, cores: set[int] | None) -> None:
        self.name = name
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._cores = cores
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], priority: int = _JOB_PRIORITY) -> None:
        self._queue.put((priority, next(self._order), job))

    def _run(self) -> None:
        pin_current_thread(self._cores)
        while True:
            priority, _, job = self._queue.get()
            if priority == _STOP_PRIORITY:
                return
            try:
                job()
            except Exception:  # a job reports its own failures; this keeps the thread alive
                logger.exception("%s job failed", self.name)

    def stop(self, timeout_s: float) -> bool:
        """Finish queued work and stop; False if the thread is still running after ``timeout_s``."""
        # Queued after every pending job, so pending saves still reach the store.
        self.submit(lambda: None, _STOP_PRIORITY)
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


def _rows(addrs: np.ndarray, length: int, device_id: int) -> np.ndarray:
    """Nx3 NIXL descriptor rows ``(addr, length, device)`` for every address in ``addrs``."""
    flat = addrs.reshape(-1)
    rows = np.empty((flat.size, 3), dtype=np.uint64)
    rows[:, 0] = flat
    rows[:, 1] = length
    rows[:, 2] = device_id
    return rows


@dataclass
class _RemoteBuffer:
    """Hit chunks a DE read into its host buffer, leased to this engine until released."""

    address: str
    peer: PeerKV
    lease: str
    chunk_addrs: list[int]


@dataclass
class _LoadedHit:
    """A hit whose leading readable chunks sit in a host buffer: this engine's pool slots, or a DE's."""

    req_id: str
    chunks: list[ChunkLoad]
    slots: list[int] = field(default_factory=list)
    remote: _RemoteBuffer | None = None


class _Injection:
    """One forward's layerwise injection of every loaded hit.

    Local hits are copied layer by layer as each attention layer asks; remote
    hits have every layer's READ posted at the first layer, so later layers
    move over the network while earlier layers compute.
    """

    def __init__(self, worker: DualPathWorker, hits: list[_LoadedHit]) -> None:
        self.worker = worker
        self.local = [h for h in hits if h.remote is None]
        self.remote = [h for h in hits if h.remote is not None]
        self.reads = {id(h): worker._post_remote_reads(h) for h in self.remote}
        self.plan = worker._copy_plan(self.local)

    def layer(self, layer: int) -> None:
        for hit in list(self.remote):
            reads = self.reads[id(hit)]
            if reads is None or not reads[layer].wait(self.worker.config.pd_transfer_timeout_s):
                # Earlier layers are in; this one onwards come from the store here.
                self.worker._repair_from_store(hit)
                self.remote.remove(hit)
                self.local.append(hit)
                self.plan = self.worker._copy_plan(self.local)
        self.worker._copy_in(self.plan, [layer])

    def finish(self) -> None:
        for hit in self.remote:
            self.worker._end_remote(hit)
        self.worker._release_hits(self.local)


class DualPathWorker:
    def __init__(self, vllm_config: VllmConfig, config: DualPathConfig, kv_role: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        self.config = config
        self.kv_role = kv_role
        self.geometry = ChunkGeometry.of(config, vllm_config)
        self.namespace = namespace_for(
            vllm_config, config, self.geometry.chunk_tokens, get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
        )
        self._digest = self.namespace.digest()
        self.layout = BlockLayout(self.namespace.num_layers, self.namespace.layer_block_bytes)
        agent_name = f"dualpath-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # The I/O lanes, the side channel and (layerwise) the forward all use
        # the agent. No progress thread: NIXL's spins on a core for good, and
        # polling a transfer or the notifications (the side channel's tick)
        # makes progress as well.
        self._transfer_cores = kv_transfer_cores(vllm_config.device_config.device_type)
        with threads_started_on(self._transfer_cores):
            self.agent = nixl_agent(
                agent_name,
                nixl_agent_config(
                    enable_prog_thread=False, backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
                ),
            )
            if kv_role != "kv_both":
                # Before any registration: pools and KV cache must be readable by peers.
                add_ucx_backend(self.agent)
            # The backend must exist before the pools register memory with the agent.
            self.store = make_store(config.store_config, self.layout, self.agent)
            self.load_pool = HostBufferPool(self.agent, self.layout.full_block_bytes, config.load_buffer_chunks)
            self.save_pool = HostBufferPool(self.agent, self.layout.full_block_bytes, config.save_buffer_chunks)
        self.stats = StatsRecorder()
        self.peers: PeerLink | None = None
        self._reads = _IOLane("dualpath-read", self._transfer_cores)
        self._saves = _IOLane("dualpath-save", self._transfer_cores)
        self._pulls = _IOLane("dualpath-pull", self._transfer_cores)
        # PE: threads that wait for DEs to read hits (one per read in flight, up to this many).
        self._de_reads = ThreadPoolExecutor(
            max_workers=8,
            thread_name_prefix="dualpath-de-read",
            initializer=pin_current_thread,
            initargs=(self._transfer_cores,),
        )
        self._lock = threading.Lock()
        self._done_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._reported_failed_blocks: set[int] = set()
        # Layerwise: hits read and reported, waiting for the next forward.
        self._loaded: list[_LoadedHit] = []
        # Loads submitted and not yet injected or failed; and those of them whose request ended.
        self._in_flight: set[str] = set()
        self._dropped: set[str] = set()
        self._injection: _Injection | None = None
        self.read_queue = StoreReadQueue()
        self._layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._kv_registration = None

    # -- KV cache views -------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != self.layout.num_layers:
            raise ValueError(f"expected {self.layout.num_layers} KV cache layers, got {len(names)}")
        self._layers = [_physical_block_view(kv_caches[name], num_blocks) for name in names]
        self._layer_index = {name: i for i, name in enumerate(names)}
        outer, _, block_bytes = self._layers[0].shape
        layer_block_bytes = outer * block_bytes * self.geometry.blocks_per_chunk
        if layer_block_bytes != self.layout.layer_block_bytes:
            raise ValueError(
                f"KV cache holds {layer_block_bytes} bytes per layer per chunk, the namespace "
                f"expects {self.layout.layer_block_bytes}: unsupported KV cache layout"
            )
        if self.kv_role != "kv_both":
            kv = self.local_kv()
            regions = [(addr, kv["outer"] * kv["outer_stride"], kv["device_id"], "") for addr in kv["layer_addrs"]]
            self._kv_registration = self.agent.register_memory(regions, kv["mem_type"], backends=[UCX])
            self.peers = PeerLink(
                self.agent,
                self.config.side_channel_host,
                self.config.side_channel_port,
                self._digest,
                self.local_kv,
                self._serve_read,
                self.config.pd_lease_s,
                self._transfer_cores,
            )
        logger.info(
            "DualPath worker (%s, %s): %d layers, %d-byte Layer Blocks, namespace %s",
            self.kv_role,
            self.config.load_mode,
            len(names),
            layer_block_bytes,
            self._digest,
        )

    def local_kv(self) -> dict[str, Any]:
        """Where this engine's KV cache lives, as peers need it to READ blocks (see :class:`PeerKV`)."""
        first = self._layers[0]
        return {
            "layer_addrs": [kv.data_ptr() for kv in self._layers],
            "outer": first.shape[0],
            "outer_stride": first.stride(0),
            "block_bytes": first.shape[2],
            "mem_type": mem_type(first.device.type),
            "device_id": first.device.index or 0,
        }

    def _slot_blocks(self, pool: HostBufferPool) -> torch.Tensor:
        """The pool as ``[slot, layer, sub_block, outer, block_bytes]`` (a view, no copy)."""
        outer, _, block_bytes = self._layers[0].shape
        return torch.from_numpy(pool.array).view(
            pool.num_slots, self.layout.num_layers, self.geometry.blocks_per_chunk, outer, block_bytes
        )

    def _kv_rows(self, kv: PeerKV | dict[str, Any], layers: list[int], block_ids: np.ndarray) -> np.ndarray:
        """NIXL rows of KV cache blocks, ordered layer, block, outer."""
        get = kv.get if isinstance(kv, dict) else lambda name: getattr(kv, name)
        bases = np.asarray(get("layer_addrs"), dtype=np.uint64)[layers]
        outer = np.arange(get("outer"), dtype=np.uint64) * np.uint64(get("outer_stride"))
        addrs = bases[:, None, None] + block_ids.astype(np.uint64)[None, :, None] * np.uint64(get("block_bytes")) + outer
        return _rows(addrs, get("block_bytes"), get("device_id"))

    def _buffer_rows(self, chunk_addrs: list[int], chunks: list[ChunkLoad], layers: list[int]) -> np.ndarray:
        """NIXL rows of hit blocks inside Full Blocks at ``chunk_addrs``, ordered like :meth:`_kv_rows`."""
        outer, _, block_bytes = self._layers[0].shape
        first = np.asarray(
            [addr + (c.first_sub_block + i) * outer * block_bytes for c, addr in zip(chunks, chunk_addrs) for i in range(len(c.block_ids))],
            dtype=np.uint64,
        )  # fmt: skip
        layer_offsets = np.asarray(layers, dtype=np.uint64) * np.uint64(self.layout.layer_block_bytes)
        outer_offsets = np.arange(outer, dtype=np.uint64) * np.uint64(block_bytes)
        return _rows(layer_offsets[:, None, None] + first[None, :, None] + outer_offsets, block_bytes, 0)

    @staticmethod
    def _block_ids(chunks: list[ChunkLoad]) -> np.ndarray:
        return np.asarray([b for c in chunks for b in c.block_ids], dtype=np.int64)

    # -- loads: reading hits ----------------------------------------------------

    def start_load_kv(self, meta: DualPathMetadata) -> None:
        self._note_ended(meta)
        for send in meta.sends:
            self.peers.hold(send.req_id, send.expires_at)
        for spec in meta.loads:
            with self._lock:
                self._in_flight.add(spec.req_id)
            if self.config.benchmark_oracle:
                self._load_nothing(spec)
            elif spec.read_side == "de":
                # Not on the read lane: waiting for a DE must not hold up this
                # engine's own store reads, or the two sides would take turns.
                self._de_reads.submit(self._load_through_de, spec, time.perf_counter())
            else:
                self._queue_local_read(spec, time.perf_counter())
        for pull in meta.pulls:
            self._pulls.submit(lambda pull=pull: self._pull(pull))

    def _spec_tokens(self, spec: LoadSpec) -> int:
        return sum(len(c.block_ids) for c in spec.chunks) * self.geometry.block_size

    def _count_read_queue(self, tokens: int) -> None:
        self.stats.gauge(read_queue_tokens=self.read_queue.add(tokens))

    def _note_ended(self, meta: DualPathMetadata) -> None:
        """Requests that ended: a hit of theirs not yet injected must never be."""
        with self._lock:
            self._dropped.update(r for r in meta.dropped_req_ids if r in self._in_flight)
            dropped = [h for h in self._loaded if h.req_id in self._dropped]
            self._loaded = [h for h in self._loaded if h.req_id not in self._dropped]
        self._release_hits(dropped)

    def _load_nothing(self, spec: LoadSpec) -> None:
        """benchmark_oracle: the hit counts as loaded; no byte is read or moved."""
        self.stats.add(loaded_tokens=self._spec_tokens(spec))
        with self._lock:
            self._in_flight.discard(spec.req_id)
            self._done_loads.add(spec.req_id)

    def _queue_local_read(self, spec: LoadSpec, started: float) -> None:
        # The read queue is what the router balances: tokens this engine has
        # yet to read from the store, counted from the moment they queue.
        tokens = self._spec_tokens(spec)
        self._count_read_queue(tokens)

        def job() -> None:
            try:
                hit = self._guarded_read(spec, lambda: self._read_here(spec))
            finally:
                self._count_read_queue(-tokens)
            self._finish_load(spec, hit, started)

        self._reads.submit(job)

    def _load_through_de(self, spec: LoadSpec, started: float) -> None:
        hit = self._guarded_read(spec, lambda: self._read_through_de(spec))
        if hit is None:
            self._queue_local_read(spec, started)
        else:
            self._finish_load(spec, hit, started)

    def _guarded_read(self, spec: LoadSpec, read: Callable[[], _LoadedHit | None]) -> _LoadedHit | None:
        """``read()``, injected at once in bulk mode; a failure is an empty hit (recompute), None is read()'s."""
        try:
            hit = read()
            if hit is not None and self.config.load_mode == "bulk":
                self._inject_whole(hit)
            return hit
        except Exception:
            # Whatever went wrong, the request must still be reported, or it
            # would wait in WAITING_FOR_REMOTE_KVS forever.
            logger.exception("request %s: load failed", spec.req_id)
            return _LoadedHit(spec.req_id, [])

    def _finish_load(self, spec: LoadSpec, hit: _LoadedHit, started: float) -> None:
        good = len(hit.chunks)
        failed = [b for chunk in spec.chunks[good:] for b in chunk.block_ids]
        if failed:
            logger.warning(
                "request %s: chunk %s unreadable; hit shortened by %d blocks",
                spec.req_id,
                self._key(spec.chunks[good].chunk_hash),
                len(failed),
            )
        loaded_blocks = sum(len(chunk.block_ids) for chunk in spec.chunks[:good])
        self.stats.add(
            loaded_tokens=loaded_blocks * self.geometry.block_size,
            load_failed_tokens=len(failed) * self.geometry.block_size,
        )
        self.stats.time("load_seconds", time.perf_counter() - started)
        with self._lock:
            dropped = spec.req_id in self._dropped
            if self.config.load_mode == "layerwise" and hit.chunks and not dropped:
                self._loaded.append(hit)
            else:
                self._in_flight.discard(spec.req_id)
                self._dropped.discard(spec.req_id)
            self._failed_blocks.update(failed)
            self._done_loads.add(spec.req_id)
        if dropped and self.config.load_mode == "layerwise":
            self._release_hits([hit])

    def _read_here(self, spec: LoadSpec) -> _LoadedHit:
        """Read the hit from the store into this engine's pool; the leading readable chunks."""
        slots = self.load_pool.acquire(len(spec.chunks))
        try:
            ok = self._store_read([c.chunk_hash for c in spec.chunks], slots)
        except TransferAbandoned:
            # NIXL may still write these slots: they never return to the pool.
            logger.error("request %s: store read abandoned; %d load slots retired", spec.req_id, len(slots))
            raise
        except BaseException:
            self.load_pool.release(slots)
            raise
        # The hit ends at the first bad chunk; later chunks are not used even
        # if they arrived, so the loaded prefix stays contiguous.
        readable = next((i for i, flag in enumerate(ok) if not flag), len(ok))
        self.load_pool.release(slots[readable:])
        self.stats.add(bytes_read=readable * self.layout.full_block_bytes)
        return _LoadedHit(spec.req_id, spec.chunks[:readable], slots=slots[:readable])

    def _store_read(self, chunk_hashes: list[str], slots: list[int]) -> list[bool]:
        """Read chunks into load-pool slots; the time it took feeds the read-rate estimate."""
        started = time.perf_counter()
        ok = self.store.read([self._key(h) for h in chunk_hashes], [self.load_pool.slot_addr(s) for s in slots])
        self.read_queue.record_read(sum(ok) * self.geometry.chunk_tokens, time.perf_counter() - started)
        return ok

    def _read_through_de(self, spec: LoadSpec) -> _LoadedHit | None:
        """Ask the DE to read the hit into its buffer; None if it cannot (then this engine reads)."""
        address = spec.de_side_channel
        timeout_s = self.config.de_read_timeout_s
        try:
            peer = self.peers.peer(address, timeout_s)
            answer = PeerLink.read_request(address, self._digest, [c.chunk_hash for c in spec.chunks], timeout_s)
        except PeerBusy as exc:
            # Declined at once (the DE counts it): no time lost, and the peer is healthy.
            logger.info("request %s: %s; reading the hit here", spec.req_id, exc)
            return None
        except Exception as exc:
            logger.warning("request %s: DE %s did not read the hit (%s); reading it here", spec.req_id, address, exc)
            self.peers.forget(address)
            self.stats.add(de_read_fallbacks=1)
            return None
        readable = int(answer["readable"])
        if not readable:
            return _LoadedHit(spec.req_id, [])
        remote = _RemoteBuffer(address, peer, answer["lease"], [int(a) for a in answer["chunk_addrs"]])
        return _LoadedHit(spec.req_id, spec.chunks[:readable], remote=remote)

    def _serve_read(self, chunk_hashes: list[str], deadline_s: float, reply: Callable[[dict[str, Any]], None]) -> None:
        """DE side: a PE asked this engine to read a hit into its buffer within ``deadline_s`` (side-channel thread)."""
        tokens = len(chunk_hashes) * self.geometry.chunk_tokens
        reason = self.read_queue.decline_reason(tokens, deadline_s)
        if reason is not None:
            self._decline_read(reason, reply)
            return
        self._count_read_queue(tokens)
        received = time.monotonic()

        def job() -> None:
            try:
                # The estimate at arrival can be off (reads slowed down): a read
                # that can no longer end in time is not started, so the PE
                # reads it once, itself, rather than both sides reading it.
                late = self.read_queue.decline_reason(tokens, deadline_s - (time.monotonic() - received), 0)
                if late is not None:
                    self._decline_read(late, reply)
                else:
                    reply(self._read_for_peer(chunk_hashes))
            finally:
                self._count_read_queue(-tokens)

        self._reads.submit(job)

    def _decline_read(self, reason: str, reply: Callable[[dict[str, Any]], None]) -> None:
        self.stats.add(de_reads_declined=1)
        reply({"error": reason, "busy": True})

    def _read_for_peer(self, chunk_hashes: list[str]) -> dict[str, Any]:
        try:
            slots = self.load_pool.acquire(len(chunk_hashes))
        except PoolExhausted:
            return {"error": f"host buffer has no room for {len(chunk_hashes)} chunks"}
        try:
            ok = self._store_read(chunk_hashes, slots)
        except TransferAbandoned:
            logger.error("store read for a peer abandoned; %d load slots retired", len(slots))
            return {"error": "store read timed out"}
        except Exception as exc:
            self.load_pool.release(slots)
            return {"error": f"store read failed: {exc}"}
        readable = next((i for i, flag in enumerate(ok) if not flag), len(ok))
        self.load_pool.release(slots[readable:])
        nbytes = readable * self.layout.full_block_bytes
        self.stats.add(bytes_read=nbytes, bytes_read_for_peer=nbytes)
        return {
            "readable": readable,
            "lease": self.peers.lease(self.load_pool, slots[:readable]) if readable else None,
            "chunk_addrs": [self.load_pool.slot_addr(s) for s in slots[:readable]],
        }

    # -- loads: injecting hits into the KV cache ------------------------------

    def _inject_whole(self, hit: _LoadedHit) -> None:
        """Bulk mode, on the thread that read the hit: every layer now, then the buffer is free."""
        if hit.remote is not None:
            reads = self._post_remote_reads(hit)
            if reads is not None and all(r.wait(self.config.pd_transfer_timeout_s) for r in reads):
                self._end_remote(hit)
                return
            self._repair_from_store(hit)
        try:
            self._copy_in(self._copy_plan([hit]), list(range(self.layout.num_layers)))
        finally:
            self._release_hits([hit])

    def _post_remote_reads(self, hit: _LoadedHit) -> list[PeerRead] | None:
        """One READ per layer from the DE's buffer straight into the KV cache; None if NIXL refuses."""
        remote = hit.remote
        block_ids = self._block_ids(hit.chunks)
        local_type = mem_type(self._layers[0].device.type)
        try:
            return [
                post_read(
                    self.agent,
                    remote.peer.agent,
                    self._kv_rows(self.local_kv(), [layer], block_ids),
                    local_type,
                    self._buffer_rows(remote.chunk_addrs, hit.chunks, [layer]),
                    "DRAM",
                )
                for layer in range(self.layout.num_layers)
            ]
        except Exception as exc:
            logger.warning("request %s: cannot READ from DE %s: %s", hit.req_id, remote.address, exc)
            return None

    def _end_remote(self, hit: _LoadedHit) -> None:
        """Every layer of a DE-read hit arrived: count it and hand the DE its buffer back."""
        self.stats.add(bytes_pulled_from_peer=len(hit.chunks) * self.layout.full_block_bytes)
        self._release_hits([hit])

    def _repair_from_store(self, hit: _LoadedHit) -> None:
        """A READ from the DE failed after the hit was reported: read the same chunks here.

        Runs on the read lane and waits for it. On the forward thread
        (layerwise) this stalls the step, but the KV must be right before
        attention runs; a store that cannot serve it either leaves no correct
        answer, so that is an error.
        """
        remote, hit.remote = hit.remote, None
        logger.warning("request %s: READ from DE %s failed; reading the hit from the store here", hit.req_id, remote.address)
        self.peers.forget(remote.address)
        self.stats.add(de_read_fallbacks=1)
        done = threading.Event()
        result: list[_LoadedHit] = []

        def job() -> None:
            try:
                result.append(self._read_here(LoadSpec(hit.req_id, hit.chunks)))
            finally:
                done.set()

        self._reads.submit(job, _REPAIR_PRIORITY)
        done.wait()
        if not result or len(result[0].chunks) != len(hit.chunks):
            if result:
                self._release_hits(result)
            raise RuntimeError(f"request {hit.req_id}: hit KV lost with its DE and unreadable from the store")
        hit.slots = result[0].slots

    def _copy_plan(self, hits: list[_LoadedHit]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Index tensors (pool slot, sub-block, KV block) of every block of hits held in this engine's pool."""
        slot_index, sub_index, block_index = [], [], []
        for hit in hits:
            for chunk, slot in zip(hit.chunks, hit.slots):
                for i, block_id in enumerate(chunk.block_ids):
                    slot_index.append(slot)
                    sub_index.append(chunk.first_sub_block + i)
                    block_index.append(block_id)
        if not block_index:
            return None
        slot_t, sub_t, block_t = (torch.tensor(x, dtype=torch.long) for x in (slot_index, sub_index, block_index))
        return slot_t, sub_t, block_t.to(self._layers[0].device)

    def _copy_in(self, plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, layers: list[int]) -> None:
        """Copy ``layers`` of the planned blocks from the pool into the KV cache."""
        if plan is None:
            return
        slot_t, sub_t, block_t = plan
        host = self._slot_blocks(self.load_pool)
        device = self._layers[0].device
        for layer in layers:
            # host[...] is [n, outer, bytes]; the cache view wants [outer, n, bytes].
            self._layers[layer].index_copy_(1, block_t, host[slot_t, layer, sub_t].transpose(0, 1).to(device))
        if device.type != "cpu":
            # The KV must be in the cache, not merely queued on a stream.
            torch.accelerator.synchronize(device)

    def _release_hits(self, hits: list[_LoadedHit]) -> None:
        for hit in hits:
            if hit.remote is not None:
                self.peers.notify(hit.remote.peer.agent, RELEASE + hit.remote.lease.encode())
            if hit.slots:
                self.load_pool.release(hit.slots)
                hit.slots = []
            with self._lock:
                self._in_flight.discard(hit.req_id)
                self._dropped.discard(hit.req_id)

    def wait_for_layer_load(self, layer_name: str, meta: DualPathMetadata) -> None:
        """Layerwise: before attention layer ``l`` runs, layer ``l`` of every loaded hit is in the cache."""
        if self.config.load_mode != "layerwise":
            return
        layer = self._layer_index[layer_name]
        if layer == 0:
            # Only here: a hit that turns up later in this forward would miss
            # the layers already run, so it waits for the next forward (vLLM
            # cannot schedule it before it is reported after this one).
            self._finish_injection()
            self._note_ended(meta)
            with self._lock:
                hits, self._loaded = self._loaded, []
            self._injection = _Injection(self, hits) if hits else None
        if self._injection is None:
            return
        self._injection.layer(layer)
        if layer == self.layout.num_layers - 1:
            self._finish_injection()

    def _finish_injection(self) -> None:
        injection, self._injection = self._injection, None
        if injection is not None:
            injection.finish()

    def _key(self, chunk_hash: str) -> str:
        return chunk_key(self.config.key_prefix, self._digest, chunk_hash)

    # -- PD: the DE pulls a prefilled prompt from its PE -----------------------

    def _pull(self, spec: PullSpec) -> None:
        started = time.perf_counter()
        address = spec.remote_side_channel
        notification = PULLED + spec.remote_req_id.encode()
        ok = False
        try:
            peer = self.peers.peer(address, self.config.pd_transfer_timeout_s)
            if not spec.block_ids:
                # Nothing to copy: only the PE's blocks to release.
                self.peers.notify(peer.agent, notification)
                return
            if len(spec.remote_block_ids) == len(spec.block_ids) and self._same_block_geometry(peer):
                layers = list(range(self.layout.num_layers))
                read = post_read(
                    self.agent,
                    peer.agent,
                    self._kv_rows(self.local_kv(), layers, np.asarray(spec.block_ids)),
                    mem_type(self._layers[0].device.type),
                    self._kv_rows(peer, layers, np.asarray(spec.remote_block_ids)),
                    peer.mem_type,
                    notification,
                )
                ok = read.wait(self.config.pd_transfer_timeout_s)
        except Exception as exc:
            logger.warning("request %s: pulling its prompt KV from PE %s failed: %s", spec.req_id, address, exc)
        if not spec.block_ids:
            return
        if ok:
            self.stats.add(
                bytes_pulled_from_peer=len(spec.block_ids) * self.layout.layer_block_bytes
                * self.layout.num_layers // self.geometry.blocks_per_chunk,
                pulled_tokens=len(spec.block_ids) * self.geometry.block_size,
            )  # fmt: skip
        else:
            self.peers.forget(address)
            logger.warning("request %s: prompt KV not pulled from PE %s; recomputing it", spec.req_id, address)
        self.stats.time("pull_seconds", time.perf_counter() - started)
        with self._lock:
            if not ok:
                self._failed_blocks.update(spec.block_ids)
            self._done_loads.add(spec.req_id)

    def _same_block_geometry(self, peer: PeerKV) -> bool:
        outer, _, block_bytes = self._layers[0].shape
        if (peer.outer, peer.block_bytes, len(peer.layer_addrs)) != (outer, block_bytes, len(self._layers)):
            logger.warning("PE %s has another KV block geometry; prompts from it are recomputed", peer.agent)
            return False
        return True

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        sending = self.peers.take_released_holds() if self.peers is not None else set()
        with self._lock:
            done, self._done_loads = self._done_loads, set()
            # Failed blocks are reported in the same pass as their request.
            self._reported_failed_blocks |= self._failed_blocks
            self._failed_blocks = set()
        return sending or None, done or None

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
            self._saves.submit(lambda spec=spec, slots=slots: self._save(spec, slots))

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
        self._de_reads.shutdown(wait=True, cancel_futures=True)
        if self.peers is not None:
            self.peers.close()
        busy = [lane.name for lane in (self._reads, self._pulls, self._saves) if not lane.stop(timeout_s=60.0)]
        if busy:
            # A transfer is still running: its memory stays registered.
            logger.warning("DualPath I/O lanes %s still busy at shutdown; host buffers left registered", busy)
            return
        if self._kv_registration is not None:
            self.agent.deregister_memory(self._kv_registration, backends=[UCX])
        self.load_pool.close()
        self.save_pool.close()
        self.store.close()
