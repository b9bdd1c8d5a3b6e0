"""``make demo``: the 1P1D stack on one machine (run through ``examples/disagg_demo.sh``).

SeaweedFS (S3), one prefill engine (``configs/pe.json``) and one decode engine
(``configs/de.json``), both vLLM on CPU with the tiny test Llama, and
``dualpath-router`` with the ``dualpath`` policy in front. First a chat, as a
user sends it: a few turns through the official ``openai`` client
(``examples/chat_client.py``), streaming, each turn the whole conversation so
far; it prints the streamed text and per turn the read side and hit tokens
from the router's ``x-dualpath-*`` headers. The tiny model has random
weights, so its text is gibberish; the tokenizer and the chat template are
real (``dualpath_dev/tokenizer.py``). Then two agents run a multi-turn
session at the same time on token ids; every turn appends the model's answer
and a new observation to the agent's context. Per turn it prints the read
side the router chose, the hit tokens and the time of the whole
(non-streaming) request, and at the end the bytes each side read from the
store. Everything started here is stopped on exit, also on Ctrl-C.

The engines get a random API key and cluster key per run in their
environment (``VLLM_API_KEY``, ``DUALPATH_CLUSTER_KEY``), the router the API
key (``DUALPATH_ENGINE_API_KEY``): only the router talks to the engines.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

from dualpath_connector.protocol import counter_total_name
from dualpath_dev.engines import ClusterKeys, RouterProcess, VLLMServer
from dualpath_dev.processes import start_all
from dualpath_dev.seaweedfs import SeaweedFS
from dualpath_dev.tiny_model import make_tiny_llama

# Run as a script, examples/ is on sys.path: the demo chats through the copyable client itself, so it cannot rot.
from chat_client import chat  # noqa: E402  (after the installed packages on purpose)

# Long enough (more than one 32-token chunk) that the second turn already finds stored chunks.
CHAT_SYSTEM = (
    "You are the assistant of a team that serves agents with long contexts. Answer in one or two short "
    "sentences, name the component you mean, and say when you do not know."
)
CHAT_USER_TURNS = (
    "Hello! What does the router do with my request?",
    "Where does the KV cache of my previous turns live?",
    "And which side reads it back, the prefill or the decode engine?",
    "Thanks. Summarize this conversation in one line.",
)


def _agent(session: dict, agent: int, args: argparse.Namespace, rows: list, start: threading.Barrier) -> None:
    try:
        _turns(session, agent, args, rows, start)
    except BaseException:
        start.abort()  # the other agents stop waiting for this one
        raise


def _turns(session: dict, agent: int, args: argparse.Namespace, rows: list, start: threading.Barrier) -> None:
    router, model = session["router"], session["model"]
    rng = random.Random(agent)
    context = [rng.randrange(1024) for _ in range(args.first_prompt_tokens)]
    for turn in range(1, args.turns + 1):
        # Agents send each turn together, as a batch of tool results would.
        start.wait()
        answer, headers, seconds = router.complete(
            {"model": model, "prompt": context, "max_tokens": args.output_tokens, "temperature": 0.0,
             "ignore_eos": True, "return_token_ids": True}
        )  # fmt: skip
        output = answer["choices"][0]["token_ids"]
        rows.append(
            {
                "agent": agent, "turn": turn, "prompt_tokens": len(context),
                "read_side": headers.get("x-dualpath-read-side", "?"),
                "hit_tokens": int(headers.get("x-dualpath-hit-tokens", 0)), "seconds": seconds,
            }
        )  # fmt: skip
        print(
            f"agent {agent} turn {turn:>2}: {len(context):>6} prompt tokens, read side {rows[-1]['read_side']:>2}, "
            f"{rows[-1]['hit_tokens']:>6} hit tokens, {seconds * 1000:>7.0f} ms",
            flush=True,
        )
        # Saves are asynchronous: the next turn waits for this one's chunks, as a tool call would.
        session["de"].wait_stored(context + output[:-1])
        context = context + output + [rng.randrange(1024) for _ in range(args.tokens_per_turn)]


def _chat(session: dict, args: argparse.Namespace) -> list[dict]:
    """A streaming multi-turn chat through the openai client; each turn waits for its prompt's chunks."""
    from transformers import AutoTokenizer

    router, de = session["router"], session["de"]
    # The router's tokenizer (the model directory's): the demo needs the prompt's ids to wait for its chunks.
    tokenizer = AutoTokenizer.from_pretrained(session["model"])
    # The router asks clients for no key; a failed turn fails the demo at once instead of being retried.
    client = OpenAI(base_url=f"{router.url}/v1", api_key="none", timeout=120.0, max_retries=0)
    print("== chat: the openai client, streaming (random weights: the answers are gibberish) ==", flush=True)
    rows = []
    # Greedy, so the same run prints the same text.
    for turn in chat(client, session["model"], CHAT_USER_TURNS[: args.chat_turns], system=CHAT_SYSTEM,
                     max_tokens=args.chat_max_tokens, temperature=0.0):
        rows.append({"read_side": turn.read_side, "hit_tokens": turn.hit_tokens, "chunks": turn.chunks,
                     "characters": len(turn.text)})
        # Saves are asynchronous: the next turn waits for this prompt's chunks, as a user's typing would.
        de.wait_stored(tokenizer.apply_chat_template(turn.messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
    print(flush=True)
    return rows


def run(args: argparse.Namespace) -> dict:
    workdir = args.workdir.resolve()
    model = make_tiny_llama(workdir / "tiny-llama")
    rows: list[dict] = []
    with SeaweedFS() as s3:
        print(f"S3 (SeaweedFS) on {s3.endpoint}")
        # Random per run: the engines answer only the router (API key), the side channel only its peers.
        keys = ClusterKeys.generate()
        pe = VLLMServer(model, s3, workdir / "demo-pe.log", config="pe.json", keys=keys)
        de = VLLMServer(model, s3, workdir / "demo-de.log", config="de.json", keys=keys)
        print(f"PE {pe.base_url} (side channel {pe.side_channel}), DE {de.base_url} (side channel {de.side_channel})")
        print(f"starting both engines (logs: {pe.log_path}, {de.log_path}) ...", flush=True)
        with contextlib.ExitStack() as running:
            running.callback(de.stop)
            running.callback(pe.stop)
            # Side by side: an engine's start-up is mostly single-threaded imports.
            start_all([pe, de])
            router = running.enter_context(RouterProcess([pe], [de], s3, workdir, policy="dualpath"))
            print(f"dualpath-router on {router.url} (log: {router.log_path})\n", flush=True)
            session = {"router": router, "model": str(model), "de": de}
            chat_rows = _chat(session, args) if args.chat_turns else []
            print(f"== {args.agents} agents, token ids, non-streaming ==", flush=True)
            start = threading.Barrier(args.agents)
            with ThreadPoolExecutor(args.agents) as pool:
                # result() re-raises an agent's failure here.
                for future in [pool.submit(_agent, session, a, args, rows, start) for a in range(args.agents)]:
                    future.result()
            # Connector stats reach /metrics with engine steps; the DE's last
            # decode steps carry its reads.
            time.sleep(2.0)
            pe_read = pe.metric_total(counter_total_name("bytes_read"))
            de_read = de.metric_total(counter_total_name("bytes_read_for_peer"))
            pulled = pe.metric_total(counter_total_name("bytes_pulled_from_peer"))
            # The PE saves the prompt chunks it computed, the DE those decoding completed.
            written = {name: e.metric_total(counter_total_name("bytes_written")) for name, e in (("PE", pe), ("DE", de))}
    sides = sorted({r["read_side"] for r in rows if r["hit_tokens"]})
    print(f"\nread sides used for hits: {', '.join(sides) or 'none'}")
    print(f"bytes read from the store: PE side {pe_read / 2**20:.1f} MiB, DE side {de_read / 2**20:.1f} MiB "
          f"(pulled by the PE from the DE over NIXL: {pulled / 2**20:.1f} MiB); written by the PE "
          f"{written['PE'] / 2**20:.1f} MiB and the DE {written['DE'] / 2**20:.1f} MiB")  # fmt: skip
    return {"chat": chat_rows, "turns": rows, "pe_bytes_read": pe_read, "de_bytes_read": de_read, "pulled": pulled,
            "written": sum(written.values())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(".cache"))
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-prompt-tokens", type=int, default=3000)
    parser.add_argument("--tokens-per-turn", type=int, default=300)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--chat-turns", type=int, default=3, choices=range(len(CHAT_USER_TURNS) + 1),
                        help="turns of the chat before the agents (0: no chat)")
    parser.add_argument("--chat-max-tokens", type=int, default=24)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    # SIGTERM unwinds like Ctrl-C, so the context managers stop what was started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run(args)


if __name__ == "__main__":
    main()
