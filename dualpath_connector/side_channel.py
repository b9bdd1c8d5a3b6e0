"""PE<->DE control messages over ZeroMQ: agent metadata, DE-side read requests.

Bulk bytes never travel here (NIXL moves them); messages are small JSON
objects with an ``op`` field. The server answers on its own thread; a handler
may answer later from any thread (a DE-side read replies once the store read
is done), so replies are handed back to the server thread through an
in-process socket: ZeroMQ sockets belong to one thread.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import zmq

from dualpath_connector.affinity import pin_current_thread

logger = logging.getLogger(__name__)

Reply = Callable[[dict[str, Any]], None]
Handler = Callable[[dict[str, Any], Reply], None]

_server_ids = itertools.count()


class SideChannelError(RuntimeError):
    """The peer did not answer in time, or answered with an error."""


class PeerBusy(SideChannelError):
    """The peer declined at once: it could not answer within the asker's deadline."""


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
        handlers: dict[str, Handler],
        on_tick: Callable[[], None],
        tick_s: float = 0.005,
        cpu_affinity: set[int] | None = None,
    ) -> None:
        self.address = f"{host}:{port}"
        self._handlers = handlers
        self._on_tick = on_tick
        self._tick_ms = max(1, int(tick_s * 1000))
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
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

    def _replier(self, identity: bytes) -> Reply:
        def reply(message: dict[str, Any]) -> None:
            self._reply_socket().send_multipart([identity, json.dumps(message).encode()])

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
                while True:
                    try:
                        identity, _, body = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._dispatch(identity, body)
            try:
                self._on_tick()
            except Exception:
                logger.exception("side channel tick failed")
        self._router.close()
        self._replies.close()

    def _dispatch(self, identity: bytes, body: bytes) -> None:
        reply = self._replier(identity)
        try:
            message = json.loads(body)
            handler = self._handlers[message["op"]]
        except (ValueError, KeyError, TypeError):
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


_client_context: tuple[int, zmq.Context] | None = None


def _context() -> zmq.Context:
    # Our own context, not zmq.Context.instance(): inside a vLLM worker the
    # shared instance is vLLM's, and its sockets' options and lifetime are
    # not ours to rely on. Re-created after a fork.
    global _client_context
    if _client_context is None or _client_context[0] != os.getpid():
        _client_context = (os.getpid(), zmq.Context())
    return _client_context[1]


def request(address: str, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Send one request to the side channel at ``host:port``; its answer, or :class:`SideChannelError`."""
    sock = _context().socket(zmq.DEALER)
    # A dead peer must not keep this process from exiting.
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{address}")
        sock.send_multipart([b"", json.dumps(message).encode()])
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise SideChannelError(f"no answer from {address} to {message['op']!r} within {timeout_s:.1f}s")
        _, body = sock.recv_multipart()
    finally:
        sock.close()
    answer = json.loads(body)
    if "error" in answer:
        error = PeerBusy if answer.get("busy") else SideChannelError
        raise error(f"{address} refused {message['op']!r}: {answer['error']}")
    return answer
