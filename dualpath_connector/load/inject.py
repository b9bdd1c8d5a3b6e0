"""Injection: a loaded hit's bytes move from its host buffer into the KV cache.

- ``bulk`` (:meth:`Injector.inject_whole`): every layer at once, on the thread
  that read the hit, before the load is reported;
- ``layerwise`` (:class:`LayerwiseInjection`): the next forward injects layer
  ``l`` of every loaded hit right before attention layer ``l``: a NIXL READ from
  the DE's buffer, or a copy from this engine's pool. READs, and on a GPU the
  pool copies too (:mod:`~dualpath_connector.cache.device_copies`, on their own
  stream), are posted for all layers at the first one, so later layers move
  while earlier ones compute; on a CPU the pool copy of layer ``l`` runs right
  before it.

On a GPU the pool's slots of a hit return to the pool only once its copies
have run (:meth:`Injector.release_retired`), and the forward's stall is read
from CUDA events then (:mod:`~dualpath_connector.load.load_timing`).

A READ from a DE that fails after the hit was reported is *repaired*: the
hit is read from the store here (a callable the read path provides) and the
remaining layers come from that copy; earlier layers are already right.

An *arriving* hit (:mod:`~dualpath_connector.load.arrivals`) is injected layer by
layer as its layers land: before attention layer ``l`` the forward waits for
layer ``l`` of it alone. Chunks whose layer does not land in time, or fails
its check, are failed (a callable the worker provides: their blocks are
reported to vLLM, which recomputes them) and get no further layer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from nixl_backends.buffers import HostBufferPool
from nixl_backends.layout import BlockLayout
from nixl_backends.transport import PeerRead, post_read

from dualpath_connector.cache.copy_stream import CopyStream, Mark
from dualpath_connector.cache.device_copies import DeviceCopier
from dualpath_connector.cache.kv_cache_view import CopyPlan, KVCacheView
from dualpath_connector.cache.kv_regions import full_block_rows
from dualpath_connector.load.load_timing import StepLoadTiming
from dualpath_connector.load.loaded_hit import LoadedHit
from dualpath_connector.metrics.stats_recorder import StatsRecorder

logger = logging.getLogger(__name__)


class Injector:
    def __init__(
        self,
        *,
        view: KVCacheView,
        pool: HostBufferPool,
        blocks_per_chunk: int,
        agent,
        stats: StatsRecorder,
        repair: Callable[[LoadedHit], None],
        release: Callable[[list[LoadedHit]], None],
        transfer_timeout_s: float,
        fail: Callable[[LoadedHit, int], None] = lambda hit, good: None,
        arrival_timeout_s: float = 10.0,
        load_stream: CopyStream | None = None,
    ) -> None:
        self.view = view
        # The cache's own geometry (the worker checked it against the namespace's).
        self.layout = BlockLayout(view.num_layers, view.layer_block_bytes(blocks_per_chunk))
        self.agent = agent
        self.stats = stats
        self.repair = repair
        self.release = release
        self.transfer_timeout_s = transfer_timeout_s
        # An arriving hit's chunks from ``good`` on did not land intact: ``fail(hit, good)``.
        self.fail = fail
        self.arrival_timeout_s = arrival_timeout_s
        self._host = view.host_blocks(pool.array, pool.num_slots, blocks_per_chunk, layer_major=pool.layer_major)
        # On an accelerator (given a stream): pool copies are queued on it.
        self.device = DeviceCopier(view, self._host, load_stream) if load_stream is not None else None
        # Hits whose device copies were queued: released, and their timing read, once the copies ran.
        self._retiring: list[tuple[list[LoadedHit], StepLoadTiming]] = []

    def inject_whole(self, hit: LoadedHit) -> None:
        """Bulk mode: every layer now, then the buffer is free."""
        if hit.remote is not None:
            reads = self.post_remote_reads(hit)
            if reads is not None and all(self.remote_read_done(hit, r) for r in reads):
                self.end_remote(hit)
                return
            cancel(reads)
            self.repair(hit)
        try:
            layers = list(range(self.layout.num_layers))
            if self.device is not None:
                # On the read lane: the host waits here, the forward never does.
                self.post_device([hit], layers)[1][-1].wait()
            else:
                self.copy_in([hit], layers)
        finally:
            self.release([hit])

    def post_device(self, hits: list[LoadedHit], layers: Sequence[int], follow: bool = True) -> tuple[Mark, list[Mark]]:
        """Queue ``layers`` of hits held in the pool on the copy stream; its start mark and one mark per layer."""
        return self.device.post_loads(self.plan(hits, on_device=False), layers, follow)

    def retire(self, hits: list[LoadedHit], timing: StepLoadTiming) -> None:
        """Release ``hits`` (and report ``timing``) once every device copy queued so far has run."""
        self._retiring.append((hits, timing))
        self.release_retired()

    def release_retired(self, wait: bool = False) -> None:
        """Release what :meth:`retire` holds whose copies ran (all of it, waiting, if ``wait``)."""
        still = []
        for hits, timing in self._retiring:
            if wait:
                for mark in timing.all_marks():
                    mark.wait()
            if still or not timing.resolved():
                still.append((hits, timing))  # in order: a later step's copies queue behind this one's
                continue
            timing.report(self.stats)
            self.release(hits)
        self._retiring = still

    def plan(self, hits: list[LoadedHit], *, on_device: bool = True) -> CopyPlan:
        """Pool slot, sub-block and KV block of every block of hits held in this engine's pool."""
        slots, subs, blocks = [], [], []
        for hit in hits:
            for chunk, slot in zip(hit.chunks, hit.slots):
                n = len(chunk.block_ids)
                slots += [slot] * n
                subs += range(chunk.first_sub_block, chunk.first_sub_block + n)
                blocks += chunk.block_ids
        return self.view.plan(slots, subs, blocks, on_device=on_device)

    def copy_in(self, hits: list[LoadedHit], layers: list[int], plan: CopyPlan | None = None) -> None:
        self.view.copy_in(self._host, plan if plan is not None else self.plan(hits), layers)

    def post_remote_reads(self, hit: LoadedHit) -> list[PeerRead] | None:
        """One READ per layer from the DE's buffer straight into the KV cache; None if NIXL refuses, or if the DE's
        lease of the buffer may have ended (its slots may hold another read's chunks by now)."""
        remote = hit.remote
        if remote.expired():
            logger.warning("request %s: DE %s's lease of the hit's buffer ended before its READ", hit.req_id,
                           remote.address)  # fmt: skip
            return None
        local = self.view.regions
        chunks = hit.chunks
        layers = range(self.layout.num_layers)
        # Rows of every layer at once (ordered layer-major), split into one READ per layer.
        local_rows = np.split(local.rows(layers, hit.block_ids()), self.layout.num_layers)
        remote_rows = np.split(
            full_block_rows(remote.chunk_addrs, [c.first_sub_block for c in chunks], [len(c.block_ids) for c in chunks],
                            layers, remote.layer_stride, self.view.outer, self.view.block_bytes),
            self.layout.num_layers,
        )  # fmt: skip
        try:
            return [
                post_read(self.agent, remote.peer.agent, local_rows[layer], local.mem_type, remote_rows[layer], "DRAM")
                for layer in layers
            ]
        except Exception as exc:
            logger.warning("request %s: cannot READ from DE %s: %s", hit.req_id, remote.address, exc)
            return None

    def remote_read_done(self, hit: LoadedHit, read: PeerRead) -> bool:
        """True once ``read`` (from ``hit``'s DE buffer) ended before the DE's lease could; else False, once it
        can no longer write here. One seen ending after the lease may have read slots the DE had reused."""
        remote = hit.remote
        done = read.wait(min(self.transfer_timeout_s, max(0.0, remote.deadline - time.monotonic())))
        return done and not remote.expired()

    def end_remote(self, hit: LoadedHit) -> None:
        """Every layer of a DE-read hit arrived: count it and hand the DE its buffer back."""
        nbytes = len(hit.chunks) * self.layout.full_block_bytes
        self.stats.add(bytes_pulled_from_peer=nbytes)
        self.stats.sample("compute_network_bytes_per_request", nbytes)
        self.release([hit])


class LayerwiseInjection:
    """One forward's layerwise injection of every loaded hit."""

    def __init__(self, injector: Injector, hits: list[LoadedHit]) -> None:
        self.injector = injector
        self.num_layers = injector.layout.num_layers
        # Arriving hits whose every layer is in already are injected like any pool-held hit.
        self.arriving = [h for h in hits if h.arrivals is not None and not h.arrivals.complete(len(h.chunks))]
        arriving = {id(h) for h in self.arriving}
        self.local = [h for h in hits if h.remote is None and id(h) not in arriving]
        self.remote = [h for h in hits if h.remote is not None]
        self.started = time.perf_counter()
        self.reads = {id(h): injector.post_remote_reads(h) for h in self.remote}
        self.timing = StepLoadTiming()
        self._local_copy_s = 0.0
        self._remote_span_s = 0.0
        self._arriving_plan: CopyPlan | None = None
        self._followed = False
        if injector.device is not None:
            # Every layer of every pool-held hit now; the forward waits per layer on marks.
            self._ready: list[list[Mark]] = [[] for _ in range(self.num_layers)]
            self._post(self.local, range(self.num_layers))
        else:
            self.plan = injector.plan(self.local)

    def _post(self, hits: list[LoadedHit], layers: range) -> None:
        if not hits:
            return
        # The first post of the forward waits for the compute stream's queued work; later ones need not.
        start, marks = self.injector.post_device(hits, layers, follow=not self._followed)
        self._followed = True
        self.timing.device_loads.append((start, marks[-1]))
        for layer, mark in zip(layers, marks):
            self._ready[layer].append(mark)

    def layer(self, layer: int) -> None:
        entered = time.perf_counter()
        for hit in list(self.remote):
            reads = self.reads[id(hit)]
            if reads is None or not self.injector.remote_read_done(hit, reads[layer]):
                # Earlier layers are in; this one onwards come from the store here, once no READ can land on them.
                cancel(reads)
                self.injector.repair(hit)
                self.remote.remove(hit)
                self.local.append(hit)
                if self.injector.device is not None:
                    self._post([hit], range(layer, self.num_layers))
                else:
                    self.plan = self.injector.plan(self.local)
        if self.remote:
            self._remote_span_s = time.perf_counter() - self.started
        if self.arriving:
            self._land(layer)
        if self.injector.device is not None:
            if self._ready[layer]:
                stream = self.injector.device.stream
                self.timing.device_waits.append((stream.compute_mark(), list(self._ready[layer])))
                for mark in self._ready[layer]:
                    stream.compute_waits(mark)
        else:
            copy_started = time.perf_counter()
            self.injector.copy_in(self.local, [layer], self.plan)
            self._local_copy_s += time.perf_counter() - copy_started
        self.timing.host_wait_s += time.perf_counter() - entered

    def _land(self, layer: int) -> None:
        """Wait for layer ``layer`` of the arriving hits; fail what did not land intact; inject the rest."""
        for hit in self.arriving:
            if not hit.chunks:
                continue  # failed at an earlier layer: nothing left to wait for
            good = hit.arrivals.wait(layer, self.injector.arrival_timeout_s)
            if good < len(hit.chunks):
                self.injector.fail(hit, good)
                hit.chunks = hit.chunks[:good]
                self._arriving_plan = None
        hits = [h for h in self.arriving if h.chunks]
        if self.injector.device is not None:
            self._post(hits, range(layer, layer + 1))
            return
        if self._arriving_plan is None:
            self._arriving_plan = self.injector.plan(hits)
        copy_started = time.perf_counter()
        self.injector.copy_in(hits, [layer], self._arriving_plan)
        self._local_copy_s += time.perf_counter() - copy_started

    def finish(self) -> None:
        for hit in self.remote:
            self.injector.end_remote(hit)
        landed = [h.arrivals.last_landed_at() for h in self.arriving]
        arrival_span_s = max((t - self.started for t in landed if t is not None), default=0.0)
        self.timing.host_load_s = max(self._local_copy_s, self._remote_span_s, arrival_span_s)
        # The remote hits' buffers were handed back above; the pool-held ones wait for their copies
        # (and an arriving hit's slots also for its read to end).
        self.injector.retire(self.local + self.arriving, self.timing)


def cancel(reads: list[PeerRead] | None) -> None:
    """End every READ of a hit that still runs (its layers are about to be read from the store into the same
    blocks); returns once none can write them."""
    for read in reads or ():
        read.cancel()
