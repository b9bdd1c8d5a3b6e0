"""TTFT with ``bulk`` vs ``layerwise`` injection of a 90% store hit, per prompt length, side by side.

One SeaweedFS (S3 on 127.0.0.1) and two vLLM OpenAI servers with DualPathConnector
(``configs/single.json``, the tiny random Llama, vLLM's local prefix cache off), one
with ``load_mode: bulk`` and one with ``load_mode: layerwise``, run at the same time
and share the store: the same bucket and key prefix, hence one namespace. For each
prompt length L and repetition, with fresh random token ids:

- a context C (the first 90% of L, whole chunks) is sent once, as its own request, to
  one of the servers (alternating), which computes it and saves its chunks; the script
  waits until they have landed in the bucket;
- C + S_bulk goes to the bulk server and C + S_layerwise to the layerwise server
  (order alternating), S_* being two different fresh suffixes of L - |C| tokens: both
  load exactly the same stored chunks of C, and neither finds the other's suffix
  chunks (a chunk key hashes every token before it);
- recompute (0% hit, for scale): a fresh prompt of L tokens on one server.

TTFT is the time from sending the request to the first streamed chunk carrying token
ids (``max_tokens=1``). Medians go to a markdown table and
``benchmarks/results/injection.json`` (and ``injection.png`` when matplotlib is
importable).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # dualpath_dev: the checkout's dev scaffolding
from _common import (  # noqa: E402
    VOCAB,
    SaveWaiter,
    add_server_args,
    bar_chart,
    chunk_tokens,
    exit_on_sigterm,
    markdown_table,
    median,
    result_payload,
    run_and_report,
    size_label,
    store_traffic,
    ttft_caption,
    vllm_stack,
)

from dualpath_dev.engines import VLLMServer, cached_tokens  # noqa: E402

MODES = ("bulk", "layerwise")
LOAD_SECONDS = "dualpath_kv:load_seconds_sum"
WARMUP_TOKENS = 2048


class Bench:
    def __init__(self, servers: dict[str, VLLMServer], chunk_tokens: int, args: argparse.Namespace) -> None:
        self.servers = servers
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

    def send(self, mode: str, prompt: list[int], stored_before: int) -> dict:
        """One timed request on ``mode``'s server; then waits for the saves it caused.

        ``stored_before``: tokens of ``prompt`` whose chunks are in the store already.
        """
        server = self.servers[mode]
        load_before = server.metric_total(LOAD_SECONDS)
        ttft, _, usage = server.complete(prompt, 1, self.args.request_timeout)
        save = self.waiters[mode].wait(self.chunks(len(prompt)) - self.chunks(stored_before))
        # The load's timing reaches /metrics with a later engine step: the save wait made some.
        return {
            "server": mode,
            "ttft_s": ttft,
            "cached_tokens": cached_tokens(usage),
            "prompt_tokens": len(prompt),
            "load_s": server.metric_total(LOAD_SECONDS) - load_before,
            "save": save,
        }

    def rep(self, length: int, rep: int, recompute: bool) -> dict[str, dict]:
        """One repetition at ``length``: {"recompute"?, "prime", "bulk", "layerwise"} samples."""
        samples = {}
        order = MODES if rep % 2 == 0 else MODES[::-1]
        if recompute:
            samples["recompute"] = self.send(order[1], self.fresh(length), 0)
        context = self.fresh(self.context_tokens(length))
        samples["prime"] = self.send(order[1], context, 0)
        for mode in order:
            samples[mode] = self.send(mode, context + self.fresh(length - len(context)), len(context))
            samples[mode]["expected_hit_tokens"] = len(context)
            if samples[mode]["cached_tokens"] != len(context):
                print(f"  warning: {mode} hit {samples[mode]['cached_tokens']} tokens, expected {len(context)}",
                      file=sys.stderr)
        return samples


def summarize(length: int, stored: int, samples: dict[str, list[dict]]) -> dict:
    """One table row; bulk and layerwise medians only over samples that got the whole stored hit.

    A load that failed (e.g. a store read past ``io_timeout_s``) makes vLLM
    recompute the hit: that sample measures recompute, not injection, and is
    kept in ``samples`` but left out of the medians (``*_full_hits`` counts the rest).
    """
    row = {
        "prompt_tokens": length,
        "stored_tokens": stored,
        "recompute_ttft_ms_median": median([s["ttft_s"] for s in samples.get("recompute", [])]) * 1000,
    }
    for mode in MODES:
        full = [s for s in samples[mode] if s["cached_tokens"] == stored]
        row[f"{mode}_ttft_ms_median"] = median([s["ttft_s"] for s in full]) * 1000
        row[f"{mode}_load_ms_median"] = median([s["load_s"] for s in full]) * 1000
        row[f"{mode}_after_load_ms_median"] = median([s["ttft_s"] - s["load_s"] for s in full]) * 1000
        row[f"{mode}_full_hits"] = f"{len(full)}/{len(samples[mode])}"
    row["layerwise_vs_bulk"] = row["layerwise_ttft_ms_median"] / row["bulk_ttft_ms_median"]
    row["samples"] = samples
    return row


def run(args: argparse.Namespace) -> dict:
    rows = []
    # Same bucket and key prefix (configs/single.json) for both: one store, one namespace.
    stack = {mode: {"extra": {"load_mode": mode}} for mode in MODES}
    with vllm_stack(args, "bench-injection", stack, {"io_timeout_s": args.store_io_timeout}) as servers:
        bench = Bench(servers, chunk_tokens(servers["bulk"]), args)

        if args.warmup:
            # First requests pay one-time costs (kernels, NIXL OBJ connections): one repetition, discarded.
            length = min(WARMUP_TOKENS, *args.sizes)
            print(f"warm-up ({length} tokens, both servers) ...", file=sys.stderr)
            bench.rep(length, 0, recompute=False)
            bench.rep(length, 1, recompute=False)

        for length in args.sizes:
            samples: dict[str, list[dict]] = {}
            for rep in range(args.reps):
                for kind, sample in bench.rep(length, rep, args.recompute).items():
                    samples.setdefault(kind, []).append(sample)
                    print(f"{length:>6} tokens rep {rep + 1}/{args.reps} {kind:>9} on {sample['server']:>9}: TTFT "
                          f"{sample['ttft_s'] * 1000:8.1f} ms, cached {sample['cached_tokens']}, "
                          f"load {sample['load_s'] * 1000:.0f} ms", file=sys.stderr)
            rows.append(summarize(length, bench.context_tokens(length), samples))
        traffic = {mode: store_traffic(server) for mode, server in servers.items()}
    return result_payload(args, store_traffic=traffic, results=rows)


def table(payload: dict) -> str:
    rows = [
        [
            r["prompt_tokens"],
            r["stored_tokens"],
            f"{r['recompute_ttft_ms_median']:.0f}",
            f"{r['bulk_ttft_ms_median']:.0f}",
            f"{r['layerwise_ttft_ms_median']:.0f}",
            f"{r['layerwise_vs_bulk']:.2f}x",
            f"{r['bulk_load_ms_median']:.0f}",
            f"{r['layerwise_load_ms_median']:.0f}",
            f"{r['bulk_after_load_ms_median']:.0f}",
            f"{r['layerwise_after_load_ms_median']:.0f}",
            f"{r['bulk_full_hits']}, {r['layerwise_full_hits']}",
        ]
        for r in payload["results"]
    ]
    caption = (
        f"{ttft_caption(payload)} bulk / layerwise: the prompt's first {payload['config']['hit_fraction']:.0%} "
        f"(whole chunks) was stored by an earlier request, the same stored chunks for both servers; recompute: "
        f"a never-seen prompt of the same length (0% hit). "
        f"layerwise/bulk: ratio of the median TTFTs. load ms: the connector's load_seconds (store read, plus "
        f"the KV cache copy in bulk mode); TTFT-load: the rest of the TTFT, per sample (lookup, scheduling, the "
        f"forward of the new tokens, with the layerwise copies in it). full hits: samples that got the whole "
        f"stored hit, the only ones in the bulk and layerwise medians (a failed load is recomputed)."
    )
    headers = ["prompt tokens", "stored tokens", "recompute TTFT ms", "bulk TTFT ms", "layerwise TTFT ms",
               "layerwise/bulk", "bulk load ms", "layerwise load ms", "bulk TTFT-load ms", "layerwise TTFT-load ms",
               "full hits (bulk, layerwise)"]
    return markdown_table(headers, rows, caption)


def chart(payload: dict, path: Path) -> Path | None:
    rows = payload["results"]
    series = {
        f"bulk ({payload['config']['hit_fraction']:.0%} hit)": [r["bulk_ttft_ms_median"] for r in rows],
        f"layerwise ({payload['config']['hit_fraction']:.0%} hit)": [r["layerwise_ttft_ms_median"] for r in rows],
    }
    if payload["config"]["recompute"]:
        series = {"recompute (0% hit)": [r["recompute_ttft_ms_median"] for r in rows], **series}
    title = f"TTFT, bulk vs layerwise injection (vLLM CPU, median of {payload['config']['reps']})"
    return bar_chart(path, [size_label(r["prompt_tokens"]) for r in rows], series, "prompt tokens", title)


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
    add_server_args(parser)
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
