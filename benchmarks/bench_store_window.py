"""S3 store reads at a store round trip: a fixed window of requests in flight vs one sized from the link's BDP.

The ``s3`` store keeps ``window`` GETs in flight per read. ``fixed``: the window
before it was measured, ``io_window_min`` = ``io_threads`` = 8 requests.
``bdp``: the shipped defaults, from ``io_window_min`` 8 up to ``io_threads`` 32,
sized from the link's measured bandwidth-delay product (``nixl_backends/window.py``).

One SeaweedFS on 127.0.0.1 holds N chunk objects (written once, straight); each
mode has its own NIXL agent and store and reads them through one delaying relay
(``dualpath_dev.s3_relay`` in a process of its own: every request waits
``--store-rtt-ms`` before it is forwarded, requests on different connections
side by side: a round trip; with ``--store-mbit`` the bodies also cross one
link of that bandwidth each way, one after another). Per round trip, the modes
alternate (fixed, bdp, fixed, bdp, ...) for ``--reps`` repetitions; each
sample reads all N objects as hits are read (batches of ``--batch-chunks``),
checks every byte against what was written, and records the seconds and the
window the store ended on. Medians, min-max and the bdp/fixed ratio are
printed and written to ``benchmarks/results/store-window-rtt.{json,png}``
(``store-window-rtt-link.{json,png}``: ``make bench-store-window-link``, the same on a 200 Mbit/s link).

What limits the figures: at 0 ms the relay and SeaweedFS share the machine's
two cores with the client (CPU-bound, both modes alike); with a round trip and
no ``--store-mbit`` the relay adds no bandwidth limit, so a larger window keeps
paying up to its ceiling (``io_threads``); with one, the link's bandwidth is
what a larger window can fill and no more.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # dualpath_dev: the checkout's dev scaffolding
from _common import (  # noqa: E402
    bar_chart,
    exit_on_sigterm,
    markdown_table,
    median,
    result_payload,
    run_and_report,
)

from dualpath_connector.cli import parse_size  # noqa: E402
from nixl_backends.buffers import HostBufferPool  # noqa: E402
from nixl_backends.layout import BlockLayout, chunk_key  # noqa: E402
from nixl_backends.registry import make_store, parse_store_config  # noqa: E402

NUM_LAYERS = 4
MODES = {"fixed": {"io_window_min": 8, "io_threads": 8}, "bdp": {"io_window_min": 8, "io_threads": 32}}
MB = 1e6


class ModeReader:
    """One mode's agent, store (through the relay) and pool; reads every object into the pool and checks it."""

    def __init__(self, mode: str, section: dict, layout: BlockLayout, count: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(f"bench-window-{mode}-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=[]))
        self.store = make_store(parse_store_config({**section, **MODES[mode]}), layout, self.agent)
        self.pool = HostBufferPool(self.agent, layout.object_bytes, count)
        self.layout = layout

    def read(self, keys: list[str], expected: np.ndarray, batch: int) -> float:
        """Seconds to read ``keys`` in batches; raises unless every object arrived byte for byte."""
        view = self.pool.array[: len(keys) * self.pool.slot_stride].reshape(len(keys), -1)
        view[:] = 0xA5  # poison: a read that moved nothing cannot pass
        started = time.perf_counter()
        for b in range(0, len(keys), batch):
            ok = self.store.read(keys[b : b + batch], [self.pool.slot_addr(s) for s in range(b, min(len(keys), b + batch))])
            if not all(ok):
                raise RuntimeError(f"{ok.count(False)} of {len(ok)} reads failed")
        took = time.perf_counter() - started
        if not np.array_equal(view[:, : self.layout.object_bytes], expected):
            raise RuntimeError("bytes read differ from bytes written")
        return took

    def close(self) -> None:
        self.pool.close()
        self.store.close()


def run(args: argparse.Namespace) -> dict:
    from dualpath_dev.s3_relay import S3RelayProcess
    from dualpath_dev.seaweedfs import SeaweedFS

    layout = BlockLayout(num_layers=NUM_LAYERS, layer_block_bytes=parse_size(args.chunk_size) // NUM_LAYERS)
    bucket = f"bench-window-{uuid.uuid4().hex[:8]}"
    samples: list[dict] = []
    with contextlib.ExitStack() as stack:
        server = SeaweedFS().start()
        stack.callback(server.stop)
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-window-")))
        relay = S3RelayProcess(server.endpoint, logs / "relay.log").start()
        stack.callback(relay.stop)
        relay.set_rate(args.store_mbit)
        direct = server.store_config(bucket)
        # The objects, written once straight to the server (the writer's own agent, closed after).
        rng = np.random.default_rng(args.seed)
        keys = [chunk_key("bench", "c" * 32, rng.bytes(32).hex()) for _ in range(args.chunks)]
        writer = ModeReader("fixed", direct, layout, args.chunks)
        source = writer.pool.array[: args.chunks * writer.pool.slot_stride].reshape(args.chunks, -1)
        source[:] = rng.integers(0, 256, size=source.shape, dtype=np.uint8)
        if not all(writer.store.write(keys, [writer.pool.slot_addr(s) for s in range(args.chunks)])):
            raise RuntimeError("writing the objects failed")
        expected = source[:, : layout.object_bytes].copy()
        writer.close()
        relayed = {**direct, "endpoint": relay.endpoint, "create_bucket": False}
        readers = {mode: ModeReader(mode, relayed, layout, args.chunks) for mode in MODES}
        for reader in readers.values():
            stack.callback(reader.close)
        for rtt_ms in args.store_rtt_ms:
            relay.set_delay(rtt_ms)
            for mode, reader in readers.items():  # one unmeasured read per mode: the window measures this link
                reader.read(keys, expected, args.batch_chunks)
            for rep in range(args.reps):
                for mode, reader in readers.items():
                    seconds = reader.read(keys, expected, args.batch_chunks)
                    samples.append({"store_rtt_ms": rtt_ms, "mode": mode, "rep": rep, "seconds": seconds,
                                    "window_after": reader.store.window.size()})  # fmt: skip
                    print(f"{rtt_ms:g} ms {mode}: {seconds:.3f}s window {samples[-1]['window_after']}", file=sys.stderr)
    return result_payload(args, object_bytes=layout.object_bytes, samples=samples, rows=summarize(args, layout, samples))


def summarize(args: argparse.Namespace, layout: BlockLayout, samples: list[dict]) -> list[dict]:
    rows = []
    total = args.chunks * layout.object_bytes
    for rtt_ms in args.store_rtt_ms:
        row: dict = {"store_rtt_ms": rtt_ms}
        for mode in MODES:
            seconds = [s["seconds"] for s in samples if s["store_rtt_ms"] == rtt_ms and s["mode"] == mode]
            windows = [s["window_after"] for s in samples if s["store_rtt_ms"] == rtt_ms and s["mode"] == mode]
            row[mode] = {"seconds_median": median(seconds), "seconds_min": min(seconds), "seconds_max": max(seconds),
                         "MBps_median": total / median(seconds) / MB, "window_median": median(windows), "reps": len(seconds)}
        row["bdp_over_fixed"] = row["bdp"]["seconds_median"] / row["fixed"]["seconds_median"]
        rows.append(row)
    return rows


def table(payload: dict) -> str:
    cfg = payload["config"]
    rows = [[f"{r['store_rtt_ms']:g}",
             *[f"{r[m]['seconds_median']:.3f} ({r[m]['seconds_min']:.3f}-{r[m]['seconds_max']:.3f})" for m in MODES],
             *[f"{r[m]['MBps_median']:.0f}" for m in MODES], f"{r['bdp']['window_median']:g}",
             f"{r['bdp_over_fixed']:.2f}x"] for r in payload["rows"]]  # fmt: skip
    link = f" and a {cfg['store_mbit']:g} Mbit/s link each way" if cfg.get("store_mbit") else ""
    caption = (f"Reading {cfg['chunks']} chunk objects of {payload['object_bytes']} bytes from SeaweedFS through a "
               f"relay adding the round trip to every request{link} (batches of {cfg['batch_chunks']}, every byte "
               f"checked); median (min-max) of {cfg['reps']} repetitions, modes interleaved. fixed: 8 requests in "
               f"flight; bdp: from 8 up to 32, sized from the link's measured bandwidth-delay product. "
               f"{payload['environment']['cpu_count']}-core machine, relay and server on it.")
    headers = ["RTT ms", "fixed s", "bdp s", "fixed MB/s", "bdp MB/s", "bdp window", "bdp / fixed time"]
    return markdown_table(headers, rows, caption)


def chart(payload: dict, path: Path) -> Path | None:
    rows = payload["rows"]
    mbit = payload["config"].get("store_mbit")
    return bar_chart(path, [f"{r['store_rtt_ms']:g} ms" for r in rows],
                     {mode: [r[mode]["MBps_median"] for r in rows] for mode in MODES}, "store round trip",
                     "s3 store reads at a store round trip" + (f", {mbit:g} Mbit/s link" if mbit else ""),
                     ylabel="read MB/s (median)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store-rtt-ms", type=float, nargs="+", default=[0.0, 5.0, 20.0])
    parser.add_argument("--store-mbit", type=float, default=0.0,
                        help="the store link's bandwidth each way, Mbit/s (0: none, the round trip only)")
    parser.add_argument("--chunk-size", default="64KiB", help="one chunk object's KV bytes")
    parser.add_argument("--chunks", type=int, default=512, help="objects read per sample")
    parser.add_argument("--batch-chunks", type=int, default=256, help="objects per store read (one hit's)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="store-window-rtt.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    exit_on_sigterm()
    run_and_report(run, table, args, args.output, chart)


if __name__ == "__main__":
    main()
