"""Store reads in flight per engine (issue 30, part 2): the worker's own read path, 1, 2 and 4 reads at once.

A burst of hits (``--hits`` requests of ``--hit-chunks`` chunks each, as a batch of agents' turns arriving
together) is queued on a real ``HitReader`` (the connector's read path: pool slots, one GET per object through
NIXL's OBJ plugin, the integrity check and the NaN/inf scan of every chunk) whose read lane runs
``store_reads_in_flight`` reads at once, against SeaweedFS on 127.0.0.1. Timed from the first submit to the
last hit reported; every hit must come back whole and verified, or the run stops (no speed for wrong data).
The modes are interleaved (1 2 4 4 2 1 ...), medians and spread over ``--reps``, load average at start and end.
``--store-delay-ms`` puts the delaying S3 relay (``dualpath_dev.s3_relay``, a process of its own) in front of
SeaweedFS: every request waits that long before it reaches the server (a store with milliseconds per request).

    .venv/bin/python benchmarks/bench_read_lanes.py                   # results/read_lanes.{json,png}
    .venv/bin/python benchmarks/bench_read_lanes.py --store-delay-ms 5 --output read_lanes-5ms.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # dualpath_dev: the checkout's dev scaffolding
from _common import exit_on_sigterm, markdown_table, median, result_payload, run_and_report  # noqa: E402

from dualpath_connector.lanes.io_lanes import IOLane  # noqa: E402
from dualpath_connector.metadata import ChunkLoad, LoadSpec  # noqa: E402
from dualpath_connector.protocol import StoreKeySpace  # noqa: E402
from dualpath_connector.load.loaded_hit import LoadedHit  # noqa: E402
from dualpath_connector.load.fetch import HitReader  # noqa: E402
from dualpath_connector.metrics.stats_recorder import StatsRecorder  # noqa: E402
from dualpath_dev.s3_relay import S3RelayProcess  # noqa: E402
from nixl_backends.buffers import HostBufferPool  # noqa: E402
from nixl_backends.integrity import ChunkIntegrity  # noqa: E402
from nixl_backends.layout import KVNamespace, chunk_hashes  # noqa: E402
from nixl_backends.registry import make_store, parse_store_config  # noqa: E402

MB = 1e6
PATIENT_S = 600.0


def namespace(layers: int) -> KVNamespace:
    """A Llama-8B-shaped KV (8 KV heads of 128, bf16, 32-token chunks: 128 KiB per layer) with ``layers`` layers."""
    return KVNamespace(model="bench", dtype="bfloat16", block_size=32, chunk_tokens=32, num_layers=layers,
                       num_kv_heads=8, head_size=128, kv_layout="NHD", layer_block_bytes=2 * 32 * 8 * 128 * 2)  # fmt: skip


class Burst:
    """Counts reported hits; ``wait`` returns them all once the last one is in."""

    def __init__(self, expected: int) -> None:
        self.hits: list[LoadedHit] = []
        self._expected = expected
        self._done = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, hit: LoadedHit) -> None:
        with self._lock:
            self.hits.append(hit)
            if len(self.hits) == self._expected:
                self._done.set()

    def wait(self) -> list[LoadedHit]:
        if not self._done.wait(PATIENT_S):
            raise RuntimeError(f"only {len(self.hits)} of {self._expected} hits reported in {PATIENT_S:.0f}s")
        return self.hits


def run(args: argparse.Namespace) -> dict:
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    from dualpath_dev.seaweedfs import SeaweedFS

    key_space = StoreKeySpace.of(namespace(args.layers), "bench")
    layout = key_space.layout
    hits = [chunk_hashes(key_space.digest, list(range(h * 100_000, h * 100_000 + args.hit_chunks * 32)), 32)
            for h in range(args.hits)]  # fmt: skip
    seconds: dict[int, list[float]] = {n: [] for n in args.reads_in_flight}
    with SeaweedFS() as server, contextlib.ExitStack() as stack:
        section = server.store_config(f"bench-{uuid.uuid4().hex[:10]}") | {"create_bucket": True}
        if args.store_delay_ms > 0:
            proxy = S3RelayProcess(server.endpoint, server.data_dir / "delay-relay.log").start()
            stack.callback(proxy.stop)
            proxy.set_delay(args.store_delay_ms)
            section["endpoint"] = proxy.endpoint
        # As the connector's worker makes its agent: reads run on several threads.
        agent = nixl_agent(f"bench-read-lanes-{uuid.uuid4().hex[:8]}", nixl_agent_config(
            enable_prog_thread=False, backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))  # fmt: skip
        store = make_store(parse_store_config(section), layout, agent)
        pool = HostBufferPool(agent, layout.object_bytes, args.hits * args.hit_chunks)
        integrity = ChunkIntegrity(layout)
        try:
            _store_hits(store, pool, integrity, key_space, hits, args.seed)
            lanes = {n: IOLane(f"bench-read-{n}", None, threads=n) for n in args.reads_in_flight}
            readers = {n: HitReader(store=store, pool=pool, block_size=32, key_space=key_space, integrity=integrity,
                                    kv_dtype=torch.bfloat16, peers=None, lane=lane, stats=StatsRecorder(),
                                    de_read_timeout_s=10.0, cores=None) for n, lane in lanes.items()}  # fmt: skip
            try:
                _burst(readers[args.reads_in_flight[0]], hits)  # warm-up: connections, the server's page cache
                for rep in range(args.reps):
                    order = args.reads_in_flight if rep % 2 == 0 else args.reads_in_flight[::-1]  # A B C, C B A
                    for n in order:
                        seconds[n].append(_burst(readers[n], hits))
                        print(f"rep {rep}: {n} in flight: {seconds[n][-1]:.3f}s", file=sys.stderr)
            finally:
                for n, reader in readers.items():
                    reader.shutdown()
                    lanes[n].stop(60.0)
        finally:
            pool.close()
            store.close()
    total = args.hits * args.hit_chunks * layout.object_bytes
    results = []
    for n in args.reads_in_flight:
        rates = [total / s / MB for s in seconds[n]]
        results.append({"reads_in_flight": n, "seconds": seconds[n], "MBps_median": median(rates),
                        "MBps_range": [min(rates), max(rates)], "verified": True})  # fmt: skip
    base = results[0]["MBps_median"]
    for result in results:
        result["vs_first"] = result["MBps_median"] / base
    return result_payload(args, object_bytes=layout.object_bytes, burst_bytes=total, results=results)


def _store_hits(store, pool: HostBufferPool, integrity: ChunkIntegrity, key_space: StoreKeySpace,
                hits: list[list[str]], seed: int) -> None:  # fmt: skip
    """Every chunk of every hit written once: finite bf16 KV under a valid trailer."""
    generator = torch.Generator().manual_seed(seed)
    layout = key_space.layout
    for hit in hits:
        slots = pool.acquire(len(hit))
        try:
            for chunk_hash, slot in zip(hit, slots):
                obj = pool.slot_view(slot)[: layout.object_bytes]
                values = torch.randn(layout.full_block_bytes // 2, generator=generator).bfloat16()
                obj[: layout.full_block_bytes] = values.view(torch.uint8).numpy()
                integrity.seal(key_space.object_hash(chunk_hash), obj)
            ok = store.write([key_space.key(h) for h in hit], [pool.slot_addr(s) for s in slots])
            if not all(ok):
                raise RuntimeError(f"{ok.count(False)} chunk writes failed")
        finally:
            pool.release(slots)


def _burst(reader: HitReader, hits: list[list[str]]) -> float:
    """Seconds to read every hit, all queued at once; each must come back whole."""
    burst = Burst(len(hits))
    specs = [LoadSpec(f"bench-{i}", [ChunkLoad(h, 0, [0]) for h in hit]) for i, hit in enumerate(hits)]
    started = time.perf_counter()
    for spec in specs:
        reader.submit_here(spec, burst)
    loaded = burst.wait()
    elapsed = time.perf_counter() - started
    short = [len(hit.chunks) for hit in loaded if len(hit.chunks) != len(hits[0])]
    reader.release(loaded)
    if short:
        raise RuntimeError(f"hits came back short ({short} chunks of {len(hits[0])}): no speed for a failed read")
    return elapsed


def table(payload: dict) -> str:
    config = payload["config"]
    rows = [[r["reads_in_flight"], f"{r['MBps_median']:.0f} [{r['MBps_range'][0]:.0f}-{r['MBps_range'][1]:.0f}]",
             f"{median(r['seconds']):.3f}", f"{r['vs_first']:.2f}x"] for r in payload["results"]]  # fmt: skip
    delay = f" behind a {config['store_delay_ms']:g} ms delay per request" if config["store_delay_ms"] else ""
    env = payload["environment"]
    caption = (f"{config['hits']} hits x {config['hit_chunks']} chunks of {payload['object_bytes'] / 2**20:.2f} MiB "
               f"({payload['burst_bytes'] / 2**20:.0f} MiB per burst), SeaweedFS on 127.0.0.1{delay}, "
               f"{config['reps']} interleaved repetitions; load {env['load_avg_at_start'][0]:.1f} -> "
               f"{env['load_avg_at_end'][0]:.1f}")  # fmt: skip
    return markdown_table(["reads in flight", "MB/s median [min-max]", "burst s (median)", "vs 1"], rows, caption)


def chart(payload: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    results = payload["results"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    x = np.arange(len(results))
    medians = [r["MBps_median"] for r in results]
    low = [m - r["MBps_range"][0] for m, r in zip(medians, results)]
    high = [r["MBps_range"][1] - m for m, r in zip(medians, results)]
    ax.bar(x, medians, yerr=[low, high], capsize=4)
    ax.set_xticks(x, [str(r["reads_in_flight"]) for r in results])
    ax.set_xlabel("store reads in flight (store_reads_in_flight)")
    ax.set_ylabel("hit read rate, MB/s")
    ax.set_title("Read path, one engine, SeaweedFS on 127.0.0.1")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reads-in-flight", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hits", type=int, default=8, help="hits queued at once")
    parser.add_argument("--hit-chunks", type=int, default=16, help="chunks (32 tokens each) per hit")
    parser.add_argument("--layers", type=int, default=8, help="layers per chunk: 128 KiB of KV each")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--store-delay-ms", type=float, default=0.0, help="each store request waits this long first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="read_lanes.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    if min(args.reads_in_flight) < 1 or args.reps < 3:
        parser.error("--reads-in-flight must be positive and --reps at least 3")
    exit_on_sigterm()
    run_and_report(run, table, args, args.output, chart)


if __name__ == "__main__":
    main()
