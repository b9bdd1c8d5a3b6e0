"""What the router lets through to its engines: only valid token ids, only with its API key.

Engines run without a tokenizer, so vLLM checks no prompt id against the
vocabulary and an id past it kills the engine: the router refuses every bad
form with a 400 naming the id and its position, and no engine sees it. The
engines accept only requests carrying the router's API key; the router sends
it everywhere, refuses to start without it, and never shows it.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import httpx
import pytest
import yaml

from dualpath_connector.protocol import metric_samples
from dualpath_dev.tiny_model import TINY_LLAMA
from tests.integration.test_router_chat import tokenizer_dir  # noqa: F401 (fixture)
from tests.integration.test_router_http import (  # noqa: F401 (fixtures)
    API_KEY,
    MODEL,
    PROMPT,
    complete,
    engines,
    router_config,
    standin_stack,
    start_router,
)

VOCAB = TINY_LLAMA["vocab_size"]  # what the router reads from the tiny Llama's config.json
MAX_POSITIONS = TINY_LLAMA["max_position_embeddings"]


def rejected(router, reason: str) -> float:
    """The router's count of requests refused for ``reason`` (0 before the first one)."""
    return sum(value for name, labels, value in metric_samples(httpx.get(f"{router.url}/metrics").text)
               if name == "dualpath_router_rejected_requests_total" and labels.get("reason") == reason)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, tiny_model):
    """One router whose vocabulary comes from the tiny Llama's config.json, in front of two stand-ins."""
    with standin_stack(tmp_path_factory.mktemp("router"), without=("vocab_size",),
                       model_config=str(tiny_model)) as stack:  # fmt: skip
        yield stack


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([5, 999999, 7], f"bad token id 999999 at prompt[1]: token ids are in [0, {VOCAB})"),
        ([5, VOCAB], f"bad token id {VOCAB} at prompt[1]"),  # the first id past the vocabulary
        ([-1, 5], "bad token id -1 at prompt[0]"),
        ([5, 6, True], "bad token id true at prompt[2]: a token id is an integer, got bool"),
        ([5, 7.0], "bad token id 7.0 at prompt[1]: a token id is an integer, got float"),
        ([5, "7"], 'bad token id "7" at prompt[1]: a token id is an integer, got str'),
        ([5, [7, 8]], "bad token id [7, 8] at prompt[1]: a token id is an integer, got a nested list"),
        ([5, None], "bad token id null at prompt[1]: a token id is an integer, got null"),
        ([5, {"id": 7}], "bad token id {\"id\": 7} at prompt[1]: a token id is an integer, got dict"),
        ([[5, 999999]], "bad token id 999999 at prompt[0][1]"),  # one prompt in a list
        ([[5, [6]]], "bad token id [6] at prompt[0][1]"),
        ([5, 10**30], f"bad token id {10**30} at prompt[1]"),
        ([], "`prompt` is empty"),
        ([[]], "`prompt[0]` is empty"),
        (None, "`prompt` must be one non-empty string or one list of token ids, got null"),
        (7, "`prompt` must be one non-empty string or one list of token ids, got 7"),
        ("", "`prompt` must be one non-empty string"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_token_ids_get_400_and_reach_no_engine(guarded, prompt, message, stream):
    pe, de, router = guarded
    reason = "bad_token_ids" if message.startswith("bad token id") else "bad_prompt"
    before = rejected(router, reason)
    response = complete(router, prompt=prompt, max_tokens=2, stream=stream)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"]
    assert error["type"] == "BadRequestError" and error["param"] == "prompt" and error["code"] == 400
    assert pe.received == [] and de.received == []
    assert rejected(router, reason) == before + 1


def test_ids_at_the_vocabulary_edges_pass(guarded):
    """Negative control: the check refuses what is out of range, nothing else."""
    pe, de, router = guarded
    before = rejected(router, "bad_token_ids")
    response = complete(router, prompt=[0, *PROMPT, VOCAB - 1], max_tokens=2)
    assert response.status_code == 200, response.text
    assert pe.received[-1]["prompt"] == [0, *PROMPT, VOCAB - 1]
    pe.received.clear()
    de.received.clear()
    assert rejected(router, "bad_token_ids") == before


def test_max_prompt_tokens_defaults_to_the_model_config(guarded):
    pe, de, router = guarded
    response = complete(router, prompt=[1] * (MAX_POSITIONS + 1), max_tokens=2)
    assert response.status_code == 400
    assert (f"the prompt has {MAX_POSITIONS + 1} tokens, more than the model's {MAX_POSITIONS}"
            in response.json()["error"]["message"])  # fmt: skip
    assert pe.received == []
    # Negative control: a prompt and its completion that fit max_position_embeddings exactly pass.
    assert complete(router, prompt=[1] * (MAX_POSITIONS - 2), max_tokens=2).status_code == 200
    assert len(pe.received[-1]["prompt"]) == MAX_POSITIONS - 2
    pe.received.clear()
    de.received.clear()


def test_a_body_above_the_cap_gets_413_before_it_is_read_whole(guarded):
    """Declared (Content-Length) or not (chunked): the router stops reading past max_request_bytes (8 MiB)."""
    pe, de, router = guarded
    big = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "pad": "x" * (9 << 20)}).encode()
    declared = httpx.post(f"{router.url}/v1/completions", content=big, timeout=60.0,
                          headers={"content-type": "application/json"})  # fmt: skip
    chunked = httpx.post(f"{router.url}/v1/completions", timeout=60.0, headers={"content-type": "application/json"},
                         content=(big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20)))  # fmt: skip
    for response in (declared, chunked):
        assert response.status_code == 413 and "max_request_bytes" in response.json()["error"]["message"]
    assert pe.received == [] and de.received == []
    # Control: the same request without the padding passes.
    assert complete(router, prompt=PROMPT, max_tokens=2).status_code == 200
    pe.received.clear()
    de.received.clear()


def test_the_engines_see_the_routers_request_id_not_the_clients(guarded):
    """A client's id could name another client's request on the engines (an abort, for one)."""
    pe, de, router = guarded
    for _ in range(2):
        assert complete(router, prompt=PROMPT, max_tokens=2, request_id="everyone-uses-this").status_code == 200
    ids = [body["request_id"] for body in (*pe.received, *de.received)]
    assert all(i.startswith("dualpath-") for i in ids) and len({b["request_id"] for b in pe.received}) == 2
    pe.received.clear()
    de.received.clear()


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"n": 2}, "n", "`n` > 1 is not served through the PD router"),
        ({"n": 0}, "n", "`n` must be a positive integer, got 0"),
        ({"n": "2"}, "n", "`n` must be a positive integer"),
        ({"stream_options": {"include_usage": True}}, "stream_options",
         "Stream options can only be defined when `stream=True`."),
        ({"min_tokens": 3, "max_tokens": 2}, "min_tokens", "min_tokens must be less than or equal to max_tokens=2"),
        ({"min_tokens": -1}, "min_tokens", "`min_tokens` must be a non-negative integer"),
        ({"max_tokens": MAX_POSITIONS + 1}, "max_tokens",
         f"max_tokens={MAX_POSITIONS + 1} cannot be greater than max_model_len={MAX_POSITIONS}"),
        ({"cache_salt": ""}, "cache_salt", "Parameter 'cache_salt' must be a non-empty string if provided."),
        ({"cache_salt": 7}, "cache_salt", "Parameter 'cache_salt' must be a non-empty string if provided."),
        ({"cache_salt": "a/b"}, "cache_salt", "must not contain '@', '/'"),
        ({"cache_salt": "x" * 129}, "cache_salt", "must be at most 128 characters"),
    ],
)
def test_what_a_de_would_refuse_gets_400_before_any_prefill(guarded, body, param, message):
    """No PE prefills (and holds blocks for a DE) a request its DE would refuse: vLLM's own rules, checked first."""
    pe, de, router = guarded
    response = complete(router, **{"prompt": PROMPT, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert pe.received == [] and de.received == []


def test_explicit_vocab_size_and_prompt_limit(engines, start_router):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    router = start_router(router_config([pe], [de], vocab_size=200, max_prompt_tokens=70))
    assert complete(router, prompt=PROMPT, max_tokens=2).status_code == 200  # 70 ids below 200
    response = complete(router, prompt=[*PROMPT[:69], 200], max_tokens=2)
    assert response.status_code == 400 and "bad token id 200 at prompt[69]" in response.json()["error"]["message"]
    response = complete(router, prompt=[*PROMPT, 1], max_tokens=2)
    assert response.status_code == 400 and "the prompt has 71 tokens" in response.json()["error"]["message"]
    assert len(pe.received) == 1


def test_the_smallest_vocabulary_wins_and_tokenizer_ids_are_checked(engines, start_router, tokenizer_dir):  # noqa: F811
    """A tokenizer knowing more ids than the model: what it makes of text is checked against the model's size."""
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    # The tokenizer has 11 ids; the "model" 5.
    router = start_router(router_config([pe], [de], tokenizer=str(tokenizer_dir), vocab_size=5))
    assert complete(router, prompt="hello world how are", max_tokens=2).status_code == 200  # ids 1..4
    response = complete(router, prompt="hello world how are you", max_tokens=2)  # "you" is id 5
    assert response.status_code == 400
    assert "bad token id 5 at the tokenized prompt[4]" in response.json()["error"]["message"]
    chat = httpx.post(f"{router.url}/v1/chat/completions", timeout=30.0,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})
    assert chat.status_code == 400  # the template adds "user" (6)
    assert "at the tokenized messages[0]" in chat.json()["error"]["message"]
    assert len(pe.received) == 1


def test_router_sends_its_api_key_to_every_engine_request(engines, start_router):
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    router = start_router(router_config([pe], [de]))
    for stream in (False, True):
        response = complete(router, prompt=PROMPT, max_tokens=3, stream=stream)
        assert response.status_code == 200, response.text
    assert len(pe.received) == 2 and len(de.received) == 2 and pe.refused == de.refused == 0
    # Prefill, decode and the /metrics scrapes.
    assert set(pe.authorizations) == set(de.authorizations) == {f"Bearer {API_KEY}"}
    # Negative control: the stand-ins refuse a request without it, as vLLM with --api-key does.
    direct = httpx.post(f"{pe.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT}, timeout=30.0)
    assert direct.status_code == 401 and pe.refused == 1


def test_an_engine_refusing_the_key_is_a_failed_engine_and_no_key_shows(engines, start_router):
    pe_other, pe_ok, de = engines("pe-other", "prefill"), engines("pe-ok", "prefill"), engines("de0", "decode")
    other_key = secrets.token_hex(16)
    pe_other.api_key = other_key  # started with another cluster's key
    router = start_router(router_config([pe_other, pe_ok], [de], policy="round_robin"))
    answers = [complete(router, prompt=PROMPT, max_tokens=2) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert {a.headers["x-dualpath-prefill-engine"] for a in answers} == {"pe-ok"}
    assert pe_other.refused >= 1 and pe_other.received == []

    pe_ok.api_key = other_key  # now every PE refuses it
    response = complete(router, prompt=PROMPT, max_tokens=2)
    assert response.status_code == 503
    message = response.json()["error"]["message"]
    assert "HTTP 401: the engine refused the router's API key ($DUALPATH_ENGINE_API_KEY" in message
    assert len(de.received) == 2  # the two good requests only
    shown = message + router.log() + httpx.get(f"{router.url}/metrics").text
    assert API_KEY not in shown and other_key not in shown


def _start_up(tmp_path, config: dict, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The router's start-up with ``env`` as its whole environment (plus PATH); refusals exit at once."""
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({**config, "port": 1}))
    return subprocess.run([sys.executable, "-m", "dualpath_router.app", "--config", str(path)],
                          capture_output=True, text=True, timeout=120, env={"PATH": os.environ["PATH"], **env})


def _config(**overrides) -> dict:
    engine = {"name": "pe0", "url": "http://127.0.0.1:9", "node": "a"}
    return {"served_model_names": [MODEL], "prefill_engines": [engine],
            "decode_engines": [{**engine, "name": "de0", "side_channel": "127.0.0.1:9"}], **overrides}


def test_refuses_to_start_without_a_vocabulary_size(tmp_path):
    result = _start_up(tmp_path, _config(), {"DUALPATH_ENGINE_API_KEY": API_KEY})
    assert result.returncode == 2
    for key in ("`tokenizer`", "`model_config`", "`vocab_size`"):
        assert key in result.stderr
    assert API_KEY not in result.stderr + result.stdout


def test_refuses_a_model_config_without_a_vocabulary(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    for target, reason in ((tmp_path / "model", "no positive integer `vocab_size`"),
                           (tmp_path / "nowhere", "cannot read a Hugging Face config.json")):
        result = _start_up(tmp_path, _config(model_config=str(target)), {"DUALPATH_ENGINE_API_KEY": API_KEY})
        assert result.returncode == 2
        assert f"model_config: {target}" in result.stderr and reason in result.stderr


@pytest.mark.parametrize(
    "overrides, env, named",
    [
        ({}, {}, "set the environment variable DUALPATH_ENGINE_API_KEY"),
        # The config names another variable: the default one, set, does not count.
        ({"engine_api_key_env": "CLUSTER_A_ENGINE_KEY"}, {"DUALPATH_ENGINE_API_KEY": API_KEY},
         "set the environment variable CLUSTER_A_ENGINE_KEY"),
        ({}, {"DUALPATH_ENGINE_API_KEY": f"{API_KEY}\nX-Injected: 1"}, "DUALPATH_ENGINE_API_KEY holds whitespace"),
        ({"engine_api_key_env": f"Bearer {API_KEY}"}, {}, "engine_api_key_env must name an environment variable"),
    ],
)
def test_refuses_to_start_without_the_engine_api_key(tmp_path, overrides, env, named):
    result = _start_up(tmp_path, _config(vocab_size=VOCAB, **overrides), env)
    assert result.returncode == 2
    assert named in result.stderr
    assert API_KEY not in result.stderr + result.stdout
