"""The tiny test models' tokenizer: a byte-level BPE trained here, saved as a Hugging Face tokenizer.

The tiny models are random, so any tokenizer of their vocabulary size makes
them a complete Hugging Face model; this one lets text prompts and chat run
end to end (vLLM and ``dualpath-router`` load it with ``AutoTokenizer``).
It is trained on the Python reference documentation that ships with the
standard library (``pydoc_data/topics.py``, English prose): nothing is
downloaded, and the same corpus gives the same tokenizer, byte for byte
(:func:`tokenizer_spec` records the corpus digest, so a changed corpus
rebuilds the model directory).

Byte-level, so every text encodes and every id sequence a model emits
decodes (bytes that are not UTF-8 become U+FFFD). Its ids fill the model's
vocabulary exactly: special tokens first (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2,
Llama's bos and eos ids, then the chat roles), the 256 byte tokens, then the
merges.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path
from typing import Any

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
ROLES = ("system", "user", "assistant")
ROLE_TOKENS = tuple(f"<|{role}|>" for role in ROLES)
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)
# Every message is `<|role|>` newline content `</s>` newline after one `<s>`; the
# generation prompt opens the assistant's turn. A conversation's rendering
# starts with the rendering of each of its prefixes (plus the generation
# prompt), so every turn's prompt begins with the previous turn's: the prefix
# the KV cache reuses. Special tokens split the text, so the BPE of one
# message never depends on its neighbours.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{% if message['content'] is not string %}"
    "{{ raise_exception('message content must be a string') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# Bumped when the training or the saved files change in a way the spec would not show.
_BUILDER_VERSION = 1


def training_corpus() -> Path:
    """The text the tokenizer learns from: the standard library's copy of the Python reference docs."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the tokenizer's training text (pydoc_data, part of the standard library)")
    return path


def tokenizer_spec(vocab_size: int) -> dict[str, Any]:
    """Everything the built tokenizer depends on (for the model directory's marker)."""
    corpus = training_corpus().read_bytes()
    return {
        "builder": _BUILDER_VERSION,
        "vocab_size": vocab_size,
        "special_tokens": list(SPECIAL_TOKENS),
        "chat_template": CHAT_TEMPLATE,
        "corpus_sha256": hashlib.sha256(corpus).hexdigest(),
    }


def save_tokenizer(target: Path, model_config: dict[str, Any]) -> None:
    """Train the tokenizer for ``model_config`` and save it into the model directory ``target``.

    Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json;
    ``model_config`` must give ``vocab_size`` and the ``bos_token_id`` and
    ``eos_token_id`` the tokenizer's ``<s>`` and ``</s>`` get.
    """
    # Imported here: a checkout that already has the model never pays for them.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = model_config["vocab_size"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes, whether the corpus has them or not: any text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([training_corpus().read_text(encoding="utf-8")], trainer)
    bos_id, eos_id = backend.token_to_id(BOS), backend.token_to_id(EOS)
    # Encoding text (not chat, whose template writes <s> itself) starts with <s>, as Llama's tokenizers do.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    if backend.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the corpus gave {backend.get_vocab_size()} tokens, not the model's {vocab_size}")
    wanted = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    wrong = {key: model_config.get(key) for key, value in wanted.items() if model_config.get(key) != value}
    if wrong:
        raise ValueError(f"the model config's {wrong} must be the tokenizer's {wanted}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_config.get("max_position_embeddings", 1 << 30),
        clean_up_tokenization_spaces=False,
    )
    # The chat template inside tokenizer_config.json, where every transformers version looks for it.
    tokenizer.save_pretrained(target, save_jinja_files=False)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # transformers 5 names its own class; older ones (and other loaders) know this one.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # transformers 5 writes the map only for some tokenizers; a complete model directory has it.
    special_tokens_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (target / "special_tokens_map.json").write_text(json.dumps(special_tokens_map, indent=2, sort_keys=True) + "\n")
