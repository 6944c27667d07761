"""GGUF tensors -> Hugging Face tensors: names, dequantization, q/k RoPE row order."""

from __future__ import annotations

import numpy as np

from gpu.config import MIXTRAL_MOE_NAMES, QWEN_MOE_NAMES, ModelError
from gpu.gguf.reader import Tensor

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


# A mixture of experts' MLP: the router, each expert's projections stacked [E, N, K] in one
# tensor (index into the family's expert names), and Qwen2-MoE's shared expert.
EXPERT_TENSORS = {"ffn_gate_exps.weight": 1, "ffn_up_exps.weight": 2, "ffn_down_exps.weight": 3}
MOE_TENSORS = {
    "ffn_gate_inp.weight": "gate.weight",
    "ffn_gate_shexp.weight": "shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "shared_expert_gate.weight",
}
EXPERT = "{expert}"  # in the names of a stacked tensor's parts


def required_layer_tensors(model_type: str) -> list[str]:
    """The Hugging Face names (after ``model.layers.N.``) every layer of ``model_type`` must
    have: no biases (a file may lack them), the q/k head norms for Qwen3 only; a mixture of
    experts' MLP tensors are checked when the model loads (dense layers may be among them)."""
    qk_norms = model_type in ("qwen3", "qwen3_moe")
    skipped = set() if qk_norms else {"attn_q_norm.weight", "attn_k_norm.weight"}
    moe = model_type in ("mixtral", "qwen2_moe", "qwen3_moe")
    return [
        suffix
        for key, suffix in LAYER_TENSORS.items()
        if not key.endswith(".bias") and key not in skipped
        and not (moe and key.startswith("ffn_") and key != "ffn_norm.weight")
    ]  # fmt: skip


# Tensors that carry no weights of their own in the Hugging Face layout.
_DERIVED_TENSORS = {"rope_freqs.weight"}


def unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (``LlamaModel.permute`` in convert_hf_to_gguf.py).

    Within each head llama.cpp interleaves the two rotary halves (row order 0, d/2, 1, d/2+1, ...)
    so that rotated pairs are adjacent. Hugging Face's ``rotate_half`` expects the halves as two
    contiguous blocks. ``weight`` has the Hugging Face shape ``[n_head * head_dim, ...]`` (a bias
    is 1-D); the result has the same shape.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ModelError(f"cannot unpermute a q/k tensor of {rows} rows into {n_head} heads")
    half = rows // n_head // 2
    rest = weight.shape[1:]
    # llama.cpp row (head h, pair j, half s) = h*2*half + 2*j + s; HF wants h*2*half + s*half + j
    return np.ascontiguousarray(
        weight.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(weight.shape)
    )


def hf_tensor_name(name: str, n_layers: int, model_type: str = "llama") -> str | None:
    """The Hugging Face name of GGUF tensor ``name`` (None: nothing of its own); a stacked
    experts' tensor's names hold ``{expert}``, one per expert (``expert_names``)."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    if name in _DERIVED_TENSORS:
        return None
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer, key = int(parts[1]), parts[2]
        if layer >= n_layers:
            raise ModelError(f"tensor {name!r} names layer {layer}, but block_count={n_layers}")
        moe = MIXTRAL_MOE_NAMES if model_type == "mixtral" else QWEN_MOE_NAMES
        if key in LAYER_TENSORS:
            return f"model.layers.{layer}.{LAYER_TENSORS[key]}"
        if key in EXPERT_TENSORS and model_type.endswith(("_moe", "mixtral")):
            projection = moe[EXPERT_TENSORS[key]]
            return f"model.layers.{layer}.{moe[0]}.experts.{EXPERT}.{projection}.weight"
        if key in MOE_TENSORS and model_type.endswith(("_moe", "mixtral")):
            return f"model.layers.{layer}.{moe[0]}.{MOE_TENSORS[key]}"
        if key.startswith(("ffn_gate.", "ffn_up.", "ffn_down.")) and key.count(".") == 2:
            raise ModelError(
                f"tensor {name!r}: an early Mixtral GGUF with one tensor per expert (llama.cpp "
                "no longer reads these either): use a newer conversion of the model"
            )
    raise ModelError(f"unsupported GGUF tensor {name!r} (no Hugging Face equivalent known)")


def expert_names(name: str, experts: int) -> list[str]:
    """The names of a stacked tensor's parts, one per expert (``name`` itself otherwise)."""
    if EXPERT not in name:
        return [name]
    return [name.replace(EXPERT, str(e)) for e in range(experts)]


def dequantize(tensor: Tensor) -> np.ndarray:
    import gguf

    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelError(
            f"tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, which the gguf "
            f"package cannot dequantize: {exc}"
        ) from exc
    # GGUF lists dimensions fastest-first; numpy (and the HF [out, in] layout) want them reversed.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.array(values, dtype=np.float32, copy=True).reshape(shape)
