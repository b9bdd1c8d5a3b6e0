"""The aggregated-read descriptor (ObjectCache Table 1): parsing and full validation.

Everything that can be checked without touching the store is checked here,
before the gateway reads a byte: field types, sizes against the configured
limits, and the delivery target's regions (count, length, overlap). Object
existence and sizes are checked by the aggregator, still before any read.

Wire form (JSON body of ``POST /<bucket>?aggregate``)::

    {"chunk_keys": [...], "num_layers": L, "chunk_tokens": G, "per_layer_chunk_bytes": S,
     "delivery": "layer_major", "compute_window_s": 0.01,          # optional, per layer
     "target": {"type": "http"}
            | {"type": "nixl", "agent_metadata": "<base64>", "layout": "layer_major" | "chunk_major",
               "regions": [[addr, length], ...]}}

``layer_major`` regions: one per layer, chunk ``j`` of layer ``l`` at ``regions[l] + j*S``.
``chunk_major`` regions: one per chunk (a Full Block), layer ``l`` at ``regions[j] + l*S``.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from s3agg_gateway_ext.config import GatewayConfig

_MAX_KEY_BYTES = 1024  # S3's own limit on key length
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
    layout: Literal["layer_major", "chunk_major"]
    # (addr, length) per region, as int64 arrays for vectorised address arithmetic.
    addrs: np.ndarray
    lengths: np.ndarray

    def remote_addrs(self, chunks: np.ndarray, layers: np.ndarray, layer_bytes: int) -> np.ndarray:
        """Client addresses of (chunk, layer) slices; arguments broadcast against each other."""
        if self.layout == "layer_major":
            return self.addrs[layers] + chunks * layer_bytes
        return self.addrs[chunks] + layers * layer_bytes


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
    compute_window_s: float | None
    target: NixlTarget | HttpTarget

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_keys)

    @property
    def full_block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def payload_bytes(self) -> int:
        return self.num_chunks * self.full_block_bytes


def _int_field(body: dict[str, Any], name: str, low: int, high: int) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise DescriptorError(400, "InvalidArgument", f"{name}={value} outside [{low}, {high}]")
    return value


def _parse_target(raw: Any, num_chunks: int, num_layers: int, layer_bytes: int) -> NixlTarget | HttpTarget:
    if not isinstance(raw, dict):
        raise _bad(f"target must be an object, got {raw!r}")
    kind = raw.get("type")
    if kind == "http":
        if set(raw) != {"type"}:
            raise _bad(f"unknown target keys {sorted(set(raw) - {'type'})}")
        return HttpTarget()
    if kind != "nixl":
        raise _bad(f"target.type must be 'nixl' or 'http', got {kind!r}")
    unknown = set(raw) - {"type", "agent_metadata", "layout", "regions"}
    if unknown:
        raise _bad(f"unknown target keys {sorted(unknown)}")
    try:
        metadata = base64.b64decode(raw.get("agent_metadata", ""), validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise _bad("target.agent_metadata must be base64") from None
    if not metadata:
        raise _bad("target.agent_metadata is empty")
    layout = raw.get("layout")
    if layout not in ("layer_major", "chunk_major"):
        raise _bad(f"target.layout must be 'layer_major' or 'chunk_major', got {layout!r}")
    regions = raw.get("regions")
    if not isinstance(regions, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
        for r in regions
    ):
        raise _bad("target.regions must be a list of [addr, length] integer pairs")
    expected, needed = (num_layers, num_chunks * layer_bytes) if layout == "layer_major" else (
        num_chunks, num_layers * layer_bytes)
    if len(regions) != expected:
        raise DescriptorError(400, "InvalidTarget", f"{layout} target needs {expected} regions, got {len(regions)}")
    pairs = np.array(regions, dtype=object)
    if any(a <= 0 or n < 0 or a + n > _ADDR_LIMIT for a, n in regions):
        raise DescriptorError(400, "InvalidTarget", "target region outside the 64-bit address space")
    addrs = pairs[:, 0].astype(np.int64)
    lengths = pairs[:, 1].astype(np.int64)
    short = np.flatnonzero(lengths < needed)
    if short.size:
        i = int(short[0])
        raise DescriptorError(
            400, "InvalidTarget", f"target region {i} has {int(lengths[i])} bytes, needs {needed}")
    order = np.argsort(addrs, kind="stable")
    ends = addrs[order] + lengths[order]
    overlap = np.flatnonzero(ends[:-1] > addrs[order][1:])
    if overlap.size:
        a, b = int(order[overlap[0]]), int(order[overlap[0] + 1])
        raise DescriptorError(400, "InvalidTarget", f"target regions {a} and {b} overlap")
    return NixlTarget(metadata, layout, addrs, lengths)


def parse_descriptor(bucket: str, body: bytes, config: GatewayConfig) -> Descriptor:
    """Parse and validate a request body; raises :class:`DescriptorError` naming the problem."""
    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(f"body is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise _bad("body must be a JSON object")
    unknown = set(raw) - {"chunk_keys", "num_layers", "chunk_tokens", "per_layer_chunk_bytes", "delivery",
                          "compute_window_s", "target"}
    if unknown:
        raise _bad(f"unknown descriptor keys {sorted(unknown)}")
    keys = raw.get("chunk_keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        raise _bad("chunk_keys must be a list of non-empty strings")
    if not 1 <= len(keys) <= config.max_chunks:
        raise DescriptorError(400, "InvalidArgument", f"{len(keys)} chunk_keys outside [1, {config.max_chunks}]")
    long_key = next((k for k in keys if len(k.encode()) > _MAX_KEY_BYTES), None)
    if long_key is not None:
        raise DescriptorError(400, "KeyTooLongError", f"key longer than {_MAX_KEY_BYTES} bytes: {long_key[:64]}...")
    num_layers = _int_field(raw, "num_layers", 1, config.max_layers)
    chunk_tokens = _int_field(raw, "chunk_tokens", 1, 1 << 20)
    layer_bytes = _int_field(raw, "per_layer_chunk_bytes", 1, config.max_layer_chunk_bytes)
    payload = len(keys) * num_layers * layer_bytes
    if payload > config.max_payload_bytes:
        raise DescriptorError(
            400, "InvalidArgument", f"payload {payload} bytes exceeds max_payload_bytes {config.max_payload_bytes}")
    if raw.get("delivery", "layer_major") != "layer_major":
        raise _bad(f"delivery must be 'layer_major', got {raw.get('delivery')!r}")
    window = raw.get("compute_window_s")
    if window is not None and (not isinstance(window, (int, float)) or isinstance(window, bool) or window <= 0):
        raise _bad(f"compute_window_s must be a positive number, got {window!r}")
    target = _parse_target(raw.get("target"), len(keys), num_layers, layer_bytes)
    return Descriptor(bucket, tuple(keys), num_layers, chunk_tokens, layer_bytes,
                      float(window) if window is not None else None, target)
