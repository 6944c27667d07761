"""The weight and KV cache formats by name, apart from the quantizers (``gpu.quant``), which
need torch: a launcher offers these names as flag choices without loading the runtime."""

from __future__ import annotations

from gpu.config import ModelError

# auto: a GGUF model in its own blocks on CPU (where the kernels run), anything else unquantized.
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")
# Decode steps of up to 8 tokens on CUDA: off; matmuls (the linears through Triton's
# matrix-vector kernel, gpu/triton_gemv.py); layers (their norms, SiLU and residual adds too).
TRITON_GEMV_MODES = ("off", "matmuls", "layers")
# What logprobs are taken from (gpu/sampling.py): the model's logits, or those sampled from.
LOGPROBS_MODES = ("raw", "processed")


def check_quantization(quantization: str) -> str:
    if quantization not in QUANTIZATIONS:
        raise ModelError(
            f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}"
        )
    return quantization
