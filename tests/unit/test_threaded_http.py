"""The test services' HTTP server takes a client's whole burst of connections into its accept queue."""

from __future__ import annotations

import select
import socket
import time
from http.server import BaseHTTPRequestHandler

from dualpath_dev.threaded_http import ServiceHTTPServer

BURST = 64  # above NIXL OBJ's 32 threads, each opening its own connection at once


def _handshakes_done(server: ServiceHTTPServer, wait_s: float) -> int:
    """Connect BURST sockets to ``server`` while nothing accepts; how many finished their handshake."""
    address = server.server_address
    clients = []
    try:
        for _ in range(BURST):
            client = socket.socket()
            client.setblocking(False)
            client.connect_ex(address)
            clients.append(client)
        pending, done = set(clients), 0
        deadline = time.monotonic() + wait_s
        while pending and (left := deadline - time.monotonic()) > 0:
            _, writable, _ = select.select([], list(pending), [], left)
            for client in writable:
                pending.discard(client)
                done += client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        return done
    finally:
        for client in clients:
            client.close()


def test_a_burst_of_connections_completes_its_handshakes_before_any_is_accepted():
    with ServiceHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler) as server:
        assert _handshakes_done(server, wait_s=5.0) == BURST


def test_control_socketservers_default_backlog_leaves_most_of_the_burst_unconnected():
    class DefaultBacklog(ServiceHTTPServer):
        request_queue_size = 5  # socketserver's

    # The kernel drops SYNs while the accept queue is full; the clients' retransmits find it full still.
    with DefaultBacklog(("127.0.0.1", 0), BaseHTTPRequestHandler) as server:
        assert _handshakes_done(server, wait_s=1.5) <= 8
