"""mma_preload on the modelled CUDA runtime: bandwidth vs transfer size and vs number of paths (the shapes of the
paper's Figures 8 and 9), and sweeps of chunk size and queue depth (Figure 13).

Runs ``mma_preload/build/mma_model_test bw`` with and without ``LD_PRELOAD=libmma_preload.so``. Bandwidth is taken
from the model's own link timelines (bytes / [first start, last end] of the links used, in model time), so it does
not depend on how fast this machine's CPU is. Model links are 0.1 GB/s (NVLink 1 GB/s), about 250 times slower than
real PCIe, so the chunk sizes swept here (256 KiB - 4 MiB) correspond to far larger chunks on real hardware in
chunks per copy and time per chunk. Writes a markdown table to stdout and ``benchmarks/results/mma.json``
(+ ``mma.png`` when matplotlib is importable).

    .venv/bin/python benchmarks/bench_mma.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # dualpath_dev: the checkout's dev scaffolding
from _common import RESULTS_DIR, environment, exit_on_sigterm, markdown_table, pyplot, save_figure, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MMA = ROOT / "mma_preload"
PROG = MMA / "build" / "mma_model_test"
LIB = MMA / "build" / "libmma_preload.so"
MiB = 1 << 20
LINK_GBPS = 0.1


def bw(size: int, reps: int, streams: int, *, preload: bool, env: dict[str, str], direction: str = "h2d") -> float:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MMA_", "MODEL_", "LD_"))}
    e.update(MMA_LOG_LEVEL="0", MODEL_LINK_GBPS=str(LINK_GBPS), MODEL_NVLINK_GBPS=str(LINK_GBPS * 10), **env)
    if preload:
        e["LD_PRELOAD"] = str(LIB)
    r = subprocess.run([str(PROG), "bw", "0", direction, str(size), str(reps), str(streams)], capture_output=True,
                       text=True, timeout=300, env=e, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])["model"][direction]["window_gbps"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer points")
    args = ap.parse_args()
    exit_on_sigterm()
    subprocess.run(["make", "-C", str(MMA)], check=True, capture_output=True, timeout=300)
    chunk = {"MMA_CHUNK": "1M"}
    reps = 2 if args.quick else 3
    sizes = [1, 2, 4, 8, 16] if args.quick else [1, 2, 4, 8, 16, 32]
    res: dict[str, list] = {"size": [], "paths": [], "chunk": [], "depth": []}
    rows = []
    for mib in sizes:  # Figure 8 shape: bandwidth vs transfer size (4 GPUs, all links free)
        nat = bw(mib * MiB, reps, 1, preload=False, env=chunk)
        mp = bw(mib * MiB, reps, 1, preload=True, env=chunk)
        res["size"].append({"mib": mib, "native_gbps": nat, "mma_gbps": mp})
        rows.append(["size", f"{mib} MiB", f"{nat:.3f}", f"{mp:.3f}", f"{mp / nat:.2f}"])
    for n in (1, 2, 3, 4):  # Figure 9 shape: bandwidth vs number of paths
        env = dict(chunk, MMA_PATHS=",".join(str(i) for i in range(n)), MMA_SINGLE_PATH="1")
        mp = bw(16 * MiB, reps, 4, preload=True, env=env)
        res["paths"].append({"paths": n, "mma_gbps": mp, "ideal_gbps": n * LINK_GBPS})
        rows.append(["paths", str(n), f"{n * LINK_GBPS:.3f}", f"{mp:.3f}", f"{mp / (n * LINK_GBPS):.2f}"])
    nat16 = bw(16 * MiB, reps, 1, preload=False, env={})
    for c in ("256K", "512K", "1M", "2M", "4M"):  # Figure 13 shape: chunk size and queue depth
        mp = bw(16 * MiB, reps, 1, preload=True, env={"MMA_CHUNK": c})
        res["chunk"].append({"chunk": c, "mma_gbps": mp})
        rows.append(["chunk", c, f"{nat16:.3f}", f"{mp:.3f}", f"{mp / nat16:.2f}"])
    for dpt in (1, 2, 4, 8):
        mp = bw(16 * MiB, reps, 1, preload=True, env=dict(chunk, MMA_QUEUE_DEPTH=str(dpt)))
        res["depth"].append({"depth": dpt, "mma_gbps": mp})
        rows.append(["depth", str(dpt), f"{nat16:.3f}", f"{mp:.3f}", f"{mp / nat16:.2f}"])
    print(markdown_table(["sweep", "point", "native / ideal GB/s", "mma GB/s", "ratio"], rows,
                         caption=f"mma_preload on the modelled runtime (4 GPUs, {LINK_GBPS} GB/s links, H2D to GPU 0)"))
    payload = {"env": environment(), "link_gbps": LINK_GBPS, "results": res}
    print("wrote", write_json("mma.json", payload))
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    ax[0].plot([r["mib"] for r in res["size"]], [r["native_gbps"] for r in res["size"]], "o-", label="native")
    ax[0].plot([r["mib"] for r in res["size"]], [r["mma_gbps"] for r in res["size"]], "o-", label="mma")
    ax[0].set(xscale="log", xlabel="transfer size (MiB)", ylabel="GB/s (model)", title="vs size")
    ax[0].legend()
    ax[1].plot([r["paths"] for r in res["paths"]], [r["mma_gbps"] for r in res["paths"]], "o-", label="mma")
    ax[1].plot([r["paths"] for r in res["paths"]], [r["ideal_gbps"] for r in res["paths"]], "--", label="ideal")
    ax[1].set(xlabel="paths", title="vs number of paths")
    ax[1].legend()
    ax[2].plot([r["chunk"] for r in res["chunk"]], [r["mma_gbps"] for r in res["chunk"]], "o-")
    ax[2].set(xlabel="chunk size (depth 2)", title="chunk size")
    print("wrote", save_figure(fig, RESULTS_DIR / "mma.png"))


if __name__ == "__main__":
    main()
