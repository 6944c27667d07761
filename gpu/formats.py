"""The weight and KV cache formats by name, apart from the quantizers (``gpu.quant``), which
need torch: a launcher offers these names as flag choices without loading the runtime."""

from __future__ import annotations

from gpu.config import ModelError

QUANTIZATIONS = ("none", "int8", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")


def check_quantization(quantization: str) -> str:
    if quantization not in QUANTIZATIONS:
        raise ModelError(
            f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}"
        )
    return quantization
