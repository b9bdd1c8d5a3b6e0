"""Markdown table, JSON and PNG plots of a comparison payload (:func:`dualpath_dev.compare.run_comparison`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dualpath_connector.protocol import counter_total_name

logger = logging.getLogger(__name__)


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


# Counters that explain a slow run: hits read twice, misses made by dropped saves.
RUN_EVENTS = {
    "saves skipped (chunks)": counter_total_name("save_skipped_chunks"),
    "DE reads declined": counter_total_name("de_reads_declined"),
    "DE read fallbacks": counter_total_name("de_read_fallbacks"),
    "PE reads moved to the DE": counter_total_name("reads_moved_to_de"),
    "hit tokens the DE read of split PE reads": counter_total_name("split_read_tail_tokens"),
}


MODE_LABELS = {"basic": "Basic", "dualpath": "DualPath", "oracle": "Oracle"}

# Each row's "speedup vs Basic": the comparison's own field (``compare_runs``), never a second ratio of two JCTs.
ROW_SPEEDUP = {"dualpath": "dualpath_speedup", "oracle": "basic_over_oracle"}


def why_no_ratio(runs: dict[str, dict], modes: tuple[str, ...]) -> str | None:
    """Why ``compare_runs`` left a ratio of these modes' JCTs null: the first mode that failed or left agents
    unfinished (an incomplete run's JCT compares with nothing); None where every one of them finished."""
    for mode in modes:
        label = MODE_LABELS.get(mode, mode)
        run = runs.get(mode)
        if run is None:
            return f"no {label} run"
        if "error" in run or "summary" not in run:
            return f"{label} failed"
        summary = run["summary"]
        if summary.get("agents_failed"):
            done = summary.get("agents_done")
            total = done + summary["agents_failed"] if done is not None else None
            return (f"{label} finished {done} of {total} agents" if total is not None
                    else f"{label} left {summary['agents_failed']} agents unfinished")  # fmt: skip
    return None


def _ratio(value: float | None, runs: dict[str, dict], modes: tuple[str, ...]) -> str:
    """``value`` as ``1.23x``; where it is null, ``n/a`` and the reason (``n/a: Basic finished 15 of 16 agents``)."""
    if value is not None:
        return f"{value:.2f}x"
    reason = why_no_ratio(runs, modes)
    return f"n/a: {reason}" if reason else "n/a"


def _row_speedup(mode: str, runs: dict[str, dict], comparison: dict) -> str:
    if mode == "basic":
        reason = why_no_ratio(runs, ("basic",))
        return f"n/a: {reason}" if reason else "1.00x"
    if mode not in ROW_SPEEDUP:
        return "n/a"
    return _ratio(comparison.get(ROW_SPEEDUP[mode]), runs, ("basic", mode))


def _spread(figure: dict | None, fallback: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    """A figure over the repetitions as ``median [min-max]``; one run's value where there was one repetition."""
    values = (figure or {}).get("values") or []
    if len(values) < 2:
        return _fmt(None if fallback is None else fallback * scale, spec, suffix)
    if figure["median"] is None:
        return "n/a"
    low, mid, high = (figure[k] * scale for k in ("min", "median", "max"))
    return f"{mid:{spec}}{suffix} [{low:{spec}}-{high:{spec}}{suffix}]"


def _ratio_spread(comparison: dict, key: str) -> str:
    """`` [min-max]`` of a ratio over the repetitions, or nothing for one repetition."""
    figure = comparison.get("spread", {}).get(key)
    if not figure or len(figure["values"]) < 2 or figure["median"] is None:
        return ""
    return f" [{figure['min']:.2f}x-{figure['max']:.2f}x]"


def _load(payload: dict) -> str:
    environment = payload.get("environment")
    if not environment:
        return ""
    return (f" {environment['cpus']} CPUs; 1-minute load average {environment['load_avg_at_start'][0]:.1f} at the "
            f"start, {environment['load_avg_at_end'][0]:.1f} at the end.")  # fmt: skip


def rtt_shown(payload: dict) -> bool:
    """Whether the payload compares store round trips (``--store-rtt-ms``) or ran at one: then every row says its
    RTT. Payloads from before the relay have neither and render as they did."""
    return bool(payload["config"].get("store_rtts_ms")) or any(t.get("store_rtt_ms") for t in payload["topologies"])


def where(topology: dict, shown: bool) -> str:
    """A topology entry's name in the report's lines: ``1P1D``, or ``1P1D at 5 ms store RTT`` where RTTs are shown."""
    if not shown:
        return topology["topology"]
    return f"{topology['topology']} at {topology.get('store_rtt_ms', 0.0):g} ms store RTT"


def markdown(payload: dict) -> str:
    trace = payload["trace"]
    cluster = payload["config"]["cluster"]
    shown = rtt_shown(payload)
    rtt_note = (" Store RTT: every engine and router request to S3 waited this long in a relay in the S3 namespace "
                "before SeaweedFS saw it (per request, not bandwidth; 0: no relay); one cluster per RTT."
                if shown else "")  # fmt: skip
    rtt_head, rtt_align = ("| store RTT ms ", "|--:") if shown else ("", "")
    lines = [
        "# DualPath on the emulated cluster",
        "",
        f"Trace: {trace['agents']} agents, {trace['turns']:.1f} turns/agent, append {trace['append']:.0f}, "
        f"gen {trace['gen']:.0f}, context {trace['context']:.0f} tokens/turn (hit ratio {trace['hit_ratio']:.1%}). "
        f"Storage NIC {cluster['storage_mbit']:g} Mbit/s per node, compute network "
        f"{'unshaped' if not cluster['compute_mbit'] else str(cluster['compute_mbit']) + ' Mbit/s'}; "
        f"replay {payload['config']['replay_mode']}.{rtt_note}{_load(payload)}",
        "",
        f"| topology {rtt_head}| mode | JCT s | speedup vs Basic | bound (P+D)/P | NIC read max/avg | link use while reads wait "
        "| read span s | links' combined rate moved over it | all links reading over it "
        "| TTFT mean s | queue s | read s | prefill s | other s | TTFT p90 s | TPOT p50 ms | read sides | failed requests |",
        f"|---{rtt_align}|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|",
    ]
    for topology in payload["topologies"]:
        first = f"| {topology['topology']} " + (f"| {topology.get('store_rtt_ms', 0.0):g} " if shown else "")
        for mode, run in topology["runs"].items():
            if "error" in run:
                lines.append(f"{first}| {mode} | failed: {run['error'][:120]} |" + " |" * 16)
                continue
            s, b, use = run["summary"], run["ttft_breakdown"], run.get("link_use", {})
            figures = topology.get("figures", {}).get(mode, {})
            speedup = _row_speedup(mode, topology["runs"], topology["comparison"])
            sides = ", ".join(f"{k or '?'}:{v}" for k, v in s["read_sides"].items())
            lines.append(
                f"{first}| {mode} | {_spread(figures.get('jct_s'), s['jct_s'], '.1f')} | {speedup} "
                f"| {topology['bound']:.2f}x | {_fmt(run['nic']['max_over_avg'])} "
                f"| {_fmt(use.get('use_while_waiting'), '.0%')} "
                f"| {_spread(figures.get('read_span_s'), use.get('read_span_s'), '.0f')} "
                f"| {_spread(figures.get('combined_rate_fraction'), use.get('combined_rate_fraction'), '.0f', 100, '%')} "
                f"| {_fmt(use.get('all_busy_over_read_span'), '.0%')} "
                f"| {_fmt(b.get('ttft_s'))} "
                f"| {_fmt(b.get('queue_s'))} | {_fmt(b.get('read_s'))} | {_fmt(b.get('prefill_s'))} "
                f"| {_fmt(b.get('other_s'))} | {_fmt(s['ttft_s'].get('p90'))} "
                f"| {_fmt(s['tpot_s']['p50'] * 1000 if s['tpot_s'] else None, '.0f')} | {sides} "
                f"| {s['failed_requests']}{' (+' + str(s['agents_failed']) + ' agents)' if s.get('agents_failed') else ''} |"
            )
    lines += ["", "Comparison:", ""]
    for topology in payload["topologies"]:
        c, runs = topology["comparison"], topology["runs"]
        speedup = _ratio(c["dualpath_speedup"], runs, ("basic", "dualpath")) + _ratio_spread(c, "dualpath_speedup")
        if c["dualpath_speedup"] is None:
            of_bound = f"(bound {c['bound']:.2f}x)"
        else:
            of_bound = f"of a {c['bound']:.2f}x bound ({_fmt(c['fraction_of_bound'], '.0%')})"
            if c.get("read_span_speedup") is not None:
                of_bound += (f"; over the read span {c['read_span_speedup']:.2f}x"
                             f"{_ratio_spread(c, 'read_span_speedup')} ({c['fraction_of_read_span_bound']:.0%} of the "
                             f"bound)")  # fmt: skip
            if c.get("repetitions", 1) > 1:
                of_bound += f"; medians of {c['repetitions']} interleaved repetitions [min-max]"
        lines.append(
            f"- {where(topology, shown)}: DualPath speedup {speedup} {of_bound}; DualPath/Oracle JCT "
            f"{_ratio(c['dualpath_over_oracle'], runs, ('dualpath', 'oracle'))}."
        )
        if c.get("aps_at_slo"):
            held = ", ".join(f"{mode} {_fmt(aps, '.3g', '/s')}" for mode, aps in c["aps_at_slo"].items())
            lines.append(f"- {where(topology, shown)}: agent arrivals per second at the SLO: {held}; DualPath/Basic "
                         f"{_fmt(c.get('dualpath_aps_speedup'), '.2f', 'x')}.")  # fmt: skip
            for mode, run in topology["runs"].items():
                steps = ", ".join(f"{s['rate']:g}/s {'held' if s['holds'] else 'broke'} (TTFT {s['ttft_s']:.2f} s)"
                                  for s in run.get("sweep", []))  # fmt: skip
                if steps:
                    lines.append(f"  - {mode}: {steps}")
    for topology in payload["topologies"]:
        name = where(topology, shown)
        for mode, run in topology["runs"].items():
            # A counter no engine reported (a run older than the counter) is left out, not printed as 0.
            deltas = run.get("engine_deltas", {}).values()
            events = {label: sum(engine.get(series, 0) for engine in deltas)
                      for label, series in RUN_EVENTS.items()
                      if any(series in engine for engine in deltas)}  # fmt: skip
            if any(events.values()):
                lines.append(f"- {name} {mode}: " + ", ".join(f"{k} {v:.0f}" for k, v in events.items()) + ".")
            per_link = (run.get("link_use") or {}).get("per_link")
            if per_link:
                lines.append(f"- {name} {mode}: each link's rate moved over the read span (while it "
                             f"read): " + ", ".join(f"{node} {_fmt(f['rate_over_read_span'], '.0%')} "
                                                     f"({_fmt(f['rate_while_busy'], '.0%')})"
                                                     for node, f in per_link.items()) + ".")  # fmt: skip
            cpu = (run.get("nic") or {}).get("cpu_busy_while_links_busy")
            if cpu:
                whole = run["nic"].get("cpu_busy") or {}
                lines.append(f"- {name} {mode}: each core busy while the storage links moved data "
                             f"(over the whole run): " + ", ".join(f"{core} {share:.0%} ({_fmt(whole.get(core), '.0%')})"
                                                                  for core, share in cpu.items()) + ".")  # fmt: skip
            relay = run.get("relay")
            if relay:
                requests = ", ".join(f"{method} {count}" for method, count in relay["requests"].items())
                lines.append(f"- {name} {mode}: store requests through the relay: {requests}; its CPU "
                             f"{relay['cpu_s']:.1f} s.")  # fmt: skip
            slo = run.get("summary", {}).get("slo")
            if slo:
                lines.append(
                    f"- {name} {mode}: SLO {'holds' if slo['holds'] else 'missed'} at p{slo['percentile']:g} "
                    f"(TTFT {slo['ttft_s']:.2f} s <= {slo['ttft_limit_s']:g} s, "
                    f"TPOT {slo['tpot_s'] * 1000:.0f} ms <= {slo['tpot_limit_s'] * 1000:g} ms)."
                )
    lines += [
        "",
        "NIC read max/avg: per 1 s window in which the storage links moved at least a quarter of one link's "
        "capacity, the busiest node's read bytes over the mean of all nodes; traffic-weighted mean over windows. "
        "TTFT split: means from the PEs' /metrics (queue = vLLM queue time minus the connector's load time, "
        "read = load time, prefill = vLLM prefill time); other = client TTFT minus the three (router, PD pull, "
        "DE first step). With repetitions, JCT, read span and combined rate are median [min-max] over them and "
        "the other columns are the median-JCT repetition's. Link use while reads wait: from the engines' read timelines, at each 0.25 s instant with "
        "reads queued or running, busy storage links over the links those reads could keep busy (100%: no link "
        "idled while a read waited).",
    ]
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> Path | None:
    """JCT per mode and topology, the TTFT split, and each node's storage read rate over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot")
        return None
    topologies = payload["topologies"]
    shown = rtt_shown(payload)
    # One group per topology entry: with store RTTs a topology has one entry per RTT.
    names = [t["topology"] + (f"\n{t.get('store_rtt_ms', 0.0):g} ms RTT" if shown else "") for t in topologies]
    ok = {(name, m): t["runs"][m] for name, t in zip(names, topologies) for m in ("basic", "dualpath", "oracle")
          if "summary" in t["runs"].get(m, {})}  # fmt: skip
    # Only the modes that ran: a mode with no bars would still take a slot and a legend entry.
    modes = [m for m in ("basic", "dualpath", "oracle") if any(mode == m for _, mode in ok)] or ["basic"]
    n_series = max(1, len(ok))
    fig = plt.figure(figsize=(12, 4 + 2.2 * ((n_series + 2) // 3)))
    grid = fig.add_gridspec(1 + (n_series + 2) // 3, 3)
    ax = fig.add_subplot(grid[0, 0])
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        present = [(j, name, t) for j, (name, t) in enumerate(zip(names, topologies)) if (name, mode) in ok]
        xs = [j + i * width for j, _, _ in present]
        # Medians with their min-max over the repetitions, where there were several.
        jct = [t.get("figures", {}).get(mode, {}).get("jct_s") or {} for _, _, t in present]
        ys = [ok[(name, mode)]["summary"]["jct_s"] for _, name, _ in present]
        ys = [f["median"] if f.get("median") is not None else y for f, y in zip(jct, ys)]
        errors = [[y - f.get("min", y) if f.get("median") is not None else 0 for f, y in zip(jct, ys)],
                  [f.get("max", y) - y if f.get("median") is not None else 0 for f, y in zip(jct, ys)]]  # fmt: skip
        ax.bar(xs, ys, width, yerr=errors, capsize=3, label=mode)
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(topologies))], names,
                  fontsize=8 if shown else 10)  # fmt: skip
    ax.set_ylabel("JCT (s)")
    ax.set_title("Job completion time")
    ax.legend()
    ax = fig.add_subplot(grid[0, 1:])
    labels, bottoms = [], []
    parts = ("queue_s", "read_s", "prefill_s", "other_s")
    for (topology, mode), run in ok.items():
        labels.append(f"{topology}\n{mode}")
        bottoms.append([run["ttft_breakdown"].get(p, 0.0) for p in parts])
    base = [0.0] * len(labels)
    for k, part in enumerate(parts):
        values = [b[k] for b in bottoms]
        ax.bar(range(len(labels)), values, bottom=base, label=part.removesuffix("_s"))
        base = [x + y for x, y in zip(base, values)]
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title("TTFT breakdown (PE /metrics)")
    ax.legend(fontsize=8)
    for index, ((topology, mode), run) in enumerate(ok.items()):
        ax = fig.add_subplot(grid[1 + index // 3, index % 3])
        series = run["nic"]["series"]
        t = series["t"]
        for node, values in series["read_bytes"].items():
            rates = [(b - a) * 8 / 1e6 / (t2 - t1) for a, b, t1, t2 in zip(values, values[1:], t, t[1:]) if t2 > t1]
            ax.plot(t[1 : len(rates) + 1], rates, label=node)
        ax.set_title(f"{topology.replace(chr(10), ' ')} {mode}: storage reads", fontsize=9)
        ax.set_xlabel("s")
        ax.set_ylabel("Mbit/s")
        ax.legend(fontsize=7, loc="upper left")
        use = run.get("link_use", {}).get("series")
        if use and use["t"]:
            # Reads waiting or running anywhere: a link idle under a non-zero line is the "taking turns" pattern.
            waiting = ax.twinx()
            waiting.step(use["t"], use["outstanding"], where="post", color="grey", linewidth=0.7, label="reads outstanding")
            waiting.set_ylabel("reads outstanding", fontsize=7)
            waiting.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(payload: dict, out_dir: Path, name: str) -> dict[str, Path]:
    """``<name>.json``, ``<name>.md`` and ``<name>.png`` under ``out_dir`` (JSON written atomically)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md", "png": out_dir / f"{name}.png"}
    text = markdown(payload)
    tmp = paths["json"].with_name(paths["json"].name + ".tmp")
    tmp.write_text(json.dumps({**payload, "table": text}, indent=1) + "\n")
    tmp.replace(paths["json"])
    paths["md"].write_text(text)
    if plot(payload, paths["png"]) is None:
        del paths["png"]
    return paths
