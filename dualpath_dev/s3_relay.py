"""An S3 relay in front of a real S3 server (SeaweedFS) that makes it behave as users' stores do.

- ``credentials`` (a :class:`~dualpath_dev.credentials_endpoint.RotatingCredentials`):
  accept only what a store with rotating temporary credentials accepts.
  SeaweedFS knows static identities only and refuses a session token it did
  not issue, so the relay takes the store's part: it checks each request's
  SigV4 signature with the pair the endpoint issued (known, unexpired, its own
  token), answers ``400 ExpiredToken`` or ``403`` otherwise, as S3 does, and
  forwards what passes re-signed with the server's static key. Without
  ``credentials`` requests pass as they were signed (for the server's key).
- ``throttle_fraction`` / ``reset_fraction``: that share of object GETs and PUTs
  (drawn from a seeded generator) is answered ``503 SlowDown``, or its
  connection reset without an answer (a store shedding load, a flaky network);
  counted in ``throttled`` and ``resets``.
- ``delay_s``: every request waits this long before it is forwarded, as a
  store across a network answers its first byte a round trip later (bodies
  still move at the relay's pace: it models per-request latency, not bandwidth).
  Settable while the relay runs.
- :meth:`hold` / :meth:`release`: object GETs wait at the relay from ``hold``
  until ``release`` (at most ``hold_limit_s``), as a store that stopped
  answering does; ``held`` counts those waiting now.

Bodies pass unchanged (aws-chunked ones too). Counts what it refused and
forwarded. Runs on threads of the calling process, on a free port, until :meth:`stop`.
"""

from __future__ import annotations

import http.client
import logging
import random
import re
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from s3agg_gateway_ext.descriptor import DescriptorError
from s3agg_gateway_ext.sigv4 import error_xml, sign, verify_headers, verify_payload

from dualpath_dev.credentials_endpoint import RotatingCredentials
from dualpath_dev.threaded_http import ThreadedHTTPService

logger = logging.getLogger(__name__)

_KEY_ID = re.compile(r"Credential=([^/,\s]+)/")
# Not forwarded: the relay's own connection; re-signing, the client's signature too.
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding"}
_DROPPED = _HOP_BY_HOP | {"authorization", "x-amz-security-token", "x-amz-date", "host"}


class S3Relay(ThreadedHTTPService):
    name = "s3-relay"

    def __init__(self, upstream: str, access_key: str, secret_key: str,
                 credentials: RotatingCredentials | None = None, region: str = "us-east-1",
                 delay_s: float = 0.0, throttle_fraction: float = 0.0, reset_fraction: float = 0.0,
                 seed: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.upstream = urlsplit(upstream)
        self._static = (access_key, secret_key)
        self.credentials = credentials
        self.region = region
        self.delay_s = delay_s
        self.throttle_fraction, self.reset_fraction = throttle_fraction, reset_fraction
        self._faults = random.Random(seed)
        self.throttled = self.resets = 0
        self._lock = threading.Lock()
        self.forwarded = 0
        self.refused: dict[str, int] = {}  # S3 error code -> requests refused with it
        self._open = threading.Event()
        self._open.set()
        self.held = 0
        self.hold_limit_s = 120.0
        self._local = threading.local()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def hold(self) -> None:
        """Object GETs wait from now until :meth:`release`."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def _wait_if_held(self, method: str, path: str) -> None:
        if method != "GET" or path.strip("/").count("/") < 1 or self._open.is_set():
            return
        with self._lock:
            self.held += 1
        try:
            self._open.wait(self.hold_limit_s)
        finally:
            with self._lock:
                self.held -= 1

    def refused_total(self) -> int:
        with self._lock:
            return sum(self.refused.values())

    # -- one request -----------------------------------------------------------------------------

    def _fault(self, method: str, path: str) -> str | None:
        """``"throttle"``, ``"reset"`` or None for this request (object GETs and PUTs only)."""
        if method not in ("GET", "PUT") or path.strip("/").count("/") < 1:
            return None
        with self._lock:
            draw = self._faults.random()
            if draw < self.reset_fraction:
                self.resets += 1
                return "reset"
            if draw < self.reset_fraction + self.throttle_fraction:
                self.throttled += 1
                return "throttle"
        return None

    def _check(self, method: str, path: str, query: str, headers: dict[str, str], body: bytes) -> None:
        """Raise the S3 error the store answers a request with that no unexpired issued pair signed."""
        if self.credentials is None:
            return  # the server checks the signature itself
        key_id = _KEY_ID.search(headers.get("authorization", ""))
        if key_id is None:
            raise DescriptorError(403, "AccessDenied", "no AWS4-HMAC-SHA256 signature")
        secret = self.credentials.secret_for(key_id.group(1), headers.get("x-amz-security-token"))
        if secret is None:
            raise DescriptorError(400, "ExpiredToken", "the provided token has expired or is not known")
        verify_payload(verify_headers(method, path, query, headers, key_id.group(1), secret), body)

    def _forward(self, method: str, path: str, query: str, headers: dict[str, str], body: bytes):
        """The upstream's response to the request re-signed with its static key: (status, headers, body)."""
        target = f"{path}?{query}" if query else path
        if self.credentials is None:  # signed for the server's key already, over the host it was sent to
            forwarded = {k: v for k, v in headers.items() if k not in _HOP_BY_HOP}
        else:
            forwarded = {k: v for k, v in headers.items() if k not in _DROPPED}
            forwarded["host"] = self.upstream.netloc
            forwarded.update(sign(method, path, query, forwarded, *self._static, self.region))
        forwarded["content-length"] = str(len(body))
        conn = getattr(self._local, "conn", None)
        for attempt in range(2):  # a kept-alive connection the server closed meanwhile is opened again, once
            if conn is None:
                conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
                self._local.conn = conn
            try:
                conn.request(method, target, body=body, headers=forwarded)
                response = conn.getresponse()
                return response.status, response.getheaders(), response.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = self._local.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    # -- the server ----------------------------------------------------------------------------------

    def handler(self) -> type[BaseHTTPRequestHandler]:
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect

            def _serve(self) -> None:
                path, _, query = self.path.partition("?")
                headers = {k.lower(): v for k, v in self.headers.items()}
                body = self._body(headers)
                try:
                    relay._check(self.command, path, query, headers, body)
                except DescriptorError as exc:
                    with relay._lock:
                        relay.refused[exc.code] = relay.refused.get(exc.code, 0) + 1
                    self._answer(exc.status, [("Content-Type", "application/xml")],
                                 error_xml(exc.code, exc.message, path, "relay").encode())
                    return
                fault = relay._fault(self.command, path)
                if fault == "reset":
                    # RST, no answer: SO_LINGER 0 drops the connection instead of closing it in order.
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                if fault == "throttle":
                    self._answer(503, [("Content-Type", "application/xml")],
                                 error_xml("SlowDown", "Please reduce your request rate.", path, "relay").encode())
                    return
                relay._wait_if_held(self.command, path)
                if relay.delay_s:
                    time.sleep(relay.delay_s)  # the store's round trip
                status, got, content = relay._forward(self.command, path, query, headers, body)
                with relay._lock:
                    relay.forwarded += 1
                kept = [(k, v) for k, v in got if k.lower() not in ("connection", "transfer-encoding", "content-length")]
                # A HEAD's length is the object's, not its (empty) body's.
                length = dict((k.lower(), v) for k, v in got).get("content-length") if self.command == "HEAD" else None
                self._answer(status, kept, content, length)

            def _body(self, headers: dict[str, str]) -> bytes:
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailer fields of the HTTP chunking (aws-chunked ones are in the body)
                    return b"".join(chunks)
                return self.rfile.read(int(headers.get("content-length", 0)))

            def _answer(self, status: int, headers: list[tuple[str, str]], content: bytes,
                        length: str | None = None) -> None:  # fmt: skip
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", length or str(len(content)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(content)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve  # noqa: N815 (http.server's names)

            def log_message(self, *args) -> None:
                pass

        return Handler

    def stop(self) -> None:
        self.release()  # held requests answer (or fail) instead of waiting out hold_limit_s
        super().stop()

    def start(self) -> S3Relay:
        super().start()
        logger.info("S3 relay %s -> %s", self.endpoint, self.upstream.geturl())
        return self
