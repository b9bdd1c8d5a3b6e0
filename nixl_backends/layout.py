"""The data model every component shares: namespace, chunk hash chain, block arithmetic, keys.

A chunk is ``chunk_tokens`` consecutive tokens. Its hash chains over all tokens
before it (``H_i = sha256(H_{i-1} || tokens_i)``), seeded by the namespace
digest, so a key names one exact prefix under one exact byte layout. Hashes
never depend on Python's ``hash`` or ``PYTHONHASHSEED``: the same tokens give
the same key in any process on any machine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

# Token ids are serialised as little-endian int64 so the chain is independent
# of the vocabulary size and of the host's byte order.
_TOKEN_DTYPE = np.dtype("<i8")
HASH_HEX_CHARS = 64
# One integrity digest per Layer Block, in a trailer after the Full Block
# (:mod:`nixl_backends.integrity`); part of the stored format, so fixed.
DIGEST_BYTES = 16


@dataclass(frozen=True)
class KVNamespace:
    """Everything that makes stored KV bytes incompatible with another engine's.

    Two engines share stored chunks exactly when their namespaces are equal.
    """

    model: str
    dtype: str
    block_size: int
    chunk_tokens: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    kv_layout: str
    layer_block_bytes: int
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    # Device platform and attention backend: they decide the byte order of a block.
    platform: str = ""
    # How the trailers are computed (nixl_backends.integrity.integrity_tag).
    integrity: str = "xxh3-128"

    def digest(self) -> str:
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class BlockLayout:
    """Full Block / Layer Block arithmetic of a stored chunk object.

    A Full Block is the chunk's Layer Blocks concatenated in layer order: the
    bytes of layer ``l`` are ``[l*S, (l+1)*S)`` with ``S = layer_block_bytes``.
    The object stored per chunk is the Full Block followed by its trailer, one
    ``DIGEST_BYTES`` digest per layer. Readers find a layer and its digest by
    this arithmetic alone, without a manifest.
    """

    num_layers: int
    layer_block_bytes: int

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or self.layer_block_bytes <= 0:
            raise ValueError(
                f"num_layers and layer_block_bytes must be positive, got "
                f"{self.num_layers} and {self.layer_block_bytes}"
            )

    @property
    def full_block_bytes(self) -> int:
        return self.num_layers * self.layer_block_bytes

    @property
    def trailer_bytes(self) -> int:
        return self.num_layers * DIGEST_BYTES

    @property
    def object_bytes(self) -> int:
        """Bytes of one stored chunk object: the Full Block and its trailer."""
        return self.full_block_bytes + self.trailer_bytes

    def layer_range(self, layer: int) -> tuple[int, int]:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside [0, {self.num_layers})")
        start = layer * self.layer_block_bytes
        return start, start + self.layer_block_bytes

    def digest_range(self, layer: int) -> tuple[int, int]:
        """Where layer ``layer``'s digest sits in the object."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside [0, {self.num_layers})")
        start = self.full_block_bytes + layer * DIGEST_BYTES
        return start, start + DIGEST_BYTES


def chunk_hashes(
    namespace_digest: str,
    token_ids: Sequence[int],
    chunk_tokens: int,
    *,
    start_chunk: int = 0,
    previous_hash: str | None = None,
) -> list[str]:
    """Hex hashes of every *full* chunk of ``token_ids`` from ``start_chunk`` on.

    To extend a chain incrementally pass the hash of chunk ``start_chunk - 1``
    as ``previous_hash``; the result is then identical to hashing from zero.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if start_chunk > 0 and not previous_hash:
        raise ValueError("previous_hash is required when start_chunk > 0")
    num_chunks = len(token_ids) // chunk_tokens
    if start_chunk >= num_chunks:
        return []
    tokens = np.asarray(
        token_ids[start_chunk * chunk_tokens : num_chunks * chunk_tokens], dtype=_TOKEN_DTYPE
    ).tobytes()
    chunk_bytes = chunk_tokens * _TOKEN_DTYPE.itemsize
    prev = bytes.fromhex(previous_hash) if previous_hash is not None else hashlib.sha256(namespace_digest.encode()).digest()
    out: list[str] = []
    for offset in range(0, len(tokens), chunk_bytes):
        prev = hashlib.sha256(prev + tokens[offset : offset + chunk_bytes]).digest()
        out.append(prev.hex())
    return out


def isolated_chain(namespace_digest: str, *, cache_salt: str | None = None, lora: tuple[str, str] | None = None) -> str:
    """The digest a request's chunk hash chain starts from (what :func:`chunk_hashes` takes).

    A request whose KV differs behind the same token ids gets a chain of its own: vLLM's ``cache_salt`` (a
    tenant's isolation), a LoRA adapter (``(name, path)``: its name and where it was loaded from). Its chunks
    then have other hashes, so other keys and other trailers: nothing is shared across salts, adapters, or with
    plain requests, and a lookup without the salt cannot find them. Plain requests chain from the namespace
    digest itself (their keys are unchanged). The parts are JSON-encoded: no two inputs give the same text.
    """
    if not cache_salt and lora is None:
        return namespace_digest
    parts = ["dualpath-chain/1", namespace_digest, cache_salt or None, list(lora) if lora is not None else None]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def shard_chunk_hash(shard_digest: str, chunk_hash: str) -> str:
    """The hash one rank's shard of chunk ``chunk_hash`` is stored under, in namespace ``shard_digest``."""
    return hashlib.sha256(bytes.fromhex(chunk_hash) + shard_digest.encode()).hexdigest()


def chunk_key(prefix: str, namespace_digest: str, chunk_hash: str) -> str:
    """``<prefix>/<namespace>/<hh>/<hash>``: a file under a POSIX root, an object in a bucket.

    The two-character fan-out keeps directories small on file systems.
    """
    if len(chunk_hash) != HASH_HEX_CHARS or chunk_hash.strip("0123456789abcdef"):
        raise ValueError(f"chunk hash must be {HASH_HEX_CHARS} hex characters, got {chunk_hash!r}")
    parts = [p for p in (prefix.strip("/"), namespace_digest, chunk_hash[:2], chunk_hash) if p]
    return "/".join(parts)
