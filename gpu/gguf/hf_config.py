"""The Hugging Face ``config.json`` for a GGUF model: architecture, RoPE scaling, token ids."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu.config import ModelError
from gpu.gguf.reader import Gguf
from gpu.gguf.weights import dequantize

# general.architecture -> (HF model_type, HF architectures entry, q/k rows permuted by llama.cpp)
_ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM", False),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM", False),
}
# llama.cpp writes Mixtral as "llama" with experts
_MIXTRAL = ("mixtral", "MixtralForCausalLM", True)
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class _Arch:
    name: str
    model_type: str
    hf_class: str
    permuted_qk: bool
    n_layers: int
    n_head: int
    n_head_kv: int
    head_dim: int
    experts: int = 0


def arch_of(g: Gguf) -> _Arch:
    arch = str(g.require("general.architecture"))
    if arch not in _ARCHITECTURES:
        raise ModelError(
            f"{g.path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(sorted(_ARCHITECTURES))}"
        )
    model_type, hf_class, permuted = _ARCHITECTURES[arch]
    experts = int(g.get(f"{arch}.expert_count", 0) or 0)
    if experts and arch == "llama":
        model_type, hf_class, permuted = _MIXTRAL
    if (experts > 0) != (model_type in _MOE_TYPES):
        raise ModelError(
            f"{g.path}: {arch}.expert_count={experts} does not fit a {model_type} model"
        )
    hidden = int(g.require(f"{arch}.embedding_length"))
    n_head = int(g.require(f"{arch}.attention.head_count"))
    n_head_kv = int(g.get(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(g.get(f"{arch}.attention.key_length", 0)) or hidden // n_head
    rope_dim = int(g.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelError(
            f"{g.path}: partial rotary embeddings (rope.dimension_count={rope_dim}, "
            f"head_dim={head_dim}) are not supported"
        )
    return _Arch(
        name=arch,
        model_type=model_type,
        hf_class=hf_class,
        permuted_qk=permuted,
        n_layers=int(g.require(f"{arch}.block_count")),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        experts=experts,
    )


def _llama3_rope_factors(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_ctx: int,
) -> np.ndarray:
    """The per-frequency divisors Llama-3.1 style scaling applies (what rope_freqs.weight holds)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_ctx / low_freq_factor
    high_wavelen = original_ctx / high_freq_factor
    smooth = (original_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, mid))


def _rope_scaling(g: Gguf, arch: _Arch, theta: float) -> dict[str, Any] | None:
    prefix = f"{arch.name}.rope.scaling"
    kind = g.get(f"{prefix}.type")
    if kind not in (None, "none"):
        factor = float(g.get(f"{prefix}.factor", 1.0))
        scaling: dict[str, Any] = {"rope_type": str(kind), "type": str(kind), "factor": factor}
        orig = g.get(f"{prefix}.original_context_length")
        if orig:
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling
    freqs = next((t for t in g.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    # Llama 3.1/3.2 GGUFs store the scaling only as precomputed factors; recover the parameters
    # (every Llama 3.x release uses low=1, high=4, original=8192; a file may name the original).
    values = dequantize(freqs).reshape(-1).astype(np.float64)
    factor = float(values.max())
    originals = [8192]
    if g.get(f"{prefix}.original_context_length"):
        originals.insert(0, int(g.get(f"{prefix}.original_context_length")))
    for low, high, orig in ((1.0, 4.0, o) for o in originals):
        expect = _llama3_rope_factors(arch.head_dim, theta, factor, low, high, orig)
        if expect.shape == values.shape and np.allclose(expect, values, rtol=1e-4, atol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig,
            }
    raise ModelError(
        f"{g.path}: rope_freqs.weight does not match Llama-3 style rope scaling; not supported"
    )


def token_id(g: Gguf, name: str) -> int | None:
    value = g.get(f"tokenizer.ggml.{name}_token_id")
    return None if value is None else int(value)


def eos_ids(g: Gguf) -> list[int]:
    ids: list[int] = []
    for name in ("eos", "eot", "eom"):
        tid = token_id(g, name)
        if tid is not None and tid not in ids:
            ids.append(tid)
    return ids


def build_config(
    g: Gguf, arch: _Arch, vocab_size: int, tied: bool, dense_layers: tuple[int, ...] = ()
) -> dict[str, Any]:
    """``dense_layers``: a mixture of experts' layers whose MLP is dense (their tensors say)."""
    a = arch.name
    hidden = int(g.require(f"{a}.embedding_length"))
    theta = float(g.get(f"{a}.rope.freq_base", 10000.0))
    context = int(g.get(f"{a}.context_length", 2048))
    eos = eos_ids(g)
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(
            g.get(f"{a}.feed_forward_length")
            or g.get(f"{a}.expert_feed_forward_length")
            or g.require(f"{a}.feed_forward_length")
        ),
        "num_hidden_layers": arch.n_layers,
        "num_attention_heads": arch.n_head,
        "num_key_value_heads": arch.n_head_kv,
        "head_dim": arch.head_dim,
        "max_position_embeddings": context,
        "rms_norm_eps": float(g.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "bos_token_id": token_id(g, "bos"),
        "eos_token_id": eos[0] if eos else None,
        "pad_token_id": token_id(g, "padding"),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    scaling = _rope_scaling(g, arch, theta)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch.experts:
        config.update(_moe_config(g, arch, dense_layers))
    if arch.model_type in ("llama", "mixtral"):
        config.update(attention_bias=False, mlp_bias=False, attention_dropout=0.0)
    elif arch.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if arch.model_type in ("qwen3", "qwen3_moe"):
            config.update(attention_bias=False)
        config.update(
            use_sliding_window=False,
            sliding_window=context,
            max_window_layers=arch.n_layers,
            attention_dropout=0.0,
        )
    return config


def _moe_config(g: Gguf, arch: _Arch, dense_layers: tuple[int, ...]) -> dict[str, Any]:
    """A mixture of experts' config.json keys, as transformers names them per family. The
    routing weights are renormalised as llama.cpp's graphs do: Mixtral and Qwen3-MoE always,
    Qwen2-MoE never (unless the file says, ``expert_weights_norm``). The experts' sizes are
    their tensors' (files written before llama.cpp stored ``expert_feed_forward_length`` and
    ``expert_shared_feed_forward_length`` lack those keys)."""
    a = arch.name
    used = int(g.require(f"{a}.expert_used_count"))
    size = _rows_of(g, "ffn_gate_exps.weight") or int(
        g.get(f"{a}.expert_feed_forward_length") or g.require(f"{a}.feed_forward_length")
    )
    if arch.model_type == "mixtral":
        return {"num_local_experts": arch.experts, "num_experts_per_tok": used,
                "intermediate_size": size}  # fmt: skip
    config: dict[str, Any] = {
        "num_experts": arch.experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": size,
        "norm_topk_prob": bool(g.get(f"{a}.expert_weights_norm", arch.model_type == "qwen3_moe")),
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(dense_layers),
    }
    if arch.model_type == "qwen2_moe":
        shared = _rows_of(g, "ffn_gate_shexp.weight")
        config["shared_expert_intermediate_size"] = shared or int(
            g.get(f"{a}.expert_shared_feed_forward_length") or 0
        )
    return config


def _rows_of(g: Gguf, suffix: str) -> int:
    """The output rows of the first layer's tensor ``blk.N.<suffix>`` (0: no layer has it)."""
    for tensor in g.tensors:
        if tensor.name.startswith("blk.") and tensor.name.endswith("." + suffix):
            return int(tensor.shape[1])
    return 0
