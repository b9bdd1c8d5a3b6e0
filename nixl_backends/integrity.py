"""Chunk integrity: a digest per Layer Block, stored in a trailer after the Full Block.

A stored chunk object is ``[layer 0 | layer 1 | ... | layer L-1 | d_0 | ... | d_{L-1}]``:
the Full Block keeps layer ``l`` at ``[l*S, (l+1)*S)`` as before, so range
readers (layerwise loads, the s3agg gateway) still find a layer by arithmetic,
and the trailer holds one ``DIGEST_BYTES`` digest per layer at
``full_block_bytes + l*DIGEST_BYTES`` (:class:`~nixl_backends.layout.BlockLayout`).
A reader that holds one layer and its digest can check that layer alone.

Why a trailer and not object metadata: POSIX files have none that every file
system keeps, NIXL's OBJ plugin neither writes nor returns S3 user metadata,
and a trailer is written and read by the same transfer as the data, so the
bytes and their digests can never come from two different writes.

Each digest covers the chunk hash, the layer index and the layer's bytes, so
a valid layer copied to another chunk or another layer position fails too.
Two modes, both 16-byte digests:

- ``checksum``: XXH3-128 (native, tens of GB/s). Catches corruption and
  truncation; anyone can recompute it, so it does not stop a writer who means harm.
- ``keyed``: keyed BLAKE3 (a MAC; native, SIMD) under a key derived from a
  secret shared by every engine of the deployment (``DUALPATH_INTEGRITY_KEY``).
  A writer without the key cannot make a chunk that verifies.

The algorithm, and in keyed mode a fingerprint of the key, are part of the
namespace (:class:`~nixl_backends.layout.KVNamespace`, :func:`integrity_tag`):
chunks of one mode or key are never read as another's, so two deployments
with different keys never count each other's chunks as corrupt, and rotating
the key starts a new (cold) namespace.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Sequence
from typing import Literal

import blake3
import numpy as np
import xxhash

from nixl_backends.configuration import ConfigError
from nixl_backends.layout import DIGEST_BYTES, HASH_HEX_CHARS, BlockLayout

logger = logging.getLogger(__name__)

INTEGRITY_KEY_ENV = "DUALPATH_INTEGRITY_KEY"
INTEGRITY_MODES = ("checksum", "keyed")
IntegrityMode = Literal["checksum", "keyed"]
# As the shipped configs: a store anyone else can write to must not be able to put KV in front of a forward.
DEFAULT_INTEGRITY: IntegrityMode = "keyed"
ALGORITHMS = {"checksum": "xxh3-128", "keyed": "blake3-keyed"}
_MIN_SECRET_BYTES = 16
_KEY_CONTEXT = "dualpath-kv 2026 chunk integrity v1"
_FINGERPRINT_CONTEXT = "dualpath-kv 2026 integrity key fingerprint v1"


def integrity_tag(key: bytes | None) -> str:
    """What the namespace records: the algorithm, and which key (a one-way fingerprint, not the key)."""
    if key is None:
        return ALGORITHMS["checksum"]
    fingerprint = blake3.blake3(key, derive_key_context=_FINGERPRINT_CONTEXT).hexdigest()[:16]
    return f"{ALGORITHMS['keyed']}/{fingerprint}"


def integrity_key_from_env(mode: IntegrityMode, where: str = "") -> bytes | None:
    """The MAC key for ``mode`` (None for ``checksum``); a ConfigError naming the variable if unusable.

    The secret itself never appears in a message.
    """
    if mode not in INTEGRITY_MODES:
        raise ConfigError(f"bad value for {where}'integrity': {mode!r}; supported: {INTEGRITY_MODES}")
    if mode == "checksum":
        logger.warning("%sintegrity is 'checksum': XXH3 catches corruption and truncation, but anyone who can "
                       "write to the store can make a chunk that passes it and is served as KV; 'keyed' (the "
                       "default, with $%s) stops that", where, INTEGRITY_KEY_ENV)  # fmt: skip
        return None
    secret = os.environ.get(INTEGRITY_KEY_ENV, "")
    if len(secret.encode()) < _MIN_SECRET_BYTES:
        raise ConfigError(
            f"{where}integrity 'keyed' (the default) needs a secret of at least {_MIN_SECRET_BYTES} bytes in "
            f"${INTEGRITY_KEY_ENV} (the same on every engine of the deployment); integrity 'checksum' checks "
            "without one but does not stop a writer who means harm"
        )
    return derived_integrity_key(secret)


def derived_integrity_key(secret: str) -> bytes:
    """The MAC key of ``secret``: fixed-size from any secret; the context keeps it apart from other uses of it."""
    return blake3.blake3(secret.encode(), derive_key_context=_KEY_CONTEXT).digest()


def chunk_hash_of(key: str) -> str:
    """The chunk hash a store key ends with (``<prefix>/<namespace>/<hh>/<hash>``)."""
    chunk_hash = key.rsplit("/", 1)[-1]
    if len(chunk_hash) != HASH_HEX_CHARS:
        raise ValueError(f"not a chunk key: {key!r}")
    return chunk_hash


class ChunkIntegrity:
    """Seals Full Blocks with their trailer and verifies them, a whole chunk or one layer at a time.

    Buffers are anything exposing the buffer protocol (numpy views of the
    registered host pools); digests are computed by native code on them in
    place, without a copy.
    """

    def __init__(self, layout: BlockLayout, key: bytes | None = None) -> None:
        self.layout = layout
        self._key = key
        self.algorithm = ALGORITHMS["keyed" if key is not None else "checksum"]
        self.tag = integrity_tag(key)

    def _digest(self, hash_bytes: bytes, layer: int, data) -> bytes:
        """The digest of ``data``, layer ``layer`` of the chunk whose hash is ``hash_bytes``.

        Callers decode the hex chunk hash once per chunk, not once per layer.
        """
        tag = hash_bytes + layer.to_bytes(4, "little")
        if self._key is None:
            hasher = xxhash.xxh3_128(tag)
            hasher.update(data)
            return hasher.digest()
        hasher = blake3.blake3(tag, key=self._key)
        hasher.update(data)
        return hasher.digest(DIGEST_BYTES)

    def seal(self, chunk_hash: str, obj: np.ndarray) -> None:
        """Write the trailer of the Full Block in ``obj`` (``object_bytes`` uint8, writable)."""
        s, full = self.layout.layer_block_bytes, self.layout.full_block_bytes
        hash_bytes = bytes.fromhex(chunk_hash)
        view = memoryview(obj)
        for layer in range(self.layout.num_layers):
            start = full + layer * DIGEST_BYTES
            view[start : start + DIGEST_BYTES] = self._digest(hash_bytes, layer, view[layer * s : (layer + 1) * s])

    def verify_layer(self, chunk_hash: str, layer: int, data, digest) -> bool:
        """Whether ``data`` (one Layer Block) matches its stored ``digest``; constant-time compare."""
        return self._matches(bytes.fromhex(chunk_hash), layer, data, digest)

    def _matches(self, hash_bytes: bytes, layer: int, data, digest) -> bool:
        # compare_digest takes the stored digest's buffer as it is: no copy.
        return hmac.compare_digest(self._digest(hash_bytes, layer, data), memoryview(digest).cast("B"))

    def verify(self, chunk_hash: str, obj: np.ndarray) -> bool:
        """Whether every layer of the object in ``obj`` matches its trailer."""
        s, full = self.layout.layer_block_bytes, self.layout.full_block_bytes
        view = memoryview(obj)
        return self.verify_parts(chunk_hash, [view[layer * s : (layer + 1) * s] for layer in range(self.layout.num_layers)],
                                 view[full:])  # fmt: skip

    def verify_parts(self, chunk_hash: str, layers: Sequence, trailer) -> bool:
        """Whether every layer matches its digest, the object given in pieces: its Layer Blocks and its trailer
        (a layer-major pool's slot)."""
        hash_bytes = bytes.fromhex(chunk_hash)
        digests = memoryview(trailer).cast("B")
        return all(
            self._matches(hash_bytes, layer, data, digests[layer * DIGEST_BYTES : (layer + 1) * DIGEST_BYTES])
            for layer, data in enumerate(layers)
        )

    def verify_layer_major(self, chunk_hashes: Sequence[str], layer: int, region) -> int:
        """How many leading chunks of a layer-major region of layer ``layer`` verify.

        ``region`` holds one layer of ``n = len(chunk_hashes)`` chunks with their digests, as
        the s3agg gateway delivers it: chunk ``j``'s Layer Block at ``j*S``, its digest at
        ``n*S + j*DIGEST_BYTES`` (``n*(S + DIGEST_BYTES)`` bytes in all). A reader uses the
        chunks before the first one that fails.
        """
        s, n = self.layout.layer_block_bytes, len(chunk_hashes)
        view = memoryview(region).cast("B")
        if view.nbytes != n * (s + DIGEST_BYTES):
            raise ValueError(f"a layer-major region of {n} chunks is {n * (s + DIGEST_BYTES)} bytes, got {view.nbytes}")
        digests = n * s
        for j, chunk_hash in enumerate(chunk_hashes):
            digest = view[digests + j * DIGEST_BYTES : digests + (j + 1) * DIGEST_BYTES]
            if not self.verify_layer(chunk_hash, layer, view[j * s : (j + 1) * s], digest):
                return j
        return n
