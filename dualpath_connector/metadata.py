"""Per-step metadata the scheduler half sends to the worker half (plain picklable dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


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
    # "pe": this engine reads the store; "de": the decode engine whose side
    # channel is ``de_side_channel`` reads it into its buffer, this engine pulls.
    read_side: str = "pe"
    de_side_channel: str | None = None
    # With a DE named: if that DE reads the hit (read side "de", or a read moved
    # there), it keeps the chunks under this token for its own decode of the
    # prompt and then pulls only the rest from this engine.
    keep_token: str | None = None

    def num_blocks(self) -> int:
        return sum(len(c.block_ids) for c in self.chunks)


@dataclass
class SaveSpec:
    """Chunks whose every token is computed by the end of this step, with their blocks."""

    req_id: str
    chunk_hashes: list[str]
    # One list per chunk: the chunk's blocks in token order.
    block_ids: list[list[int]]
    # Chunks recomputed after a failed load, some of them maybe stored already: write only those the store
    # lacks. Objects are immutable; KV recomputed in other step shapes may differ in its last bits, and a
    # re-put would change what every later hit of that prefix reads.
    only_missing: bool = False


@dataclass
class PullSpec:
    """DE: pull a prefilled prompt's KV from the PE that computed it.

    ``remote_block_ids[i]`` (PE) is copied into ``block_ids[i]`` (here).
    No ``block_ids``: nothing to pull (a local prefix hit, an aborted request),
    only the PE's blocks to release. ``block_ids`` without matching remote
    blocks: the PE's answer was unusable, so the pull fails and vLLM recomputes.
    ``remote_block_ids`` None: a push hand-off's (no ``remote_hold_token``):
    the PE's answer to the claim names its blocks, pulled from
    ``remote_first_block`` on.

    ``kept``: hit chunks this DE read for the PE and kept under ``kept_token``,
    with the blocks here they fill (a subset of ``block_ids``; hashes computed
    here from the prompt). Those that are still kept and match are copied in
    from the buffer and not pulled; any other is pulled like the rest.
    """

    req_id: str
    remote_side_channel: str
    remote_req_id: str
    remote_hold_token: str  # ends the PE's hold: sent with the pulled notification; "" in a push hand-off
    remote_block_ids: list[int] | None
    block_ids: list[int]
    remote_first_block: int = 0
    kept_token: str | None = None
    kept: list[ChunkLoad] = field(default_factory=list)


@dataclass
class SendSpec:
    """PE: a finished prefill's blocks are held until the DE's pull or ``expires_at`` (time.time()); DE: the same
    for a finished decode, until the next turn's PE pulls it (``retained``).

    Only a ``pulled:`` notification or ``release_hold`` message carrying ``hold_token`` ends the hold early.
    """

    req_id: str
    expires_at: float
    hold_token: str
    block_ids: list[int]  # a push hand-off's DE learns them from its claim
    retained: bool = False  # a DE's finished decode held for the next turn's PE (RetainedDecode), not a prefill


@dataclass
class DualPathMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    pulls: list[PullSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    # Tokens this step's forward computes (all requests): the worker learns its recompute rate from them.
    computed_tokens: int = 0
    # Requests that ended before their loaded KV was injected: their blocks
    # may already belong to another request, so the injection is dropped.
    dropped_req_ids: list[str] = field(default_factory=list)


@dataclass
class SavedChunks(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: the chunks whose store writes finished since the last step.

    ``stored`` counts the ranks that wrote each chunk hash (every TP/PP rank
    writes its own shard, so a chunk is durable once all ranks counted it);
    ``failed`` holds chunks some rank could not write (or skipped: full save buffer).
    ``writes`` counts the SaveSpecs the ranks finished (stored, failed or skipped), each counted once its
    stats were handed on: the scheduler keeps the engine stepping until every write it planned is counted,
    so a write that ends after the last request still reaches /metrics and the KV events.
    vLLM merges the ranks' metadata with :meth:`aggregate`.
    """

    stored: dict[str, int] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    writes: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> SavedChunks:
        assert isinstance(other, SavedChunks)
        for chunk_hash, ranks in other.stored.items():
            self.stored[chunk_hash] = self.stored.get(chunk_hash, 0) + ranks
        self.failed |= other.failed
        self.writes += other.writes
        return self
