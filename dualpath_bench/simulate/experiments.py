"""The simulator's experiments: P/D ratios, scale, the P/D range's ends, calibration, decision rate.

Each returns plain dicts (the JSON the report writes); :mod:`dualpath_bench.simulate.report` prints them.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

from dualpath_bench.errors import BenchUsageError
from dualpath_bench.pd_range import Hardware, link_loads, pd_range
from dualpath_bench.simulate.cluster import MODES, RunResult, Simulation
from dualpath_bench.simulate.hardware import SimHardware
from dualpath_bench.simulate.prefill_steps import PrefillSteps
from dualpath_bench.trace import TraceConfig, generate, turn_lengths

logger = logging.getLogger(__name__)

# The paper's coding trace (§3: 429 appended tokens, 64k maximum context, 157 turns); generated tokens
# per turn are an assumption (dualpath_bench.trace).
PAPER_TRACE = TraceConfig(max_context=65536, append_tokens=429, output_tokens=200, turns=157)
# Scale runs: a window of turns of the paper trace, the earlier turns' KV already in the store, so
# contexts are as long as in the full runs while 48P96D stays within minutes of one core.
SCALE_WINDOW = (40, 12)  # first turn, turns


def parse_topology(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)P(\d+)D", text.strip(), re.IGNORECASE)
    if not match or not int(match[1]) or not int(match[2]):
        raise BenchUsageError(f"topology {text!r}: expected <P>P<D>D with P, D >= 1, e.g. 1P2D")
    return int(match[1]), int(match[2])


def _run(hw: SimHardware, topology: str, mode: str, agents: list[list[tuple[int, int]]]) -> RunResult:
    p, d = parse_topology(topology)
    result = Simulation(hw, p, d, mode).run(agents)
    logger.info("%s %s %s: JCT %.1f s (%d turns, %.1f s wall, %.0f placements/s)", hw.name, topology, mode,
                result.jct_s, result.turns, result.wall_s, result.placements_per_s)  # fmt: skip
    return result


def topology_sweep(hw: SimHardware, topologies: list[str], agents: list[list[tuple[int, int]]],
                   modes: tuple[str, ...] = MODES) -> list[dict]:  # fmt: skip
    """Basic / DualPath / Oracle JCT per topology, on one trace (paper Fig. 8)."""
    rows = []
    for topology in topologies:
        runs = {mode: _run(hw, topology, mode, agents) for mode in modes}
        row = {"topology": topology, "runs": {m: r.to_json() for m, r in runs.items()}}
        if "basic" in runs:
            row["speedup"] = {m: runs["basic"].jct_s / r.jct_s for m, r in runs.items()}
        rows.append(row)
    return rows


def scale_sweep(hw: SimHardware, scales: list[int], agents_per_pe_node: int, trace: TraceConfig,
                window: tuple[int, int] = SCALE_WINDOW) -> list[dict]:  # fmt: skip
    """``k`` x 2P4D (§7.6: 2P4D .. 48P96D) at a constant number of agents per engine, on a window of turns."""
    rows = []
    first, count = window
    for k in scales:
        topology = f"{2 * k}P{4 * k}D"
        agents = [turns[:first + count] for turns in turn_lengths(replace(trace, agents=agents_per_pe_node * 2 * k))]
        p, d = parse_topology(topology)
        runs = {mode: Simulation(hw, p, d, mode).run(agents, first_turn=first) for mode in ("basic", "dualpath")}
        for mode, result in runs.items():
            logger.info("%s %s %s: JCT %.1f s (%d turns, %.1f s wall, %.0f placements/s)", hw.name, topology, mode,
                        result.jct_s, result.turns, result.wall_s, result.placements_per_s)  # fmt: skip
        rows.append({"topology": topology, "agents": len(agents), "runs": {m: r.to_json() for m, r in runs.items()},
                     "speedup": runs["basic"].jct_s / runs["dualpath"].jct_s})  # fmt: skip
    base = rows[0]["runs"]["dualpath"]["jct_s"]
    for row in rows:
        row["dualpath_jct_vs_smallest"] = row["runs"]["dualpath"]["jct_s"] / base
    return rows


def quota_effect(hw: SimHardware, topology: str, agents: list[list[tuple[int, int]]], token_budget: int,
                 quota_s: float) -> dict:
    """DualPath with PEs stepping in node lockstep, without and with the compute quota (§6.2)."""
    p, d = parse_topology(topology)
    runs = {}
    for name, quota in (("token budget only", None), (f"quota {quota_s * 1000:g} ms", quota_s)):
        result = Simulation(hw, p, d, "dualpath", prefill_steps=PrefillSteps(token_budget, quota)).run(agents)
        logger.info("%s %s dualpath, %s: JCT %.1f s, %s", hw.name, topology, name, result.jct_s, result.prefill_steps)
        runs[name] = {"jct_s": result.jct_s, "agent_mean_s": result.agent_mean_s, "turns": result.turns,
                      **result.prefill_steps}
    return {"topology": topology, "token_budget": token_budget, "quota_s": quota_s, "runs": runs}


def decision_rate(hw: SimHardware, prefill_nodes: int, decode_nodes: int, agents_per_pe_node: int) -> dict:
    """Placements per second of the router's policy code on one core at this size (§7.6: 48P96D)."""
    agents = turn_lengths(replace(PAPER_TRACE, agents=agents_per_pe_node * prefill_nodes, turns=3))
    result = Simulation(hw, prefill_nodes, decode_nodes, "dualpath").run(agents)
    return {"topology": f"{prefill_nodes}P{decode_nodes}D", "engines": (prefill_nodes + decode_nodes) * hw.engines_per_node,
            "placements": result.placements, "router_s": result.placement_s,
            "placements_per_s": result.placements_per_s}  # fmt: skip


def pd_range_check(hw: SimHardware, agents_per_node: int) -> dict:
    """Both ends of §4.2's range, just inside and just outside, with compute out of the way.

    Inside, the storage NICs are the busiest links; outside, a compute NIC or a DE's DRAM is, and the
    storage NICs fall below it. The analytic loads (dualpath_bench.pd_range) are shown alongside.
    """
    s = Fraction(hw.storage_bytes_per_s) / Fraction(hw.cnic_bytes_per_s)
    analytic_hw = Hardware(hw.gpus_per_node, s, Fraction(hw.cnic_bytes_per_s) / 10**9, Fraction(hw.dram_bytes_per_s) / 10**9)
    found = pd_range(analytic_hw)
    io_only = hw.scaled(1000.0)
    low_in = Fraction(1, int(1 / found.lower) - 1)  # 1/6 for 1/7
    low_out = Fraction(1, int(1 / found.lower) + 1)  # 1/8
    high_in = Fraction(int(found.upper))  # 3 for 7/2
    high_out = Fraction(int(found.upper) + 1)  # 4
    rows = []
    for where, ratio in (("lower end, inside", low_in), ("lower end, outside", low_out),
                         ("upper end, inside", high_in), ("upper end, outside", high_out)):  # fmt: skip
        p, d = ratio.numerator, ratio.denominator
        agents = turn_lengths(replace(PAPER_TRACE, agents=agents_per_node * (p + d), turns=20))
        result = Simulation(io_only, p, d, "dualpath").run(agents)
        utilisation = result.utilisation
        busiest = max(utilisation, key=utilisation.__getitem__)
        rows.append({"where": where, "topology": f"{p}P{d}D", "ratio": str(ratio), "utilisation": utilisation,
                     "busiest": busiest, "analytic_loads": {k: float(v) for k, v in link_loads(analytic_hw, ratio).items()},
                     "jct_s": result.jct_s, "turns": result.turns})  # fmt: skip
    return {"range": [str(found.lower), str(found.upper)], "lower_by": found.lower_bound_by,
            "upper_by": found.upper_bound_by, "hardware": io_only.name, "rows": rows}  # fmt: skip


def calibration(hw: SimHardware, measured_paths: list[Path], trace: dict) -> list[dict]:
    """Predicted vs measured JCT for each emulated-cluster run in ``measured_paths``.

    Each run is simulated on its own trace (``trace_config`` in its JSON; ``trace`` for runs that predate
    it) and its own storage NIC rate. Online runs (agents arriving at a rate) are left out: the simulator
    replays offline (§7.3), all agents at once, so their JCT is not comparable; so are runs without an Oracle,
    on which the per-turn overhead is fitted, and runs with a store round trip (``store_rtt_ms``), which it
    does not model.
    """
    rows = []
    for path in measured_paths:
        payload = json.loads(path.read_text())
        if payload["config"].get("replay_mode", "offline") != "offline":
            logger.info("calibration: %s is an online run, left out", path.name)
            continue
        run_trace = TraceConfig.from_dict(payload.get("trace_config", trace))
        agents = [[(len(t.append), t.output_tokens) for t in a.turns] for a in generate(run_trace)]
        run_hw = replace(hw, storage_bytes_per_s=payload["config"]["cluster"]["storage_mbit"] * 1e6 / 8)
        for topo in payload["topologies"]:
            if topo.get("store_rtt_ms"):
                logger.info("calibration: %s %s ran with a store round trip, which the simulator lacks; left out",
                            path.name, topo["topology"])  # fmt: skip
                continue
            # The rate the Basic run's PE link achieved (TCP and S3 below the link's nominal rate).
            measured_rate = _read_rate(topo["runs"].get("basic", {}), run_hw.storage_bytes_per_s / hw.kv_bytes_per_token)
            topo_hw = run_hw
            if measured_rate is not None:
                topo_hw = replace(run_hw, storage_bytes_per_s=measured_rate * hw.kv_bytes_per_token)
            oracle = topo["runs"].get("oracle", {}).get("summary")
            if oracle is None:
                # Without it the shared CPU's cost per turn is unknown, and a prediction would compare the preset's.
                logger.info("calibration: %s %s has no Oracle run to fit the per-turn overhead on, left out",
                            path.name, topo["topology"])  # fmt: skip
                continue
            # The shared CPU's cost per turn, from the run without KV I/O; then Basic and DualPath are predicted.
            topo_hw = _fit_overhead(topo_hw, topo["topology"], agents, oracle["jct_s"])
            for mode, run in topo["runs"].items():
                if "summary" not in run or mode not in MODES:
                    continue
                predicted = _run(topo_hw, topo["topology"], mode, agents)
                measured = run["summary"]["jct_s"]
                row = {"source": path.name, "topology": topo["topology"], "mode": mode, "measured_jct_s": measured,
                       "storage_bytes_per_s": topo_hw.storage_bytes_per_s,
                       "predicted_jct_s": predicted.jct_s, "error": predicted.jct_s / measured - 1,
                       "overhead_s": topo_hw.request_overhead_s, "fitted": mode == "oracle",
                       "measured_hit_tokens": run["summary"]["hit_tokens"],
                       "predicted_hit_tokens": predicted.hit_bytes / hw.kv_bytes_per_token if mode != "oracle" else None}  # fmt: skip
                own_rate = _read_rate(run, run_hw.storage_bytes_per_s / hw.kv_bytes_per_token)
                if own_rate is not None:
                    # On the shared CPU a read is slower while both links read: the same prediction at the rate
                    # this run's reads achieved (a measured figure of the run, so not an independent prediction).
                    at_own = _run(replace(topo_hw, storage_bytes_per_s=own_rate * hw.kv_bytes_per_token),
                                  topo["topology"], mode, agents)  # fmt: skip
                    row.update(own_read_tokens_per_s=own_rate, own_rate_jct_s=at_own.jct_s,
                               own_rate_error=at_own.jct_s / measured - 1)
                rows.append(row)
    return rows


def _read_rate(run: dict, link_tokens_per_s: float) -> float | None:
    """The tokens/s a run's storage links moved while they read (mean over the links that read); None if unknown.

    From each link's measured rate while it read (``link_use.per_link``) where the run has it: with several
    reads in flight per engine a single read's rate is a share of its link's. Older runs read one at a time
    per engine, and there the median per-read rate of each side is the link's.
    """
    link_use = run.get("link_use") or {}
    busy = [f["rate_while_busy"] for f in (link_use.get("per_link") or {}).values() if f.get("rate_while_busy")]
    if busy:
        return sum(busy) / len(busy) * link_tokens_per_s
    rates = [rate for rate in link_use.get("read_tokens_per_s_median", {}).values() if rate]
    return sum(rates) / len(rates) if rates else None


def _fit_overhead(hw: SimHardware, topology: str, agents: list[list[tuple[int, int]]], oracle_jct_s: float) -> SimHardware:
    """``hw`` with the per-turn overhead at which the simulated Oracle takes ``oracle_jct_s`` (bisection).

    Oracle moves no KV bytes but the saves, so the gap between its measured and simulated JCT is what the
    model lacks: on the emulated cluster every engine, SeaweedFS and the router share two cores.
    """
    low, high = 0.0, 60.0
    for _ in range(24):
        middle = (low + high) / 2
        jct = Simulation(replace(hw, request_overhead_s=middle), *parse_topology(topology), "oracle").run(agents).jct_s
        low, high = (middle, high) if jct < oracle_jct_s else (low, middle)
    return replace(hw, request_overhead_s=(low + high) / 2)
