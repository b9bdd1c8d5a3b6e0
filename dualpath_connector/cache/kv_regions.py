"""Where a KV cache lives, as NIXL sees it: one type for this engine's cache and a peer's.

Layer ``l``, outer index ``o`` (K/V for split layouts, the head for ``LHBNC``,
else 0) and block ``b`` are ``block_bytes`` at ``layer_addrs[l] + o * outer_stride
+ b * block_stride``; ``block_stride`` exceeds ``block_bytes`` in vLLM's
cross-layer layouts, where a block holds every layer's page. Engines send the
wire form in the side channel's ``hello`` answer; a peer's parsed form names
its NIXL agent. Descriptor rows are built with numpy, never a Python loop over
bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nixl_backends.layout import BlockLayout
from nixl_backends.nixl_io import descriptors

from dualpath_connector.protocol import ProtocolError

_MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class KVRegions:
    layer_addrs: tuple[int, ...]
    outer: int
    outer_stride: int
    num_blocks: int
    block_stride: int
    block_bytes: int
    mem_type: str
    device_id: int
    # The owner's NIXL agent; empty for this engine's own cache.
    agent: str = ""

    def rows(self, layers: Sequence[int], block_ids: np.ndarray) -> np.ndarray:
        """NIXL rows of ``block_ids`` in ``layers``, ordered layer, block, outer."""
        bases = np.asarray(self.layer_addrs, dtype=np.uint64)[list(layers)]
        outer = np.arange(self.outer, dtype=np.uint64) * np.uint64(self.outer_stride)
        blocks = np.asarray(block_ids, dtype=np.uint64) * np.uint64(self.block_stride)
        addrs = bases[:, None, None] + blocks[None, :, None] + outer
        return descriptors(addrs, self.block_bytes, self.device_id)

    def registration(self) -> list[tuple[int, int, int, str]]:
        """The cache's memory as ``nixl_agent.register_memory`` takes it: each layer's span, overlapping
        spans (cross-layer layouts interleave layers block by block) merged into one."""
        span = (self.outer - 1) * self.outer_stride + (self.num_blocks - 1) * self.block_stride + self.block_bytes
        merged: list[list[int]] = []
        for start in sorted(self.layer_addrs):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], start + span)
            else:
                merged.append([start, start + span])
        return [(start, end - start, self.device_id, "") for start, end in merged]

    def same_block_geometry(self, other: KVRegions) -> bool:
        """Blocks of ``other`` can be copied one to one into blocks of this cache."""
        return (self.outer, self.block_bytes, len(self.layer_addrs)) == (
            other.outer,
            other.block_bytes,
            len(other.layer_addrs),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "layer_addrs": list(self.layer_addrs),
            "outer": self.outer,
            "outer_stride": self.outer_stride,
            "num_blocks": self.num_blocks,
            "block_stride": self.block_stride,
            "block_bytes": self.block_bytes,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
        }

    @classmethod
    def from_wire(cls, data: Any, agent: str) -> KVRegions:
        """A peer's regions from its ``hello`` answer; :class:`ProtocolError` if malformed."""
        if not isinstance(data, dict):
            raise ProtocolError("kv must be an object")

        def count(name: str, minimum: int) -> int:
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ProtocolError(f"kv.{name} must be an integer >= {minimum}, got {value!r}")
            return value

        addrs = data.get("layer_addrs")
        if not isinstance(addrs, list) or not addrs or not all(isinstance(a, int) and a > 0 for a in addrs):
            raise ProtocolError("kv.layer_addrs must be a non-empty list of addresses")
        if data.get("mem_type") not in _MEM_TYPES:
            raise ProtocolError(f"kv.mem_type must be one of {_MEM_TYPES}, got {data.get('mem_type')!r}")
        block_bytes = count("block_bytes", 1)
        return cls(
            layer_addrs=tuple(addrs),
            outer=count("outer", 1),
            outer_stride=count("outer_stride", 0),
            num_blocks=count("num_blocks", 1),
            block_stride=count("block_stride", block_bytes),
            block_bytes=block_bytes,
            mem_type=data["mem_type"],
            device_id=count("device_id", 0),
            agent=agent,
        )


def full_block_rows(
    chunk_addrs: Sequence[int],
    first_sub_blocks: Sequence[int],
    block_counts: Sequence[int],
    layers: Sequence[int],
    layer_stride: int,
    outer: int,
    block_bytes: int,
) -> np.ndarray:
    """NIXL rows of hit blocks inside Full Blocks held in host memory, ordered like :meth:`KVRegions.rows`.

    Chunk ``j``'s layer 0 is at ``chunk_addrs[j]``, its layer ``l`` ``l * layer_stride``
    further (one Layer Block in a chunk-major buffer, a band in a layer-major one);
    its blocks ``first_sub_blocks[j] .. + block_counts[j]`` are the ones wanted. Within a
    Layer Block, sub-block ``i``'s outer slice ``o`` is at ``(i * outer + o) * block_bytes``.
    """
    starts = np.repeat(np.asarray(chunk_addrs, dtype=np.uint64), block_counts)
    subs = np.concatenate(
        [np.arange(first, first + n, dtype=np.uint64) for first, n in zip(first_sub_blocks, block_counts)]
    ) if len(block_counts) else np.empty(0, dtype=np.uint64)  # fmt: skip
    first = starts + subs * np.uint64(outer * block_bytes)
    layer_offsets = np.asarray(layers, dtype=np.uint64) * np.uint64(layer_stride)
    outer_offsets = np.arange(outer, dtype=np.uint64) * np.uint64(block_bytes)
    return descriptors(layer_offsets[:, None, None] + first[None, :, None] + outer_offsets, block_bytes)
