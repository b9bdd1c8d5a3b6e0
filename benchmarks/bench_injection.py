"""TTFT of a 90%-hit prompt served by ``bulk``, ``layerwise`` and s3agg layerwise store loads and all-local, side by side.

One SeaweedFS (S3 on 127.0.0.1), an ``s3agg-gateway`` in front of its bucket and four vLLM OpenAI servers with DualPathConnector
(``configs/single.json``, the tiny random Llama), started together and sharing the store
(the same bucket and key prefix, hence one namespace):

- ``bulk`` and ``layerwise``: ``load_mode`` bulk / layerwise, vLLM's local prefix cache
  off, so every hit is a connector load from the store;
- ``s3agg-layerwise``: layerwise with store ``s3agg`` (the gateway, same bucket and key prefix):
  the hit arrives layer by layer (ObjectCache on the request path);
- ``all-local``: vLLM's local prefix cache on (the connector too, so it makes the same store
  lookups and saves as the others): its hit comes from its own KV cache, no connector load.

For each prompt length L and repetition, with fresh random token ids:

- recompute (0% hit, for scale): a fresh prompt of L tokens on bulk or layerwise (alternating);
- a context C (the first 90% of L, whole chunks) is sent once, as its own request, to
  all-local, which computes it, keeps it in its prefix cache and saves its chunks; the
  script waits until they have landed in the bucket;
- C + S_mode goes to each of the three servers (order reversed every other repetition), the
  S_* being different fresh suffixes of L - |C| tokens: bulk and layerwise load exactly the
  same stored chunks of C, all-local finds C in its prefix cache, and no server finds
  another's suffix chunks (a chunk key hashes every token before it).

TTFT is the time from sending the request to the first streamed chunk carrying token
ids (``max_tokens=1``). The per-layer stall metric is read from each server's /metrics
as deltas over each request: ``dualpath_kv:layer_wait_seconds`` (time the forward waited
in ``wait_for_layer_load``, per step summed over layers) and ``dualpath_kv:layer_load_seconds``
(per step, the time its layerwise loads took on their own, first copy to last); the table
gives layerwise's median wait per request and the hidden fraction 1 - sum(wait) / sum(load),
"n/a" where the connector does not export them. Around each s3agg hit the gateway's own
/metrics give its time per phase (``s3agg_request_phase_seconds``: reading the objects from
the store, delivering the layers, the request in all). Medians go to a
markdown table and ``benchmarks/results/injection.json`` (and ``injection.png`` when
matplotlib is importable).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # dualpath_dev: the checkout's dev scaffolding
from _common import (  # noqa: E402
    PROBE_TOKENS,
    VOCAB,
    SaveWaiter,
    add_server_args,
    add_store_rtt_arg,
    bar_chart,
    chunk_tokens,
    exit_on_sigterm,
    markdown_table,
    median,
    result_payload,
    run_and_report,
    set_store_rtt,
    size_label,
    store_traffic,
    tree_cpu_s,
    vllm_stack,
)

from dualpath_connector.protocol import metric_samples, metric_totals  # noqa: E402
from dualpath_dev.engines import VLLMServer, cached_tokens  # noqa: E402

S3AGG = "s3agg-layerwise"  # layerwise, the hit arriving layer by layer through s3agg-gateway (ObjectCache)
MODES = ("bulk", "layerwise", S3AGG)  # the connector loads the hit from the store
LAYERWISE = ("layerwise", S3AGG)
LOCAL = "all-local"  # vLLM's own prefix cache holds the hit
SERVERS = (*MODES, LOCAL)
WARMUP_TOKENS = 2048
# Each sample's delta of these series over its request; None where the server does not export one.
DELTAS = {
    "load_s": "dualpath_kv:load_seconds_sum",
    "loads": "dualpath_kv:load_seconds_count",
    "layer_wait_s": "dualpath_kv:layer_wait_seconds_sum",
    "layer_load_s": "dualpath_kv:layer_load_seconds_sum",
    "layer_steps": "dualpath_kv:layer_load_seconds_count",
}


# The gateway's time per phase of a request (its /metrics, by phase), summed over the requests of a sample.
GATEWAY_PHASES = ("storage_read", "delivery", "total")


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    return after[name] - before.get(name, 0.0) if name in after else None


def gateway_phases(gateway) -> dict[str, float]:
    """Seconds the gateway spent so far in each phase of its requests, summed over them."""
    with urllib.request.urlopen(f"{gateway.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {labels["phase"]: value for name, labels, value in metric_samples(text)
            if name == "s3agg_request_phase_seconds_sum"}  # fmt: skip


class Bench:
    def __init__(self, servers: dict[str, VLLMServer], chunk_tokens: int, args: argparse.Namespace,
                 services: dict) -> None:  # fmt: skip
        self.servers = servers
        self.gateway = services["gateway"]
        # Whose CPU a request's time went to: every engine (its process tree), SeaweedFS, the gateway, and this
        # process (the script and the relays, which run on its threads).
        self.cpu_pids = {**{mode: server.proc.pid for mode, server in servers.items()},
                         "seaweedfs": services["s3"].proc.pid, "gateway": self.gateway.proc.pid,
                         "bench+relays": os.getpid()}  # fmt: skip
        self.chunk_tokens = chunk_tokens
        self.args = args
        self.rng = random.Random(args.seed)
        self.waiters = {mode: SaveWaiter(server, args, self.fresh) for mode, server in servers.items()}

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def chunks(self, tokens: int) -> int:
        return tokens // self.chunk_tokens

    def context_tokens(self, length: int) -> int:
        """The stored part of an L-token prompt: ``--hit-fraction`` of it, rounded down to whole chunks."""
        return self.chunks(int(length * self.args.hit_fraction)) * self.chunk_tokens

    def cpu_seconds(self) -> dict[str, float]:
        # The script's own process without its children: the services are those.
        return {name: tree_cpu_s(pid, descendants=pid != os.getpid()) for name, pid in self.cpu_pids.items()}

    def send(self, mode: str, prompt: list[int], stored_before: int) -> dict:
        """One timed request on ``mode``'s server; then waits for the saves it caused and its load's timings.

        ``stored_before``: tokens of ``prompt`` whose chunks are in the store already.
        """
        server = self.servers[mode]
        gateway = self.gateway if mode == S3AGG else None
        before = metric_totals(server.metrics_text())
        phases_before = gateway_phases(gateway) if gateway else {}
        cpu_before = self.cpu_seconds()
        ttft, _, usage = server.complete(prompt, 1, self.args.request_timeout)
        cpu = {name: seconds - cpu_before[name] for name, seconds in self.cpu_seconds().items()}
        save = self.waiters[mode].wait(self.chunks(len(prompt)) - self.chunks(stored_before))
        watched = [DELTAS["loads"], DELTAS["layer_steps"]] if mode in LAYERWISE else [DELTAS["loads"]]
        after = self.settled(server, before, watched if stored_before and mode in MODES else [])
        # The gateway's request ended with its last WRITE, before the engine's timings settled above.
        phases = gateway_phases(gateway) if gateway else {}
        return {
            "server": mode,
            "ttft_s": ttft,
            "cached_tokens": cached_tokens(usage),
            "prompt_tokens": len(prompt),
            **{key: delta(before, after, name) for key, name in DELTAS.items()},
            **{f"gateway_{phase}_s": delta(phases_before, phases, phase) for phase in GATEWAY_PHASES},
            # CPU seconds each process (tree) used from sending the request to its first token.
            "cpu_s": cpu,
            "save": save,
        }

    def settled(self, server: VLLMServer, before: dict[str, float], watched: list[str]) -> dict[str, float]:
        """The server's metric totals once every exported series in ``watched`` moved past ``before``.

        Connector timings reach /metrics with an engine step's output, so while
        one lags a probe (shorter than a chunk: no lookup, no load, no save)
        makes a step. A load that failed moves nothing: after ``--save-settle``
        seconds the totals are taken as they are.
        """
        deadline = time.monotonic() + self.args.save_settle
        while True:
            totals = metric_totals(server.metrics_text())
            lagging = [name for name in watched if name in totals and totals[name] <= before.get(name, 0.0)]
            if not lagging:
                return totals
            if time.monotonic() > deadline:
                print(f"  warning: {', '.join(lagging)} did not move within {self.args.save_settle}s", file=sys.stderr)
                return totals
            time.sleep(0.2)
            server.complete(self.fresh(PROBE_TOKENS), 1, self.args.request_timeout)

    def rep(self, length: int, rep: int, recompute: bool) -> dict[str, dict]:
        """One repetition at ``length``: {"recompute"?, "prime", "bulk", "layerwise", "all-local"} samples."""
        samples = {}
        order = SERVERS if rep % 2 == 0 else SERVERS[::-1]
        if recompute:
            samples["recompute"] = self.send(MODES[rep % 2], self.fresh(length), 0)
        context = self.fresh(self.context_tokens(length))
        # Computed once, on all-local: its prefix cache keeps it, and the store gets its chunks.
        samples["prime"] = self.send(LOCAL, context, 0)
        for mode in order:
            samples[mode] = self.send(mode, context + self.fresh(length - len(context)), len(context))
            samples[mode]["expected_hit_tokens"] = len(context)
            if samples[mode]["cached_tokens"] != len(context):
                print(f"  warning: {mode} hit {samples[mode]['cached_tokens']} tokens, expected {len(context)}",
                      file=sys.stderr)
        return samples


def summarize(length: int, stored: int, samples: dict[str, list[dict]]) -> dict:
    """One table row; medians of the three servers only over samples that got the whole hit.

    A load that failed (e.g. a store read past ``io_timeout_s``) makes vLLM
    recompute the hit: that sample measures recompute, not injection, and is
    kept in ``samples`` but left out of the medians (``full_hits`` counts the rest).
    """
    full = {mode: [s for s in samples[mode] if s["cached_tokens"] == stored] for mode in SERVERS}
    ttft = {mode: median([s["ttft_s"] for s in full[mode]]) * 1000 for mode in SERVERS}
    # The stall metric, per layerwise server: samples whose server exported it.
    stalls = {mode: [s for s in full[mode] if s["layer_wait_s"] is not None and s["layer_load_s"] is not None]
              for mode in LAYERWISE}
    load_total = {mode: sum(s["layer_load_s"] for s in stalls[mode]) for mode in LAYERWISE}
    # Floored at 0 as the connector's gauge is: on the CPU path the wait is the copy itself, plus timer noise.
    hidden = {mode: max(0.0, 1 - sum(s["layer_wait_s"] for s in stalls[mode]) / load_total[mode])
              if load_total[mode] else None for mode in LAYERWISE}
    return {
        "prompt_tokens": length,
        "stored_tokens": stored,
        "recompute_ttft_ms_median": median([s["ttft_s"] for s in samples.get("recompute", [])]) * 1000,
        "ttft_ms_median": ttft,
        "vs_all_local": {mode: ttft[mode] / ttft[LOCAL] for mode in MODES},
        "load_ms_median": {mode: median([s["load_s"] for s in full[mode]]) * 1000 for mode in MODES},
        "after_load_ms_median": {
            mode: median([s["ttft_s"] - s["load_s"] for s in full[mode]]) * 1000 for mode in MODES
        },
        "layer_wait_ms_median": {mode: median([s["layer_wait_s"] for s in stalls[mode]]) * 1000
                                 if stalls[mode] else None for mode in LAYERWISE},
        "layer_hidden_fraction": hidden,
        # What the gateway itself took for s3agg's hits: reading the objects from the store, and in all.
        "gateway_ms_median": {phase: median([s[f"gateway_{phase}_s"] for s in full[S3AGG]]) * 1000
                              for phase in GATEWAY_PHASES if all(s.get(f"gateway_{phase}_s") is not None
                                                                 for s in full[S3AGG])},
        "full_hits": {mode: f"{len(full[mode])}/{len(samples[mode])}" for mode in SERVERS},
        # Per server: the median CPU seconds each process took while that server's requests waited for a token.
        "cpu_s_median": {mode: {name: median([s["cpu_s"][name] for s in full[mode]]) for name in full[mode][0]["cpu_s"]}
                         for mode in SERVERS if full[mode] and all("cpu_s" in s for s in full[mode])},
        "samples": samples,
    }


def run(args: argparse.Namespace) -> dict:
    rows = []
    # Same bucket and key prefix (configs/single.json) for all: one store, one namespace.
    stack = {mode: {"extra": {"load_mode": mode}} for mode in ("bulk", "layerwise")}
    # The same bucket through s3agg-gateway: the same namespace, so the same stored chunks.
    stack[S3AGG] = {"extra": {"load_mode": "layerwise"}, "s3agg": True}
    stack[LOCAL] = {"vllm_args": ["--enable-prefix-caching"]}
    relays: list | None = [] if args.store_rtt_ms else None
    services: dict = {}
    with vllm_stack(args, "bench-injection", stack, {"io_timeout_s": args.store_io_timeout}, relays,
                    services) as servers:  # fmt: skip
        bench = Bench(servers, chunk_tokens(servers["bulk"]), args, services)

        if args.warmup:
            # First requests pay one-time costs (kernels, NIXL OBJ connections): one repetition, discarded.
            length = min(WARMUP_TOKENS, *args.sizes)
            print(f"warm-up ({length} tokens, every server) ...", file=sys.stderr)
            bench.rep(length, 0, recompute=False)
            bench.rep(length, 1, recompute=False)

        for rtt_ms in args.store_rtt_ms or [None]:
            set_store_rtt(relays, rtt_ms)
            for length in args.sizes:
                samples: dict[str, list[dict]] = {}
                for rep in range(args.reps):
                    for kind, sample in bench.rep(length, rep, args.recompute).items():
                        samples.setdefault(kind, []).append(sample)
                        print(f"{'' if rtt_ms is None else f'RTT {rtt_ms:g} ms, '}{length:>6} tokens rep "
                              f"{rep + 1}/{args.reps} {kind:>9} on {sample['server']:>9}: TTFT "
                              f"{sample['ttft_s'] * 1000:8.1f} ms, cached {sample['cached_tokens']}, "
                              f"load {ms(sample['load_s'])} ms, layer wait {ms(sample['layer_wait_s'])} ms "
                              f"of {ms(sample['layer_load_s'])} ms", file=sys.stderr)
                rows.append({"store_rtt_ms": rtt_ms, **summarize(length, bench.context_tokens(length), samples)})
        traffic = {mode: store_traffic(server) for mode, server in servers.items()}
    return result_payload(args, store_traffic=traffic, results=rows)


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f}"


def table(payload: dict) -> str:
    rtt = payload["config"].get("store_rtt_ms")
    rows = [
        [
            *([f"{r['store_rtt_ms']:g}"] if rtt else []),
            r["prompt_tokens"],
            r["stored_tokens"],
            f"{r['recompute_ttft_ms_median']:.0f}",
            *(f"{r['ttft_ms_median'][mode]:.0f}" for mode in (LOCAL, *MODES)),
            *(f"{r['vs_all_local'][mode]:.2f}x" for mode in MODES),
            *(f"{r['load_ms_median'][mode]:.0f}" for mode in MODES),
            *(ms(None if r["layer_wait_ms_median"][mode] is None else r["layer_wait_ms_median"][mode] / 1000)
              for mode in LAYERWISE),
            *("n/a" if r["layer_hidden_fraction"][mode] is None else f"{r['layer_hidden_fraction'][mode]:.0%}"
              for mode in LAYERWISE),
            ", ".join(r["full_hits"][mode] for mode in (LOCAL, *MODES)),
            *(ms(None if phase not in r.get("gateway_ms_median", {}) else r["gateway_ms_median"][phase] / 1000)
              for phase in GATEWAY_PHASES),
        ]
        for r in payload["results"]
    ]
    env, config = payload["environment"], payload["config"]
    caption = (
        f"TTFT (max_tokens=1) on vLLM's CPU build, tiny random Llama (4 layers, bf16), median of "
        f"{config['reps']} repetition(s) with fresh random prompts each. What limits these figures: "
        f"{env['cpu_count']} CPU cores, shared by the four engines, SeaweedFS, s3agg-gateway, this script and other work on the "
        f"machine (load average {env['load_avg_at_start'][0]:.1f} at the start, {env['load_avg_at_end'][0]:.1f} "
        f"at the end), and attention on the CPU: the KV copies run on the same cores as the forward, with no copy "
        f"engine to overlap them with compute, so this measures the CPU data path, not a GPU's overlap. "
        f"all-local: vLLM's prefix cache held the prompt's first {config['hit_fraction']:.0%} (whole chunks), "
        f"computed by an earlier request on that server; bulk / layerwise: the same chunks, saved by that request, "
        f"loaded from S3 (SeaweedFS on 127.0.0.1) with that load_mode, local prefix cache off; {S3AGG}: layerwise "
        f"with store s3agg, the hit arriving layer by layer through s3agg-gateway in front of the same bucket "
        f"(reported once layer 0 landed, the forward waiting per layer); every server makes "
        f"the connector's store lookups. recompute: a never-seen prompt of the same length (0% hit). x / all-local: "
        f"ratio of the median TTFTs. load ms: the connector's load_seconds (store read, plus the KV cache copy in "
        f"bulk mode). layerwise wait: the forward's time in wait_for_layer_load per request "
        f"(dualpath_kv:layer_wait_seconds); hidden: 1 - sum(wait) / sum(layerwise load time) "
        f"(dualpath_kv:layer_load_seconds), n/a where the connector does not export them. full hits: samples that "
        f"got the whole hit, the only ones in the medians (a failed load is recomputed). gateway storage_read / "
        f"delivery / total ms: what s3agg-gateway itself took per {S3AGG} hit (its s3agg_request_phase_seconds): "
        f"reading the chunk objects from the store, writing the layers to the engine, the request in all."
    )
    if rtt:
        caption += (f" Store RTT: every request from an engine to S3 (and to the gateway) waited this long in a relay "
                    f"before it was forwarded (dualpath_dev/s3_relay.py: per-request latency, not bandwidth; the "
                    f"gateway reads the store directly, as it would run beside it); the relay is Python on the same "
                    f"cores, so it also costs CPU per request.")
    headers = [*(["store RTT ms"] if rtt else []), "prompt tokens", "stored tokens", "recompute TTFT ms", "all-local TTFT ms",
               *(f"{mode} TTFT ms" for mode in MODES), *(f"{mode} / all-local" for mode in MODES),
               *(f"{mode} load ms" for mode in MODES), *(f"{mode} wait ms" for mode in LAYERWISE),
               *(f"{mode} hidden" for mode in LAYERWISE), f"full hits ({', '.join((LOCAL, *MODES))})",
               *(f"gateway {phase} ms" for phase in GATEWAY_PHASES)]
    return markdown_table(headers, rows, caption) + cpu_table(payload)


def cpu_table(payload: dict) -> str:
    """Where the CPU went while each server's requests waited for their token (medians), when measured."""
    rows = [[*([f"{r['store_rtt_ms']:g}"] if payload["config"].get("store_rtt_ms") else []), r["prompt_tokens"], mode,
             f"{r['ttft_ms_median'][mode]:.0f}", *(f"{seconds:.2f}" for seconds in cpu.values())]
            for r in payload["results"] for mode, cpu in r.get("cpu_s_median", {}).items()]  # fmt: skip
    if not rows:
        return ""
    names = list(next(iter(next(r for r in payload["results"] if r.get("cpu_s_median"))["cpu_s_median"].values())))
    headers = [*(["store RTT ms"] if payload["config"].get("store_rtt_ms") else []), "prompt tokens", "request on",
               "TTFT ms", *(f"{name} CPU s" for name in names)]
    caption = ("CPU seconds each process took from a request's send to its first token (medians over the full "
               "hits), by the server the request went to: every engine is its process tree (API server, engine "
               "core, worker), bench+relays is this script with the relays on its threads. Two cores give at most "
               "2 s of CPU per second.")
    return "\n\n" + markdown_table(headers, rows, caption)


def chart(payload: dict, path: Path) -> Path | None:
    rows = payload["results"]
    hit = f"{payload['config']['hit_fraction']:.0%} hit"
    series = {f"{mode} ({hit})": [r["ttft_ms_median"][mode] for r in rows] for mode in (LOCAL, *MODES)}
    if payload["config"]["recompute"]:
        series = {"recompute (0% hit)": [r["recompute_ttft_ms_median"] for r in rows], **series}
    title = (f"TTFT: all-local vs bulk vs layerwise vs s3agg layerwise (vLLM CPU, {payload['environment']['cpu_count']} cores, "
             f"median of {payload['config']['reps']})")
    labels = [size_label(r["prompt_tokens"]) + ("" if r.get("store_rtt_ms") is None else f"\n{r['store_rtt_ms']:g} ms RTT")
              for r in rows]
    return bar_chart(path, labels, series, "prompt tokens (store RTT)", title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8000, 16000, 32000], help="prompt lengths (tokens)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per length (the median is reported)")
    parser.add_argument("--hit-fraction", type=float, default=0.9, help="stored share of each prompt")
    parser.add_argument("--no-recompute", dest="recompute", action="store_false",
                        help="skip the 0%%-hit recompute request per repetition")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--store-io-timeout", type=float, default=120.0,
                        help="the store's io_timeout_s (connector default 30 s: a loaded 2-core box reads a "
                             "32k hit's 900 chunks from SeaweedFS slower than that)")
    add_store_rtt_arg(parser)
    add_server_args(parser)
    parser.add_argument("--gateway-min-read-bytes", type=int, default=None,
                        help="the s3agg gateway's smallest ranged GET (default: the gateway's, 4 MiB; 0: one layer per "
                             "GET, so layer 0 lands before the other layers are read)")
    parser.add_argument("--output", default="injection", help="base name under benchmarks/results/ (.json, .png)")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if not 0 < args.hit_fraction < 1:
        parser.error("--hit-fraction must be between 0 and 1")
    if max(args.sizes) + 1 > args.max_model_len:
        parser.error("--max-model-len must exceed the longest prompt plus one output token")
    exit_on_sigterm()
    run_and_report(run, table, args, f"{args.output}.json", chart)


if __name__ == "__main__":
    main()
