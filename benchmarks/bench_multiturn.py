"""A conversation's next turn through vLLM's multi-turn P/D proxy (the DE's retained decode) vs the store path.

One SeaweedFS (S3 on 127.0.0.1), a PD pair (``configs/pe.json``, ``configs/de.json`` with
``pd_retain_decode_s``; the tiny random Llama) and two P/D proxies in front of the same pair
(``tests/nixl_style_proxy.py``, which imports nothing of ours):

- ``store``: NixlConnector's convention: each turn's prefill engine finds the conversation's earlier turns
  in the store (the PE reads the hit from S3);
- ``retained``: ``--multiturn``, as vLLM's ``disagg_proxy_multiturn.py``: the conversation's next prefill
  gets the DE's last answer and the PE pulls the conversation's KV from the DE's retained blocks (NIXL
  READ), the store being the fallback where that does not apply.

Per repetition, one conversation per mode (order reversed every other repetition): a first turn of
``--context`` fresh tokens, then ``--turns`` - 1 turns each appending the last output and ``--append`` fresh
tokens; ``--output-tokens`` per turn, greedy, non-streamed. Before each next turn the script waits until the
last turn's chunks are in the bucket (both modes), so the store path always has its hit. Reported per turn
after the first (the turns with something to reuse): the time through the proxy (PE prefill with its hit,
hand-off, DE pull and decode), and from the PE's /metrics the tokens it pulled from the DE and the bytes it
read from S3: a ``retained`` turn that read the store, or a ``store`` turn that pulled, is not on its path
and is left out of the medians (counted). ``--store-rtt-ms``: every engine request to S3 waits that long
in a relay (the retained path does not touch S3). Output: ``benchmarks/results/<output>.{json,png}``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # dualpath_dev: the checkout's dev scaffolding
from _common import (  # noqa: E402
    REPO_ROOT,
    VOCAB,
    add_server_args,
    add_store_rtt_arg,
    bar_chart,
    exit_on_sigterm,
    markdown_table,
    median,
    result_payload,
    run_and_report,
    set_store_rtt,
    vllm_stack,
)

from dualpath_connector.protocol import metric_totals  # noqa: E402
from dualpath_dev.engines import ClusterKeys  # noqa: E402
from dualpath_dev.processes import ServiceProcess, free_port  # noqa: E402

MODES = ("store", "retained")
PROXY = REPO_ROOT / "tests" / "nixl_style_proxy.py"
PULLED = "dualpath_kv:pulled_tokens_total"
READ = "dualpath_kv:bytes_read_total"


class Proxy(ServiceProcess):
    """tests/nixl_style_proxy.py in front of one PE and one DE, on a free port, stopped by its PID."""

    def __init__(self, pe, de, log_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.args = [sys.executable, str(PROXY), "--port", str(self.port), "--prefill", pe.base_url,
                     "--decode", de.base_url, *extra]  # fmt: skip
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{self.port}"
        self.health_url = f"{self.url}/health"


def turn(proxy: Proxy, pe, body: dict, timeout_s: float) -> tuple[float, list[int]]:
    """One turn through ``proxy``: its seconds and its output tokens."""
    import httpx

    started = time.perf_counter()
    answer = httpx.post(f"{proxy.url}/v1/completions", json=body, headers=pe.keys.auth_headers(), timeout=timeout_s)
    seconds = time.perf_counter() - started
    answer.raise_for_status()
    return seconds, answer.json()["choices"][0]["token_ids"]


def conversation(mode: str, proxy: Proxy, engines: dict, rng: random.Random, args) -> list[dict]:
    pe, de = engines["pe"], engines["de"]
    history: list[int] = []
    conversation_id = {"conversation_id": uuid.uuid4().hex} if mode == "retained" else {}
    samples = []
    for index in range(args.turns):
        prompt = history + [rng.randrange(VOCAB) for _ in range(args.context if index == 0 else args.append)]
        before = metric_totals(pe.metrics_text())
        body = {"model": str(pe.model), "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, **conversation_id}  # fmt: skip
        seconds, out = turn(proxy, pe, body, args.request_timeout)
        de.wait_stored(prompt + out[:-1], args.save_timeout)  # the next turn's store hit, in both modes
        pe.complete([1, 2, 3], 1, args.request_timeout)  # one more PE step: its counters of this turn exported
        after = metric_totals(pe.metrics_text())
        pulled, read = after.get(PULLED, 0) - before.get(PULLED, 0), after.get(READ, 0) - before.get(READ, 0)
        if index:
            on_path = (pulled > 0 and read == 0) if mode == "retained" else (read > 0 and pulled == 0)
            samples.append({"mode": mode, "turn": index, "prompt_tokens": len(prompt), "seconds": seconds,
                            "pe_pulled_tokens": pulled, "pe_read_bytes": read, "on_its_path": on_path})  # fmt: skip
        history = prompt + out
    return samples


def run(args: argparse.Namespace) -> dict:
    keys = ClusterKeys.generate()
    stack = {"pe": {"config": "pe.json", "keys": keys},
             "de": {"config": "de.json", "keys": keys, "extra": {"pd_retain_decode_s": args.retain_s}}}  # fmt: skip
    relays: list | None = [] if args.store_rtt_ms else None
    rows = []
    rng = random.Random(args.seed)
    with vllm_stack(args, "bench-multiturn", stack, None, relays) as engines:
        proxies = {mode: Proxy(engines["pe"], engines["de"], args.workdir / f"bench-multiturn-{mode}-proxy.log",
                               *(["--multiturn"] if mode == "retained" else [])) for mode in MODES}  # fmt: skip
        try:
            for proxy in proxies.values():
                proxy.start(args.start_timeout)
            if args.warmup:  # one-time costs (NIXL connections, kernels): discarded
                for mode in MODES:
                    conversation(mode, proxies[mode], engines, rng, argparse.Namespace(**{**vars(args), "turns": 2}))
            for rtt_ms in args.store_rtt_ms or [None]:
                set_store_rtt(relays, rtt_ms)
                samples = []
                for rep in range(args.reps):
                    for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                        for sample in conversation(mode, proxies[mode], engines, rng, args):
                            samples.append({**sample, "rep": rep})
                            print(f"{'' if rtt_ms is None else f'RTT {rtt_ms:g} ms, '}rep {rep + 1} {mode} turn "
                                  f"{sample['turn']} ({sample['prompt_tokens']} tokens): {sample['seconds'] * 1000:.0f} "
                                  f"ms, PE pulled {sample['pe_pulled_tokens']:.0f} tokens, read "
                                  f"{sample['pe_read_bytes']:.0f} B{'' if sample['on_its_path'] else ' (off its path)'}",
                                  file=sys.stderr)  # fmt: skip
                rows.append(summarize(rtt_ms, samples))
        finally:
            for proxy in proxies.values():
                proxy.stop()
    return result_payload(args, results=rows)


def summarize(rtt_ms: float | None, samples: list[dict]) -> dict:
    row: dict = {"store_rtt_ms": rtt_ms, "samples": samples}
    for mode in MODES:
        mine = [s for s in samples if s["mode"] == mode]
        good = [s["seconds"] * 1000 for s in mine if s["on_its_path"]]
        row[mode] = {"on_its_path": f"{len(good)}/{len(mine)}", "turn_ms_median": median(good),
                     "turn_ms_range": [min(good, default=float("nan")), max(good, default=float("nan"))]}  # fmt: skip
    row["retained_over_store"] = row["retained"]["turn_ms_median"] / row["store"]["turn_ms_median"]
    return row


def table(payload: dict) -> str:
    cfg = payload["config"]
    rows = [[f"{r['store_rtt_ms'] or 0:g}",
             *[f"{r[m]['turn_ms_median']:.0f} ({r[m]['turn_ms_range'][0]:.0f}-{r[m]['turn_ms_range'][1]:.0f})"
               for m in MODES], *[r[m]["on_its_path"] for m in MODES], f"{r['retained_over_store']:.2f}x"]
            for r in payload["results"]]  # fmt: skip
    caption = (f"A conversation's turns 2-{cfg['turns']} ({cfg['context']} tokens first, {cfg['append']} more and "
               f"the last output each turn, {cfg['output_tokens']} output tokens), time through a P/D proxy in "
               f"front of one PE and one DE (vLLM CPU build, tiny random Llama, "
               f"{payload['environment']['cpu_count']} cores); median (min-max) over {cfg['reps']} repetitions' "
               f"turns, modes interleaved. store: NixlConnector's convention, the PE reads the conversation from "
               f"S3; retained: vLLM's multi-turn proxy, the PE pulls it from the DE's retained decode. on its path: "
               f"turns that took that path (PE pulled and read nothing / read and pulled nothing).")
    headers = ["store RTT ms", "store ms", "retained ms", "store on its path", "retained on its path",
               "retained / store"]
    return markdown_table(headers, rows, caption)


def chart(payload: dict, path: Path) -> Path | None:
    rows = payload["results"]
    return bar_chart(path, [f"{r['store_rtt_ms'] or 0:g} ms" for r in rows],
                     {mode: [r[mode]["turn_ms_median"] for r in rows] for mode in MODES}, "store round trip",
                     "A conversation's next turn: store vs retained", ylabel="median turn time (ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_args(parser)
    add_store_rtt_arg(parser)
    parser.add_argument("--context", type=int, default=4000, help="fresh tokens of the first turn")
    parser.add_argument("--append", type=int, default=200, help="fresh tokens each later turn adds")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--retain-s", type=float, default=120.0, help="the DE's pd_retain_decode_s")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--output", default="multiturn", help="result file stem under benchmarks/results/")
    args = parser.parse_args()
    if args.context + (args.turns - 1) * (args.append + args.output_tokens) + args.output_tokens > args.max_model_len:
        parser.error("--max-model-len must hold the conversation's last turn")
    exit_on_sigterm()
    run_and_report(run, table, args, f"{args.output}.json", chart)


if __name__ == "__main__":
    main()
