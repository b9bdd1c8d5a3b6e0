"""benchmarks/bench_traffic_isolation.py: the tc trees it builds, where the marked flow goes, its teardown.

The tc command builder is pure. The rest builds the emulated network (1 PE, 1 DE namespace) and
needs root and network namespaces; those tests are skipped with the reason when ``ip netns add`` is
refused. Timing is the benchmark's business: nothing here asserts a latency.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest

from dualpath_dev.cluster import htb_shaping, leftovers
from tests.conftest import REPO_ROOT, needs_netns

_SCRIPT = REPO_ROOT / "benchmarks" / "bench_traffic_isolation.py"
_spec = importlib.util.spec_from_file_location("bench_traffic_isolation", _SCRIPT)
bench = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up
_spec.loader.exec_module(bench)



# --- the tc trees ----------------------------------------------------------------------------------


def test_fifo_and_idle_are_the_clusters_own_shaping():
    for mode in ("idle", "fifo"):
        assert bench.link_commands("eth9", 200.0, mode, 46) == htb_shaping("eth9", 200.0)


def test_prio_splits_the_link_into_a_high_class_for_the_dscp_and_a_low_class_for_the_rest():
    commands = bench.link_commands("eth9", 200.0, "prio", 46)
    assert commands[:2] == htb_shaping("eth9", 200.0)  # the same rate limit as without isolation
    classes = {c[c.index("classid") + 1]: c for c in commands if c[:2] == ["class", "add"] and "1:10" in c[5:7]}
    assert set(classes) == {"1:11", "1:12"}

    def option(command: list[str], name: str) -> str:
        return command[command.index(name) + 1]

    high, low = classes["1:11"], classes["1:12"]
    assert option(high, "parent") == option(low, "parent") == "1:10"
    assert option(high, "prio") == "0" and option(low, "prio") == "1"  # htb serves prio 0 first
    assert option(high, "ceil") == option(low, "ceil") == "200.0mbit"  # either may use the whole link
    rates = [float(option(c, "rate").removesuffix("mbit")) for c in (high, low)]
    assert sum(rates) == pytest.approx(200.0) and min(rates) > 0  # KV keeps a guarantee: never starved
    filters = [c for c in commands if c[:2] == ["filter", "add"]]
    assert len(filters) == 2
    marked, rest = sorted(filters, key=lambda c: int(option(c, "prio")))
    # DSCP 46 is TOS 0xb8; the mask keeps the ECN bits out of the match.
    assert marked[marked.index("match"):] == ["match", "ip", "tos", "0xb8", "0xfc", "flowid", "1:11"]
    assert option(marked, "protocol") == "ip"
    assert option(rest, "protocol") == "all" and rest[-2:] == ["flowid", "1:12"]
    assert rest[rest.index("match"):rest.index("flowid")] == ["match", "u32", "0", "0"]  # everything


def test_the_filter_follows_the_dscp():
    commands = bench.link_commands("eth9", 100.0, "prio", 16)
    marked = next(c for c in commands if "tos" in c)
    assert marked[marked.index("tos") + 1:marked.index("tos") + 3] == ["0x40", "0xfc"]


@pytest.mark.parametrize(("mode", "dscp", "message"), [("strict", 46, "mode must be one of"),
                                                        ("prio", 64, "dscp must be in 0..63"),
                                                        ("prio", -1, "dscp must be in 0..63")])  # fmt: skip
def test_bad_mode_or_dscp_is_refused(mode, dscp, message):
    with pytest.raises(ValueError, match=message):
        bench.link_commands("eth9", 100.0, mode, dscp)


def test_link_settings_set_the_mtu_and_turn_segmentation_offload_off():
    assert bench.link_settings("eth9", 9000) == ["link", "set", "dev", "eth9", "mtu", "9000", "gso_max_segs", "1"]


def test_cpu_split_gives_the_flow_a_cpu_of_its_own():
    flow, kv = bench.cpu_split()
    if len(os.sched_getaffinity(0)) < 2:
        assert (flow, kv) == (None, None)
    else:
        assert len(flow) == 1 and kv and not set(flow) & set(kv)
        assert set(flow) | set(kv) == os.sched_getaffinity(0)


@pytest.mark.parametrize(("argv", "named"), [(["--dscp", "64"], "--dscp"), (["--modes", "idle,strict"], "--modes"),
                                             (["--message-bytes", "4"], "--message-bytes"),
                                             (["--link-mbit", "0"], "--link-mbit"), (["--mtu", "100"], "--mtu")])  # fmt: skip
def test_bad_options_are_refused_by_name(argv, named, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert named in capsys.readouterr().err


# --- on the emulated network ---------------------------------------------------------------------------


def _subnet() -> str:
    # Neither the benchmarks' defaults (10.213, 10.214) nor the e2e network tests' 10.220-10.249.
    return f"10.{160 + int.from_bytes(os.urandom(1), 'big') % 30}"


def _spec(prefix: str, mode: str = "prio", **changes) -> bench.RunSpec:
    return dataclasses.replace(
        bench.RunSpec(mode=mode, link_mbit=50.0, dscp=46, duration_s=2.0, rate=100.0, message_bytes=128,
                      timeout_ms=1000.0, read_mib=0.5, reads_in_flight=2, subnet=_subnet(), prefix=prefix),
        **changes,
    )  # fmt: skip


@needs_netns
def test_marked_flow_is_classified_into_the_high_class_and_unmarked_into_the_low(prefix):
    spec = _spec(prefix)
    net = bench.shaped_network(spec)
    try:
        marked = bench.measure(net, spec, kv=True)
        # The negative control: the same flow without its DSCP, on the same tree.
        unmarked = bench.measure(net, dataclasses.replace(spec, dscp=0, duration_s=1.0), kv=False)
    finally:
        net.teardown()
    assert leftovers(prefix) == []

    answered = sum(r is not None for r in marked["flow"]["rtt_us"])
    assert answered > 0.9 * spec.count
    # The PE's link carries the echo replies: each one through 1:11, nothing else marked.
    assert answered <= marked["classes"]["1:11"]["packets"] <= spec.count
    # KV went through the low class, and the bytes that arrived are the source's.
    assert marked["kv"]["bytes_equal"] and marked["kv"]["checks"] >= 2
    flow = marked["flow"]
    in_window = sum(flow["start"] <= t <= flow["end"] for t in marked["kv"]["done"])
    assert in_window > spec.reads_in_flight
    # The counters span the flow's window; all but the READs in flight at its start crossed it entirely.
    assert marked["classes"]["1:12"]["bytes"] >= (in_window - spec.reads_in_flight) * marked["kv"]["read_bytes"]
    unmarked_answered = sum(r is not None for r in unmarked["flow"]["rtt_us"])
    assert unmarked_answered > 0
    assert unmarked["classes"]["1:11"]["packets"] == 0
    assert unmarked["classes"]["1:12"]["packets"] >= unmarked_answered


@needs_netns
def test_an_exception_midway_stops_every_worker_and_leaves_no_network(monkeypatch, prefix):
    started = []

    class RecordedWorker(bench.Worker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    def fail(namespace, interface):
        raise RuntimeError("injected failure after the workers started")

    monkeypatch.setattr(bench, "Worker", RecordedWorker)
    monkeypatch.setattr(bench, "class_counters", fail)
    with pytest.raises(RuntimeError, match="injected"):
        bench.run_mode(_spec(prefix, "fifo"))
    assert [w.role for w in started] == ["echo", "kv-source", "kv-reader"]
    assert all(w.proc.poll() is not None for w in started)
    assert leftovers(prefix) == []


@needs_netns
def test_sigterm_midway_tears_down(tmp_path, prefix):
    bench_run = subprocess.Popen(
        [sys.executable, str(_SCRIPT), "--modes", "fifo", "--duration", "30", "--link-mbit", "50", "--prefix", prefix,
         "--subnet", _subnet(), "--out-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        # Polls the network's state, which nothing can signal: the namespaces exist once built.
        while len([n for n in leftovers(prefix) if n.startswith(f"{prefix}-")]) < 3:
            assert bench_run.poll() is None, bench_run.stderr.read()
            assert time.monotonic() < deadline, "the benchmark did not build its network"
            time.sleep(0.05)
        bench_run.send_signal(signal.SIGTERM)
        bench_run.wait(timeout=60)
    finally:
        if bench_run.poll() is None:
            bench_run.kill()
            bench_run.wait()
    assert bench_run.returncode == 143
    assert leftovers(prefix) == []
    assert not list(tmp_path.iterdir())  # no result written for an interrupted run

