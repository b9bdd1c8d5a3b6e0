"""Basic vs DualPath vs Oracle on the emulated cluster, one topology after another, in one invocation.

Per topology (``1P1D``, ``1P2D``, ``2P1D``...) and store round trip
(``store_rtts_ms``: every engine and router request to the store waits that
long in a relay; one cluster each, in that order) one :class:`EmulatedCluster`
is built. Basic (router policy ``basic``: PE-side reads only) and DualPath (policy
``dualpath``) share its engines and differ only in the router; every run adds
its own ``token_salt`` to the trace, so no run finds another's chunks in the
store and each starts from the same (empty) state of its prefix space. With
``repeats`` the modes run interleaved (A B C A B C ...), and the comparison
gives each ratio's median over the repetitions with its spread. Oracle
restarts the engines with the connector's benchmark-only switch
(``benchmark_oracle: true``, accepted only with ``DUALPATH_BENCHMARK=1``),
which reports hits as loaded without reading or moving bytes; its outputs are
not meaningful, its timings are the no-I/O bound. A mode that fails (an
engine refuses the switch, a request fails) is recorded with its reason and
the others still run.

Per run it records the replay (JCT or latency percentiles), the storage-link
counters of every node sampled every ``nic_interval_s``, and the engines'
/metrics deltas (connector bytes and timings, vLLM's queue and prefill
histograms), from which :func:`ttft_breakdown` and :func:`nic_balance` derive
the report's columns.
"""

from __future__ import annotations

import contextlib
import logging
import re
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dualpath_connector.protocol import METRIC_PREFIX, counter_total_name, metric_totals
from dualpath_connector.load.read_timeline import load as load_timeline

from dualpath_dev.cluster import ClusterConfig, EmulatedCluster, EngineSpec, NicSampler, NicSample
from dualpath_bench.errors import BenchUsageError
from dualpath_bench.link_use import link_use
from dualpath_bench.replay import ReplayConfig, StoreWatcher, replay
from dualpath_bench.trace import Agent, summarize

logger = logging.getLogger(__name__)

MODES = ("basic", "dualpath", "oracle")
POLICY = {"basic": "basic", "dualpath": "dualpath", "oracle": "dualpath"}
TOPOLOGY_RE = re.compile(r"^(\d+)P(\d+)D$")
# Connector settings scaled to the emulated links, which are ~10^4 times slower
# than a real storage NIC. Every agent's first prompt reaches the store at once
# (from the DE): 8 agents' 2k-token prompts are ~500 chunks, more than the
# default save buffer (256), and a skipped save makes the agent's next turn a
# miss. A hit takes ~2.5 s to read here, so a DE with four reads queued needs
# longer than the default 10 s de_read_timeout_s (meant to detect a dead DE);
# the DE still declines at once what it could not finish in time.
ENGINE_SETTINGS = {"save_buffer_chunks": 2048, "de_read_timeout_s": 30.0}
ORACLE_SETTINGS = {"benchmark_oracle": True}
ORACLE_ENV = {"DUALPATH_BENCHMARK": "1"}
# Under the work directory: every engine's per-read timeline (read_timeline.py), for link_use.
TIMELINES = "read-timelines"

LOAD_SECONDS_SUM = f"{METRIC_PREFIX}load_seconds_sum"
# Engine series whose change over a run the report uses (sums over label sets).
ENGINE_SERIES = (
    "vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count",
    "vllm:request_prefill_kv_computed_tokens_sum",
    *(f"{METRIC_PREFIX}{timing}_{part}" for timing in ("load_seconds", "pull_seconds") for part in ("sum", "count")),
    *map(counter_total_name, (
        "bytes_read", "bytes_read_for_peer", "bytes_pulled_from_peer", "bytes_written", "save_skipped_chunks",
        "loaded_tokens", "load_failed_tokens", "de_read_fallbacks", "de_reads_declined", "reads_moved_to_de",
        "kept_tokens", "pulled_tokens", "saved_chunks", "split_read_tail_tokens",
    )),
)  # fmt: skip


class BenchError(BenchUsageError, ValueError):
    """A comparison setting that cannot work; the message names it."""


def parse_topology(text: str) -> tuple[int, int]:
    match = TOPOLOGY_RE.match(text.strip().upper())
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise BenchError(f"topology must look like 1P1D or 2P1D, got {text!r}")
    return int(match[1]), int(match[2])


@dataclass(frozen=True)
class BenchConfig:
    topologies: tuple[str, ...] = ("1P1D",)
    modes: tuple[str, ...] = MODES
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    replay_mode: str = "offline"
    rate: float = 0.0
    # Online: agent arrival rates to try in increasing order per mode, until the SLO breaks (APS at SLO, §7.4).
    rates: tuple[float, ...] = ()
    slo_ttft_s: float = 4.0
    slo_tpot_s: float = 0.05
    slo_percentile: float = 90.0
    nic_interval_s: float = 1.0
    busy_fraction: float = 0.25  # a balance window counts when it moved >= this x one NIC's capacity
    warmup_requests: int = 2
    max_model_len: int = 8192
    start_timeout_s: float = 900.0
    progress: bool = True
    # Runs of every mode, interleaved (A B C A B C ...): medians and spread, not one run of each after the other.
    repeats: int = 1
    # Store round trips (ms) to compare at, a cluster each (cluster.store_rtt_ms); empty: cluster.store_rtt_ms alone.
    store_rtts_ms: tuple[float, ...] = ()

    def validate(self) -> BenchConfig:
        for topology in self.topologies:
            parse_topology(topology)
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise BenchError(f"bench.modes must be a non-empty subset of {MODES}, got {list(self.modes)}")
        if self.nic_interval_s <= 0:
            raise BenchError(f"bench.nic_interval_s must be > 0, got {self.nic_interval_s}")
        if not 0 <= self.busy_fraction < 1:
            raise BenchError(f"bench.busy_fraction must be in [0, 1), got {self.busy_fraction}")
        if self.rates and (self.replay_mode != "online" or min(self.rates) <= 0):
            raise BenchError(f"bench.rates (APS at SLO) needs the online replay and positive rates, got "
                             f"{list(self.rates)} with replay {self.replay_mode!r}")  # fmt: skip
        if self.repeats < 1:
            raise BenchError(f"bench.repeats must be at least 1, got {self.repeats}")
        for cluster in self.clusters():
            cluster.validate()
        return self

    def clusters(self) -> list[ClusterConfig]:
        """The cluster config of each store round trip to compare at, in order."""
        return [replace(self.cluster, store_rtt_ms=rtt) for rtt in self.store_rtts_ms] or [self.cluster]


def _engine_snapshot(url: str) -> dict[str, float]:
    totals = metric_totals(urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode())
    return {name: totals.get(name, 0.0) for name in ENGINE_SERIES}


def _settled_snapshot(urls: dict[str, str], timeout_s: float = 15.0) -> dict[str, dict[str, float]]:
    """Engine counters once they stop moving: connector stats reach /metrics with engine steps."""
    deadline = time.monotonic() + timeout_s
    previous = {name: _engine_snapshot(url) for name, url in urls.items()}
    while time.monotonic() < deadline:
        time.sleep(1.0)  # the engines' stats interval; nothing to wait on but the counters themselves
        current = {name: _engine_snapshot(url) for name, url in urls.items()}
        if current == previous:
            return current
        previous = current
    logger.warning("engine counters still moving after %.0fs; using the last snapshot", timeout_s)
    return previous


def _delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {e: {k: after[e][k] - before[e].get(k, 0.0) for k in after[e]} for e in after}


def _busy_windows(samples: list[NicSample], mbit: float, busy_fraction: float) -> list[int]:
    """Indices ``i`` of the windows (sample i to i + 1) in which the storage links together moved at least
    ``busy_fraction`` of one link's capacity."""
    capacity = mbit * 1e6 / 8  # bytes per second of one link
    busy = []
    for i, (a, b) in enumerate(zip(samples, samples[1:])):
        dt = b.t - a.t
        if dt > 0 and sum(y - x for x, y in zip(a.read_bytes, b.read_bytes)) >= busy_fraction * capacity * dt:
            busy.append(i)
    return busy


def _cpu_busy(samples: list[NicSample], windows: list[int]) -> dict[str, float] | None:
    """Each core's busy share of its ticks over ``windows`` (None: no samples carry ticks)."""
    if not windows or not all(samples[i].cpu_ticks and samples[i + 1].cpu_ticks for i in windows):
        return None
    shares = {}
    for core in samples[windows[0]].cpu_ticks:
        busy = sum(samples[i + 1].cpu_ticks[core][0] - samples[i].cpu_ticks[core][0] for i in windows)
        ticks = sum(samples[i + 1].cpu_ticks[core][1] - samples[i].cpu_ticks[core][1] for i in windows)
        shares[core] = busy / ticks if ticks else 0.0
    return shares


def nic_balance(samples: list[NicSample], nodes: list[str], mbit: float, busy_fraction: float) -> dict:
    """Storage-read balance across all nodes' links: max/avg per busy window, traffic-weighted mean.

    Also each core's busy share over the same windows and over the whole run: whether the box's CPUs, not the
    links, set the pace while the links moved data.
    """
    windows = []
    busy = _busy_windows(samples, mbit, busy_fraction)
    for i in busy:
        moved = [y - x for x, y in zip(samples[i].read_bytes, samples[i + 1].read_bytes)]
        total = sum(moved)
        windows.append((total, max(moved) / (total / len(moved))))
    totals = [b - a for a, b in zip(samples[0].read_bytes, samples[-1].read_bytes)] if samples else []
    writes = [b - a for a, b in zip(samples[0].write_bytes, samples[-1].write_bytes)] if samples else []
    weight = sum(w for w, _ in windows)
    return {
        "busy_windows": len(windows),
        "max_over_avg": sum(w * r for w, r in windows) / weight if weight else None,
        "read_bytes": dict(zip(nodes, totals)),
        "write_bytes": dict(zip(nodes, writes)),
        "cpu_busy_while_links_busy": _cpu_busy(samples, busy),
        "cpu_busy": _cpu_busy(samples, list(range(len(samples) - 1))),
        "series": {
            "t": [s.t - samples[0].t for s in samples],
            "read_bytes": {n: [s.read_bytes[i] - samples[0].read_bytes[i] for s in samples] for i, n in enumerate(nodes)},
        },
    }


def ttft_breakdown(summary: dict, deltas: dict[str, dict[str, float]], prefill_names: list[str]) -> dict:
    """Mean TTFT split into PE queueing, storage read, PE prefill and the rest, from /metrics deltas.

    Approximations: means, not per request; vLLM's queue time on the PE runs
    until the request is scheduled, which for a hit is after its read, so the
    read (the connector's ``load_seconds``) is taken out of it; "other" is the
    client's TTFT minus the three: router scheduling and HTTP, the DE's pull of
    the prompt's KV and its first decode step.
    """
    pe = {k: sum(deltas[n][k] for n in prefill_names) for k in ENGINE_SERIES}
    requests = pe["vllm:request_queue_time_seconds_count"]
    if not requests or not summary.get("ttft_s"):
        return {}
    read = pe[LOAD_SECONDS_SUM] / requests
    queue = max(0.0, pe["vllm:request_queue_time_seconds_sum"] / requests - read)
    prefill = pe["vllm:request_prefill_time_seconds_sum"] / max(1.0, pe["vllm:request_prefill_time_seconds_count"])
    ttft = summary["ttft_s"]["mean"]
    return {"queue_s": queue, "read_s": read, "prefill_s": prefill, "other_s": max(0.0, ttft - queue - read - prefill),
            "ttft_s": ttft}  # fmt: skip


def cache_compute(deltas: dict, prefill_names: list[str], bytes_per_token: float, summary: dict, mbit: float) -> dict:
    """The storage-bound arithmetic of a run: seconds to read a turn's hit vs to compute its misses."""
    pe = {k: sum(deltas[n][k] for n in prefill_names) for k in ENGINE_SERIES}
    requests = max(1, summary["requests"] - summary["failed_requests"])
    hit = summary["hit_tokens"] / requests
    computed = pe["vllm:request_prefill_kv_computed_tokens_sum"] / requests
    prefill_rate = (
        pe["vllm:request_prefill_kv_computed_tokens_sum"] / pe["vllm:request_prefill_time_seconds_sum"]
        if pe["vllm:request_prefill_time_seconds_sum"] else None
    )  # fmt: skip
    read_s = hit * bytes_per_token / (mbit * 1e6 / 8)
    return {
        "hit_tokens_per_turn": hit,
        "computed_tokens_per_turn": computed,
        "bytes_per_token": bytes_per_token,
        "read_s_per_turn_one_link": read_s,
        "prefill_tokens_per_s": prefill_rate,
        "compute_s_per_turn": computed / prefill_rate if prefill_rate else None,
    }


def _warmup(router_url: str, model: str, n: int, salt: int) -> None:
    """Short requests with never-seen tokens: vLLM's first steps compile and allocate; keep them out of the run."""
    import json
    import random

    rng = random.Random(f"warmup/{salt}")
    for _ in range(n):
        body = {"model": model, "prompt": [rng.randrange(1024) for _ in range(80)], "max_tokens": 4,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        request = urllib.request.Request(f"{router_url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        urllib.request.urlopen(request, timeout=600).read()


def _run_mode(cluster: EmulatedCluster, mode: str, agents: list[Agent], config: BenchConfig, salt: int,
              watcher: StoreWatcher, bytes_per_token: float) -> dict:  # fmt: skip
    # The paper profiles the read rate in advance (A.4); here it is the link's rate, in tokens.
    link_tokens_per_s = cluster.network.config.storage_mbit * 1e6 / 8 / bytes_per_token
    router = cluster.start_router(POLICY[mode], scheduling={"read_tokens_per_s": link_tokens_per_s})
    try:
        model = str(cluster.model)
        _warmup(router.url, model, config.warmup_requests, salt)
        urls = {name: server.base_url for name, server in cluster.engines.items()}
        before = _settled_snapshot(urls)
        replay_config = ReplayConfig(
            router.url, model, mode=config.replay_mode, rate=config.rate, token_salt=salt,
            max_context=config.max_model_len, slo_ttft_s=config.slo_ttft_s, slo_tpot_s=config.slo_tpot_s,
            slo_percentile=config.slo_percentile, progress=config.progress,
        )  # fmt: skip
        relay_before = cluster.relay.stats() if cluster.relay is not None else None
        started = time.time()
        with NicSampler(cluster.network, config.nic_interval_s) as sampler:
            result = replay(agents, replay_config, watcher)
        ended = time.time()
        after = _settled_snapshot(urls)
        relay = _relay_delta(relay_before, cluster.relay.stats()) if relay_before is not None else None
    finally:
        cluster.stop_router()
    summary = result.summary()
    deltas = _delta(before, after)
    nodes = [n.name for n in cluster.network.nodes]
    prefill = [n.name for n in cluster.network.nodes if n.role == "prefill"]
    return {
        "mode": mode,
        "policy": POLICY[mode],
        "store_rtt_ms": cluster.network.config.store_rtt_ms,
        # The store requests that waited the round trip in the relay during the run, by method, and its CPU seconds
        # (it shares the cores with everything else); None without a relay.
        "relay": relay,
        "summary": summary,
        "ttft_breakdown": ttft_breakdown(summary, deltas, prefill),
        "cache_compute": cache_compute(deltas, prefill, bytes_per_token, summary, cluster.network.config.storage_mbit),
        "nic": nic_balance(sampler.samples, nodes, cluster.network.config.storage_mbit, config.busy_fraction),
        "link_use": link_use(
            load_timeline(cluster.workdir / TIMELINES, started, ended),
            {server.side_channel: name for name, server in cluster.engines.items()}, started, ended,
            link_tokens_per_s=link_tokens_per_s,
        ),
        "engine_deltas": deltas,
        "records": [asdict(r) for r in result.records],
    }


def _relay_delta(before: dict, after: dict) -> dict:
    """What the relay did between two of its ``stats``: requests by method and CPU seconds."""
    methods = set(before["requests"]) | set(after["requests"])
    return {"requests": {m: after["requests"].get(m, 0) - before["requests"].get(m, 0) for m in sorted(methods)},
            "cpu_s": after["cpu_s"] - before["cpu_s"]}  # fmt: skip


def _run_or_sweep(cluster: EmulatedCluster, mode: str, agents: list[Agent], config: BenchConfig, salt: int,
                  watcher: StoreWatcher, bytes_per_token: float) -> dict:  # fmt: skip
    """One run; with ``config.rates``, online runs at increasing rates until the SLO breaks (§7.4's APS at SLO).

    The result is the run at the highest rate whose SLO held (the lowest rate's if none did), with the
    whole ``sweep`` and ``aps_at_slo`` (None: the SLO broke at every rate tried).
    """
    if not config.rates:
        return _run_mode(cluster, mode, agents, config, salt, watcher, bytes_per_token)
    sweep, held = [], None
    for k, rate in enumerate(sorted(config.rates)):
        # Every rate in a fresh prefix space of its own.
        run = _run_mode(cluster, mode, agents, replace(config, rate=rate), salt + 10 * (k + 1), watcher,
                        bytes_per_token)  # fmt: skip
        slo = run["summary"]["slo"]
        sweep.append({"rate": rate, "holds": slo["holds"], "ttft_s": slo["ttft_s"], "tpot_s": slo["tpot_s"]})
        if not slo["holds"]:
            held = held or run
            break
        held = {**run, "aps_at_slo": rate}
    return {**held, "sweep": sweep, "aps_at_slo": held.get("aps_at_slo")}


def _watcher(cluster: EmulatedCluster) -> tuple[StoreWatcher, float]:
    """A store watcher on the control link, and KV bytes per token, from an engine's key space."""
    key_space = next(iter(cluster.engines.values())).key_space()
    assert cluster.s3 is not None
    store = cluster.s3.lookup_store(cluster.store_section(cluster.s3.endpoint), key_space.layout)
    return StoreWatcher(store, key_space), key_space.layout.full_block_bytes / key_space.chunk_tokens


def run_topology(topology: str, agents: list[Agent], config: BenchConfig, workdir: Path, model: Path) -> dict:
    """Every mode of ``config`` on one cluster (``config.cluster``, its store round trip included), ``config.repeats``
    times, the modes interleaved (A B C A B C ...).

    Basic and DualPath share their engines; the Oracle's engines take their place for its run, so with the Oracle
    every repetition starts the plain engines again. Every run has a prefix space (token salt) of its own.
    """
    prefill, decode = parse_topology(topology)
    bound = (prefill + decode) / prefill
    cluster_config = replace(config.cluster, prefill=prefill, decode=decode)
    repetitions: list[dict[str, dict]] = [{} for _ in range(config.repeats)]
    plain = [m for m in config.modes if m != "oracle"]
    timelines = {"read_timeline_dir": str(workdir / TIMELINES)}
    with EmulatedCluster(cluster_config, workdir, model, config.max_model_len, config.start_timeout_s) as cluster, \
            contextlib.ExitStack() as watchers:  # fmt: skip
        logger.info("%s: network %s, S3 %s, store round trip %g ms", topology, cluster.network.prefix,
                    cluster.s3.endpoint, cluster_config.store_rtt_ms)  # fmt: skip

        def engines(spec: EngineSpec) -> tuple[StoreWatcher, float]:
            cluster.start_engines(spec)
            watcher, bytes_per_token = _watcher(cluster)
            watchers.callback(watcher.close)
            return watcher, bytes_per_token

        plain_engines = None
        for repetition, runs in enumerate(repetitions):
            logger.info("%s: repetition %d of %d", topology, repetition + 1, config.repeats)
            salt = 1000 * repetition  # sweeps add 10 per rate: far below the next repetition's
            if plain:
                plain_engines = plain_engines or engines(EngineSpec(extra={**ENGINE_SETTINGS, **timelines}))
                for mode in plain:
                    runs[mode] = _guarded(mode, lambda m=mode: _run_or_sweep(
                        cluster, m, agents, config, salt + MODES.index(m) + 1, *plain_engines))  # fmt: skip
            if "oracle" in config.modes:
                plain_engines = None

                def oracle() -> dict:
                    spec = EngineSpec(extra={**ENGINE_SETTINGS, **ORACLE_SETTINGS, **timelines}, env=ORACLE_ENV,
                                      name="oracle")  # fmt: skip
                    return _run_or_sweep(cluster, "oracle", agents, config, salt + MODES.index("oracle") + 1,
                                         *engines(spec))  # fmt: skip

                runs["oracle"] = _guarded("oracle", oracle)
    return {
        "topology": topology,
        "prefill": prefill,
        "decode": decode,
        "bound": bound,
        "store_rtt_ms": cluster_config.store_rtt_ms,
        "cluster": asdict(cluster_config),
        # Per mode, the repetition with the median JCT (or the first that failed): the table's row.
        "runs": {mode: representative([runs[mode] for runs in repetitions]) for mode in config.modes},
        "repetitions": repetitions,
        "figures": mode_figures(repetitions),
        "comparison": compare_repetitions(repetitions, bound),
    }


def _guarded(mode: str, run) -> dict:
    try:
        return run()
    except Exception as exc:  # one mode's failure must not hide the others' results
        logger.exception("mode %s failed", mode)
        return {"mode": mode, "error": f"{type(exc).__name__}: {exc}"}


def _finished_jct(run: dict) -> float | None:
    """A run's JCT, or None where it failed or left agents unfinished (its JCT compares with nothing)."""
    summary = run.get("summary")
    if not summary or summary["agents_failed"]:
        return None
    return summary["jct_s"]


def representative(runs: list[dict]) -> dict:
    """The run that stands for a mode's repetitions: the first that did not finish, else the median JCT's
    (the lower middle one of an even count)."""
    unfinished = [run for run in runs if _finished_jct(run) is None]
    if unfinished:
        return unfinished[0]
    return sorted(runs, key=_finished_jct)[(len(runs) - 1) // 2]


# Each mode's figures, per repetition, that the report gives with their spread.
RUN_FIGURES = {
    "jct_s": _finished_jct,
    "read_span_s": lambda run: (run.get("link_use") or {}).get("read_span_s"),
    "combined_rate_fraction": lambda run: (run.get("link_use") or {}).get("combined_rate_fraction"),
}


def spread(values: list[float | None]) -> dict:
    """Median, min and max of one figure over the repetitions; all None where any repetition lacks it."""
    if not values or any(v is None for v in values):
        return {"median": None, "min": None, "max": None, "values": values}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def mode_figures(repetitions: list[dict[str, dict]]) -> dict[str, dict[str, dict]]:
    modes = list(dict.fromkeys(m for runs in repetitions for m in runs))
    return {mode: {name: spread([figure(runs.get(mode, {})) for runs in repetitions])
                   for name, figure in RUN_FIGURES.items()} for mode in modes}  # fmt: skip


def compare_runs(runs: dict[str, dict], bound: float) -> dict:
    """One repetition's ratios; the read-span ratio holds DualPath to the bound over the seconds reads were
    outstanding (a job also spends time reading nothing: first prompts, decode, the tail)."""
    basic, dual, oracle = (_finished_jct(runs.get(mode, {})) for mode in ("basic", "dualpath", "oracle"))
    speedup = basic / dual if basic and dual else None
    span = {mode: RUN_FIGURES["read_span_s"](runs.get(mode, {})) for mode in ("basic", "dualpath")}
    span_speedup = span["basic"] / span["dualpath"] if speedup and span["basic"] and span["dualpath"] else None
    aps = {mode: run.get("aps_at_slo") for mode, run in runs.items() if "sweep" in run}
    return {
        "aps_at_slo": aps,
        "dualpath_aps_speedup": aps["dualpath"] / aps["basic"] if aps.get("basic") and aps.get("dualpath") else None,
        "dualpath_speedup": speedup,
        "bound": bound,
        "fraction_of_bound": speedup / bound if speedup else None,
        "read_span_speedup": span_speedup,
        "fraction_of_read_span_bound": span_speedup / bound if span_speedup else None,
        "dualpath_over_oracle": dual / oracle if dual and oracle else None,
        "basic_over_oracle": basic / oracle if basic and oracle else None,
    }


# The comparison's ratios, each a median over the repetitions' (every repetition pairs modes run back to back).
RATIOS = ("dualpath_aps_speedup", "dualpath_speedup", "fraction_of_bound", "read_span_speedup",
          "fraction_of_read_span_bound", "dualpath_over_oracle", "basic_over_oracle")  # fmt: skip


def compare_repetitions(repetitions: list[dict[str, dict]], bound: float) -> dict:
    """Medians of the repetitions' ratios; ``spread`` has each one's median, min and max. A ratio that any
    repetition could not give (a mode failed there) is None: a median of the others would hide the failure."""
    per = [compare_runs(runs, bound) for runs in repetitions]
    spreads = {key: spread([c[key] for c in per]) for key in RATIOS}
    aps_modes = list(dict.fromkeys(m for c in per for m in c["aps_at_slo"]))
    return {
        **{key: spreads[key]["median"] for key in RATIOS},
        "aps_at_slo": {m: spread([c["aps_at_slo"].get(m) for c in per])["median"] for m in aps_modes},
        "bound": bound,
        "repetitions": len(per),
        "spread": spreads,
    }


def run_comparison(agents: list[Agent], config: BenchConfig, workdir: Path, model: Path) -> dict:
    """Every topology of ``config``, at each of its store round trips; the payload the report renders."""
    config.validate()
    topologies = [run_topology(t, agents, replace(config, cluster=cluster), workdir, model)
                  for t in config.topologies for cluster in config.clusters()]  # fmt: skip
    return {
        "config": {**asdict(config), "cluster": asdict(config.cluster)},
        "trace": summarize(agents),
        "topologies": topologies,
    }
