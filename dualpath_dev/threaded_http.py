"""An HTTP service on threads of the calling process (test and benchmark stand-ins), on a free port."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dualpath_dev.processes import free_port


class ThreadedHTTPService:
    """Serves ``handler()``'s class from :meth:`start` until :meth:`stop` (or the ``with`` block's end)."""

    name = "http-service"

    def __init__(self) -> None:
        self._server: ThreadingHTTPServer | None = None

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
