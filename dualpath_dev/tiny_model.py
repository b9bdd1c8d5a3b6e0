"""The tiny test Llama: a random checkpoint made with a fixed seed and a large init scale.

Its outputs depend on every token of the context, so a wrong KV cache changes
tokens and logprobs (vLLM's dummy weights would not).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

TINY_LLAMA = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 32768,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}
_TINY_LLAMA_SEED = 0


def make_tiny_llama(target: str | os.PathLike[str]) -> Path:
    """Write the tiny test Llama to ``target`` (once; reused when already there)."""
    target = Path(target)
    marker = target / "dualpath-tiny-llama.json"
    wanted = json.dumps({"config": TINY_LLAMA, "seed": _TINY_LLAMA_SEED}, sort_keys=True)
    if marker.exists() and marker.read_text() == wanted:
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(_TINY_LLAMA_SEED)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    target.parent.mkdir(parents=True, exist_ok=True)
    # Made beside the target and renamed into place: a reader never sees half a checkpoint.
    staging = Path(tempfile.mkdtemp(prefix="tiny-llama-", dir=target.parent))
    model.save_pretrained(staging, safe_serialization=True)
    (staging / marker.name).write_text(wanted)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target

