"""The engine <-> router <-> bench contract, in one place and without a vLLM import.

Everything that crosses a process boundary between our components is defined
here and nowhere else:

- the ``kv_transfer_params`` the router sends a prefill engine
  (:class:`PrefillRequest`) and the hand-off a PE answers with and the router
  passes to a decode engine (:class:`PrefillHandoff`);
- the side-channel operations between engines (``hello``, ``read``,
  ``claim_hold``, ``release_hold``), their messages and the NIXL notification prefixes (``pulled:``, ``release:``);
- metric names (``dualpath_kv:*``) and the store key space an engine exports as
  the labels of ``dualpath_kv:store_namespace_info`` (:class:`StoreKeySpace`);
- one parser of Prometheus text (:func:`metric_samples`, :func:`metric_total`), and one reader of
  an engine's SSE stream's lines (:func:`sse_lines`).

Every message carries :data:`PROTOCOL_VERSION`; a peer speaking another
version is refused with a message naming both. Parsers validate types before
anything reaches an engine: hostile input raises :class:`ProtocolError`.
"""

from __future__ import annotations

import codecs
import dataclasses
import re
import secrets
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Literal

from nixl_backends.layout import BlockLayout, KVNamespace, chunk_hashes, chunk_key, shard_chunk_hash

# Bumped on any incompatible change of a message, a key or a label below.
# 2: side-channel messages are signed (cluster_auth); stored chunks carry integrity trailers.
# 3: the hello answer's KV regions carry num_blocks and block_stride (cross-layer layouts).
# 4: a DE keeps a hit it read for a PE (read ``keep_token``, hand-off ``kept_*``) and pulls only the rest.
# 5: a read answer's ``layer_stride`` (layer-major buffers).
# 6: a DE claims a hold before it READs (``claim_hold``); a read answer carries its lease's time (``lease_s``).
PROTOCOL_VERSION = 6
VERSION_KEY = "dualpath_version"


class ProtocolError(ValueError):
    """A message that does not follow this contract; the text says what is wrong."""


def check_version(message: dict[str, Any], what: str) -> None:
    version = message.get(VERSION_KEY)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{what} speaks dualpath protocol version {version!r}, this side speaks {PROTOCOL_VERSION}: "
            "run the same dualpath-kv release on every engine and router"
        )


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ProtocolError(f"{name} must be a list of non-negative integers")
    return list(value)


def _count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _positive(value: Any, name: str) -> int:
    if _count(value, name) == 0:
        raise ProtocolError(f"{name} must be positive, got 0")
    return value


# A keep token is a uuid4 hex: short, and safe to log.
_KEEP_TOKEN_CHARS = frozenset("0123456789abcdef")


def _keep_token(value: Any, name: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 64 or not set(value) <= _KEEP_TOKEN_CHARS:
        raise ProtocolError(f"{name} must be 1-64 lowercase hex characters")
    return value


def new_keep_token() -> str:
    """A fresh token naming a hit a DE keeps for its decode (PE side)."""
    return uuid.uuid4().hex


def new_hold_token() -> str:
    """A fresh secret that ends one PE hold (128 bits: not guessable by who did not see the hand-off)."""
    return secrets.token_hex(16)


def _nonempty_str(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"{name} must be a non-empty string, got {value!r}"[:200])
    return value


def _side_channel(params: dict[str, Any]) -> str:
    """A hand-off's PE side channel, ``host:port``: NixlConnector's ``remote_host`` and ``remote_port`` where a
    proxy left both (it may have rewritten the host), else ours, ``remote_side_channel``."""
    host, port = params.get("remote_host"), params.get("remote_port")
    if host is None and port is None:
        return _nonempty_str(params.get("remote_side_channel"), "remote_side_channel")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ProtocolError(f"remote_port must be a TCP port, got {port!r}"[:200])
    return f"{_nonempty_str(host, 'remote_host')}:{port}"


# -- kv_transfer_params --------------------------------------------------------


def require_object(params: Any) -> None:
    """``kv_transfer_params`` are absent or a JSON object: vLLM also takes them from ``vllm_xargs``, where a
    client may put a string or a list. Raises :class:`ProtocolError`."""
    if params is not None and not isinstance(params, dict):
        raise ProtocolError(f"kv_transfer_params must be a JSON object, got {type(params).__name__}")

ReadSide = Literal["pe", "de"]
READ_SIDES: tuple[str, ...] = ("pe", "de")


@dataclass(frozen=True)
class PrefillRequest:
    """Router (or any P/D proxy) -> PE: prefill only, hand the KV to a DE; who reads the store hit.

    ``de_side_channel`` (``host:port``) is the side channel of the DE that
    will decode the request. ``read_side`` ``"de"`` makes that DE read the
    hit into its buffer (the side channel is then required); with ``"pe"``
    the PE reads it, or moves the read to that DE while its own link is busy.

    Parameters without :data:`VERSION_KEY` come from a proxy that follows
    NixlConnector's convention (vLLM's P/D proxy examples, llm-d, Dynamo):
    ``{"do_remote_decode": true, ...}`` and NIXL's keys, which mean nothing
    here and are ignored. They are served as a PE-side read, or as above when
    they name ``de_side_channel`` (and ``read_side``). A version that is
    present and not ours is refused: that is a mismatched release.
    """

    read_side: ReadSide = "pe"
    de_side_channel: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "do_remote_decode": True,
            "read_side": self.read_side,
            "de_side_channel": self.de_side_channel,
            VERSION_KEY: PROTOCOL_VERSION,
        }

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> PrefillRequest | None:
        """The request in ``params``; None if it asks for no remote decode."""
        require_object(params)
        if not params or not params.get("do_remote_decode"):
            return None
        if VERSION_KEY in params:
            check_version(params, "the router's kv_transfer_params")
        side = params.get("read_side", "pe")
        if side not in READ_SIDES:
            raise ProtocolError(f"read_side must be one of {READ_SIDES}, got {side!r}")
        de = params.get("de_side_channel")
        if side == "de" or de is not None:
            de = _nonempty_str(de, f"de_side_channel (read_side {side!r})")
        return cls(side, de)


@dataclass(frozen=True)
class PrefillHandoff:
    """PE -> router -> DE: where the prefilled prompt's KV waits to be pulled.

    ``remote_block_ids`` are the PE's blocks of the prompt in token order;
    ``stored_chunks`` leading chunks were in the store when the PE looked or
    are being saved by the PE, so the DE saves only the chunks after them.

    DE-read hits (paper §4.1): the DE read prompt chunks ``kept_first_chunk``
    onwards (``kept_chunks`` of them) for the PE and keeps them in its buffer
    under ``kept_token``; it takes them from there and pulls only the other
    blocks. The token is a hint, never trusted: the DE uses a kept chunk only
    if its hash equals the one the DE computes from the prompt itself.

    ``tp_size``: the PE's tensor parallel size. DE rank ``r`` pulls from PE
    rank ``r`` (at the side channel's port + ``r``), so a DE of another size
    refuses the hand-off and recomputes the prompt.

    ``hold_token``: the secret that ends the PE's hold on these blocks. Only
    who saw the hand-off has it (the DE, in its ``pulled:`` notification; the
    router, in a ``release_hold`` message when the DE refused the request or the
    client went away): a notification or message without it ends nothing.

    The dict also carries NixlConnector's ``remote_host`` and ``remote_port``
    (the side channel's), which P/D proxies copy or rewrite: where both are
    present the DE reaches the PE there (a proxy may have put in the address it
    reached the PE at). A push-mode proxy (vLLM's ``toy_push_proxy_server.py``)
    sends the DE only ``remote_request_id``, ``remote_host``, ``remote_port``
    and ``tp_size``, without our version, the blocks or the hold token: that is
    a *push* hand-off (``remote_block_ids`` None, ``hold_token`` empty), which
    the DE still pulls: its claim names the request alone, and the PE's answer
    names the blocks (:class:`ClaimHold`).
    """

    remote_side_channel: str
    remote_request_id: str
    remote_block_ids: list[int] | None  # None: a push hand-off, the blocks come with the claim
    stored_chunks: int = 0
    kept_token: str | None = None
    kept_first_chunk: int = 0
    kept_chunks: int = 0
    tp_size: int = 1
    hold_token: str = ""  # always set by a PE; empty only in a push hand-off

    @property
    def push(self) -> bool:
        """A push-mode proxy's hand-off: no blocks and no hold token, the DE claims the hold by request id."""
        return self.remote_block_ids is None

    def to_dict(self) -> dict[str, Any]:
        host, _, port = self.remote_side_channel.rpartition(":")
        params = {
            "do_remote_prefill": True,
            "tp_size": self.tp_size,
            "remote_side_channel": self.remote_side_channel,
            "remote_host": host,
            "remote_port": int(port),
            "remote_request_id": self.remote_request_id,
            "remote_block_ids": None if self.push else list(self.remote_block_ids),
            "hold_token": self.hold_token,
            "stored_chunks": self.stored_chunks,
            VERSION_KEY: PROTOCOL_VERSION,
        }
        if self.kept_token is not None:
            params.update(kept_token=self.kept_token, kept_first_chunk=self.kept_first_chunk, kept_chunks=self.kept_chunks)
        return params

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> PrefillHandoff | None:
        """The hand-off in ``params``; None if it carries no remote prefill."""
        require_object(params)
        if not params or not params.get("do_remote_prefill"):
            return None
        push = params.get("remote_block_ids") is None
        if not push or VERSION_KEY in params:  # a push-mode proxy keeps NixlConnector's keys only
            check_version(params, "the prefill engine's kv_transfer_params")
        token = None if push else params.get("kept_token")  # a push-mode proxy drops it with the blocks
        if token is not None:
            token = _keep_token(token, "kept_token")
        return cls(
            remote_side_channel=_side_channel(params),
            remote_request_id=_nonempty_str(params.get("remote_request_id"), "remote_request_id"),
            remote_block_ids=None if push else _int_list(params.get("remote_block_ids"), "remote_block_ids"),
            hold_token="" if push else _keep_token(params.get("hold_token"), "hold_token"),
            stored_chunks=_count(params.get("stored_chunks", 0), "stored_chunks"),
            kept_token=token,
            kept_first_chunk=_count(params.get("kept_first_chunk", 0), "kept_first_chunk") if token else 0,
            kept_chunks=_count(params.get("kept_chunks", 0), "kept_chunks") if token else 0,
            # A PE that predates tensor-parallel PD sends none: it was one rank.
            tp_size=_positive(params.get("tp_size", 1), "tp_size"),
        )


# The chunk boundaries at the end of a retained decode whose hashes it names: a prompt that re-renders the
# last turn's end differently (a chat template's closing tokens) still matches at an earlier boundary.
RETAINED_CHECKPOINTS = 4
_HASH_CHARS = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class RetainedDecode:
    """DE -> multi-turn proxy -> PE: a finished decode's blocks, held for the conversation's next turn.

    vLLM's multi-turn P/D proxy (``disagg_proxy_multiturn.py``) keeps a DE's
    final ``kv_transfer_params`` per ``conversation_id`` and gives them to the
    next turn's prefill engine with ``do_remote_decode`` true: that PE pulls
    the turn's KV from the DE's blocks instead of the store (a DE configured
    with ``pd_retain_decode_s``).

    ``remote_block_ids`` hold the KV of the conversation's first
    ``retained_tokens`` tokens (the prompt and every output token but the
    last). ``checkpoints`` name the chain hash of the conversation's tokens
    at its last full-chunk boundaries (``[[chunks, hash], ...]``, most chunks
    first): the PE pulls only chunks its own prompt hashes to the same value
    (same tokens, same model, salt and adapter), never KV of other tokens.
    ``hold_token`` ends the DE's hold, as a :class:`PrefillHandoff`'s does; an
    unclaimed hold ends after ``pd_retain_decode_s``.
    """

    remote_side_channel: str
    remote_request_id: str
    remote_block_ids: list[int]
    hold_token: str
    retained_tokens: int
    checkpoints: list[tuple[int, str]]
    tp_size: int = 1

    def to_dict(self) -> dict[str, Any]:
        host, _, port = self.remote_side_channel.rpartition(":")
        return {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_side_channel": self.remote_side_channel,
            "remote_host": host,
            "remote_port": int(port),
            "remote_request_id": self.remote_request_id,
            "remote_block_ids": list(self.remote_block_ids),
            "hold_token": self.hold_token,
            "tp_size": self.tp_size,
            "retained_tokens": self.retained_tokens,
            "retained_checkpoints": [[chunks, digest] for chunks, digest in self.checkpoints],
            VERSION_KEY: PROTOCOL_VERSION,
        }

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> RetainedDecode | None:
        """The retained decode in a prefill request's ``params``; None if it names none."""
        require_object(params)
        if not params or not params.get("do_remote_decode") or params.get("retained_checkpoints") is None:
            return None
        check_version(params, "the decode engine's kv_transfer_params")
        checkpoints = params["retained_checkpoints"]
        if not isinstance(checkpoints, list) or not 0 < len(checkpoints) <= RETAINED_CHECKPOINTS \
                or not all(isinstance(c, list) and len(c) == 2 for c in checkpoints):  # fmt: skip
            raise ProtocolError(f"retained_checkpoints must be 1 to {RETAINED_CHECKPOINTS} [chunks, hash] pairs")
        return cls(
            remote_side_channel=_side_channel(params),
            remote_request_id=_nonempty_str(params.get("remote_request_id"), "remote_request_id"),
            remote_block_ids=_int_list(params.get("remote_block_ids"), "remote_block_ids"),
            hold_token=_keep_token(params.get("hold_token"), "hold_token"),
            retained_tokens=_count(params.get("retained_tokens"), "retained_tokens"),
            checkpoints=[(_positive(chunks, "retained_checkpoints chunks"), _chain_hash(digest))
                         for chunks, digest in checkpoints],  # fmt: skip
            tp_size=_positive(params.get("tp_size", 1), "tp_size"),
        )


def _chain_hash(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 128 or not set(value) <= _HASH_CHARS:
        raise ProtocolError("retained_checkpoints hashes must be 1-128 lowercase hex characters")
    return value


# -- the side channel between engines ------------------------------------------

OP_HELLO = "hello"
OP_READ = "read"
OP_RELEASE_HOLD = "release_hold"
OP_CLAIM_HOLD = "claim_hold"
# NIXL notifications: a DE's READ of a prefilled prompt ends with PULLED + the
# PE's request id + ":" + the claim token the PE answered its claim with (a DE
# with nothing to pull sends the hand-off's hold token instead); a PE hands a
# DE's leased buffer back with RELEASE + lease (a lease id is itself unguessable).
PULLED = b"pulled:"
RELEASE = b"release:"


def pulled_notification(remote_request_id: str, hold_token: str) -> bytes:
    return PULLED + f"{remote_request_id}:{hold_token}".encode()


def parse_pulled(message: bytes) -> tuple[str, str] | None:
    """``(request id, hold token)`` of a ``pulled:`` notification; None if malformed."""
    try:
        req_id, _, token = message[len(PULLED) :].decode().rpartition(":")
        return (req_id, _keep_token(token, "hold_token")) if req_id else None
    except (UnicodeDecodeError, ProtocolError):
        return None


@dataclass(frozen=True)
class ReleaseHold:
    """Router -> PE: the DE will not pull this hand-off (it refused the request, or the client went away)."""

    OP: ClassVar[str] = OP_RELEASE_HOLD
    remote_request_id: str
    hold_token: str

    def to_message(self) -> dict[str, Any]:
        return {"op": self.OP, VERSION_KEY: PROTOCOL_VERSION, "remote_request_id": self.remote_request_id,
                "hold_token": self.hold_token}  # fmt: skip

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> ReleaseHold:
        check_version(message, f"the {cls.OP} message")
        return cls(_nonempty_str(message.get("remote_request_id"), "remote_request_id"),
                   _keep_token(message.get("hold_token"), "hold_token"))  # fmt: skip


class ClaimHold(ReleaseHold):
    """DE -> PE, before any READ of a hand-off's blocks: the PE answers with a :class:`HoldClaim` only while the
    hold lives and nobody claimed it, and keeps the blocks until that READ's notification or the claim's end.

    NIXL READs are one-sided: the PE cannot refuse one at read time, so the
    claim is where a late DE (the hold expired and the blocks went to another
    request) or a second DE with the same hand-off is refused.

    An empty ``hold_token`` is a push hand-off's claim (:attr:`PrefillHandoff.push`:
    the proxy dropped the token): the cluster key that signs every side-channel
    message proves a cluster engine sent it, the hold is still granted once,
    and the answer names the blocks.
    """

    OP: ClassVar[str] = OP_CLAIM_HOLD

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> ClaimHold:
        check_version(message, f"the {cls.OP} message")
        token = message.get("hold_token")
        return cls(_nonempty_str(message.get("remote_request_id"), "remote_request_id"),
                   "" if token == "" else _keep_token(token, "hold_token"))  # fmt: skip


@dataclass(frozen=True)
class HoldClaim:
    """PE -> DE: the hold is this DE's for ``claim_s`` seconds from when the PE answered; its READ's notification
    carries ``claim_token`` (:func:`pulled_notification`). The answer to a push hand-off's claim also names the
    held blocks, in token order (``remote_block_ids``).

    The DE counts ``claim_s`` from when it *sent* the claim, which is earlier,
    so its deadline falls before the PE's on any pair of clocks that tick at
    the same rate: it posts no READ, and trusts none that ends, after it.
    """

    claim_token: str
    claim_s: float
    remote_block_ids: list[int] | None = None

    def to_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"claim_token": self.claim_token, "claim_s": self.claim_s}
        if self.remote_block_ids is not None:
            message["remote_block_ids"] = list(self.remote_block_ids)
        return message

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> HoldClaim:
        blocks = message.get("remote_block_ids")
        return cls(_keep_token(message.get("claim_token"), "claim_token"), _seconds(message.get("claim_s"), "claim_s"),
                   None if blocks is None else _int_list(blocks, "remote_block_ids"))  # fmt: skip


def _seconds(value: Any, name: str) -> float:
    """A positive, finite number of seconds (NaN and infinity are refused: a deadline must end)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 1e9:
        raise ProtocolError(f"{name} must be a positive number of seconds, got {value!r}"[:200])
    return float(value)


def hello_message() -> dict[str, Any]:
    return {"op": OP_HELLO, VERSION_KEY: PROTOCOL_VERSION}


@dataclass(frozen=True)
class ReadRequest:
    """PE -> DE: read these chunks into your buffer within ``deadline_s``, or decline at once.

    ``keep_token``: the DE is also the request's decode engine; after the PE
    released the buffer, the DE keeps the chunks under this token for its own
    decode of the same prompt (:class:`PrefillHandoff` ``kept_token``).
    """

    namespace: str
    chunk_hashes: list[str]
    deadline_s: float
    keep_token: str | None = None

    def to_message(self) -> dict[str, Any]:
        return {
            "op": OP_READ,
            VERSION_KEY: PROTOCOL_VERSION,
            "namespace": self.namespace,
            "chunk_hashes": list(self.chunk_hashes),
            "deadline_s": self.deadline_s,
            "keep_token": self.keep_token,
        }

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> ReadRequest:
        hashes = message.get("chunk_hashes")
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            raise ProtocolError("chunk_hashes must be a list of strings")
        deadline = _seconds(message.get("deadline_s"), "deadline_s")
        token = message.get("keep_token")
        if token is not None:
            token = _keep_token(token, "keep_token")
        return cls(str(message.get("namespace")), hashes, deadline, token)


@dataclass(frozen=True)
class ReadAnswer:
    """DE -> PE: the leading ``readable`` chunks sit at ``chunk_addrs``, lent under ``lease``.

    ``chunk_addrs`` name each chunk's layer 0; layer ``l`` is ``l * layer_stride``
    further (one Layer Block in a chunk-major buffer, a band in a layer-major
    one: version 5). ``lease_s``: from when the DE *received* the read request
    until its lease ends (version 6). The PE counts it from when it sent the
    request, which is earlier, so it reads the buffer only while the DE
    surely still lends it.
    """

    readable: int
    lease: str | None
    chunk_addrs: list[int]
    layer_stride: int = 0
    lease_s: float = 0.0

    def to_message(self) -> dict[str, Any]:
        return {"readable": self.readable, "lease": self.lease, "chunk_addrs": list(self.chunk_addrs),
                "layer_stride": self.layer_stride, "lease_s": self.lease_s}  # fmt: skip

    @classmethod
    def from_message(cls, message: dict[str, Any], asked: int) -> ReadAnswer:
        readable = message.get("readable")
        if not isinstance(readable, int) or isinstance(readable, bool) or not 0 <= readable <= asked:
            raise ProtocolError(f"readable must be an integer in [0, {asked}], got {readable!r}")
        if not readable:
            return cls(0, None, [])
        addrs = _int_list(message.get("chunk_addrs"), "chunk_addrs")
        lease = message.get("lease")
        if len(addrs) != readable or not isinstance(lease, str) or not lease:
            raise ProtocolError("a read answer names one address per readable chunk and a lease")
        stride = message.get("layer_stride", 0)
        if not isinstance(stride, int) or isinstance(stride, bool) or not 0 < stride < 1 << 48:
            raise ProtocolError(f"layer_stride must be a positive integer, got {stride!r}")
        return cls(readable, lease, addrs, stride, _seconds(message.get("lease_s"), "lease_s"))


# -- metrics ---------------------------------------------------------------------

METRIC_PREFIX = "dualpath_kv:"
NAMESPACE_INFO_METRIC = f"{METRIC_PREFIX}store_namespace_info"
# Its label naming every shard's namespace, rank 0's first, comma-separated (one for a one-rank or MLA engine).
SHARD_NAMESPACES_LABEL = "shard_namespaces"

COUNTERS = {
    "loaded_tokens": "Tokens whose KV was loaded from the store (hit tokens)",
    "load_failed_tokens": "Hit tokens that could not be loaded and were recomputed or failed",
    "bytes_read": "Bytes read from the store",
    "bytes_written": "Bytes written to the store",
    "saved_chunks": "Chunks written to the store",
    "save_skipped_chunks": "Chunks not saved because the save buffer was full or the write failed",
    "resave_present_chunks": "Chunks recomputed after a failed load and not written again: the store had them",
    "bytes_read_for_peer": "Bytes read from the store into this engine's buffer for a PE (DE-side reads)",
    "bytes_pulled_from_peer": "Bytes pulled from another engine: DE-read hits on a PE, prefilled prompts on a DE",
    "pulled_tokens": "Prompt tokens whose KV a DE pulled from its PE",
    "pull_failed_tokens": "Prompt tokens whose KV a DE could not pull from its PE (recomputed there)",
    "kept_tokens": "Prompt tokens a DE copied in from the hit it had read for its PE and kept, instead of pulling "
    "them back from the PE (DE-read flow)",
    "reads_moved_to_de": "PE-side reads this PE moved to the request's DE because its own storage link was busy "
    "and the DE could finish sooner (work stealing)",
    "split_read_tail_tokens": "Hit tokens of PE-side reads split across both storage links that the request's DE "
    "read (the tail; this PE read the head at the same time)",
    "de_read_fallbacks": "DE-side reads that failed or timed out, read from the store by the PE instead",
    "de_reads_declined": "PE read requests this DE declined (its read queue would miss the PE's deadline); "
    "the PE read those hits itself",
    "corrupt_chunks": "Chunks read from the store that failed their integrity digest or held NaN/inf (treated as "
    "misses and deleted)",
    "forged_notifications": "pulled: notifications and router releases ignored: malformed, for no hold of this "
    "engine's within a lease, or with the wrong hold token",
    "s3_requests_retried": "S3 payload requests (GETs, PUTs through NIXL OBJ) that failed after the AWS SDK's own "
    "retries and were sent again, after a jittered backoff (store.io_retries); NIXL reports no cause",
    "s3_retries_past_deadline": "Failed S3 payload requests not sent again because their load's deadline (the "
    "hit's estimated recompute time from the load's start) would pass first: those chunks were recomputed",
    "refused_hold_claims": "DE claims of this PE's holds refused: the hold had ended (lease, release, pull), another "
    "DE had claimed it, or the hold token was wrong; that DE recomputed the prompt instead of reading the blocks",
    "side_channel_rejected_messages": "Side-channel messages dropped unanswered: unsigned, wrong key, stale, "
    "replayed or malformed",
    "kv_events_stored_blocks": "vLLM blocks announced in BlockStored KV events (medium STORAGE) once their chunk "
    "was written by every rank",
    "kv_events_removed_blocks": "vLLM blocks announced in BlockRemoved KV events (medium STORAGE) after gc deleted "
    "their chunk",
    "kv_events_dropped": "KV events (and chunks awaiting their write) dropped because kv_events_max_queued was reached",
    "gc_records_rejected": "gc removal records ignored: unreadable, malformed, another version or namespace, bad checksum",
    # Reported by the store itself (StoreMetrics): the Dual-Blade local tier and the tiered store in front of it.
    **{f"local_tier_{name}": doc for name, doc in {
        "hit_chunks": "Chunks read from the local (Dual-Blade) tier",
        "miss_chunks": "Chunks asked of the local tier that it did not hold (read from the next tier, if any)",
        "corrupt_chunks": "Local-tier chunks whose bytes no longer matched their bind checksum (dropped, read elsewhere)",
        "evicted_chunks": "Chunks the local tier evicted (coldest first by its ranker) to make room",
        "page_cache_bytes_read": "Bytes the local tier read through the page-cache path",
        "direct_bytes_read": "Bytes the local tier read through the O_DIRECT path",
        "page_cache_bytes_written": "Bytes the local tier wrote through the page-cache path",
        "direct_bytes_written": "Bytes the local tier wrote through the O_DIRECT path",
        "filled_chunks": "Chunks a lower tier served that were copied into the local tier in the background",
        "fill_skipped_chunks": "Chunks a lower tier served that were not copied up (no free fill slot, or the write failed)",
    }.items()},
}
TIMINGS = {
    "load_seconds": "Time from a load's start to its hit being readable (bulk: in the KV cache)",
    "save_seconds": "Time to write one step's completed chunks to the store",
    "verify_seconds": "Time to check one store read's chunks: integrity digests, then NaN/inf in the KV values",
    "pull_seconds": "Time for a DE to pull a prefilled prompt's KV from its PE",
    "layer_wait_seconds": "Layerwise loads: time one forward waited in wait_for_layer_load, summed over layers "
    "(on a GPU, the compute stream's stall)",
    "layer_load_seconds": "Layerwise loads: time one forward's loads took on their own (copies from first to last)",
}
# Per-request sizes in bytes (histograms with byte buckets).
SIZES = {
    "compute_network_bytes_per_request": "KV bytes this engine received from a peer engine for one request (the "
    "compute network): on a PE the hit a DE read for it, on a DE the prompt KV it pulled from the PE; a request's "
    "total is the PE's figure plus the DE's",
}
GAUGES = {
    "pd_held_blocks": "PE: KV blocks of finished prefills held for their DEs to pull",
    "read_queue_tokens": "Tokens queued or in flight in this engine's store reads, including reads served for a PE",
    "abandoned_transfer_bytes": "Host buffer bytes kept from reuse for store transfers abandoned at their deadline, "
    "until NIXL reports them ended (held for good: transfers that never end)",
    "layer_load_hidden_fraction": "Layerwise loads: 1 - layer_wait_seconds / layer_load_seconds of the latest "
    "forward (1: every byte moved behind compute)",
    "local_tier_page_cache_budget_bytes": "Local tier: page-cache budget B_pc from the memory cgroup (Dual-Blade Eq. 1-2)",
    "local_tier_page_cache_layers": "Local tier: n1, the front layers of every chunk on the page-cache path (Algorithm 1)",
    "local_tier_page_cache_hit_ratio": "Local tier: share of page-cache-path bytes served without a device read "
    "(this process's device reads, less the direct path's)",
    "local_tier_used_bytes": "Local tier: bytes of extents holding chunks",
    "local_tier_capacity_bytes": "Local tier: the extent file's size (the tier's byte budget)",
}


def counter_total_name(name: str) -> str:
    """The exported name of counter ``name`` (prometheus_client appends ``_total``)."""
    return f"{METRIC_PREFIX}{name}_total"


def metric_samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` of every sample in Prometheus exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels, sample.value


def metric_totals(text: str) -> dict[str, float]:
    """Each series summed over its label sets (engines export one per engine index/model)."""
    totals: dict[str, float] = defaultdict(float)
    for name, _, value in metric_samples(text):
        totals[name] += value
    return dict(totals)


def metric_total(text: str, name: str) -> float:
    return metric_totals(text).get(name, 0.0)


# -- the store key space -----------------------------------------------------------


@dataclass(frozen=True)
class StoreKeySpace:
    """What names an engine's stored chunks: enough to compute its keys from token ids.

    ``digest`` is the namespace digest (:meth:`nixl_backends.layout.KVNamespace.digest`);
    engines export it with the rest as labels of ``dualpath_kv:store_namespace_info``.
    """

    digest: str
    key_prefix: str
    chunk_tokens: int
    num_layers: int
    layer_block_bytes: int

    def validate(self) -> None:
        if not self.digest or self.digest.strip("0123456789abcdef"):
            raise ProtocolError(f"digest must be a lowercase hex string, got {self.digest!r}")
        for name in ("chunk_tokens", "num_layers", "layer_block_bytes"):
            if getattr(self, name) <= 0:
                raise ProtocolError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def of(cls, namespace: KVNamespace, key_prefix: str) -> StoreKeySpace:
        """The key space of an engine's namespace, as its scheduler, worker and metrics name keys."""
        return cls(namespace.digest(), key_prefix, namespace.chunk_tokens, namespace.num_layers,
                   namespace.layer_block_bytes)  # fmt: skip

    @cached_property
    def layout(self) -> BlockLayout:
        # Once: the read and save paths ask per chunk (the key space is frozen).
        return BlockLayout(self.num_layers, self.layer_block_bytes)

    @property
    def chain_digest(self) -> str:
        """The namespace digest chunk hashes chain from (:func:`~nixl_backends.layout.chunk_hashes`)."""
        return self.digest

    @property
    def keys_per_chunk(self) -> int:
        """Objects that make one chunk whole (:meth:`chunk_keys` lists them chunk by chunk)."""
        return 1

    def object_hash(self, chunk_hash: str) -> str:
        """The hash a stored object of chunk ``chunk_hash`` is keyed and sealed under (here: the same)."""
        return chunk_hash

    def key(self, chunk_hash: str) -> str:
        return chunk_key(self.key_prefix, self.digest, self.object_hash(chunk_hash))

    def object_keys(self, hashes: Sequence[str]) -> list[str]:
        """The keys of every object of each chunk, chunk by chunk (``keys_per_chunk`` a chunk)."""
        return [self.key(h) for h in hashes]

    def chunk_keys(self, token_ids: Sequence[int], chain: str | None = None) -> list[str]:
        """Keys of every full chunk of ``token_ids``, hashed from ``chain`` (default: ``chain_digest``; a salted
        request's is :func:`~nixl_backends.layout.isolated_chain`)."""
        return self.object_keys(chunk_hashes(chain or self.chain_digest, token_ids, self.chunk_tokens))

    def claimable_keys(self, token_ids: Sequence[int], chain: str | None = None) -> list[str]:
        """Keys of the chunks an engine can load for this prompt: never the last token's
        (vLLM computes the last prompt token itself, it needs its logits)."""
        claimable = max(0, (len(token_ids) - 1) // self.chunk_tokens)
        return self.chunk_keys(token_ids[: claimable * self.chunk_tokens], chain)

    def to_labels(self) -> dict[str, str]:
        return {
            "namespace": self.digest,
            "key_prefix": self.key_prefix,
            "chunk_tokens": str(self.chunk_tokens),
            "num_layers": str(self.num_layers),
            "layer_block_bytes": str(self.layer_block_bytes),
        }

    @classmethod
    def from_labels(cls, labels: dict[str, str]) -> StoreKeySpace:
        try:
            space = cls(
                digest=labels["namespace"],
                key_prefix=labels["key_prefix"],
                chunk_tokens=int(labels["chunk_tokens"]),
                num_layers=int(labels["num_layers"]),
                layer_block_bytes=int(labels["layer_block_bytes"]),
            )
        except (KeyError, ValueError) as exc:
            raise ProtocolError(f"malformed {NAMESPACE_INFO_METRIC} labels {labels}: {exc!r}") from None
        space.validate()
        return ShardedKeySpace.with_shards(space, labels.get(SHARD_NAMESPACES_LABEL, space.digest).split(","))

    @classmethod
    def from_metrics(cls, text: str) -> StoreKeySpace:
        """The key space an engine exports on its /metrics; ProtocolError if it exports none."""
        for name, labels, _ in metric_samples(text):
            if name == NAMESPACE_INFO_METRIC:
                return cls.from_labels(labels)
        raise ProtocolError(f"no {NAMESPACE_INFO_METRIC} in the metrics (is DualPathConnector loaded?)")


@dataclass(frozen=True)
class RankKeySpace(StoreKeySpace):
    """One tensor-parallel rank's shard of an engine's chunks.

    Chunk hashes chain from the engine's namespace (``engine_digest``, rank
    0's: what the scheduler, the router and KV events name chunks by); each
    rank stores its shard under its own namespace (``digest``). Every rank but
    0 keys and seals its objects under the chunk hash chained once more with
    its namespace (:func:`~nixl_backends.layout.shard_chunk_hash`), so one
    rank's object copied to another rank's key fails its integrity check. Rank
    0 keeps the engine's hashes: its objects are those of a one-rank engine's
    namespace layout.
    """

    engine_digest: str = ""

    @property
    def chain_digest(self) -> str:
        return self.engine_digest

    def object_hash(self, chunk_hash: str) -> str:
        if self.digest == self.engine_digest:
            return chunk_hash
        return shard_chunk_hash(self.digest, chunk_hash)

    @classmethod
    def of_rank(cls, namespace: KVNamespace, engine: KVNamespace, key_prefix: str) -> RankKeySpace:
        return cls(namespace.digest(), key_prefix, namespace.chunk_tokens, namespace.num_layers,
                   namespace.layer_block_bytes, engine_digest=engine.digest())  # fmt: skip


@dataclass(frozen=True)
class ShardedKeySpace(StoreKeySpace):
    """A tensor-parallel engine's chunks as a whole: a chunk is stored when every rank's shard is
    (:class:`RankKeySpace`); ``shard_digests`` are the ranks' namespaces, rank 0's (``digest``) first."""

    shard_digests: tuple[str, ...] = ()

    def validate(self) -> None:
        super().validate()
        for digest in self.shard_digests:
            dataclasses.replace(self, digest=digest, shard_digests=()).validate()

    @classmethod
    def with_shards(cls, engine: StoreKeySpace, digests: Sequence[str]) -> StoreKeySpace:
        """``engine``'s key space over its shards' namespaces (rank 0's, ``engine.digest``, first); ``engine``
        itself when there is one."""
        if list(digests[:1]) != [engine.digest]:
            raise ProtocolError(f"{SHARD_NAMESPACES_LABEL} must name {engine.digest} first, got {list(digests)}")
        if len(digests) == 1:
            return engine
        space = cls(**dataclasses.asdict(engine), shard_digests=tuple(digests))
        space.validate()
        return space

    @cached_property
    def shards(self) -> list[RankKeySpace]:
        return [RankKeySpace(digest, self.key_prefix, self.chunk_tokens, self.num_layers, self.layer_block_bytes,
                             engine_digest=self.digest) for digest in self.shard_digests]  # fmt: skip

    @property
    def keys_per_chunk(self) -> int:
        return len(self.shard_digests)

    def object_keys(self, hashes: Sequence[str]) -> list[str]:
        return [shard.key(h) for h in hashes for shard in self.shards]


# -- an engine's SSE stream -----------------------------------------------------------------------

_SSE_LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of an SSE stream given as byte chunks cut anywhere (inside a character, between CR and LF).

    Split only where the SSE format ends a line (CRLF, LF, CR). httpx's ``aiter_lines`` splits as
    ``str.splitlines`` does, also at U+0085, U+2028, U+2029: an engine writes those raw inside its JSON
    strings (JSON escapes only characters below U+0020, and vLLM does not escape non-ASCII), so a generated
    text holding one would reach a reader as two lines, neither of them valid JSON.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    async for chunk in chunks:
        text = pending + decoder.decode(chunk)
        # A CR at the end may be the first half of a CRLF whose LF is in the next chunk.
        held = text.endswith("\r")
        *lines, pending = _SSE_LINE_END.split(text[:-1] if held else text)
        if held:
            pending += "\r"
        for line in lines:
            yield line
    lines = _SSE_LINE_END.split(pending + decoder.decode(b"", final=True))
    if lines[-1] == "":
        lines.pop()
    for line in lines:
        yield line
