"""Traffic isolation in emulation: a latency-sensitive flow's RTT while NIXL KV pulls share its link.

The emulated cluster's network (``dualpath_dev.cluster``, one PE and one DE namespace on the compute
bridge) with both nodes' compute links shaped to ``--link-mbit`` on their egress. In each run:

- **KV pulls**: a NIXL agent in the PE namespace registers a ``--read-mib`` buffer; an agent in the
  DE namespace READs it over UCX (``UCX_TLS=tcp``, ``UCX_NET_DEVICES`` = the DE's compute link),
  ``--reads-in-flight`` READs at a time, back to back, so the PE -> DE direction is saturated. The
  bytes of the first and the last READ are compared with the source's (seeded) bytes.
- **The latency-sensitive flow**: UDP request/response messages of ``--message-bytes`` at
  ``--rate`` per second from the DE namespace to an echo server in the PE namespace, both sockets
  marked with DSCP ``--dscp`` (``IP_TOS``), as the model's collectives would be in their own traffic
  class; one RTT per message, a message unanswered after ``--timeout-ms`` counts as lost.

Three modes, each run on a freshly built network: ``idle`` (no KV, the link shaped as in ``fifo``),
``fifo`` (KV and the flow in one htb class: no isolation) and ``prio`` (the same htb rate limit
split into two classes: the flow's DSCP -> a high-priority class served first, everything else,
KV included, -> a low-priority class that may use all the link the flow leaves; this kernel has no
``prio``/``ets`` qdisc, so htb's own class priorities do it). :func:`link_commands` lists the exact
tc commands; docs/traffic-isolation.md ("Measured in emulation") quotes them beside the RoCE DSCP ->
TC mapping they mirror. The modes run in turn, ``--rounds`` times, and each mode's samples are
pooled, so whatever else the machine does weighs on all of them alike. Reported per mode: RTT
p50/p99/p99.9, lost messages, the p99 ratio to ``idle`` (goal: <= 1.20 with isolation) and the KV
goodput during the flow's windows (bytes of READs completed in them); the JSON adds every RTT, the tc counters of the PE link's classes (which class
the flow's packets went through) and each worker's CPU seconds.

The links, as a fabric's: the compute links get ``--mtu`` (9000 by default, jumbo frames; RDMA
fabrics run 4096-byte MTUs) and no segmentation offload (``gso_max_segs 1``), so a queue holds
wire-sized packets: with offload a single 64 KiB TCP super-packet would hold the link for
milliseconds ahead of any priority. The flow's endpoints run SCHED_FIFO (``--flow-scheduling``)
on a CPU of their own, the KV workers on the others (``--pin``): they stand for collectives that GPUs
and NICs drive, and for KV bytes an RDMA NIC moves without a CPU, not for processes queueing for
the same core.

What limits the figures: veth links on one kernel (no NIC, no switch queues, no RDMA: UCX moves
KV over TCP, so TCP's congestion control fills the bottleneck queue); a 2-core machine where the
kernel's packet processing (softirq) for KV and for the flow, the UCX workers and anything else
running share the CPUs: with the flow on the KV workers' CPUs (``--no-pin``), or at a 1500-byte MTU
(six times the KV packets), that kernel work adds hundreds of microseconds to the flow's tail even
in its own class (docs/traffic-isolation.md quotes both), and a
latency spike may be scheduling, not the link (the JSON records the workers' CPU time and the load
average); Python timestamps around ``send``/``recv`` (tens of microseconds of noise).

Runs as root where ``ip netns add`` is allowed; namespaces, links and worker processes are removed
on every exit path (also Ctrl-C and SIGTERM). Results: ``benchmarks/results/traffic-isolation.{json,png}``
(``traffic-isolation-quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from _common import (  # noqa: E402
    REPO_ROOT,
    exit_on_sigterm,
    markdown_table,
    pyplot,
    result_payload,
    run_and_report,
    save_figure,
)

from dualpath_dev.cluster import (  # noqa: E402
    PREFIX_RE, ClusterConfig, ClusterNetwork, htb_shaping, netns_supported, tc,
)
from dualpath_dev.processes import stop_process_group  # noqa: E402

MIB = 1 << 20
MB = 1e6
MODES = ("idle", "fifo", "prio")
GOAL_P99_RATIO = 1.20  # the goal: the flow's p99 with isolation, over its idle p99
READY = "TRAFFIC-ISOLATION-READY "  # a worker's first line on stdout: it is listening / connected
RESULT = "TRAFFIC-ISOLATION-RESULT "  # a worker's last line (NIXL may print to stdout too)
HIGH_CLASS, LOW_CLASS = "1:11", "1:12"  # with isolation: the flow's class, everything else (KV)
HIGH_SHARE = 0.9  # of the link guaranteed to the flow's class (the collectives' large share; KV gets the rest)
SEED = 1234
FLOW_RT_PRIORITY = 50  # SCHED_FIFO priority of the flow's endpoints (1..99), above every normal process


# --- the tc trees (pure) ---------------------------------------------------------------------------


def link_commands(interface: str, mbit: float, mode: str, dscp: int) -> list[list[str]]:
    """The tc commands (arguments after ``tc``) for one shaped link's egress in ``mode``.

    All modes share the emulated cluster's rate limit: htb class 1:10 at ``mbit``, the default
    (``dualpath_dev.cluster.htb_shaping``). ``idle`` and ``fifo`` stop there: one FIFO for
    everything. ``prio`` splits 1:10 into two htb classes that may each use the whole link
    (``ceil``): 1:11 (htb ``prio 0``, guaranteed :data:`HIGH_SHARE` of the rate) for IPv4 packets
    whose DSCP is ``dscp``, and 1:12 (``prio 1``, the rest guaranteed) for every other packet, KV
    included. htb dequeues a class within its guaranteed rate before any class that borrows, and
    among those the lower ``prio`` first, so a flow far below its guarantee is served strictly first,
    while KV takes whatever the flow leaves idle and is never starved below its own guarantee.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not 0 <= dscp <= 63:
        raise ValueError(f"dscp must be in 0..63, got {dscp}")
    commands = htb_shaping(interface, mbit)
    if mode == "prio":
        ceil = f"{mbit}mbit"
        for classid, share, prio in ((HIGH_CLASS, HIGH_SHARE, "0"), (LOW_CLASS, 1 - HIGH_SHARE, "1")):
            commands.append(["class", "add", "dev", interface, "parent", "1:10", "classid", classid, "htb",
                             "rate", f"{mbit * share:g}mbit", "ceil", ceil, "prio", prio, "quantum", "1514"])  # fmt: skip
        commands += [
            # u32 on the IPv4 header's DS field (the TOS byte; DSCP is its upper six bits).
            ["filter", "add", "dev", interface, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "tos", hex(dscp << 2), "0xfc", "flowid", HIGH_CLASS],
            # Everything else; 1:10 is no longer a leaf, so the root's default could not take it.
            ["filter", "add", "dev", interface, "parent", "1:", "protocol", "all", "prio", "2", "u32",
             "match", "u32", "0", "0", "flowid", LOW_CLASS],
        ]  # fmt: skip
    return commands


def link_settings(interface: str, mtu: int) -> list[str]:
    """``ip link`` arguments for a shaped link's end: the MTU, and no segmentation offload, so its queue
    holds wire-sized packets."""
    return ["link", "set", "dev", interface, "mtu", str(mtu), "gso_max_segs", "1"]


# --- the workers (each in a namespace, started by the harness) ---------------------------------------


def _say(marker: str, payload: dict) -> None:
    print(marker + json.dumps(payload), flush=True)


def _stdin_closed(wait_s: float = 0.0) -> bool:
    """True once the harness closed this worker's stdin (its stop signal); waits at most ``wait_s`` for it."""
    readable, _, _ = select.select([sys.stdin], [], [], wait_s)
    return bool(readable) and not sys.stdin.buffer.read1(1 << 16)


def _flow_scheduling(spec: dict) -> None:
    """With ``realtime``, SCHED_FIFO for the flow's endpoints: they run as soon as a message arrives.

    The flow stands for the model's collectives, which the GPU and the NIC drive, not processes that
    wait for a CPU the KV workers and the rest of the machine share; without this, a 2-core box
    adds its scheduling delays to the link's queueing delay, in every run, idle included.
    """
    if spec["realtime"]:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(FLOW_RT_PRIORITY))


def echo_worker(spec: dict) -> None:
    """UDP echo server on ``spec['host']``; the replies carry the flow's DSCP too (they cross the loaded link)."""
    _flow_scheduling(spec)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, spec["dscp"] << 2)
    sock.bind((spec["host"], 0))
    _say(READY, {"port": sock.getsockname()[1]})
    while True:  # until the harness stops this process
        data, peer = sock.recvfrom(65536)
        sock.sendto(data, peer)


def ping_worker(spec: dict) -> dict:
    """``spec['count']`` request/response messages paced at ``spec['rate']`` per second; RTTs in µs (None: lost)."""
    _flow_scheduling(spec)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, spec["dscp"] << 2)
    sock.connect((spec["host"], spec["port"]))
    timeout_s = spec["timeout_ms"] / 1000
    padding = bytes(spec["message_bytes"] - 8)
    rtts: list[float | None] = []
    start = time.monotonic()
    for seq in range(spec["count"]):
        delay = start + seq / spec["rate"] - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # pacing: the schedule of an open-loop flow, not synchronization
        sent = time.perf_counter_ns()
        sock.send(seq.to_bytes(8, "big") + padding)
        deadline = time.monotonic() + timeout_s
        rtt = None
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                reply = sock.recv(65536)
            except TimeoutError:
                break
            if int.from_bytes(reply[:8], "big") == seq:  # a late reply to a lost message is skipped
                rtt = (time.perf_counter_ns() - sent) / 1000
                break
        rtts.append(rtt)
    return {"start": start, "end": time.monotonic(), "rtt_us": rtts, "cpu_s": time.process_time()}


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    from nixl_backends.transport import add_ucx_backend

    logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines would go to stdout
    # No progress thread: it polls without pause and would take a core of two from the flow. The
    # workers progress UCX themselves with paced polls (the reader as it checks its READs, the
    # source as it checks for notifications), as the connector's workers do.
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    add_ucx_backend(agent)  # UCX_TLS / UCX_NET_DEVICES come from the environment the harness set
    return agent


def _source_bytes(nbytes: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, 256, nbytes, dtype=np.uint8)


def kv_source_worker(spec: dict) -> dict:
    """The PE side: a registered KV-sized buffer the reader pulls; serves until stdin closes."""
    from nixl_backends.transport import UCX

    agent = _agent(f"kv-source-{os.getpid()}")
    buffer = _source_bytes(spec["read_bytes"])
    registration = agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM", backends=[UCX])
    _say(READY, {"metadata": base64.b64encode(agent.get_agent_metadata()).decode(), "addr": buffer.ctypes.data,
                 "nbytes": buffer.nbytes})  # fmt: skip
    # Until the harness closes stdin: each wake-up progresses UCX (the peer's READs are served there).
    while not _stdin_closed(spec["progress_interval_s"]):
        agent.get_new_notifs()
    agent.deregister_memory(registration, backends=[UCX])
    return {"cpu_s": time.process_time()}


def kv_reader_worker(spec: dict) -> dict:
    """The DE side: READs of the source's buffer back to back until stdin closes; each READ's completion time."""
    from nixl_backends.nixl_io import Polling
    from nixl_backends.transport import UCX, post_read

    agent = _agent(f"kv-reader-{os.getpid()}")
    source = spec["source"]
    peer = agent.add_remote_agent(base64.b64decode(source["metadata"]))
    nbytes = source["nbytes"]
    expected = _source_bytes(nbytes)
    slots = [np.zeros(nbytes, dtype=np.uint8) for _ in range(spec["reads_in_flight"])]
    registration = agent.register_memory([(s.ctypes.data, s.nbytes, 0, "") for s in slots], "DRAM", backends=[UCX])
    remote = np.asarray([(source["addr"], nbytes, 0)], dtype=np.uint64)

    def post(slot: np.ndarray):
        return post_read(agent, peer, np.asarray([(slot.ctypes.data, nbytes, 0)], dtype=np.uint64), "DRAM",
                         remote, "DRAM")  # fmt: skip

    def verified(slot: np.ndarray) -> bool:
        return bool(np.array_equal(slot, expected))

    done: list[float] = []
    checks: list[bool] = []
    in_flight = [(post(slot), slot) for slot in slots]
    polling = Polling(spec["timeout_s"])
    stopping = False
    while in_flight:
        progressed = False
        for i, (read, slot) in enumerate(in_flight):
            state = read.state()
            if state == "PROC":
                continue
            if state != "DONE":
                raise RuntimeError("a KV READ failed; see the UCX messages above")
            progressed = True
            done.append(time.monotonic())
            if len(done) == 1:
                checks.append(verified(slot))
                _say(READY, {"first_read_s": done[0]})
            if stopping:
                checks.append(verified(slot))
                in_flight[i] = None  # type: ignore[call-overload]
            else:
                slot[:] = 0  # poisoned: a READ that wrote nothing cannot pass the last check
                in_flight[i] = (post(slot), slot)
        in_flight = [entry for entry in in_flight if entry is not None]
        if not stopping and _stdin_closed():
            stopping = True  # let the READs in flight finish: their buffers must not be freed under UCX
            polling = Polling(spec["timeout_s"])
        if polling.expired:
            raise RuntimeError(f"no KV READ finished in {spec['timeout_s']}s")
        if progressed:
            polling = Polling(spec["timeout_s"])
        polling.sleep(progressed)
    agent.deregister_memory(registration, backends=[UCX])
    return {"done": done, "read_bytes": nbytes, "bytes_equal": all(checks), "checks": len(checks),
            "cpu_s": time.process_time()}  # fmt: skip


WORKERS = {"echo": echo_worker, "ping": ping_worker, "kv-source": kv_source_worker, "kv-reader": kv_reader_worker}


# --- the harness -------------------------------------------------------------------------------------


def cpu_split() -> tuple[list[int] | None, list[int] | None]:
    """(the flow's CPUs, the KV workers' CPUs): the last CPU this process may use, and the others; (None, None)
    with fewer than two.

    Over RDMA a NIC moves KV bytes without a CPU and the collectives run on GPUs; over TCP on veth each
    KV packet costs CPU time, and on a shared core that time would land in the flow's latency.
    """
    cpus = sorted(os.sched_getaffinity(0))
    return ([cpus[-1]], cpus[:-1]) if len(cpus) >= 2 else (None, None)


@dataclass(frozen=True)
class RunSpec:
    """What one measurement does; the same for every mode but ``mode``."""

    mode: str
    link_mbit: float
    dscp: int
    duration_s: float
    rate: float
    message_bytes: int
    timeout_ms: float
    read_mib: float
    reads_in_flight: int
    subnet: str
    mtu: int = 9000
    realtime: bool = True
    flow_cpus: list[int] | None = None  # None: not pinned
    kv_cpus: list[int] | None = None
    prefix: str = ""

    @property
    def count(self) -> int:
        return max(1, round(self.duration_s * self.rate))


class Worker:
    """One worker process under ``ip netns exec``, in its own process group, stopped by its PID."""

    def __init__(self, node, role: str, spec: dict, env: dict[str, str] | None = None) -> None:
        command = [*node.launcher, sys.executable, str(Path(__file__).resolve()), "--worker", role, json.dumps(spec)]
        self.role = role
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=REPO_ROOT, env={**os.environ, **(env or {})}, start_new_session=True)  # fmt: skip

    def line(self, marker: str) -> dict:
        """The worker's next line starting with ``marker`` (other output is skipped); raises if it exits first."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(marker):
                return json.loads(line[len(marker):])
        raise RuntimeError(f"the {self.role} worker exited ({self.proc.wait()}) before its {marker.strip()} line")

    def finish(self, timeout_s: float) -> dict:
        """Close stdin (the worker's stop signal) and return its result line."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        result = self.line(RESULT)
        self.proc.wait(timeout=timeout_s)
        return result

    def stop(self) -> None:
        stop_process_group(self.proc, grace_s=5.0)


@contextlib.contextmanager
def workers() -> Iterator[list[Worker]]:
    """A list to start workers into; every one is stopped on the way out, whatever happened."""
    started: list[Worker] = []
    try:
        yield started
    finally:
        for worker in reversed(started):
            worker.stop()


def shaped_network(spec: RunSpec):
    """The emulated cluster's network (1 PE, 1 DE) with both compute links shaped for ``spec.mode``."""
    net = ClusterNetwork(ClusterConfig(prefill=1, decode=1, subnet=spec.subnet, prefix=spec.prefix))
    net.build()
    try:
        for node in net.nodes:
            subprocess.run(["ip", "-n", node.namespace, *link_settings(node.compute_if, spec.mtu)], check=True)
            subprocess.run(["ip", *link_settings(node.compute_peer_if, spec.mtu)], check=True)  # the bridge's end
            for command in link_commands(node.compute_if, spec.link_mbit, spec.mode, spec.dscp):
                tc(node.namespace, *command)
    except BaseException:
        net.teardown()
        raise
    return net


_CLASS_LINE = re.compile(r"^class htb (\S+) .*\n\s*Sent (\d+) bytes (\d+) pkt", re.MULTILINE)


def class_counters(namespace: str, interface: str) -> dict[str, dict[str, int]]:
    """``tc -s class show``: bytes and packets sent per htb class of ``interface``."""
    out = subprocess.run(["ip", "netns", "exec", namespace, "tc", "-s", "class", "show", "dev", interface],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return {m[1]: {"bytes": int(m[2]), "packets": int(m[3])} for m in _CLASS_LINE.finditer(out)}


def measure(net, spec: RunSpec, kv: bool) -> dict:
    """The flow (and, with ``kv``, the KV pulls) on a built, shaped network; the raw samples and counters."""
    pe, de = net.nodes
    ucx = {"UCX_TLS": "tcp"}
    with workers() as started:
        echo = Worker(pe, "echo", {"host": pe.compute_addr, "dscp": spec.dscp, "realtime": spec.realtime,
                                   "cpus": spec.flow_cpus})  # fmt: skip
        started.append(echo)
        port = echo.line(READY)["port"]
        reader = None
        if kv:
            source = Worker(pe, "kv-source", {"read_bytes": int(spec.read_mib * MIB), "progress_interval_s": 0.001,
                                              "cpus": spec.kv_cpus}, {**ucx, "UCX_NET_DEVICES": pe.compute_if})  # fmt: skip
            started.append(source)
            reader = Worker(de, "kv-reader", {"source": source.line(READY), "reads_in_flight": spec.reads_in_flight,
                                              "timeout_s": 60.0, "cpus": spec.kv_cpus},
                            {**ucx, "UCX_NET_DEVICES": de.compute_if})  # fmt: skip
            started.append(reader)
            reader.line(READY)  # connected, and one READ through: the link is busy from here on
        before = class_counters(pe.namespace, pe.compute_if)
        ping = Worker(de, "ping", {"host": pe.compute_addr, "port": port, "dscp": spec.dscp, "count": spec.count,
                                   "rate": spec.rate, "message_bytes": spec.message_bytes,
                                   "timeout_ms": spec.timeout_ms, "realtime": spec.realtime,
                                   "cpus": spec.flow_cpus})  # fmt: skip
        started.append(ping)
        flow = ping.finish(timeout_s=30.0)
        after = class_counters(pe.namespace, pe.compute_if)
        result = {"flow": flow, "classes": {k: {f: v[f] - before.get(k, {}).get(f, 0) for f in v}
                                            for k, v in after.items()}}  # fmt: skip
        if reader is not None:
            result["kv"] = reader.finish(timeout_s=60.0)
            result["kv_source"] = source.finish(timeout_s=30.0)
    return result


def percentile_us(rtts: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(rtts), q)) if rtts else float("nan")


def summarize(mode: str, raws: Sequence[dict]) -> dict:
    """One row from a mode's runs (one per round): the flow's RTT percentiles and losses over all of
    them, the KV goodput in the flow's windows, the classes' counters and the workers' CPU seconds, summed."""
    rtts = [r for raw in raws for r in raw["flow"]["rtt_us"]]
    answered = [r for r in rtts if r is not None]
    windows = [raw["flow"]["end"] - raw["flow"]["start"] for raw in raws]
    classes: dict[str, dict[str, int]] = {}
    for raw in raws:
        for handle, counters in raw["classes"].items():
            total = classes.setdefault(handle, {"bytes": 0, "packets": 0})
            for name in total:
                total[name] += counters[name]
    kv = all("kv" in raw for raw in raws)
    row = {
        "mode": mode, "kv": kv, "rounds": len(raws), "messages": len(rtts), "lost": len(rtts) - len(answered),
        "p50_us": percentile_us(answered, 50), "p99_us": percentile_us(answered, 99),
        "p99_9_us": percentile_us(answered, 99.9), "max_us": max(answered, default=float("nan")),
        "p99_us_per_round": [percentile_us([r for r in raw["flow"]["rtt_us"] if r is not None], 99) for raw in raws],
        "window_s": sum(windows), "flow_cpu_s": sum(raw["flow"]["cpu_s"] for raw in raws), "classes": classes,
    }  # fmt: skip
    if kv:
        in_window = [sum(raw["flow"]["start"] <= t <= raw["flow"]["end"] for t in raw["kv"]["done"]) for raw in raws]
        moved = sum(n * raw["kv"]["read_bytes"] for n, raw in zip(in_window, raws))
        row.update(kv_reads_in_window=sum(in_window), kv_MBps=moved / sum(windows) / MB,
                   kv_MBps_per_round=[n * raw["kv"]["read_bytes"] / w / MB for n, raw, w in zip(in_window, raws, windows)],
                   kv_bytes_equal=all(raw["kv"]["bytes_equal"] for raw in raws),
                   kv_reader_cpu_s=sum(raw["kv"]["cpu_s"] for raw in raws),
                   kv_source_cpu_s=sum(raw["kv_source"]["cpu_s"] for raw in raws))  # fmt: skip
    row["rtt_us"] = rtts
    return row


def run_mode(spec: RunSpec) -> dict:
    """One run on a fresh network: the raw samples and counters (see :func:`measure`)."""
    net = shaped_network(spec)
    try:
        return measure(net, spec, kv=spec.mode != "idle")
    finally:
        net.teardown()


def run(args: argparse.Namespace) -> dict:
    ok, why = netns_supported()
    if not ok:
        raise SystemExit(f"bench_traffic_isolation needs network namespaces (root): {why}")
    commands = {mode: link_commands("<link>", args.link_mbit, mode, args.dscp) for mode in args.modes}
    flow_cpus, kv_cpus = cpu_split() if args.pin else (None, None)
    raws: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    # Rounds of every mode in turn: whatever else the machine does then weighs on all modes alike.
    for round_ in range(args.rounds):
        for mode in args.modes:
            spec = RunSpec(mode=mode, link_mbit=args.link_mbit, dscp=args.dscp, duration_s=args.duration,
                           rate=args.rate, message_bytes=args.message_bytes, timeout_ms=args.timeout_ms,
                           read_mib=args.read_mib, reads_in_flight=args.reads_in_flight, subnet=args.subnet,
                           mtu=args.mtu, realtime=args.flow_scheduling == "realtime", flow_cpus=flow_cpus,
                           kv_cpus=kv_cpus, prefix=args.prefix)  # fmt: skip
            print(f"round {round_ + 1}/{args.rounds}, {mode}: {spec.count} messages at {spec.rate:g}/s on a "
                  f"{spec.link_mbit:g} Mbit/s link ...", file=sys.stderr)  # fmt: skip
            raw = run_mode(spec)
            raws[mode].append(raw)
            answered = [r for r in raw["flow"]["rtt_us"] if r is not None]
            print(f"  p50 {percentile_us(answered, 50):.0f} us, p99 {percentile_us(answered, 99):.0f} us, "
                  f"lost {len(raw['flow']['rtt_us']) - len(answered)}", file=sys.stderr)  # fmt: skip
    rows = [summarize(mode, raws[mode]) for mode in args.modes]
    idle = next((r for r in rows if r["mode"] == "idle"), None)
    for row in rows:
        row["p99_over_idle"] = row["p99_us"] / idle["p99_us"] if idle else None
    prio = next((r for r in rows if r["mode"] == "prio"), None)
    goal = None
    if idle and prio:
        goal = {"p99_over_idle": prio["p99_over_idle"], "limit": GOAL_P99_RATIO,
                "met": prio["p99_over_idle"] <= GOAL_P99_RATIO and prio["lost"] == 0}  # fmt: skip
    return result_payload(args, tc_commands=commands, link_settings=link_settings("<link>", args.mtu),
                          cpus={"flow": flow_cpus, "kv": kv_cpus}, runs=rows, goal=goal)  # fmt: skip


def table(payload: dict) -> str:
    cfg, cpus = payload["config"], payload["cpus"]
    rows = []
    for r in payload["runs"]:
        ratio = r["p99_over_idle"]
        rows.append([
            r["mode"], "yes" if r["kv"] else "no", r["messages"], r["lost"], f"{r['p50_us']:.0f}",
            f"{r['p99_us']:.0f}", f"{r['p99_9_us']:.0f}", f"{ratio:.2f}x" if ratio is not None else "-",
            f"{r['kv_MBps']:.1f}" if r["kv"] else "-",
        ])  # fmt: skip
    caption = (
        f"A UDP request/response flow ({cfg['message_bytes']} B, {cfg['rate']:g}/s, DSCP {cfg['dscp']}) between the "
        f"emulated DE and PE namespaces, alone (idle) and while the DE pulls {cfg['read_mib']:g} MiB NIXL READs "
        f"from the PE back to back ({cfg['reads_in_flight']} in flight, UCX over TCP), on compute links shaped to "
        f"{cfg['link_mbit']:g} Mbit/s (htb, MTU {cfg['mtu']}): fifo = one queue for both, prio = the flow's DSCP in "
        f"a high-priority htb class. {cfg['rounds']} round(s) of {cfg['duration']:g} s per mode, modes in turn, "
        f"samples pooled; flow endpoints {cfg['flow_scheduling']}, CPUs flow/KV {cpus['flow'] or 'shared'}/"
        f"{cpus['kv'] or 'shared'} of {payload['environment']['cpu_count']}, load average "
        f"{payload['environment']['load_avg_at_start'][0]:.1f} at start. RTT in microseconds; KV MB/s: READs "
        f"completed during the flow's windows."
    )
    text = markdown_table(["run", "KV", "messages", "lost", "p50 us", "p99 us", "p99.9 us", "p99 / idle",
                           "KV MB/s"], rows, caption)  # fmt: skip
    goal = payload.get("goal")
    if goal:
        text += (f"\n\nGoal (prio p99 <= {goal['limit']:.2f}x idle, nothing lost): "
                 f"{'met' if goal['met'] else 'NOT met'} ({goal['p99_over_idle']:.2f}x).")  # fmt: skip
    return text


def chart(payload: dict, path: Path) -> Path | None:
    """The flow's RTT distribution per run (CDF, log x); None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for r in payload["runs"]:
        rtts = np.sort(np.asarray([x for x in r["rtt_us"] if x is not None]))
        if rtts.size:
            label = f"{r['mode']}: p99 {r['p99_us']:.0f} us" + (f", KV {r['kv_MBps']:.1f} MB/s" if r["kv"] else "")
            ax.plot(rtts, np.arange(1, rtts.size + 1) / rtts.size, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("request/response RTT (us)")
    ax.set_ylabel("fraction of messages")
    ax.set_title(f"Latency flow vs KV pulls on a {payload['config']['link_mbit']:g} Mbit/s link")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def _modes(text: str) -> list[str]:
    modes = [m for m in text.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes must be from {', '.join(MODES)}, got {text!r}")
    return modes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--modes", type=_modes, default=list(MODES), help="runs, in order (idle,fifo,prio)")
    parser.add_argument("--link-mbit", type=float, default=200.0, help="compute link rate (htb), Mbit/s")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of the flow per run")
    parser.add_argument("--rate", type=float, default=200.0, help="flow messages per second")
    parser.add_argument("--message-bytes", type=int, default=128, help="flow message size (UDP payload)")
    parser.add_argument("--dscp", type=int, default=46, help="the flow's DSCP (46: EF); 0 leaves it unmarked")
    parser.add_argument("--timeout-ms", type=float, default=1000.0, help="a message unanswered this long is lost")
    parser.add_argument("--read-mib", type=float, default=4.0, help="bytes per KV READ, MiB")
    parser.add_argument("--reads-in-flight", type=int, default=2, help="KV READs posted at a time")
    parser.add_argument("--mtu", type=int, default=9000,
                        help="compute links' MTU (jumbo: a fabric's large MTU, a sixth of 1500's packets)")
    parser.add_argument("--flow-scheduling", choices=("realtime", "normal"), default="realtime",
                        help="CPU scheduling of the flow's endpoints: SCHED_FIFO, or as every other process")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all modes in turn (results pooled)")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="the flow's endpoints on one CPU, the KV workers on the others (needs 2+ CPUs)")
    parser.add_argument("--subnet", default="10.214", help="private /16 (two octets) for the emulated network")
    parser.add_argument("--prefix", default="", help="namespace and link name prefix (dpb + 1-5 of [0-9a-z]); "
                        "default: a fresh random one per run")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="5 s per run; results under *-quick.*")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.rounds = 5.0, 1
    checks = {
        "--link-mbit": args.link_mbit > 0, "--duration": args.duration > 0, "--rate": args.rate > 0,
        "--message-bytes": 8 <= args.message_bytes <= 1400, "--dscp": 0 <= args.dscp <= 63,
        "--timeout-ms": args.timeout_ms > 0, "--read-mib": args.read_mib > 0,
        "--reads-in-flight": args.reads_in_flight >= 1, "--mtu": 1280 <= args.mtu <= 65535,
        "--rounds": args.rounds >= 1, "--prefix": not args.prefix or bool(PREFIX_RE.match(args.prefix)),
    }  # fmt: skip
    if problems := [name for name, ok in checks.items() if not ok]:
        parser.error(f"out of range: {', '.join(problems)} (message bytes 8..1400, dscp 0..63, mtu 1280..65535, "
                     f"prefix {PREFIX_RE.pattern}, the rest > 0)")  # fmt: skip
    return args


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:  # internal: one worker in a namespace, started by Worker
        role, spec = sys.argv[2], json.loads(sys.argv[3])
        # Stopped by the harness: exit at once. Unwinding would free buffers under READs still in flight
        # (UCX may write them: a crash); the namespace's removal and the kernel clean up the rest.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
        if spec.get("cpus"):
            os.sched_setaffinity(0, spec["cpus"])  # before NIXL starts threads: they inherit it
        result = WORKERS[role](spec)
        _say(RESULT, result)
        return
    exit_on_sigterm()
    args = parse_args()
    name = "traffic-isolation-quick.json" if args.quick else "traffic-isolation.json"
    run_and_report(run, table, args, name, chart=chart, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
