"""Model configuration: the subset of a Hugging Face ``config.json`` the runtime needs.

One frozen dataclass, validated in ``__post_init__``; derived values are properties.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ModelError(ValueError):
    """A model folder, file or input that the runtime cannot use; the message names the problem."""


# model_type -> architecture family knobs. Qwen2 puts biases on q/k/v; Qwen3 has none but
# normalises each q and k head (RMSNorm over head_dim, before the rotary); the rest have neither.
# The mixture-of-experts families (``MoeConfig``) share their dense relatives' attention.
SUPPORTED_MODEL_TYPES: dict[str, dict[str, bool]] = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "mistral": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
    "mixtral": {"qkv_bias": False, "qk_norm": False},
    "qwen2_moe": {"qkv_bias": True, "qk_norm": False},
    "qwen3_moe": {"qkv_bias": False, "qk_norm": True},
}
# The families whose sliding window applies only with ``use_sliding_window``.
_OPT_IN_WINDOW = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# Mixtral names its experts' projections w1 (gate), w3 (up), w2 (down) under
# ``block_sparse_moe``; the Qwen MoE families keep the dense names under ``mlp``.
MIXTRAL_MOE_NAMES = ("block_sparse_moe", "w1", "w3", "w2")
QWEN_MOE_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj")


_MOE_DEFAULTS: dict[str, dict[str, int]] = {
    "mixtral": {"num_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_intermediate_size": 5632,
    },
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
}  # fmt: skip


@dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP (Mixtral, Qwen1.5/2-MoE, Qwen3-MoE): a router picks
    ``top_k`` of ``num_experts`` SwiGLU experts per token (softmax over all experts, then the
    top k; ``norm_topk_prob``: their weights rescaled to sum to 1) and the token's MLP output
    is the weighted sum of theirs. ``shared_intermediate_size`` (Qwen2-MoE): one more expert
    every token takes, scaled by a sigmoid gate. Layers in ``dense_layers`` keep a dense MLP
    of the model's ``intermediate_size``."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    shared_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    names: tuple[str, str, str, str] = QWEN_MOE_NAMES  # (block, gate, up, down)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ModelError(
                f"num_experts_per_tok={self.top_k} must be 1..num_experts={self.num_experts}"
            )

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def block(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.names[0]}"

    def router(self, layer: int) -> str:
        return f"{self.block(layer)}.gate.weight"

    def expert(self, layer: int, expert: int) -> tuple[str, str, str]:
        """The checkpoint names of one expert's gate, up and down weights."""
        prefix = f"{self.block(layer)}.experts.{expert}"
        return tuple(f"{prefix}.{n}.weight" for n in self.names[1:])  # type: ignore[return-value]

    def shared(self, layer: int) -> tuple[str, str, str, str]:
        """The shared expert's gate, up and down weights and its gate's (Qwen2-MoE)."""
        prefix = f"{self.block(layer)}.shared_expert"
        projections = (f"{prefix}.{n}_proj.weight" for n in ("gate", "up", "down"))
        return (*projections, f"{prefix}_gate.weight")  # type: ignore[return-value]

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> MoeConfig | None:
        model_type = raw.get("model_type")
        if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe"):
            return None
        # (an unset key: transformers' default for the family)
        defaults = _MOE_DEFAULTS[model_type]
        experts = int(
            raw.get("num_experts") or raw.get("num_local_experts") or defaults["num_experts"]
        )
        top_k = int(raw.get("num_experts_per_tok") or defaults["num_experts_per_tok"])
        layers = int(raw["num_hidden_layers"])
        if model_type == "mixtral":
            return cls(experts, top_k, int(raw["intermediate_size"]), True, names=MIXTRAL_MOE_NAMES)
        step = int(raw.get("decoder_sparse_step") or 1)
        only_dense = set(raw.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(layers) if i in only_dense or (i + 1) % step)
        shared = 0
        if model_type == "qwen2_moe":
            shared = int(
                raw.get("shared_expert_intermediate_size", defaults["shared_intermediate_size"])
            )
        return cls(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=int(
                raw.get("moe_intermediate_size") or defaults["moe_intermediate_size"]
            ),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            shared_intermediate_size=shared,
            dense_layers=dense,
        )


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency scaling ("rope_type": "llama3"); factor 1 means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(
        cls, raw: dict[str, Any] | None, max_position_embeddings: int = 8192
    ) -> RopeScaling:
        """``max_position_embeddings``: the model's, what transformers takes for an unset
        ``original_max_position_embeddings``."""
        if not raw:
            return cls()
        rope_type = str(raw.get("rope_type", raw.get("type", "default")))
        if rope_type not in ("default", "llama3"):
            raise ModelError(f"unsupported rope_scaling type {rope_type!r} (supported: llama3)")
        if rope_type == "default":
            return cls()
        return cls(
            rope_type=rope_type,
            factor=float(raw["factor"]),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                raw.get("original_max_position_embeddings", max_position_embeddings)
            ),
        )


# Pre-quantized checkpoints the loader reads (gpu.prequantized checks the rest of their config)
READ_QUANT_METHODS = ("awq", "gptq")


def _refuse_what_is_not_computed(raw: dict[str, Any]) -> None:
    """Config settings transformers honours and this runtime does not: a clear error, where
    they were read past and the model computed something else (logits off by ~2 at once)."""
    quantized = raw.get("quantization_config") or raw.get("compression_config")
    method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
    if quantized and (method not in READ_QUANT_METHODS or "compression_config" in raw):
        raise ModelError(
            f"pre-quantized checkpoints of quant_method {method!r} are not supported (awq and "
            "gptq, 4-bit, are): load the unquantized weights and quantize them at load time "
            "(--quantization)"
        )
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ModelError(f"unsupported hidden_act {act!r} (supported: silu)")
    if raw.get("model_type") == "qwen2_moe" and raw.get("qkv_bias") is False:
        raise ModelError("unsupported qkv_bias: false for qwen2_moe (its q/k/v carry biases here)")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag) and raw.get("model_type") not in ("qwen2", "qwen2_moe"):
            raise ModelError(f"unsupported {flag}: true (this runtime puts no bias there)")


def _context_length(raw: dict[str, Any]) -> int:
    """``max_position_embeddings``, cut to the attention window where one applies (Mistral
    v0.1's ``sliding_window: 4096``, also Mistral's default when the key is missing; Qwen2's
    and Qwen3's only with ``use_sliding_window``): within it a sliding window changes nothing, and
    attention here is never windowed."""
    length = int(raw.get("max_position_embeddings", 2048))
    # (transformers' MistralConfig has a 4096 window unless the config says otherwise)
    window = raw.get("sliding_window", 4096 if raw.get("model_type") == "mistral" else None)
    opt_in = raw.get("model_type") in _OPT_IN_WINDOW
    windowed = raw.get("use_sliding_window", False) if opt_in else True
    if windowed and isinstance(window, int) and not isinstance(window, bool) and window > 0:
        return min(length, window)
    return length


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    head_dim_override: int | None = None
    tie_word_embeddings: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    moe: MoeConfig | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelError(
                f"unknown architecture {self.model_type!r}; supported model_type values: "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim_override is None and self.hidden_size % self.num_attention_heads:
            raise ModelError("hidden_size is not a multiple of num_attention_heads")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return SUPPORTED_MODEL_TYPES[self.model_type]["qkv_bias"]

    @property
    def qk_norm(self) -> bool:
        return SUPPORTED_MODEL_TYPES[self.model_type]["qk_norm"]

    def sparse_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts (``moe``)."""
        return self.moe is not None and self.moe.sparse(layer)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], name: str = "model") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type is None:
            archs = raw.get("architectures") or []
            raise ModelError(f"config.json has no model_type (architectures={archs})")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelError(
                f"unknown architecture {model_type!r} (architectures="
                f"{raw.get('architectures')}); supported: "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
            )
        _refuse_what_is_not_computed(raw)
        try:
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                model_type=str(model_type),
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=int(raw["num_attention_heads"]),
                num_key_value_heads=int(
                    raw.get("num_key_value_heads") or raw["num_attention_heads"]
                ),
                max_position_embeddings=_context_length(raw),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(
                    raw.get("rope_theta")
                    or (raw.get("rope_parameters") or {}).get("rope_theta")
                    or 10000.0
                ),
                head_dim_override=int(raw["head_dim"]) if raw.get("head_dim") else None,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                rope_scaling=RopeScaling.from_hf(
                    _rope_scaling_dict(raw), int(raw.get("max_position_embeddings", 2048))
                ),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                name=name,
                moe=MoeConfig.from_hf(raw),
            )
        except KeyError as exc:
            raise ModelError(f"config.json lacks required field {exc.args[0]!r}") from exc

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = folder / "config.json"
        if not path.is_file():
            raise ModelError(f"{folder} has no config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_hf_dict(raw, name=folder.name)


def _rope_scaling_dict(raw: dict[str, Any]) -> dict[str, Any] | None:
    """transformers 5 moved rope settings into ``rope_parameters``; accept both spellings."""
    scaling = raw.get("rope_scaling")
    if scaling:
        return dict(scaling)
    params = raw.get("rope_parameters")
    if params and params.get("rope_type", "default") != "default":
        return dict(params)
    return None
