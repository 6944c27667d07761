"""A matrix-vector kernel for decode steps of a few rows (Triton; CUDA, fp16/bf16 or int8 weights).

At batch 1 a decode step is the weights' read: every linear streams its ``[N, K]`` weight once
for one or a few activation rows. ``gemv`` gives each program ``BLOCK_N`` output columns and
walks K in ``BLOCK_K`` slices, all ``M`` rows at once (``M <= MAX_ROWS``), accumulating in fp32;
the weight is read once whatever ``M`` is. An int8 weight with one scale per output channel
(``gpu.quant.quantize_int8``) is read as it is stored, half bf16's bytes, and each column's sums
are scaled at the end: the weight-only int8 decode step of ``Int8Linear`` on CUDA. Its block
shapes are tuned on the device at first use per (N, K, rows, weight format)
(``triton.autotune``; the executor's warm-up and the graphs' capture runs make that first use).
Whether it beats cuBLAS for bf16 weights on a given GPU is for the GPU check's graphs section
to say (``CausalLM.use_triton_gemv``, ``--triton-gemv``, off by default); int8 weights on
CUDA always take it.

What a decoder layer does between its matmuls can ride in them, since every program reads
the whole input row anyway: an RMSNorm before (its scale is one number a row, applied to the
sums at the end; the norm's weight scales the input on the way), SiLU(gate) * up before the
down projection, and the residual add after (each program adds into its own columns). A
layer of a few rows then launches its four matmuls, the rotary, the KV append and the
attention (``DecoderLayer.forward_few_rows``): the two norm kernels and the SiLU kernel are
gone, 96 kernels a step on an 8B model, whose cost at batch 1 is their launch and tail
latency, not their bytes.

The CPU tests run it under Triton's interpreter (``TRITON_INTERPRET=1``) with one fixed
configuration; Triton is imported only when the kernel first runs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from gpu.triton_launch import interpreted, on_device

MAX_ROWS = 8
DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def gemv_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, s_ptr, b_ptr, norm_ptr, y_ptr, stride_x, stride_w, stride_y, M, N, eps,
        K: tl.constexpr, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
        SILU: tl.constexpr, ADD_TO_Y: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        col_ok = cols < N
        row_ok = rows < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w = tl.load(
                w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0,
            ).to(tl.float32)
            x_at = x_ptr + rows[:, None] * stride_x + ks[None, :]
            x_ok = row_ok[:, None] & k_ok[None, :]
            x = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)
            if SILU:  # x holds [gate | up]: the input is SiLU(gate) * up
                up = tl.load(x_at + K, mask=x_ok, other=0.0).to(tl.float32)
                x = x * tl.sigmoid(x) * up
            if NORM:  # RMSNorm's scale is one number a row: it multiplies the sums at the end
                sum_sq += tl.sum(x * x, axis=1)
                x = x * tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        if SCALED:  # int8 codes: each output channel's scale
            acc = acc * tl.load(s_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if NORM:
            acc = acc * tl.rsqrt(sum_sq / K + eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + rows[:, None] * stride_y + cols[None, :]
        out_ok = row_ok[:, None] & col_ok[None, :]
        if ADD_TO_Y:  # the residual stream: each program adds into its own columns only
            acc += tl.load(out, mask=out_ok, other=0.0).to(tl.float32)
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=out_ok)

    if interpreted():
        return gemv_kernel, {"BLOCK_N": 16, "BLOCK_K": 64}
    # No tl.dot, so no software pipelining: one stage. The product tile is held in registers
    # (BLOCK_M * BLOCK_N * BLOCK_K fp32 over the program's threads): tiles past 64 a thread
    # spill or leave one program per SM, and are pruned for the batch's BLOCK_M.
    configs = [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=1)
        for n, k, w in (
            (4, 128, 2), (4, 256, 4), (8, 128, 4), (8, 128, 8), (16, 128, 8), (8, 256, 4),
            (16, 256, 4), (16, 256, 8), (32, 128, 4), (32, 256, 8), (8, 512, 4), (16, 512, 8),
        )
    ]  # fmt: skip
    # Keyed on the shape and the weight's format: the fused variants (norm, SiLU, residual)
    # stream the same weight and take the plain kernel's tuning. Tuning runs the kernel several
    # times: a residual it adds into is put back after each run.
    return triton.autotune(
        configs, key=["N", "K", "BLOCK_M", "SCALED"],
        prune_configs_by={"early_config_prune": _fits}, restore_value=["y_ptr"],
    )(gemv_kernel), {}  # fmt: skip


def row_blocks(rows: int) -> list[int]:
    """The row counts that build every variant a step of 1..``rows`` rows can launch: the
    kernel is compiled per power-of-two row block (``BLOCK_M``), the last one cut to ``rows``."""
    return sorted({min(1 << (r - 1).bit_length(), rows) for r in range(1, rows + 1)})


def _fits(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """The configs whose product tile stays within 64 fp32 values a thread for this BLOCK_M."""
    block_m = int(kwargs.get("BLOCK_M", named_args.get("BLOCK_M", 1)))
    fits = [
        c for c in configs
        if block_m * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= 64 * 32 * c.num_warps
    ]  # fmt: skip
    return fits or configs[:1]


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    scale: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu: bool = False,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[M, K]`` with ``M <= MAX_ROWS``, with what a
    decoder layer puts around its matmuls done on the way (``gpu.model``'s few-row layers):

    - ``scale``: ``weight`` is int8 codes and this ``[N]`` fp32 tensor their per-channel
      scales (``F.linear(x, weight * scale[:, None], bias)``);
    - ``norm``: ``x`` is RMS-normalised with this ``[K]`` weight first (``F.rms_norm``);
    - ``silu``: ``x`` is ``[M, 2K]``, gate then up, and the input is ``SiLU(gate) * up``;
    - ``add_to``: the result is added into this ``[M, N]`` tensor (the residual stream), which
      is returned.

    The fused inputs are computed in fp32 and never rounded to ``x``'s dtype."""
    m, k = x.shape
    if silu:
        k //= 2
    n = weight.shape[0]
    if not 0 < m <= MAX_ROWS or weight.shape[1] != k or (silu and x.shape[1] != 2 * k):
        wide = f"2 x {weight.shape[1]}" if silu else f"{weight.shape[1]}"
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows of {wide}, got {tuple(x.shape)}")
    if scale is not None:
        if weight.dtype != torch.int8 or x.dtype not in DTYPES:
            raise ValueError(
                f"gemv with scales runs int8 weights on fp16/bf16 rows, got x {x.dtype} and "
                f"weight {weight.dtype}"
            )
        if scale.shape != (n,) or scale.dtype != torch.float32 or not scale.is_contiguous():
            raise ValueError(f"gemv's scales must be a contiguous fp32 [{n}], got {scale.shape}")
    elif weight.dtype not in DTYPES or x.dtype != weight.dtype:
        raise ValueError(f"gemv runs fp16/bf16, got x {x.dtype} and weight {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs rows with unit stride")
    if norm is not None and (norm.shape != (k,) or not norm.is_contiguous()):
        raise ValueError(f"gemv's norm weight must be a contiguous [{k}], got {list(norm.shape)}")
    if add_to is not None and (
        add_to.shape != (m, n) or add_to.stride(1) != 1 or add_to.dtype != x.dtype
    ):
        raise ValueError(
            f"gemv adds into a [{m}, {n}] {x.dtype} tensor with unit-stride rows, got "
            f"{list(add_to.shape)} {add_to.dtype}"
        )
    y = add_to if add_to is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    kernel, fixed = _kernel()
    block_m = 1 << (m - 1).bit_length()

    def grid(meta: dict[str, int]) -> tuple[int]:
        return (-(-n // meta["BLOCK_N"]),)

    with on_device(x):
        kernel[grid](
            x, weight, scale if scale is not None else y, bias if bias is not None else y,
            norm if norm is not None else y, y, x.stride(0), weight.stride(0), y.stride(0), m, n,
            eps, K=k, SCALED=scale is not None, HAS_BIAS=bias is not None, NORM=norm is not None,
            SILU=silu, ADD_TO_Y=add_to is not None, BLOCK_M=block_m, **fixed,
        )  # fmt: skip
    return y
