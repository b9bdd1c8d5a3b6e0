"""TTFT with a store hit vs full recompute on vLLM's CPU build, per prompt length, side by side.

One SeaweedFS (S3 on 127.0.0.1) and one vLLM OpenAI server with DualPathConnector
(``configs/single.json``, the tiny random Llama, vLLM's local prefix cache off)
serve every measurement. For each prompt length L and repetition:

- recompute: a prompt of L + 16 fresh random token ids (never seen, so no hit);
- hit: a fresh prompt X of L tokens is sent once to populate the store; when its
  chunks have landed (``dualpath_kv:saved_chunks_total`` on ``/metrics``), X + 16
  new tokens is sent and its KV for X is loaded from S3 instead of recomputed.

TTFT is the time from sending the request to the first streamed chunk carrying
token ids (``max_tokens=1``). Medians go to a markdown table and
``benchmarks/results/ttft.json`` (and ``ttft.png`` when matplotlib is importable).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    REPO_ROOT,
    RESULTS_DIR,
    environment,
    exit_on_sigterm,
    markdown_table,
    median,
    run_and_report,
)

from dualpath_connector.devstack import SeaweedFS, VLLMServer, cached_tokens, make_tiny_llama  # noqa: E402

VOCAB = 1024  # the tiny Llama's vocabulary
PROBE_TOKENS = 8  # shorter than a chunk: a probe is never looked up and never saved


def save_counters(server: VLLMServer) -> tuple[int, int]:
    return (
        int(server.metric_total("dualpath_kv:saved_chunks_total")),
        int(server.metric_total("dualpath_kv:save_skipped_chunks_total")),
    )


# --- the benchmark -------------------------------------------------------------------------------


class Bench:
    def __init__(self, server: VLLMServer, chunk_tokens: int, args: argparse.Namespace) -> None:
        self.server = server
        self.chunk_tokens = chunk_tokens
        self.args = args
        self.rng = random.Random(args.seed)
        self.saved, self.skipped = save_counters(server)

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def request(self, prompt: list[int]) -> tuple[float, int]:
        ttft, _, usage = self.server.complete(prompt, 1, self.args.request_timeout)
        return ttft, cached_tokens(usage)

    def wait_saves(self, expected_new: int) -> dict:
        """Wait until ``expected_new`` more chunks were saved (or skipped) since the last wait.

        The connector's counters reach ``/metrics`` only with an engine step, and
        a save finishes on the I/O thread after the step that planned it; an idle
        engine would never report it. So while the counters lag, a tiny probe
        request (shorter than one chunk: never looked up, never saved) makes the
        engine step. Gives up after ``--save-timeout`` seconds; also returns when
        the counters stop increasing for ``--save-settle`` seconds of probing.
        """
        started = time.monotonic()
        target = self.saved + self.skipped + expected_new
        last_total, last_change = -1, started
        probes = 0
        while True:
            saved, skipped = save_counters(self.server)
            total = saved + skipped
            now = time.monotonic()
            if total != last_total:
                last_total, last_change = total, now
            if total >= target:
                status = "landed"
                break
            if now - started > self.args.save_timeout:
                status = "timeout"
                break
            if now - last_change > self.args.save_settle:
                status = "stopped increasing"
                break
            time.sleep(0.2)
            self.server.complete(self.fresh(PROBE_TOKENS), 1, self.args.request_timeout)
            probes += 1
        info = {
            "expected_chunks": expected_new,
            "saved_chunks": saved - self.saved,
            "skipped_chunks": skipped - self.skipped,
            "wait_s": round(time.monotonic() - started, 3),
            "probes": probes,
            "status": status,
        }
        self.saved, self.skipped = saved, skipped
        if status != "landed" or info["skipped_chunks"]:
            print(f"  warning: save wait {info}", file=sys.stderr)
        return info

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
        ttft, hit = self.request(prompt)
        # Chunks of X are stored already; only chunks completed by the new tokens are saved.
        after = self.wait_saves(len(prompt) // self.chunk_tokens - len(context) // self.chunk_tokens)
        return {
            "ttft_s": ttft,
            "cached_tokens": hit,
            "prompt_tokens": len(prompt),
            "populate_ttft_s": populate_ttft,
            "populate_cached_tokens": populate_hit,
            "save": save,
            "save_after_hit": after,
        }


def run(args: argparse.Namespace) -> dict:
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = make_tiny_llama(args.workdir / "tiny-llama")
    log_path = (args.workdir / "bench-ttft-vllm.log").resolve()
    s3 = None
    server = None
    rows = []
    try:
        s3 = SeaweedFS().start()
        print(f"S3 (SeaweedFS) on {s3.endpoint}", file=sys.stderr)
        server = VLLMServer(model, s3, log_path, max_model_len=args.max_model_len)
        print(f"vLLM starting on {server.base_url}; log: {log_path}", file=sys.stderr)
        started = time.monotonic()
        server.start(args.start_timeout)
        print(f"vLLM healthy after {time.monotonic() - started:.0f}s", file=sys.stderr)
        chunk_tokens = server.kv_config["kv_connector_extra_config"].get("chunk_tokens", 32)  # default: block size 32
        bench = Bench(server, chunk_tokens, args)

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
                "speedup": rec / hit,
                "hit_tokens_median": median([s["cached_tokens"] for s in samples["hit"]]),
                "recompute_cached_tokens_max": max(s["cached_tokens"] for s in samples["recompute"]),
                "samples": samples,
            })
        store_traffic = {
            "bytes_read_total": server.metric_total("dualpath_kv:bytes_read_total"),
            "bytes_written_total": server.metric_total("dualpath_kv:bytes_written_total"),
            "loaded_tokens_total": server.metric_total("dualpath_kv:loaded_tokens_total"),
            "load_failed_tokens_total": server.metric_total("dualpath_kv:load_failed_tokens_total"),
        }
    finally:
        if server is not None:
            server.stop()
        if s3 is not None:
            s3.stop()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {"config": config, "environment": environment(), "store_traffic": store_traffic, "results": rows}


def table(payload: dict) -> str:
    cfg = payload["config"]
    rows = [
        [
            r["context_tokens"],
            r["prompt_tokens"],
            f"{r['recompute_ttft_ms_median']:.0f}",
            f"{r['hit_ttft_ms_median']:.0f}",
            f"{r['speedup']:.2f}x",
            f"{r['hit_tokens_median']:.0f}",
        ]
        for r in payload["results"]
    ]
    caption = (
        f"TTFT on vLLM's CPU build ({payload['environment']['cpu_count']} cores, tiny random Llama, bf16, "
        f"max_tokens=1), median of {cfg['reps']} repetition(s) with fresh random prompts each; local prefix "
        f"cache off, so every hit token was loaded from S3 (SeaweedFS on 127.0.0.1). recompute: "
        f"{cfg['extra_tokens']} more tokens than the context, all computed; hit: the same length, of which "
        f"the context's chunks come from the store."
    )
    headers = ["context tokens", "prompt tokens", "recompute TTFT ms", "hit TTFT ms", "speedup", "hit tokens"]
    return markdown_table(headers, rows, caption)


def chart(payload: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = payload["results"]
    labels = [f"{r['context_tokens'] // 1024}k" if r["context_tokens"] % 1024 == 0 else str(r["context_tokens"])
              for r in rows]
    x = range(len(rows))
    width = 0.38
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    rec = ax.bar([i - width / 2 for i in x], [r["recompute_ttft_ms_median"] for r in rows], width, label="recompute")
    hit = ax.bar([i + width / 2 for i in x], [r["hit_ttft_ms_median"] for r in rows], width, label="store hit (S3)")
    ax.bar_label(rec, fmt="%.0f", fontsize=8)
    ax.bar_label(hit, fmt="%.0f", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("median TTFT (ms)")
    ax.set_title(f"TTFT, hit vs recompute (vLLM CPU, median of {payload['config']['reps']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192, 16384], help="context lengths (tokens)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per length (the median is reported)")
    parser.add_argument("--extra-tokens", type=int, default=16, help="new tokens after the stored context")
    parser.add_argument("--max-model-len", type=int, default=20480)
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the discarded warm-up pair")
    parser.add_argument("--workdir", type=Path, default=REPO_ROOT / ".cache", help="model and vLLM log go here")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds for vLLM to become healthy")
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument("--save-timeout", type=float, default=120.0, help="seconds to wait for saves to land")
    parser.add_argument("--save-settle", type=float, default=10.0,
                        help="stop waiting when the save counters did not move for this long")
    parser.add_argument("--seed", type=int, default=0)
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
    payload = run_and_report(run, table, args, f"{args.output}.json")
    png = chart(payload, RESULTS_DIR / f"{args.output}.png")
    if png is not None:
        print(f"chart: {png}")


if __name__ == "__main__":
    main()
