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
- ``rate_bytes_s`` (0: none): the store's link, shared by every connection, one
  pacer each way (:class:`LinkPacer`): a GET's answer body waits its turn on the
  way down, a PUT's body on the way up, ``bytes / rate`` each, first come first
  served, as a link of that bandwidth serializes what crosses it. Settable while
  the relay runs.
- ``server_cert`` / ``upstream_ca``: HTTPS on the client side (the relay's own
  certificate: clients trust its CA) and to an ``https://`` store (trusted by
  ``upstream_ca``), so a TLS store keeps TLS on both hops with the delay between.
- :meth:`hold` / :meth:`release`: object GETs wait at the relay from ``hold``
  until ``release`` (at most ``hold_limit_s``), as a store that stopped
  answering does; ``held`` counts those waiting now.

Bodies pass unchanged (aws-chunked ones too). Counts what it refused and
forwarded (by method too). Runs on threads of the calling process, on a free port, until :meth:`stop`;
or in a process of its own (:class:`S3RelayProcess`, ``python -m dualpath_dev.s3_relay``), where a
benchmark's timing threads never share its GIL and a launcher (``ip netns exec <ns>``) can place it in a
network namespace: there it relays from every address it listens on (``--listen 0.0.0.0:0``), and the
store's traffic still crosses whatever links lead to that namespace.

    python -m dualpath_dev.s3_relay --upstream http://127.0.0.1:8333 --listen 127.0.0.1:0 --delay-ms 5

prints ``port <n>`` once it listens, then answers one command a line on stdin: ``delay <ms>`` and
``rate <Mbit/s>`` (from now on; rate 0: no limit) and ``stats`` (requests forwarded by method, its CPU
seconds), each with ``ok <json>`` (``error <why>`` for what it refuses); it exits when stdin closes.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import logging
import random
import re
import select
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import urlsplit

from s3agg_gateway_ext.descriptor import DescriptorError
from s3agg_gateway_ext.sigv4 import error_xml, sign, verify_headers, verify_payload

from dualpath_dev.credentials_endpoint import RotatingCredentials
from dualpath_dev.processes import stop_process_group
from dualpath_dev.threaded_http import ThreadedHTTPService
from dualpath_dev.tls import ServerTLS

logger = logging.getLogger(__name__)

_KEY_ID = re.compile(r"Credential=([^/,\s]+)/")
# Not forwarded: the relay's own connection; re-signing, the client's signature too.
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding"}
_DROPPED = _HOP_BY_HOP | {"authorization", "x-amz-security-token", "x-amz-date", "host"}


class LinkPacer:
    """One direction of a link of ``rate_bytes_s``: transfers cross it one after another, first come first served."""

    def __init__(self, clock=time.monotonic) -> None:
        self.rate_bytes_s = 0.0  # 0: no limit
        self._clock = clock
        self._lock = threading.Lock()
        self._free_at = 0.0

    def reserve(self, nbytes: int) -> float:
        """When a transfer of ``nbytes`` queued now has crossed the link (now, without a limit)."""
        with self._lock:
            now = self._clock()
            if self.rate_bytes_s <= 0:
                return now
            self._free_at = max(now, self._free_at) + nbytes / self.rate_bytes_s
            return self._free_at

    def cross(self, nbytes: int) -> None:
        """Wait until ``nbytes`` queued now have crossed the link."""
        wait_s = self.reserve(nbytes) - self._clock()
        if wait_s > 0:
            time.sleep(wait_s)


class S3Relay(ThreadedHTTPService):
    name = "s3-relay"

    # ``access_key``/``secret_key``: the upstream's static pair, which re-signs what ``credentials`` accepted
    # (unused without ``credentials``: requests pass as their client signed them).
    # ``server_cert``: (certificate chain, key) PEM files to serve HTTPS with; ``upstream_ca``: the CA bundle an
    # ``https://`` upstream is trusted by.
    def __init__(self, upstream: str, access_key: str = "", secret_key: str = "",
                 credentials: RotatingCredentials | None = None, region: str = "us-east-1",
                 delay_s: float = 0.0, throttle_fraction: float = 0.0, reset_fraction: float = 0.0,
                 seed: int = 0, server_cert: tuple[str, str] | None = None,
                 upstream_ca: str | None = None) -> None:  # fmt: skip
        server_context = None
        if server_cert is not None:
            server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            server_context.load_cert_chain(*server_cert)
        super().__init__(server_context)
        self.upstream = urlsplit(upstream)
        self._upstream_context = ssl.create_default_context(cafile=upstream_ca) if self.upstream.scheme == "https" \
            else None
        self._static = (access_key, secret_key)
        self.credentials = credentials
        self.region = region
        self.delay_s = delay_s
        self.up, self.down = LinkPacer(), LinkPacer()
        self.throttle_fraction, self.reset_fraction = throttle_fraction, reset_fraction
        self._faults = random.Random(seed)
        self.throttled = self.resets = 0
        self._lock = threading.Lock()
        self.forwarded = 0
        self.forwarded_by_method: Counter[str] = Counter()
        self.refused: dict[str, int] = {}  # S3 error code -> requests refused with it
        self._open = threading.Event()
        self._open.set()
        self.held = 0
        self.hold_limit_s = 120.0
        self._local = threading.local()

    @property
    def rate_bytes_s(self) -> float:
        return self.down.rate_bytes_s

    @rate_bytes_s.setter
    def rate_bytes_s(self, rate: float) -> None:
        self.up.rate_bytes_s = self.down.rate_bytes_s = rate

    @property
    def endpoint(self) -> str:
        host = self._server.server_address[0] if self._server is not None else "127.0.0.1"
        scheme = "http" if self.ssl_context is None else "https"
        return f"{scheme}://{'127.0.0.1' if host == '0.0.0.0' else host}:{self.port}"

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
                if self._upstream_context is None:
                    conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
                else:
                    conn = http.client.HTTPSConnection(self.upstream.hostname, self.upstream.port, timeout=60,
                                                       context=self._upstream_context)  # fmt: skip
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
                relay.up.cross(len(body))
                status, got, content = relay._forward(self.command, path, query, headers, body)
                if self.command != "HEAD":
                    relay.down.cross(len(content))
                with relay._lock:
                    relay.forwarded += 1
                    relay.forwarded_by_method[self.command] += 1
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

    def start(self, host: str = "127.0.0.1", port: int = 0) -> S3Relay:
        """Serve on ``host:port`` (port 0: a free one); ``0.0.0.0``: on every address of this network namespace."""
        super().start(host, port)
        logger.info("S3 relay %s -> %s (delay %g ms)", self.endpoint, self.upstream.geturl(), self.delay_s * 1000)
        return self

    def stats(self) -> dict:
        """Requests forwarded by method, the delay, and this process's CPU seconds (all its threads')."""
        with self._lock:
            return {"requests": dict(self.forwarded_by_method), "forwarded": self.forwarded,
                    "delay_ms": self.delay_s * 1000, "rate_mbit_s": self.rate_bytes_s * 8 / 1e6,
                    "cpu_s": time.process_time()}  # fmt: skip


class S3RelayProcess:
    """An :class:`S3Relay` (a delay and a link rate only) in a child process of its own, in its own process group,
    stopped by its PID.

    ``launcher`` prefixes the command (``ip netns exec <ns>``: the relay runs in that namespace, and
    ``upstream`` is as that namespace reaches it); ``listen_host`` is where it listens (``0.0.0.0``: every
    address there). Its log (stderr) goes to ``log_path``. With ``tls`` it serves HTTPS (clients trust
    ``tls.ca_file``); ``upstream_ca`` trusts an ``https://`` upstream.
    """

    def __init__(self, upstream: str, log_path: Path, *, listen_host: str = "127.0.0.1", delay_ms: float = 0.0,
                 launcher: Sequence[str] = (), start_timeout_s: float = 60.0, tls: ServerTLS | None = None,
                 upstream_ca: str | None = None) -> None:  # fmt: skip
        self.upstream = upstream
        self.tls = tls
        self.upstream_ca = upstream_ca
        self.log_path = Path(log_path)
        self.listen_host = listen_host
        self.delay_ms = delay_ms
        self.launcher = list(launcher)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        """Where this process's namespace reaches the relay (its listen address; loopback for ``0.0.0.0``)."""
        scheme = "http" if self.tls is None else "https"
        return f"{scheme}://{'127.0.0.1' if self.listen_host == '0.0.0.0' else self.listen_host}:{self.port}"

    def start(self) -> S3RelayProcess:
        command = [*self.launcher, sys.executable, "-m", "dualpath_dev.s3_relay", "--upstream", self.upstream,
                   "--listen", f"{self.listen_host}:0", "--delay-ms", str(self.delay_ms)]  # fmt: skip
        if self.tls is not None:
            command += ["--tls-cert", str(self.tls.cert_file), "--tls-key", str(self.tls.key_file)]
        if self.upstream_ca is not None:
            command += ["--upstream-ca", self.upstream_ca]
        with open(self.log_path, "w") as log:
            # The checkout's root: dualpath_dev is development scaffolding, not installed.
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         text=True, start_new_session=True, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
        try:
            line = self._line(self.start_timeout_s)
            if not line.startswith("port "):
                raise RuntimeError(f"the S3 relay did not start (it printed {line!r}); see {self.log_path}")
            self.port = int(line.split()[1])
        except BaseException:
            self.stop()
            raise
        logger.info("S3 relay process %d: %s -> %s, delay %g ms", self.proc.pid, self.endpoint, self.upstream,
                    self.delay_ms)  # fmt: skip
        return self

    def _line(self, timeout_s: float) -> str:
        """The relay's next line on stdout; an error if it prints none within ``timeout_s`` (its stdout is only
        ever its answers, one line each, so nothing waits in the reader's buffer when this selects)."""
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"the S3 relay answered nothing in {timeout_s:g}s; see {self.log_path}")
        return self.proc.stdout.readline()

    def _ask(self, command: str) -> dict:
        assert self.proc is not None and self.proc.stdin is not None, "start() first"
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self._line(30.0)
        if not line.startswith("ok "):
            raise RuntimeError(f"the S3 relay answered {line!r} to {command!r}; see {self.log_path}")
        return json.loads(line[3:])

    def set_delay(self, delay_ms: float) -> None:
        """Every request the relay receives from now on waits ``delay_ms``."""
        self._ask(f"delay {delay_ms}")
        self.delay_ms = delay_ms

    def set_rate(self, mbit_s: float) -> None:
        """Bodies cross the store's link at ``mbit_s`` each way from now on (0: no limit)."""
        self._ask(f"rate {mbit_s}")

    def stats(self) -> dict:
        """The relay's :meth:`S3Relay.stats`."""
        return self._ask("stats")

    def requests(self) -> Counter[str]:
        """Requests forwarded since the start, by method."""
        return Counter(self.stats()["requests"])

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # the relay's own signal to exit
            stop_process_group(self.proc, grace_s=3.0)
            self.proc = None

    def __enter__(self) -> S3RelayProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _serve_commands(relay: S3Relay) -> None:
    """Answer stdin's commands until it closes (the parent stopped the relay or died)."""
    for line in sys.stdin:
        words = line.split()
        if words[:1] in (["delay"], ["rate"]) and len(words) == 2:
            try:
                value = _non_negative(words[1])
            except (ValueError, argparse.ArgumentTypeError) as exc:
                print(f"error {words[0]}: {exc}", flush=True)
                continue
            if words[0] == "delay":
                relay.delay_s = value / 1000
                answer = {"delay_ms": value}
            else:
                relay.rate_bytes_s = value * 1e6 / 8
                answer = {"rate_mbit_s": value}
        elif words == ["stats"]:
            answer = relay.stats()
        else:
            print(f"error unknown command {line.strip()!r}", flush=True)
            continue
        print(f"ok {json.dumps(answer)}", flush=True)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"HOST:PORT expected (port 0: a free one), got {text!r}")
    return host, int(port)


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a finite number >= 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dualpath_dev.s3_relay",
                                     description="An S3 relay that delays every request (a store's round trip).")
    parser.add_argument("--upstream", required=True, help="the S3 server's URL, e.g. http://127.0.0.1:8333")
    parser.add_argument("--listen", type=_host_port, default=("127.0.0.1", 0), help="HOST:PORT (port 0: a free one)")
    parser.add_argument("--delay-ms", type=_non_negative, default=0.0, help="each request waits this long first")
    parser.add_argument("--rate-mbit", type=_non_negative, default=0.0,
                        help="the store link's bandwidth each way, Mbit/s (0: no limit)")
    parser.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM; with --tls-key)")
    parser.add_argument("--tls-key", help="the certificate's private key (PEM)")
    parser.add_argument("--upstream-ca", help="CA bundle that an https:// upstream is trusted by")
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server_cert = None if args.tls_cert is None else (args.tls_cert, args.tls_key)
    relay = S3Relay(args.upstream, delay_s=args.delay_ms / 1000, server_cert=server_cert, upstream_ca=args.upstream_ca)
    relay.rate_bytes_s = args.rate_mbit * 1e6 / 8
    relay.start(*args.listen)
    try:
        print(f"port {relay.port}", flush=True)
        _serve_commands(relay)
    finally:
        relay.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
