"""The cluster key and the signed envelope every side-channel message travels in.

The engines of one cluster share a secret, ``DUALPATH_CLUSTER_KEY``. A side
channel hands out what a NIXL peer needs to READ an engine's KV cache (agent
metadata, KV addresses), so a message counts only if it proves the sender
holds that secret. One ZeroMQ frame per message::

    magic "DPSC" | envelope version (1 byte) | kind "Q" request / "A" answer (1 byte)
    | sent at, ms since the epoch (8 bytes) | nonce (16 random bytes)
    | reply_to: the request's nonce in an answer, zeros in a request (16 bytes)
    | HMAC-SHA256(key, every byte before the MAC + body) (32 bytes) | body (JSON)

A receiver checks the MAC in constant time before it trusts any field, then
the kind (a request cannot be reflected back as an answer), the clock (at most
:data:`MAX_CLOCK_SKEW_S` apart) and, for requests, that the nonce is new
(:class:`ReplayGuard`); an answer must name its request's nonce. Only then is
the body parsed. Authenticated, not encrypted: the KV network must be private.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
import secrets
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass

from nixl_backends.configuration import ConfigError

CLUSTER_KEY_ENV = "DUALPATH_CLUSTER_KEY"
MIN_KEY_BYTES = 16
# Engines' clocks may disagree by this much (NTP keeps them far closer); a
# message sent longer ago than this is stale, so a recorded one cannot be
# replayed later.
MAX_CLOCK_SKEW_S = 60.0

MAGIC = b"DPSC"
# Bumped on any change of the layout above; a peer of another version is refused by name.
ENVELOPE_VERSION = 1
REQUEST = b"Q"
ANSWER = b"A"
_KIND_NAMES = {REQUEST: "a request", ANSWER: "an answer"}
NONCE_BYTES = 16
_NO_REQUEST = bytes(NONCE_BYTES)
_HEADER = struct.Struct(f">4sBcQ{NONCE_BYTES}s{NONCE_BYTES}s")
_MAC_BYTES = hashlib.sha256().digest_size
ENVELOPE_OVERHEAD = _HEADER.size + _MAC_BYTES


class AuthError(ValueError):
    """A frame that is not an authentic, fresh side-channel message; the text says why (never the key)."""


class ClusterKey:
    """The shared secret; its repr and every error leave the value out."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_KEY_BYTES:
            raise ConfigError(
                f"{CLUSTER_KEY_ENV} is shorter than {MIN_KEY_BYTES} bytes: give every engine of the cluster "
                "the same longer secret, e.g. the output of `openssl rand -hex 32`"
            )
        self._secret = secret

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ClusterKey:
        """The key in ``DUALPATH_CLUSTER_KEY`` (its UTF-8 bytes, hex or free text); ConfigError naming the variable."""
        value = environ.get(CLUSTER_KEY_ENV)
        if not value:
            raise ConfigError(
                f"{CLUSTER_KEY_ENV} is not set: prefill and decode engines (kv_producer/kv_consumer) sign "
                "their side channel with it; give every engine of the cluster the same secret of at least "
                f"{MIN_KEY_BYTES} bytes, e.g. the output of `openssl rand -hex 32`"
            )
        return cls(value.encode())

    def mac(self, data: bytes) -> bytes:
        return hmac.new(self._secret, data, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "ClusterKey(<hidden>)"


@dataclass(frozen=True)
class Opened:
    """An authentic message: its body (not yet parsed), nonce and the time its sender stamped."""

    body: bytes
    nonce: bytes
    sent_at: float


def _seal(key: ClusterKey, kind: bytes, body: bytes, reply_to: bytes, now: float | None) -> tuple[bytes, bytes]:
    nonce = secrets.token_bytes(NONCE_BYTES)
    sent_ms = int((time.time() if now is None else now) * 1000)
    header = _HEADER.pack(MAGIC, ENVELOPE_VERSION, kind, sent_ms, nonce, reply_to)
    return header + key.mac(header + body) + body, nonce


def seal_request(key: ClusterKey, body: bytes, now: float | None = None) -> tuple[bytes, bytes]:
    """The frame to send and its nonce, which the answer must name."""
    return _seal(key, REQUEST, body, _NO_REQUEST, now)


def seal_answer(key: ClusterKey, body: bytes, request_nonce: bytes, now: float | None = None) -> bytes:
    return _seal(key, ANSWER, body, request_nonce, now)[0]


def _open(key: ClusterKey, frame: bytes, kind: bytes, now: float | None) -> tuple[Opened, bytes]:
    if len(frame) < ENVELOPE_OVERHEAD or not frame.startswith(MAGIC):
        raise AuthError(
            "not a signed dualpath side-channel message "
            "(a peer of an older dualpath-kv release, or not a cluster member)"
        )
    header, mac, body = frame[: _HEADER.size], frame[_HEADER.size : ENVELOPE_OVERHEAD], frame[ENVELOPE_OVERHEAD:]
    _, version, sent_kind, sent_ms, nonce, reply_to = _HEADER.unpack(header)
    if version != ENVELOPE_VERSION:
        raise AuthError(
            f"side-channel envelope version {version}, this side speaks {ENVELOPE_VERSION}: run the same "
            "dualpath-kv release on every engine"
        )
    # The stamp first: a stale frame (a replay, a flood of old captures) costs no MAC over its body.
    sent_at = sent_ms / 1000
    skew = sent_at - (time.time() if now is None else now)
    if abs(skew) > MAX_CLOCK_SKEW_S:
        raise AuthError(
            f"stamped {skew:+.0f} s from this engine's clock, beyond {MAX_CLOCK_SKEW_S:.0f} s: a replayed "
            "message, or clocks out of sync (run NTP on every engine's host)"
        )
    if not hmac.compare_digest(mac, key.mac(header + body)):
        raise AuthError(f"bad signature (a {CLUSTER_KEY_ENV} other than this engine's, or a tampered message)")
    if sent_kind != kind:
        # Signed by a member, so one of ours: a request reflected back as its answer, or the reverse.
        raise AuthError(f"{_KIND_NAMES.get(sent_kind, repr(sent_kind))} where {_KIND_NAMES[kind]} was expected")
    return Opened(body, nonce, sent_at), reply_to


def open_request(key: ClusterKey, frame: bytes, now: float | None = None) -> Opened:
    """The authentic request in ``frame``, or AuthError; a server still checks its nonce (:class:`ReplayGuard`)."""
    return _open(key, frame, REQUEST, now)[0]


def open_answer(key: ClusterKey, frame: bytes, request_nonce: bytes, now: float | None = None) -> bytes:
    """The body of the authentic answer to the request sent with ``request_nonce``, or AuthError."""
    opened, reply_to = _open(key, frame, ANSWER, now)
    if not hmac.compare_digest(reply_to, request_nonce):
        raise AuthError("an authentic answer, but to another request (replayed)")
    return opened.body


class ReplayGuard:
    """The nonces of authentic requests still inside the clock-skew window; a repeat is refused.

    A nonce is forgotten once its stamp falls out of the window, or, past
    ``capacity`` nonces, the oldest; either way requests stamped no later
    than a forgotten nonce are refused from then on, so a forgotten nonce can
    never come back (under a flood, or if this host's clock steps back, the
    window narrows, it never opens). One thread only (the side channel's).
    """

    def __init__(self, capacity: int = 100_000, window_s: float = MAX_CLOCK_SKEW_S) -> None:
        self._capacity = capacity
        self._window_s = window_s
        self._seen: set[bytes] = set()
        self._by_time: list[tuple[float, bytes]] = []
        self._floor = float("-inf")

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, opened: Opened, now: float | None = None) -> None:
        now = time.time() if now is None else now
        # A nonce stamped before the window would be refused as stale anyway.
        while self._by_time and self._by_time[0][0] < now - self._window_s:
            self._forget_oldest()
        if opened.sent_at <= self._floor:
            raise AuthError("older than the nonces this engine still remembers (a possible replay)")
        if opened.nonce in self._seen:
            raise AuthError("replayed (a nonce this engine has already served)")
        self._seen.add(opened.nonce)
        heapq.heappush(self._by_time, (opened.sent_at, opened.nonce))
        if len(self._seen) > self._capacity:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        sent_at, nonce = heapq.heappop(self._by_time)
        self._seen.discard(nonce)
        self._floor = max(self._floor, sent_at)
