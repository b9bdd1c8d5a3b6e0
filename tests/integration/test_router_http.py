"""dualpath-router as a real process in front of stand-in engines.

The stand-ins are small HTTP servers on real sockets that answer like vLLM's
OpenAI server with our connector (JSON and SSE completions, Prometheus
/metrics, a :class:`PrefillHandoff` on the prefill answer), record every body
they receive and can be told to fail. They stand in for vLLM because a CPU
vLLM start costs about 90 s per engine; the real engines behind this router
are covered by the 1P1D end-to-end test (tests/e2e/test_pd_e2e.py).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from dualpath_connector.pd.cluster_auth import CLUSTER_KEY_ENV, ClusterKey
from dualpath_connector.protocol import (
    OP_RELEASE_HOLD,
    PROTOCOL_VERSION,
    VERSION_KEY,
    PrefillHandoff,
    PrefillRequest,
    ReleaseHold,
    new_hold_token,
)
from dualpath_connector.pd.side_channel import SideChannelServer
from dualpath_dev.processes import free_port, stop_process_group
from dualpath_router.credentials import DEFAULT_METRICS_TOKEN_ENV

MODEL = "tiny-llama"
PROMPT = list(range(100, 170))
# What the stand-ins demand and the routers started here get in DUALPATH_ENGINE_API_KEY; random per run.
API_KEY = secrets.token_hex(16)
# The cluster key of the stand-in PEs that serve a side channel and of the routers given it; random per run.
CLUSTER_SECRET = secrets.token_hex(16)


class StandInEngine:
    """A vLLM-like OpenAI server: records bodies, answers prefill or decode, fails on demand.

    ``mode``: ``ok``; ``http500`` (5xx before any byte); ``close`` (drops the
    connection without answering); ``close_once`` (drops it once, then ``ok``); ``http400`` (refuses the request);
    ``hold`` (a PE answers, a DE streams past its first event, only after ``release``).
    Like vLLM started with an API key, it answers 401 to a POST without
    ``Authorization: Bearer <api_key>`` (and records nothing of it).
    With ``side_channel`` a PE serves one (signed with ``CLUSTER_SECRET``), named
    in its hand-offs, that records the router's ``release_hold`` messages.
    """

    def __init__(self, name: str, role: str, api_key: str = API_KEY, side_channel: bool = False) -> None:
        self.name = name
        self.role = role
        self.mode = "ok"
        self.api_key = api_key
        # Any other status fails the router's scrapes of /metrics.
        self.metrics_status = 200
        self.released_holds: list[ReleaseHold] = []
        self.side_channel: SideChannelServer | None = None
        if side_channel:
            self.side_channel = SideChannelServer("127.0.0.1", free_port(), ClusterKey(CLUSTER_SECRET.encode()),
                                                  {OP_RELEASE_HOLD: self._release_hold}, on_tick=lambda: None)
        self.received: list[dict] = []
        self.request_ids: list[str | None] = []  # the X-Request-Id of each request received
        self.paths: list[str] = []  # and its path
        # The Authorization header of every request (GET and POST), None when absent.
        self.authorizations: list[str | None] = []
        self.refused = 0
        self.sent_kv_transfer_params: list[dict] = []
        self.decode_kv_transfer_params: dict | None = None  # put in each non-streamed decode answer when set
        self.release = threading.Event()
        self.metrics_text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0\n'
            "# TYPE dualpath_kv:read_queue_tokens gauge\n"
            f'dualpath_kv:read_queue_tokens{{engine="0",model_name="{MODEL}"}} 0\n'
        )
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep pytest output readable
                pass

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                engine.authorizations.append(self.headers.get("Authorization"))
                if self.path == "/metrics":
                    self._send(engine.metrics_status, engine.metrics_text.encode(), "text/plain; version=0.0.4")
                else:
                    self._send(200, b"", "text/plain")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                engine.authorizations.append(self.headers.get("Authorization"))
                if self.headers.get("Authorization") != f"Bearer {engine.api_key}":
                    engine.refused += 1
                    self._send(401, b'{"error": "Unauthorized"}', "application/json")
                    return
                engine.received.append(body)
                engine.request_ids.append(self.headers.get("X-Request-Id"))
                engine.paths.append(self.path)
                if engine.mode in ("close", "close_once"):
                    engine.mode = "ok" if engine.mode == "close_once" else "close"
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if engine.mode == "http500":
                    self._send(500, b'{"error": {"message": "engine dead"}}', "application/json")
                    return
                if engine.mode == "http400":
                    self._send(400, b'{"error": {"message": "prompt too long"}}', "application/json")
                    return
                if engine.role == "prefill":
                    if engine.mode == "hold":
                        engine.release.wait(30)
                    self._send(200, json.dumps(engine.prefill_answer(body)).encode(), "application/json")
                elif body.get("stream"):
                    self._stream(body)
                else:
                    self._send(200, json.dumps(engine.decode_answer(body)).encode(), "application/json")

            def _stream(self, body: dict) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream; charset=utf-8")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for i, event in enumerate(engine.decode_events(body)):
                    if i == 1 and engine.mode == "hold":
                        engine.release.wait(30)
                    data = f"data: {event}\n\n".encode()
                    try:
                        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                        self.wfile.flush()
                    except OSError:  # the router hung up
                        return
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name=f"standin-{name}", daemon=True)
        self.thread.start()

    def _release_hold(self, message: dict, reply: Callable[[dict], None]) -> None:
        self.released_holds.append(ReleaseHold.from_message(message))
        reply({"released": True, "pending": False})

    def prefill_answer(self, body: dict) -> dict:
        # A fresh request id per answer: the DE must get this very answer's hand-off.
        side_channel = self.side_channel.address if self.side_channel else f"127.0.0.1:{self.server.server_address[1]}"
        kv_transfer_params = PrefillHandoff(side_channel, uuid.uuid4().hex, [1, 2, 3], stored_chunks=1,
                                            hold_token=new_hold_token()).to_dict()
        self.sent_kv_transfer_params.append(kv_transfer_params)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": body.get("model", MODEL),
            "choices": [{"index": 0, "text": "", "token_ids": [7], "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(body.get("prompt", [])), "completion_tokens": 1},
            "kv_transfer_params": kv_transfer_params,
        }

    def decode_tokens(self, body: dict) -> list[int]:
        return [(len(body.get("prompt", [])) + i) % 1000 for i in range(body.get("max_tokens") or 16)]

    def decode_answer(self, body: dict) -> dict:
        tokens = self.decode_tokens(body)
        return {
            "id": "cmpl-1", "object": "text_completion", "model": body.get("model", MODEL),
            "choices": [{"index": 0, "text": "", "token_ids": tokens, "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(body.get("prompt", [])), "completion_tokens": len(tokens)},
            "served_by": self.name,
            **({"kv_transfer_params": self.decode_kv_transfer_params} if self.decode_kv_transfer_params else {}),
        }

    def decode_events(self, body: dict) -> list[str]:
        tokens = self.decode_tokens(body)
        events = [
            json.dumps({"id": "cmpl-1", "object": "text_completion", "model": body.get("model", MODEL),
                        "choices": [{"index": 0, "text": "", "token_ids": [t],
                                     "finish_reason": "length" if i == len(tokens) - 1 else None}]})
            for i, t in enumerate(tokens)
        ]
        return [*events, "[DONE]"]

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        if self.side_channel is not None:
            self.side_channel.stop()


class RouterProcess:
    """``python -m dualpath_router.app`` on a free port, stopped by its PID; ``API_KEY`` in its environment.

    With ``cluster_key`` it has ``CLUSTER_SECRET`` too, and sends ``release_hold`` messages.
    """

    def __init__(self, config: dict, workdir: Path, api_key: str = API_KEY, cluster_key: bool = False,
                 host: str = "127.0.0.1") -> None:  # fmt: skip
        self.port = free_port()
        config = {**config, "host": host, "port": self.port}
        self.config_path = workdir / "router.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "router.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ, DUALPATH_ENGINE_API_KEY=api_key)
        if cluster_key:
            self.env[CLUSTER_KEY_ENV] = CLUSTER_SECRET
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 180.0) -> RouterProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dualpath_router.app", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited early:\n{self.log_path.read_text()}")
            try:
                httpx.get(f"{self.url}/v1/models", timeout=1.0)
                return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise TimeoutError(f"router not up after {timeout_s}s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, grace_s=5.0)
            self.proc = None

    def log(self) -> str:
        return self.log_path.read_text()


def router_config(pes: list[StandInEngine], des: list[StandInEngine], **overrides) -> dict:
    config = {
        "served_model_names": [MODEL],
        "vocab_size": 1024,
        "policy": "dualpath",
        "report_hit_tokens": True,
        "metrics_refresh_interval_s": 0.2,
        "prefill_engines": [{"name": e.name, "url": e.url, "node": f"node-{e.name}"} for e in pes],
        "decode_engines": [
            {"name": e.name, "url": e.url, "node": f"node-{e.name}", "side_channel": f"127.0.0.1:{5700 + i}"}
            for i, e in enumerate(des)
        ],
        "timeouts": {"connect_s": 2, "prefill_s": 30, "decode_s": 30},
    }
    config.update(overrides)
    return config


@contextlib.contextmanager
def standin_stack(workdir: Path, without: tuple[str, ...] = (), **overrides):
    """Stand-in ``pe0`` and ``de0`` behind one router process, yielded as ``(pe, de, router)``; all stopped after.

    For a module-scoped fixture: a router start is slow. ``overrides`` go to
    :func:`router_config`; ``without`` names its keys to leave out.
    """
    with contextlib.ExitStack() as stack:
        pe = StandInEngine("pe0", "prefill")
        stack.callback(pe.stop)
        de = StandInEngine("de0", "decode")
        stack.callback(de.stop)
        config = router_config([pe], [de], **overrides)
        for key in without:
            del config[key]
        router = RouterProcess(config, workdir)
        stack.callback(router.stop)
        yield pe, de, router.start()


@pytest.fixture
def engines():
    made: list[StandInEngine] = []

    def make(name: str, role: str, side_channel: bool = False) -> StandInEngine:
        made.append(StandInEngine(name, role, side_channel=side_channel))
        return made[-1]

    yield make
    for engine in made:
        engine.stop()


@pytest.fixture
def start_router(tmp_path):
    started: list[RouterProcess] = []

    def start(config: dict, api_key: str = API_KEY, cluster_key: bool = False) -> RouterProcess:
        workdir = tmp_path / f"router{len(started)}"
        workdir.mkdir()
        started.append(RouterProcess(config, workdir, api_key, cluster_key))
        return started[-1].start()

    yield start
    for router in started:
        router.stop()


def dead_engine_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def complete(router: RouterProcess, **body) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, **body}, timeout=30.0)


def test_prefill_then_decode_bodies_and_headers(engines, start_router):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    router = start_router(router_config([pe], [de], read_side="de"))
    response = complete(router, prompt=PROMPT, max_tokens=5, temperature=0.0, min_tokens=2, return_token_ids=True)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == de.decode_tokens({"prompt": PROMPT, "max_tokens": 5})
    assert response.headers["x-dualpath-read-side"] == "de"
    assert response.headers["x-dualpath-hit-tokens"] == "0"  # no store configured
    assert response.headers["x-dualpath-prefill-engine"] == "pe0"
    assert response.headers["x-dualpath-decode-engine"] == "de0"

    [pe_body] = pe.received
    assert pe_body["prompt"] == PROMPT
    assert pe_body["max_tokens"] == 1 and pe_body["stream"] is False and "min_tokens" not in pe_body
    assert pe_body["temperature"] == 0.0
    assert pe_body["kv_transfer_params"] == {
        "do_remote_decode": True, "read_side": "de", "de_side_channel": "127.0.0.1:5700",
        VERSION_KEY: PROTOCOL_VERSION,
    }
    assert PrefillRequest.from_dict(pe_body["kv_transfer_params"]) == PrefillRequest("de", "127.0.0.1:5700")
    [de_body] = de.received
    assert de_body["max_tokens"] == 5 and de_body["prompt"] == PROMPT
    assert de_body["min_tokens"] == 2
    # The PE's hand-off, unchanged.
    assert de_body["kv_transfer_params"] == pe.sent_kv_transfer_params[0]
    # One request id, made by the router, for both engines' logs and the client.
    assert pe.request_ids == de.request_ids == [response.headers["x-request-id"]]
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])


def test_a_clients_request_id_reaches_both_engines_and_a_bad_one_is_refused(engines, start_router):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    router = start_router(router_config([pe], [de]))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    response = httpx.post(f"{router.url}/v1/completions", json=body, headers={"X-Request-Id": "agent-7:turn-3"},
                          timeout=30.0)  # fmt: skip
    assert response.status_code == 200, response.text
    assert pe.request_ids == de.request_ids == ["agent-7:turn-3"] == [response.headers["x-request-id"]]
    for bad in ("with space", "x" * 129, "caf\u00e9"):
        response = httpx.post(f"{router.url}/v1/completions", json=body, headers={"X-Request-Id": bad.encode()},
                              timeout=30.0)  # fmt: skip
        assert response.status_code == 400 and "X-Request-Id must be" in response.json()["error"]["message"], bad
    assert len(pe.received) == 1  # the refused ones reached no engine


def test_hits_are_not_reported_unless_the_operator_enables_it(engines, start_router):
    """By default no answer says how much of its prompt someone else stored (a cross-tenant oracle)."""
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    router = start_router(router_config([pe], [de], read_side="de", report_hit_tokens=False))
    response = complete(router, prompt=PROMPT, max_tokens=2, temperature=0.0)
    assert response.status_code == 200, response.text
    assert "x-dualpath-hit-tokens" not in response.headers and response.headers["x-dualpath-read-side"] == "de"


def test_streaming_passes_the_decode_stream_through(engines, start_router):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    router = start_router(router_config([pe], [de]))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30.0) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-dualpath-decode-engine"] == "de0"
        received = response.read().decode()
    expected = "".join(f"data: {event}\n\n" for event in de.decode_events({"prompt": PROMPT, "max_tokens": 4}))
    assert received == expected
    assert pe.received[0]["stream"] is False and pe.received[0]["max_tokens"] == 1
    assert "stream_options" not in pe.received[0]  # meaningless for a one-token prefill
    assert de.received[0]["stream"] is True and de.received[0]["stream_options"] == {"include_usage": True}


def test_prefill_retries_on_another_pe_when_the_first_is_down(engines, start_router):
    pe_bad, pe_good, de = engines("pe-bad", "prefill"), engines("pe-good", "prefill"), engines("de0", "decode")
    pe_bad.mode = "http500"
    config = router_config([pe_bad, pe_good], [de], policy="round_robin")
    config["prefill_engines"].insert(0, {"name": "pe-down", "url": dead_engine_url(), "node": "n-down"})
    router = start_router(config)
    for _ in range(3):
        response = complete(router, prompt=PROMPT, max_tokens=2)
        assert response.status_code == 200, response.text
        assert response.headers["x-dualpath-prefill-engine"] == "pe-good"
        assert de.received[-1]["kv_transfer_params"] == pe_good.sent_kv_transfer_params[-1]
    metrics = httpx.get(f"{router.url}/metrics").text
    assert 'dualpath_router_retries_total{role="prefill"}' in metrics


def fail_scrapes(*des: StandInEngine) -> None:
    """With every DE's scrape failing the router chooses among all DEs: round robin tries them in config order."""
    for de in des:
        de.metrics_status = 503


def test_decode_after_a_de_dropped_the_connection_prefills_again(engines, start_router):
    """The request reached the first DE, which may have pulled and ended the hold: the next DE needs a new hand-off."""
    pe = engines("pe0", "prefill", side_channel=True)
    de_bad, de_good = engines("de-bad", "decode"), engines("de-good", "decode")
    de_bad.mode = "close"
    fail_scrapes(de_bad, de_good)
    router = start_router(router_config([pe], [de_bad, de_good], policy="round_robin"), cluster_key=True)
    for stream in (False, True):
        response = complete(router, prompt=PROMPT, max_tokens=3, stream=stream)
        assert response.status_code == 200, response.text
        assert response.headers["x-dualpath-decode-engine"] == "de-good"
        spent, fresh = pe.sent_kv_transfer_params[-2:]
        assert de_bad.received[-1]["kv_transfer_params"] == spent
        assert de_good.received[-1]["kv_transfer_params"] == fresh != spent
        assert pe.released_holds[-1] == ReleaseHold(spent["remote_request_id"], spent["hold_token"])
    assert len(pe.received) == 4 and len(pe.released_holds) == 2 and len(de_good.received) == 2
    assert response.text == "".join(f"data: {e}\n\n" for e in de_good.decode_events(de_good.received[-1]))
    assert router_gauge(router, 'dualpath_router_retries_total{role="decode"}') == 2.0
    assert router_gauge(router, "dualpath_router_reprefills_total") == 2.0
    assert router_gauge(router, 'dualpath_router_released_holds_total{reason="decode_failed"}') == 2.0
    for engine, role in (("pe0", "prefill"), ("de-bad", "decode"), ("de-good", "decode")):
        wait_for_gauge(router, engine_tokens(engine, role), 0.0)  # a stream's booking ends just after its last byte


def test_a_connection_broken_before_the_answer_gets_the_same_engine_once_more(engines, start_router):
    """The one PE and the one DE each drop a request's connection once (as an engine closing a kept-alive
    connection just as the request goes out does): both are asked again instead of the request failing."""
    pe, de = engines("pe0", "prefill", side_channel=True), engines("de0", "decode")
    router = start_router(router_config([pe], [de]), cluster_key=True)
    pe.mode = "close_once"
    response = complete(router, prompt=PROMPT, max_tokens=3)
    assert response.status_code == 200, response.text
    assert len(pe.received) == 2 and len(de.received) == 1
    assert router_gauge(router, 'dualpath_router_retries_total{role="prefill"}') == 1.0

    de.mode = "close_once"
    response = complete(router, prompt=PROMPT, max_tokens=3)
    assert response.status_code == 200, response.text
    assert response.json()["served_by"] == "de0"
    # The dropped request may have pulled the first hand-off: the second attempt gets a new one.
    spent, fresh = pe.sent_kv_transfer_params[-2:]
    assert [body["kv_transfer_params"] for body in de.received[-2:]] == [spent, fresh] and fresh != spent
    assert pe.released_holds == [ReleaseHold(spent["remote_request_id"], spent["hold_token"])]
    assert router_gauge(router, "dualpath_router_reprefills_total") == 1.0

    # Control: an engine that drops every connection is asked twice per request, then the request fails.
    de.mode = "close"
    received = len(de.received)
    response = complete(router, prompt=PROMPT, max_tokens=3)
    assert response.status_code == 503 and "all decode engines failed: de0" in response.text
    assert len(de.received) == received + 2


def test_decode_refused_at_connect_keeps_the_handoff(engines, start_router):
    """The control: nothing reached the refusing DE, so the next DE gets the same hand-off, from one prefill."""
    pe, de_good = engines("pe0", "prefill", side_channel=True), engines("de-good", "decode")
    fail_scrapes(de_good)  # de-down's fail too: nothing listens there
    config = router_config([pe], [de_good], policy="round_robin")
    config["decode_engines"].insert(0, {"name": "de-down", "url": dead_engine_url(), "node": "n-down",
                                        "side_channel": "127.0.0.1:5799"})  # fmt: skip
    router = start_router(config, cluster_key=True)
    response = complete(router, prompt=PROMPT, max_tokens=3)
    assert response.status_code == 200, response.text
    assert response.json()["served_by"] == "de-good"
    assert len(pe.received) == 1 and pe.released_holds == []
    assert de_good.received[-1]["kv_transfer_params"] == pe.sent_kv_transfer_params[0]
    assert router_gauge(router, 'dualpath_router_retries_total{role="decode"}') == 1.0  # de-down was tried
    assert router_gauge(router, "dualpath_router_reprefills_total") == 0.0


def test_all_engines_failed_is_a_503_with_the_reasons(engines, start_router):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    pe.mode = "http500"
    router = start_router(router_config([pe], [de]))
    response = complete(router, prompt=PROMPT, max_tokens=2)
    assert response.status_code == 503
    assert "all prefill engines failed" in response.json()["error"]["message"]
    assert "pe0: HTTP 500" in response.json()["error"]["message"]
    assert de.received == []

    pe.mode, de.mode = "ok", "http500"
    response = complete(router, prompt=PROMPT, max_tokens=2)
    assert response.status_code == 503
    assert "all decode engines failed" in response.json()["error"]["message"]


def test_engine_refusal_reaches_the_client(engines, start_router):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    pe.mode = "http400"
    router = start_router(router_config([pe], [de]))
    response = complete(router, prompt=PROMPT, max_tokens=2)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "prompt too long"
    assert len(pe.received) == 1 and de.received == []


def test_prefill_without_kv_transfer_params_sends_the_plain_request(engines, start_router):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    pe.prefill_answer = lambda body: {"id": "x", "object": "text_completion", "model": MODEL,
                                      "choices": [{"index": 0, "text": "", "token_ids": [7]}]}
    router = start_router(router_config([pe], [de]))
    response = complete(router, prompt=PROMPT, max_tokens=2)
    assert response.status_code == 200
    assert "kv_transfer_params" not in de.received[0]


@pytest.mark.parametrize(
    "change, reason",
    [
        ({VERSION_KEY: PROTOCOL_VERSION + 1}, f"version {PROTOCOL_VERSION + 1}"),
        ({VERSION_KEY: None}, "version None"),
        ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
        ({"stored_chunks": True}, "stored_chunks"),
    ],
)
def test_unusable_handoff_sends_the_plain_request(engines, start_router, change, reason):
    """Another release's or a broken PE's hand-off: the DE recomputes, the router says why."""
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    answer = pe.prefill_answer

    def tampered(body: dict) -> dict:
        good = answer(body)
        return {**good, "kv_transfer_params": {**good["kv_transfer_params"], **change}}

    pe.prefill_answer = tampered
    router = start_router(router_config([pe], [de]))
    response = complete(router, prompt=PROMPT, max_tokens=2)
    assert response.status_code == 200, response.text
    assert "kv_transfer_params" not in de.received[0]
    assert "prefill engine pe0 answered unusable kv_transfer_params" in router.log()
    assert reason in router.log()


@pytest.mark.parametrize(
    "body, status, reason",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (json.dumps({"model": MODEL, "max_tokens": 2}).encode(), 400, "missing required field `prompt`"),
        (json.dumps({"model": MODEL, "prompt": [1, -5]}).encode(), 400, "bad token id -5"),
        (json.dumps({"model": MODEL, "prompt": [1, "a"]}).encode(), 400, 'bad token id "a" at prompt[1]'),
        (json.dumps({"model": MODEL, "prompt": [[1, 2], [3]]}).encode(), 400, "batched prompts"),
        (json.dumps({"model": MODEL, "prompt": [1, 2], "max_tokens": 0}).encode(), 400, "`max_tokens`"),
        (json.dumps({"model": MODEL, "prompt": [1, 2], "max_tokens": "5"}).encode(), 400, "`max_tokens`"),
        (json.dumps({"model": "gpt-5", "prompt": [1, 2]}).encode(), 404, "The model `gpt-5` does not exist"),
        (json.dumps({"model": MODEL, "prompt": "hello"}).encode(), 400, "text prompts need `tokenizer`"),
        (b'{"model": "m", "prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", 400, "nested too deeply"),
    ],
)
def test_bad_requests_get_4xx_with_the_reason(engines, start_router, body, status, reason):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    router = start_router(router_config([pe], [de]))
    response = httpx.post(f"{router.url}/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30.0)
    assert response.status_code == status
    assert reason in response.json()["error"]["message"]
    assert pe.received == [] and de.received == []


def test_chat_without_tokenizer_is_refused(engines, start_router):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    router = start_router(router_config([pe], [de]))
    response = httpx.post(f"{router.url}/v1/chat/completions",
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, timeout=30.0)
    assert response.status_code == 400
    assert "text prompts need `tokenizer` in the router config" in response.json()["error"]["message"]


def router_gauge(router: RouterProcess, series: str) -> float | None:
    for line in httpx.get(f"{router.url}/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def wait_for_gauge(router: RouterProcess, series: str, value: float) -> None:
    wait_until(lambda: router_gauge(router, series) == value, f"{series} == {value}")


def engine_tokens(engine: str, role: str) -> str:
    return f'dualpath_router_engine_unfinished_tokens{{engine="{engine}",role="{role}"}}'


def test_every_accepted_request_is_answered(engines, start_router):
    """Concurrent requests while engines fail in every way: each gets a response, the books balance."""
    pe_ok, pe_close = engines("pe-ok", "prefill"), engines("pe-close", "prefill")
    de_ok, de_500 = engines("de-ok", "decode"), engines("de-500", "decode")
    pe_close.mode, de_500.mode = "close", "http500"
    router = start_router(router_config([pe_ok, pe_close], [de_ok, de_500], policy="round_robin"))

    def one(i: int) -> int:
        return complete(router, prompt=PROMPT[: 10 + i], max_tokens=2, stream=bool(i % 2)).status_code

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(one, range(24)))
    assert statuses == [200] * 24
    # A stream's booking is released just after its last byte: poll.
    for engine, role in (("pe-ok", "prefill"), ("pe-close", "prefill"), ("de-ok", "decode"), ("de-500", "decode")):
        wait_for_gauge(router, engine_tokens(engine, role), 0.0)


def test_health_and_metrics(engines, start_router):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    # A queue counts only from an engine that has requests (an idle one's gauge is stale).
    pe.metrics_text += "dualpath_kv:read_queue_tokens{engine=\"1\"} 640\nvllm:num_requests_waiting{engine=\"1\"} 1\n"
    router = start_router(router_config([pe], [de]))
    assert httpx.get(f"{router.url}/health").status_code == 200
    complete(router, prompt=PROMPT, max_tokens=2)
    wait_for_gauge(router, 'dualpath_router_node_read_queue_tokens{node="node-pe0"}', 640.0)
    metrics = httpx.get(f"{router.url}/metrics").text
    assert 'dualpath_router_requests_total{policy="dualpath",read_side=' in metrics
    assert "dualpath_router_beta_tokens" in metrics


def _non_loopback_address() -> str | None:
    """This machine's address on its default route, if it has one (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.254", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def test_metrics_answer_loopback_clients_or_the_token_holder_only(engines, tmp_path):
    """/metrics counts hit tokens: before and after one request, it tells whether the prompt's prefix was
    stored. So a client from another host reads it only with the operator's token."""
    address = _non_loopback_address()
    if address is None:
        pytest.skip("no non-loopback address to reach the router from")
    config = router_config([engines("pe0", "prefill")], [engines("de0", "decode")])
    (tmp_path / "open").mkdir()
    (tmp_path / "token").mkdir()
    open_router = RouterProcess(config, tmp_path / "open", host="0.0.0.0")
    token_router = RouterProcess(config, tmp_path / "token", host="0.0.0.0")
    token_router.env[DEFAULT_METRICS_TOKEN_ENV] = "metrics-token-0123"
    try:
        open_router.start()
        assert "dualpath_router_hit_tokens_total" in httpx.get(f"{open_router.url}/metrics").text
        far = httpx.get(f"http://{address}:{open_router.port}/metrics")
        assert far.status_code == 403 and "loopback clients only" in far.json()["error"]

        token_router.start()
        far = f"http://{address}:{token_router.port}/metrics"
        assert httpx.get(f"{token_router.url}/metrics").status_code == 401  # loopback too, once a token is set
        assert httpx.get(far, headers={"Authorization": "Bearer metrics-token-012"}).status_code == 401
        allowed = httpx.get(far, headers={"Authorization": "Bearer metrics-token-0123"})
        assert allowed.status_code == 200 and "dualpath_router_hit_tokens_total" in allowed.text
        assert "metrics-token-0123" not in token_router.log()
    finally:
        open_router.stop()
        token_router.stop()


def test_client_leaving_mid_stream_releases_the_booking(engines, start_router):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    de.mode = "hold"
    router = start_router(router_config([pe], [de]))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30.0) as response:
        chunks = response.iter_raw()  # held: dropping the iterator closes the stream
        assert next(chunks).startswith(b"data: ")
        assert router_gauge(router, engine_tokens("de0", "decode")) == len(PROMPT)
    # The client hung up; the DE is still holding its stream open.
    wait_for_gauge(router, engine_tokens("de0", "decode"), 0.0)
    assert router_gauge(router, engine_tokens("pe0", "prefill")) == 0.0
    de.release.set()


def test_overloaded_pe_queues_the_request_until_it_has_room(engines, start_router):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    pe.mode = "hold"
    # beta = 0.01 s x 1000 tokens/s = 10 tokens: one 70-token prompt overloads the PE.
    router = start_router(router_config([pe], [de], scheduling={"beta_s": 0.01, "prefill_tokens_per_s": 1000.0}))
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(complete, router, prompt=PROMPT, max_tokens=2)
        wait_until(lambda: len(pe.received) == 1, "the first prefill to arrive")
        second = pool.submit(complete, router, prompt=PROMPT[:20], max_tokens=2)
        wait_for_gauge(router, "dualpath_router_queued_requests", 1.0)
        assert len(pe.received) == 1  # the second waits in the router, not at the engine
        pe.release.set()
        assert first.result().status_code == 200 and second.result().status_code == 200
    assert [len(body["prompt"]) for body in pe.received] == [len(PROMPT), 20]
    assert router_gauge(router, "dualpath_router_queued_requests") == 0.0


def test_dualpath_reads_on_the_side_with_the_shorter_queue(engines, start_router):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    # The PE node's NIC is busy (and the PE has requests, so its gauge is current).
    pe.metrics_text += 'dualpath_kv:read_queue_tokens{engine="1"} 5000\nvllm:num_requests_waiting{engine="1"} 1\n'
    router = start_router(router_config([pe], [de]))
    wait_for_gauge(router, 'dualpath_router_node_read_queue_tokens{node="node-pe0"}', 5000.0)
    response = complete(router, prompt=PROMPT, max_tokens=2)
    assert response.headers["x-dualpath-read-side"] == "de"
    assert pe.received[-1]["kv_transfer_params"]["read_side"] == "de"


@pytest.mark.parametrize("policy, read_side, named", [("dualpath", "auto", True), ("round_robin", "auto", True),
                                                      ("basic", "auto", False), ("dualpath", "pe", False)])  # fmt: skip
def test_the_pe_learns_its_de_unless_every_read_stays_on_the_pe(engines, start_router, policy, read_side, named):
    """A PE-side read names the decoding DE (the PE may move a queued read there); Basic and a forced "pe" do not."""
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    router = start_router(router_config([pe], [de], policy=policy, read_side=read_side))
    assert complete(router, prompt=PROMPT, max_tokens=1).headers["x-dualpath-read-side"] == "pe"
    expected = PrefillRequest("pe", "127.0.0.1:5700" if named else None)
    assert PrefillRequest.from_dict(pe.received[-1]["kv_transfer_params"]) == expected


def test_round_robin_alternates_read_sides(engines, start_router):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    router = start_router(router_config([pe], [de], policy="round_robin"))
    sides = [complete(router, prompt=PROMPT, max_tokens=1).headers["x-dualpath-read-side"] for _ in range(4)]
    assert sides == ["pe", "de", "pe", "de"]
