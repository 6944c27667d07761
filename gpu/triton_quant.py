"""Per-row activation quantization in one kernel (Triton; CUDA): fp8 e4m3 or int8 codes and
one fp32 scale per row, bit for bit what ``gpu.quant.quantize_fp8_rows`` /
``quantize_int8_rows`` compute with ~7 torch kernels (abs, amax, cast, clamp, divide, divide,
clamp, cast) before every W8A8 / fp8 matmul.

One program per row: a first pass over the row takes its largest magnitude, the scale is
``max(amax, 1e-12) / QMAX``, a second pass writes ``round(x / scale)`` clamped to
``+-QMAX``. The division is IEEE (``tl.div_rn``, as torch's), and the rounding is done here,
half to even, on the fp32 magnitude: for int8 to an integer; for e4m3 to the format's step at
the value's binade (2^(e - 3), or 2^-9 below 2^-6 where e4m3 is subnormal), whose e4m3 bits
(sign, 4 exponent, 3 mantissa bits; -0.0 kept) are then written as bytes: no float-to-fp8 cast,
which Triton's interpreter (the CPU tests') rounds wrongly near powers of two. Triton is imported
only when the kernel first runs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from gpu.quant import FP8, FP8_MAX, INT8_MAX
from gpu.triton_launch import on_device

BLOCK = 1024


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def quantize_rows_kernel(  # type: ignore[no-untyped-def]
        x_ptr, q_ptr, s_ptr, stride_x, stride_q,
        K: tl.constexpr, QMAX: tl.constexpr, FP8_CODES: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        q_row = q_ptr + row * stride_q
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            ks = k0 + offs
            x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / QMAX
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            ks = k0 + offs
            x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            v = tl.minimum(tl.maximum(tl.div_rn(x, scale), -QMAX), QMAX)
            bits = v.to(tl.int32, bitcast=True)
            negative = bits < 0  # the sign bit: -0.0 stays -0.0 (e4m3 has it too)
            v = tl.abs(v)
            if FP8_CODES:
                # the e4m3 step at v's binade: 2^(e - 3), e = floor(log2 |v|), at least 2^-9
                e = ((bits >> 23) & 0xFF) - 127
                e = tl.maximum(e, -6)
                step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
                units = v * ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)  # v / step
            else:
                step = 1.0
                units = v
            low = tl.floor(units)
            frac = units - low
            odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
            up = (frac > 0.5) | ((frac == 0.5) & odd)
            rounded = (low + up.to(tl.float32)) * step
            if FP8_CODES:
                # e4m3's bits of the (exactly representable) magnitude, then the sign bit
                rbits = rounded.to(tl.int32, bitcast=True)
                re = ((rbits >> 23) & 0xFF) - 127
                normal = ((re + 7) << 3) | ((rbits >> 20) & 0x7)
                code = tl.where(re >= -6, normal, (rounded * 512.0).to(tl.int32))  # 2^-9 units
                code = code | (negative.to(tl.int32) << 7)
                tl.store(q_row + ks, code.to(tl.uint8), mask=ks < K)
            else:
                rounded = tl.where(negative, -rounded, rounded)
                tl.store(q_row + ks, rounded.to(q_ptr.dtype.element_ty), mask=ks < K)

    return quantize_rows_kernel


def quantize_rows(x: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[M, K]`` activations -> (e4m3 or int8 codes ``[M, K]``, fp32 scales ``[M, 1]``)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows takes [M, K] rows of unit stride, got {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8 if fp8 else torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        codes = q.view(torch.uint8) if fp8 else q  # e4m3's bytes are written as such
        with on_device(x):
            _kernel()[(m,)](
                x, codes, scale, x.stride(0), q.stride(0),
                K=k, QMAX=FP8_MAX if fp8 else INT8_MAX, FP8_CODES=fp8, BLOCK=BLOCK,
            )  # fmt: skip
    return q, scale
