"""Helpers shared by the benchmark scripts: medians, markdown tables, JSON results, signals."""

from __future__ import annotations

import json
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]], caption: str = "") -> str:
    """A GitHub markdown table; numbers are right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(_is_number(r[i]) for r in cells) and bool(cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        out = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric)) + "|"
    text = [line(headers), sep, *(line(r) for r in cells)]
    if caption:
        text = [caption, "", *text]
    return "\n".join(text)


def _is_number(text: str) -> bool:
    try:
        float(text.replace("x", "").replace(",", ""))
    except ValueError:
        return False
    return True


def environment() -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_avg_at_start": list(os.getloadavg()),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(name: str, payload: dict) -> Path:
    """Write ``benchmarks/results/<name>`` atomically (via a ``.tmp`` file git ignores)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so ``finally`` blocks stop what was started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def run_and_report(run, table, args, json_name: str) -> dict:
    """Run a benchmark, print its table and write its JSON; Ctrl-C exits 130 after cleanup."""
    try:
        payload = run(args)
    except KeyboardInterrupt:
        print("interrupted; everything this run started has been stopped", file=sys.stderr)
        sys.exit(130)
    text = table(payload)
    payload["table"] = text
    path = write_json(json_name, payload)
    print(text)
    print(f"\nresults: {path}")
    return payload
