"""What the engines' model accepts as a prompt: the vocabulary size and the longest prompt.

Engines may run with ``--skip-tokenizer-init``, and then vLLM checks no prompt
token id against the vocabulary: an id past the embedding table kills the
engine's forward pass. The router therefore must know the vocabulary size in every
configuration and refuses to start without one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nixl_backends.configuration import ConfigError

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ModelLimits:
    # Token ids are in [0, vocab_size).
    vocab_size: int
    # Longer prompts are refused; None: the engines decide.
    max_prompt_tokens: int | None = None
    # max_tokens above it, or a prompt as long, is refused as the engines would (vLLM's max_model_len); None: unchecked.
    max_model_len: int | None = None


def read_model_config(path: str) -> dict[str, Any]:
    """A Hugging Face ``config.json`` (given itself or the model directory holding it)."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model_config: {file}: cannot read a Hugging Face config.json: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model_config: {file}: not a JSON object")
    return data


def _positive_int(section: dict[str, Any], key: str) -> int | None:
    value = section.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def model_limits(
    tokenizer_size: int | None,
    model_config: str | None,
    vocab_size: int | None,
    max_prompt_tokens: int | None,
    max_model_len: int | None = None,
) -> ModelLimits:
    """The limits from every configured source (``RouterConfig.validate`` made sure there is one).

    Where several give a vocabulary size the smallest wins: an id must be
    valid for the tokenizer's decoding and for the model's embedding table.
    ``max_prompt_tokens`` and ``max_model_len`` default to the model config's
    ``max_position_embeddings`` (an engine's ``--max-model-len`` is at most that).
    """
    sizes: dict[str, int] = {}
    if tokenizer_size is not None:
        sizes["tokenizer"] = tokenizer_size
    if model_config is not None:
        data = read_model_config(model_config)
        # Multimodal models keep the language model's numbers in text_config.
        text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
        model_vocab = _positive_int(data, "vocab_size") or _positive_int(text, "vocab_size")
        if model_vocab is None:
            raise ConfigError(f"model_config: {model_config}: no positive integer `vocab_size`")
        sizes["model_config"] = model_vocab
        positions = _positive_int(text, "max_position_embeddings")
        max_prompt_tokens = max_prompt_tokens or positions
        max_model_len = max_model_len or positions
    if vocab_size is not None:
        sizes["vocab_size"] = vocab_size
    source = min(sizes, key=sizes.__getitem__)
    logger.info("token ids must be below %d (from %s); prompts up to %s tokens", sizes[source], source,
                max_prompt_tokens or "any number of")
    return ModelLimits(sizes[source], max_prompt_tokens, max_model_len)
