"""PE<->DE control messages over ZeroMQ: agent metadata, DE-side read requests.

Bulk bytes never travel here (NIXL moves them); messages are small JSON
objects with an ``op`` field. The server answers on its own thread; a handler
may answer later from any thread (a DE-side read replies once the store read
is done), so replies are handed back to the server thread through an
in-process socket: ZeroMQ sockets belong to one thread.

Every message, request and answer, is signed with the cluster key
(:mod:`dualpath_connector.pd.cluster_auth`). A frame that fails the check is
dropped unanswered (a scanner learns nothing, not even that it was refused),
counted in :attr:`SideChannelServer.rejected_messages` and logged at most once
a minute. A client refuses an answer that is not signed or not to its request.

A client watches its connection while it waits: a peer whose connection closes
(a killed or restarting engine) or whose port refuses is :class:`PeerGone` at
once; only a peer that is up and silent costs the whole deadline.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from dualpath_connector.lanes.affinity import pin_current_thread
from dualpath_connector.pd.cluster_auth import (
    AuthError,
    ClusterKey,
    ReplayGuard,
    open_answer,
    open_request,
    seal_answer,
    seal_request,
)

logger = logging.getLogger(__name__)

Reply = Callable[[dict[str, Any]], None]
Handler = Callable[[dict[str, Any], Reply], None]

_server_ids = itertools.count()
# Far above any request or answer we send (a read request names at most one
# load buffer of chunk hashes); ZeroMQ drops a peer that sends more, before
# it costs memory.
MAX_MESSAGE_BYTES = 16 << 20
# ZeroMQ's default queues 1,000 messages per peer: 16 GiB of 16 MiB frames.
RECEIVE_QUEUE = 8
# Requests handled between two ticks (notifications, expiry) at most.
_FRAMES_PER_TICK = 64
# A flood of bad frames must not flood the log: one warning, then at most one per interval.
REJECTION_LOG_INTERVAL_S = 60.0


class SideChannelError(RuntimeError):
    """The peer did not answer in time, or answered with an error."""


class PeerTimeout(SideChannelError):
    """No answer within the deadline: a slow peer, a dead one, or one without this engine's cluster key."""


class PeerBusy(SideChannelError):
    """The peer declined at once: it could not answer within the asker's deadline."""


class PeerGone(SideChannelError):
    """The peer's connection closed before it answered, or nothing accepts connections at its address."""


# The connection events that mean no answer can come: the peer's process closed it (a killed or restarted
# engine), or its port refuses connections (nothing listens there). Either way waiting out the deadline would
# only delay what the caller does without an answer.
_GONE_EVENTS = {zmq.EVENT_DISCONNECTED: "closed the connection", zmq.EVENT_CONNECT_RETRIED: "refused the connection"}


def encode_bytes(data: bytes) -> str:
    return base64.b64encode(data).decode()


def decode_bytes(text: str) -> bytes:
    return base64.b64decode(text)


class SideChannelServer:
    """Answers ``{"op": ...}`` requests on ``tcp://host:port``; runs ``on_tick`` between messages."""

    def __init__(
        self,
        host: str,
        port: int,
        key: ClusterKey,
        handlers: dict[str, Handler],
        on_tick: Callable[[], None],
        tick_s: float = 0.005,
        cpu_affinity: set[int] | None = None,
    ) -> None:
        self.address = f"{host}:{port}"
        self._key = key
        self._replays = ReplayGuard()
        # Frames dropped unanswered (bad signature, stale, replayed, malformed); read by any thread.
        self.rejected_messages = 0
        self._rejections_unlogged = 0
        self._next_rejection_log = float("-inf")
        self._handlers = handlers
        self._on_tick = on_tick
        self._tick_ms = max(1, int(tick_s * 1000))
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        # Messages ZeroMQ queues per peer before dropping more: with the size bound, a peer (authenticated or
        # not: signatures are checked after receipt) pins at most RECEIVE_QUEUE x MAX_MESSAGE_BYTES here.
        self._router.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        self._router.bind(f"tcp://{host}:{port}")
        self._replies_address = f"inproc://dualpath-replies-{next(_server_ids)}"
        self._replies = self._context.socket(zmq.PULL)
        self._replies.bind(self._replies_address)
        self._local = threading.local()
        self._stopping = threading.Event()
        self._cpu_affinity = cpu_affinity
        self._thread = threading.Thread(target=self._run, name="dualpath-side-channel", daemon=True)
        self._thread.start()
        logger.info("DualPath side channel listening on %s", self.address)

    def _reply_socket(self) -> zmq.Socket:
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self._local.push = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._replies_address)
        return sock

    def _replier(self, identity: bytes, request_nonce: bytes) -> Reply:
        def reply(message: dict[str, Any]) -> None:
            frame = seal_answer(self._key, json.dumps(message).encode(), request_nonce)
            self._reply_socket().send_multipart([identity, frame])

        return reply

    def _run(self) -> None:
        pin_current_thread(self._cpu_affinity)
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        while not self._stopping.is_set():
            events = dict(poller.poll(self._tick_ms))
            if self._replies in events:
                while True:
                    try:
                        identity, body = self._replies.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._router.send_multipart([identity, b"", body])
            if self._router in events:
                # At most a batch between ticks: a flood of requests must not starve hold and lease expiry.
                for _ in range(_FRAMES_PER_TICK):
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._receive(frames)
            try:
                self._on_tick()
            except Exception:
                logger.exception("side channel tick failed")
        self._router.close()
        self._replies.close()

    def _receive(self, frames: list[zmq.Frame]) -> None:
        # ROUTER frames from a DEALER: identity, empty delimiter, one envelope.
        try:
            if len(frames) != 3 or frames[1].bytes:
                raise AuthError(f"{len(frames) - 1} frames where a delimiter and one envelope were expected")
            opened = open_request(self._key, frames[2].bytes)
            self._replays.check(opened)
        except AuthError as exc:
            self._reject(frames[-1], exc)
            return
        self._dispatch(self._replier(frames[0].bytes, opened.nonce), opened.body)

    def _reject(self, frame: zmq.Frame, reason: AuthError) -> None:
        self.rejected_messages += 1
        self._rejections_unlogged += 1
        now = time.monotonic()
        if now < self._next_rejection_log:
            return
        try:
            peer = frame.get("Peer-Address")
        except zmq.ZMQError:
            peer = "an unknown address"
        logger.warning(
            "side channel %s: dropped %d message(s) unanswered, the last from %s: %s (%d in all; the next such "
            "warning comes %.0f s from now at the earliest)",
            self.address, self._rejections_unlogged, peer, reason, self.rejected_messages, REJECTION_LOG_INTERVAL_S,
        )  # fmt: skip
        self._rejections_unlogged = 0
        self._next_rejection_log = now + REJECTION_LOG_INTERVAL_S

    def _dispatch(self, reply: Reply, body: bytes) -> None:
        # The sender holds the cluster key: a bad message from it gets an error naming the fault.
        try:
            message = json.loads(body)
            handler = self._handlers[message["op"]]
        except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested past ~1000 levels
            reply({"error": "malformed side-channel message or unknown op"})
            return
        try:
            handler(message, reply)
        except Exception as exc:
            logger.exception("side channel op %r failed", message.get("op"))
            reply({"error": f"{type(exc).__name__}: {exc}"})

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            # Closes what replies left open in other threads (a read lane's socket): a context collected with
            # a socket open blocks the collecting thread in zmq_ctx_term for good.
            self._context.destroy(linger=0)


_client_context: tuple[int, zmq.Context] | None = None


def _context() -> zmq.Context:
    # Our own context, not zmq.Context.instance(): inside a vLLM worker the
    # shared instance is vLLM's, and its sockets' options and lifetime are
    # not ours to rely on. Re-created after a fork.
    global _client_context
    if _client_context is None or _client_context[0] != os.getpid():
        _client_context = (os.getpid(), zmq.Context())
    return _client_context[1]


def rank_address(address: str, tp_rank: int) -> str:
    """The side channel of TP rank ``tp_rank`` of the engine at ``host:port``: ``host:(port + tp_rank)``.

    Every rank serves its own (its agent, its KV regions, its buffers); an
    engine is named by rank 0's, and rank ``r`` talks to rank ``r`` only.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) + tp_rank < 65536:
        raise SideChannelError(f"not a side channel address for rank {tp_rank}: {address!r}")
    return f"{host}:{int(port) + tp_rank}"


def request(address: str, message: dict[str, Any], timeout_s: float, key: ClusterKey | None = None) -> dict[str, Any]:
    """Send one request to the side channel at ``host:port``; its answer, or :class:`SideChannelError`.

    Signed with ``key`` (default: the one in ``DUALPATH_CLUSTER_KEY``); an
    answer not signed with it, or not to this request, is refused.
    """
    key = ClusterKey.from_env() if key is None else key
    frame, nonce = seal_request(key, json.dumps(message).encode())
    sock = _context().socket(zmq.DEALER)
    # A dead peer must not keep this process from exiting.
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    events = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
    try:
        sock.connect(f"tcp://{address}")
        sock.send_multipart([b"", frame])
        _await_answer(sock, events, address, message["op"], timeout_s)
        frames = sock.recv_multipart()
    finally:
        sock.disable_monitor()
        events.close()
        sock.close()
    try:
        if len(frames) != 2 or frames[0]:
            raise AuthError(f"{len(frames)} frames where a delimiter and one envelope were expected")
        answer = json.loads(open_answer(key, frames[1], nonce))
    except (AuthError, ValueError) as exc:
        raise SideChannelError(f"refused the answer of {address} to {message['op']!r}: {exc}") from None
    if not isinstance(answer, dict):
        raise SideChannelError(f"refused the answer of {address} to {message['op']!r}: not a JSON object")
    if "error" in answer:
        error = PeerBusy if answer.get("busy") else SideChannelError
        raise error(f"{address} refused {message['op']!r}: {answer['error']}")
    return answer


def _await_answer(sock: zmq.Socket, events: zmq.Socket, address: str, op: str, timeout_s: float) -> None:
    """Return once an answer waits on ``sock``; :class:`PeerGone` as soon as ``events`` says none can come."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(events, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while (left_s := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(max(1, int(left_s * 1000))))
        if sock in ready:
            return
        if events in ready:
            event = recv_monitor_message(events)["event"]
            if event in _GONE_EVENTS:
                raise PeerGone(f"{address} {_GONE_EVENTS[event]} before answering {op!r}")
    # A server drops what fails its check unanswered, so a key mismatch looks like this too.
    raise PeerTimeout(
        f"no answer from {address} to {op!r} within {timeout_s:.1f}s (is it up, on this "
        "dualpath-kv release, with this engine's DUALPATH_CLUSTER_KEY?)"
    )
