"""``make demo``: one vLLM engine (CPU, tiny Llama) with the connector, KV in a local S3 server.

Runs a 5-turn agent-style conversation whose prompt grows every turn and
prints per turn the prompt tokens, the tokens whose KV came from the store,
and the time to first token. The engine runs with vLLM's local prefix cache
off, so every hit shown was read from S3. Between turns the demo waits until
the previous turn's chunks are in the bucket, as an agent's tool call would
give them time to land (saves are asynchronous). Everything started here is
stopped on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
from pathlib import Path

from dualpath_connector.protocol import METRIC_PREFIX, counter_total_name
from dualpath_dev.engines import VLLMServer, cached_tokens
from dualpath_dev.seaweedfs import SeaweedFS
from dualpath_dev.tiny_model import make_tiny_llama

STORE_WAIT_S = 60.0


def run(workdir: Path, turns: int, first_prompt_tokens: int, tokens_per_turn: int, output_tokens: int) -> dict:
    model = make_tiny_llama(workdir / "tiny-llama")
    rows = []
    with SeaweedFS() as s3:
        print(f"S3 (SeaweedFS) on {s3.endpoint}")
        server = VLLMServer(model, s3, (workdir / "demo-vllm.log").resolve())
        print(f"vLLM with DualPathConnector starting on {server.base_url} (log: {server.log_path}) ...")
        with server:
            rng = random.Random(0)
            context = [rng.randrange(1024) for _ in range(first_prompt_tokens)]
            print(f"\n{'turn':>4} {'prompt tokens':>14} {'hit tokens':>11} {'TTFT ms':>9}")
            for turn in range(1, turns + 1):
                ttft, output, usage = server.complete(context, output_tokens)
                rows.append(
                    {"turn": turn, "prompt_tokens": len(context), "hit_tokens": cached_tokens(usage), "ttft_s": ttft}
                )
                print(f"{turn:>4} {len(context):>14} {cached_tokens(usage):>11} {ttft * 1000:>9.0f}")
                # Every chunk whose KV was computed (prompt and output but the
                # last token) is saved; each turn's chunks extend the last's.
                try:
                    server.wait_stored(context + output[:-1], STORE_WAIT_S)
                except TimeoutError:  # the next turn then shows a shorter hit; the demo goes on
                    print(f"  (only part of the previous turn's chunks landed within {STORE_WAIT_S:.0f}s)")
                # The agent appends the model's answer and a new observation.
                context = context + output + [rng.randrange(1024) for _ in range(tokens_per_turn)]
            read = server.metric_total(counter_total_name("bytes_read"))
            written = server.metric_total(counter_total_name("bytes_written"))
            print(f"\nstore traffic reported so far: {read / 2**20:.1f} MiB read, {written / 2**20:.1f} MiB written")
            stall = {part: server.metric_total(f"{METRIC_PREFIX}layer_{part}") for part in
                     ("wait_seconds_count", "wait_seconds_sum", "load_seconds_sum")}  # fmt: skip
            hidden = 1 - stall["wait_seconds_sum"] / stall["load_seconds_sum"] if stall["load_seconds_sum"] else 0.0
            print(f"layerwise loads: {stall['wait_seconds_count']:.0f} forwards waited "
                  f"{stall['wait_seconds_sum'] * 1000:.1f} ms of {stall['load_seconds_sum'] * 1000:.1f} ms loading "
                  f"({max(0.0, hidden):.0%} hidden behind compute)")  # fmt: skip
    return {"turns": rows, "bytes_read": read, "bytes_written": written, "layer_stall": stall, "log": server.log_path}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(".cache"))
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--first-prompt-tokens", type=int, default=2000)
    parser.add_argument("--tokens-per-turn", type=int, default=300)
    parser.add_argument("--output-tokens", type=int, default=32)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    # SIGTERM unwinds like Ctrl-C, so the context managers stop what was started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run(args.workdir, args.turns, args.first_prompt_tokens, args.tokens_per_turn, args.output_tokens)


if __name__ == "__main__":
    main()
