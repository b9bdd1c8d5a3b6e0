"""The connector's GPU data path, without vLLM: byte checks in every KV layout, and whether layerwise loading hides.

1. **Bytes.** For every layout in ``dualpath_dev.kv_layouts`` (FlashAttention,
   FlashInfer, HND, CPU, MLA, and vLLM 0.32's LBHNC/LBNHC/LHBNC and cross-layer
   BLHNC/BLNHC), KV caches on the device and a pinned host pool of stored
   objects (Full Block + integrity trailer): the connector's ``DeviceCopier``
   copies blocks out (as a save) and into another cache (as a load), on its copy
   streams; the blocks, the untouched blocks and the trailers are compared byte
   for byte, and the host slots against the store format (layer ``l`` of
   sub-block ``s`` where ``BlockLayout`` puts it).
2. **Overlap.** A 7B-like model (``--layers`` 32, ``--heads`` 32, ``--head-dim`` 128,
   bf16, LBHNC) with a ``--hit`` (0.9) share of a ``--tokens`` prompt in pinned
   pools, one chunk-major and one layer-major (``HostBufferPool(layer_major=...)``);
   per layer a compute stand-in (two matmuls with one decoder layer's FLOPs at
   ``--tokens`` tokens). Per forward, medians (and min-max) of ``--reps``, the modes
   interleaved: *no-load* (compute only), *bulk* (every layer copied, then the
   forward), *layerwise* (every layer queued at once on the copy stream, the forward
   waits on each layer's event: the connector's path), *layerwise-per-block* (one
   copy per block instead of per slot plus a device scatter), and *bulk* /
   *layerwise* from the layer-major pool (one copy per layer of the hit). Columns:
   the forward's time, the host time spent queueing the copies (the forward's kernels
   queue after them), the loads' own time, and the stall and hidden fraction as
   ``StepLoadTiming`` reports them for the connector; and the host->device copies
   per layer with their sizes.
   ``--mma`` repeats part 2 with ``mma_preload`` preloaded (``MMA_SINGLE_PATH=1`` on
   a one-GPU machine, so its chunking runs), and reports the copies it intercepted;
   it refuses to run without the built library.

Writes ``gpu_connector.json`` and ``gpu_connector.md`` to ``--out-dir`` and prints
the table. Exit status 0 when every byte check passes, 1 otherwise, 77 with
``--device cuda`` and no GPU. ``--device cpu`` runs the same code on CPU tensors
with ``InlineCopyStream`` (no stream, no overlap: a self-test of the script, which
``make test`` runs with ``--quick``).

    python3 scripts/gpu_connector_check.py [--device cuda] [--tokens 8192] [--mma]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dualpath_connector.cache.copy_stream import CopyStream, copy_stream_for, pinned  # noqa: E402
from dualpath_connector.cache.device_copies import DeviceCopier  # noqa: E402
from dualpath_connector.cache.kv_cache_view import KVCacheView  # noqa: E402
from dualpath_connector.load.load_timing import StepLoadTiming  # noqa: E402
from dualpath_connector.metrics.stats_recorder import StatsRecorder  # noqa: E402
from dualpath_dev import kv_layouts  # noqa: E402
from dualpath_dev.kv_layouts import CacheShape  # noqa: E402
from nixl_backends.layout import BlockLayout  # noqa: E402

MMA_LIBRARY = REPO / "mma_preload" / "build" / "libmma_preload.so"
TRAILER_SENTINEL = 0xA5


class PinnedPool:
    """Slots of stored objects in one page-locked host array, chunk- or layer-major (as the connector's pools)."""

    def __init__(self, view: KVCacheView, slots: int, blocks_per_chunk: int, device: torch.device,
                 layer_major: bool = False) -> None:  # fmt: skip
        self.layout = BlockLayout(view.num_layers, view.layer_block_bytes(blocks_per_chunk))
        self.slots, self.layer_major = slots, layer_major
        self.array = np.full(slots * self.layout.object_bytes, TRAILER_SENTINEL, dtype=np.uint8)
        self._pin = pinned(self.array.ctypes.data, self.array.nbytes, device)
        self._pin.__enter__()
        self.host = view.host_blocks(self.array, slots, blocks_per_chunk, layer_major=layer_major)

    def trailers_untouched(self) -> bool:
        if self.layer_major:  # the layer bands, then every slot's trailer
            return bool((self.array[self.slots * self.layout.full_block_bytes :] == TRAILER_SENTINEL).all())
        objects = self.array.reshape(-1, self.layout.object_bytes)
        return bool((objects[:, self.layout.full_block_bytes :] == TRAILER_SENTINEL).all())

    def close(self) -> None:
        self._pin.__exit__(None, None, None)


# -- 1. bytes -------------------------------------------------------------------------


def check_layout(layout: str, device: torch.device) -> dict:
    """Saves then loads through a chunk-major and a layer-major pool; ok when both are byte-exact."""
    parts = {name: check_pool(layout, device, name == "layer_major") for name in ("chunk_major", "layer_major")}
    return {"layout": layout, **parts["chunk_major"], "layer_major": parts["layer_major"],
            "ok": all(part["ok"] for part in parts.values())}  # fmt: skip


def check_pool(layout: str, device: torch.device, layer_major: bool) -> dict:
    shape = CacheShape(num_layers=3, num_blocks=16, block=16, heads=4, dim=64, device=str(device))
    source = KVCacheView(kv_layouts.make_caches(layout, shape, 1), shape.num_blocks)
    target = KVCacheView(kv_layouts.make_caches(layout, shape, 2), shape.num_blocks)
    before = [view.clone() for view in target.layers]
    bpc = 2
    pool = PinnedPool(source, 3, bpc, device, layer_major)
    try:
        slots, subs = [2, 2, 0, 0, 1], [0, 1, 0, 1, 1]
        out_blocks, in_blocks = [5, 2, 11, 0, 3], [1, 14, 3, 4, 0]
        saver = DeviceCopier(source, pool.host, copy_stream_for(device), staging_bytes=pool.host[0, 0].numel() * 3)
        saver.post_saves(source.plan(slots, subs, out_blocks, on_device=False)).wait()
        stored = all(
            torch.equal(pool.host[slot, layer, sub].to(device), source.layers[layer][:, block])
            for layer in range(shape.num_layers)
            for slot, sub, block in zip(slots, subs, out_blocks)
        )
        # Loads in batches of two slots: the staging area is reused within a layer.
        loader = DeviceCopier(target, pool.host, copy_stream_for(device), staging_bytes=pool.host[0, 0].numel() * 2)
        _, marks = loader.post_loads(target.plan(slots, subs, in_blocks, on_device=False), range(shape.num_layers))
        marks[-1].wait()
        loaded = all(
            torch.equal(target.layers[layer][:, dst], source.layers[layer][:, src])
            for layer in range(shape.num_layers)
            for src, dst in zip(out_blocks, in_blocks)
        )
        untouched = [b for b in range(shape.num_blocks) if b not in in_blocks]
        kept = all(torch.equal(t[:, untouched], b[:, untouched]) for t, b in zip(target.layers, before))
        # Negative control: a block that went elsewhere must compare unequal.
        control = not torch.equal(target.layers[0][:, 14], source.layers[0][:, 5])
        ok = stored and loaded and kept and pool.trailers_untouched() and control
        return {"outer": source.outer, "stored": stored, "loaded": loaded, "kept": kept,
                "trailers": pool.trailers_untouched(), "negative_control": control, "ok": ok}  # fmt: skip
    finally:
        pool.close()


# -- 2. overlap -------------------------------------------------------------------------


def fill_random(array: np.ndarray, tile_bytes: int = 64 << 20) -> None:
    """Random bytes, one random tile repeated: a 32k-token hit is 14 GiB, too much to draw byte by byte."""
    tile = np.random.default_rng(4).integers(0, 256, min(tile_bytes, array.size), dtype=np.uint8)
    whole = array.size // tile.size * tile.size
    array[:whole].reshape(-1, tile.size)[:] = tile
    array[whole:] = tile[: array.size - whole]


class Model:
    """A 7B-like KV cache with the hit in a pinned pool, and a per-layer compute stand-in."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.device = device
        self.chunk_blocks = args.chunk // args.block
        num_blocks = -(-args.tokens // args.block) + self.chunk_blocks
        shape = CacheShape(args.layers, num_blocks, args.block, args.heads, args.head_dim, device=str(device))
        self.view = KVCacheView(kv_layouts.make_caches("LBHNC", shape, 3), num_blocks)
        hit_chunks = int(args.tokens * args.hit) // args.chunk
        # The hit in consecutive slots of each pool layout: per layer one copy per chunk (chunk-major) or one
        # copy of the whole layer (layer-major).
        self.pools = {name: PinnedPool(self.view, hit_chunks, self.chunk_blocks, device, name == "layer-major")
                      for name in ("chunk-major", "layer-major")}  # fmt: skip
        self.pool = self.pools["chunk-major"]
        for pool in self.pools.values():
            fill_random(pool.array)
        n = hit_chunks * self.chunk_blocks
        # The hit's blocks in a scattered order, as vLLM hands blocks out.
        blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(5))[:n].tolist()
        self.plan = self.view.plan(np.repeat(np.arange(hit_chunks), self.chunk_blocks),
                                   np.tile(np.arange(self.chunk_blocks), hit_chunks), blocks, on_device=False)  # fmt: skip
        self.hit_bytes = hit_chunks * self.pool.layout.full_block_bytes
        hidden, ffn = args.heads * args.head_dim, args.ffn
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.x = torch.randn(args.tokens, hidden, dtype=dtype, device=device)
        # One decoder layer's weights: q, k, v, o (hidden x hidden each) and gate, up, down (hidden x ffn).
        self.w_in = torch.randn(hidden, 4 * hidden + 2 * ffn, dtype=dtype, device=device) / hidden**0.5
        self.w_out = torch.randn(ffn, hidden, dtype=dtype, device=device) / ffn**0.5

    def compute_layer(self) -> None:
        h = self.x @ self.w_in
        h[:, : self.w_out.shape[0]] @ self.w_out

    def per_block_loads(self, stream: CopyStream) -> tuple:
        """Every layer queued as one host->device copy per block (the alternative to staging + scatter)."""
        stream.follow_compute()
        start, marks = stream.mark(), []
        slots, subs, blocks = self.plan.slots.tolist(), self.plan.sub_blocks.tolist(), self.plan.block_ids.tolist()
        with stream.active():
            for layer in range(self.view.num_layers):
                target = self.view.layers[layer]
                for slot, sub, block in zip(slots, subs, blocks):
                    target[:, block].copy_(self.pool.host[slot, layer, sub], non_blocking=True)
                marks.append(stream.mark())
        return start, marks


def forward(model: Model, mode: str, stream: CopyStream, copiers: dict[str, DeviceCopier]) -> dict:
    """One forward in ``mode``; its time on the compute stream, the host time queueing the loads took, and the
    connector's load timing."""
    layers = range(model.view.num_layers)
    timing = StepLoadTiming()
    begin = stream.compute_mark()
    queued = time.perf_counter()
    if mode != "no-load":
        copier = copiers["layer-major" if mode.endswith("layer-major") else "chunk-major"]
        start, marks = model.per_block_loads(stream) if mode == "layerwise-per-block" else copier.post_loads(model.plan, layers)
        timing.device_loads.append((start, marks[-1]))
    queued = time.perf_counter() - queued
    for layer in layers:
        if mode.startswith("bulk") and layer == 0:
            timing.device_waits.append((stream.compute_mark(), [marks[-1]]))
            stream.compute_waits(marks[-1])
        elif mode.startswith("layerwise"):
            timing.device_waits.append((stream.compute_mark(), [marks[layer]]))
            stream.compute_waits(marks[layer])
        model.compute_layer()
    end = stream.compute_mark()
    end.wait()
    for mark in timing.all_marks():
        mark.wait()
    stats = StatsRecorder()
    timing.report(stats)
    data = stats.take()
    return {"step_s": begin.seconds_until(end), "wait_s": data["layer_wait_seconds"][0],
            "load_s": data["layer_load_seconds"][0], "queue_s": queued}  # fmt: skip


MODES = ("no-load", "bulk", "layerwise", "layerwise-per-block", "bulk-layer-major", "layerwise-layer-major")


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    model = Model(args, device)
    try:
        stream = copy_stream_for(device)
        copiers = {name: DeviceCopier(model.view, pool.host, stream) for name, pool in model.pools.items()}
        for mode in MODES:
            forward(model, mode, stream, copiers)  # warm-up: allocator, kernels
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for _ in range(args.reps):  # interleaved: A B C ... A B C ...
            for mode in MODES:
                runs[mode].append(forward(model, mode, stream, copiers))
        rows = {}
        for mode, samples in runs.items():
            step, wait, load, queue = (statistics.median(r[k] for r in samples) for k in ("step_s", "wait_s", "load_s", "queue_s"))
            rows[mode] = {"step_ms": round(step * 1e3, 3), "step_ms_min": round(min(r["step_s"] for r in samples) * 1e3, 3),
                          "step_ms_max": round(max(r["step_s"] for r in samples) * 1e3, 3),
                          "queue_ms": round(queue * 1e3, 3), "wait_ms": round(wait * 1e3, 3), "load_ms": round(load * 1e3, 3),
                          "hidden_fraction": round(max(0.0, 1 - wait / load), 3) if load > 0 else None}  # fmt: skip
        base = rows["no-load"]["step_ms"]
        for row in rows.values():
            row["vs_no_load"] = round(row["step_ms"] / base, 3) if base > 0 else None
        # What DeviceCopier.post_loads queued per layer, for each pool layout.
        copies = {name: {"per_layer": len(c.last_load_copy_bytes), "bytes_each": sorted(set(c.last_load_copy_bytes))}
                  for name, c in copiers.items()}  # fmt: skip
        return {"hit_mib": round(model.hit_bytes / 2**20, 1), "h2d_copies": copies, "modes": rows}
    finally:
        for pool in model.pools.values():
            pool.close()


def measure_under_mma(argv: list[str], out_dir: Path) -> dict:
    """Part 2 again in a child with ``mma_preload`` preloaded, and what the library says it intercepted."""
    if not MMA_LIBRARY.exists():
        raise SystemExit(f"--mma: {MMA_LIBRARY} is missing; build it first (make -C mma_preload)")
    stats = out_dir / f"mma-stats-{os.getpid()}.json"
    env = {**os.environ, "LD_PRELOAD": str(MMA_LIBRARY), "MMA_SINGLE_PATH": "1", "MMA_STATS_FILE": str(stats)}
    child = subprocess.run([sys.executable, __file__, *argv, "--overlap-only"], env=env,
                           capture_output=True, text=True, check=True)  # fmt: skip
    part = json.loads(child.stdout.strip().splitlines()[-1])
    # The library writes its counts at exit; none where nothing reached cudaMemcpy(Async) (a CPU run).
    part["mma_stats"] = json.loads(stats.read_text()) if stats.exists() else None
    stats.unlink(missing_ok=True)
    return part


def table(result: dict) -> str:
    lines = []
    for title, part in (("", result["overlap"]), (" with mma_preload", result.get("overlap_mma"))):
        if not part:
            continue
        copies = "; ".join(f"{name}: {c['per_layer']} copies of {'/'.join(f'{b / 2**20:.2f}' for b in c['bytes_each'])} MiB"
                           for name, c in part["h2d_copies"].items())  # fmt: skip
        intercepted = f"; mma intercepted {part['mma_stats']['intercepted']} copies" if part.get("mma_stats") else ""
        lines += [f"\n{result['tokens']} tokens, {part['hit_mib']} MiB hit{title}; host->device per layer: {copies}{intercepted}\n",
                  "| mode | forward ms (min-max) | x no-load | queueing ms | load ms | stall ms | hidden |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for mode, row in part["modes"].items():
            lines.append(f"| {mode} | {row['step_ms']} ({row['step_ms_min']}-{row['step_ms_max']}) | {row['vs_no_load']} | "
                         f"{row['queue_ms']} | {row['load_ms']} | {row['wait_ms']} | {row['hidden_fraction']} |")  # fmt: skip
    checks = ", ".join(f"{c['layout']}:{'ok' if c['ok'] else 'FAIL'}" for c in result["layouts"])
    if result["device"] == "cpu":
        # InlineCopyStream runs each copy when it is queued: nothing can overlap.
        lines.append("\n(cpu: copies run when queued; these figures check the script, they measure nothing)")
    return f"device: {result['device']}\nbyte checks: {checks}\n" + "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hit", type=float, default=0.9)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mma", action="store_true", help="repeat the overlap part with mma_preload preloaded")
    parser.add_argument("--overlap-only", action="store_true", help=argparse.SUPPRESS)  # the --mma child
    parser.add_argument("--quick", action="store_true", help="small sizes (the CPU self-test)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.layers, args.heads, args.head_dim, args.ffn, args.chunk, args.reps = 512, 4, 2, 32, 128, 64, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 77
    device = torch.device(args.device)
    if args.overlap_only:
        print(json.dumps(measure(args, device)))
        return 0
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "tokens": args.tokens,
              "layouts": [check_layout(layout, device) for layout in sorted(kv_layouts.LAYOUTS)],
              "overlap": measure(args, device)}  # fmt: skip
    if args.mma:
        result["overlap_mma"] = measure_under_mma(argv or sys.argv[1:], args.out_dir)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "gpu_connector.json").write_text(json.dumps(result, indent=1))
    text = table(result)
    (args.out_dir / "gpu_connector.md").write_text(text)
    print(text)
    return 0 if all(c["ok"] for c in result["layouts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
