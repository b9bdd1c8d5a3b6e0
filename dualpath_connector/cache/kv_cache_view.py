"""A physical block view of vLLM's KV cache, whatever its layout: pure torch, no vLLM import.

Each layer's tensor is viewed as ``uint8 [outer, num_blocks, block_bytes]`` in
the order its bytes lie in memory: block-major layouts (CPU, FlashInfer
``[blocks, 2, ...]``, MLA ``[blocks, block, dim]``) give ``outer == 1``;
K/V-split layouts (FlashAttention ``[2, blocks, ...]``) give ``outer == 2``.
A Layer Block in a host buffer holds a chunk's blocks in token order, each as
its ``outer`` slices: ``[sub_block, outer, block_bytes]``.

Copies between host buffers and the cache are one indexed tensor copy per
layer (:meth:`copy_in`, :meth:`copy_out`), never a Python loop over blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from dualpath_connector.cache.kv_regions import KVRegions


def physical_block_view(kv: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A uint8 view ``[outer, num_blocks, block_bytes]`` of one layer's KV cache tensor.

    The dimensions after the block dimension (in memory order) must be dense: a
    block's bytes are one run per outer index. The block dimension may stride
    further than that run: with vLLM's cross-layer layouts (``BLHNC``,
    ``BLNHC``) each layer's tensor is a slice of one allocation whose blocks
    hold every layer's page.
    """
    order = sorted(range(kv.dim()), key=lambda d: kv.stride(d), reverse=True)
    sizes = [kv.shape[d] for d in order]
    strides = [kv.stride(d) for d in order]
    block_dims = [i for i, size in enumerate(sizes) if size == num_blocks]
    if not block_dims:
        raise ValueError(f"no dimension of size num_blocks={num_blocks} in KV cache shape {tuple(kv.shape)}")
    dim = block_dims[0]
    inner = math.prod(sizes[dim + 1 :])
    outer = math.prod(sizes[:dim])
    dense_inner = all(strides[i] == math.prod(sizes[i + 1 :]) for i in range(dim + 1, len(sizes)))
    # Dimensions before the block's merge into one: each steps over the next whole.
    mergeable = all(strides[i] == strides[i + 1] * sizes[i + 1] for i in range(dim - 1))
    outer_stride = strides[dim - 1] if dim else num_blocks * strides[dim]
    if not (dense_inner and mergeable and strides[dim] >= inner and (dim == 0 or outer_stride >= num_blocks * strides[dim])):
        raise ValueError(f"KV cache tensor with strides {kv.stride()} is not a permutation of a dense layout")
    element = kv.element_size()
    raw = torch.empty(0, dtype=torch.uint8, device=kv.device).set_(kv.untyped_storage())
    return raw.as_strided(
        (outer, num_blocks, inner * element),
        (outer_stride * element, strides[dim] * element, 1),
        kv.storage_offset() * element,
    )


def _long(values: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64))


@dataclass(frozen=True)
class CopyPlan:
    """Which host slot and sub-block each KV cache block comes from (or goes to)."""

    slots: torch.Tensor
    sub_blocks: torch.Tensor
    block_ids: torch.Tensor  # on the cache's device, or the host's for DeviceCopier

    def __len__(self) -> int:
        return int(self.block_ids.numel())


class KVCacheView:
    """Every layer of one engine's KV cache as physical blocks."""

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int) -> None:
        if not layers:
            raise ValueError("a KV cache view needs at least one layer")
        if layers[0].device.type not in ("cpu", "cuda"):
            # The copy paths are the CPU's inline copies and CUDA's copy streams (DeviceCopier).
            raise ValueError(f"KV cache on a {layers[0].device.type!r} device: the connector runs on CPU and CUDA only")
        self.layers = [physical_block_view(kv, num_blocks) for kv in layers]
        shapes = {tuple(view.shape) for view in self.layers}
        if len(shapes) != 1:
            raise ValueError(f"KV cache layers differ in shape: {sorted(shapes)}")
        self.outer, self.num_blocks, self.block_bytes = self.layers[0].shape
        self.device = self.layers[0].device

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_block_bytes(self, blocks_per_chunk: int) -> int:
        """Bytes of one layer of one chunk (a Layer Block)."""
        return self.outer * self.block_bytes * blocks_per_chunk

    @cached_property
    def regions(self) -> KVRegions:
        """Where the cache lives for NIXL; the tensors never move, so this is computed once."""
        from nixl_backends.transport import mem_type

        first = self.layers[0]
        return KVRegions(
            layer_addrs=tuple(view.data_ptr() for view in self.layers),
            outer=self.outer,
            outer_stride=first.stride(0),
            num_blocks=self.num_blocks,
            block_stride=first.stride(1),
            block_bytes=self.block_bytes,
            mem_type=mem_type(self.device.type),
            device_id=self.device.index or 0,
        )

    def host_blocks(self, buffer: np.ndarray, num_slots: int, blocks_per_chunk: int, layer_major: bool = False) -> torch.Tensor:
        """A host buffer of slots as ``[slot, layer, sub_block, outer, block_bytes]`` (a view, no copy).

        Chunk-major: each slot starts with a Full Block; bytes after it (the
        stored object's integrity trailer) are outside the view. Layer-major
        (``HostBufferPool(layer_major=...)``): the buffer starts with one band per
        layer, ``[layer][slot][Layer Block]``, so ``view[a:b, layer]`` is one run.
        """
        shape = (self.num_layers, blocks_per_chunk, self.outer, self.block_bytes)
        full_block_bytes = math.prod(shape)
        if layer_major:
            bands = torch.from_numpy(buffer)[: full_block_bytes * num_slots]
            return bands.view(self.num_layers, num_slots, *shape[1:]).transpose(0, 1)
        slots = torch.from_numpy(buffer).view(num_slots, -1)[:, :full_block_bytes]
        return slots.unflatten(1, shape)

    def plan(
        self, slots: Sequence[int], sub_blocks: Sequence[int], block_ids: Sequence[int], *, on_device: bool = True
    ) -> CopyPlan:
        """Block ``block_ids[i]`` of the cache <-> sub-block ``sub_blocks[i]`` of host slot ``slots[i]``."""
        block_ids = _long(block_ids)
        return CopyPlan(_long(slots), _long(sub_blocks), block_ids.to(self.device) if on_device else block_ids)

    def copy_in(self, host: torch.Tensor, plan: CopyPlan, layers: Sequence[int]) -> None:
        """Copy ``layers`` of the planned blocks from the host buffer into a CPU cache, inline: done on return.

        A CUDA cache is loaded on a copy stream (:class:`~dualpath_connector.cache.device_copies.DeviceCopier`),
        which the forward waits for per layer on the device, never with a host-side synchronize.
        """
        if self.device.type != "cpu":
            raise RuntimeError("copy_in is the CPU path; a CUDA cache loads through DeviceCopier")
        if not len(plan):
            return
        for layer in layers:
            # host[...] is [n, outer, bytes]; the cache view wants [outer, n, bytes].
            rows = host[plan.slots, layer, plan.sub_blocks].transpose(0, 1)
            self.layers[layer].index_copy_(1, plan.block_ids, rows)

    def copy_out(self, host: torch.Tensor, plan: CopyPlan) -> None:
        """Copy every layer of the planned blocks from the cache into the host buffer."""
        if not len(plan):
            return
        for layer, view in enumerate(self.layers):
            host[plan.slots, layer, plan.sub_blocks] = view.index_select(1, plan.block_ids).transpose(0, 1).cpu()
