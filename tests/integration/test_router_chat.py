"""Text prompts and chat through the router's tokenizer, in front of tokenizer-less stand-in engines.

The tokenizer is a word-level one built here (no download): the engines
only ever see token ids, and the router turns their ``token_ids`` back into
chat messages.
"""

from __future__ import annotations

import json

import httpx
import pytest

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
