"""End-to-end effect of a local Dual-Blade tier: agents' TTFT with ``tiered: [dualblade, s3]`` vs ``s3`` alone.

One SeaweedFS (S3 on 127.0.0.1) and two vLLM OpenAI servers with DualPathConnector side by side (the
tiny random Llama, vLLM's local prefix cache off, so every hit comes from a store): ``s3`` stores in
one bucket; ``tiered`` in another behind a local ``dualblade`` tier under ``--workdir`` (write-through,
so its hits are read from the local tier). Each of ``--agents`` agents runs ``--turns`` turns like
``make demo-single``'s conversation: a first prompt of ``--first-prompt-tokens``, then per turn
``--tokens-per-turn`` new tokens (a tool's output) appended; every turn goes to both servers (order
alternating), and the next turn starts once both stored the turn's chunks. Reported: median TTFT over
the hit turns (turn 2 on) per server, the ratio, the hit tokens, and the local tier's counters from
the tiered server's ``/metrics``. Results in ``benchmarks/results/tiered-ttft.{json,png}``.

What limits it: both servers and SeaweedFS share two cores, S3 is on loopback (no storage NIC to
spare), and the tiny model's chunks are small, so the store read is a small part of TTFT here; on a
serving node the local tier spares the storage NIC, which this machine cannot show.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from _common import bar_chart, exit_on_sigterm, markdown_table, median, result_payload, run_and_report  # noqa: E402

from dualpath_connector.protocol import counter_total_name  # noqa: E402
from dualpath_dev.engines import VLLMServer, cached_tokens  # noqa: E402
from dualpath_dev.seaweedfs import SeaweedFS  # noqa: E402
from dualpath_dev.tiny_model import make_tiny_llama  # noqa: E402

SERVERS = ("s3", "tiered")
LOCAL_COUNTERS = ("local_tier_hit_chunks", "local_tier_miss_chunks", "local_tier_page_cache_bytes_read",
                  "local_tier_direct_bytes_read")


def run(args: argparse.Namespace) -> dict:
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = make_tiny_llama(args.workdir / "tiny-llama")
    samples: dict[str, list[dict]] = {name: [] for name in SERVERS}
    with SeaweedFS() as s3:
        shared = {"backend": "s3", "endpoint": s3.endpoint, "bucket": "bench-tiered-shared", "addressing_style": "path"}
        local_root = (args.workdir / "bench-tiered-local").resolve()
        shutil.rmtree(local_root, ignore_errors=True)  # a tier left by an earlier run would hit from turn 1
        local = {"backend": "dualblade", "root": str(local_root), "capacity_bytes": args.local_capacity_mib << 20}
        stores = {"s3": {**shared, "bucket": "bench-tiered-s3"}, "tiered": {"backend": "tiered", "tiers": [local, shared]}}
        servers = {name: VLLMServer(model, s3, (args.workdir / f"bench-tiered-{name}-vllm.log").resolve(),
                                    max_model_len=args.max_model_len, extra={"store": stores[name]})
                   for name in SERVERS}
        try:
            for name, server in servers.items():
                print(f"vLLM {name} starting on {server.base_url}; log: {server.log_path}", file=sys.stderr)
                server.start(args.start_timeout)
            rng = random.Random(args.seed)
            for agent in range(args.agents):
                context = [rng.randrange(1024) for _ in range(args.first_prompt_tokens)]
                for turn in range(1, args.turns + 1):
                    order = SERVERS if (agent + turn) % 2 else SERVERS[::-1]
                    for name in order:
                        ttft, output, usage = servers[name].complete(context, args.output_tokens)
                        samples[name].append({"agent": agent, "turn": turn, "prompt_tokens": len(context),
                                              "hit_tokens": cached_tokens(usage), "ttft_s": ttft})
                        servers[name].wait_stored(context + output[:-1], args.save_timeout)
                    context = context + [rng.randrange(1024) for _ in range(args.tokens_per_turn)]
            local_counters = {name: servers["tiered"].metric_total(counter_total_name(name)) for name in LOCAL_COUNTERS}
        finally:
            for server in servers.values():
                server.stop()
    return result_payload(args, samples=samples, local_tier=local_counters)


def summary(payload: dict) -> dict[str, dict]:
    out = {}
    for name, rows in payload["samples"].items():
        hits = [r for r in rows if r["turn"] > 1]
        out[name] = {"ttft_ms_median": median([r["ttft_s"] for r in hits]) * 1000,
                     "hit_tokens_median": median([r["hit_tokens"] for r in hits]),
                     "first_turn_ttft_ms_median": median([r["ttft_s"] for r in rows if r["turn"] == 1]) * 1000}
    return out


def table(payload: dict) -> str:
    stats = summary(payload)
    rows = [[name, f"{s['first_turn_ttft_ms_median']:.0f}", f"{s['ttft_ms_median']:.0f}", f"{s['hit_tokens_median']:.0f}",
             f"{stats['s3']['ttft_ms_median'] / s['ttft_ms_median']:.2f}x"] for name, s in stats.items()]
    config = payload["config"]
    caption = (f"{config['agents']} agents x {config['turns']} turns, first prompt {config['first_prompt_tokens']} tokens, "
               f"+{config['tokens_per_turn']} per turn; median over hit turns (2..). Local tier: "
               + ", ".join(f"{k} {v:.0f}" for k, v in payload["local_tier"].items()))
    return markdown_table(["store", "turn 1 TTFT ms", "hit-turn TTFT ms", "hit tokens", "s3 / this"], rows, caption)


def chart(payload: dict, path: Path) -> Path | None:
    stats = summary(payload)
    return bar_chart(path, ["turn 1 (no hit)", "hit turns"],
                     {name: [s["first_turn_ttft_ms_median"], s["ttft_ms_median"]] for name, s in stats.items()},
                     "turns", "Agents' TTFT: s3 alone vs a local Dual-Blade tier in front")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(".cache"))
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first-prompt-tokens", type=int, default=2000)
    parser.add_argument("--tokens-per-turn", type=int, default=300)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--local-capacity-mib", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--save-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="tiered-ttft", help="base name under benchmarks/results/")
    args = parser.parse_args()
    exit_on_sigterm()
    run_and_report(run, table, args, f"{args.output}.json", chart)


if __name__ == "__main__":
    main()
