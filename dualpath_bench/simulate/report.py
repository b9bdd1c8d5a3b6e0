"""The simulator's results as Markdown tables, JSON and a plot (benchmarks/results/simulate-*)."""

from __future__ import annotations

import json
from pathlib import Path

KINDS = ("storage NIC, reads", "PE compute NIC, reads", "PE compute NIC, writes", "DE compute NIC, reads",
         "DE compute NIC, writes", "PE DRAM", "DE DRAM")  # fmt: skip


def _topologies(rows: list[dict]) -> list[str]:
    out = ["| topology | mode | JCT s | speedup vs Basic | read sides | storage NIC utilisation | turns | sim wall s |",
           "|---|---|--:|--:|---|--:|--:|--:|"]
    for row in rows:
        for mode, run in row["runs"].items():
            out.append(f"| {row['topology']} | {mode} | {run['jct_s']:.1f} | {row.get('speedup', {}).get(mode, 0):.2f}x | "
                       f"{', '.join(f'{k}:{v}' for k, v in run['read_sides'].items() if v)} | "
                       f"{run['utilisation'].get('storage NIC, reads', 0):.2f} | {run['turns']} | {run['wall_s']:.1f} |")  # fmt: skip
    return out


def _scale(rows: list[dict]) -> list[str]:
    out = ["| topology | agents | Basic JCT s | DualPath JCT s | speedup | DualPath JCT vs smallest | "
           "Basic / DualPath mean agent completion s | DualPath mean vs smallest | placements/s |",
           "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    base = rows[0]["runs"]["dualpath"]["agent_mean_s"]
    for row in rows:
        b, d = row["runs"]["basic"], row["runs"]["dualpath"]
        out.append(f"| {row['topology']} | {row['agents']} | {b['jct_s']:.1f} | {d['jct_s']:.1f} | {row['speedup']:.2f}x | "
                   f"{row['dualpath_jct_vs_smallest']:.3f} | {b['agent_mean_s']:.1f} / {d['agent_mean_s']:.1f} | "
                   f"{d['agent_mean_s'] / base:.3f} | {d['placements_per_s']:.0f} |")  # fmt: skip
    return out


def _pd_range(check: dict) -> list[str]:
    out = [f"Analytic range (dualpath_bench.pd_range): {check['range'][0]} <= P/D <= {check['range'][1]} "
           f"(lower end: {check['lower_by']}; upper end: {check['upper_by']}). Simulated on {check['hardware']} "
           "(compute and decode 1000x faster, so only links limit), DualPath policy; utilisation = bytes / "
           "(bandwidth x JCT), mean over the links of each kind (§4.2 assumes balanced load), analytic load in brackets:", "",
           "| where | topology | " + " | ".join(KINDS) + " | busiest |", "|---|---|" + "--:|" * len(KINDS) + "---|"]
    for row in check["rows"]:
        analytic = dict(zip(KINDS, (1.0, *(row["analytic_loads"][k] for k in (
            "PE compute NIC, reads (Eq. 1)", "PE compute NIC, writes (Eq. 2)", "DE compute NIC, reads (Eq. 4)",
            "DE compute NIC, writes (Eq. 6)", "PE DRAM", "DE DRAM (Eq. 8)")))))  # fmt: skip
        cells = [f"{row['utilisation'].get(k, 0):.2f} ({analytic[k]:.2f})" for k in KINDS]
        out.append(f"| {row['where']} | {row['topology']} | " + " | ".join(cells) + f" | {row['busiest']} |")
    return out


def _quota(quota: dict) -> list[str]:
    out = [f"DualPath at {quota['topology']}; each PE engine's step packs its ready prefills FIFO up to "
           f"{quota['token_budget']} new tokens, a node's engines step in lockstep (data-parallel attention meets "
           "the experts' all-to-all every layer), so a node's step lasts as long as its slowest engine's; bubble = "
           "engine time waiting for that, over the engines with work in the step. With the quota, a step's prefills "
           "also stay under its predicted time (binary search, one block at least).", "",
           "| steps | JCT s | mean agent completion s | node steps | step p50 s | p99 s | max s | bubble |",
           "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for name, run in quota["runs"].items():
        out.append(f"| {name} | {run['jct_s']:.1f} | {run['agent_mean_s']:.1f} | {run['steps']} | "
                   f"{run['step_p50_s']:.3f} | {run['step_p99_s']:.3f} | {run['step_max_s']:.3f} | "
                   f"{run['bubble_fraction']:.1%} |")
    return out


def _calibration(rows: list[dict]) -> list[str]:
    out = ["| run | topology | mode | measured JCT s | simulated JCT s | error | per-turn overhead s | "
           "at the run's own read rate: tokens/s, JCT s, error |",
           "|---|---|---|--:|--:|--:|--:|--:|"]  # fmt: skip
    for row in rows:
        error = "fitted" if row.get("fitted") else f"{row['error']:+.0%}"
        own = "n/a"
        if row.get("own_rate_jct_s") is not None:
            own = f"{row['own_read_tokens_per_s']:.0f}, {row['own_rate_jct_s']:.1f}, {row['own_rate_error']:+.0%}"
        out.append(f"| {row['source']} | {row['topology']} | {row['mode']} | {row['measured_jct_s']:.1f} | "
                   f"{row['predicted_jct_s']:.1f} | {error} | {row.get('overhead_s', 0.0):.2f} | {own} |")  # fmt: skip
    return out


def markdown(payload: dict) -> str:
    lines = [f"# DualPath simulator: preset {payload['preset']}", "", payload["description"], ""]
    if payload.get("topologies"):
        lines += ["## P/D ratios (paper Fig. 8)", "", *_topologies(payload["topologies"]), ""]
    if payload.get("scale"):
        lines += ["## Scale at constant agents per engine (paper §7.6)", "", payload["scale_note"], "",
                  *_scale(payload["scale"]), ""]  # fmt: skip
    if payload.get("decision_rate"):
        r = payload["decision_rate"]
        lines += ["## Router decision rate", "",
                  f"{r['topology']} with {r['engines']} engines: {r['placements']} placements in {r['router_s']:.2f} s "
                  f"of the router's code (try_place + finish_prefill + finish_decode) = **{r['placements_per_s']:.0f} "
                  f"placements/s** on one core. {payload.get('decision_rate_note', '')}", ""]  # fmt: skip
    if payload.get("quota"):
        lines += ["## Compute quota (paper §6.2, A.4)", "", *_quota(payload["quota"]), ""]
    if payload.get("pd_range"):
        lines += ["## The bottleneck-free P/D range, simulated (paper §4.2)", "", *_pd_range(payload["pd_range"]), ""]
    if payload.get("calibration"):
        lines += ["## Calibration against the emulated cluster (benchmarks/results/dualpath-bench*.json)", "",
                  payload.get("calibration_note", ""), "", *_calibration(payload["calibration"]), ""]  # fmt: skip
    lines += ["## Hardware", "", "| figure | value | source |", "|---|--:|---|"]
    for key, value in payload["hardware"].items():
        if key not in ("sources", "name"):
            lines.append(f"| {key} | {value:.4g} | {payload['hardware']['sources'].get(key, '')} |")
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("topologies", "scale", "pd_range") if payload.get(p)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "topologies":
            rows = payload["topologies"]
            modes = list(rows[0]["runs"])
            for i, mode in enumerate(modes):
                ax.bar([j + i * 0.25 for j in range(len(rows))], [r["runs"][mode]["jct_s"] for r in rows], 0.25, label=mode)
            ax.set_xticks([j + 0.25 for j in range(len(rows))], [r["topology"] for r in rows])
            ax.set_ylabel("JCT s"), ax.set_title("P/D ratios"), ax.legend()
        elif panel == "scale":
            rows = payload["scale"]
            for mode in ("basic", "dualpath"):
                ax.plot([r["topology"] for r in rows], [r["runs"][mode]["jct_s"] for r in rows], marker="o", label=mode)
            ax.set_ylabel("JCT s"), ax.set_title("constant agents per engine"), ax.legend(), ax.set_ylim(bottom=0)
        else:
            rows = payload["pd_range"]["rows"]
            for i, kind in enumerate(KINDS):
                ax.bar([j + i * 0.11 for j in range(len(rows))], [r["utilisation"].get(kind, 0) for r in rows], 0.11, label=kind)
            ax.axhline(1.0, color="k", lw=0.5)
            ax.set_xticks([j + 0.33 for j in range(len(rows))], [f"{r['topology']}\n{r['where']}" for r in rows], fontsize=7)
            ax.set_ylabel("utilisation"), ax.set_title("P/D range ends"), ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(payload: dict, out_dir: Path, name: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md", "png": out_dir / f"{name}.png"}
    paths["json"].write_text(json.dumps(payload, indent=1) + "\n")
    paths["md"].write_text(markdown(payload))
    plot(payload, paths["png"])
    return paths
