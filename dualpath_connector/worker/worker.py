"""Worker half: vLLM's worker hooks and the bookkeeping of loads, over objects that own each concern.

The concerns live in their own modules; this one wires them up and keeps
what vLLM asks back (``get_finished``, ``get_block_ids_with_load_errors``):

- :mod:`~dualpath_connector.cache.kv_cache_view`: the KV cache as physical blocks, copies in and out;
- :mod:`~dualpath_connector.load.fetch`: hits read here, through the DE, or (on a DE) for a PE;
- :mod:`~dualpath_connector.load.inject`: hit bytes into the KV cache, in bulk or layer by layer;
- :mod:`~dualpath_connector.pd.pulls`: a DE pulls a prefilled prompt from its PE;
- :mod:`~dualpath_connector.save.saves`: completed chunks out of the cache and into the store;
- :mod:`~dualpath_connector.lanes.io_lanes`: one lane per link (store reads, store writes, pulls);
- :mod:`~dualpath_connector.pd.peer`: the PD side channel, holds and leases.

Loads are asynchronous in vLLM's sense. In ``bulk`` mode a hit is injected on
the thread that read it, before the load is reported. In ``layerwise`` mode
it is reported as soon as its bytes sit in a buffer, and the next forward
injects it layer by layer; vLLM schedules a loaded request only after the
report, so no attention layer reads a block before its layer is in, and a
request that ends before that forward has its injection dropped. With a
store that delivers per layer (s3agg) the report comes once layer 0 landed,
and the forward waits for each later layer as it reaches it
(:mod:`~dualpath_connector.load.arrivals`); the per-layer compute time it measures
(:mod:`~dualpath_connector.worker.compute_window`) is declared to that store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING

import torch

from nixl_backends.abandoned import process_held_bytes
from nixl_backends.buffers import HostBufferPool
from nixl_backends.integrity import ChunkIntegrity
from nixl_backends.registry import for_rank, make_store
from nixl_backends.transport import UCX, add_ucx_backend

from dualpath_connector.lanes.affinity import kv_transfer_cores, threads_started_on
from dualpath_connector.worker.compute_window import ComputeWindow
from dualpath_connector.cache.copy_stream import CudaCopyStream, pinned
from dualpath_connector.config import (
    TRANSPORT_WHERE,
    ChunkGeometry,
    DualPathConfig,
    kv_events_enabled,
    namespace_for,
)
from dualpath_connector.load.inject import Injector, LayerwiseInjection
from dualpath_connector.lanes.io_lanes import IOLane
from dualpath_connector.cache.kv_cache_view import KVCacheView
from dualpath_connector.metadata import DualPathMetadata, LoadSpec, PullSpec, SavedChunks
from dualpath_connector.pd.peer import PeerLink
from dualpath_connector.protocol import COUNTERS, GAUGES, RankKeySpace
from dualpath_connector.pd.pulls import PromptPuller
from dualpath_connector.worker.recompute_time import RecomputeTime
from dualpath_connector.load.loaded_hit import LoadedHit
from dualpath_connector.load.fetch import HitReader
from dualpath_connector.load.read_timeline import ReadTimeline
from dualpath_connector.save.saves import ChunkSaver
from dualpath_connector.metrics.stats import DualPathStats
from dualpath_connector.metrics.stats_recorder import StatsRecorder

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

# How long an empty step (nothing scheduled, no load in flight) waits for a store write to end: it paces
# the steps vLLM runs while writes are in flight, and is what a request arriving then may wait at most.
EMPTY_STEP_WAIT_S = 0.002


class DualPathWorker:
    def __init__(self, vllm_config: VllmConfig, config: DualPathConfig, kv_role: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        self.config = config
        self.kv_role = kv_role
        self.geometry = ChunkGeometry.of(config, vllm_config)
        tp_rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
        self.tp_rank, self.tp_size = tp_rank, vllm_config.parallel_config.tensor_parallel_size
        namespace = namespace_for(vllm_config, config, self.geometry.chunk_tokens, tp_rank, pp_rank)
        engine = namespace_for(vllm_config, config, self.geometry.chunk_tokens, tp_rank=0, pp_rank=0)
        self.key_space = RankKeySpace.of_rank(namespace, engine, config.key_prefix)
        # An MLA latent is the same on every TP rank: one namespace for all, written by rank 0 alone.
        self.saves_chunks = namespace.tp_rank == tp_rank
        self.layout = self.key_space.layout
        # The I/O lanes, the side channel and (layerwise) the forward all use
        # the agent. No progress thread: NIXL's spins on a core for good, and
        # polling a transfer or the notifications (the side channel's tick)
        # makes progress as well.
        self._transfer_cores = kv_transfer_cores(vllm_config.device_config.device_type)
        with threads_started_on(self._transfer_cores):
            self.agent = nixl_agent(
                f"dualpath-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                nixl_agent_config(
                    enable_prog_thread=False, backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
                ),
            )
            if kv_role != "kv_both":
                # Before any registration: pools and KV cache must be readable by peers, on the side
                # channel's interface only.
                traffic = config.transport_config.listening_on(config.side_channel_host)
                add_ucx_backend(self.agent, traffic, TRANSPORT_WHERE)
            # The backend must exist before the pools register memory with the agent.
            self.store = make_store(for_rank(config.store_config, tp_rank, pp_rank), self.layout, self.agent)
            # A slot holds a whole stored object: the Full Block and its integrity trailer. Where the store
            # reads into pieces (POSIX, s3agg), the load pool is layer-major: a hit's layer is one host run,
            # one H2D copy.
            layer_major = (self.layout.num_layers, self.layout.layer_block_bytes) if self.store.reads_segments else None
            self.load_pool = HostBufferPool(self.agent, self.layout.object_bytes, config.load_buffer_chunks, layer_major)
            self.save_pool = HostBufferPool(self.agent, self.layout.object_bytes, config.save_buffer_chunks)
        # On a GPU both pools are page-locked once, here: copies from and to them are then asynchronous.
        device = torch.device(vllm_config.device_config.device)
        self._pins = contextlib.ExitStack()
        for pool in (self.load_pool, self.save_pool):
            self._pins.enter_context(pinned(pool.base_addr, pool.array.nbytes, device))
        self.integrity = ChunkIntegrity(self.layout, config.integrity_key)
        self.stats = StatsRecorder()
        self.compute_window = ComputeWindow()
        self.recompute_time = RecomputeTime()
        self.timeline = None
        if config.read_timeline_dir is not None:
            engine = f"{config.side_channel_host}:{config.side_channel_port}" if kv_role != "kv_both" else f"pid-{os.getpid()}"
            self.timeline = ReadTimeline(config.read_timeline_dir, engine)
        self._lanes = {name: IOLane(f"dualpath-{name}", self._transfer_cores, threads) for name, threads in
                       (("read", self.config.store_reads_in_flight), ("save", 1), ("pull", 1))}  # fmt: skip
        # Built with the KV cache (register_kv_caches).
        self.peers: PeerLink | None = None
        self.reader: HitReader | None = None
        self.injector: Injector | None = None
        self.puller: PromptPuller | None = None
        self.saver: ChunkSaver | None = None
        self._kv_registration = None
        self._layer_index: dict[str, int] = {}
        # The bookkeeping vLLM asks back, under one lock.
        self._lock = threading.Lock()
        self._done_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._reported_failed_blocks: set[int] = set()
        # Layerwise: hits read and reported, waiting for the next forward.
        self._loaded: list[LoadedHit] = []
        # Loads submitted and not yet injected or failed; and those of them whose request ended.
        self._in_flight: set[str] = set()
        self._dropped: set[str] = set()
        self._injection: LayerwiseInjection | None = None
        self._rejected_reported = (0, 0, 0)  # side-channel messages, pulled: notifications, hold claims
        self._abandoned_reported = 0  # abandoned_transfer_bytes as last reported
        self._store_counters: dict[str, int] = {}
        # Finished writes, handed to the scheduler as worker metadata each step: the chunks (for KV
        # events, when enabled) and how many writes ended. A write's count waits in
        # ``_writes_finished`` until a stats hand-over that includes its stats (``get_stats``).
        self._kv_events = kv_events_enabled(vllm_config, config)
        self._saved = SavedChunks()
        self._writes_finished = 0
        self._write_ended = threading.Event()

    # -- set-up ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != self.layout.num_layers:
            raise ValueError(f"expected {self.layout.num_layers} KV cache layers, got {len(names)}")
        view = KVCacheView([kv_caches[name] for name in names], num_blocks)
        self._layer_index = {name: i for i, name in enumerate(names)}
        layer_block_bytes = view.layer_block_bytes(self.geometry.blocks_per_chunk)
        if layer_block_bytes != self.layout.layer_block_bytes:
            raise ValueError(
                f"KV cache holds {layer_block_bytes} bytes per layer per chunk, the namespace "
                f"expects {self.layout.layer_block_bytes}: unsupported KV cache layout"
            )
        if self.kv_role != "kv_both":
            regions = view.regions
            self._kv_registration = self.agent.register_memory(regions.registration(), regions.mem_type, backends=[UCX])
            self.peers = PeerLink(
                self.agent,
                self.config.side_channel_host,
                self.config.side_channel_port,
                self.key_space.digest,
                regions,
                lambda request, reply: self.reader.serve_peer(request, reply),
                self.config.pd_lease_s,
                self.config.pd_transfer_timeout_s,
                self._transfer_cores,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
            )
        self.reader = HitReader(
            store=self.store, pool=self.load_pool, block_size=self.geometry.block_size, key_space=self.key_space,
            integrity=self.integrity, kv_dtype=kv_caches[names[0]].dtype, peers=self.peers, lane=self._lanes["read"], stats=self.stats,
            de_read_timeout_s=self.config.de_read_timeout_s, cores=self._transfer_cores,
            move_queued_reads=self.config.move_queued_reads, split_read_min_tokens=self.config.split_read_min_tokens,
            moved_read_min_deadline_s=self.config.moved_read_min_deadline_s,
            timeline=self.timeline,
            layer_arrival=self.config.load_mode == "layerwise", compute_window_s=lambda: self.compute_window.seconds,
            recompute_s=self.recompute_time.seconds if self.config.retries_within_recompute else lambda tokens: None,
            # A store read replacing a failed READ mid-forward gets the deadline the READ had.
            repair_timeout_s=self.config.pd_transfer_timeout_s,
        )  # fmt: skip
        # On a GPU, loads and saves each get a copy stream beside the forward's (the CPU path copies inline).
        on_cuda = view.device.type == "cuda"
        self.injector = Injector(
            view=view, pool=self.load_pool, blocks_per_chunk=self.geometry.blocks_per_chunk,
            agent=self.agent, stats=self.stats, repair=self.reader.repair, release=self._release_hits,
            transfer_timeout_s=self.config.pd_transfer_timeout_s,
            fail=self._fail_arrived, arrival_timeout_s=self.config.layer_arrival_timeout_s,
            load_stream=CudaCopyStream(view.device) if on_cuda else None,
        )  # fmt: skip
        self.saver = ChunkSaver(
            view=view, pool=self.save_pool, store=self.store, key_space=self.key_space, integrity=self.integrity,
            blocks_per_chunk=self.geometry.blocks_per_chunk, lane=self._lanes["save"], stats=self.stats,
            save_stream=CudaCopyStream(view.device) if on_cuda else None,
            on_written=self._note_written,
        )  # fmt: skip
        if self.peers is not None:
            self.puller = PromptPuller(
                agent=self.agent, view=view, peers=self.peers, block_size=self.geometry.block_size, stats=self.stats,
                transfer_timeout_s=self.config.pd_transfer_timeout_s,
            )  # fmt: skip
        logger.info(
            "DualPath worker (%s, %s): %d layers, %d-byte Layer Blocks, namespace %s",
            self.kv_role, self.config.load_mode, len(names), layer_block_bytes, self.key_space.digest,
        )  # fmt: skip

    # -- loads --------------------------------------------------------------------

    def start_load_kv(self, meta: DualPathMetadata) -> None:
        self.recompute_time.step_started(meta.computed_tokens)
        self._note_ended(meta)
        for send in meta.sends:
            self.peers.hold(send.req_id, send.expires_at, send.hold_token, send.block_ids, send.retained)
        for spec in meta.loads:
            with self._lock:
                self._in_flight.add(spec.req_id)
            started = time.perf_counter()
            on_parts = lambda parts, spec=spec, started=started: self._on_read(spec, parts, started)  # noqa: E731
            if self.config.benchmark_oracle:
                self._load_nothing(spec)
            else:
                self.reader.fetch(spec, self.reader.plan(spec), on_parts)
        for pull in meta.pulls:
            self._lanes["pull"].submit(lambda pull=pull: self._pull(pull))

    def _load_nothing(self, spec: LoadSpec) -> None:
        """benchmark_oracle: the hit counts as loaded; no byte is read or moved."""
        self.stats.add(loaded_tokens=spec.num_blocks() * self.geometry.block_size)
        with self._lock:
            self._in_flight.discard(spec.req_id)
            self._done_loads.add(spec.req_id)

    def _on_read(self, spec: LoadSpec, parts: list[LoadedHit], started: float) -> None:
        """A read ended (on a read thread) as parts forming a prefix of the hit: inject now in bulk mode, then report."""
        if self.config.load_mode == "bulk":
            parts = self._inject_whole(spec, parts)
        self._finish_load(spec, parts, started)

    def _inject_whole(self, spec: LoadSpec, parts: list[LoadedHit]) -> list[LoadedHit]:
        """Bulk mode: every part now, in order; one that fails ends the hit before it (later parts are released)."""
        for i, part in enumerate(parts):
            if not part.chunks:
                continue
            try:
                self.injector.inject_whole(part)
            except Exception:
                logger.exception("request %s: load failed", spec.req_id)
                self.reader.release(parts[i + 1 :])
                return parts[:i]
        return parts

    def _finish_load(self, spec: LoadSpec, parts: list[LoadedHit], started: float) -> None:
        good = sum(len(part.chunks) for part in parts)
        failed = [b for chunk in spec.chunks[good:] for b in chunk.block_ids]
        if failed:
            logger.warning(
                "request %s: chunk %s unreadable; hit shortened by %d blocks",
                spec.req_id, self.key_space.key(spec.chunks[good].chunk_hash), len(failed),
            )  # fmt: skip
        loaded_blocks = sum(len(chunk.block_ids) for chunk in spec.chunks[:good])
        self.stats.add(
            loaded_tokens=loaded_blocks * self.geometry.block_size,
            load_failed_tokens=len(failed) * self.geometry.block_size,
        )
        self.stats.sample("load_seconds", time.perf_counter() - started)
        layerwise = self.config.load_mode == "layerwise"
        held = [part for part in parts if part.chunks]
        with self._lock:
            dropped = spec.req_id in self._dropped
            if layerwise and held and not dropped:
                self._loaded.extend(held)
            else:
                self._in_flight.discard(spec.req_id)
                self._dropped.discard(spec.req_id)
            self._failed_blocks.update(failed)
            self._done_loads.add(spec.req_id)
        if dropped and layerwise:
            self._release_hits(parts)

    def _fail_arrived(self, hit: LoadedHit, good: int) -> None:
        """Chunks ``good..`` of an arriving hit did not land intact: vLLM recomputes their blocks after this forward."""
        failed = [b for chunk in hit.chunks[good:] for b in chunk.block_ids]
        logger.warning("request %s: a layer of %d hit chunks did not land intact; %d blocks will be recomputed",
                       hit.req_id, len(hit.chunks) - good, len(failed))  # fmt: skip
        self.stats.add(load_failed_tokens=len(failed) * self.geometry.block_size)
        with self._lock:
            self._failed_blocks.update(failed)

    def _note_ended(self, meta: DualPathMetadata) -> None:
        """Requests that ended: a hit of theirs not yet injected must never be."""
        with self._lock:
            self._dropped.update(r for r in meta.dropped_req_ids if r in self._in_flight)
            dropped = [h for h in self._loaded if h.req_id in self._dropped]
            self._loaded = [h for h in self._loaded if h.req_id not in self._dropped]
        self._release_hits(dropped)

    def _release_hits(self, hits: list[LoadedHit]) -> None:
        self.reader.release(hits)
        with self._lock:
            for hit in hits:
                self._in_flight.discard(hit.req_id)
                self._dropped.discard(hit.req_id)

    def wait_for_layer_load(self, layer_name: str, meta: DualPathMetadata) -> None:
        """Layerwise: before attention layer ``l`` runs, layer ``l`` of every loaded hit is in the cache."""
        if self.config.load_mode != "layerwise":
            return
        layer = self._layer_index[layer_name]
        if layer == 0:
            self.injector.release_retired()
            # Only here: a hit that turns up later in this forward would miss
            # the layers already run, so it waits for the next forward (vLLM
            # cannot schedule it before it is reported after this one).
            self._finish_injection()
            self._note_ended(meta)
            with self._lock:
                hits, self._loaded = self._loaded, []
            self._injection = LayerwiseInjection(self.injector, hits) if hits else None
        if self._injection is None:
            return
        last = layer == self.layout.num_layers - 1
        self.compute_window.entered(layer)
        self._injection.layer(layer)
        self.compute_window.left(layer, last)
        if last:
            self._finish_injection()

    def _finish_injection(self) -> None:
        injection, self._injection = self._injection, None
        if injection is not None:
            injection.finish()

    # -- PD pulls (DE) --------------------------------------------------------------

    def _pull(self, spec: PullSpec) -> None:
        rest = spec
        kept = self._take_kept(spec) if spec.kept_token is not None else set()
        if kept:
            pairs = [(b, r) for b, r in zip(spec.block_ids, spec.remote_block_ids) if b not in kept]
            rest = dataclasses.replace(
                spec, block_ids=[b for b, _ in pairs], remote_block_ids=[r for _, r in pairs], kept_token=None, kept=[]
            )
        ok = self.puller.pull(rest)
        if kept and not rest.block_ids:
            self.stats.sample("compute_network_bytes_per_request", 0)  # the whole prompt was kept here
        if not spec.block_ids:
            return  # only the PE's blocks were released: no load to report
        with self._lock:
            if not ok:
                self._failed_blocks.update(rest.block_ids)
            self._done_loads.add(spec.req_id)

    def _take_kept(self, spec: PullSpec) -> set[int]:
        """Copy the hit chunks this DE read for the PE and still keeps into their blocks; the blocks filled.

        A chunk is used only if the buffer holds exactly the hash computed here
        from the prompt; whatever is not filled here is pulled from the PE.
        """
        claimed = self.peers.claim_kept(spec.kept_token)
        if claimed is None:
            # The PE read the hit itself, or the kept chunks expired.
            logger.debug("request %s: no hit kept under its token; pulling the whole prompt", spec.req_id)
            return set()
        pool, slots, chunk_hashes = claimed
        slot_of = dict(zip(chunk_hashes, slots))
        usable = [chunk for chunk in spec.kept if chunk.chunk_hash in slot_of]
        used = [slot_of[chunk.chunk_hash] for chunk in usable]
        pool.release(sorted(set(slots) - set(used)))
        if not usable:
            return set()
        try:
            self.injector.inject_whole(LoadedHit(spec.req_id, usable, slots=used))  # releases the slots
        except Exception:
            logger.exception("request %s: copying its kept hit in failed; pulling it", spec.req_id)
            return set()
        filled = {block for chunk in usable for block in chunk.block_ids}
        self.stats.add(kept_tokens=len(filled) * self.geometry.block_size)
        return filled

    # -- what vLLM asks back ----------------------------------------------------------

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        if self.injector is not None:
            self.injector.release_retired()
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

    # -- saves ------------------------------------------------------------------------

    def wait_for_save(self, meta: DualPathMetadata) -> None:
        self.recompute_time.step_ended()  # the forward is over: its saves below run on the save lane
        if self.saves_chunks:
            self.saver.save(meta.saves)
        if not (meta.loads or meta.saves or meta.pulls or meta.sends or meta.computed_tokens or self._in_flight):
            # An empty step: vLLM steps an idle engine while writes are in flight (has_pending_push_work)
            # and would spin a core; wait for a write to end, briefly, so a new request is not held up.
            self._write_ended.wait(EMPTY_STEP_WAIT_S)
            self._write_ended.clear()

    def _note_written(self, chunk_hashes: list[str], ok: list[bool]) -> None:
        # On the save lane.
        with self._lock:
            self._writes_finished += 1
            if self._kv_events:
                for chunk_hash, stored in zip(chunk_hashes, ok):
                    if stored:
                        self._saved.stored[chunk_hash] = 1
                    else:
                        self._saved.failed.add(chunk_hash)
        self._write_ended.set()

    def take_saved_chunks(self) -> SavedChunks | None:
        """The writes finished since the last step, for the scheduler (None: nothing new)."""
        with self._lock:
            if not (self._saved.stored or self._saved.failed or self._saved.writes):
                return None
            taken, self._saved = self._saved, SavedChunks()
        return taken

    # -- lifecycle --------------------------------------------------------------------

    def get_stats(self) -> DualPathStats | None:
        if self.peers is not None:
            # The side channel counts refusals on its own thread; hand on what is new.
            rejected = self.peers.rejected_messages, self.peers.forged_notifications, self.peers.refused_claims
            self.stats.add(side_channel_rejected_messages=rejected[0] - self._rejected_reported[0],
                           forged_notifications=rejected[1] - self._rejected_reported[1],
                           refused_hold_claims=rejected[2] - self._rejected_reported[2])  # fmt: skip
            self._rejected_reported = rejected
            self.stats.gauge(pd_held_blocks=self.peers.held_blocks)
        self._add_store_metrics()
        # Writes counted before the take: their stats are in it (a write records them before it counts).
        with self._lock:
            writes, self._writes_finished = self._writes_finished, 0
        data = self.stats.take()
        with self._lock:
            self._saved.writes += writes
        return DualPathStats(data=data) if data is not None else None

    def _add_store_metrics(self) -> None:
        # The store keeps totals; hand on what grew since the last call, and its latest gauges.
        reported = self.store.metrics()
        counters = {name: value for name, value in reported.counters.items() if name in COUNTERS}
        self.stats.add(**{name: value - self._store_counters.get(name, 0) for name, value in counters.items()})
        self._store_counters = counters
        self.stats.gauge(**{name: value for name, value in reported.gauges.items() if name in GAUGES})
        abandoned = process_held_bytes()
        if abandoned != self._abandoned_reported:  # changes only: an idle engine's steps stay without stats
            self.stats.gauge(abandoned_transfer_bytes=abandoned)
            self._abandoned_reported = abandoned

    def shutdown(self) -> None:
        if self.reader is not None:
            self.reader.shutdown()
        if self.peers is not None:
            self.peers.close()
        if self.injector is not None:
            self.injector.release_retired(wait=True)
        busy = [lane.name for lane in self._lanes.values() if not lane.stop(timeout_s=60.0)]
        if busy:
            # A transfer is still running: its memory stays registered.
            logger.warning("DualPath I/O lanes %s still busy at shutdown; host buffers left registered", busy)
            return
        if self._kv_registration is not None:
            self.agent.deregister_memory(self._kv_registration, backends=[UCX])
        self._pins.close()
        self.load_pool.close()
        self.save_pool.close()
        self.store.close()
        if self.timeline is not None:
            self.timeline.close()
