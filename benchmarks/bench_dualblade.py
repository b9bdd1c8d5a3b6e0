"""Chunk-run read latency under a cgroup memory limit: page-cache-only POSIX vs direct-only vs Dual-Blade.

For every memory limit (``--limits-mib``) and store, one worker process runs
inside a fresh child memory cgroup of this process's own (v1
``memory.limit_in_bytes``, or v2 ``memory.max`` on a pure-v2 host) with that
limit, so its page cache is squeezed the way a serving node's is:

- ``posix``: the page-cache-only baseline (one file per chunk, buffered I/O);
- ``direct``: the ``dualblade`` store with ``page_cache_bytes=0`` (everything
  through ``O_DIRECT`` except each object's unaligned tail);
- ``dualblade``: ``page_cache_bytes=None``, the budget measured in the cgroup,
  split by Algorithm 1 (the front ``n1`` layers of every chunk);
- ``ranked``: the same budget, ``residency: ranked`` (the ranker's hottest
  chunks whole in the page cache, every other chunk direct).

A worker writes a working set larger than every limit (``--working-set-mib``
of 32 x 32 KiB-Layer-Block chunks, about 1 MiB each, 16 chunks per write),
calls ``replan()`` (dualblade stores), then times ``--reads`` requests, each
one ``store.read`` of a run of ``--run-length`` consecutive chunks (a prompt
hit). Runs are drawn Zipf-like (``--zipf``) over a seeded permutation of the
runs, the same sequence for every store; the permutation keeps the hot runs
independent of write order, so no store starts with them cached by accident.
Every chunk read must return True and carry its index at the start of every
Layer Block and at the end of the object (one stamp on each I/O path); a
mismatch fails the run. Reported per run: p50/p99/p99.9 latency, MB/s (bytes
read / read-phase wall time), the worker's device reads in the read phase
(``/proc/self/io`` ``read_bytes``) and the page-cache hit ratio derived from
them, the cgroup's page cache at the end, and the Dual-Blade gauges and
counters. A worker the kernel OOM-kills is recorded as ``oom``.

What limits the figures: the disk is a virtual disk (``/dev/vda``) whose host
may cache it, so "device" reads may be served from the host's memory; the 2
cores are shared with other work (the load average is recorded); cgroup v1
charges a page to the cgroup that first touched it and counts mapped library
pages (the worker's Python, numpy and NIXL) as its page cache too; the
worker's own memory (~100 MB resident, ``worker_peak_rss_bytes``) counts
against every limit. Dual-Blade checks an xxh3 checksum of every object it
reads; the POSIX store does not (that cost is part of its figures). The
page cache is dropped between runs (``drop_caches``) where writable; the JSON
says when it was not. With a few hundred reads, p99.9 is close to the maximum.
Results: ``benchmarks/results/dualblade.{json,png}`` (``dualblade-quick.*``
with ``--quick``).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from _common import (  # noqa: E402
    REPO_ROOT, bar_chart, exit_on_sigterm, markdown_table, result_payload, run_and_report,
)

MIB = 1 << 20
MB = 1e6  # throughput in MB/s (10^6 bytes per second)
STORES = ("posix", "direct", "dualblade", "ranked")
BLADES = ("dualblade", "ranked")  # compared against the single paths
WRITE_BATCH = 16  # chunks per store.write in the fill phase
RESULT_MARKER = "BENCH-DUALBLADE-RESULT "  # NIXL may print to the worker's stdout too
NOISE = 0.10  # "no worse" tolerates this much for p99 and throughput
GOAL_P99_RATIO = 3.0  # the issue's goal: posix p99 / dualblade p99 at the tightest limit
CGROUP_FS = Path("/sys/fs/cgroup")


# --- memory cgroups -----------------------------------------------------------------------------


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _read_keyed(path: Path) -> dict[str, int]:
    """``key value`` lines (memory.stat, memory.events, memory.oom_control); {} when unreadable."""
    out: dict[str, int] = {}
    for line in (_read_text(path) or "").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("-").isdigit():
            out[fields[0]] = int(fields[1])
    return out


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    return int(text) if text is not None and text.strip().isdigit() else None


@dataclass(frozen=True)
class Cgroup:
    """One child memory cgroup: the worker joins it before exec, the parent removes it after."""

    version: Literal["v1", "v2"]
    path: Path

    def join(self) -> None:
        """Move the calling process in (run as the worker's ``preexec_fn``: before any of its I/O)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def stats(self) -> dict[str, int | None]:
        """How often the limit was hit, OOM kills, peak usage, page cache now (None where not exposed)."""
        if self.version == "v1":
            stat = _read_keyed(self.path / "memory.stat")
            return {
                "limit_hits": _read_int(self.path / "memory.failcnt"),
                "oom_kills": _read_keyed(self.path / "memory.oom_control").get("oom_kill"),
                "peak_bytes": _read_int(self.path / "memory.max_usage_in_bytes"),
                "page_cache_bytes": stat.get("total_cache"),
            }
        events = _read_keyed(self.path / "memory.events")
        return {
            "limit_hits": events.get("max"),
            "oom_kills": events.get("oom_kill"),
            "peak_bytes": _read_int(self.path / "memory.peak"),
            "page_cache_bytes": _read_keyed(self.path / "memory.stat").get("file"),
        }

    def remove(self, timeout_s: float = 10.0) -> None:
        """rmdir once no process is left in it; a reaped worker can linger for a moment."""
        deadline = time.monotonic() + timeout_s
        while True:
            procs = _read_text(self.path / "cgroup.procs")
            if procs is None or not procs.strip():
                try:
                    self.path.rmdir()
                    return
                except FileNotFoundError:
                    return
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise
            if time.monotonic() > deadline:
                print(f"warning: could not remove cgroup {self.path} within {timeout_s:.0f}s; "
                      f"rmdir it by hand", file=sys.stderr)
                return
            time.sleep(0.02)


@dataclass(frozen=True)
class CgroupParent:
    """This process's own memory cgroup, under which the workers' cgroups are made."""

    version: Literal["v1", "v2"]
    path: Path

    def create(self, name: str, limit_bytes: int) -> Cgroup:
        path = self.path / name
        path.mkdir()
        cgroup = Cgroup(self.version, path)
        try:
            limit_file = "memory.limit_in_bytes" if self.version == "v1" else "memory.max"
            (path / limit_file).write_text(str(limit_bytes))
        except BaseException:
            cgroup.remove()
            raise
        return cgroup


def find_cgroup_parent() -> tuple[CgroupParent | None, str]:
    """Where worker cgroups can be made, and a note for the JSON ("v1 <path>" or "unavailable: <reason>")."""
    if os.geteuid() != 0:
        return None, "unavailable: not root (a child memory cgroup needs it)"
    paths: dict[str, str] = {}
    for line in (_read_text(Path("/proc/self/cgroup")) or "").splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            paths[controller] = path.lstrip("/")
    parent: CgroupParent | None = None
    # Hybrid hosts (v1 memory beside a v2 at unified/) charge memory to the v1 cgroup: prefer it, as the budgeter does.
    if "memory" in paths and (CGROUP_FS / "memory" / paths["memory"]).is_dir():
        parent = CgroupParent("v1", CGROUP_FS / "memory" / paths["memory"])
    elif "" in paths and "memory" in (_read_text(CGROUP_FS / paths[""] / "cgroup.controllers") or "").split():
        parent = CgroupParent("v2", CGROUP_FS / paths[""])
        if "memory" not in (_read_text(parent.path / "cgroup.subtree_control") or "").split():
            try:
                (parent.path / "cgroup.subtree_control").write_text("+memory")
            except OSError as exc:
                # v2 refuses controllers for children of a cgroup that holds processes itself (but the root).
                return None, f"unavailable: cannot enable the v2 memory controller under {parent.path}: {exc}"
    if parent is None:
        return None, "unavailable: no memory cgroup controller found for this process"
    try:  # a probe: mkdir, a limit, rmdir
        parent.create(f"dualblade-bench-{os.getpid()}-probe", 64 * MIB).remove()
    except OSError as exc:
        return None, f"unavailable: cannot create a child cgroup under {parent.path}: {exc}"
    return parent, f"{parent.version} {parent.path}"


def drop_page_cache() -> str | None:
    """Drop the previous run's leftovers from the page cache; None when done, else why not."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError as exc:
        return f"not dropped: {exc}"
    return None


# --- the worker (one store, inside its cgroup) ------------------------------------------------


def read_sequence(num_runs: int, reads: int, exponent: float, seed: int) -> np.ndarray:
    """Run indices of the read requests: Zipf-like ranks, mapped to runs by a seeded permutation."""
    rng = np.random.default_rng(seed)
    weights = np.arange(1, num_runs + 1, dtype=np.float64) ** -exponent
    hot_first = rng.permutation(num_runs)
    return hot_first[rng.choice(num_runs, size=reads, p=weights / weights.sum())]


def _peak_rss_bytes() -> int:
    """The worker's peak resident set (``VmHWM``): what any limit must leave room for besides page cache."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def worker(spec: dict) -> dict:
    """Fill one store with the working set and time the read sequence; the result for the parent."""
    from nixl._api import nixl_agent, nixl_agent_config

    from nixl_backends.buffers import HostBufferPool, align_up
    from nixl_backends.dualblade.budget import MemoryBudgeter, process_read_bytes
    from nixl_backends.layout import BlockLayout
    from nixl_backends.registry import make_store, parse_store_config

    logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines would go to stdout
    layout = BlockLayout(spec["chunk_layers"], spec["layer_bytes"])
    run_length, num_chunks = spec["run_length"], spec["num_chunks"]
    keys = [f"bench/{i % 256:02x}/{i:064x}" for i in range(num_chunks)]
    if spec["store"] == "posix":
        section: dict = {"backend": "posix", "root": spec["root"]}
    else:
        extent = align_up(layout.object_bytes)
        section = {"backend": "dualblade", "root": spec["root"], "capacity_bytes": num_chunks * extent,
                   "page_cache_bytes": 0 if spec["store"] == "direct" else None,
                   "residency": "ranked" if spec["store"] == "ranked" else "layers"}
    agent = nixl_agent(f"bench-dualblade-{os.getpid()}", nixl_agent_config(backends=[]))
    store = make_store(parse_store_config(section), layout, agent)  # before the pool: it creates the backend
    pool = None
    try:
        slots = max(WRITE_BATCH, run_length)
        pool = HostBufferPool(agent, layout.object_bytes, slots)
        pool.array[:] = np.random.default_rng(spec["seed"]).integers(0, 256, pool.array.size, dtype=np.uint8)
        # A stamp (the chunk's index) at the start of every Layer Block and at the object's end: every
        # I/O path of a split chunk (page-cache front, direct middle, page-cache tail) carries some.
        stamps = np.array([*(layer * layout.layer_block_bytes for layer in range(layout.num_layers)),
                           layout.object_bytes - 8]) // 8
        words = [pool.slot_view(s).view(np.int64) for s in range(slots)]
        addrs = [pool.slot_addr(s) for s in range(slots)]

        started = time.perf_counter()
        for first in range(0, num_chunks, WRITE_BATCH):
            batch = range(first, min(first + WRITE_BATCH, num_chunks))
            for slot, index in enumerate(batch):
                words[slot][stamps] = index
            if not all(store.write([keys[i] for i in batch], addrs[: len(batch)])):
                raise RuntimeError(f"{spec['store']}: a write of chunks {batch.start}..{batch.stop - 1} failed")
        write_seconds = time.perf_counter() - started
        if spec["store"] != "posix":
            store.replan()  # plan for the filled tier, not for the last interval's fill level

        sequence = read_sequence(num_chunks // run_length, spec["reads"], spec["zipf"], spec["seed"])
        latencies = []
        device_before = process_read_bytes()
        started = time.perf_counter()
        for run in sequence:
            chunks = range(run * run_length, (run + 1) * run_length)
            for slot in range(run_length):
                words[slot][stamps] = -1  # poison: a read that moved nothing cannot pass
            clock = time.perf_counter()
            ok = store.read([keys[i] for i in chunks], addrs[:run_length])
            latencies.append(time.perf_counter() - clock)
            if not all(ok):
                raise RuntimeError(f"{spec['store']}: {ok.count(False)} of {run_length} chunks of run {run} missed")
            for slot, index in enumerate(chunks):
                if not np.all(words[slot][stamps] == index):
                    raise RuntimeError(f"{spec['store']}: chunk {index} read back with wrong bytes "
                                       f"(stamps {words[slot][stamps].tolist()})")
        read_seconds = time.perf_counter() - started
        device_bytes = process_read_bytes() - device_before
        metrics = store.metrics()
        cgroup_page_cache = MemoryBudgeter().snapshot().page_cache_bytes
    finally:
        if pool is not None:
            pool.close()
        store.close()
    bytes_read = len(sequence) * run_length * layout.object_bytes
    # Bytes asked of the page cache (everything for posix), and what the device had to supply for them.
    direct = metrics.counters.get("local_tier_direct_bytes_read", 0)
    page_cache = metrics.counters.get("local_tier_page_cache_bytes_read", bytes_read - direct)
    missed = max(0, device_bytes - direct)
    p50, p99, p999 = np.percentile(np.array(latencies) * 1e3, [50, 99, 99.9])
    return {
        "status": "ok",
        "object_bytes": layout.object_bytes,
        "write_seconds": write_seconds,
        "write_MBps": num_chunks * layout.object_bytes / write_seconds / MB,
        "read_seconds": read_seconds,
        "bytes_read": bytes_read,
        "read_MBps": bytes_read / read_seconds / MB,
        "p50_ms": p50, "p99_ms": p99, "p99_9_ms": p999,
        "distinct_runs_read": len(set(sequence.tolist())),
        "device_bytes_read": device_bytes,
        # Readahead can pull more than was asked: then the ratio bottoms out at 0.
        "page_cache_hit_ratio": max(0.0, 1.0 - missed / page_cache) if page_cache else None,
        "cgroup_page_cache_bytes_end": cgroup_page_cache,
        "worker_peak_rss_bytes": _peak_rss_bytes(),
        "store_counters": metrics.counters,
        "store_gauges": metrics.gauges,
        "latencies_ms": [round(s * 1e3, 4) for s in latencies],
    }


# --- the parent ---------------------------------------------------------------------------------


def run_worker(args: argparse.Namespace, parent: CgroupParent | None, limit_mib: int | None, store: str,
               num_chunks: int, serial: int) -> dict:
    """One store at one limit: a fresh cgroup, store directory and worker; all removed afterwards."""
    dropped = drop_page_cache()
    root = args.workdir / f"{store}-{limit_mib or 'nolimit'}-{os.getpid()}"
    spec = {"store": store, "root": str(root), "num_chunks": num_chunks, "chunk_layers": args.chunk_layers,
            "layer_bytes": args.layer_kib * 1024, "run_length": args.run_length, "reads": args.reads,
            "zipf": args.zipf, "seed": args.seed}
    cgroup = None
    proc = None
    try:
        if parent is not None and limit_mib is not None:
            cgroup = parent.create(f"dualblade-bench-{os.getpid()}-{serial}", limit_mib * MIB)
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                                stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                                preexec_fn=cgroup.join if cgroup is not None else None)
        stdout, _ = proc.communicate(timeout=args.worker_timeout_s)
        stats = cgroup.stats() if cgroup is not None else {}
        result = next((json.loads(line[len(RESULT_MARKER):]) for line in stdout.splitlines()
                       if line.startswith(RESULT_MARKER)), None)
        if proc.returncode != 0 or result is None:
            if stats.get("oom_kills"):
                result = {"status": "oom"}
            else:
                raise RuntimeError(f"{store} worker at limit {limit_mib} MiB exited {proc.returncode} "
                                   f"(its stderr is above)")
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(root, ignore_errors=True)
    return {"limit_mib": limit_mib, "store": store, "drop_caches": dropped or "dropped", "cgroup_end": stats,
            **result}


def summarize(rows: list[dict], limits: list[int | None]) -> list[dict]:
    """Per limit and Dual-Blade variant: posix p99 / its p99, and it against the better of the two single paths."""
    out = []
    for limit in limits:
        by_store = {r["store"]: r for r in rows if r["limit_mib"] == limit and r["status"] == "ok"}
        alone = [by_store[s] for s in ("posix", "direct") if s in by_store]
        for variant in BLADES:
            blade = by_store.get(variant)
            if blade is None:
                continue
            entry: dict = {"limit_mib": limit, "variant": variant}
            if "posix" in by_store:
                entry["posix_over_dualblade_p99"] = by_store["posix"]["p99_ms"] / blade["p99_ms"]
            if len(alone) == 2:
                p99 = blade["p99_ms"] / min(r["p99_ms"] for r in alone)
                mbps = blade["read_MBps"] / max(r["read_MBps"] for r in alone)
                entry.update(p99_vs_best_alone=p99, MBps_vs_best_alone=mbps,
                             no_worse_than_either=p99 <= 1 + NOISE and mbps >= 1 - NOISE)
            out.append(entry)
    return out


def run(args: argparse.Namespace) -> dict:
    parent, cgroup_note = find_cgroup_parent()
    limits: list[int | None] = list(args.limits_mib) if parent is not None else [None]
    if parent is None:
        print(f"cgroup {cgroup_note}: running without memory limits", file=sys.stderr)
    object_bytes = args.chunk_layers * args.layer_kib * 1024 + args.chunk_layers * 16  # BlockLayout.object_bytes
    runs = max(1, round(args.working_set_mib * MIB / (args.run_length * object_bytes)))
    num_chunks = runs * args.run_length
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for limit in limits:
        for store in args.stores:
            print(f"limit {limit or 'none'} MiB, {store}: {num_chunks} chunks, {args.reads} reads ...", file=sys.stderr)
            row = run_worker(args, parent, limit, store, num_chunks, len(rows))
            if row["status"] == "ok":
                print(f"  p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, {row['read_MBps']:.0f} MB/s",
                      file=sys.stderr)
            else:
                print(f"  {row['status']}", file=sys.stderr)
            rows.append(row)
    not_dropped = [r["drop_caches"] for r in rows if r["drop_caches"] != "dropped"]
    return result_payload(
        args, cgroup=cgroup_note, drop_caches=not_dropped[0] if not_dropped else "dropped before every run",
        working_set={"chunks": num_chunks, "runs": runs, "object_bytes": object_bytes,
                     "bytes": num_chunks * object_bytes},
        runs=rows, summary=summarize(rows, limits))


def _limit_label(limit: int | None) -> str:
    return f"{limit} MiB" if limit is not None else "none"


def table(payload: dict) -> str:
    rows = []
    for r in payload["runs"]:
        if r["status"] != "ok":
            rows.append([_limit_label(r["limit_mib"]), r["store"], r["status"], *["-"] * 7])
            continue
        hit = r["page_cache_hit_ratio"]
        rows.append([
            _limit_label(r["limit_mib"]), r["store"], f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
            f"{r['p99_9_ms']:.1f}", f"{r['read_MBps']:.0f}", f"{r['device_bytes_read'] / MB:.0f}",
            f"{hit * 100:.0f}" if hit is not None else "-",
            r["store_gauges"].get("local_tier_page_cache_layers", "-"),
            f"{r['cgroup_page_cache_bytes_end'] / MIB:.0f}",
        ])
    cfg, ws = payload["config"], payload["working_set"]
    caption = (
        f"Chunk-run reads ({cfg['reads']} x {cfg['run_length']} chunks of {ws['object_bytes'] / MIB:.2f} MiB, "
        f"Zipf {cfg['zipf']} over {ws['runs']} runs) from a {ws['bytes'] / MIB:.0f} MiB working set, one worker per "
        f"row in a memory cgroup with the limit shown (cgroup: {payload['cgroup']}; page cache "
        f"{payload['drop_caches']}); {payload['environment']['cpu_count']} shared CPUs, load average "
        f"{payload['environment']['load_avg_at_start'][0]:.1f} at start; a virtual disk. 'device MB': the "
        f"worker's block-device reads in the read phase; 'hit %': page-cache requests served without them; "
        f"'n1': Dual-Blade's page-cache layers per chunk."
    )
    text = markdown_table(["limit", "store", "p50 ms", "p99 ms", "p99.9 ms", "MB/s", "device MB", "hit %", "n1",
                           "cgroup cache MiB"], rows, caption)
    summary_rows = []
    for s in payload["summary"]:
        ratio = s.get("posix_over_dualblade_p99")
        verdict = s.get("no_worse_than_either")
        summary_rows.append([
            _limit_label(s["limit_mib"]), s["variant"], f"{ratio:.2f}x" if ratio is not None else "-",
            f"{s['p99_vs_best_alone']:.2f}x" if "p99_vs_best_alone" in s else "-",
            f"{s['MBps_vs_best_alone']:.2f}x" if "MBps_vs_best_alone" in s else "-",
            "-" if verdict is None else ("yes" if verdict else "no"),
        ])
    tightest = min((s["limit_mib"] or 0 for s in payload["summary"]), default=None)
    goals = [f"{s['variant']} {'met' if s['posix_over_dualblade_p99'] >= GOAL_P99_RATIO else 'not met'} "
             f"({s['posix_over_dualblade_p99']:.2f}x)" for s in payload["summary"]
             if (s["limit_mib"] or 0) == tightest and "posix_over_dualblade_p99" in s]
    summary_caption = (
        f"Dual-Blade against the single paths. Goal: posix p99 / Dual-Blade p99 >= {GOAL_P99_RATIO:.0f}x at the "
        f"tightest limit: {', '.join(goals) or 'n/a (no posix and Dual-Blade figures there)'}; and no worse than "
        f"either path alone at any limit (p99 at most {1 + NOISE:.1f}x the better one's, MB/s at least "
        f"{1 - NOISE:.1f}x the better one's)."
    )
    return text + "\n\n" + markdown_table(
        ["limit", "variant", "posix p99 / its p99", "its p99 / best alone", "its MB/s / best alone",
         "no worse than either"], summary_rows, summary_caption)


def chart(payload: dict, path: Path) -> Path | None:
    limits = list(dict.fromkeys(r["limit_mib"] for r in payload["runs"]))
    series = {}
    for store in payload["config"]["stores"]:
        by_limit = {r["limit_mib"]: r for r in payload["runs"] if r["store"] == store}
        # An OOM-killed run has no figure: its bar is missing (nan), not zero.
        series[store] = [by_limit[limit].get("p99_ms", float("nan")) for limit in limits]
    return bar_chart(path, [_limit_label(limit) for limit in limits], series, "cgroup memory limit",
                     f"p99 latency of a {payload['config']['run_length']}-chunk read", ylabel="p99 (ms)")


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _store_list(text: str) -> list[str]:
    stores = [part for part in text.split(",") if part]
    unknown = set(stores) - set(STORES)
    if unknown or not stores:
        raise argparse.ArgumentTypeError(f"stores must be some of {','.join(STORES)}, got {text!r}")
    return [s for s in STORES if s in stores]


def main() -> None:
    exit_on_sigterm()
    if sys.argv[1:2] == ["--worker"]:  # internal: one store inside its cgroup, started by run_worker
        print(RESULT_MARKER + json.dumps(worker(json.loads(sys.argv[2]))), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limits-mib", type=_int_list, default=[512, 1024, 2048],
                        help="cgroup memory limits, tightest first (comma-separated MiB)")
    parser.add_argument("--working-set-mib", type=int, default=3072, help="bytes of chunks written, then read")
    parser.add_argument("--reads", type=int, default=300, help="timed read requests per store and limit")
    parser.add_argument("--chunk-layers", type=int, default=32, help="Layer Blocks per chunk")
    parser.add_argument("--layer-kib", type=int, default=32, help="bytes per Layer Block (KiB)")
    parser.add_argument("--run-length", type=int, default=16, help="consecutive chunks per read (a prompt hit)")
    parser.add_argument("--zipf", type=float, default=0.8, help="skew of the runs read (Zipf exponent)")
    parser.add_argument("--stores", type=_store_list, default=list(STORES), help="comma-separated subset")
    parser.add_argument("--workdir", type=Path, default=REPO_ROOT / ".cache" / "bench-dualblade",
                        help="store directories go here (one at a time, removed after each run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker-timeout-s", type=float, default=1800.0, help="a worker running longer is killed")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: limits 192,384 MiB, 512 MiB working set, 60 reads")
    args = parser.parse_args()
    if args.quick:
        args.limits_mib, args.working_set_mib, args.reads = [192, 384], 512, 60
    if not args.limits_mib or args.reads < 1 or args.working_set_mib < 1:
        parser.error("--limits-mib, --reads and --working-set-mib must be positive")
    args.limits_mib = sorted(args.limits_mib)
    run_and_report(run, table, args, "dualblade-quick.json" if args.quick else "dualblade.json", chart)


if __name__ == "__main__":
    main()
