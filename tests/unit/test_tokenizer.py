"""The tiny models' tokenizer (dualpath_dev/tokenizer.py): deterministic, inside the vocabulary, a working
chat template, lossless text round trips, and a model directory that loads as a complete HF model."""

from __future__ import annotations

import json

import pytest

from dualpath_dev import tokenizer as tokenizer_module
from dualpath_dev.tiny_model import TINY_DEEPSEEK_V2, TINY_LLAMA, make_tiny_llama
from dualpath_dev.tokenizer import save_tokenizer, tokenizer_spec

TEXTS = [
    "Hello, how does the router pick a read side?",
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # tabs\tand  double  spaces",
    "héllo wörld, ✓ 数据 🚀 and a lone \u00a0nbsp",
    " leading space and trailing newline\n",
]
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is a KV cache?"},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(path, TINY_LLAMA)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_same_corpus_gives_the_same_files(tokenizer_dir, tmp_path):
    save_tokenizer(tmp_path, TINY_LLAMA)
    names = sorted(p.name for p in tokenizer_dir.iterdir())
    assert names == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (tmp_path / name).read_bytes() == (tokenizer_dir / name).read_bytes(), name


def test_another_corpus_changes_the_spec(tmp_path, monkeypatch):
    """The model directory's marker holds the spec: a changed training text rebuilds the directory."""
    before = tokenizer_spec(1024)
    other = tmp_path / "topics.py"
    other.write_text("another text")
    monkeypatch.setattr(tokenizer_module, "training_corpus", lambda: other)
    assert tokenizer_spec(1024) != before
    assert tokenizer_spec(1024)["corpus_sha256"] != before["corpus_sha256"]


def test_ids_fill_the_vocabulary_exactly(tokenizer):
    assert len(tokenizer) == TINY_LLAMA["vocab_size"] == TINY_DEEPSEEK_V2["vocab_size"]
    assert sorted(tokenizer.get_vocab().values()) == list(range(TINY_LLAMA["vocab_size"]))
    # </s> is an id the model can emit and the one its config stops on.
    assert tokenizer.eos_token == "</s>" and tokenizer.eos_token_id == TINY_LLAMA["eos_token_id"] == 2
    assert tokenizer.bos_token_id == TINY_LLAMA["bos_token_id"] == 1
    assert tokenizer.pad_token_id == 0


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in ids[1:]
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Trained merges, not one token per byte.
    assert len(ids) - 1 < len(text.encode())


def test_every_id_decodes(tokenizer):
    """A random model emits any id: each one decodes (a partial UTF-8 byte as U+FFFD)."""
    text = tokenizer.decode(list(range(len(tokenizer))), skip_special_tokens=True)
    assert text and "<|user|>" not in text and "</s>" not in text


def test_chat_template_renders(tokenizer):
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<s><|system|>\nYou are a terse assistant.</s>\n<|user|>\nWhat is a KV cache?</s>\n<|assistant|>\n"
    )
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids.count(tokenizer.bos_token_id) == 1  # the template's <s>, not a second from encoding
    assert [tokenizer.convert_ids_to_tokens(i) for i in ids[-2:]] == ["<|assistant|>", "Ċ"]


def test_each_turn_starts_with_the_previous_turns_prompt(tokenizer):
    """What the KV cache reuses: turn N+1's prompt begins with turn N's, token for token."""
    first = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
    conversation = [*CHAT, {"role": "assistant", "content": "Keys and values, kept."},
                    {"role": "user", "content": "Why keep it?"}]  # fmt: skip
    second = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    assert second[: len(first)] == first and len(second) > len(first)
    # Control: a changed earlier message breaks the prefix.
    edited = [{**conversation[0], "content": "You are a verbose assistant."}, *conversation[1:]]
    third = tokenizer.apply_chat_template(edited, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert third[: len(first)] != first


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([{"role": "tool", "content": "42"}], "roles are system, user and assistant, not tool"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "message content must be a string"),
    ],
)
def test_chat_template_refuses(tokenizer, messages, error):
    with pytest.raises(Exception, match=error):
        tokenizer.apply_chat_template(messages, tokenize=False)


def test_model_config_must_agree_on_bos_and_eos(tmp_path):
    with pytest.raises(ValueError, match="eos_token_id"):
        save_tokenizer(tmp_path, {**TINY_LLAMA, "eos_token_id": 100001})


def test_tiny_model_directory_is_a_complete_hf_model(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    model_dir = make_tiny_llama(tmp_path / "tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    assert len(tokenizer) == config.vocab_size
    assert tokenizer.eos_token_id == config.eos_token_id and tokenizer.bos_token_id == config.bos_token_id
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    # The marker covers the tokenizer: one made by another builder is rebuilt.
    marker = model_dir / "dualpath-tiny-llama.json"
    recorded = json.loads(marker.read_text())
    assert recorded["tokenizer"] == tokenizer_spec(config.vocab_size)
    (model_dir / "tokenizer.json").unlink()
    recorded["tokenizer"]["builder"] = -1
    marker.write_text(json.dumps(recorded, sort_keys=True))
    make_tiny_llama(model_dir)
    assert (model_dir / "tokenizer.json").is_file()
