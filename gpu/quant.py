"""Weight (and KV cache) quantization: formats, validation, and the quantizers themselves.

Weights are quantized once at load time from whatever full-precision checkpoint was read (a
Hugging Face folder, or a GGUF file, which ``gpu.gguf`` first dequantizes to fp32):

- ``int8``: weight-only, symmetric, one fp32 scale per output channel
  (``W ~= q * scale[:, None]``, ``q`` in [-127, 127]); activations stay in the model dtype.
  Per-channel rounding error is at most ``scale / 2``: a relative error of ~0.4% of the row's
  largest weight.
- ``fp8``: float8 e4m3 weights with one fp32 scale per output channel, activations quantized
  per token (row) to e4m3 at run time, then ``torch._scaled_mm`` (Hopper's fp8 tensor cores;
  torch also runs it on CPU, which the tests use). Per-token activation scales keep each row's
  result independent of the rest of the batch.

The KV cache can be stored in float8 e4m3 (``--kv-cache-dtype fp8``): half of bf16's bytes
(a quarter of fp32's), no scales (vLLM's and FlashInfer's default: keys and values of these
models sit well inside e4m3's +-448 range).
"""

from __future__ import annotations

import torch

from gpu.config import ModelError
from gpu.formats import KV_CACHE_DTYPES

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
INT8_MAX = 127.0


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for ``--kv-cache-dtype`` (``auto``: the model's dtype)."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        return FP8
    raise ModelError(f"unknown kv cache dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")


def _row_scales(weight: torch.Tensor, qmax: float) -> torch.Tensor:
    amax = weight.abs().amax(dim=1).to(torch.float32)
    # An all-zero row gets scale 1 (its codes are 0 either way) rather than a division by 0.
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (int8 ``[N, K]``, fp32 scales ``[N]``), symmetric per output row."""
    w = weight.to(torch.float32)
    scale = _row_scales(w, INT8_MAX)
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale


def pack_row_blocks(w: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N/8), ceil(K/8), 8, 8]`` (zero padded, same dtype): blocks of 8
    output rows, each a sequence of 8-row x 8-column tiles, the layout the CPU linear kernels
    stream (see ``gpu.cpu_kernels``)."""
    n, k = w.shape
    np_, kp = -(-n // 8) * 8, -(-k // 8) * 8
    padded = torch.zeros((np_, kp), dtype=w.dtype, device=w.device)
    padded[:n, :k] = w
    return padded.view(np_ // 8, 8, kp // 8, 8).permute(0, 2, 1, 3).contiguous()


def unpack_row_blocks(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of :func:`pack_row_blocks`: ``[n, k]``."""
    nb, kb = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(nb * 8, kb * 8)[:n, :k]


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (e4m3 ``[N, K]``, fp32 scales ``[N]``), per output row."""
    w = weight.to(torch.float32)
    scale = _row_scales(w, FP8_MAX)
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.contiguous(), scale


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``[M, K]`` -> (e4m3 ``[M, K]``, fp32 scales ``[M, 1]``), one scale per row."""
    amax = x.abs().amax(dim=1, keepdim=True).to(torch.float32)
    scale = torch.clamp(amax, min=1e-12) / FP8_MAX
    q = (x.to(torch.float32) / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def fp8_matmul_supported(device: torch.device) -> bool:
    """fp8 tensor cores: compute capability 8.9 (Ada) or 9.x (Hopper). CPU runs ``_scaled_mm``
    too (slowly; for tests and quality reports)."""
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)
