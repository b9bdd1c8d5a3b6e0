"""dualpath-bench: traces, replay against a stand-in router, the emulated network and its teardown.

Network tests need root and network namespaces; they are skipped with the
reason when ``ip netns add`` is refused. The 1P1D smoke run starts real vLLM
engines in namespaces, behind the store round trip's relay.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dualpath_bench import report
from dualpath_connector.protocol import counter_total_name
from dualpath_dev.cluster import (
    ClusterConfig,
    ClusterError,
    ClusterNetwork,
    EmulatedCluster,
    NicSample,
    NicSampler,
    cpu_ticks,
    leftovers,
)
from dualpath_dev.compare import compare_runs, nic_balance, ttft_breakdown
from dualpath_bench.replay import ReplayConfig, ReplayError, replay
from dualpath_bench.trace import TraceConfig, TraceError, generate, read_jsonl, summarize, write_jsonl
from tests.conftest import REPO_ROOT, needs_netns



# --- traces -------------------------------------------------------------------------------------


def test_trace_is_deterministic_for_a_seed_and_differs_for_another():
    config = TraceConfig(agents=3, seed=7, turns=6, first_append_tokens=512)
    assert generate(config) == generate(config)
    assert generate(config) != generate(TraceConfig(agents=3, seed=8, turns=6, first_append_tokens=512))


def test_trace_shape_and_bounds():
    agents = generate(TraceConfig(agents=4, seed=1))
    for agent in agents:
        assert agent.total_tokens() <= 8192
        assert all(0 <= t < 1024 for turn in agent.turns for t in turn.append)
        assert len(agent.turns[0].append) == 1024  # the task / system prompt
    stats = summarize(agents)
    # Scaled like the paper's traces: short appends on a long, mostly cached context.
    assert stats["hit_ratio"] > 0.95
    assert 30 < stats["append"] < 90


def test_jsonl_round_trip(tmp_path):
    agents = generate(TraceConfig(agents=2, seed=3, turns=4))
    path = write_jsonl(agents, tmp_path / "trace.jsonl")
    assert read_jsonl(path) == agents
    assert len(path.read_text().splitlines()) == 2


def test_jsonl_errors_name_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"agent_id": "a", "turns": [{"append": [1, 2], "output_tokens": 3}]}) + "\n"
                    + json.dumps({"agent_id": "b", "turns": [{"append": [1, 5000], "output_tokens": 3}]}) + "\n")  # fmt: skip
    with pytest.raises(TraceError, match=r"bad.jsonl:2: turns\[0\].append holds a token id outside"):
        read_jsonl(path)
    with pytest.raises(TraceError, match="trace.first_append_tokens"):
        TraceConfig(first_append_tokens=9000).validate()


# --- replay against a stand-in router -----------------------------------------------------------


class StandInRouter:
    """Streams ``max_tokens`` token ids per completion (token = prompt length % 1024) with x-dualpath headers."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.lock = threading.Lock()
        router = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with router.lock:
                    router.prompts.append(body["prompt"])
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("x-dualpath-read-side", "de")
                self.send_header("x-dualpath-hit-tokens", str(len(body["prompt"]) // 32 * 32))
                self.end_headers()
                token = len(body["prompt"]) % 1024
                events = [{"choices": [{"index": 0, "token_ids": [token]}]} for _ in range(body["max_tokens"])]
                for event in events:
                    self._chunk(f"data: {json.dumps(event)}\n\n".encode())
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def stand_in_router():
    router = StandInRouter()
    yield router
    router.stop()


def test_offline_replay_grows_each_agents_context(stand_in_router):
    agents = generate(TraceConfig(agents=3, seed=5, turns=4, first_append_tokens=100, sigma=0.0))
    salt = 11
    result = replay(agents, ReplayConfig(stand_in_router.url, "m", token_salt=salt, progress=False))
    summary = result.summary()
    assert summary["agents_done"] == 3 and summary["failed_requests"] == 0
    assert summary["requests"] == sum(len(a.turns) for a in agents)
    assert summary["read_sides"] == {"de": summary["requests"]}
    assert summary["jct_s"] >= max(r.start_s + r.e2e_s for r in result.records) - 1e-6
    # Turn i's prompt = turn i-1's prompt + its output + turn i's salted append.
    for agent in agents:
        context: list[int] = []
        for turn in agent.turns:
            prompt = context + [(t + salt) % 1024 for t in turn.append]
            assert prompt in stand_in_router.prompts
            context = prompt + [len(prompt) % 1024] * turn.output_tokens
    record = result.records[0]
    assert record.ttft_s is not None and record.ttst_s is not None and record.tpot_s is not None
    assert record.ttft_s <= record.ttst_s <= record.e2e_s


def test_online_replay_reports_slo(stand_in_router):
    agents = generate(TraceConfig(agents=4, seed=2, turns=2, first_append_tokens=64))
    config = ReplayConfig(stand_in_router.url, "m", mode="online", rate=50.0, progress=False,
                          slo_ttft_s=30.0, slo_tpot_s=5.0)  # fmt: skip
    result = replay(agents, config)
    summary = result.summary()
    starts = {r.start_s for r in result.records if r.turn == 0}
    assert len(starts) == 4  # Poisson arrivals: every agent at its own time
    assert summary["slo"]["holds"] is True
    assert summary["slo"]["percentile"] == 90.0


def test_replay_config_errors_name_the_setting():
    with pytest.raises(ReplayError, match="replay.rate"):
        ReplayConfig("http://x:1", "m", mode="online").validate()
    with pytest.raises(ReplayError, match="replay.mode"):
        ReplayConfig("http://x:1", "m", mode="sideways").validate()


# --- report arithmetic --------------------------------------------------------------------------


def test_nic_balance_weights_busy_windows():
    mbit = 8.0  # 1 MB/s per link
    samples = [
        NicSample(0.0, [0, 0], [0, 0]),
        NicSample(1.0, [1_000_000, 1_000_000], [0, 0]),  # balanced: 1.0
        NicSample(2.0, [2_000_000, 1_000_000], [0, 10]),  # one link only: 2.0
        NicSample(3.0, [2_000_001, 1_000_000], [0, 10]),  # idle: ignored
    ]
    balance = nic_balance(samples, ["pe0", "de0"], mbit, busy_fraction=0.25)
    assert balance["busy_windows"] == 2
    # Weighted by bytes moved: (2 MB x 1.0 + 1 MB x 2.0) / 3 MB.
    assert balance["max_over_avg"] == pytest.approx(4 / 3)
    assert balance["read_bytes"] == {"pe0": 2_000_001, "de0": 1_000_000}
    assert balance["write_bytes"] == {"pe0": 0, "de0": 10}
    assert balance["cpu_busy"] is None  # samples without ticks: nothing claimed


def test_nic_balance_reports_each_core_busy_while_the_links_moved_data():
    mbit = 8.0
    samples = [
        NicSample(0.0, [0, 0], [0, 0], {"cpu0": (0, 0), "cpu1": (0, 0)}),
        # links busy: cpu0 full, cpu1 half
        NicSample(1.0, [1_000_000, 1_000_000], [0, 0], {"cpu0": (100, 100), "cpu1": (50, 100)}),
        NicSample(2.0, [1_000_000, 1_000_000], [0, 0], {"cpu0": (100, 200), "cpu1": (50, 200)}),  # both idle
    ]
    balance = nic_balance(samples, ["pe0", "de0"], mbit, busy_fraction=0.25)
    assert balance["cpu_busy_while_links_busy"] == {"cpu0": 1.0, "cpu1": 0.5}
    # Control: over the whole run the idle second counts, so the same ticks read half as busy.
    assert balance["cpu_busy"] == {"cpu0": 0.5, "cpu1": 0.25}


def test_cpu_ticks_counts_idle_and_iowait_as_not_busy(tmp_path):
    stat = tmp_path / "stat"
    # cpu1 offline: the next core keeps its own number.
    stat.write_text("cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 10 1 5 80 4 0 0 0 0 0\ncpu2 1 0 1 97 1 0 0 0 0 0\nintr 5\n")
    assert cpu_ticks(str(stat)) == {"cpu0": (16, 100), "cpu2": (2, 100)}
    here = cpu_ticks()  # this machine's: one entry per online core
    assert here and all(0 <= busy <= ticks for busy, ticks in here.values())


def test_ttft_breakdown_and_comparison():
    deltas = {"pe0": {"vllm:request_queue_time_seconds_sum": 10.0, "vllm:request_queue_time_seconds_count": 10,
                      "dualpath_kv:load_seconds_sum": 6.0, "vllm:request_prefill_time_seconds_sum": 2.0,
                      "vllm:request_prefill_time_seconds_count": 10}}  # fmt: skip
    from dualpath_dev.compare import ENGINE_SERIES

    deltas = {"pe0": {k: deltas["pe0"].get(k, 0.0) for k in ENGINE_SERIES}}
    split = ttft_breakdown({"ttft_s": {"mean": 1.5}}, deltas, ["pe0"])
    assert split == pytest.approx({"queue_s": 0.4, "read_s": 0.6, "prefill_s": 0.2, "other_s": 0.3, "ttft_s": 1.5})
    runs = {m: {"summary": {"jct_s": j, "agents_failed": 0}} for m, j in (("basic", 20.0), ("dualpath", 11.0), ("oracle", 10.0))}
    comparison = compare_runs(runs, bound=2.0)
    assert comparison["dualpath_speedup"] == pytest.approx(20 / 11)
    assert comparison["fraction_of_bound"] == pytest.approx(10 / 11)
    assert comparison["dualpath_over_oracle"] == pytest.approx(1.1)
    assert compare_runs({"basic": runs["basic"], "dualpath": {"mode": "dualpath", "error": "x"}}, 2.0)[
        "dualpath_speedup"] is None  # fmt: skip


def test_report_renders_table_and_plot(tmp_path):
    samples = [NicSample(float(t), [t * 10**6, t * 10**6], [0, 0], {"cpu0": (90 * t, 100 * t)}) for t in range(4)]
    run = {
        "summary": {"jct_s": 12.0, "ttft_s": {"mean": 1.0, "p90": 2.0}, "tpot_s": {"p50": 0.03},
                    "read_sides": {"pe": 3, "de": 2}, "failed_requests": 0, "agents_failed": 0},
        "ttft_breakdown": {"queue_s": 0.1, "read_s": 0.5, "prefill_s": 0.2, "other_s": 0.2, "ttft_s": 1.0},
        "nic": nic_balance(samples, ["pe0", "de0"], 8.0, 0.25),
    }  # fmt: skip
    payload = {
        "config": {"cluster": {"storage_mbit": 8.0, "compute_mbit": 0.0}, "replay_mode": "offline"},
        "trace": summarize(generate(TraceConfig(agents=2, turns=3))),
        "topologies": [{"topology": "1P1D", "bound": 2.0, "runs": {"basic": run, "dualpath": run,
                        "oracle": {"mode": "oracle", "error": "ConfigError: unknown key benchmark_oracle"}},
                        "comparison": compare_runs({"basic": run, "dualpath": run}, 2.0)}],
    }  # fmt: skip
    paths = report.write(payload, tmp_path, "bench")
    text = paths["md"].read_text()
    assert "| 1P1D | dualpath | 12.0 | 1.00x | 2.00x | 1.00 |" in text
    assert "oracle | failed: ConfigError" in text
    assert "1P1D dualpath: each core busy while the storage links moved data (over the whole run): cpu0 90% (90%)." in text
    assert json.loads(paths["json"].read_text())["table"] == text
    assert paths["png"].stat().st_size > 0


# --- the emulated network -----------------------------------------------------------------------


def _subnet() -> str:
    # Not 10.213, the benchmark's default: a test must not collide with a running benchmark.
    return f"10.{220 + int.from_bytes(os.urandom(1), 'big') % 30}"


@needs_netns
def test_exception_after_tc_leaves_nothing(prefix):
    with pytest.raises(RuntimeError, match="injected"):
        with ClusterNetwork(ClusterConfig(prefill=1, decode=2, storage_mbit=100, compute_mbit=500,
                                          subnet=_subnet(), prefix=prefix)) as net:  # fmt: skip
            assert set(net.namespaces) <= set(leftovers(prefix))
            qdisc = subprocess.run(["ip", "netns", "exec", net.s3_namespace, "tc", "qdisc", "show", "dev",
                                    net.nodes[0].storage_peer_if], capture_output=True, text=True).stdout  # fmt: skip
            assert "htb" in qdisc
            raise RuntimeError("injected")
    assert leftovers(prefix) == []


@needs_netns
def test_failure_while_building_leaves_nothing(monkeypatch, prefix):
    calls = []
    original = ClusterNetwork._shape

    def shape_then_fail(namespace, interface, mbit):
        calls.append(interface)
        if len(calls) == 3:
            raise ClusterError("injected tc failure")
        original(namespace, interface, mbit)

    monkeypatch.setattr(ClusterNetwork, "_shape", staticmethod(shape_then_fail))
    with pytest.raises(ClusterError, match="injected"):
        ClusterNetwork(ClusterConfig(prefill=2, decode=1, subnet=_subnet(), prefix=prefix)).build()
    assert leftovers(prefix) == []


@needs_netns
@pytest.mark.parametrize("failing", ["SeaweedFS", "S3RelayProcess"])
def test_service_failure_in_cluster_start_leaves_nothing(monkeypatch, tmp_path, prefix, failing):
    from dualpath_dev import s3_relay, seaweedfs

    def refuse(self, timeout_s=60.0):
        raise RuntimeError("injected S3 start failure")

    service = seaweedfs.SeaweedFS if failing == "SeaweedFS" else s3_relay.S3RelayProcess
    monkeypatch.setattr(service, "start", refuse)
    config = ClusterConfig(subnet=_subnet(), prefix=prefix, store_rtt_ms=20.0 if failing == "S3RelayProcess" else 0.0)
    cluster = EmulatedCluster(config, tmp_path, tmp_path / "model")
    with pytest.raises(RuntimeError, match="injected S3"):
        with cluster:
            pass
    assert leftovers(prefix) == []
    assert cluster.s3 is None and cluster.relay is None  # the SeaweedFS that had started was stopped too


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_midway_tears_down(sig, prefix):
    code = (
        "import signal, sys\n"
        "from dualpath_dev.cluster import ClusterConfig, ClusterNetwork\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"
        # A background shell starts its children with SIGINT ignored; this test needs the default.
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"with ClusterNetwork(ClusterConfig(subnet={_subnet()!r}, prefix={prefix!r})) as net:\n"
        "    print('built', flush=True)\n"
        "    sys.stdin.read()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "built", child.stderr.read()
        assert leftovers(prefix)
        child.send_signal(sig)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode != 0
    assert leftovers(prefix) == []


@needs_netns
def test_subnet_in_use_is_refused(prefix):
    subnet = _subnet()
    other = prefix[:-1] + ("1" if prefix[-1] == "0" else "0")
    with ClusterNetwork(ClusterConfig(subnet=subnet, prefix=prefix)):
        with pytest.raises(ClusterError, match="in use here"):
            ClusterNetwork(ClusterConfig(subnet=subnet, prefix=other)).build()
    assert leftovers(other) == []


@needs_netns
def test_storage_link_is_rate_limited_and_counted(prefix):
    mbit, size = 40.0, 2_500_000  # 0.5 s at the link rate
    server_code = (
        "import socket\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('0.0.0.0', 9999)); s.listen(); print('ready', flush=True)\n"
        f"c, _ = s.accept(); c.sendall(b'x' * {size}); c.close()\n"
    )
    with ClusterNetwork(ClusterConfig(storage_mbit=mbit, subnet=_subnet(), prefix=prefix)) as net:
        node = net.nodes[0]
        server = subprocess.Popen(["ip", "netns", "exec", net.s3_namespace, sys.executable, "-c", server_code],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert server.stdout.readline().strip() == "ready"
            client_code = (
                "import socket, time\n"
                f"s = socket.create_connection(({node.s3_addr!r}, 9999)); n = 0; t = time.perf_counter()\n"
                "while (b := s.recv(1 << 20)): n += len(b)\n"
                "print(n, time.perf_counter() - t)\n"
            )
            with NicSampler(net, interval_s=0.1) as sampler:
                out = subprocess.run(["ip", "netns", "exec", node.namespace, sys.executable, "-c", client_code],
                                     capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
            server.wait(timeout=30)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    received, seconds = int(out[0]), float(out[1])
    assert received == size
    # The link may be slower on a loaded machine, never much faster than its rate.
    assert seconds >= 0.7 * size * 8 / (mbit * 1e6)
    # Each sample also holds this machine's per-core ticks, which only grow.
    assert all(len(s.cpu_ticks) == len(sampler.samples[0].cpu_ticks) > 0 for s in sampler.samples)
    assert sampler.samples[-1].cpu_ticks["cpu0"][1] > sampler.samples[0].cpu_ticks["cpu0"][1]
    moved = sampler.samples[-1].read_bytes[0] - sampler.samples[0].read_bytes[0]
    assert size <= moved <= size * 1.1  # payload plus TCP/IP headers
    # The other node read nothing (a few IPv6 neighbour-discovery packets aside).
    assert sampler.samples[-1].read_bytes[1] - sampler.samples[0].read_bytes[1] < 10_000


_STORE_CLIENT = """
import hashlib, json, sys, time
import boto3
from botocore.config import Config
client = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1",
                      config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
body = open(sys.argv[3], "rb").read()
clock = time.perf_counter()
client.put_object(Bucket=sys.argv[2], Key="relayed", Body=body)
put_s = time.perf_counter() - clock
clock = time.perf_counter()
got = client.get_object(Bucket=sys.argv[2], Key="relayed")["Body"].read()
print(json.dumps({"put_s": put_s, "get_s": time.perf_counter() - clock, "sha": hashlib.sha256(got).hexdigest()}))
"""


@needs_netns
def test_the_store_rtt_relay_runs_in_the_s3_namespace_and_delays_what_crosses_a_storage_link(tmp_path, prefix):
    import hashlib

    import boto3
    from botocore.config import Config

    from dualpath_dev.cluster import BUCKET

    rtt_ms, body = 50.0, os.urandom(1 << 20)
    (tmp_path / "body").write_bytes(body)
    config = ClusterConfig(storage_mbit=200, subnet=_subnet(), prefix=prefix, store_rtt_ms=rtt_ms)
    with EmulatedCluster(config, tmp_path, tmp_path / "model") as cluster:
        node, relay_pid = cluster.network.nodes[0], cluster.relay.proc.pid
        in_s3 = subprocess.run(["ip", "netns", "pids", cluster.network.s3_namespace], capture_output=True,
                               text=True, check=True).stdout.split()  # fmt: skip
        assert str(relay_pid) in in_s3
        env = dict(os.environ, AWS_ACCESS_KEY_ID=cluster.s3.access_key, AWS_SECRET_ACCESS_KEY=cluster.s3.secret_key)
        # An engine's way: from its namespace, over its storage link, to the relay's port.
        with NicSampler(cluster.network, interval_s=0.1) as sampler:
            out = subprocess.run(["ip", "netns", "exec", node.namespace, sys.executable, "-c", _STORE_CLIENT,
                                  f"http://{node.s3_addr}:{cluster.store_port}", BUCKET, str(tmp_path / "body")],
                                 capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr
        timed = json.loads(out.stdout)
        assert timed["sha"] == hashlib.sha256(body).hexdigest()
        assert timed["put_s"] >= rtt_ms / 1000 and timed["get_s"] >= rtt_ms / 1000  # lower bounds only
        moved = [sampler.samples[-1].write_bytes[0] - sampler.samples[0].write_bytes[0],
                 sampler.samples[-1].read_bytes[0] - sampler.samples[0].read_bytes[0]]  # fmt: skip
        assert min(moved) >= len(body)  # both ways over the node's storage link
        # The relay forwarded to the cluster's SeaweedFS: the object is there.
        assert cluster.s3.client().get_object(Bucket=BUCKET, Key="relayed")["Body"].read() == body
        # The router's way: over the control link, through the relay too.
        store = boto3.client("s3", endpoint_url=cluster.store_endpoint, aws_access_key_id=cluster.s3.access_key,
                             aws_secret_access_key=cluster.s3.secret_key, region_name="us-east-1",
                             config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))  # fmt: skip
        clock = time.perf_counter()
        store.head_object(Bucket=BUCKET, Key="relayed")
        assert time.perf_counter() - clock >= rtt_ms / 1000
        assert cluster.relay.requests() == {"PUT": 1, "GET": 1, "HEAD": 1}
    assert leftovers(prefix) == []
    with pytest.raises(ProcessLookupError):
        os.kill(relay_pid, 0)


# --- the real stack ------------------------------------------------------------------------------


@needs_netns
@pytest.mark.engine
def test_smoke_1p1d_two_agents(tmp_path, tiny_model, prefix):
    from dualpath_dev.compare import BenchConfig, run_comparison

    agents = generate(TraceConfig(agents=2, seed=0, turns=3, first_append_tokens=1024, sigma=0.0))
    # With a store round trip: the engines' reads and writes and the router's lookups go through the relay.
    cluster = ClusterConfig(storage_mbit=200, subnet=_subnet(), prefix=prefix, store_rtt_ms=2.0)
    config = BenchConfig(modes=("basic", "dualpath"), cluster=cluster, progress=False, warmup_requests=1)
    payload = run_comparison(agents, config, tmp_path, tiny_model)
    assert leftovers(prefix) == []
    topology = payload["topologies"][0]
    assert topology["store_rtt_ms"] == 2.0
    runs = topology["runs"]
    for mode in ("basic", "dualpath"):
        assert "error" not in runs[mode], runs[mode].get("error")
        summary = runs[mode]["summary"]
        # On failure, what each engine skipped saving and each failed turn's error say why.
        why = {"skipped": {engine: deltas.get(counter_total_name("save_skipped_chunks"))
                           for engine, deltas in runs[mode]["engine_deltas"].items()},
               "errors": [r["error"] for r in runs[mode]["records"] if r["error"]]}  # fmt: skip
        assert summary["agents_done"] == 2 and summary["failed_requests"] == 0, why
        assert summary["hit_tokens"] > 0  # later turns hit the chunks the DE stored
        relayed = runs[mode]["relay"]["requests"]
        assert relayed.get("GET", 0) > 0 and relayed.get("PUT", 0) > 0, relayed  # hits read, chunks saved
    assert set(runs["basic"]["summary"]["read_sides"]) == {"pe"}
    assert runs["basic"]["nic"]["read_bytes"]["pe0"] > 0
    report.write(payload, tmp_path, "smoke")
    assert "| 1P1D | 2 | basic |" in (tmp_path / "smoke.md").read_text()
