"""An HTTP service on threads of the calling process (test and benchmark stand-ins), on a free port."""

from __future__ import annotations

import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dualpath_dev.processes import free_port


class ThreadedHTTPService:
    """Serves ``handler()``'s class from :meth:`start` until :meth:`stop` (or the ``with`` block's end).

    With ``ssl_context`` (a server-side context) it serves HTTPS; each connection's handshake runs on the
    thread that serves it, not on the one that accepts.
    """

    name = "http-service"

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._server: ThreadingHTTPServer | None = None
        self.ssl_context = ssl_context

    def handler(self) -> type[BaseHTTPRequestHandler]:
        raise NotImplementedError

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.server_port

    def start(self, host: str = "127.0.0.1", port: int = 0):
        """Serve on ``host:port`` (port 0: a free one)."""
        self._server = ThreadingHTTPServer((host, port or free_port()), self.handler())
        self._server.daemon_threads = True
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
