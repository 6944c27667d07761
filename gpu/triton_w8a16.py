"""Weight-only int8 matmul for steps of many rows (Triton; CUDA, fp16/bf16 activations).

``Int8Linear`` on CUDA keeps its weight as int8 codes with one fp32 scale per output channel
and leaves the activations in bf16 (W8A16): quantizing each activation row to int8 (W8A8, one
``torch._int_mm``) lost too much on small models (SmolLM2-135M, teacher-forced, the CUDA
paths' math in fp32 on the CPU: 90.7% top-1 agreement with the unquantized model against 97.3%
weight-only; ``docs/performance.md``). Steps of a
few rows take ``gpu.triton_gemv`` (the weight's read is the step); longer ones this tiled
GEMM: each program loads a ``BLOCK_M x BLOCK_K`` activation tile and a ``BLOCK_K x BLOCK_N``
tile of codes, widens the codes to the activations' dtype in registers (exact: int8 fits
bf16's 8-bit significand) and accumulates ``tl.dot`` in fp32; the channel scales and the bias
are applied once at the end. The weight crosses memory once, at half bf16's bytes, and the
products run on the tensor cores.

Block shapes are tuned on the device per (N, K) and power-of-two row bucket (``triton.autotune``;
the warm-up runs every bucket a step can reach). The CPU tests run it under Triton's
interpreter with one fixed configuration; Triton is imported only when the kernel first runs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from gpu.triton_launch import interpreted, on_device

DTYPES = (torch.float16, torch.bfloat16)
# Rows are bucketed by powers of two for tuning, up to this (longer steps share its tuning).
MAX_BUCKET = 4096


def row_bucket(m: int) -> int:
    """The tuning bucket of a step of ``m`` rows: ``m`` rounded up to a power of two, at least
    16 (``tl.dot``'s smallest tile) and at most ``MAX_BUCKET``."""
    return min(max(16, 1 << (m - 1).bit_length()), MAX_BUCKET)


def row_buckets(max_rows: int) -> list[int]:
    """Every bucket a step of 1..``max_rows`` rows falls in, smallest first."""
    buckets = [row_bucket(1)]
    while buckets[-1] < row_bucket(max_rows):
        buckets.append(buckets[-1] * 2)
    return buckets


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # Not specialised on M (a row count that is a multiple of 16 would compile apart from one
    # that is not): the warm-up's one call per bucket then covers every step length.
    @triton.jit(do_not_specialize=["M"])  # type: ignore[untyped-decorator]
    def w8a16_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, stride_x, stride_w, stride_y, BUCKET,
        K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        # Programs walk the output in groups of GROUP_M row tiles, so the weight tiles a group
        # reads are reused from L2 by its row tiles.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        in_group = GROUP_M * tiles_n
        first_m = (pid // in_group) * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_m
        pid_n = (pid % in_group) // group_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(
                x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None],
                mask=col_ok[None, :] & k_ok[:, None],
                other=0,
            )
            acc = tl.dot(x, w.to(x.dtype), acc)
        acc = acc * tl.load(s_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    if interpreted():
        return w8a16_kernel, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}
    configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8},
                      num_warps=w, num_stages=s)
        for m, n, k, w, s in (
            (16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
            (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
        )
    ]  # fmt: skip
    return triton.autotune(
        configs, key=["N", "K", "BUCKET"],
        prune_configs_by={"early_config_prune": prune_to_bucket},
    )(w8a16_kernel), {}  # fmt: skip


def prune_to_bucket(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """Row tiles no taller than the bucket (a 16-row step gains nothing from 128-row tiles):
    the autotuning prune of this GEMM and of ``gpu.triton_blocks``'."""
    bucket = int(named_args.get("BUCKET", kwargs.get("BUCKET", MAX_BUCKET)))
    fits = [c for c in configs if c.kwargs["BLOCK_M"] <= bucket]
    return fits or configs[:1]


def w8a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, qweight * scale[:, None], bias)`` for ``x`` ``[M, K]`` fp16/bf16, the
    int8 codes ``[N, K]`` and their fp32 scales ``[N]``; ``[M, N]`` in ``x``'s dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    if x.dtype not in DTYPES or qweight.dtype != torch.int8 or qweight.shape[1] != k:
        raise ValueError(
            f"w8a16_matmul takes fp16/bf16 rows of {qweight.shape[1]} and int8 codes, got x "
            f"{x.dtype} {tuple(x.shape)}, weight {qweight.dtype} {tuple(qweight.shape)}"
        )
    if scale.shape != (n,) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"the scales must be a contiguous fp32 [{n}], got {scale.shape}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"the bias must be a contiguous [{n}], got {bias.shape}")
    if x.stride(1) != 1 or qweight.stride(1) != 1:
        raise ValueError("w8a16_matmul needs rows with unit stride")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    kernel, fixed = _kernel()

    def grid(meta: dict[str, int]) -> tuple[int]:
        return (-(-m // meta["BLOCK_M"]) * -(-n // meta["BLOCK_N"]),)

    with on_device(x):
        kernel[grid](
            x, qweight, scale, bias if bias is not None else y, y, m, n, x.stride(0),
            qweight.stride(0), y.stride(0), row_bucket(m), K=k, HAS_BIAS=bias is not None,
            **fixed,
        )  # fmt: skip
    return y
