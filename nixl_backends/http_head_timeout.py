"""uvicorn's HTTP/1.1 protocol with a request-head deadline, for the router and the gateway.

uvicorn closes a kept-alive connection that sends nothing for ``timeout_keep_alive``, but it has no deadline for
a request head: a client that opens a connection and sends nothing, or a few bytes of a head and then nothing,
holds it for ever (slowloris). Its ``limit_concurrency`` counts such connections too, so a thousand idle sockets
make every real request a 503. This protocol

- closes a connection whose request head is not complete ``head_timeout_s`` after its first byte was awaited
  (the connection opened, or the previous answer ended and a byte of the next head came), answering 408;
- when the connection limit is reached, makes room for a new connection by closing the oldest that has not
  completed a request head (none of those has a request in flight), so clients that send requests keep being
  served while idle ones pile up; only connections with requests in flight count against the limit then.

Bodies are the application's to bound (the router and the gateway read them with their own size limits).
"""

from __future__ import annotations

import asyncio
import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def head_timeout_protocol(head_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """The protocol class to pass as ``uvicorn.run(http=...)`` (with ``limit_concurrency=max_connections``)."""
    if head_timeout_s <= 0 or max_connections < 1:
        raise ValueError(f"head_timeout_s must be positive and max_connections >= 1, got {head_timeout_s}, "
                         f"{max_connections}")  # fmt: skip

    class HeadTimeoutProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._head_timer: asyncio.TimerHandle | None = None
            self._awaiting_head_since = time.monotonic()
            super().connection_made(transport)
            self._make_room()
            self._await_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                if self._head_timer is None:  # the first byte of the next head on a kept-alive connection
                    self._awaiting_head_since = time.monotonic()
                    self._await_head()
            elif self._head_timer is not None:  # a head is complete
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _await_head(self) -> None:
            self._head_timer = self.loop.call_later(head_timeout_s, self._close_without_head, "timeout")

        def _headless(self) -> bool:
            """No request head yet: nothing of this connection is in flight in the application."""
            return self._head_timer is not None and self.conn.their_state is h11.IDLE

        def _close_without_head(self, why: str) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            logger.debug("closing a connection without a request head (%s)", why)
            if why == "timeout":
                self.transport.write(_REQUEST_TIMEOUT)
            self.transport.close()
            # uvicorn forgets a connection when the transport reports it lost; until then it still counts.
            self.connections.discard(self)

        def _make_room(self) -> None:
            """Over the limit: close the connections that have waited longest without a request head."""
            excess = len(self.connections) - max_connections + 1  # uvicorn answers 503 at len >= limit
            if excess <= 0:
                return
            idle = sorted((c for c in self.connections if c is not self and c._headless()),
                          key=lambda c: c._awaiting_head_since)  # fmt: skip
            for connection in idle[:excess]:
                connection._close_without_head("the connection limit was reached")

    return HeadTimeoutProtocol
