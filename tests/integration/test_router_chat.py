"""Text prompts and chat through the router's tokenizer, in front of stand-in engines.

Two tokenizers, both built here (no download): a word-level one whose ids
the tests spell out, and the tiny test models' own byte-level BPE with its
chat template (dualpath_dev/tokenizer.py), driven by the official ``openai``
client and examples/chat_client.py. The engines only ever see token ids,
and the router turns their ``token_ids`` back into text and chat messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.conftest import REPO_ROOT
from tests.integration.test_router_http import MODEL, standin_stack

WORDS = ["hello", "world", "how", "are", "you", "user", "assistant", "fine", "thanks", ":"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return path


def ids(text: str) -> list[int]:
    return [WORDS.index(word) + 1 for word in text.split()]


ANSWER = "fine thanks"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tokenizer_dir):
    """One router for the module: loading transformers makes its start slow."""
    with standin_stack(tmp_path_factory.mktemp("router"), tokenizer=str(tokenizer_dir)) as (pe, de, router):
        de.decode_tokens = lambda body: ids(ANSWER)
        yield pe, de, router


def test_text_prompt_is_tokenized_for_the_engines(stack):
    pe, de, router = stack
    response = httpx.post(f"{router.url}/v1/completions",
                          json={"model": MODEL, "prompt": "hello world how are you", "max_tokens": 2}, timeout=30.0)
    assert response.status_code == 200, response.text
    assert pe.received[-1]["prompt"] == de.received[-1]["prompt"] == ids("hello world how are you")
    # The engines answer token ids only; the router writes the text.
    assert de.received[-1]["return_token_ids"] is True
    assert response.json()["choices"][0]["text"] == ANSWER


def test_text_prompt_streaming_gets_text(stack):
    _, _, router = stack
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30.0) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(event)["choices"][0]["text"] for event in events[:-1])
    assert text.split() == ANSWER.split()


def test_an_engine_text_holding_line_separators_streams_whole(stack):
    """vLLM writes U+2028 and U+0085 raw in its JSON: the router must not read them as line ends (httpx's
    aiter_lines does), or the event reaches json.loads in pieces and the client's stream breaks off."""
    _, de, router = stack
    plain = de.decode_events

    def raw_separators(body: dict) -> list[str]:
        events = [json.loads(event) for event in plain(body)[:-1]]
        for event in events:
            event["choices"][0]["text"] = "x\u2028y\u0085z"
        return [json.dumps(event, ensure_ascii=False) for event in events] + ["[DONE]"]

    de.decode_events = raw_separators
    try:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30.0) as response:
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        del de.decode_events
    assert events[-1] == "[DONE]"
    # The router writes the text from the token ids, as for any stream.
    assert "".join(json.loads(event)["choices"][0]["text"] for event in events[:-1]).split() == ANSWER.split()


def test_chat_completion(stack):
    pe, de, router = stack
    messages = [{"role": "user", "content": "how are you"}]
    response = httpx.post(f"{router.url}/v1/chat/completions",
                          json={"model": MODEL, "messages": messages, "max_completion_tokens": 2}, timeout=30.0)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert response.headers["x-dualpath-decode-engine"] == "de0"
    assert pe.received[-1]["prompt"] == ids("user : how are you assistant :")
    assert pe.received[-1]["max_tokens"] == 1 and de.received[-1]["max_tokens"] == 2
    assert "messages" not in de.received[-1] and de.received[-1]["return_token_ids"] is True


def test_chat_keeps_the_cache_salt(stack):
    """A chat request's salt reaches both engines: without it they would store the tenant's KV in the shared chain."""
    pe, de, router = stack
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
            "cache_salt": "tenant-a"}
    response = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30.0)
    assert response.status_code == 200, response.text
    assert pe.received[-1]["cache_salt"] == de.received[-1]["cache_salt"] == "tenant-a"


def test_chat_streaming(stack):
    pe, de, router = stack
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=30.0) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    assert text.strip() == ANSWER
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_needs_messages(stack):
    _, _, router = stack
    response = httpx.post(f"{router.url}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30.0)
    assert response.status_code == 400
    assert "`messages`" in response.json()["error"]["message"]


# The tiny test models' own tokenizer (dualpath_dev/tokenizer.py), as the dev stack and `make demo` use it:
# byte-level BPE with a chat template, so answers with multi-byte characters come token by token.
MODEL_ANSWER = "Grüße from the store ✓ 数据"


@pytest.fixture(scope="module")
def model_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from dualpath_dev.tiny_model import TINY_LLAMA
    from dualpath_dev.tokenizer import save_tokenizer

    path = tmp_path_factory.mktemp("model-tokenizer")
    save_tokenizer(path, TINY_LLAMA)
    return path, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def model_stack(tmp_path_factory, model_tokenizer):
    path, tokenizer = model_tokenizer
    with standin_stack(tmp_path_factory.mktemp("router"), tokenizer=str(path)) as (pe, de, router):
        # The answer ends with </s>, as a model stops: the client never sees it.
        de.decode_tokens = lambda body: [*tokenizer.encode(MODEL_ANSWER, add_special_tokens=False),
                                         tokenizer.eos_token_id]
        yield pe, de, router


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_model_tokenizer_text_prompt(model_stack, model_tokenizer):
    pe, de, router = model_stack
    _, tokenizer = model_tokenizer
    response = httpx.post(f"{router.url}/v1/completions",
                          json={"model": MODEL, "prompt": "Où est le cache?", "max_tokens": 8}, timeout=30.0)
    assert response.status_code == 200, response.text
    assert pe.received[-1]["prompt"] == tokenizer.encode("Où est le cache?")
    assert pe.received[-1]["prompt"][0] == tokenizer.bos_token_id
    assert response.json()["choices"][0]["text"] == MODEL_ANSWER


def test_chat_client_example_streams_a_conversation(model_stack, model_tokenizer):
    """examples/chat_client.py, as a user runs it: two streamed turns, the second's prompt extends the first's."""
    pe, de, router = model_stack
    _, tokenizer = model_tokenizer
    before = len(pe.received)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "chat_client.py"), "--base-url", f"{router.url}/v1",
         "--system", "Be brief.", "Hello there", "Tell me more"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    answer_tokens = len(tokenizer.encode(MODEL_ANSWER, add_special_tokens=False))
    assert done.stdout.count(f"assistant> {MODEL_ANSWER}\n") == 2, done.stdout
    # One chunk per engine event (the role chunk carries the first token's text; U+FFFD halves wait).
    assert f"[turn 2: {answer_tokens + 1} streamed chunks, {len(MODEL_ANSWER)} characters, read side " in done.stdout
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    second = [*first, {"role": "assistant", "content": MODEL_ANSWER}, {"role": "user", "content": "Tell me more"}]
    prompts = [body["prompt"] for body in pe.received[before:]]
    assert prompts == [chat_ids(tokenizer, first), chat_ids(tokenizer, second)]
    # What makes the second turn a cache hit: its prompt starts with the first's, token for token.
    assert prompts[1][: len(prompts[0])] == prompts[0]


def test_openai_client_headers_and_text(model_stack, monkeypatch):
    """The client library's own streaming call, through the example's helper: text whole, headers there."""
    from openai import OpenAI

    _, _, router = model_stack
    monkeypatch.syspath_prepend(str(REPO_ROOT / "examples"))  # as when the example runs as a script
    import chat_client
    client = OpenAI(base_url=f"{router.url}/v1", api_key="none")
    turn = chat_client.stream_turn(client, MODEL, [{"role": "user", "content": "Hi"}], max_tokens=8)
    assert turn.text == MODEL_ANSWER and "\ufffd" not in turn.text and "</s>" not in turn.text
    assert turn.read_side in ("pe", "de") and turn.headers["x-dualpath-decode-engine"] == "de0"
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    assert whole.choices[0].message.content == MODEL_ANSWER
    # Control: without the template's roles the request is refused, with the template's reason.
    with pytest.raises(Exception, match="roles are system, user and assistant, not tool"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "42"}], max_tokens=8)


def test_text_that_cannot_fit_is_refused_before_it_is_tokenized(tmp_path, tokenizer_dir):
    """No token spells more than the longest one does: text past max_prompt_tokens of those is refused unread."""
    with standin_stack(tmp_path, tokenizer=str(tokenizer_dir), max_prompt_tokens=8) as (pe, de, router):
        long_text = " ".join(["hello"] * 2000)
        for body in ({"prompt": long_text}, {"messages": [{"role": "user", "content": long_text}]}):
            path = "chat/completions" if "messages" in body else "completions"
            response = httpx.post(f"{router.url}/v1/{path}", json={"model": MODEL, "max_tokens": 2, **body}, timeout=30.0)
            assert response.status_code == 400 and "characters" in response.json()["error"]["message"], response.text
        assert pe.received == []
        # Control: a short text passes the bound and is tokenized.
        ok = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "max_tokens": 2, "prompt": "hello world"},
                        timeout=30.0)  # fmt: skip
        assert ok.status_code == 200, ok.text
