"""Tiny random models written in Hugging Face format: the fixtures' weights and the oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_BASE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)


def write_tiny_model(folder: Path, kind: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a random model of ``kind`` (llama | qwen2 | llama31 | mistral) to ``folder``."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    params = {**TINY_BASE, **overrides}
    torch.manual_seed(seed)
    if kind == "qwen2":
        model: Any = Qwen2ForCausalLM(Qwen2Config(**params, tie_word_embeddings=True))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**params, sliding_window=None))
    elif kind == "llama31":
        params["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        params["rope_theta"] = 500000.0
        model = LlamaForCausalLM(LlamaConfig(**params))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**params))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        # Random init has tiny variance; widen it so attention is far from uniform.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif p.dim() == 1:
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()
