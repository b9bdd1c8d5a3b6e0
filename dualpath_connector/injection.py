"""Injection: a loaded hit's bytes move from its host buffer into the KV cache.

- ``bulk`` (:meth:`Injector.inject_whole`): every layer at once, on the thread
  that read the hit, before the load is reported;
- ``layerwise`` (:class:`LayerwiseInjection`): the next forward injects layer
  ``l`` of every loaded hit right before attention layer ``l``: a local indexed
  copy, or a NIXL READ from the DE's buffer posted for all layers at the first
  one, so later layers move while earlier ones compute.

A READ from a DE that fails after the hit was reported is *repaired*: the
hit is read from the store here (a callable the read path provides) and the
remaining layers come from that copy; earlier layers are already right.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from nixl_backends.buffers import HostBufferPool
from nixl_backends.layout import BlockLayout
from nixl_backends.transport import PeerRead, post_read

from dualpath_connector.kv_cache_view import CopyPlan, KVCacheView
from dualpath_connector.kv_regions import full_block_rows
from dualpath_connector.read_path import LoadedHit
from dualpath_connector.stats import StatsRecorder

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
    ) -> None:
        self.view = view
        # The cache's own geometry (the worker checked it against the namespace's).
        self.layout = BlockLayout(view.num_layers, view.layer_block_bytes(blocks_per_chunk))
        self.agent = agent
        self.stats = stats
        self.repair = repair
        self.release = release
        self.transfer_timeout_s = transfer_timeout_s
        self._host = view.host_blocks(pool.array, pool.num_slots, blocks_per_chunk)

    def inject_whole(self, hit: LoadedHit) -> None:
        """Bulk mode: every layer now, then the buffer is free."""
        if hit.remote is not None:
            reads = self.post_remote_reads(hit)
            if reads is not None and all(r.wait(self.transfer_timeout_s) for r in reads):
                self.end_remote(hit)
                return
            self.repair(hit)
        try:
            self.copy_in([hit], list(range(self.layout.num_layers)))
        finally:
            self.release([hit])

    def plan(self, hits: list[LoadedHit]) -> CopyPlan:
        """Pool slot, sub-block and KV block of every block of hits held in this engine's pool."""
        slots, subs, blocks = [], [], []
        for hit in hits:
            for chunk, slot in zip(hit.chunks, hit.slots):
                n = len(chunk.block_ids)
                slots += [slot] * n
                subs += range(chunk.first_sub_block, chunk.first_sub_block + n)
                blocks += chunk.block_ids
        return self.view.plan(slots, subs, blocks)

    def copy_in(self, hits: list[LoadedHit], layers: list[int], plan: CopyPlan | None = None) -> None:
        self.view.copy_in(self._host, plan if plan is not None else self.plan(hits), layers)

    def post_remote_reads(self, hit: LoadedHit) -> list[PeerRead] | None:
        """One READ per layer from the DE's buffer straight into the KV cache; None if NIXL refuses."""
        remote = hit.remote
        local = self.view.regions
        chunks = hit.chunks
        layers = range(self.layout.num_layers)
        # Rows of every layer at once (ordered layer-major), split into one READ per layer.
        local_rows = np.split(local.rows(layers, hit.block_ids()), self.layout.num_layers)
        remote_rows = np.split(
            full_block_rows(remote.chunk_addrs, [c.first_sub_block for c in chunks], [len(c.block_ids) for c in chunks],
                            layers, self.layout, self.view.outer, self.view.block_bytes),
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

    def end_remote(self, hit: LoadedHit) -> None:
        """Every layer of a DE-read hit arrived: count it and hand the DE its buffer back."""
        self.stats.add(bytes_pulled_from_peer=len(hit.chunks) * self.layout.full_block_bytes)
        self.release([hit])


class LayerwiseInjection:
    """One forward's layerwise injection of every loaded hit."""

    def __init__(self, injector: Injector, hits: list[LoadedHit]) -> None:
        self.injector = injector
        self.local = [h for h in hits if h.remote is None]
        self.remote = [h for h in hits if h.remote is not None]
        self.reads = {id(h): injector.post_remote_reads(h) for h in self.remote}
        self.plan = injector.plan(self.local)

    def layer(self, layer: int) -> None:
        for hit in list(self.remote):
            reads = self.reads[id(hit)]
            if reads is None or not reads[layer].wait(self.injector.transfer_timeout_s):
                # Earlier layers are in; this one onwards come from the store here.
                self.injector.repair(hit)
                self.remote.remove(hit)
                self.local.append(hit)
                self.plan = self.injector.plan(self.local)
        self.injector.copy_in(self.local, [layer], self.plan)

    def finish(self) -> None:
        for hit in self.remote:
            self.injector.end_remote(hit)
        self.injector.release(self.local)

