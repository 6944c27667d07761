"""The model the GPU check's model and timing sections load: the default one (SmolLM2) or,
where it is not installed or asked for, a random model of SmolLM2's exact shape written in
Hugging Face format (``write_synthetic_model``, which ``tools/bench`` uses too)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gpu.config import ModelConfig

# SmolLM2-135M-Instruct's config.json (Llama architecture); the synthetic stand-in's shape.
SMOLLM2_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# Qwen3-0.6B's shape (q/k head norms; heads of 128 wider than hidden / heads, q 2x hidden), 4 of
# its 28 layers: the architecture's CUDA paths (the head norms in the graphs) in seconds.
QWEN3_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


# Qwen3-30B-A3B's shape (experts of 768, 8 of them per token; its attention as Qwen3's) in 2
# of its 48 layers and with 32 of its 128 experts: the mixture-of-experts path on CUDA
# (eager: a sparse layer reads its experts' token counts on the host) in seconds.
QWEN3_MOE_CONFIG: dict[str, Any] = {
    **QWEN3_CONFIG,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_experts": 32,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}


def write_synthetic_model(folder: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """A random model of ``config``'s shape in Hugging Face format (config + safetensors).

    Embeddings are wide enough that logits are not flat (as in the test fixtures)."""
    from safetensors.torch import save_file

    from gpu.model import expected_shapes

    folder.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_hf_dict(config)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = 0.8 + 0.4 * torch.rand(shape, generator=gen)
        elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            t = torch.randn(shape, generator=gen) * 0.1
        elif name.endswith(".bias"):
            t = torch.randn(shape, generator=gen) * 0.02
        else:
            t = torch.randn(shape, generator=gen) * (1.0 / shape[1]) ** 0.5
        tensors[name] = t.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def resolve_model(spec: str, workdir: Path) -> tuple[Path, str]:
    """(Hugging Face folder, description). "synthetic" writes the stand-in; "default" falls
    back to it when the default model is not installed."""
    if spec != "synthetic":
        try:
            from gpu.gguf import resolve_model_path

            folder = resolve_model_path(None if spec == "default" else spec, progress=False)
            return folder, f"{spec} -> {folder}"
        except Exception as exc:
            if spec != "default":
                raise
            print(f"[model] default model unavailable ({exc}); using the synthetic stand-in")
            reason = f"default model unavailable: {exc}"
    else:
        reason = "requested"
    folder = write_synthetic_model(workdir / "smollm2-shape-random", SMOLLM2_CONFIG)
    return folder, f"synthetic SmolLM2-135M shape, random weights ({reason})"
