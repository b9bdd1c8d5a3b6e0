"""``make demo``: one vLLM engine (CPU, tiny Llama) with the connector, KV in a local S3 server.

Runs a 5-turn agent-style conversation whose prompt grows every turn and
prints per turn the prompt tokens, the tokens whose KV came from the store,
and the time to first token. The engine runs with vLLM's local prefix cache
off, so every hit shown was read from S3. Everything started here is stopped
on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dualpath_connector.devstack import SeaweedFS, free_port, make_tiny_llama, stop_process_group

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "single.json"


def _post_stream(url: str, body: dict) -> tuple[float, list[int], dict]:
    """POST a streaming completion; return (seconds to first token, token ids, usage)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    first_token_s = None
    tokens: list[int] = []
    usage: dict = {}
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            for choice in event.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and first_token_s is None:
                    first_token_s = time.perf_counter() - started
                tokens.extend(ids)
            usage = event.get("usage") or usage
    return first_token_s or float("nan"), tokens, usage


def _metric_total(base_url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=30).read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def _wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode} during start-up")
        try:
            if urllib.request.urlopen(f"{base_url}/health", timeout=5).status == 200:
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vLLM not healthy after {timeout_s}s")


def run(workdir: Path, turns: int, first_prompt_tokens: int, tokens_per_turn: int, output_tokens: int) -> None:
    model = make_tiny_llama(workdir / "tiny-llama")
    server = None
    proc = None
    try:
        server = SeaweedFS().start()
        print(f"S3 (SeaweedFS) on {server.endpoint}")
        kv_config = json.loads(CONFIG.read_text())
        kv_config["kv_connector_extra_config"]["store"]["endpoint"] = server.endpoint
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        # Credentials travel in the standard AWS variables, never on the
        # command line, where vLLM would log them with its arguments.
        env = dict(
            os.environ,
            AWS_ACCESS_KEY_ID=server.access_key,
            AWS_SECRET_ACCESS_KEY=server.secret_key,
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_NUM_OF_RESERVED_CPU="1",
        )
        log_path = workdir / "demo-vllm.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                    "--model", str(model), "--skip-tokenizer-init", "--dtype", "bfloat16",
                    "--block-size", "32", "--enforce-eager", "--seed", "0",
                    "--host", "127.0.0.1", "--port", str(port),
                    "--max-model-len", "8192", "--no-enable-prefix-caching",
                    "--enable-prompt-tokens-details",
                    "--kv-transfer-config", json.dumps(kv_config),
                ],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        print(f"vLLM with DualPathConnector starting on {base_url} (log: {log_path}) ...")
        _wait_healthy(base_url, proc, timeout_s=600)

        rng = random.Random(0)
        context = [rng.randrange(1024) for _ in range(first_prompt_tokens)]
        print(f"\n{'turn':>4} {'prompt tokens':>14} {'hit tokens':>11} {'TTFT ms':>9}")
        for turn in range(1, turns + 1):
            ttft, output, usage = _post_stream(
                f"{base_url}/v1/completions",
                {
                    "model": str(model),
                    "prompt": context,
                    "max_tokens": output_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "return_token_ids": True,
                },
            )
            hit = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            print(f"{turn:>4} {len(context):>14} {hit:>11} {ttft * 1000:>9.0f}")
            # The agent appends the model's answer and a new observation.
            context = context + output + [rng.randrange(1024) for _ in range(tokens_per_turn)]
        read = _metric_total(base_url, "dualpath_kv:bytes_read_total")
        written = _metric_total(base_url, "dualpath_kv:bytes_written_total")
        print(f"\nstore traffic: {read / 2**20:.1f} MiB read, {written / 2**20:.1f} MiB written")
    finally:
        if proc is not None:
            stop_process_group(proc, grace_s=20.0)
        if server is not None:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(".cache"))
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--first-prompt-tokens", type=int, default=2000)
    parser.add_argument("--tokens-per-turn", type=int, default=300)
    parser.add_argument("--output-tokens", type=int, default=32)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    # SIGTERM unwinds like Ctrl-C, so the finally block stops what was started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run(args.workdir, args.turns, args.first_prompt_tokens, args.tokens_per_turn, args.output_tokens)


if __name__ == "__main__":
    main()
