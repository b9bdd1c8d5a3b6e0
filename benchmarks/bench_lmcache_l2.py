"""LMCache L2 adapters side by side on one SeaweedFS: ours (nixl_backends.lmcache_l2, NIXL OBJ) vs LMCache's s3.

Both adapters are driven by LMCache's own ``lmcache bench l2`` runners (``bench_store``, ``bench_lookup``,
``bench_load``: one producer submits a task of N keys, waits on the adapter's eventfd) on the same
SeaweedFS, for each object (chunk) size; every repetition stores fresh keys, looks them up, loads them into
zeroed buffers and checks the bytes against what was stored (no figure is ever reported for wrong data).
Around every store and load it also counts CPU seconds per MB moved by process (this one with the adapter under
test, the relay, the S3 server): on a few shared cores a rate swings by more than CPU per MB does.

Why our own harness around LMCache's runners and not the ``lmcache bench l2`` command: the built-in s3
adapter only speaks virtual-hosted addressing (``s3_endpoint`` is the Host header, ``<bucket>.<host>``),
and ``<bucket>.127.0.0.1`` does not resolve here. What works against 127.0.0.1 is
``s3_endpoint: "127.0.0.1:PORT"`` (no bucket in the host) with the bucket as the first component of the
object name, which that adapter builds as ``<model_name>@<rank>@<group>@<hash>`` and URL-quotes keeping
``/``: so keys whose model name is ``<bucket>/<model>`` land in ``<bucket>`` path-style. The command makes
its keys with the fixed model name ``bench-model``; the runners take our keys.

``--server versitygw --store-rtt-ms 0 5 20``: both adapters over TLS to the second S3 server, through an S3
relay (``dualpath_dev.s3_relay``, a process of its own) that serves TLS with its own per-run CA and delays
every request by the round trip; the round trips are measured one after another, the adapters interleaved
within each. LMCache's s3 adapter (AWS CRT) trusts only the system's CA bundle and takes no CA setting, so
the bench bind-mounts the relay's CA over that bundle: only inside a private mount namespace, which it
refuses to do without (``make bench-lmcache-l2-tls-rtt`` runs it under ``unshare --mount``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # dualpath_dev: the checkout's dev scaffolding
from _common import (  # noqa: E402
    bar_chart,
    environment,
    exit_on_sigterm,
    markdown_table,
    median,
    run_and_report,
    tree_cpu_s,
)

from dualpath_connector.cli import parse_size  # noqa: E402

MB = 1e6
KIB, MIB = 1024, 1024 * 1024
ADAPTERS = ("dualpath-s3", "lmcache-s3")
OPS = ("store", "lookup", "load")


def human(size: int) -> str:
    return f"{size // MIB} MiB" if size % MIB == 0 else f"{size // KIB} KiB"


@dataclass(frozen=True)
class Target:
    """Where the adapters send requests: the server itself, or the relay in front of it."""

    server: Any  # the S3Server (its keys, a client for buckets)
    endpoint: str  # http(s)://127.0.0.1:PORT
    ca_file: str | None  # what a client trusts, with https

    @property
    def host_port(self) -> str:
        return urlsplit(self.endpoint).netloc


def make_adapter(name: str, target: Target, bucket: str, variant: dict):
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.s3_l2_adapter import S3L2AdapterConfig

    from nixl_backends.lmcache_l2 import DualPathL2Adapter, DualPathL2AdapterConfig

    server = target.server
    if name == "dualpath-s3":
        # Credentials come from AWS_* in the environment (run() sets them): adapter_params refuse a secret.
        section = {"backend": "s3", "endpoint": target.endpoint, "bucket": bucket, **variant}
        if target.ca_file is not None:
            section["ca_bundle"] = target.ca_file
        return DualPathL2Adapter(DualPathL2AdapterConfig.from_dict({"store": section, "adopt_stored_objects": False}))
    server.client().create_bucket(Bucket=bucket)
    return create_l2_adapter(S3L2AdapterConfig.from_dict({
        "s3_endpoint": target.host_port, "s3_region": "us-east-1", "disable_tls": target.ca_file is None,
        "s3_prefer_http2": False, "aws_access_key_id": server.access_key, "aws_secret_access_key": server.secret_key,
    }))  # fmt: skip


# Where AWS CRT (LMCache's s3 adapter) looks for the system's CA bundle on Debian and Ubuntu.
SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def trust_in_this_mount_namespace(ca_file: str) -> None:
    """Make ``ca_file`` the system CA bundle for this process only: bind-mounted, in a private mount namespace."""
    import subprocess

    # The process that started this one (make, a shell) runs in the machine's mount namespace.
    if os.stat("/proc/self/ns/mnt").st_ino == os.stat(f"/proc/{os.getppid()}/ns/mnt").st_ino:
        raise SystemExit("LMCache's s3 adapter over TLS trusts only the system CA bundle: run this bench in a "
                         "mount namespace of its own (unshare --mount --propagation private ...; "
                         "make bench-lmcache-l2-tls-rtt), never over the machine's bundle")  # fmt: skip
    subprocess.run(["mount", "--bind", ca_file, SYSTEM_CA_BUNDLE], check=True)


def staging_rate(size: int, total: int) -> float:
    """GB/s of what our adapter adds per stored object in host memory: a memcpy into the slot and its seal."""
    from nixl_backends.integrity import ChunkIntegrity, integrity_key_from_env
    from nixl_backends.layout import BlockLayout

    layout = BlockLayout(1, size)
    integrity = ChunkIntegrity(layout, integrity_key_from_env("keyed", ""))  # the adapter's default mode
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    slot = np.zeros(layout.object_bytes, dtype=np.uint8)
    count = max(1, total // size)
    start = time.perf_counter()
    for _ in range(count):
        np.copyto(slot[:size], src)
        integrity.seal("ab" * 32, slot)
    return count * size / (time.perf_counter() - start) / 1e9


class CpuMeter:
    """CPU seconds used so far by the processes a run's figures depend on: this one (the adapter under test, its
    threads), the relay (when there is one) and the S3 server. All share the machine's cores, so a throughput
    that stops growing is read against where the CPU went."""

    def __init__(self, server: Any, relay: Any = None) -> None:
        self.server, self.relay = server, relay

    def read(self) -> dict[str, float]:
        # This process without its children (the server and the relay are those).
        seconds = {"client": tree_cpu_s(os.getpid(), descendants=False)}
        if self.relay is not None:
            seconds["relay"] = float(self.relay.stats()["cpu_s"])
        seconds["server"] = tree_cpu_s(self.server.proc.pid)
        return seconds


class AdapterRun:
    """One adapter at one object size: its bucket, buffers and samples; rounds are run by the caller, so the
    adapters' rounds interleave (A B, then B A, ...) and drift on the machine reaches both alike."""

    def __init__(self, name: str, target: Target, size: int, num_keys: int, variant: dict, kv_ranks: int,
                 meter: CpuMeter) -> None:  # fmt: skip
        from lmcache.cli.commands.bench.l2_adapter_bench import data

        self.server, self.size, self.num_keys, self.kv_ranks = target.server, size, num_keys, kv_ranks
        self.meter = meter
        # Each variant of our adapter's store section is an adapter of its own in the table.
        self.name = " ".join([name, *(f"{k}={v}" for k, v in variant.items())])
        self.bucket = f"bench-{name.split('-')[0]}-{uuid.uuid4().hex[:8]}"
        self.adapter = make_adapter(name, target, self.bucket, variant)
        self.stored_buf = data.make_aligned_tensor(num_keys * size, 4096)
        self.stored = data.make_memory_objects(self.stored_buf, num_keys, size, 0)
        self.loaded_buf = data.make_aligned_tensor(num_keys * size, 4096)
        self.loaded = data.make_memory_objects(self.loaded_buf, num_keys, size, 0)
        self.samples: dict[str, list[float]] = {op: [] for op in OPS}
        # CPU seconds per process, summed over the counted rounds' stores and loads.
        self.cpu_s: dict[str, collections.Counter[str]] = {op: collections.Counter() for op in ("store", "load")}

    def round(self, r: int, counted: bool) -> None:
        import torch
        from lmcache.cli.commands.bench.l2_adapter_bench import data, runner

        quiet = lambda _line: None  # noqa: E731
        name, size, num_keys, adapter = self.name, self.size, self.num_keys, self.adapter
        # Fresh keys and fresh random bytes every round: every store is a real PUT of new data.
        keys = data.make_object_keys(num_keys, model_name=f"{self.bucket}/bench", key_offset=r * num_keys)
        if self.kv_ranks:
            # LMCache's generator gives every key a rank of its own; a deployment's keys share its few ranks.
            keys = [dataclasses.replace(key, kv_rank=i % self.kv_ranks) for i, key in enumerate(keys)]
        self.stored_buf.copy_(torch.randint(0, 256, (num_keys * size,), dtype=torch.uint8))
        self.loaded_buf.zero_()
        results, used = {}, {}
        for op, bench in (
            ("store", lambda: runner.bench_store(adapter, 1, num_keys, size, 1, lambda _: [keys],
                                                 lambda _: [self.stored], quiet)),
            ("lookup", lambda: runner.bench_lookup(adapter, 1, num_keys, 1, lambda _: [keys], quiet)),
            ("load", lambda: runner.bench_load(adapter, 1, num_keys, size, 1, lambda _: [keys],
                                               lambda _: [self.loaded], quiet)),
        ):  # fmt: skip
            before = self.meter.read()
            results[op] = bench()
            after = self.meter.read()
            used[op] = {who: after[who] - before[who] for who in before}
        adapter.submit_unlock(keys)  # the lookup locked them
        for op, result in results.items():
            if result.timed_out_rounds or result.success_counts != [num_keys]:
                raise RuntimeError(f"{name} {op} of {num_keys} x {human(size)}: {result.success_counts} succeeded")
        if not torch.equal(self.stored_buf, self.loaded_buf):
            raise RuntimeError(f"{name}: loaded bytes differ from the stored ones ({human(size)})")
        if counted:
            for op, result in results.items():
                self.samples[op].append(result.round_durations[0])
            for op, counter in self.cpu_s.items():
                counter.update(used[op])

    def finish(self) -> dict:
        try:
            status = self.adapter.report_status()
        finally:
            self.adapter.close()
            with contextlib.suppress(Exception):
                client = self.server.client()
                for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
                    objects = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                    if objects:
                        client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects})
        out: dict = {"adapter": self.name, "chunk_bytes": self.size, "num_keys": self.num_keys,
                     "samples_s": self.samples,
                     "adapter_status": {k: v for k, v in status.items() if isinstance(v, (int, float, str, bool))}}  # fmt: skip
        for op in OPS:
            seconds = median(self.samples[op])
            out[f"{op}_chunks_per_s"] = self.num_keys / seconds
            # Spread: the rates of the slowest and the fastest repetition.
            out[f"{op}_chunks_per_s_range"] = [self.num_keys / max(self.samples[op]), self.num_keys / min(self.samples[op])]
            if op != "lookup":
                moved_mb = self.num_keys * self.size * len(self.samples[op]) / MB
                out[f"{op}_cpu_ms_per_MB"] = {who: 1000 * cpu / moved_mb for who, cpu in self.cpu_s[op].items()}
                out[f"{op}_MBps"] = self.num_keys * self.size / seconds / MB
                out[f"{op}_MBps_range"] = [self.num_keys * self.size / max(self.samples[op]) / MB,
                                           self.num_keys * self.size / min(self.samples[op]) / MB]
        return out


def measure(names: list[str], target: Target, size: int, num_keys: int, reps: int, warmup: int,
            variants: list[dict], meter: CpuMeter, kv_ranks: int = 0) -> list[dict]:
    """Every adapter at one size (ours once per store-section variant), rounds interleaved: A B C, C B A, ...
    (warm-up rounds first, discarded)."""
    runs = [AdapterRun(name, target, size, num_keys, variant, kv_ranks, meter) for name in names
            for variant in (variants if name == "dualpath-s3" else [{}])]  # fmt: skip
    try:
        for r in range(warmup + reps):
            for run in runs if r % 2 == 0 else runs[::-1]:
                run.round(r, counted=r >= warmup)
    finally:
        results = [run.finish() for run in runs]
    return results


def run(args: argparse.Namespace) -> dict:
    import secrets
    import tempfile

    from dualpath_dev.s3_relay import S3RelayProcess
    from dualpath_dev.seaweedfs import SeaweedFS
    from dualpath_dev.tls import make_server_tls
    from dualpath_dev.versitygw import VersityGW
    from nixl_backends.integrity import INTEGRITY_KEY_ENV

    sizes = [parse_size(s) for s in args.chunk_sizes]
    total = parse_size(args.total)
    results, staging = [], {}
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-lmcache-l2-")))
        server = (VersityGW if args.server == "versitygw" else SeaweedFS)(workdir / args.server).start()
        stack.callback(server.stop)
        os.environ.update(AWS_ACCESS_KEY_ID=server.access_key, AWS_SECRET_ACCESS_KEY=server.secret_key)
        # Our adapter's default integrity ("keyed") takes its secret from the environment: one per run.
        os.environ.setdefault(INTEGRITY_KEY_ENV, secrets.token_hex(16))
        print(f"S3 ({args.server}) on {server.endpoint}", file=sys.stderr)
        target = Target(server, server.endpoint, getattr(server, "ca_bundle", None))
        relay = None
        if args.store_rtt_ms != [0.0]:
            # TLS on both hops: the relay's own certificate to the clients, the server's CA to verify upstream.
            tls = make_server_tls(workdir / "relay-tls", ["127.0.0.1"]) if target.ca_file is not None else None
            relay = stack.enter_context(S3RelayProcess(server.endpoint, workdir / "relay.log", tls=tls,
                                                       upstream_ca=target.ca_file))  # fmt: skip
            target = Target(server, relay.endpoint, None if tls is None else str(tls.ca_file))
        if target.ca_file is not None and "lmcache-s3" in args.adapters:
            trust_in_this_mount_namespace(target.ca_file)
        for rtt_ms in args.store_rtt_ms:
            if relay is not None:
                relay.set_delay(rtt_ms)
            for size in sizes:
                num_keys = max(1, total // size)
                staging[size] = staging_rate(size, total)
                print(f"{', '.join(args.adapters)} interleaved: {num_keys} x {human(size)}, store round trip "
                      f"{rtt_ms:g} ms, {args.reps} repetitions ...", file=sys.stderr)  # fmt: skip
                measured = measure(args.adapters, target, size, num_keys, args.reps, args.warmup, args.variants,
                                   CpuMeter(server, relay), args.kv_ranks)  # fmt: skip
                results += [dict(r, store_rtt_ms=rtt_ms) for r in measured]
        requests = relay.requests() if relay is not None else None
    return {"config": vars(args) | {"chunk_bytes": sizes, "total_bytes": total, "tls": target.ca_file is not None},
            "environment": environment(), "staging_GBps": {str(k): v for k, v in staging.items()},
            "relay_requests": requests, "results": results}  # fmt: skip


def _rtts(payload: dict) -> list[float]:
    return list(dict.fromkeys(r.get("store_rtt_ms", 0.0) for r in payload["results"]))


def table(payload: dict) -> str:
    by_key = {(r["adapter"], r["chunk_bytes"], r.get("store_rtt_ms", 0.0)): r for r in payload["results"]}
    adapters = list(dict.fromkeys(r["adapter"] for r in payload["results"]))
    rtts = _rtts(payload)
    headers = ["chunk", "keys/task", *(["store RTT ms"] if rtts != [0.0] else []), "adapter", "store MB/s",
               "store chunks/s", "load MB/s", "load chunks/s", "lookup keys/s"]  # fmt: skip
    rows = []
    for rtt in rtts:
        for size in payload["config"]["chunk_bytes"]:
            for name in adapters:
                r = by_key[(name, size, rtt)]
                spread = lambda key: "[{:.0f}-{:.0f}]".format(*r[key])  # noqa: E731
                rows.append([human(size), r["num_keys"], *([f"{rtt:g}"] if rtts != [0.0] else []), name,
                             f"{r['store_MBps']:.0f} {spread('store_MBps_range')}", f"{r['store_chunks_per_s']:.0f}",
                             f"{r['load_MBps']:.0f} {spread('load_MBps_range')}", f"{r['load_chunks_per_s']:.0f}",
                             f"{r['lookup_chunks_per_s']:.0f} {spread('lookup_chunks_per_s_range')}"])  # fmt: skip
    cfg = payload["config"]
    staging = ", ".join(f"{human(int(k))} {v:.1f}" for k, v in payload["staging_GBps"].items())
    server = cfg.get("server", "seaweedfs")
    where = (f"one {server} (127.0.0.1{', over TLS' if cfg.get('tls') else ''}"
             + (f", every request delayed by the store round trip at an S3 relay" if rtts != [0.0] else "") + ")")
    caption = (
        f"LMCache L2 adapters on {where}, {payload['environment']['cpu_count']}-core machine shared "
        f"with the client, driven by LMCache's `lmcache bench l2` runners: one task of all keys per operation, "
        f"median of {cfg['reps']} repetitions after {cfg['warmup']} warm-up, the adapters' rounds interleaved "
        f"(A B, B A, ...), [slowest-fastest] repetition in brackets, {human(cfg['total_bytes'])} per task, "
        + (f"keys over {cfg['kv_ranks']} KV rank(s), " if cfg.get("kv_ranks") else "a KV rank per key, ") +
        f"MB = 10^6 bytes, every load checked byte for byte. Our adapter's own host-memory work per object "
        f"(memcpy into a registered slot + the keyed BLAKE3 seal, its default), GB/s: {staging}."
    )
    text = markdown_table(headers, rows, caption)
    if set(adapters) >= set(ADAPTERS) and len(adapters) == 2:
        ratio_rows = [[f"{rtt:g}", human(size)] + [
            f"{by_key[('dualpath-s3', size, rtt)][f'{op}_MBps'] / by_key[('lmcache-s3', size, rtt)][f'{op}_MBps']:.2f}x"
            for op in ("store", "load")] for rtt in rtts for size in cfg["chunk_bytes"]]  # fmt: skip
        text += "\n\n" + markdown_table(["store RTT ms", "chunk", "store: ours / LMCache's", "load: ours / LMCache's"],
                                          ratio_rows, "Ours over LMCache's s3 adapter, medians of the same run.")
    if all("store_cpu_ms_per_MB" in r for r in payload["results"]):
        text += "\n\n" + cpu_table(payload, adapters, rtts)
    return text


def cpu_table(payload: dict, adapters: list[str], rtts: list[float]) -> str:
    """CPU milliseconds per MB moved, by process: what each adapter costs the machine whatever its rate."""
    by_key = {(r["adapter"], r["chunk_bytes"], r.get("store_rtt_ms", 0.0)): r for r in payload["results"]}
    who = list(dict.fromkeys(w for r in payload["results"] for w in r["store_cpu_ms_per_MB"]))
    rows = [[f"{rtt:g}", human(size), name,
             *(f"{by_key[(name, size, rtt)][f'{op}_cpu_ms_per_MB'][w]:.2f}" for op in ("store", "load") for w in who)]
            for rtt in rtts for size in payload["config"]["chunk_bytes"] for name in adapters]  # fmt: skip
    return markdown_table(
        ["store RTT ms", "chunk", "adapter", *(f"{op}: {w} CPU ms/MB" for op in ("store", "load") for w in who)], rows,
        "CPU per MB moved, summed over the counted repetitions' tasks: client = this process (the adapter under "
        "test and its threads; the other adapter idle), relay = the S3 relay's process, server = the S3 server's "
        "process; all on the same cores.")  # fmt: skip


def chart(payload: dict, path: Path) -> Path | None:
    sizes = payload["config"]["chunk_bytes"]
    rtts = _rtts(payload)
    by_key = {(r["adapter"], r["chunk_bytes"], r.get("store_rtt_ms", 0.0)): r for r in payload["results"]}
    adapters = list(dict.fromkeys(r["adapter"] for r in payload["results"]))
    groups = [(s, rtt) for rtt in rtts for s in sizes]
    labels = [human(s) if rtts == [0.0] else f"{human(s)}, {rtt:g} ms" for s, rtt in groups]
    series = {f"{a} {op}": [by_key[(a, s, rtt)][f"{op}_MBps"] for s, rtt in groups]
              for op in ("store", "load") for a in adapters}  # fmt: skip
    return bar_chart(path, labels, series, "object (chunk) size" + ("" if rtts == [0.0] else ", store round trip"),
                     "LMCache L2 adapters: store and load", ylabel="MB/s")  # fmt: skip


def _variant(text: str) -> dict:
    """``key=value[,key=value]``: values parsed as JSON where they are (numbers, booleans), else strings."""
    import json

    variant = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--variants takes key=value settings, got {item!r}")
        try:
            variant[key] = json.loads(value)
        except ValueError:
            variant[key] = value
    return variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-sizes", nargs="+", default=["512KiB", "2MiB", "8MiB"],
                        help="object sizes (an LMCache chunk of 256 tokens: 512 KiB for the tiny test Llama, "
                             "32 MiB for an 8B model at TP 1)")  # fmt: skip
    parser.add_argument("--total", default="64MiB", help="bytes per task (keys per task = total / size)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="discarded repetitions first")
    parser.add_argument("--adapters", nargs="+", choices=ADAPTERS, default=list(ADAPTERS))
    parser.add_argument("--variants", type=_variant, nargs="+", default=[{}],
                        help="settings of our adapter's s3 store section, one adapter of ours per variant, all "
                             "interleaved, e.g. io_threads=16 request_checksum_calculation=when_required "
                             "(join several settings of one variant with commas; default: the store's defaults)")
    parser.add_argument("--server", choices=("seaweedfs", "versitygw"), default="seaweedfs",
                        help="the S3 server (versitygw: over TLS, its CA per run)")
    parser.add_argument("--store-rtt-ms", type=float, nargs="+", default=[0.0],
                        help="store round trips to measure at, one after another (an S3 relay delays each request)")
    parser.add_argument("--kv-ranks", type=int, default=0,
                        help="spread each task's keys over this many KV ranks (a deployment's: its workers); "
                             "0: a rank per key, as LMCache's bench key generator makes them")
    parser.add_argument("--output", default="lmcache_l2.json", help="file name under benchmarks/results/")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 sizes, 8 MiB, 2 repetitions")
    args = parser.parse_args()
    if args.quick:
        args.chunk_sizes, args.total, args.reps = ["512KiB", "2MiB"], "8MiB", 2
        if args.output == "lmcache_l2.json":
            args.output = "lmcache_l2-quick.json"
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.kv_ranks < 0:
        parser.error(f"--kv-ranks must be at least 0, got {args.kv_ranks}")
    exit_on_sigterm()
    import nixl._api  # noqa: F401  (sets up NIXL's logging, which prints INFO lines to stdout)

    logging.getLogger("nixl").setLevel(logging.WARNING)
    run_and_report(run, table, args, args.output, chart)


if __name__ == "__main__":
    main()
