"""Basic vs DualPath vs Oracle on the emulated cluster (root: network namespaces, tc-shaped storage NICs).

    python -m dualpath_dev.bench_cluster --topologies 1P1D,1P2D,2P1D
    python -m dualpath_dev.bench_cluster --modes basic,dualpath --store-rtt-ms 0 5 20   # at three store round trips

``make bench-dualpath`` runs it. It lives with the dev scaffolding it drives (:mod:`dualpath_dev.cluster` starts
SeaweedFS and vLLM from a checkout), not in the installed ``dualpath-bench``, whose trace and replay options it
takes (``dualpath_bench.cli``); the result files are ``dualpath_bench.report``'s.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path

from dualpath_bench import report
from dualpath_bench.cli import CLUSTER_TRACE, agents_from, replay_args, run_command, trace_args
from dualpath_bench.errors import BenchUsageError
from dualpath_bench.trace import TraceConfig
from dualpath_dev.cluster import ClusterConfig, netns_supported
from dualpath_dev.compare import BenchConfig, run_comparison
from dualpath_dev.tiny_model import make_tiny_llama

def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise BenchUsageError(f"--rates must be comma-separated numbers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    supported, why = netns_supported()
    if not supported:
        print(f"the emulated cluster needs network namespaces: {why}", file=sys.stderr)
        return 2
    agents = agents_from(args)
    config = BenchConfig(
        topologies=tuple(t.strip() for t in args.topologies.split(",") if t.strip()),
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        cluster=ClusterConfig(storage_mbit=args.storage_mbit, compute_mbit=args.compute_mbit, subnet=args.subnet,
                              store_cpus=args.store_cpus),
        replay_mode=args.mode, rate=args.rate, rates=_rates(args.rates),
        slo_ttft_s=args.slo_ttft_s, slo_tpot_s=args.slo_tpot_ms / 1000,
        slo_percentile=args.slo_percentile, nic_interval_s=args.nic_interval_s,
        max_model_len=args.max_model_len, progress=args.progress, repeats=args.repeats,
        store_rtts_ms=tuple(args.store_rtt_ms),
    ).validate()  # fmt: skip
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = make_tiny_llama(args.workdir / "tiny-llama")
    load_at_start = list(os.getloadavg())
    payload = run_comparison(agents, config, args.workdir.resolve(), model)
    # What else ran on the machine (1-, 5-, 15-minute load averages), to judge the figures by.
    payload["environment"] = {"cpus": os.cpu_count(), "load_avg_at_start": load_at_start,
                              "load_avg_at_end": list(os.getloadavg())}  # fmt: skip
    if not args.trace:
        # What the simulator's calibration regenerates the same trace from.
        payload["trace_config"] = {f.name: getattr(args, f.name) for f in fields(TraceConfig)}
    paths = report.write(payload, args.out_dir, args.name)
    print(paths["md"].read_text())
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    failed = [f"{t['topology']}/{m}" for t in payload["topologies"] for runs in t["repetitions"]
              for m, r in runs.items() if "error" in r]
    return 1 if failed else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dualpath_dev.bench_cluster", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--topologies", default="1P1D", help="comma-separated, e.g. 1P1D,1P2D,2P1D")
    p.add_argument("--modes", default="basic,dualpath,oracle")
    p.add_argument("--rates", default="", help="online: arrival rates to sweep per mode until the SLO breaks "
                   "(APS at SLO), e.g. 0.05,0.1,0.2")
    p.add_argument("--storage-mbit", type=float, default=16.0, help="each node's storage NIC, both directions")
    p.add_argument("--compute-mbit", type=float, default=0.0, help="compute network per node; 0: unshaped")
    p.add_argument("--store-cpus", default="", help="cores SeaweedFS runs on, e.g. 0 (taskset's list); default: unpinned")
    p.add_argument("--store-rtt-ms", type=float, nargs="+", default=[],
                   help="store round trips to compare at, a cluster each (e.g. 0 5 20): every engine and router "
                        "request to S3 waits this long in a relay in the S3 namespace; default: no relay")
    p.add_argument("--subnet", default="10.213", help="first two octets of the private /16 to use")
    p.add_argument("--nic-interval-s", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of every mode, interleaved (basic dualpath oracle basic ...); medians and spread")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--workdir", type=Path, default=Path("dualpath-bench-work"),
                   help="model, logs, S3 data")
    p.add_argument("--out-dir", type=Path, default=Path("."))
    p.add_argument("--name", default="dualpath-bench", help="results file stem")
    trace_args(p, CLUSTER_TRACE)
    replay_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command("bench_cluster", run, parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
