"""Prefill/decode disaggregation end to end on vLLM's CPU build: one PE, one DE, the router, a real S3 server.

A multi-turn agent session goes through ``dualpath-router`` with the read side
forced to ``pe``, forced to ``de``, and chosen by the ``dualpath`` policy. Each
turn's output (tokens and logprobs of the context-sensitive tiny Llama) must
equal one engine's without the connector, and the connector metrics must show
bytes on the side that read.

Why the baseline replays each turn twice: a DE gets every prompt block from
its PE and recomputes only the last prompt token (vLLM samples from it), and a
token's KV depends in its last bits on how prefill was chunked around it. The
engine without the connector therefore serves each turn as the PE and the DE
did: once with ``max_tokens=1`` (the PE's prefill, starting where the previous
turn's blocks end), then the real request, whose prefix-cache hit leaves
exactly the last token to compute because every prompt is 1 token past a
block boundary (appends and outputs are whole blocks).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import urllib.request

import pytest

from dualpath_connector.protocol import PrefillRequest, counter_total_name
from dualpath_dev.engines import RouterProcess, VLLMServer
from tests.vllm_engine import Engine

pytestmark = pytest.mark.engine

BLOCK = 32
OUTPUT_TOKENS = 2 * BLOCK
BATCH_TOKENS = 512
TURNS = 3
BUCKET = "dualpath-pd"
READ_SIDES = ("pe", "de", "dualpath")


def session_prompts(seed: int) -> list[list[int]]:
    """Appends of each turn; the first prompt is 1 token past a block boundary."""
    rng = random.Random(seed)
    first = [rng.randrange(1024) for _ in range(24 * BLOCK + 1)]
    return [first] + [[rng.randrange(1024) for _ in range(8 * BLOCK)] for _ in range(TURNS - 1)]


SESSIONS = {side: session_prompts(seed) for seed, side in enumerate(READ_SIDES)}
# After the sessions: a prompt on top of the last session's history, for the DE-failure test.
FALLBACK_APPEND = session_prompts(99)[1]


def same(a: dict, b: dict) -> bool:
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


@pytest.fixture(scope="module")
def baseline(tiny_model) -> dict:
    """Per session, per turn: the prompt and the output of an engine without the connector."""
    out: dict = {}
    with Engine(tiny_model, max_num_batched_tokens=BATCH_TOKENS) as engine:
        for side, appends in SESSIONS.items():
            history: list[int] = []
            turns = []
            for turn, append in enumerate(appends):
                prompt = history + append
                # Sessions are independent: each starts from an empty prefix cache.
                engine.generate([prompt], 1, reset_prefix_cache=turn == 0)
                result = engine.generate([prompt], OUTPUT_TOKENS, reset_prefix_cache=False)[0]
                assert result["num_cached_tokens"] == len(prompt) - 1
                turns.append({"prompt": prompt, **result})
                history = prompt + result["tokens"]
            out[side] = turns
        last = out[READ_SIDES[-1]][-1]
        prompt = last["prompt"] + last["tokens"] + FALLBACK_APPEND
        out["fallback"] = {"prompt": prompt, **engine.generate([prompt], OUTPUT_TOKENS, reset_prefix_cache=False)[0]}
    return out


@pytest.fixture(scope="module")
def cluster(tiny_model, seaweedfs, tmp_path_factory):
    """One PE and one DE (vLLM OpenAI servers), stopped by the PIDs they hold."""
    logs = tmp_path_factory.mktemp("pd-logs")
    options = {"bucket": BUCKET, "max_num_batched_tokens": BATCH_TOKENS}
    pe = VLLMServer(tiny_model, seaweedfs, logs / "pe.log", config="pe.json", **options)
    de = VLLMServer(tiny_model, seaweedfs, logs / "de.log", config="de.json", **options)
    try:
        pe.start()
        de.start()
        # vLLM compiles its logprobs gather on first use, which stalls that
        # engine for a minute on 2 cores; do it before the DE serves peers.
        warm_up = {"model": str(tiny_model), "prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 0, "return_tokens_as_token_ids": True}
        for server in (pe, de):
            request = urllib.request.Request(f"{server.base_url}/v1/completions", json.dumps(warm_up).encode(), {"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=900).read()
        yield pe, de
    finally:
        pe.stop()
        de.stop()


def through_router(router: RouterProcess, prompt: list[int]) -> tuple[dict, dict[str, str]]:
    """A greedy completion through the router: (output as the baseline has it, x-dualpath-* headers)."""
    answer, headers, _ = router.complete(
        {
            "model": router_model(router), "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
        }  # fmt: skip
    )
    choice = answer["choices"][0]
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}, headers


def router_model(router: RouterProcess) -> str:
    return json.loads(router.config_path.read_text())["served_model_names"][0]


@pytest.mark.parametrize("read_side", READ_SIDES)
def test_session_through_router_matches_single_engine(read_side, tiny_model, seaweedfs, cluster, baseline, tmp_path):
    pe, de = cluster
    before = {
        "pe_read": pe.metric_total(counter_total_name("bytes_read")),
        "de_read_for_pe": de.metric_total(counter_total_name("bytes_read_for_peer")),
    }
    router = RouterProcess([pe], [de], seaweedfs, tmp_path, read_side="auto" if read_side == "dualpath" else read_side)
    router.start()
    try:
        sides = []
        for turn, expected in enumerate(baseline[read_side]):
            out, headers = through_router(router, expected["prompt"])
            assert same(out, expected), f"turn {turn} differs from the engine without the connector"
            # The next turn must find every chunk the DE saves (asynchronously).
            de.wait_stored(expected["prompt"] + out["tokens"][:-1])
            hit = int(headers["x-dualpath-hit-tokens"])
            sides.append(headers["x-dualpath-read-side"])
            # Every full chunk of the previous turn's prompt and output was stored by the DE.
            previous = baseline[read_side][turn - 1] if turn else None
            assert hit == (len(previous["prompt"]) + OUTPUT_TOKENS - 1) // BLOCK * BLOCK if previous else hit == 0
    finally:
        router.stop()
    if read_side != "dualpath":
        assert set(sides) == {read_side}
    assert set(sides) <= {"pe", "de"}
    pe_read = _settled(lambda: pe.metric_total(counter_total_name("bytes_read"))) - before["pe_read"]
    de_read = _settled(lambda: de.metric_total(counter_total_name("bytes_read_for_peer"))) - before["de_read_for_pe"]
    if read_side == "pe":
        assert pe_read > 0 and de_read == 0
    elif read_side == "de":
        assert de_read > 0 and pe_read == 0
        assert pe.metric_total(counter_total_name("bytes_pulled_from_peer")) >= de_read
    else:
        assert pe_read + de_read > 0


def _settled(read, timeout_s: float = 30.0) -> float:
    """A counter's value once it stops moving (vLLM exports connector stats with engine steps)."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        again = read()
        if again == value:
            return value
        value = again
    return value


def test_de_killed_during_de_side_read_falls_back(cluster, baseline):
    """The DE hangs, then dies, while the PE waits for it to read a hit: the PE reads the store itself.

    Runs last in this module: the DE does not come back.
    """
    pe, de = cluster
    expected = baseline["fallback"]
    fallbacks_before = pe.metric_total(counter_total_name("de_read_fallbacks"))
    os.killpg(de.proc.pid, signal.SIGSTOP)
    answer: dict = {}

    def ask() -> None:
        body = {
            "model": str(pe.model), "prompt": expected["prompt"], "max_tokens": OUTPUT_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "kv_transfer_params": PrefillRequest("de", de.side_channel).to_dict(),
        }  # fmt: skip
        request = urllib.request.Request(f"{pe.base_url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            answer.update(json.loads(response.read()))

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        deadline = time.monotonic() + 60
        # The request is in the PE, waiting for the DE's read.
        while pe.metric_total("vllm:num_requests_waiting") + pe.metric_total("vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline, "the request never reached the PE"
            time.sleep(0.1)
    finally:
        os.killpg(de.proc.pid, signal.SIGKILL)
        asker.join(timeout=300)
    choice = answer["choices"][0]
    assert same({"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}, expected)
    assert "did not read the hit" in pe.log_path.read_text()
    assert _settled(lambda: pe.metric_total(counter_total_name("de_read_fallbacks"))) == fallbacks_before + 1
