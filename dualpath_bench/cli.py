"""dualpath-bench: generate agent traces, replay them through a router, compare Basic/DualPath/Oracle.

    dualpath-bench generate --out trace.jsonl --agents 64
    dualpath-bench run --router http://127.0.0.1:8000 --model tiny-llama --trace trace.jsonl --out run.json
    dualpath-bench run ... --mode online --rate 0.5 --slo-ttft-s 4 --slo-tpot-ms 50
    dualpath-bench pd-range --gpus-per-node 8 --snic 1       # the bottleneck-free P/D range (paper §4.2)
    dualpath-bench simulate --preset paper --topologies 1P1D,1P2D,2P1D --scale 1,4,24   # discrete-event simulator

The emulated cluster's comparison runs from a source checkout (it starts SeaweedFS and vLLM the way the
tests do): ``python -m dualpath_dev.bench_cluster`` (``make bench-dualpath``), with the trace and replay
options of ``run``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import fields
from fractions import Fraction
from pathlib import Path

from nixl_backends.registry import make_store, parse_store_config

from dualpath_connector.protocol import StoreKeySpace

from dualpath_bench.errors import BenchUsageError
from dualpath_bench.pd_range import Hardware, fraction, link_loads, pd_range
from dualpath_bench.replay import ReplayConfig, StoreWatcher, replay
from dualpath_bench.trace import Agent, TraceConfig, Turn, generate, read_jsonl, summarize, write_jsonl

logger = logging.getLogger(__name__)

# A short storage-bound workload for the emulated cluster's comparison (dualpath_dev.bench_cluster) on a 2-core
# machine (see README: the arithmetic); the simulator's emulated preset replays it too.
CLUSTER_TRACE = {"agents": 8, "turns": 8, "first_append_tokens": 2048, "sigma": 0.3}

def trace_args(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    group = parser.add_argument_group("trace (ignored with --trace)")
    group.add_argument("--trace", type=Path, help="a JSONL trace to replay instead of generating one")
    for f in fields(TraceConfig):
        default = (defaults or {}).get(f.name, f.default)
        group.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=default,
                           help=f"default {default}")  # fmt: skip


def agents_from(args: argparse.Namespace):
    if args.trace:
        return read_jsonl(args.trace)
    return generate(TraceConfig.from_dict({f.name: getattr(args, f.name) for f in fields(TraceConfig)}))


def replay_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replay")
    group.add_argument("--mode", choices=("offline", "online"), default="offline")
    group.add_argument("--rate", type=float, default=0.0, help="online: agent arrivals per second")
    group.add_argument("--slo-ttft-s", type=float, default=4.0)
    group.add_argument("--slo-tpot-ms", type=float, default=50.0)
    group.add_argument("--slo-percentile", type=float, default=90.0)
    group.add_argument("--no-progress", dest="progress", action="store_false")


def cmd_generate(args: argparse.Namespace) -> int:
    agents = agents_from(args)
    path = write_jsonl(agents, args.out)
    print(json.dumps({"trace": str(path), **summarize(agents)}, indent=1))
    return 0


def _store_watcher(args: argparse.Namespace) -> StoreWatcher:
    """A watcher on the store the engines save to, in the key space an engine exports on its /metrics."""
    metrics = urllib.request.urlopen(f"{args.namespace_from.rstrip('/')}/metrics", timeout=30).read().decode()
    key_space = StoreKeySpace.from_metrics(metrics)
    # Credentials from the usual AWS sources (AWS_ACCESS_KEY_ID...), as the router takes them.
    config = parse_store_config({"backend": "s3", "endpoint": args.store_endpoint, "bucket": args.store_bucket,
                                 "create_bucket": False})  # fmt: skip
    return StoreWatcher(make_store(config, key_space.layout), key_space)


def cmd_run(args: argparse.Namespace) -> int:
    agents = agents_from(args)
    config = ReplayConfig(
        args.router, args.model, mode=args.mode, rate=args.rate, seed=args.seed, token_salt=args.salt,
        max_context=args.max_context, slo_ttft_s=args.slo_ttft_s, slo_tpot_s=args.slo_tpot_ms / 1000,
        slo_percentile=args.slo_percentile, progress=args.progress,
    )  # fmt: skip
    watcher = _store_watcher(args) if args.store_endpoint else None
    try:
        result = replay(agents, config, watcher).to_json()
    finally:
        if watcher is not None:
            watcher.close()
    result["trace"] = summarize(agents)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    print(f"results: {args.out}")
    return 0 if not result["summary"]["agents_failed"] else 1


def cmd_pd_range(args: argparse.Namespace) -> int:
    hw = Hardware(args.gpus_per_node, args.snic, args.cnic_gbps, args.memory_gbps)
    found = pd_range(hw)
    print(f"g={hw.gpus_per_node} GPUs/node, storage s={hw.storage_per_node} x B={hw.compute_nic_gbps} GB/s "
          f"= {float(hw.storage_gbps):g} GB/s/node, M={hw.memory_gbps} GB/s/node")
    if found.empty and found.lower_bound_by == found.upper_bound_by:
        print(f"no bottleneck-free P/D: {found.lower_bound_by} is over its bandwidth at any ratio")
    elif found.empty:
        print(f"no bottleneck-free P/D: {found.lower_bound_by} needs P/D >= {found.lower}, "
              f"{found.upper_bound_by} needs P/D <= {found.upper}")
    else:
        print(f"bottleneck-free: {found.lower} <= P/D <= {found.upper}  "
              f"({float(found.lower):.3g} .. {float(found.upper):.3g})")
        print(f"  lower end: {found.lower_bound_by}; upper end: {found.upper_bound_by}")
    ratios = args.ratio or ([found.lower, Fraction(1), found.upper] if not found.empty else [Fraction(1)])
    for ratio in dict.fromkeys(ratios):
        loads = link_loads(hw, ratio)
        worst = max(loads, key=loads.__getitem__)
        print(f"P/D {ratio}: " + ", ".join(f"{name} {float(load):.2f}" for name, load in loads.items())
              + f"  -> {'ok' if loads[worst] <= 1 else 'over: ' + worst}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from dataclasses import asdict, replace

    from dualpath_bench.simulate import experiments, report
    from dualpath_bench.simulate.hardware import EMULATED_RUN, emulated_run, preset

    hw = preset(args.preset, args.measured_dir)
    topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]
    for topology in topologies:
        experiments.parse_topology(topology)
    payload: dict = {"preset": args.preset, "hardware": asdict(hw)}
    if args.preset == "paper":
        trace = replace(experiments.PAPER_TRACE, agents=args.agents)
        agents = experiments.turn_lengths(trace)
        payload["trace"] = {**asdict(trace), **summarize_lengths(agents)}
        payload["description"] = (
            f"Offline (§7.3): {args.agents} agents of the paper-shaped trace start at once; JCT = when the last "
            f"turn ends. Trace: {payload['trace']['turns']:.0f} turns/agent, append {payload['trace']['append']:.0f}, "
            f"gen {payload['trace']['gen']:.0f}, context {payload['trace']['context']:.0f} tokens/turn (hit ratio "
            f"{payload['trace']['hit_ratio']:.1%}). Placements, read sides and books: dualpath_router's own "
            "Dispatcher.try_place, policies and Accounting; Oracle = DualPath without KV I/O (§7.2).")
    else:
        # The trace of the run the preset's figures come from (its trace_config: same agents, seed, lengths).
        trace = emulated_run(args.measured_dir)["trace_config"]
        agents = [[(len(t.append), t.output_tokens) for t in a.turns] for a in generate(TraceConfig.from_dict(trace))]
        payload["trace"] = {**trace, **summarize_lengths(agents)}
        payload["description"] = (
            f"The trace of {EMULATED_RUN} (its trace_config: {trace['agents']} agents, seed {trace['seed']}) on the "
            f"emulated cluster's parameters; engine figures are that file's Basic 1P1D run's.")
    payload["topologies"] = experiments.topology_sweep(hw, topologies, agents)
    if args.scale:
        scales = [int(k) for k in args.scale.split(",")]
        scale_hw = replace(hw, name=f"{hw.name}, one engine per node", engines_per_node=1)
        payload["scale"] = experiments.scale_sweep(scale_hw, scales, args.scale_agents, experiments.PAPER_TRACE)
        first, count = experiments.SCALE_WINDOW
        payload["scale_note"] = (
            f"k x 2P4D with {args.scale_agents} agents per prefill node (the paper: 2K agents at 2P4D, 48K at 48P96D), "
            f"offline, on a window of each trajectory of the same paper-shaped trace: turns {first}..{first + count - 1}, "
            f"the earlier turns' KV already in the store (contexts as long as in the full runs), and one engine per "
            f"node (the node's {hw.gpus_per_node} GPUs and CNICs pooled), so 48P96D fits in minutes of one core.")
    if args.compute_quota_ms:
        payload["quota"] = experiments.quota_effect(hw, topologies[0], agents, args.quota_token_budget,
                                                    args.compute_quota_ms / 1000)
    if args.decision_rate:
        p, d = experiments.parse_topology(args.decision_rate)
        payload["decision_rate"] = experiments.decision_rate(hw, p, d, 16)
        payload["decision_rate_note"] = (
            f"{hw.engines_per_node} engines per node as in §4; 16 agents per prefill node, 3 turns each. "
            "A placement is O(nodes) while every engine is healthy: Accounting keeps per-node totals "
            "(NodeBooks) as engines' books change, and the policy chooses from them.")
    if args.pd_range:
        payload["pd_range"] = experiments.pd_range_check(hw, args.pd_range_agents)
    if args.preset == "emulated":
        payload["calibration"] = experiments.calibration(hw, sorted(args.measured_dir.glob("dualpath-bench*.json")),
                                                         CLUSTER_TRACE)  # fmt: skip
        payload["calibration_note"] = (
            "Each offline run is simulated on its own trace and storage NIC rate, with the engine figures of the "
            "preset (online runs are left out: the simulator replays offline). "
            "One figure is fitted per run, on its Oracle (no KV I/O but the saves): the per-turn overhead of the "
            "emulated cluster's shared CPU (every engine, SeaweedFS and the router share two cores), at which the "
            "simulated Oracle takes the measured time. Basic and DualPath are then predicted, and their error is "
            "what the model lacks besides that floor. The storage NIC rate is what a read achieved on the Basic "
            "run's PE link (median per read). The last column repeats the prediction at the rate the mode's own "
            "reads achieved (the mean of its sides' medians): on two shared cores a read slows down while both "
            "links read, so that column uses a figure measured in the run it predicts.")
    paths = report.write(payload, args.out_dir, args.name or f"simulate-{args.preset}")
    print(paths["md"].read_text())
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


def summarize_lengths(agents: list[list[tuple[int, int]]]) -> dict[str, float]:
    """:func:`summarize` for a trace of (append, output) counts."""
    return summarize(Agent(str(i), [Turn([0] * a, o) for a, o in turns]) for i, turns in enumerate(agents))


def _positive_fraction(text: str) -> Fraction:
    try:
        return fraction(text)
    except (ValueError, ZeroDivisionError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive number or fraction, e.g. 8, 0.5, 1/2 ({exc})")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="dualpath-bench", description=__doc__.splitlines()[0])
    top.add_argument("-v", "--verbose", action="store_true")
    sub = top.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="write a seeded agent trace (JSONL)")
    p.add_argument("--out", type=Path, required=True)
    trace_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("run", help="replay a trace through a running dualpath-router")
    p.add_argument("--router", required=True, help="router base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="a served model name of the router")
    p.add_argument("--out", type=Path, default=Path("dualpath-replay.json"))
    p.add_argument("--salt", type=int, default=0, help="added to every token id: a fresh prefix space per run")
    p.add_argument("--store-endpoint", help="S3 endpoint to wait for each turn's chunks on (else no waiting)")
    p.add_argument("--store-bucket", default="dualpath-kv")
    p.add_argument("--namespace-from", help="an engine URL whose /metrics names the store namespace")
    trace_args(p)
    replay_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("pd-range", help="the P/D ratios whose compute NICs and DRAM keep up with saturated storage")
    p.add_argument("--gpus-per-node", type=int, default=8, help="g: GPUs (and compute NICs) per node")
    p.add_argument("--snic", type=_positive_fraction, default=Fraction(1),
                   help="s: a node's storage bandwidth in compute-NIC units (s x B)")
    p.add_argument("--cnic-gbps", type=_positive_fraction, default=Fraction(50),
                   help="B: one compute NIC's bandwidth, GB/s (400 Gbps = 50)")
    p.add_argument("--memory-gbps", type=_positive_fraction, default=Fraction(500), help="M: a node's DRAM bandwidth, GB/s")
    p.add_argument("--ratio", type=_positive_fraction, action="append",
                   help="a P/D to show every link's load at (repeatable; default: both ends and 1)")
    p.set_defaults(func=cmd_pd_range)

    p = sub.add_parser("simulate", help="discrete-event simulation of Basic/DualPath/Oracle with the router's policies")
    p.add_argument("--preset", choices=("paper", "emulated"), default="paper")
    p.add_argument("--topologies", default="1P1D,1P2D,2P1D")
    p.add_argument("--agents", type=int, default=1024, help="paper preset: agents of the P/D-ratio runs")
    p.add_argument("--scale", default="", help="k x 2P4D at constant agents per engine, e.g. 1,4,24 (24 = 48P96D)")
    p.add_argument("--scale-agents", type=int, default=1024, help="agents per prefill node in the scale runs")
    p.add_argument("--decision-rate", default="", help="a topology to measure the router's placements/s at, e.g. 48P96D")
    p.add_argument("--pd-range", action="store_true", help="simulate both ends of the bottleneck-free P/D range")
    p.add_argument("--compute-quota-ms", type=float, default=0.0,
                   help="also run DualPath at the first topology with PE nodes stepping in lockstep, without and "
                        "with this compute quota (§6.2; the paper: 300)")
    p.add_argument("--quota-token-budget", type=int, default=16384, help="new tokens per engine step in that run")
    p.add_argument("--pd-range-agents", type=int, default=256, help="agents per node in the P/D range runs")
    p.add_argument("--measured-dir", type=Path, default=Path("benchmarks/results"),
                   help="emulated preset: where the measured dualpath-bench*.json runs are (figures and trace "
                        "from dualpath-bench.json, calibration against every offline run)")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="", help="results file stem (default simulate-<preset>)")
    p.set_defaults(func=cmd_simulate)
    return top


def run_command(prog: str, command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a bench command the way every bench entry point does: logging set up by ``args.verbose``, SIGTERM
    unwinding like Ctrl-C (every context manager tears down what it built), usage errors as exit status 2."""
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    # One line per HTTP request would bury the progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return command(args)
    except BenchUsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; everything this run started has been stopped", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "run" and bool(args.store_endpoint) != bool(args.namespace_from):
        print("--store-endpoint and --namespace-from go together", file=sys.stderr)
        return 2
    return run_command("dualpath-bench", args.func, args)


if __name__ == "__main__":
    sys.exit(main())
