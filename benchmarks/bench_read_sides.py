"""A store hit read by the prefill engine (PE) vs by the decode engine (DE), same hit, idle links, side by side.

One SeaweedFS (S3 on 127.0.0.1), a PD pair (``configs/pe.json``, ``configs/de.json``; the tiny random Llama)
and two ``dualpath-router`` processes in front of the same pair, one with ``read_side: pe`` forced, the other
with ``read_side: de``. The PE neither moves queued reads to the DE nor splits them
(``move_queued_reads`` false), so ``pe`` is a read on the PE's link alone and ``de`` one on the DE's alone.

Per prompt length L and repetition: a fresh context C of L tokens is sent once through the ``pe`` router (computed,
saved by the PE; the script waits until its chunks are in the bucket); then C + S_mode, S_* different fresh
suffixes of one chunk, goes through each router (order reversed every other repetition), one request at a time,
so each reads the same stored chunks of C on its own side with nothing else running.

Per request (``max_tokens=1``, non-streaming): the time through the router (PE prefill with its hit, hand-off, DE
pull and first token), the PE's ``load_seconds`` (from a load's start to its hit being readable: for ``de`` the
side-channel round trip and the DE's read), the DE's ``pull_seconds`` and the bytes each side read, as deltas of
the engines' /metrics. Modes are checked: a ``de`` sample whose DE read nothing (declined, late) is not a DE-side
read and is left out of the medians (counted in ``de read``). ``--store-rtt-ms``: every engine request to the
store waits that long in a relay first. Table, ``benchmarks/results/<output>.json`` and a chart.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # dualpath_dev: the checkout's dev scaffolding
from _common import (  # noqa: E402
    VOCAB,
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
    vllm_stack,
)

from dualpath_connector.protocol import metric_totals  # noqa: E402
from dualpath_dev.engines import ClusterKeys, RouterProcess, VLLMServer  # noqa: E402

SIDES = ("pe", "de")
# Each sample's deltas: (engine, series); None where the engine does not export it.
DELTAS = {
    "load_s": ("pe", "dualpath_kv:load_seconds_sum"),
    "loads": ("pe", "dualpath_kv:load_seconds_count"),
    "layer_wait_s": ("pe", "dualpath_kv:layer_wait_seconds_sum"),
    "pull_s": ("de", "dualpath_kv:pull_seconds_sum"),
    "pe_read_bytes": ("pe", "dualpath_kv:bytes_read_total"),
    "de_read_bytes": ("de", "dualpath_kv:bytes_read_for_peer_total"),
    "pe_pulled_bytes": ("pe", "dualpath_kv:bytes_pulled_from_peer_total"),
    "declined": ("de", "dualpath_kv:de_reads_declined_total"),
    "fallbacks": ("pe", "dualpath_kv:de_read_fallbacks_total"),
}


class Bench:
    def __init__(self, engines: dict[str, VLLMServer], routers: dict[str, RouterProcess], args) -> None:
        self.engines, self.routers, self.args = engines, routers, args
        self.rng = random.Random(args.seed)
        self.chunk_tokens = chunk_tokens(engines["pe"])

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def _totals(self) -> dict[str, dict[str, float]]:
        return {name: metric_totals(engine.metrics_text()) for name, engine in self.engines.items()}

    def _body(self, prompt: list[int]) -> dict:
        return {"model": str(self.engines["pe"].model), "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                "ignore_eos": True}  # fmt: skip

    def _settled(self, before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """The engines' counters once this request's are exported: vLLM exports a connector's stats with an engine
        step, so each engine gets a probe (shorter than a chunk: never looked up or saved) until its load (PE) and
        pull (DE) counts moved, for at most a minute."""
        deadline = time.monotonic() + 60.0
        while True:
            after = self._totals()
            moved = (after["pe"].get(DELTAS["loads"][1], 0) > before["pe"].get(DELTAS["loads"][1], 0)
                     and after["de"].get("dualpath_kv:pull_seconds_count", 0)
                     > before["de"].get("dualpath_kv:pull_seconds_count", 0))  # fmt: skip
            if moved or time.monotonic() > deadline:
                return after
            for engine in self.engines.values():
                engine.complete(self.fresh(8), 1, self.args.request_timeout)

    def send(self, side: str, prompt: list[int]) -> dict:
        before = self._totals()
        answer, headers, seconds = self.routers[side].complete(self._body(prompt), self.args.request_timeout)
        after = self._settled(before)
        sample = {"side": side, "jct_s": seconds, "read_side": headers.get("x-dualpath-read-side"),
                  "hit_tokens": int(headers.get("x-dualpath-hit-tokens", 0))}  # fmt: skip
        for field, (engine, series) in DELTAS.items():
            sample[field] = after[engine].get(series, 0.0) - before[engine].get(series, 0.0)
        # A DE-side read is one where the DE read the hit; a PE-side one where the PE read it and the DE did not.
        sample["on_its_side"] = (sample["de_read_bytes"] > 0) if side == "de" else (
            sample["pe_read_bytes"] > 0 and sample["de_read_bytes"] == 0)  # fmt: skip
        return sample

    def rep(self, length: int, rep: int) -> list[dict]:
        context = self.fresh(length - length % self.chunk_tokens)
        self.routers["pe"].complete(self._body(context), self.args.request_timeout)
        self.engines["pe"].wait_stored(context, self.args.save_timeout)
        order = SIDES if rep % 2 == 0 else SIDES[::-1]
        return [self.send(side, context + self.fresh(self.chunk_tokens)) for side in order]


def summarize(rtt_ms: float | None, length: int, samples: list[dict]) -> dict:
    row: dict = {"store_rtt_ms": rtt_ms, "prompt_tokens": length, "samples": samples}
    for side in SIDES:
        good = [s for s in samples if s["side"] == side and s["on_its_side"]]
        mine = [s for s in samples if s["side"] == side]
        row[side] = {
            "on_its_side": f"{len(good)}/{len(mine)}",
            "jct_ms_median": median([s["jct_s"] * 1000 for s in good]),
            "jct_ms_range": [min((s["jct_s"] * 1000 for s in good), default=float("nan")),
                             max((s["jct_s"] * 1000 for s in good), default=float("nan"))],  # fmt: skip
            "load_ms_median": median([s["load_s"] * 1000 / max(s["loads"], 1) for s in good]),
            "pull_ms_median": median([s["pull_s"] * 1000 for s in good]),
            "hit_tokens_median": median([s["hit_tokens"] for s in good]),
        }
    row["de_over_pe"] = row["de"]["jct_ms_median"] / row["pe"]["jct_ms_median"]
    row["de_over_pe_load"] = row["de"]["load_ms_median"] / row["pe"]["load_ms_median"]
    return row


def run(args: argparse.Namespace) -> dict:
    keys = ClusterKeys.generate()
    stack = {
        "pe": {"config": "pe.json", "keys": keys, "extra": {"move_queued_reads": False}},
        "de": {"config": "de.json", "keys": keys},
    }
    relays: list | None = [] if args.store_rtt_ms else None
    rows = []
    with vllm_stack(args, "bench-read-sides", stack, {"io_timeout_s": args.store_io_timeout}, relays) as engines:
        routers: dict[str, RouterProcess] = {}
        try:
            for side in SIDES:
                routers[side] = RouterProcess([engines["pe"]], [engines["de"]], engines["pe"].s3, args.workdir,
                                              read_side=side).start(args.start_timeout)  # fmt: skip
            bench = Bench(engines, routers, args)
            if args.warmup:  # first requests pay one-time costs (NIXL connections, kernels): discarded
                bench.rep(min(args.sizes), 0)
            for rtt_ms in args.store_rtt_ms or [None]:
                set_store_rtt(relays, rtt_ms)
                for length in args.sizes:
                    samples = []
                    for rep in range(args.reps):
                        for sample in bench.rep(length, rep):
                            samples.append(sample)
                            print(f"{'' if rtt_ms is None else f'RTT {rtt_ms:g} ms, '}{length} tokens rep {rep + 1}: "
                                  f"{sample['side']} {sample['jct_s'] * 1000:.0f} ms, hit {sample['hit_tokens']}, "
                                  f"load {sample['load_s'] * 1000:.0f} ms, pull {sample['pull_s'] * 1000:.0f} ms, "
                                  f"read PE {sample['pe_read_bytes']:.0f} B DE {sample['de_read_bytes']:.0f} B"
                                  f"{'' if sample['on_its_side'] else ' (not on its side)'}", file=sys.stderr)
                    rows.append(summarize(rtt_ms, length, samples))
        finally:
            for router in routers.values():
                router.stop()
    return result_payload(args, results=rows)


def table(payload: dict) -> str:
    rtt = bool(payload["config"].get("store_rtt_ms"))

    def span(r: dict, side: str) -> str:
        low, high = r[side]["jct_ms_range"]
        return f"{r[side]['jct_ms_median']:.0f} [{low:.0f}-{high:.0f}]"

    rows = [
        [*([f"{r['store_rtt_ms']:g}"] if rtt else []), r["prompt_tokens"], f"{r['pe']['hit_tokens_median']:.0f}",
         span(r, "pe"), span(r, "de"), f"{r['de_over_pe']:.2f}x", f"{r['pe']['load_ms_median']:.0f}",
         f"{r['de']['load_ms_median']:.0f}", f"{r['de_over_pe_load']:.2f}x", f"{r['pe']['pull_ms_median']:.0f}",
         f"{r['de']['pull_ms_median']:.0f}", f"{r['pe']['on_its_side']}, {r['de']['on_its_side']}"]
        for r in payload["results"]
    ]  # fmt: skip
    env, config = payload["environment"], payload["config"]
    caption = (
        f"One request at a time through a router forcing the read side, PD pair on vLLM's CPU build (tiny random "
        f"Llama), median [min-max] of {config['reps']} interleaved repetitions. time: through the router "
        f"(max_tokens=1: PE prefill with the hit, hand-off, DE pull, first token). load: the PE's load_seconds (for "
        f"de: asking the DE, its store read, its answer). pull: the DE's pull of the prompt's KV from the PE. on its "
        f"side: samples whose hit was read where the mode says (the only ones in the medians). What limits these "
        f"figures: {env['cpu_count']} CPU cores shared by both engines, SeaweedFS, two routers and this script (load "
        f"average {env['load_avg_at_start'][0]:.1f} at the start, {env['load_avg_at_end'][0]:.1f} at the end); "
        f"every link is loopback."
    )
    if rtt:
        caption += " Store RTT: every engine request to S3 waited this long in a relay (dualpath_dev/s3_relay.py)."
    headers = [*(["store RTT ms"] if rtt else []), "prompt tokens", "hit tokens", "pe time ms", "de time ms",
               "de / pe time", "pe load ms", "de load ms", "de / pe load", "pe pull ms", "de pull ms",
               "on its side (pe, de)"]  # fmt: skip
    return markdown_table(headers, rows, caption)


def chart(payload: dict, path: Path) -> Path | None:
    rows = payload["results"]
    labels = [size_label(r["prompt_tokens"]) + ("" if r.get("store_rtt_ms") is None else f"\n{r['store_rtt_ms']:g} ms RTT")
              for r in rows]  # fmt: skip
    series = {f"{side}-side read, time": [r[side]["jct_ms_median"] for r in rows] for side in SIDES}
    series.update({f"{side}-side read, load": [r[side]["load_ms_median"] for r in rows] for side in SIDES})
    title = f"A hit read by the PE vs by the DE (vLLM CPU, {payload['environment']['cpu_count']} cores, median of {payload['config']['reps']})"
    return bar_chart(path, labels, series, "prompt tokens", title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[3000, 6000], help="prompt lengths (tokens)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per length (the median is reported)")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--store-io-timeout", type=float, default=60.0, help="the store's io_timeout_s")
    add_store_rtt_arg(parser)
    add_server_args(parser)
    parser.add_argument("--output", default="read-sides", help="base name under benchmarks/results/ (.json, .png)")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if max(args.sizes) + 64 > args.max_model_len:
        parser.error("--max-model-len must exceed the longest prompt plus a chunk")
    exit_on_sigterm()
    run_and_report(run, table, args, f"{args.output}.json", chart)


if __name__ == "__main__":
    main()
