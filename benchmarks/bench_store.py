"""Store throughput by chunk size: posix (a temp dir) and s3 (SeaweedFS on 127.0.0.1), side by side.

For every chunk (Full Block) size, each repetition writes N fresh chunks through
``store.write`` from a NIXL-registered ``HostBufferPool``, reads them back through
``store.read`` into other slots of the same pool, checks the bytes read equal the
bytes written (so no speed is ever reported for wrong data), and deletes them.
Stores move whole chunk objects (the Full Block and its integrity trailer,
``BlockLayout.object_bytes``): pool slots hold one each and MB/s count every byte moved.
Medians over the repetitions are printed as a markdown table and written to
``benchmarks/results/store.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # dualpath_dev: the checkout's dev scaffolding
from _common import environment, exit_on_sigterm, markdown_table, median, run_and_report  # noqa: E402

from nixl_backends.buffers import HostBufferPool  # noqa: E402
from dualpath_connector.cli import parse_size  # noqa: E402
from nixl_backends.layout import BlockLayout, chunk_key  # noqa: E402
from nixl_backends.registry import make_store, parse_store_config  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
MB = 1e6  # throughput is reported in MB/s (10^6 bytes per second)
NUM_LAYERS = 4  # the chunk is split into this many Layer Blocks; stores only see the Full Block
BACKENDS = ("posix", "s3")


def human(size: int) -> str:
    return f"{size // MIB} MiB" if size % MIB == 0 else f"{size // KIB} KiB"


def random_keys(rng: np.random.Generator, prefix: str, count: int) -> list[str]:
    # Fresh keys every repetition: the posix store skips keys already present.
    digest = "b" * 32
    return [chunk_key(prefix, digest, rng.bytes(32).hex()) for _ in range(count)]


class Bucket:
    """The benchmark's S3 bucket on the local SeaweedFS, emptied between repetitions."""

    def __init__(self, server, name: str) -> None:
        import boto3
        from botocore.config import Config

        self.name = name
        self.client = boto3.client(
            "s3",
            endpoint_url=server.endpoint,
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}),
        )

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            self.client.delete_objects(Bucket=self.name, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})


def measure(backend: str, store_section: dict, chunk_bytes: int, num_chunks: int, reps: int, batch: int,
            cleanup, seed: int) -> dict:
    """All repetitions for one backend and chunk size on a fresh agent, store and pool."""
    from nixl._api import nixl_agent, nixl_agent_config

    layout = BlockLayout(num_layers=NUM_LAYERS, layer_block_bytes=chunk_bytes // NUM_LAYERS)
    agent = nixl_agent(f"bench-{backend}-{chunk_bytes}-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=[]))
    # The backend must exist on the agent before the pool registers its memory.
    store = make_store(parse_store_config(store_section), layout, agent)
    pool = None
    try:
        pool = HostBufferPool(agent, layout.object_bytes, 2 * num_chunks)
        src = list(range(num_chunks))
        dst = list(range(num_chunks, 2 * num_chunks))
        src_view = pool.array[: num_chunks * pool.slot_stride]
        dst_view = pool.array[num_chunks * pool.slot_stride :]
        rng = np.random.default_rng(seed)
        writes, reads = [], []

        def timed_batches(op, what: str, keys: list[str], slots: list[int]) -> float:
            """Seconds for ``op`` over all chunks in batches; any failed chunk aborts the run."""
            started = time.perf_counter()
            for b in range(0, num_chunks, batch):
                ok = op(keys[b : b + batch], [pool.slot_addr(s) for s in slots[b : b + batch]])
                if not all(ok):
                    raise RuntimeError(f"{backend}: {ok.count(False)} of {len(ok)} {what} failed")
            return time.perf_counter() - started

        for rep in range(reps):
            keys = random_keys(rng, f"bench-{rep}-{uuid.uuid4().hex[:6]}", num_chunks)
            src_view[:] = rng.integers(0, 256, size=src_view.size, dtype=np.uint8)
            dst_view[:] = 0xA5  # poison: a read that moved nothing cannot pass the check
            try:
                writes.append(timed_batches(store.write, "writes", keys, src))
                reads.append(timed_batches(store.read, "reads", keys, dst))

                # Slots are padded to 4 KiB; only the objects themselves are moved.
                objects = np.s_[:, : layout.object_bytes]
                if not np.array_equal(src_view.reshape(num_chunks, -1)[objects], dst_view.reshape(num_chunks, -1)[objects]):
                    raise RuntimeError(f"{backend}, {human(chunk_bytes)} chunks: bytes read differ from bytes written")
            finally:
                cleanup(keys)
    finally:
        if pool is not None:
            pool.close()
        store.close()
        del agent
    total = num_chunks * layout.object_bytes
    w, r = median(writes), median(reads)
    return {
        "backend": backend,
        "chunk_bytes": chunk_bytes,
        "num_chunks": num_chunks,
        "total_bytes": total,
        "batch_chunks": batch,
        "write_seconds": writes,
        "read_seconds": reads,
        "write_MBps_median": total / w / MB,
        "read_MBps_median": total / r / MB,
        "write_chunks_per_s_median": num_chunks / w,
        "read_chunks_per_s_median": num_chunks / r,
        "verified": True,
    }


def run(args: argparse.Namespace) -> dict:
    from dualpath_dev.seaweedfs import SeaweedFS

    sizes = [parse_size(s) for s in args.chunk_sizes]
    for size in sizes:
        if size % (NUM_LAYERS * 4096):
            raise SystemExit(f"chunk size {size} must be a multiple of {NUM_LAYERS * 4096} bytes")
    total = parse_size(args.total)
    backends = [b for b in BACKENDS if b in args.backends]
    results = []
    server = None
    root = Path(tempfile.mkdtemp(prefix="dualpath-bench-posix-"))
    try:
        if "s3" in backends:
            server = SeaweedFS().start()
            print(f"S3 (SeaweedFS) on {server.endpoint}", file=sys.stderr)
            bucket = Bucket(server, f"bench-{uuid.uuid4().hex[:10]}")
        for size in sizes:
            num_chunks = max(1, total // size)
            batch = args.batch_chunks or num_chunks
            for backend in backends:
                if backend == "posix":
                    section = {"backend": "posix", "root": str(root)}

                    def cleanup(keys: list[str]) -> None:
                        for child in root.iterdir():
                            shutil.rmtree(child, ignore_errors=True)
                else:
                    section = server.store_config(bucket.name)
                    cleanup = bucket.delete
                print(f"{backend}: {num_chunks} x {human(size)}, {args.reps} repetitions ...", file=sys.stderr)
                results.append(measure(backend, section, size, num_chunks, args.reps, batch, cleanup, args.seed))
        if server is not None:
            with contextlib.suppress(Exception):
                bucket.client.delete_bucket(Bucket=bucket.name)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {"config": vars(args) | {"chunk_bytes": sizes, "total_bytes": total}, "environment": environment(),
            "results": results}


def table(payload: dict) -> str:
    by_key = {(r["backend"], r["chunk_bytes"]): r for r in payload["results"]}
    backends = [b for b in BACKENDS if any(k[0] == b for k in by_key)]
    headers = ["chunk", "chunks"]
    for b in backends:
        headers += [f"{b} write MB/s", f"{b} read MB/s", f"{b} write chunks/s", f"{b} read chunks/s"]
    rows = []
    for size in payload["config"]["chunk_bytes"]:
        first = next(r for r in payload["results"] if r["chunk_bytes"] == size)
        row: list[object] = [human(size), first["num_chunks"]]
        for b in backends:
            r = by_key[(b, size)]
            row += [f"{r['write_MBps_median']:.0f}", f"{r['read_MBps_median']:.0f}",
                    f"{r['write_chunks_per_s_median']:.0f}", f"{r['read_chunks_per_s_median']:.0f}"]
        rows.append(row)
    cfg = payload["config"]
    caption = (
        f"Store throughput, median of {cfg['reps']} repetitions, {human(cfg['total_bytes'])} per chunk size "
        f"and repetition, MB = 10^6 bytes; every read was checked byte for byte against what was written. "
        f"posix: a temp dir on local disk; its reads come right after the writes and so are served from the "
        f"page cache (caches are not dropped). s3: SeaweedFS on 127.0.0.1 (loopback, same {cfg_cpus(payload)}-core "
        f"machine as the client)."
    )
    return markdown_table(headers, rows, caption)


def cfg_cpus(payload: dict) -> object:
    return payload["environment"]["cpu_count"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-sizes", nargs="+", default=["64KiB", "256KiB", "1MiB", "4MiB"],
                        help="Full Block sizes, e.g. 64KiB 1MiB (KiB/MiB binary, k/M decimal)")
    parser.add_argument("--total", default="64MiB", help="bytes written and read per chunk size and repetition")
    parser.add_argument("--reps", type=int, default=5, help="repetitions (the median is reported)")
    parser.add_argument("--batch-chunks", type=int, default=64,
                        help="chunks per store.write/read call (0: all at once); 64 is one vLLM step of "
                             "2048 tokens at 32-token chunks")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="store.json", help="file name under benchmarks/results/")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 sizes, 8 MiB, 2 repetitions")
    args = parser.parse_args()
    if args.quick:
        args.chunk_sizes, args.total, args.reps = ["64KiB", "1MiB"], "8MiB", 2
        if args.output == "store.json":
            args.output = "store-quick.json"
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    exit_on_sigterm()
    import nixl._api  # noqa: F401  (sets up NIXL's logging, which prints INFO lines to stdout)

    # Keep stdout for the table: NIXL's per-agent INFO lines would interleave with it.
    logging.getLogger("nixl").setLevel(logging.WARNING)
    run_and_report(run, table, args, args.output)


if __name__ == "__main__":
    main()
