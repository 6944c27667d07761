"""gpu/config.py: settings transformers honours and the runtime does not compute are refused,
or, for an attention window, the context is cut to it (where the window changes nothing)."""

from __future__ import annotations

from typing import Any

import pytest

from gpu.config import ModelConfig, ModelError

BASE: dict[str, Any] = {
    "model_type": "mistral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
}  # fmt: skip


def test_a_sliding_window_cuts_the_context_to_it() -> None:
    """Mistral v0.1 ships sliding_window 4096 with a 32768 context: its window was read past
    and attention over longer prompts was plain causal, every logit past 4096 off."""
    assert (
        ModelConfig.from_hf_dict({**BASE, "sliding_window": 4096}).max_position_embeddings == 4096
    )
    assert (
        ModelConfig.from_hf_dict({**BASE, "sliding_window": None}).max_position_embeddings == 32768
    )
    # transformers' MistralConfig defaults sliding_window to 4096 when the key is missing
    assert ModelConfig.from_hf_dict(BASE).max_position_embeddings == 4096
    for model_type in ("qwen2", "qwen3"):
        qwen = {**BASE, "model_type": model_type, "sliding_window": 4096}
        assert ModelConfig.from_hf_dict(qwen).max_position_embeddings == 32768  # window unused
        qwen_windowed = {**qwen, "use_sliding_window": True}
        assert ModelConfig.from_hf_dict(qwen_windowed).max_position_embeddings == 4096
    assert (
        ModelConfig.from_hf_dict({**BASE, "model_type": "llama"}).max_position_embeddings == 32768
    )


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "fbgemm_fp8"}}, "pre-quantized.*fbgemm_fp8"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "pre-quantized.*bitsandbytes"),
        ({"compression_config": {"format": "int-quantized"}}, "pre-quantized"),
        ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
        ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
        # Qwen3's attention_bias puts one on o_proj too, which this runtime has no place for
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
    ],
)
def test_what_is_not_computed_is_refused(setting: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelError, match=message):
        ModelConfig.from_hf_dict({**BASE, **setting})
    ok = {**BASE, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    assert ModelConfig.from_hf_dict(ok).model_type == "mistral"


def test_llama3_rope_without_original_max_position_embeddings_takes_the_models() -> None:
    """transformers fills an unset original_max_position_embeddings in from the model's
    max_position_embeddings; 8192 was assumed, and a long-context model's frequencies were
    scaled as if its original context were 8192 (logits off by ~0.5)."""
    rope = {"rope_type": "llama3", "factor": 8.0}
    llama = {**BASE, "model_type": "llama", "max_position_embeddings": 131072}
    config = ModelConfig.from_hf_dict({**llama, "rope_scaling": rope})
    assert config.rope_scaling.original_max_position_embeddings == 131072
    given = {**rope, "original_max_position_embeddings": 8192}
    config = ModelConfig.from_hf_dict({**llama, "rope_scaling": given})
    assert config.rope_scaling.original_max_position_embeddings == 8192
