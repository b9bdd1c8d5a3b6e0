"""An HTTP service on threads of the calling process (test and benchmark stand-ins), on a free port."""

from __future__ import annotations

import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dualpath_dev.processes import free_port


class ServiceHTTPServer(ThreadingHTTPServer):
    # socketserver listens with a backlog of 5. An S3 client opening its pool's connections at once (NIXL OBJ:
    # one per thread, 32) overflows it; the kernel drops the SYNs (or the last ACKs) it has no room for, and each
    # such connection costs its client a 1 s SYN retransmit (a half-open one may wait like a request never
    # answered, which the SDK gives 10 s before it sends it again: measured against a silent server). Measured through the S3 relay beside 4 CPU hogs, 20 bursts of 32 PUTs from fresh agents: half
    # took 1.0 s with a backlog of 5, none over 0.23 s with this one. tests/unit/test_threaded_http.py checks it.
    request_queue_size = 1024
    daemon_threads = True


class ThreadedHTTPService:
    """Serves ``handler()``'s class from :meth:`start` until :meth:`stop` (or the ``with`` block's end).

    With ``ssl_context`` (a server-side context) it serves HTTPS; each connection's handshake runs on the
    thread that serves it, not on the one that accepts.
    """

    name = "http-service"

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._server: ServiceHTTPServer | None = None
        self.ssl_context = ssl_context

    def handler(self) -> type[BaseHTTPRequestHandler]:
        raise NotImplementedError

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.server_port

    def start(self, host: str = "127.0.0.1", port: int = 0):
        """Serve on ``host:port`` (port 0: a free one)."""
        self._server = ServiceHTTPServer((host, port or free_port()), self.handler())
        if self.ssl_context is not None:
            self._server.socket = self.ssl_context.wrap_socket(self._server.socket, server_side=True,
                                                               do_handshake_on_connect=False)  # fmt: skip
        threading.Thread(target=self._server.serve_forever, name=self.name, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
