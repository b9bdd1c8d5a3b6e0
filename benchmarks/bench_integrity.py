"""What chunk integrity costs: sealing and verifying objects per GB, per mode and Layer Block size.

Side by side in one run, on the same bytes in one host buffer (as the pools
hold them): ``checksum`` (XXH3-128) and ``keyed`` (keyed BLAKE3) for
Layer Blocks from the tiny test model's (16 KiB) to a 70B-class model's
(a 256-token chunk of 8 KV heads x 128 dims in bf16 is 1 MiB), plus a plain
``memcpy`` of the same bytes as the memory-speed reference. One thread, as the
read lane verifies. Medians of ``--repeats``; results in
``benchmarks/results/integrity.{json,png}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from _common import bar_chart, exit_on_sigterm, markdown_table, median, result_payload, run_and_report  # noqa: E402

from nixl_backends.integrity import ChunkIntegrity  # noqa: E402
from nixl_backends.layout import BlockLayout  # noqa: E402

MODES = {"checksum": None, "keyed": b"k" * 32}
CHUNK_HASH = "ab" * 32


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def measure(layer_block_bytes: int, num_layers: int, total_bytes: int, repeats: int) -> dict[str, dict]:
    layout = BlockLayout(num_layers, layer_block_bytes)
    count = max(1, total_bytes // layout.object_bytes)
    objects = np.random.default_rng(0).integers(0, 256, (count, layout.object_bytes), dtype=np.uint8)
    payload = count * layout.full_block_bytes
    out: dict[str, dict] = {}
    for mode, key in MODES.items():
        integrity = ChunkIntegrity(layout, key)
        seal, verify = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            for obj in objects:
                integrity.seal(CHUNK_HASH, obj)
            seal.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert all(integrity.verify(CHUNK_HASH, obj) for obj in objects)
            verify.append(time.perf_counter() - started)
        out[mode] = {
            "seal_gbps": _gbps(payload, median(seal)),
            "verify_gbps": _gbps(payload, median(verify)),
            "verify_ms_per_gb": median(verify) / payload * 1e9 * 1e3,
        }
    copies = []
    target = np.empty_like(objects)
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(target, objects)
        copies.append(time.perf_counter() - started)
    out["memcpy"] = {"verify_gbps": _gbps(payload, median(copies))}
    return out


def run(args: argparse.Namespace) -> dict:
    results = {}
    for size in args.layer_block_kib:
        results[str(size)] = measure(size * 1024, args.layers, args.total_mib << 20, args.repeats)
        print(f"{size} KiB Layer Blocks: done", file=sys.stderr)
    return result_payload(args, results=results)


def table(payload: dict) -> str:
    rows = []
    for size, by_mode in payload["results"].items():
        for mode in MODES:
            r = by_mode[mode]
            rows.append([f"{size} KiB", mode, f"{r['seal_gbps']:.2f}", f"{r['verify_gbps']:.2f}",
                         f"{r['verify_ms_per_gb']:.0f}", f"{by_mode['memcpy']['verify_gbps']:.2f}"])  # fmt: skip
    caption = (f"Chunk integrity cost, one thread, {payload['config']['layers']} layers per object, "
               f"medians of {payload['config']['repeats']} (load average at start "
               f"{payload['environment']['load_avg_at_start'][0]:.1f} on {payload['environment']['cpu_count']} CPUs)")
    return markdown_table(["Layer Block", "mode", "seal GB/s", "verify GB/s", "verify ms per GB", "memcpy GB/s"],
                          rows, caption)  # fmt: skip


def chart(payload: dict, path: Path) -> Path | None:
    labels = [f"{size} KiB" for size in payload["results"]]
    series = {name: [r[name]["verify_gbps"] for r in payload["results"].values()] for name in (*MODES, "memcpy")}
    return bar_chart(path, labels, series, "Layer Block size", "Verify throughput vs memcpy (one thread)",
                     ylabel="GB/s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer-block-kib", type=int, nargs="+", default=[16, 256, 1024])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--total-mib", type=int, default=512, help="bytes verified per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    exit_on_sigterm()
    run_and_report(run, table, parser.parse_args(), "integrity.json", chart)


if __name__ == "__main__":
    main()
