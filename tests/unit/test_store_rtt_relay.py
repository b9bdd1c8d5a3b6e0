"""The delaying S3 relay as a process of its own (``python -m dualpath_dev.s3_relay``), against an in-test server."""

from __future__ import annotations

import http.client
import os
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from dualpath_dev.s3_relay import LinkPacer, S3RelayProcess, main
from dualpath_dev.tls import ServerTLS, make_server_tls


class ObjectServer:
    """PUT stores a body under its path, GET answers it, HEAD its length: the part of S3 a relay must carry."""

    def __init__(self, tls: ServerTLS | None = None) -> None:
        objects: dict[str, bytes] = {}
        self.objects = objects

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_PUT(self) -> None:
                objects[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
                self._answer(200, b"")

            def do_GET(self) -> None:
                if self.path in objects:
                    self._answer(200, objects[self.path])
                else:
                    self._answer(404, b"")

            def do_HEAD(self) -> None:
                self.send_response(200 if self.path in objects else 404)
                self.send_header("Content-Length", str(len(objects.get(self.path, b""))))
                self.end_headers()

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        if tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(tls.cert_file, tls.key_file)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            self.url = self.url.replace("http://", "https://")
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ObjectServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def _timed(endpoint: str, method: str, path: str, body: bytes | None = None,
           ca_file: Path | None = None) -> tuple[int, bytes, float]:  # fmt: skip
    """(status, body, seconds) of one request on a fresh connection (HTTPS trusting ``ca_file``)."""
    url = urlsplit(endpoint)
    if url.scheme == "https":
        conn = http.client.HTTPSConnection(url.hostname, url.port, timeout=30,
                                           context=ssl.create_default_context(cafile=ca_file))  # fmt: skip
    else:
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        clock = time.perf_counter()
        conn.request(method, path, body=body)
        response = conn.getresponse()
        content = response.read()
        return response.status, content, time.perf_counter() - clock
    finally:
        conn.close()


def test_the_relay_process_carries_bytes_both_ways_each_request_a_delay_later(tmp_path):
    body = os.urandom(1 << 20)
    with ObjectServer() as upstream, S3RelayProcess(upstream.url, tmp_path / "relay.log", delay_ms=50) as relay:
        assert relay.endpoint.startswith("http://127.0.0.1:") and relay.port
        status, _, put_s = _timed(relay.endpoint, "PUT", "/bucket/key", body)
        assert status == 200 and upstream.objects["/bucket/key"] == body
        status, got, get_s = _timed(relay.endpoint, "GET", "/bucket/key")
        assert status == 200 and got == body
        # A lower bound only: a loaded machine may take any longer.
        assert put_s >= 0.05 and get_s >= 0.05
        relay.set_delay(120)  # changed while it runs
        status, _, head_s = _timed(relay.endpoint, "HEAD", "/bucket/key")
        assert status == 200 and head_s >= 0.12
        assert relay.requests() == {"PUT": 1, "GET": 1, "HEAD": 1}
        pid = relay.proc.pid
    assert relay.proc is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped by its PID, nothing left running


def test_the_relay_serves_and_forwards_https_each_side_by_its_own_ca(tmp_path):
    """In front of a TLS store the relay terminates TLS with its own certificate and verifies the store's."""
    store_tls, relay_tls = (make_server_tls(tmp_path / name, ["127.0.0.1"]) for name in ("store", "relay"))
    body = os.urandom(256 << 10)
    with ObjectServer(store_tls) as upstream, S3RelayProcess(upstream.url, tmp_path / "relay.log", tls=relay_tls,
                                                             upstream_ca=str(store_tls.ca_file)) as relay:  # fmt: skip
        assert relay.endpoint.startswith("https://127.0.0.1:")
        assert _timed(relay.endpoint, "PUT", "/bucket/key", body, relay_tls.ca_file)[0] == 200
        status, got, _ = _timed(relay.endpoint, "GET", "/bucket/key", ca_file=relay_tls.ca_file)
        assert status == 200 and got == body and upstream.objects["/bucket/key"] == body
        # Control: a client that trusts only the store's CA does not accept the relay's certificate.
        with pytest.raises(ssl.SSLCertVerificationError):
            _timed(relay.endpoint, "GET", "/bucket/key", ca_file=store_tls.ca_file)


def test_the_relay_refuses_a_negative_delay_or_rate_and_keeps_running(tmp_path):
    with ObjectServer() as upstream, S3RelayProcess(upstream.url, tmp_path / "relay.log") as relay:
        with pytest.raises(RuntimeError, match="delay: a finite number >= 0, got -1"):
            relay.set_delay(-1)
        with pytest.raises(RuntimeError, match="rate: a finite number >= 0, got nan"):
            relay.set_rate(float("nan"))
        assert _timed(relay.endpoint, "HEAD", "/missing")[0] == 404  # answers still, undelayed


def test_a_link_pacer_serializes_transfers_at_its_rate_first_come_first_served():
    now = [10.0]
    link = LinkPacer(clock=lambda: now[0])
    assert link.reserve(1000) == 10.0  # no limit: crossed at once
    link.rate_bytes_s = 1000.0
    assert [link.reserve(500), link.reserve(500), link.reserve(2000)] == [10.5, 11.0, 13.0]  # queued behind each other
    now[0] = 20.0  # idle meanwhile: the link is free again, nothing is banked
    assert link.reserve(100) == pytest.approx(20.1)


def test_the_relay_process_paces_bodies_at_the_link_rate(tmp_path):
    body = os.urandom(1 << 20)
    with ObjectServer() as upstream, S3RelayProcess(upstream.url, tmp_path / "relay.log") as relay:
        relay.set_rate(80)  # 10 MB/s each way: 1 MiB takes 0.105 s to cross
        status, _, put_s = _timed(relay.endpoint, "PUT", "/bucket/key", body)
        assert status == 200 and upstream.objects["/bucket/key"] == body
        status, got, get_s = _timed(relay.endpoint, "GET", "/bucket/key")
        assert status == 200 and got == body
        assert put_s >= 0.1 and get_s >= 0.1  # a lower bound only: a loaded machine may take any longer
        assert relay.stats()["rate_mbit_s"] == 80


def test_a_relay_that_cannot_start_is_stopped_and_says_where_its_log_is(tmp_path):
    # The launcher runs `false` instead of the relay: it exits without a word.
    relay = S3RelayProcess("http://127.0.0.1:1", tmp_path / "relay.log", launcher=["false"])
    with pytest.raises(RuntimeError, match="did not start.*relay.log"):
        relay.start()
    assert relay.proc is None


@pytest.mark.parametrize("argv", [["--upstream", "http://x:1", "--listen", "nohost"],
                                  ["--upstream", "http://x:1", "--delay-ms", "-5"], ["--listen", "127.0.0.1:0"]])  # fmt: skip
def test_the_relay_command_line_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
