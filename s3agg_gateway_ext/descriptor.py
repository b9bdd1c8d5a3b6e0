"""The aggregated-read descriptor (ObjectCache Table 1): parsing and full validation.

Everything that can be checked without touching the store is checked here,
before the gateway reads a byte: field types, sizes against the configured
limits, and the delivery target's regions (count, length, overlap). Object
existence and sizes are checked by the aggregator, still before any read.

Wire form (JSON body of ``POST /<bucket>?aggregate``, names in
:mod:`nixl_backends.s3agg_protocol`)::

    {"version": 2, "chunk_keys": [...], "num_layers": L, "chunk_tokens": G, "per_layer_chunk_bytes": S,
     "digest_bytes": D, "delivery": "layer_major", "compute_window_s": 0.01,   # optional, per layer
     "target": {"type": "http"}
            | {"type": "nixl", "agent_metadata": "<base64>", "layout": "layer_major" | "chunk_major",
               "regions": [[addr, length], ...]}}

Each stored object is ``L*(S + D)`` bytes: the Full Block, then one ``D``-byte
digest per layer (``D`` must be :data:`~nixl_backends.layout.DIGEST_BYTES`).
``layer_major`` regions: one per layer of ``N*S + N*D`` bytes, chunk ``j`` of layer ``l`` at
``regions[l] + j*S``, its digest at ``regions[l] + N*S + j*D``.
``chunk_major`` regions: one per chunk, the stored object (layer ``l`` at ``regions[j] + l*S``,
its digest at ``regions[j] + L*S + l*D``).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from nixl_backends.layout import DIGEST_BYTES
from nixl_backends.s3agg_protocol import (
    AGENT_METADATA,
    CHUNK_KEYS,
    CHUNK_TOKENS,
    COMPUTE_WINDOW,
    DELIVERY,
    DELIVERY_LAYER_MAJOR,
    DESCRIPTOR_KEYS,
    DIGEST_BYTES_KEY,
    LAYER_BYTES,
    LAYER_STRIDE,
    LAYOUT_CHUNK_MAJOR,
    LAYOUT_LAYER_MAJOR,
    LAYOUT_STRIDED,
    NIXL_TARGET_KEYS,
    NUM_LAYERS,
    PROTOCOL_VERSION,
    REGIONS,
    TARGET,
    TARGET_HTTP,
    TARGET_LAYOUT,
    TARGET_NIXL,
    TARGET_TYPE,
    VERSION,
    TargetLayout,
)
from s3agg_gateway_ext.config import GatewayConfig

_MAX_KEY_BYTES = 1024  # S3's own limit on key length
# A per-layer compute window longer than this is no window (a layer of a forward is milliseconds to a second).
_MAX_COMPUTE_WINDOW_S = 60.0
_ADDR_LIMIT = 1 << 64


class DescriptorError(Exception):
    """A request the gateway refuses; carries the S3-style error code and HTTP status."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def _bad(message: str) -> DescriptorError:
    return DescriptorError(400, "MalformedDescriptor", message)


@dataclass(frozen=True)
class NixlTarget:
    agent_metadata: bytes
    layout: TargetLayout
    # (addr, length) per region, as int64 arrays for vectorised address arithmetic; strided: each chunk's
    # layer 0 address (lengths: one Layer Block), its trailer's address, and the stride between layers.
    addrs: np.ndarray
    lengths: np.ndarray
    layer_stride: int = 0
    trailer_addrs: np.ndarray | None = None
    # Every byte range the gateway writes (what the client must have registered).
    span_addrs: np.ndarray | None = None
    span_lengths: np.ndarray | None = None

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        return (self.addrs, self.lengths) if self.span_addrs is None else (self.span_addrs, self.span_lengths)


@dataclass(frozen=True)
class HttpTarget:
    pass


@dataclass(frozen=True)
class Descriptor:
    bucket: str
    chunk_keys: tuple[str, ...]
    num_layers: int
    chunk_tokens: int
    layer_bytes: int
    digest_bytes: int
    compute_window_s: float | None
    target: NixlTarget | HttpTarget

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_keys)

    @property
    def full_block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def object_bytes(self) -> int:
        """One stored object: the Full Block and its trailer of one digest per layer."""
        return self.num_layers * (self.layer_bytes + self.digest_bytes)

    @property
    def layer_unit_bytes(self) -> int:
        """One layer of every chunk with its digests: what a layer delivery moves."""
        return self.num_chunks * (self.layer_bytes + self.digest_bytes)

    @property
    def payload_bytes(self) -> int:
        """Every byte delivered (digests included): Theta, limits, scheduling and metrics count this."""
        return self.num_chunks * self.object_bytes

    def target_addrs(self, chunks: np.ndarray, layers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Client addresses of (chunk, layer) Layer Blocks and of their digests; arguments broadcast."""
        target = self.target
        assert isinstance(target, NixlTarget)
        s, d = self.layer_bytes, self.digest_bytes
        if target.layout == LAYOUT_LAYER_MAJOR:
            region = target.addrs[layers]
            return region + chunks * s, region + self.num_chunks * s + chunks * d
        if target.layout == LAYOUT_STRIDED:
            return target.addrs[chunks] + layers * target.layer_stride, target.trailer_addrs[chunks] + layers * d
        region = target.addrs[chunks]
        return region + layers * s, region + self.full_block_bytes + layers * d


def _int_field(body: dict[str, Any], name: str, low: int, high: int) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise DescriptorError(400, "InvalidArgument", f"{name}={value} outside [{low}, {high}]")
    return value


def _parse_target(raw: Any, num_chunks: int, num_layers: int, layer_bytes: int,
                  digest_bytes: int) -> NixlTarget | HttpTarget:
    if not isinstance(raw, dict):
        raise _bad(f"{TARGET} must be an object, got {raw!r}")
    kind = raw.get(TARGET_TYPE)
    if kind == TARGET_HTTP:
        if set(raw) != {TARGET_TYPE}:
            raise _bad(f"unknown {TARGET} keys {sorted(set(raw) - {TARGET_TYPE})}")
        return HttpTarget()
    if kind != TARGET_NIXL:
        raise _bad(f"{TARGET}.{TARGET_TYPE} must be {TARGET_NIXL!r} or {TARGET_HTTP!r}, got {kind!r}")
    unknown = set(raw) - NIXL_TARGET_KEYS
    if unknown:
        raise _bad(f"unknown {TARGET} keys {sorted(unknown)}")
    try:
        metadata = base64.b64decode(raw.get(AGENT_METADATA, ""), validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise _bad(f"{TARGET}.{AGENT_METADATA} must be base64") from None
    if not metadata:
        raise _bad(f"{TARGET}.{AGENT_METADATA} is empty")
    layout = raw.get(TARGET_LAYOUT)
    if layout not in (LAYOUT_LAYER_MAJOR, LAYOUT_CHUNK_MAJOR, LAYOUT_STRIDED):
        raise _bad(f"{TARGET}.{TARGET_LAYOUT} must be {LAYOUT_LAYER_MAJOR!r}, {LAYOUT_CHUNK_MAJOR!r} or "
                   f"{LAYOUT_STRIDED!r}, got {layout!r}")  # fmt: skip
    if (LAYER_STRIDE in raw) != (layout == LAYOUT_STRIDED):
        raise _bad(f"{TARGET}.{LAYER_STRIDE} is given with the {LAYOUT_STRIDED!r} layout and only with it")
    regions = raw.get(REGIONS)
    if not isinstance(regions, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
        for r in regions
    ):
        raise _bad(f"{TARGET}.{REGIONS} must be a list of [addr, length] integer pairs")
    if any(a <= 0 or n < 0 or a + n > _ADDR_LIMIT for a, n in regions):
        raise DescriptorError(400, "InvalidTarget", "target region outside the 64-bit address space")
    if layout == LAYOUT_STRIDED:
        return _strided_target(metadata, regions, raw.get(LAYER_STRIDE), num_chunks, num_layers, layer_bytes,
                               digest_bytes)  # fmt: skip
    expected, needed = (num_layers, num_chunks * (layer_bytes + digest_bytes)) if layout == LAYOUT_LAYER_MAJOR \
        else (num_chunks, num_layers * (layer_bytes + digest_bytes))
    if len(regions) != expected:
        raise DescriptorError(400, "InvalidTarget", f"{layout} target needs {expected} regions, got {len(regions)}")
    pairs = np.array(regions, dtype=object)
    addrs = pairs[:, 0].astype(np.int64)
    lengths = pairs[:, 1].astype(np.int64)
    short = np.flatnonzero(lengths < needed)
    if short.size:
        i = int(short[0])
        raise DescriptorError(
            400, "InvalidTarget", f"target region {i} has {int(lengths[i])} bytes, needs {needed}")
    _refuse_overlaps(addrs, lengths, "target regions")
    return NixlTarget(metadata, layout, addrs, lengths)


def _strided_target(metadata: bytes, regions: list, stride: Any, num_chunks: int, num_layers: int,
                    layer_bytes: int, digest_bytes: int) -> NixlTarget:  # fmt: skip
    """Per chunk ``[layer 0, trailer]``: every Layer Block and trailer written must lie apart from every other."""
    if not isinstance(stride, int) or isinstance(stride, bool) or not layer_bytes <= stride < _ADDR_LIMIT:
        raise DescriptorError(400, "InvalidTarget", f"{TARGET}.{LAYER_STRIDE} must be an integer >= {layer_bytes}, "
                                                    f"got {stride!r}")  # fmt: skip
    if len(regions) != num_chunks:
        raise DescriptorError(400, "InvalidTarget", f"{LAYOUT_STRIDED} target needs {num_chunks} regions, got {len(regions)}")
    pairs = np.array(regions, dtype=object)
    firsts, trailers = pairs[:, 0].astype(object), pairs[:, 1].astype(object)
    if any(a + (num_layers - 1) * stride + layer_bytes > _ADDR_LIMIT for a in firsts):
        raise DescriptorError(400, "InvalidTarget", "target region outside the 64-bit address space")
    firsts, trailers = firsts.astype(np.int64), trailers.astype(np.int64)
    blocks = (firsts[:, None] + np.arange(num_layers, dtype=np.int64) * stride).ravel()
    span_addrs = np.concatenate([blocks, trailers])
    span_lengths = np.concatenate([np.full(blocks.size, layer_bytes), np.full(trailers.size, num_layers * digest_bytes)])
    _refuse_overlaps(span_addrs, span_lengths, "target Layer Blocks and trailers")
    return NixlTarget(metadata, LAYOUT_STRIDED, firsts, np.full(firsts.size, layer_bytes), stride, trailers, span_addrs,
                      span_lengths)


def _refuse_overlaps(addrs: np.ndarray, lengths: np.ndarray, what: str) -> None:
    order = np.argsort(addrs, kind="stable")
    ends = addrs[order] + lengths[order]
    overlap = np.flatnonzero(ends[:-1] > addrs[order][1:])
    if overlap.size:
        a, b = int(order[overlap[0]]), int(order[overlap[0] + 1])
        raise DescriptorError(400, "InvalidTarget", f"{what} {a} and {b} overlap")


def _check_version(raw: dict[str, Any]) -> None:
    # An absent version is refused too: every client of this protocol sends
    # one, and guessing what an unversioned body means is what versions avoid.
    version = raw.get(VERSION)
    if type(version) is not int or version != PROTOCOL_VERSION:
        got = "no version" if version is None else f"version {version!r}"
        raise DescriptorError(
            400, "UnsupportedProtocolVersion",
            f"descriptor has {got}; this gateway speaks s3agg protocol version {PROTOCOL_VERSION}")


def _refuse_constant(name: str) -> None:
    # Python's json takes NaN, Infinity and -Infinity, which JSON does not have.
    raise _bad(f"{name} is not a JSON number")


def parse_descriptor(bucket: str, body: bytes, config: GatewayConfig) -> Descriptor:
    """Parse and validate a request body; raises :class:`DescriptorError` naming the problem."""
    try:
        raw = json.loads(body, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(f"body is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise _bad("body must be a JSON object")
    # Before anything else: another version may have other keys.
    _check_version(raw)
    unknown = set(raw) - DESCRIPTOR_KEYS
    if unknown:
        raise _bad(f"unknown descriptor keys {sorted(unknown)}")
    keys = raw.get(CHUNK_KEYS)
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        raise _bad(f"{CHUNK_KEYS} must be a list of non-empty strings")
    if not 1 <= len(keys) <= config.max_chunks:
        raise DescriptorError(400, "InvalidArgument", f"{len(keys)} {CHUNK_KEYS} outside [1, {config.max_chunks}]")
    long_key = next((k for k in keys if len(k.encode()) > _MAX_KEY_BYTES), None)
    if long_key is not None:
        raise DescriptorError(400, "KeyTooLongError", f"key longer than {_MAX_KEY_BYTES} bytes: {long_key[:64]}...")
    num_layers = _int_field(raw, NUM_LAYERS, 1, config.max_layers)
    chunk_tokens = _int_field(raw, CHUNK_TOKENS, 1, 1 << 20)
    layer_bytes = _int_field(raw, LAYER_BYTES, 1, config.max_layer_chunk_bytes)
    # Fixed by the stored format: a client that assumes another trailer would misplace every digest.
    digest_bytes = raw.get(DIGEST_BYTES_KEY)
    if type(digest_bytes) is not int or digest_bytes != DIGEST_BYTES:
        raise DescriptorError(400, "InvalidArgument", f"{DIGEST_BYTES_KEY}={digest_bytes!r}: stored chunk objects "
                                                      f"carry {DIGEST_BYTES}-byte layer digests")
    payload = len(keys) * num_layers * (layer_bytes + digest_bytes)
    if payload > config.max_payload_bytes:
        raise DescriptorError(
            400, "InvalidArgument", f"payload {payload} bytes exceeds max_payload_bytes {config.max_payload_bytes}")
    if raw.get(DELIVERY, DELIVERY_LAYER_MAJOR) != DELIVERY_LAYER_MAJOR:
        raise _bad(f"{DELIVERY} must be {DELIVERY_LAYER_MAJOR!r}, got {raw.get(DELIVERY)!r}")
    window = raw.get(COMPUTE_WINDOW)
    # Finite and bounded: 1e999 parses as inf, and an infinite window stopped the bandwidth scheduler's thread.
    if window is not None and (not isinstance(window, (int, float)) or isinstance(window, bool)
                               or not 0 < window <= _MAX_COMPUTE_WINDOW_S):  # fmt: skip
        raise _bad(f"{COMPUTE_WINDOW} must be a number of seconds in (0, {_MAX_COMPUTE_WINDOW_S}], got {window!r}")
    target = _parse_target(raw.get(TARGET), len(keys), num_layers, layer_bytes, digest_bytes)
    return Descriptor(bucket, tuple(keys), num_layers, chunk_tokens, layer_bytes, digest_bytes,
                      float(window) if window is not None else None, target)
