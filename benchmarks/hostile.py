"""Hostile neighbours for the soak: clients that misbehave beside the agents, each on its own thread.

What each does, and what the stack must answer (anything else is counted as a finding):

- ``malformed``: bodies that are not requests (not JSON, an array, nested 100,000 deep, out-of-range token
  ids, ``kv_transfer_params`` not an object, negative ``max_tokens``, 2 MiB of noise) to the router, and
  requests without the API key to the engines. Answer: a 4xx (the router may also drop a client's
  ``kv_transfer_params`` and serve the request: it owns the hand-off).
- ``idle``: connections that send nothing, kept open to the router and the PE and reopened once closed.
- ``half_sent``: request heads never finished (one byte a second), to the router and the PE.
- ``side_channel``: frames to both engines' side channels that no peer signed: noise, empty, a message sealed
  with another cluster key, and (rarely) one above the 16 MiB frame limit. Answer: none (dropped).
- ``notifications``: an insider with the cluster key (a compromised peer) handshakes as a DE would and sends
  both engines NIXL notifications of pulls that never happened (``pulled:`` for no hold, or a wrong token).
  Answer: none; no genuine hold may end early (the agents' answers would show it).
- ``long_streams``: streamed completions of 1,024 tokens through the router, read slowly.
- ``floods``: bursts of 32 one-token requests at once through the router. Answer: 200 or a 503/429 refusal.

Connections a server closed, refused or reset are outcomes, not findings: that is how a server sheds them.
A 5xx other than 503, or an exception where an answer was due, is a finding.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from dualpath_connector.pd.cluster_auth import ClusterKey, seal_request
from dualpath_connector.protocol import hello_message, pulled_notification
from dualpath_connector.pd.side_channel import decode_bytes
from dualpath_connector.pd.side_channel import request as side_channel_request

OVERSIZE_FRAME_BYTES = (16 << 20) + 1


@dataclass(frozen=True)
class Targets:
    router: tuple[str, int]
    pe: tuple[str, int]
    de: tuple[str, int]
    side_channels: tuple[str, ...]  # host:port of each engine's side channel
    cluster_key: str
    model: str
    vocab: int


class Outcomes:
    """Per behaviour, what happened how often; findings are what the stack must never do."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, Counter[str]] = {}
        self.findings: list[str] = []

    def count(self, behaviour: str, outcome: str, n: int = 1) -> None:
        with self._lock:
            self.counts.setdefault(behaviour, Counter())[outcome] += n

    def finding(self, behaviour: str, what: str) -> None:
        with self._lock:
            self.counts.setdefault(behaviour, Counter())["FINDING"] += 1
            if len(self.findings) < 20:
                self.findings.append(f"{behaviour}: {what[:300]}")

    def summary(self) -> dict:
        with self._lock:
            return {"counts": {b: dict(c) for b, c in self.counts.items()}, "findings": list(self.findings)}


def _post(address: tuple[str, int], path: str, body: bytes, headers: dict[str, str] | None = None,
          timeout_s: float = 60.0) -> int:  # fmt: skip
    conn = http.client.HTTPConnection(*address, timeout=timeout_s)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def _bad_bodies(targets: Targets, rng: random.Random) -> list[tuple[str, bytes, set[int]]]:
    """(what, body, the statuses that are right) for the router's /v1/completions."""
    ok = {"model": targets.model, "prompt": [rng.randrange(targets.vocab) for _ in range(16)], "max_tokens": 4}
    client = set(range(400, 500))
    return [
        ("not JSON", b"{\"model\": ", client),
        ("an array", b"[1, 2, 3]", client),
        ("nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000, client),
        ("token id out of range", json.dumps({**ok, "prompt": [10**9]}).encode(), client),
        # The router owns the hand-off: it drops a client's kv_transfer_params (served) or refuses them.
        ("kv_transfer_params a string", json.dumps({**ok, "kv_transfer_params": "x"}).encode(), client | {200}),
        ("kv_transfer_params in vllm_xargs", json.dumps({**ok, "vllm_xargs": {"kv_transfer_params": 7}}).encode(),
         client),
        ("negative max_tokens", json.dumps({**ok, "max_tokens": -1}).encode(), client),
        ("2 MiB of noise", os.urandom(2 << 20), client),
    ]


class HostileNeighbours:
    """Starts every behaviour on its own thread; :meth:`stop` ends them and closes what they hold."""

    def __init__(self, targets: Targets, seed: int = 0, idle_connections: int = 200, half_sent: int = 50,
                 notifications_per_s: float = 100.0) -> None:  # fmt: skip
        self.targets = targets
        self.outcomes = Outcomes()
        self._stop = threading.Event()
        self._seed = seed
        self._idle, self._half_sent = idle_connections, half_sent
        self._notifications_per_s = notifications_per_s
        self._threads: list[threading.Thread] = []

    def start(self) -> HostileNeighbours:
        behaviours: dict[str, Callable[[random.Random], None]] = {
            "malformed": self._malformed, "idle": self._idle_connections, "half_sent": self._half_sent_heads,
            "side_channel": self._side_channel, "notifications": self._notifications,
            "long_streams": self._long_streams, "floods": self._floods,
        }  # fmt: skip
        for name, loop in behaviours.items():
            rng = random.Random(f"{self._seed}-{name}")
            thread = threading.Thread(target=self._guarded, args=(name, loop, rng), name=f"hostile-{name}",
                                      daemon=True)  # fmt: skip
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> dict:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        return self.outcomes.summary()

    def _guarded(self, name: str, loop: Callable[[random.Random], None], rng: random.Random) -> None:
        try:
            loop(rng)
        except Exception as exc:  # a behaviour that broke is reported, it does not end the soak
            self.outcomes.finding(name, f"the behaviour itself failed: {exc!r}")

    # -- behaviours ------------------------------------------------------------------------------------

    def _malformed(self, rng: random.Random) -> None:
        t = self.targets
        while not self._stop.wait(0.5):
            for what, body, right in _bad_bodies(t, rng):
                try:
                    status = _post(t.router, "/v1/completions", body)
                except OSError as exc:
                    self.outcomes.finding("malformed", f"{what}: {exc!r}")
                    continue
                self.outcomes.count("malformed", str(status))
                if status not in right:
                    self.outcomes.finding("malformed", f"{what}: answered {status}")
            for engine in (t.pe, t.de):  # no API key: the engines answer only the router
                try:
                    status = _post(engine, "/v1/completions", json.dumps({"model": t.model, "prompt": [1]}).encode())
                except OSError as exc:
                    self.outcomes.finding("malformed", f"an engine without the API key: {exc!r}")
                    continue
                self.outcomes.count("malformed", f"engine {status}")
                if status != 401:
                    self.outcomes.finding("malformed", f"an engine answered {status} without the API key")

    def _held_sockets(self, name: str, count: int, opening: bytes, drip: bytes) -> None:
        """``count`` connections to the router and the PE each, sending ``opening`` then ``drip`` every second."""
        held: list[tuple[tuple[str, int], socket.socket | None]] = [
            (address, None) for address in (self.targets.router, self.targets.pe) for _ in range(count)]
        try:
            while not self._stop.wait(1.0):
                for i, (address, sock) in enumerate(held):
                    if sock is not None:
                        try:
                            if drip:
                                sock.send(drip)
                            sock.setblocking(False)
                            sock.recv(1, socket.MSG_PEEK)  # an answer (408) or the end: the server is done with it
                            closed = True
                        except BlockingIOError:
                            closed = False  # still open, nothing sent back
                        except OSError:
                            closed = True
                        if not closed:
                            continue
                        sock.close()
                        self.outcomes.count(name, "closed by the server")
                    try:
                        sock = socket.create_connection(address, timeout=5)
                        if opening:
                            sock.sendall(opening)
                        self.outcomes.count(name, "opened")
                    except OSError as exc:
                        self.outcomes.count(name, f"refused: {type(exc).__name__}")
                        sock = None
                    held[i] = (address, sock)
        finally:
            for _, sock in held:
                if sock is not None:
                    sock.close()

    def _idle_connections(self, rng: random.Random) -> None:
        self._held_sockets("idle", self._idle, b"", b"")

    def _half_sent_heads(self, rng: random.Random) -> None:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: "
        self._held_sockets("half_sent", self._half_sent, head, b"a")

    def _side_channel(self, rng: random.Random) -> None:
        context = zmq.Context.instance()
        other_key = ClusterKey(os.urandom(32))
        rounds = 0
        while not self._stop.wait(0.2):
            rounds += 1
            for address in self.targets.side_channels:
                frames = [
                    [b"", os.urandom(rng.randrange(1, 4096))],
                    [b""],
                    [b"junk", b"more", b"frames"],
                    [b"", seal_request(other_key, json.dumps(hello_message()).encode())[0]],
                ]
                if rounds % 50 == 0:
                    frames.append([b"", b"\0" * OVERSIZE_FRAME_BYTES])
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                try:
                    sock.connect(f"tcp://{address}")
                    for parts in frames:
                        sock.send_multipart(parts)
                    if sock.poll(100, zmq.POLLIN):
                        self.outcomes.finding("side_channel", f"{address} answered a frame nobody signed")
                    self.outcomes.count("side_channel", "frames sent", len(frames))
                finally:
                    sock.close()

    def _notifications(self, rng: random.Random) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        key = ClusterKey(self.targets.cluster_key.encode())
        agent = nixl_agent(f"hostile-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"]))
        peers = []
        for address in self.targets.side_channels:
            answer = side_channel_request(address, hello_message(), 30.0, key)
            name = agent.add_remote_agent(decode_bytes(answer["metadata"]))
            peers.append(name if isinstance(name, str) else name.decode())
        interval = 1.0 / self._notifications_per_s
        while not self._stop.wait(interval):
            for peer in peers:
                # A pull for no hold, or for any hold with a token nobody was given.
                forged = pulled_notification(f"cmpl-{rng.getrandbits(64):x}", f"{rng.getrandbits(128):032x}")
                try:
                    agent.send_notif(peer, forged)
                    self.outcomes.count("notifications", "sent")
                except Exception as exc:  # NIXL's own errors: the peer closed the connection
                    self.outcomes.count("notifications", f"not sent: {type(exc).__name__}")

    def _long_streams(self, rng: random.Random) -> None:
        t = self.targets
        while not self._stop.is_set():
            body = {"model": t.model, "prompt": [rng.randrange(t.vocab) for _ in range(64)], "max_tokens": 1024,
                    "ignore_eos": True, "temperature": 0.0, "stream": True}  # fmt: skip
            conn = http.client.HTTPConnection(*t.router, timeout=600)
            try:
                conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                if response.status != 200:
                    response.read()
                    self.outcomes.count("long_streams", str(response.status))
                    if response.status >= 500 and response.status != 503:
                        self.outcomes.finding("long_streams", f"answered {response.status}")
                    self._stop.wait(5.0)
                    continue
                events = 0
                while line := response.readline():
                    events += line.startswith(b"data: {")
                    if self._stop.wait(0.05):  # a slow reader
                        break
                self.outcomes.count("long_streams", "streamed")
                self.outcomes.count("long_streams", "events", events)
            except OSError as exc:
                if not self._stop.is_set():
                    self.outcomes.finding("long_streams", repr(exc))
            finally:
                conn.close()

    def _floods(self, rng: random.Random) -> None:
        t = self.targets
        while not self._stop.wait(60.0):
            statuses: list[int | str] = []

            def one() -> None:
                body = {"model": t.model, "prompt": [rng.randrange(t.vocab) for _ in range(32)], "max_tokens": 1}
                try:
                    statuses.append(_post(t.router, "/v1/completions", json.dumps(body).encode(), timeout_s=600))
                except OSError as exc:
                    statuses.append(type(exc).__name__)

            burst = [threading.Thread(target=one, daemon=True) for _ in range(32)]
            for thread in burst:
                thread.start()
            for thread in burst:
                thread.join(timeout=600)
            for status in statuses:
                self.outcomes.count("floods", str(status))
                if status not in (200, 503, 429):
                    self.outcomes.finding("floods", f"answered {status}")
