"""TTFT with a store hit vs full recompute on vLLM's CPU build, per prompt length, side by side.

One SeaweedFS (S3 on 127.0.0.1) and one vLLM OpenAI server with DualPathConnector
(``configs/single.json``, the tiny random Llama, vLLM's local prefix cache off)
serve every measurement. For each prompt length L and repetition:

- recompute: a prompt of L + 16 fresh random token ids (never seen, so no hit);
- hit: a fresh prompt X of L tokens is sent once to populate the store; when its
  chunks have landed (``dualpath_kv:saved_chunks_total`` on ``/metrics``), X + 16
  new tokens is sent and its KV for X is loaded from S3 instead of recomputed.

TTFT is the time from sending the request to the first streamed chunk carrying
token ids (``max_tokens=1``). Every hit's chunks are checked against their
integrity digests before they reach the KV cache (``--integrity``: the
connector's ``checksum`` or ``keyed`` mode); the time that takes is part of
the hit TTFT and is reported beside it (``dualpath_kv:verify_seconds``). Medians go to a markdown table and
``benchmarks/results/ttft.json`` (and ``ttft.png`` when matplotlib is importable).
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
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


# --- the benchmark -------------------------------------------------------------------------------


class Bench:
    def __init__(self, server: VLLMServer, chunk_tokens: int, args: argparse.Namespace) -> None:
        self.server = server
        self.chunk_tokens = chunk_tokens
        self.args = args
        self.rng = random.Random(args.seed)
        self.wait_saves = SaveWaiter(server, args, self.fresh).wait

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def verify_seconds(self) -> float:
        return self.server.metric_total("dualpath_kv:verify_seconds_sum")

    def request(self, prompt: list[int]) -> tuple[float, int]:
        ttft, _, usage = self.server.complete(prompt, 1, self.args.request_timeout)
        return ttft, cached_tokens(usage)

    def recompute(self, length: int) -> dict:
        prompt = self.fresh(length + self.args.extra_tokens)
        ttft, hit = self.request(prompt)
        # Let this prompt's saves finish so they do not compete with the next measurement.
        save = self.wait_saves(len(prompt) // self.chunk_tokens)
        return {"ttft_s": ttft, "cached_tokens": hit, "prompt_tokens": len(prompt), "save": save}

    def hit(self, length: int) -> dict:
        context = self.fresh(length)
        populate_ttft, populate_hit = self.request(context)
        save = self.wait_saves(len(context) // self.chunk_tokens)
        prompt = context + self.fresh(self.args.extra_tokens)
        verified_before = self.verify_seconds()
        ttft, hit = self.request(prompt)
        # Chunks of X are stored already; only chunks completed by the new tokens are saved.
        after = self.wait_saves(len(prompt) // self.chunk_tokens - len(context) // self.chunk_tokens)
        return {
            "ttft_s": ttft,
            # Waiting for the saves also lets the step's connector stats reach /metrics.
            "verify_s": self.verify_seconds() - verified_before,
            "cached_tokens": hit,
            "prompt_tokens": len(prompt),
            "populate_ttft_s": populate_ttft,
            "populate_cached_tokens": populate_hit,
            "save": save,
            "save_after_hit": after,
        }


def run(args: argparse.Namespace) -> dict:
    rows = []
    if args.integrity == "keyed" and not os.environ.get("DUALPATH_INTEGRITY_KEY"):
        os.environ["DUALPATH_INTEGRITY_KEY"] = secrets.token_hex(16)  # the server inherits it
    with vllm_stack(args, "bench-ttft", {"": {"extra": {"integrity": args.integrity}}}) as servers:
        server = servers[""]
        bench = Bench(server, chunk_tokens(server), args)

        if args.warmup:
            # First requests pay one-time costs (kernels, NIXL OBJ connections); both paths once, discarded.
            length = min(args.sizes)
            print(f"warm-up ({length} tokens, both paths) ...", file=sys.stderr)
            bench.recompute(length)
            bench.hit(length)

        for length in args.sizes:
            samples: dict[str, list[dict]] = {"recompute": [], "hit": []}
            for rep in range(args.reps):
                # Alternate the order so a slow drift of the machine hits both alike.
                order = ("recompute", "hit") if rep % 2 == 0 else ("hit", "recompute")
                for kind in order:
                    sample = bench.recompute(length) if kind == "recompute" else bench.hit(length)
                    samples[kind].append(sample)
                    print(f"{length:>6} tokens rep {rep + 1}/{args.reps} {kind:>9}: TTFT "
                          f"{sample['ttft_s'] * 1000:8.1f} ms, cached {sample['cached_tokens']}", file=sys.stderr)
            rec = median([s["ttft_s"] for s in samples["recompute"]])
            hit = median([s["ttft_s"] for s in samples["hit"]])
            rows.append({
                "context_tokens": length,
                "prompt_tokens": length + args.extra_tokens,
                "recompute_ttft_ms_median": rec * 1000,
                "hit_ttft_ms_median": hit * 1000,
                "verify_ms_median": median([s["verify_s"] for s in samples["hit"]]) * 1000,
                "speedup": rec / hit,
                "hit_tokens_median": median([s["cached_tokens"] for s in samples["hit"]]),
                "recompute_cached_tokens_max": max(s["cached_tokens"] for s in samples["recompute"]),
                "samples": samples,
            })
        traffic = store_traffic(server)
    return result_payload(args, store_traffic=traffic, results=rows)


def table(payload: dict) -> str:
    rows = [
        [
            r["context_tokens"],
            r["prompt_tokens"],
            f"{r['recompute_ttft_ms_median']:.0f}",
            f"{r['hit_ttft_ms_median']:.0f}",
            f"{r['speedup']:.2f}x",
            f"{r['hit_tokens_median']:.0f}",
            f"{r['verify_ms_median']:.2f}",
            f"{100 * r['verify_ms_median'] / r['hit_ttft_ms_median']:.2f}%",
        ]
        for r in payload["results"]
    ]
    caption = (
        f"{ttft_caption(payload)} recompute: {payload['config']['extra_tokens']} more tokens than the context, "
        f"all computed; hit: the same length, of which the context's chunks come from the store, each checked "
        f"against its {payload['config']['integrity']} integrity digests first (verify ms: that check, "
        f"part of the hit TTFT)."
    )
    headers = ["context tokens", "prompt tokens", "recompute TTFT ms", "hit TTFT ms", "speedup", "hit tokens",
               "verify ms", "verify share"]
    return markdown_table(headers, rows, caption)


def chart(payload: dict, path: Path) -> Path | None:
    rows = payload["results"]
    series = {
        "recompute": [r["recompute_ttft_ms_median"] for r in rows],
        "store hit (S3)": [r["hit_ttft_ms_median"] for r in rows],
    }
    title = f"TTFT, hit vs recompute (vLLM CPU, median of {payload['config']['reps']})"
    return bar_chart(path, [size_label(r["context_tokens"]) for r in rows], series, "context tokens", title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192, 16384], help="context lengths (tokens)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per length (the median is reported)")
    parser.add_argument("--extra-tokens", type=int, default=16, help="new tokens after the stored context")
    parser.add_argument("--max-model-len", type=int, default=20480)
    parser.add_argument("--integrity", choices=["checksum", "keyed"], default="checksum",
                        help="the connector's integrity mode (keyed: a random DUALPATH_INTEGRITY_KEY unless set)")
    add_server_args(parser)
    parser.add_argument("--output", default="ttft", help="base name under benchmarks/results/ (.json, .png)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2k tokens only, 1 repetition")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.reps = [2048], 1
        if args.output == "ttft":
            args.output = "ttft-quick"
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if max(args.sizes) + args.extra_tokens + 1 > args.max_model_len:
        parser.error("--max-model-len must exceed the longest prompt plus one output token")
    exit_on_sigterm()
    run_and_report(run, table, args, f"{args.output}.json", chart)


if __name__ == "__main__":
    main()
