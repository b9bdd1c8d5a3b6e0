"""A LoRA adapter for the tiny test model, written as PEFT writes one (adapter_config.json and
adapter_model.safetensors), with seeded random weights large enough to change greedy outputs."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "v_proj")
RANK = 8


def write_lora_adapter(model: Path, out: Path, seed: int, scale: float = 0.5) -> Path:
    """An adapter of rank ``RANK`` on every layer's q_proj and v_proj of ``model``, in ``out``; ``out``."""
    config = json.loads((model / "config.json").read_text())
    hidden, head_dim = config["hidden_size"], config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    outputs = {"q_proj": config["num_attention_heads"] * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden, generator=generator) * scale
            weights[f"{prefix}.lora_B.weight"] = torch.randn(outputs[target], RANK, generator=generator) * scale
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "base_model_name_or_path": str(model), "r": RANK, "lora_alpha": RANK,
        "target_modules": list(TARGETS), "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False,
    }))  # fmt: skip
    return out
