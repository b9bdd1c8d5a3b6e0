"""Layer Blocks between pinned host slots and a KV cache on an accelerator, queued on copy streams.

Loads: for each layer, one host->device copy per slot of that slot's Layer
Block (one run of bytes in the stored format) into a device staging area, then
one indexed copy from staging into the layer's KV blocks, then a mark; all
layers of a step are queued at once, so layer ``l+1`` moves while layer ``l``
computes, and the forward waits on layer ``l``'s mark alone. Saves mirror it:
an indexed gather of the blocks into staging, a mark the compute stream waits
on (after it a block may be reused), then one device->host copy per slot and
layer, and a mark the save lane waits on before sealing and writing.

Copies per run of slots, not per block: a Layer Block is ``blocks_per_chunk``
blocks in one run, and in a layer-major pool (``HostBufferPool(layer_major=...)``)
a hit's consecutive slots hold each layer as one run, so a layer of a hit is one
host->device copy of ``chunks x Layer Block`` bytes (large: what ``mma_preload``
splits across paths); in a chunk-major pool it is one copy per slot. The
scatter into arbitrary block ids happens on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dualpath_connector.cache.copy_stream import CopyStream, Mark
from dualpath_connector.cache.kv_cache_view import CopyPlan, KVCacheView

# Device memory one batch of Layer Blocks may stage; a plan with more slots is
# moved in several batches per layer.
STAGING_BYTES = 256 << 20


@dataclass(frozen=True)
class _Batch:
    slots: list[int]  # host slots, in staging order
    runs: list[tuple[int, int, int]]  # (staging position, first slot, count): one copy per layer each
    positions: torch.Tensor  # per planned block: its slot's index in `slots` (device)
    sub_blocks: torch.Tensor  # per planned block: sub-block within the Layer Block (device)
    block_ids: torch.Tensor  # per planned block: KV cache block (device)


class DeviceCopier:
    """Copies between the host slots ``host[slot, layer]`` and ``view``'s cache, on ``stream``.

    Plans come with host-side index tensors (``KVCacheView.plan(..., on_device=False)``):
    every device tensor a copy uses is made here, on the copy stream, so the
    caching allocator cannot hand its memory to the compute stream while a
    queued copy still reads it.
    """

    def __init__(self, view: KVCacheView, host: torch.Tensor, stream: CopyStream, staging_bytes: int = STAGING_BYTES) -> None:
        self.view = view
        self.host = host  # [slot, layer, sub_block, outer, block_bytes]
        self.stream = stream
        self._layer_block_shape = tuple(host.shape[2:])
        layer_block_bytes = max(1, host[0, 0].numel())
        # Layer-major host: consecutive slots' Layer Blocks of one layer are adjacent.
        self._runs_merge = host.shape[0] > 1 and host[0:2, 0].is_contiguous()
        # Bytes of each host->device copy of the last post_loads, per layer (what the copy-count test and
        # the GPU check read).
        self.last_load_copy_bytes: list[int] = []
        self._load_batch_slots = max(1, staging_bytes // layer_block_bytes)
        # A save stages every layer of its slots at once.
        self._save_batch_slots = max(1, staging_bytes // (layer_block_bytes * view.num_layers))

    def _batches(self, plan: CopyPlan, batch_slots: int) -> list[_Batch]:
        slots, positions = torch.unique(plan.slots, return_inverse=True)
        slot_list = slots.tolist()
        device = self.view.device
        batches = []
        for first in range(0, len(slot_list), batch_slots):
            chosen = (positions >= first) & (positions < first + batch_slots)
            batch_list = slot_list[first : first + batch_slots]
            batches.append(
                _Batch(
                    slots=batch_list,
                    runs=self._runs(batch_list),
                    positions=(positions[chosen] - first).to(device),
                    sub_blocks=plan.sub_blocks[chosen].to(device),
                    block_ids=plan.block_ids[chosen].to(device),
                )
            )
        return batches

    def _runs(self, slots: list[int]) -> list[tuple[int, int, int]]:
        """Sorted ``slots`` as runs of consecutive slots (single slots where the host is chunk-major)."""
        runs: list[tuple[int, int, int]] = []
        for position, slot in enumerate(slots):
            if runs and self._runs_merge and runs[-1][1] + runs[-1][2] == slot:
                start, first, count = runs[-1]
                runs[-1] = (start, first, count + 1)
            else:
                runs.append((position, slot, 1))
        return runs

    def _staging(self, *leading: int) -> torch.Tensor:
        return torch.empty((*leading, *self._layer_block_shape), dtype=torch.uint8, device=self.view.device)

    def post_loads(self, plan: CopyPlan, layers: Sequence[int], follow: bool = True) -> tuple[Mark, list[Mark]]:
        """Queue ``layers`` of the planned blocks into the cache; the start mark and one mark per layer.

        Host->device copies run on the copy stream into two staging areas in
        turn; each area's scatter into the KV blocks runs on the scatter stream
        once its copies landed, and the area is refilled once its scatter ran.
        So the DMA engine moves the next layer while this layer's scatter waits
        for SMs the forward holds: a scatter never holds up a copy.
        ``follow``: the copies first wait for the compute stream's queued work (which may still use the
        blocks); a later post in the same forward, into blocks that forward only reads, need not.
        """
        if follow:
            self.stream.follow_compute()
        start = self.stream.mark()
        marks: list[Mark] = []
        with self.stream.active():
            batches = self._batches(plan, self._load_batch_slots) if len(plan) else []
            width = max((len(b.slots) for b in batches), default=0)
            staging = [self._staging(width), self._staging(width)]
            for area in staging:
                self.stream.keep_for_scatter(area)
            for batch in batches:
                for index in (batch.positions, batch.sub_blocks, batch.block_ids):
                    self.stream.keep_for_scatter(index)
        layer_block = self.host[0, 0].numel()
        self.last_load_copy_bytes = [count * layer_block for batch in batches for _, _, count in batch.runs]
        scattered: list[Mark | None] = [None, None]  # per staging area: its last scatter
        step = 0
        for layer in layers:
            target = self.view.layers[layer]
            for batch in batches:
                area = step % 2
                step += 1
                with self.stream.active():
                    if scattered[area] is not None:
                        self.stream.waits(scattered[area])  # its last scatter read it
                    for position, first, count in batch.runs:
                        staging[area][position : position + count].copy_(self.host[first : first + count, layer], non_blocking=True)
                    landed = self.stream.mark()
                with self.stream.scatter_active():
                    self.stream.scatter_waits(landed)
                    rows = staging[area][batch.positions, batch.sub_blocks]  # [n, outer, bytes]
                    target.index_copy_(1, batch.block_ids, rows.transpose(0, 1))
                    scattered[area] = self.stream.scatter_mark()
            marks.append(self.stream.scatter_mark())
        return start, marks

    def post_saves(self, plan: CopyPlan) -> Mark:
        """Queue every layer of the planned blocks out to the host slots; the mark after which the host holds them.

        The compute stream waits for each batch's gather (not for the host
        copies): from then on the blocks may be rewritten.
        """
        self.stream.follow_compute()
        num_layers = self.view.num_layers
        with self.stream.active():
            for batch in self._batches(plan, self._save_batch_slots) if len(plan) else []:
                staging = self._staging(num_layers, len(batch.slots))
                for layer in range(num_layers):
                    rows = self.view.layers[layer].index_select(1, batch.block_ids).transpose(0, 1)
                    staging[layer][batch.positions, batch.sub_blocks] = rows
                self.stream.compute_waits(self.stream.mark())
                for layer in range(num_layers):
                    for i, slot in enumerate(batch.slots):
                        self.host[slot, layer].copy_(staging[layer, i], non_blocking=True)
        return self.stream.mark()
