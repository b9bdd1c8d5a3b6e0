"""The s3agg wire protocol, shared by the client (:mod:`nixl_backends.s3agg`) and ``s3agg-gateway``.

One request: ``POST /<bucket>?aggregate``, SigV4-signed, the request id in
``x-s3agg-request-id``, a JSON descriptor as body (:func:`descriptor_body`).
The gateway answers with the chosen mode in ``x-s3agg-mode`` and delivers

- to a NIXL target: WRITEs into the client's registered regions, each
  followed by a notification (:func:`encode_notification`), then a JSON
  summary as the response body;
- to an HTTP target: frames in the response body, each a :data:`FRAME`
  header (kind, index, payload length) and the payload.

Every delivery carries the chunks' integrity digests with their bytes
(:mod:`nixl_backends.integrity`), so the reader can verify what arrived; the
gateway moves them, it never checks them. With ``N`` chunks, ``L`` layers,
``S`` bytes per Layer Block and ``D`` (:data:`~nixl_backends.layout.DIGEST_BYTES`)
bytes per digest:

- chunk-major: one region per chunk, exactly the stored object
  (``L*S`` layer bytes, then the ``L*D`` trailer);
- layer-major: one region per layer of :func:`layer_region_bytes` ``= N*S + N*D``
  bytes: chunk ``j``'s Layer Block at ``j*S``, its digest of that layer at
  ``N*S + j*D``. A layer's notification or frame means both are in place;
- strided (version 3): one ``[layer 0 address, trailer address]`` pair per chunk
  and a ``layer_stride``: chunk ``j``'s layer ``l`` at ``regions[j][0] + l*layer_stride``,
  its digests (``L*D``, the stored trailer) at ``regions[j][1]``. A layer-major
  host pool's slots (``HostBufferPool(layer_major=...)``), where each layer of a
  hit is one run of every chunk's Layer Block.

Cancel: ``POST /<bucket>?aggregate&cancel``, signed the same way (empty body),
the request id in ``x-s3agg-request-id``. The gateway answers a NIXL request
only once its WRITEs ended: a 200, a 4xx, and a 5xx without
``x-s3agg-writes-may-land`` each say that none can land any more. A client
whose request ended without that word (its own timeout, a broken connection,
a 5xx with the header: a WRITE the gateway abandoned at its deadline) sends
the cancel before it reads anything else into the target: from then on no
WRITE of that request starts (one that arrives after its cancel is refused),
and the answer is ``{"stopped": true}`` once none is in flight, ``{"stopped":
false}`` while one may still land. Anything else (no answer, another status)
is no confirmation: the target must never be reused. The cancel is an
addition, not a new version: a gateway that predates it takes it for an
aggregate with an empty body (400), which confirms nothing, so the client
retires its buffers rather than risk them.

Nothing here talks to the network or NIXL; both sides import these names so
no part of the protocol is written twice.
"""

from __future__ import annotations

import base64
import json
import struct
import typing
from collections.abc import Sequence
from typing import Any, Literal

from nixl_backends.layout import DIGEST_BYTES

# Sent in every descriptor; a gateway refuses a descriptor of another version
# (or of none) before reading anything, naming both versions.
# 2: objects carry the integrity trailer; deliveries carry the digests (digest_bytes).
# 3: the strided target layout.
PROTOCOL_VERSION = 3

EXTENSION_QUERY = "aggregate"
REQUEST_ID_HEADER = "x-s3agg-request-id"
MODE_HEADER = "x-s3agg-mode"
CANCEL_QUERY = "cancel"  # with EXTENSION_QUERY: ?aggregate&cancel
CANCEL_STOPPED = "stopped"  # the cancel's JSON answer: {"stopped": bool}
WRITES_MAY_LAND_HEADER = "x-s3agg-writes-may-land"  # on a 5xx whose request had a WRITE abandoned: "true"

Mode = Literal["chunkwise", "layerwise"]
MODE_CHUNKWISE, MODE_LAYERWISE = typing.get_args(Mode)

# --- HTTP delivery ---------------------------------------------------------------------------------

FRAME = struct.Struct("<IIQ")  # kind, index (layer), payload length
FRAME_LAYER = 1  # layer ``index`` of every chunk and its digests: N*S + N*D bytes (layer-major)
FRAME_CHUNKS = 2  # every stored object in chunk order: N*L*(S + D) bytes
FRAME_END = 3  # the JSON summary; the stream ends
FRAME_ERROR = 4  # JSON {"code", "message"}; the stream ends

# --- NIXL delivery: one notification per delivered unit ---------------------------------------------

NOTIFICATION_PREFIX = "s3agg:"
ALL_LAYERS = "all"  # the token of a chunkwise delivery: every layer at once


def encode_notification(request_id: str, layer: int | None) -> bytes:
    """``s3agg:<request id>:<layer>``; ``layer=None`` (chunkwise) is ``...:all``."""
    return f"{NOTIFICATION_PREFIX}{request_id}:{ALL_LAYERS if layer is None else layer}".encode()


def parse_notification(message: bytes) -> tuple[str, str] | None:
    """``(request id, token)`` of a gateway notification (token: a layer number or ``all``), else None."""
    text = message.decode(errors="replace")
    if not text.startswith(NOTIFICATION_PREFIX):
        return None
    request_id, _, token = text[len(NOTIFICATION_PREFIX):].rpartition(":")
    return request_id, token


# --- the descriptor: the JSON body of the request ---------------------------------------------------

VERSION = "version"
CHUNK_KEYS = "chunk_keys"
NUM_LAYERS = "num_layers"
CHUNK_TOKENS = "chunk_tokens"
LAYER_BYTES = "per_layer_chunk_bytes"
DIGEST_BYTES_KEY = "digest_bytes"  # bytes per layer digest in the trailer; must be DIGEST_BYTES
DELIVERY = "delivery"
COMPUTE_WINDOW = "compute_window_s"  # optional: the per-layer compute window, for the scheduler
TARGET = "target"
DESCRIPTOR_KEYS = frozenset({VERSION, CHUNK_KEYS, NUM_LAYERS, CHUNK_TOKENS, LAYER_BYTES, DIGEST_BYTES_KEY, DELIVERY,
                             COMPUTE_WINDOW, TARGET})
# Layers are delivered in layer order; the only order there is.
DELIVERY_LAYER_MAJOR = "layer_major"

TARGET_TYPE = "type"
TARGET_NIXL, TARGET_HTTP = "nixl", "http"
AGENT_METADATA = "agent_metadata"  # base64 of the client agent's NIXL metadata
TARGET_LAYOUT = "layout"
REGIONS = "regions"  # [[addr, length], ...]; strided: [[layer 0 addr, trailer addr], ...]
LAYER_STRIDE = "layer_stride"  # strided only: bytes from a chunk's layer l to its layer l + 1
NIXL_TARGET_KEYS = frozenset({TARGET_TYPE, AGENT_METADATA, TARGET_LAYOUT, REGIONS, LAYER_STRIDE})
# layer_major: one region per layer (layer_region_bytes), chunk j of layer l at regions[l] + j*S,
#   its digest at regions[l] + N*S + j*D.
# chunk_major: one region per chunk (the stored object), layer l at regions[j] + l*S, its digest
#   at regions[j] + L*S + l*D.
# strided: one [layer 0, trailer] pair per chunk, layer l at regions[j][0] + l*layer_stride, its digest
#   at regions[j][1] + l*D.
TargetLayout = Literal["layer_major", "chunk_major", "strided"]
LAYOUT_LAYER_MAJOR, LAYOUT_CHUNK_MAJOR, LAYOUT_STRIDED = typing.get_args(TargetLayout)


def layer_region_bytes(num_chunks: int, layer_bytes: int) -> int:
    """Bytes of one layer-major region: every chunk's Layer Block, then their digests."""
    return num_chunks * (layer_bytes + DIGEST_BYTES)


def http_target() -> dict[str, Any]:
    return {TARGET_TYPE: TARGET_HTTP}


def nixl_target(agent_metadata: bytes, layout: TargetLayout, regions: Sequence[Sequence[int]],
                layer_stride: int | None = None) -> dict[str, Any]:  # fmt: skip
    """``regions``: ``[addr, length]`` per region, or for ``strided`` ``[layer 0, trailer]`` per chunk."""
    target = {
        TARGET_TYPE: TARGET_NIXL,
        TARGET_LAYOUT: layout,
        REGIONS: [[int(a), int(b)] for a, b in regions],
        AGENT_METADATA: base64.b64encode(agent_metadata).decode(),
    }
    if layout == LAYOUT_STRIDED:
        target[LAYER_STRIDE] = int(layer_stride or 0)
    return target


def descriptor_body(
    chunk_keys: Sequence[str],
    num_layers: int,
    chunk_tokens: int,
    layer_bytes: int,
    target: dict[str, Any],
    compute_window_s: float | None = None,
) -> bytes:
    """The request body; ``target`` from :func:`nixl_target` or :func:`http_target`."""
    body: dict[str, Any] = {
        VERSION: PROTOCOL_VERSION,
        CHUNK_KEYS: list(chunk_keys),
        NUM_LAYERS: num_layers,
        CHUNK_TOKENS: chunk_tokens,
        LAYER_BYTES: layer_bytes,
        DIGEST_BYTES_KEY: DIGEST_BYTES,
        DELIVERY: DELIVERY_LAYER_MAJOR,
        TARGET: target,
    }
    if compute_window_s is not None:
        body[COMPUTE_WINDOW] = compute_window_s
    return json.dumps(body).encode()
