"""Idle and half-sent connections cannot stall the router or the gateway (issue 38, part 2).

The HTTP protocol both run (``nixl_backends.http_head_timeout``) is checked in a uvicorn server on a thread of this
process, against plain uvicorn as the control: with more idle connections than the limit, plain uvicorn answers a
real request 503 while ours serves it; a half-sent head gets 408 and its connection closed, also the second head
on a kept-alive connection. Then the router process itself, wired with it, answers a half-sent head with 408 and
serves a request beside a crowd of idle connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import httpx
import pytest
import uvicorn

from nixl_backends.http_head_timeout import head_timeout_protocol
from tests.conftest import free_port, poll
from tests.integration.test_router_http import standin_stack

HEAD_TIMEOUT_S = 1.0
LIMIT = 16


async def _hello(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
    await send({"type": "http.response.body", "body": b"hello"})


@contextlib.contextmanager
def serving(http):
    """A uvicorn server on a free port of 127.0.0.1, on its own thread; yields its port."""
    config = uvicorn.Config(_hello, host="127.0.0.1", port=free_port(), http=http, limit_concurrency=LIMIT,
                            timeout_keep_alive=30, log_level="warning", lifespan="off")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        poll(lambda: server.started, bool, 10, "uvicorn to start")
        yield config.port
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def idle_connections(port: int, count: int):
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    try:
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def _read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


@pytest.mark.parametrize("guarded", [True, False], ids=["head-timeout", "plain-uvicorn"])
def test_idle_connections_past_the_limit_do_not_turn_requests_away(guarded):
    http = head_timeout_protocol(HEAD_TIMEOUT_S, LIMIT) if guarded else "h11"
    with serving(http) as port, idle_connections(port, 3 * LIMIT):
        # Every idle connection was accepted before the request's (one connection, in order, on one listener).
        status = httpx.get(f"http://127.0.0.1:{port}/", timeout=10).status_code
    assert status == (200 if guarded else 503)  # the control: plain uvicorn counts idle connections


@pytest.mark.parametrize("kept_alive", [False, True], ids=["first-head", "second-head"])
def test_a_half_sent_head_gets_408_and_is_closed(kept_alive):
    with serving(head_timeout_protocol(HEAD_TIMEOUT_S, LIMIT)) as port:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            if kept_alive:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                sock.settimeout(10)
                first = b""
                while not first.endswith(b"hello"):  # the whole answer (its head and body may come apart)
                    chunk = sock.recv(4096)
                    assert chunk, first
                    first += chunk
                assert first.startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # no blank line: the head never ends
            answer = _read_until_closed(sock, 10 * HEAD_TIMEOUT_S)
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout")
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).status_code == 200  # still serving


def test_the_router_closes_half_sent_heads_and_serves_beside_idle_connections(tmp_path):
    with standin_stack(tmp_path, head_timeout_s=HEAD_TIMEOUT_S, max_connections=LIMIT) as (_, _, router):
        port = int(router.url.rsplit(":", 1)[1])
        with idle_connections(port, 3 * LIMIT), socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
            assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200
            assert _read_until_closed(sock, 10 * HEAD_TIMEOUT_S).startswith(b"HTTP/1.1 408")
