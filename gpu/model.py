"""A Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2) over a paged KV cache.

The forward pass takes one flat batch of new tokens from many sequences (prompt chunks and
decodes mixed) described by ``BatchMetadata``; attention goes through an ``AttentionBackend``
so the same model runs on plain torch (CPU) or FlashInfer (CUDA). q/k/v and gate/up are fused
into one matmul each at load time: fewer, larger matmuls per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu.attention.backend import AttentionBackend
from gpu.attention.metadata import BatchMetadata
from gpu.config import ModelConfig, ModelError
from gpu.linear import Linear
from gpu.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = torch.cat([w[f"{attn}.{n}_proj.bias"] for n in ("q", "k", "v")])
        self.qkv_proj = Linear(
            torch.cat([w[f"{attn}.{n}_proj.weight"] for n in ("q", "k", "v")]), qkv_bias
        )
        self.o_proj = Linear(w[f"{attn}.o_proj.weight"])
        self.gate_up_proj = Linear(
            torch.cat([w[f"{mlp}.gate_proj.weight"], w[f"{mlp}.up_proj.weight"]])
        )
        self.down_proj = Linear(w[f"{mlp}.down_proj.weight"])
        self.input_norm = nn.Parameter(w[f"{prefix}.input_layernorm.weight"], requires_grad=False)
        self.post_attn_norm = nn.Parameter(
            w[f"{prefix}.post_attention_layernorm.weight"], requires_grad=False
        )
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.intermediate = config.intermediate_size

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = hidden.shape[0]
        x = F.rms_norm(hidden, (hidden.shape[-1],), self.input_norm, self.eps)
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, -1)
        qk = RotaryEmbedding.apply(qk, cos, sin)
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        attn = backend.attend(q, k, v, kv_cache)
        hidden = hidden + self.o_proj(attn.reshape(t, self.q_size))
        x = F.rms_norm(hidden, (hidden.shape[-1],), self.post_attn_norm, self.eps)
        gate_up = self.gate_up_proj(x)
        x = F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
        out: torch.Tensor = hidden + self.down_proj(x)
        return out


class CausalLM(nn.Module):
    """Token ids in, logits out; the KV cache and attention backend are passed per call."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        check_weights(config, weights)
        w = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
        self.config = config
        self.embed_tokens = nn.Parameter(w["model.embed_tokens.weight"], requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, w, f"model.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = nn.Parameter(w["model.norm.weight"], requires_grad=False)
        head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
        self.lm_head = Linear(head)
        self.rope = RotaryEmbedding(config, device, dtype)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: BatchMetadata,
        backend: AttentionBackend,
        kv_layers: list[torch.Tensor],
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` (every token's when ``logits_indices`` is None).

        ``backend.plan(meta)`` must have been called for this step.
        """
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rope.cos_sin(meta.positions)
        for layer, kv_cache in zip(self.layers, kv_layers, strict=True):
            hidden = layer(hidden, cos, sin, backend, kv_cache)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        hidden = F.rms_norm(hidden, (hidden.shape[-1],), self.norm, self.config.rms_norm_eps)
        logits: torch.Tensor = self.lm_head(hidden).float()
        return logits


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape (HF names)."""
    h, d = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (config.num_attention_heads * d, h)
        shapes[f"{p}.self_attn.k_proj.weight"] = (config.num_key_value_heads * d, h)
        shapes[f"{p}.self_attn.v_proj.weight"] = (config.num_key_value_heads * d, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, config.num_attention_heads * d)
        shapes[f"{p}.mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, config.intermediate_size)
        if config.qkv_bias:
            shapes[f"{p}.self_attn.q_proj.bias"] = (config.num_attention_heads * d,)
            shapes[f"{p}.self_attn.k_proj.bias"] = (config.num_key_value_heads * d,)
            shapes[f"{p}.self_attn.v_proj.bias"] = (config.num_key_value_heads * d,)
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Raise ``ModelError`` naming missing tensors or tensors whose shape does not match."""
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(weights))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelError(f"checkpoint is missing tensors: {', '.join(missing[:5])}{more}")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise ModelError(
                f"tensor {name} has shape {tuple(weights[name].shape)}, config expects {shape}"
            )
