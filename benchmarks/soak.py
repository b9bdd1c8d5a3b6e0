"""A soak of the 1P1D stack: agents for a while, memory and open file descriptors of every process sampled.

The stack of ``make demo`` (SeaweedFS on 127.0.0.1, a prefill engine from
``configs/pe.json``, a decode engine from ``configs/de.json``, both vLLM on CPU
with the tiny test Llama, and ``dualpath-router`` with the ``dualpath``
policy) serves ``--agents`` agents for ``--duration`` seconds. Each agent runs
an endless multi-turn session through the router: every turn appends the
model's answer and ``--tokens-per-turn`` new random tokens to its context, and
once the context passes ``--max-context`` the agent starts a new session.

With ``--check-every N`` every N-th turn of each agent is asked again under a fresh ``cache_salt``: no stored or
cached KV can serve it, so it is computed from scratch, and it is the reference (:func:`compare_answer`): the
answer's tokens must equal it with logprobs within ``NEAR_TIE``; a first differing token where each side's token
is in the other's top ``TOP_LOGPROBS`` and both lie within ``NEAR_TIE`` of each other in both computations, and of
themselves across them, is counted apart (a bfloat16 tie either computation may break); anything else is a wrong
answer. Once per run a control compares an answer with the reference of the prompt with all but its newest tokens
changed (another prefix's KV under them): it must be called wrong.
Before the first sample, ``--warmup-lengths`` requests of distinct prompt lengths fill vLLM CPU's oneDNN
primitive caches (:func:`warm_up`).
With ``--hostile`` the neighbours of ``hostile.py`` misbehave beside the agents for the whole run.

Every ``--sample-every`` seconds, for the PE, the DE and the router, the RSS
(``VmRSS`` from ``/proc/<pid>/status``) and the open file descriptors
(``/proc/<pid>/fd``) are summed over the process tree (vLLM's API server runs
its EngineCore as a child process), together with the requests done and
failed so far. A healthy stack is flat: neither series grows with the requests.

Output: a table (first, last and max value of each series, its least-squares
slope per minute over the whole run and over its second half) printed and in
``<out-dir>/soak.md``, every sample in ``soak.json``, and ``soak.png`` (one
panel RSS since the first sample, one panel fds). Exit status 1 when a process
died or a request failed. Everything started here is stopped by the PID it
holds, also on Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import threading
import time
import urllib.error
import uuid
from collections import Counter
from urllib.parse import urlsplit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # dualpath_dev: the checkout's dev scaffolding
from _common import (  # noqa: E402
    REPO_ROOT,
    RESULTS_DIR,
    VOCAB,
    exit_on_sigterm,
    markdown_table,
    pyplot,
    result_payload,
    run_and_report,
    save_figure,
    write_text,
)

from hostile import HostileNeighbours, Targets  # noqa: E402

from dualpath_dev.engines import ClusterKeys, RouterProcess, VLLMServer  # noqa: E402
from dualpath_dev.seaweedfs import SeaweedFS  # noqa: E402
from dualpath_dev.tiny_model import make_tiny_llama  # noqa: E402

MEASURED = ("pe", "de", "router")
KEPT_ERRORS = 5  # error messages kept verbatim in the JSON; the rest are only counted by kind
# The engines compute in bfloat16: a logit below 32 moves in steps of at most 1/8, and the same prompt computed in
# another chunking (a from-scratch reference against a prefix loaded or cached) can move one by a step. Logprobs
# within this are the same answer; candidates within it at the first differing token are a tie either may break.
NEAR_TIE = 0.13
# Top logprobs asked per token: enough to see every candidate of a tie among more than two.
TOP_LOGPROBS = 5
# The pass marks of a soak: RSS growth per minute in the second half, on every service.
RSS_SLOPE_LIMIT_MIB_MIN = 0.5
# vLLM CPU's own growth, kept out of the engines' slopes (see warm_up): oneDNN keeps few primitives beyond vLLM's
# per-shape caches, and glibc returns a freed primitive's pages (mmapped from 128 KiB up) instead of keeping them
# in its heap. Measured on a plain vLLM engine (no connector; results/soak-hostile/vllm-cpu-rss-by-prompt-length.md):
# with these, +44 MiB over the first 32 distinct prompt lengths and +4 over the next 128; without, +872 MiB over 640
# lengths, still 0.65 MiB per new length from the 352nd on.
BOUNDED_VLLM_CPU_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "MALLOC_MMAP_THRESHOLD_": "131072"}


# --- what a process tree holds -------------------------------------------------------------------


def _children_by_parent() -> dict[int, list[int]]:
    """Every process's children, from one pass over /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:  # it exited since the listing
            continue
        # The command name (field 2) may hold spaces and ')': the parent is the 2nd field after its last ')'.
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    return children


def _tree(root: int, children: dict[int, list[int]]) -> list[int]:
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, ()))
    return pids


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # kB
    return 0  # a zombie has no memory left


def measure_tree(root: int, children: dict[int, list[int]]) -> dict[str, float]:
    """RSS (MiB) and open fds summed over ``root`` and its descendants, and how many processes that is.

    Pages shared between the processes count once per process: the level is an
    upper bound, and what a soak looks at is how it moves.
    """
    rss = fds = processes = 0
    for pid in _tree(root, children):
        try:
            rss += _rss_bytes(pid)
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except (FileNotFoundError, ProcessLookupError):  # it exited since the listing
            continue
        processes += 1
    return {"rss_mib": round(rss / 2**20, 1), "fds": fds, "processes": processes}


# --- the agents ----------------------------------------------------------------------------------


class Tally:
    """What the agents did so far, shared between their threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.errors = 0
        self.sessions = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.read_sides: Counter[str] = Counter()
        self.error_kinds: Counter[str] = Counter()
        self.first_errors: list[str] = []
        self.served: Counter[int] = Counter()  # answers per agent
        self.checked = 0
        self.near_ties = 0
        self.wrong: list[str] = []
        self.controls: Counter[str] = Counter()  # verdicts on a reference of another prompt: "wrong" expected

    def done(self, index: int, prompt_tokens: int, headers: dict[str, str]) -> None:
        with self.lock:
            self.served[index] += 1
            self.requests += 1
            self.prompt_tokens += prompt_tokens
            self.hit_tokens += int(headers.get("x-dualpath-hit-tokens", 0))
            self.read_sides[headers.get("x-dualpath-read-side", "?")] += 1

    def failed(self, exc: Exception) -> None:
        if isinstance(exc, urllib.error.HTTPError):
            kind = f"HTTP {exc.code}"
            try:
                detail = exc.read()[:300].decode(errors="replace")
            except OSError:
                detail = str(exc)
        else:
            kind, detail = type(exc).__name__, str(exc)[:300]
        with self.lock:
            self.errors += 1
            self.error_kinds[kind] += 1
            if len(self.first_errors) < KEPT_ERRORS:
                self.first_errors.append(f"{kind}: {detail}")

    def new_session(self) -> None:
        with self.lock:
            self.sessions += 1


def agent(index: int, router: RouterProcess, model: str, args: argparse.Namespace, stop: threading.Event,
          tally: Tally) -> None:
    """One endless multi-turn session after another until ``stop`` is set."""
    rng = random.Random(f"{args.seed}-{index}")
    context: list[int] = []
    turn = 0
    while not stop.is_set():
        if not context or len(context) > args.max_context:
            context = [rng.randrange(VOCAB) for _ in range(args.first_prompt_tokens)]
            tally.new_session()
        body = {"model": model, "prompt": context, "max_tokens": args.output_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "logprobs": TOP_LOGPROBS,
                # Top logprobs keyed by token id: many ids decode to the same text ('' most of all), which a dict
                # keyed by text collapses to one of them.
                "return_tokens_as_token_ids": True}  # fmt: skip
        try:
            answer, headers, _ = router.complete(body, timeout_s=args.request_timeout)
            output = answer["choices"][0]["token_ids"]
        except Exception as exc:  # every failure is a finding, counted by kind; the agent goes on
            if stop.is_set():
                return  # cut off by the shutdown, not a failure of the stack
            tally.failed(exc)
            context = []  # a failed turn has no answer to append: start a new session
            stop.wait(1.0)  # a back-off, so a broken stack is not hammered in a tight loop
            continue
        tally.done(index, len(context), headers)
        turn += 1
        if args.check_every and turn % args.check_every == 0:
            try:
                check_answer(router, body, answer, args.request_timeout, tally)
                if index == 0 and turn == args.check_every:  # once per run: the comparison can fail
                    check_answer(router, body, answer, args.request_timeout, tally, control=True,
                                 new_tokens=args.tokens_per_turn)  # fmt: skip
            except Exception as exc:
                if stop.is_set():
                    return
                tally.failed(exc)
        context = context + output + [rng.randrange(VOCAB) for _ in range(args.tokens_per_turn)]


def warmup_lengths(count: int, longest: int) -> list[int]:
    """``count`` distinct prompt lengths spread from 16 to ``longest`` tokens."""
    if count == 1:
        return [longest]
    return sorted({16 + round(i * (longest - 16) / (count - 1)) for i in range(count)})


def warm_up(router: RouterProcess, model: str, count: int, longest: int, timeout_s: float) -> None:
    """One request per prompt length of :func:`warmup_lengths`, one at a time, before the first sample.

    Why: vLLM's CPU build runs every linear layer through a oneDNN matmul primitive made for the number of tokens
    in the step, kept in a cache per weight shape (32 token counts each) and in oneDNN's own (1,024 primitives by
    default, about 0.5 MiB each for the tiny model). Every token count not seen before grows the engine's RSS until
    those are full (heaptrack on a hostile soak's PE worker found all but 2.4 of its 53 MiB never freed over 11
    minutes there), and glibc's heap keeps some of what an evicted primitive frees. With
    ``BOUNDED_VLLM_CPU_CACHES`` the caches fill within 32 token counts: filled here first, the RSS slope is left
    to what the stack itself keeps.
    """
    rng = random.Random("warm-up")
    for length in warmup_lengths(count, longest):
        body = {"model": model, "prompt": [rng.randrange(VOCAB) for _ in range(length)], "max_tokens": 1,
                "temperature": 0.0}  # fmt: skip
        router.complete(body, timeout_s=timeout_s)


def compare_answer(answer: dict, reference: dict) -> tuple[str, str]:
    """(``"same"``, ``"near tie"`` or ``"wrong"``, why): an answer's choice against a from-scratch reference's.

    Where the tokens agree, their logprobs must agree within ``NEAR_TIE`` (a wrong KV moves whole
    distributions). At the first token that differs, each side's token must be among the other's top
    ``TOP_LOGPROBS``, both tokens' logprobs within ``NEAR_TIE`` in the two, and within ``NEAR_TIE`` of each other
    in each: one tie (of two or more candidates) that the two computations broke differently.
    """
    output, expected = answer["token_ids"], reference["token_ids"]
    differs = next((i for i, (a, b) in enumerate(zip(output, expected)) if a != b), min(len(output), len(expected)))
    pairs = zip(answer["logprobs"]["token_logprobs"][:differs], reference["logprobs"]["token_logprobs"][:differs])
    drift = max((abs(a - b) for a, b in pairs), default=0.0)
    if drift > NEAR_TIE:
        return "wrong", f"a chosen token's logprob moved {drift:.3f} before position {differs}"
    if differs == len(output) == len(expected):
        return "same", ""
    if differs >= min(len(output), len(expected)):
        return "wrong", f"{len(output)} tokens where the reference has {len(expected)}"
    ours, theirs = answer["logprobs"]["top_logprobs"][differs] or {}, reference["logprobs"]["top_logprobs"][differs] or {}
    pair = (answer["logprobs"]["tokens"][differs], reference["logprobs"]["tokens"][differs])
    why = f"at position {differs}: {pair[0]!r} where the reference has {pair[1]!r}; tops {ours} and {theirs}"
    if not all(token in ours and token in theirs for token in pair):
        return "wrong", why
    moved = max(abs(ours[token] - theirs[token]) for token in pair)
    if moved > NEAR_TIE or abs(ours[pair[0]] - ours[pair[1]]) > NEAR_TIE or abs(theirs[pair[0]] - theirs[pair[1]]) > NEAR_TIE:
        return "wrong", why
    return "near tie", why


def check_answer(router: RouterProcess, body: dict, answer: dict, timeout_s: float, tally: Tally,
                 control: bool = False, new_tokens: int = 0) -> None:  # fmt: skip
    """Ask ``body`` again under a fresh cache salt (computed from scratch) and compare. ``control``: ask for the
    prompt with everything but its last ``new_tokens`` replaced (what a wrong KV hit would have served: another
    prefix's KV under this turn's new tokens) instead, which the comparison must call wrong (it can fail)."""
    asked = {**body, "cache_salt": uuid.uuid4().hex}
    if control:
        prompt = body["prompt"]
        kept = min(new_tokens, len(prompt) - 1)
        asked["prompt"] = [(token + 1) % VOCAB for token in prompt[: len(prompt) - kept]] + prompt[len(prompt) - kept :]
    reference, _, _ = router.complete(asked, timeout_s=timeout_s)
    choice = answer["choices"][0]
    verdict, why = compare_answer(choice, reference["choices"][0])
    with tally.lock:
        if control:
            tally.controls[verdict] += 1
            return
        tally.checked += 1
        tally.near_ties += verdict == "near tie"
        if verdict == "wrong":
            tally.wrong.append(why)


# --- the run -------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = args.workdir.resolve()
    model = make_tiny_llama(workdir / "tiny-llama")
    tally = Tally()
    stop = threading.Event()
    hostile: dict = {}
    samples: list[dict] = []
    stopped_early = ""
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(SeaweedFS())
        print(f"S3 (SeaweedFS) on {s3.endpoint}", file=sys.stderr)
        # Random per run, as in the demo: the engines answer only the router, the side channel only its peers.
        keys = ClusterKeys.generate()
        engines = {
            name: VLLMServer(model, s3, workdir / f"soak-{name}.log", max_model_len=args.max_model_len,
                             config=f"{name}.json", keys=keys)
            for name in ("pe", "de")
        }  # fmt: skip
        for name, server in engines.items():
            if not args.vllm_default_caches:
                server.env.update(BOUNDED_VLLM_CPU_CACHES)
            stack.callback(server.stop)
            print(f"starting the {name.upper()} on {server.base_url}; log: {server.log_path}", file=sys.stderr)
            server.start(args.start_timeout)
        router = RouterProcess([engines["pe"]], [engines["de"]], s3, workdir, policy="dualpath")
        stack.callback(router.stop)
        router.start(args.start_timeout)
        print(f"dualpath-router on {router.url}; log: {router.log_path}", file=sys.stderr)
        procs = {"pe": engines["pe"].proc, "de": engines["de"].proc, "router": router.proc}
        if args.warmup_lengths:
            print(f"warming up: {args.warmup_lengths} prompts of distinct lengths", file=sys.stderr)
            warm_up(router, str(model), args.warmup_lengths, args.max_context, args.request_timeout)
        # Registered last, so it runs first on the way out: agents stop before the stack does, and a
        # request cut off by the shutdown is not counted as a failure.
        stack.callback(stop.set)
        if args.hostile:
            neighbours = HostileNeighbours(Targets(
                router=_address(router.url), pe=_address(engines["pe"].base_url), de=_address(engines["de"].base_url),
                side_channels=(engines["pe"].side_channel, engines["de"].side_channel),
                cluster_key=keys.cluster_key, model=str(model), vocab=VOCAB), seed=args.seed)
            stack.callback(lambda: hostile.update(neighbours.stop()))
            neighbours.start()
            print("hostile neighbours started", file=sys.stderr)
        agents = [
            threading.Thread(target=agent, args=(i, router, str(model), args, stop, tally), name=f"agent-{i}",
                             daemon=True)
            for i in range(args.agents)
        ]  # fmt: skip
        started = time.monotonic()
        samples.append(_sample(0.0, procs, tally))
        for thread in agents:
            thread.start()
        print(f"{args.agents} agents for {args.duration:.0f}s, a sample every {args.sample_every:.0f}s",
              file=sys.stderr)  # fmt: skip
        deadline = started + args.duration
        next_at = started + args.sample_every
        while True:
            wake = min(next_at, deadline)
            time.sleep(max(0.0, wake - time.monotonic()))  # the sampling cadence, not a synchronisation
            dead = [f"{name} (exit status {p.returncode})" for name, p in procs.items() if p.poll() is not None]
            if dead:
                stopped_early = f"{', '.join(dead)} exited during the soak"
                break
            samples.append(_sample(time.monotonic() - started, procs, tally))
            _print_progress(samples[-1])
            if wake >= deadline:
                break
            next_at += args.sample_every
        # Leaving the stack stops the router and the engines, which ends the requests still in flight.
    for thread in agents:
        thread.join(timeout=30)
    return result_payload(
        args,
        samples=samples,
        series=summarise(samples),
        requests=tally.requests,
        errors=tally.errors,
        error_kinds=dict(tally.error_kinds),
        first_errors=tally.first_errors,
        sessions=tally.sessions,
        prompt_tokens=tally.prompt_tokens,
        hit_tokens=tally.hit_tokens,
        read_sides=dict(tally.read_sides),
        stopped_early=stopped_early,
        served_per_agent=[tally.served[i] for i in range(args.agents)],
        answers_checked=tally.checked,
        near_ties=tally.near_ties,
        wrong_answers=len(tally.wrong),
        control_verdicts=dict(tally.controls),
        first_wrong_answers=tally.wrong[:KEPT_ERRORS],
        hostile=hostile,
    )


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def verdict(payload: dict) -> list[str]:
    """What failed the soak's marks (empty: it passed them)."""
    failed = []
    for name in MEASURED:
        slope = payload["series"][f"{name} RSS (MiB)"]["slope_per_min_2nd_half"]
        if slope is not None and slope > RSS_SLOPE_LIMIT_MIB_MIN:
            failed.append(f"{name} RSS grew {slope:.2f} MiB/min in the second half (limit {RSS_SLOPE_LIMIT_MIB_MIN})")
    if payload["stopped_early"]:
        failed.append(payload["stopped_early"])
    if payload["errors"]:
        failed.append(f"{payload['errors']} agent requests failed")
    if not all(payload["served_per_agent"]):
        failed.append(f"an agent was never served: answers per agent {payload['served_per_agent']}")
    if payload["wrong_answers"]:
        failed.append(f"{payload['wrong_answers']} wrong answers")
    if payload["answers_checked"] and payload["control_verdicts"] != {"wrong": 1}:
        failed.append(f"the control (another prompt's reference) was not called wrong: {payload['control_verdicts']}")
    if payload["hostile"].get("findings"):
        failed.append(f"{len(payload['hostile']['findings'])} hostile findings")
    return failed


def _sample(t_s: float, procs: dict, tally: Tally) -> dict:
    children = _children_by_parent()
    with tally.lock:
        counts = {"requests": tally.requests, "errors": tally.errors}
    return {"t_s": round(t_s, 1), **counts, **{name: measure_tree(procs[name].pid, children) for name in MEASURED}}


def _print_progress(sample: dict) -> None:
    parts = [f"{name} {sample[name]['rss_mib']:.0f} MiB/{sample[name]['fds']} fds" for name in MEASURED]
    print(f"  t={sample['t_s']:>6.0f}s  {'  '.join(parts)}  requests {sample['requests']}, errors {sample['errors']}",
          file=sys.stderr, flush=True)  # fmt: skip


# --- the report ----------------------------------------------------------------------------------


def _series(samples: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for name in MEASURED:
        out[f"{name} RSS (MiB)"] = [s[name]["rss_mib"] for s in samples]
    for name in MEASURED:
        out[f"{name} fds"] = [s[name]["fds"] for s in samples]
    out["requests done"] = [s["requests"] for s in samples]
    out["errors"] = [s["errors"] for s in samples]
    return out


def slope_per_minute(times_s: list[float], values: list[float]) -> float | None:
    """Least-squares slope of ``values`` over time, per minute; None with fewer than two samples."""
    if len(times_s) < 2:
        return None
    mean_t = sum(times_s) / len(times_s)
    mean_v = sum(values) / len(values)
    spread = sum((t - mean_t) ** 2 for t in times_s)
    if spread == 0:
        return None
    return 60.0 * sum((t - mean_t) * (v - mean_v) for t, v in zip(times_s, values)) / spread


def summarise(samples: list[dict]) -> dict[str, dict[str, float | None]]:
    """Per series: first, last, max, slope per minute over all samples and over the second half.

    The second half leaves out the start-up growth (allocator pools, compiled
    kernels, first connections), so a leak shows there as a slope that stays.
    """
    times = [s["t_s"] for s in samples]
    half = len(samples) // 2
    return {
        name: {
            "first": values[0],
            "last": values[-1],
            "max": max(values),
            "slope_per_min": slope_per_minute(times, values),
            "slope_per_min_2nd_half": slope_per_minute(times[half:], values[half:]),
        }
        for name, values in _series(samples).items()
        if values
    }


def table(payload: dict) -> str:
    config = payload["config"]
    hit_share = payload["hit_tokens"] / payload["prompt_tokens"] if payload["prompt_tokens"] else 0.0
    caption = (
        f"Soak of the 1P1D stack (SeaweedFS, PE, DE, dualpath-router; vLLM CPU, tiny Llama): {config['agents']} "
        f"agents for {config['duration']:.0f}s, {len(payload['samples'])} samples every {config['sample_every']:.0f}s; "
        f"{payload['requests']} requests, {payload['errors']} errors, {payload['sessions']} sessions, "
        f"{hit_share:.0%} of prompt tokens were store hits (read sides: "
        f"{', '.join(f'{k} {v}' for k, v in sorted(payload['read_sides'].items())) or 'none'}). "
        f"RSS and fds summed over each process tree."
    )
    rows = [
        [name, _fmt(s["first"]), _fmt(s["last"]), _fmt(s["max"]), _fmt(s["slope_per_min"], 2),
         _fmt(s["slope_per_min_2nd_half"], 2)]
        for name, s in payload["series"].items()
    ]  # fmt: skip
    text = markdown_table(["series", "first", "last", "max", "slope/min", "slope/min (2nd half)"], rows, caption)
    if payload["stopped_early"]:
        text += f"\n\n**Stopped early: {payload['stopped_early']}.**"
    if payload["errors"]:
        text += f"\n\nErrors by kind: {payload['error_kinds']}; first: {payload['first_errors']}"
    text += (f"\n\nAnswers per agent: {payload['served_per_agent']}. Checked against a from-scratch reference: "
             f"{payload['answers_checked']}; wrong: {payload['wrong_answers']}; differing at a near tie "
             f"(both tokens within {NEAR_TIE} of each other in both): {payload['near_ties']}. Control (the "
             f"reference of the prompt with all but its newest tokens changed): {payload['control_verdicts']}.")
    if payload["first_wrong_answers"]:
        text += f" First wrong answers: {payload['first_wrong_answers']}"
    if payload["hostile"]:
        rows = [[behaviour, ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))]
                for behaviour, counts in payload["hostile"]["counts"].items()]
        text += "\n\n" + markdown_table(["hostile neighbour", "outcomes (counted)"], rows,
                                         "Beside the agents, for the whole run (benchmarks/hostile.py):")
        if payload["hostile"]["findings"]:
            text += f"\n\nFindings: {payload['hostile']['findings']}"
    failed = verdict(payload)
    text += "\n\n" + (f"**Failed: {'; '.join(failed)}.**" if failed else
                       f"Passed: every agent served, no wrong answer, no finding, every service's RSS growth in the "
                       f"second half at most {RSS_SLOPE_LIMIT_MIB_MIN} MiB/min.")
    return text


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def chart(payload: dict, path: Path) -> Path | None:
    """RSS growth and open fds of each process tree over time; None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    minutes = [s["t_s"] / 60 for s in payload["samples"]]
    fig, (rss, fds) = plt.subplots(2, 1, sharex=True, figsize=(7.0, 6.0))
    for name in MEASURED:
        # Growth, not level: an engine's 5 GB and the router's 100 MB share one axis, and growth is the question.
        first = payload["samples"][0][name]["rss_mib"]
        rss.plot(minutes, [s[name]["rss_mib"] - first for s in payload["samples"]], marker=".",
                 label=f"{name} (first {first:.0f} MiB)")  # fmt: skip
        fds.plot(minutes, [s[name]["fds"] for s in payload["samples"]], marker=".", label=name)
    rss.set_ylabel("RSS since the first sample (MiB)")
    fds.set_ylabel("open file descriptors")
    fds.set_xlabel("minutes since the agents started")
    rss.set_title(f"Soak, 1P1D: {payload['config']['agents']} agents, {payload['requests']} requests, "
                  f"{payload['errors']} errors")  # fmt: skip
    for ax in (rss, fds):
        ax.legend()
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=4, help="concurrent agents (sessions)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds the agents run")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--first-prompt-tokens", type=int, default=1000, help="tokens of a session's first prompt")
    parser.add_argument("--tokens-per-turn", type=int, default=300, help="new random tokens appended per turn")
    parser.add_argument("--output-tokens", type=int, default=32, help="max_tokens of every request")
    parser.add_argument("--max-context", type=int, default=6000,
                        help="a session whose context passes this many tokens ends; the agent starts a new one")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a process to become healthy")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-every", type=int, default=0,
                        help="every N-th turn of an agent is compared with a from-scratch reference (0: none)")
    parser.add_argument("--hostile", action="store_true", help="run the hostile neighbours of hostile.py beside")
    parser.add_argument("--warmup-lengths", type=int, default=64,
                        help="requests of distinct prompt lengths before the first sample, filling vLLM CPU's "
                             "oneDNN caches (0: none)")
    parser.add_argument("--vllm-default-caches", action="store_true",
                        help="leave the engines' oneDNN primitive cache and glibc's mmap threshold at their defaults "
                             "(their growth then counts in the engines' slopes)")
    parser.add_argument("--workdir", type=Path, default=REPO_ROOT / ".cache", help="model and logs go here")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR, help="soak.json, soak.md, soak.png go here")
    args = parser.parse_args(argv)
    if args.warmup_lengths < 0:
        parser.error(f"--warmup-lengths must be at least 0, got {args.warmup_lengths}")
    for name in ("agents", "first_prompt_tokens", "tokens_per_turn", "output_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("duration", "sample_every", "start_timeout", "request_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.max_context < args.first_prompt_tokens:
        parser.error(f"--max-context ({args.max_context}) must be at least --first-prompt-tokens "
                     f"({args.first_prompt_tokens})")  # fmt: skip
    # A context past --max-context is never sent: the longest prompt is --max-context tokens.
    if args.max_context + args.output_tokens > args.max_model_len:
        parser.error(f"--max-model-len ({args.max_model_len}) must hold --max-context ({args.max_context}) "
                     f"plus --output-tokens ({args.output_tokens})")  # fmt: skip
    return args


def main() -> None:
    args = parse_args()
    exit_on_sigterm()
    payload = run_and_report(run, table, args, "soak.json", chart, out_dir=args.out_dir)
    markdown = write_text(args.out_dir / "soak.md", payload["table"] + "\n")
    print(f"table: {markdown}")
    if verdict(payload):
        sys.exit(1)


if __name__ == "__main__":
    main()
