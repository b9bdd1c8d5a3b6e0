"""Per-step metadata the scheduler half sends to the worker half (plain picklable dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class ChunkLoad:
    """One stored chunk to read, and which of its blocks land where.

    Chunks travel as hashes: each worker names the key with its own rank's
    namespace, since every TP/PP rank stores its own shard of a chunk.

    ``block_ids[i]`` receives sub-block ``first_sub_block + i`` of the chunk;
    leading sub-blocks already held by the local prefix cache are skipped.
    """

    chunk_hash: str
    first_sub_block: int
    block_ids: list[int]


@dataclass
class LoadSpec:
    req_id: str
    chunks: list[ChunkLoad]


@dataclass
class SaveSpec:
    """Chunks whose every token is computed by the end of this step, with their blocks."""

    req_id: str
    chunk_hashes: list[str]
    # One list per chunk: the chunk's blocks in token order.
    block_ids: list[list[int]]


@dataclass
class DualPathMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
