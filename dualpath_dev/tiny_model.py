"""The tiny test models: random checkpoints made with a fixed seed and a large init scale.

Their outputs depend on every token of the context, so a wrong KV cache changes
tokens and logprobs (vLLM's dummy weights would not). A Llama (separate K and V
per layer) and a DeepSeek-V2-style MLA model (one latent vector per token per layer).
Each directory is a complete Hugging Face model: weights, config and a tokenizer
of exactly the vocabulary (:mod:`dualpath_dev.tokenizer`), so text and chat work;
the weights are random, so the text a model writes is gibberish.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from dualpath_dev.tokenizer import save_tokenizer, tokenizer_spec

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
    # The tokenizer's <s> and </s> (Llama's defaults): </s> is an id the model can emit.
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# vLLM's CPU MLA decode kernel is compiled for one latent size only:
# kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576 (DeepSeek V2/V3's own).
# Everything else is as small as the Llama.
TINY_DEEPSEEK_V2 = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 64,
    # Every layer dense: no MoE, whose CPU kernels are not what is tested here.
    "first_k_dense_replace": 4,
    "max_position_embeddings": 32768,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    # DeepSeek's own ids (100000, 100001) are past this vocabulary; the tokenizer's <s> and </s>.
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_SEED = 0


def make_tiny_llama(target: str | os.PathLike[str]) -> Path:
    """Write the tiny test Llama to ``target`` (once; reused when already there)."""
    return _make("llama", TINY_LLAMA, "LlamaConfig", "LlamaForCausalLM", Path(target))


def make_tiny_deepseek_v2(target: str | os.PathLike[str]) -> Path:
    """Write the tiny DeepSeek-V2-style MLA model to ``target`` (once; reused when already there)."""
    return _make("deepseek-v2", TINY_DEEPSEEK_V2, "DeepseekV2Config", "DeepseekV2ForCausalLM", Path(target))


def _make(name: str, config: dict, config_class: str, model_class: str, target: Path) -> Path:
    marker = target / f"dualpath-tiny-{name}.json"
    # The tokenizer is part of the model: a new one (or a new training text) rebuilds the directory.
    wanted = json.dumps({"config": config, "seed": _SEED, "tokenizer": tokenizer_spec(config["vocab_size"])},
                        sort_keys=True)
    if marker.exists() and marker.read_text() == wanted:
        return target
    # Imported here: a checkout that already has the model never pays for them.
    import torch
    import transformers

    torch.manual_seed(_SEED)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    target.parent.mkdir(parents=True, exist_ok=True)
    # Made beside the target and renamed into place: a reader never sees half a checkpoint.
    staging = Path(tempfile.mkdtemp(prefix=f"tiny-{name}-", dir=target.parent))
    model.save_pretrained(staging, safe_serialization=True)
    save_tokenizer(staging, config)
    (staging / marker.name).write_text(wanted)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target
