"""GGUF blocks of 32 on CUDA: a matmul that reads Q4_0 / Q4_1 / Q8_0 rows as the file has them.

``BlockLinear`` keeps a weight as the file's rows of blocks (``gpu.quant.BlockWeight``): per
block of 32 weights an fp16 scale ``d`` (Q4_1: and a minimum ``m``), then 16 bytes of 4-bit
codes (weight ``j`` in the low nibble of byte ``j``, weight ``j + 16`` in its high nibble) or
32 int8 codes (Q8_0). On the CPU its own kernels run them; before this kernel CUDA dequantized
them to bf16 at load, four times a Q4 file's bytes. Here each program loads a tile of
``BLOCK_B`` blocks for ``BLOCK_N`` output rows, dequantizes it in registers with ggml's
formulas (``d * (q - 8)``, ``d * q + m``, ``d * q``: the values ``gpu.quant`` dequantizes to,
rounded to the activations' dtype as the load-time path rounded them) and multiplies it on the
tensor cores by the matching activation columns (4-bit: the low nibbles' columns and the high
nibbles' in two ``tl.dot``), accumulating in fp32. The activations are not quantized (W4A16 /
W8A16). The weight crosses memory once, at the file's size: 0.56 bytes a weight for Q4_0, 0.63
for Q4_1, 1.06 for Q8_0, against bf16's 2.

Steps of up to ``FEW_ROWS`` rows (decode) take a matrix-vector kernel instead: no tensor
cores, narrow tiles (BLOCK_N down to 4, so many programs stream a layer's rows) and the
weights kept in fp32 after dequantizing. Block shapes are tuned on the device per (N, K,
type, power-of-two row bucket or row block) (``triton.autotune``; the warm-up runs every one,
``gpu.linear.warm_triton_linears``). The CPU tests run both under Triton's interpreter with
one fixed configuration each.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from gpu.quant import BLOCK_BYTES, QK
from gpu.triton_gemv import MAX_ROWS as FEW_ROWS  # the int8 decode kernel's limit, too
from gpu.triton_launch import interpreted, on_device
from gpu.triton_w8a16 import DTYPES, prune_to_bucket, row_bucket

# The kernel's QTYPE by GGML type name.
QTYPES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # Not specialised on M, so the warm-up's one call per bucket covers every step length.
    @triton.jit(do_not_specialize=["M"])  # type: ignore[untyped-decorator]
    def blocks_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_x, stride_w, stride_y, BUCKET,
        K: tl.constexpr, NB: tl.constexpr, QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):  # fmt: skip
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
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
        w_rows = w_ptr + cols[None, :].to(tl.int64) * stride_w  # each output row's blocks
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # A tile is BLOCK_B blocks of every output row: the scales load once a block
        # ([BLOCK_B, BLOCK_N]) and are broadcast over the block's code rows; the codes load as
        # [BLOCK_B, bytes, BLOCK_N] (each block's bytes contiguous) and are flattened to the
        # tile's K rows. Masked activations read 0: padding weights (K not a multiple of 32,
        # or past the last block) then add nothing, whatever their codes.
        blks = tl.arange(0, BLOCK_B)
        if QTYPE == 2:  # Q8_0: d, then 32 int8 codes (34 bytes)
            r = tl.arange(0, BLOCK_B * 32)
            for b0 in range(0, NB, BLOCK_B):
                ok = ((b0 + blks) < NB)[:, None] & col_ok[None, :]
                at = w_rows + ((b0 + blks) * 34)[:, None]  # [BLOCK_B, BLOCK_N] block starts
                d = tl.load(at.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
                byte = at[:, None, :] + 2 + tl.arange(0, 32)[None, :, None]
                q = tl.load(byte.to(tl.pointer_type(tl.int8)), mask=ok[:, None, :], other=0)
                w = d.to(tl.float32)[:, None, :] * q.to(tl.float32)
                w = tl.reshape(w, (BLOCK_B * 32, BLOCK_N))
                ks = b0 * 32 + r
                x = tl.load(
                    x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0
                )
                acc = tl.dot(x, w.to(x.dtype), acc)
        else:  # Q4_0: d, 16 code bytes (18); Q4_1: d, m, 16 code bytes (20)
            size: tl.constexpr = 20 if QTYPE == 1 else 18
            head: tl.constexpr = 4 if QTYPE == 1 else 2
            r = tl.arange(0, BLOCK_B * 16)
            k_lo = (r // 16) * 32 + r % 16  # byte j of a block: weights j (low) and j + 16
            for b0 in range(0, NB, BLOCK_B):
                ok = ((b0 + blks) < NB)[:, None] & col_ok[None, :]
                at = w_rows + ((b0 + blks) * size)[:, None]
                d = tl.load(at.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
                d = d.to(tl.float32)[:, None, :]
                byte = at[:, None, :] + head + tl.arange(0, 16)[None, :, None]
                codes = tl.load(byte, mask=ok[:, None, :], other=0)
                lo = (codes & 15).to(tl.float32)
                hi = (codes >> 4).to(tl.float32)
                if QTYPE == 1:
                    m = tl.load((at + 2).to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
                    m = m.to(tl.float32)[:, None, :]
                    w_lo = d * lo + m
                    w_hi = d * hi + m
                else:
                    w_lo = d * (lo - 8.0)
                    w_hi = d * (hi - 8.0)
                w_lo = tl.reshape(w_lo, (BLOCK_B * 16, BLOCK_N))
                w_hi = tl.reshape(w_hi, (BLOCK_B * 16, BLOCK_N))
                ks = b0 * 32 + k_lo
                x_lo = tl.load(
                    x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0
                )
                x_hi = tl.load(
                    x_rows + ks[None, :] + 16,
                    mask=row_ok[:, None] & (ks + 16 < K)[None, :],
                    other=0.0,
                )
                acc = tl.dot(x_lo, w_lo.to(x_lo.dtype), acc)
                acc = tl.dot(x_hi, w_hi.to(x_hi.dtype), acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    if interpreted():
        return blocks_kernel, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_B": 2, "GROUP_M": 4}
    configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_B": b, "GROUP_M": 8},
                      num_warps=w, num_stages=s)
        for m, n, b, w, s in (
            (16, 32, 2, 4, 3), (16, 64, 2, 4, 3), (16, 64, 4, 4, 3), (32, 64, 2, 4, 3),
            (64, 64, 2, 4, 3), (64, 128, 2, 4, 3), (128, 128, 2, 8, 3), (128, 64, 4, 8, 3),
        )
    ]  # fmt: skip
    return triton.autotune(
        configs, key=["N", "K", "QTYPE", "BUCKET"],
        prune_configs_by={"early_config_prune": prune_to_bucket},
    )(blocks_kernel), {}  # fmt: skip


@functools.cache
def _gemv_kernel() -> Any:
    """Few rows (a decode step): the GEMM's tiles are at least 16 rows tall and BLOCK_N wide,
    tensor-core work a decode step does not need. Here each program takes ``BLOCK_N`` output
    rows' blocks (each row's blocks lie contiguous in memory) for every activation row at
    once, dequantizing to fp32 (not rounded to the activations' dtype as the GEMM's tiles
    are) and multiplying and summing in registers, with BLOCK_N down to 4: a 4096-wide layer
    on up to 1024 programs."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def blocks_gemv_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_x, stride_w, stride_y,
        K: tl.constexpr, NB: tl.constexpr, QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    ):  # fmt: skip
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        col_ok = cols < N
        row_ok = rows < M
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1]
        x_rows = x_ptr + rows[:, None, None].to(tl.int64) * stride_x  # [BLOCK_M, 1, 1]
        blks = tl.arange(0, BLOCK_B)
        # The products add up per (row, column, block, byte) across the loop and are summed
        # once at the end: a reduction each iteration cost more shuffles and barriers than
        # multiplies.
        if QTYPE == 2:  # Q8_0: d, then 32 int8 codes (34 bytes)
            j = tl.arange(0, 32)
            acc4 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_B, 32), dtype=tl.float32)
            for b0 in range(0, NB, BLOCK_B):
                ok = col_ok[:, None] & ((b0 + blks) < NB)[None, :]  # [BLOCK_N, BLOCK_B]
                at = w_rows + ((b0 + blks) * 34)[None, :]
                d = tl.load(at.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
                byte = at[:, :, None] + 2 + j[None, None, :]  # [BLOCK_N, BLOCK_B, 32]
                q = tl.load(byte.to(tl.pointer_type(tl.int8)), mask=ok[:, :, None], other=0)
                w = d.to(tl.float32)[:, :, None] * q.to(tl.float32)
                ks = ((b0 + blks) * 32)[:, None] + j[None, :]  # [BLOCK_B, 32]
                x = tl.load(
                    x_rows + ks[None, :, :],
                    mask=row_ok[:, None, None] & (ks < K)[None, :, :],
                    other=0.0,
                ).to(tl.float32)  # [BLOCK_M, BLOCK_B, 32]
                acc4 += x[:, None, :, :] * w[None, :, :, :]
            acc = tl.sum(tl.sum(acc4, axis=3), axis=2)
        else:  # Q4_0 (18 bytes: d, 16 code bytes), Q4_1 (20: d, m, 16)
            size: tl.constexpr = 20 if QTYPE == 1 else 18
            head: tl.constexpr = 4 if QTYPE == 1 else 2
            j = tl.arange(0, 16)
            acc4 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_B, 16), dtype=tl.float32)
            for b0 in range(0, NB, BLOCK_B):
                ok = col_ok[:, None] & ((b0 + blks) < NB)[None, :]
                at = w_rows + ((b0 + blks) * size)[None, :]
                d = tl.load(at.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
                d = d.to(tl.float32)[:, :, None]
                codes = tl.load(at[:, :, None] + head + j[None, None, :], mask=ok[:, :, None])
                lo = (codes & 15).to(tl.float32)
                hi = (codes >> 4).to(tl.float32)
                if QTYPE == 1:
                    m = tl.load((at + 2).to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
                    m = m.to(tl.float32)[:, :, None]
                    w_lo = d * lo + m
                    w_hi = d * hi + m
                else:
                    w_lo = d * (lo - 8.0)
                    w_hi = d * (hi - 8.0)
                ks = ((b0 + blks) * 32)[:, None] + j[None, :]  # byte j: weights j and j + 16
                x_ok = row_ok[:, None, None] & (ks < K)[None, :, :]
                x_lo = tl.load(x_rows + ks[None, :, :], mask=x_ok, other=0.0).to(tl.float32)
                x_ok = row_ok[:, None, None] & (ks + 16 < K)[None, :, :]
                x_hi = tl.load(x_rows + ks[None, :, :] + 16, mask=x_ok, other=0.0).to(tl.float32)
                acc4 += x_lo[:, None, :, :] * w_lo[None, :, :, :]
                acc4 += x_hi[:, None, :, :] * w_hi[None, :, :, :]
            acc = tl.sum(tl.sum(acc4, axis=3), axis=2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    if interpreted():
        return blocks_gemv_kernel, {"BLOCK_N": 8, "BLOCK_B": 2}
    # No tl.dot, so no software pipelining: one stage. The accumulator [BLOCK_M, BLOCK_N,
    # BLOCK_B, 16 or 32] and a step's products live in registers (pruned to 64 fp32 a thread
    # for the step's BLOCK_M); wide BLOCK_B puts more bytes in flight a program.
    configs = [
        triton.Config({"BLOCK_N": n, "BLOCK_B": b}, num_warps=w, num_stages=1)
        for n, b, w in (
            (4, 4, 2), (4, 16, 4), (4, 32, 4), (8, 4, 4), (8, 8, 4), (8, 16, 8), (16, 4, 4),
            (16, 8, 8), (32, 4, 8),
        )
    ]  # fmt: skip
    return triton.autotune(
        configs, key=["N", "K", "QTYPE", "BLOCK_M"],
        prune_configs_by={"early_config_prune": _gemv_fits},
    )(blocks_gemv_kernel), {}  # fmt: skip


def _gemv_fits(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """The configs whose product tile stays within 64 fp32 values a thread (Q8_0's blocks
    hold 32 codes a row where 4-bit ones hold 16 bytes, two products each: the same)."""
    block_m = int(kwargs.get("BLOCK_M", named_args.get("BLOCK_M", 1)))
    fits = [
        c for c in configs
        if block_m * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_B"] * 32 <= 64 * 32 * c.num_warps
    ]  # fmt: skip
    return fits or configs[:1]


def block_matmul(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, dequantize_block_rows(qtype, blocks, K), bias)`` for ``x`` ``[M, K]``
    fp16/bf16 and ``blocks`` the file's rows ``uint8 [N, ceil(K/32) * bytes]``; ``[M, N]`` in
    ``x``'s dtype."""
    m, k = x.shape
    if qtype not in QTYPES:
        raise ValueError(f"block_matmul runs {', '.join(QTYPES)}, got {qtype}")
    row_bytes = -(-k // QK) * BLOCK_BYTES[qtype]
    if x.dtype not in DTYPES or blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(
            f"block_matmul takes fp16/bf16 rows and uint8 blocks, got x {x.dtype}, "
            f"blocks {blocks.dtype}"
        )
    if blocks.shape[1] != row_bytes:
        raise ValueError(
            f"{qtype} rows of {blocks.shape[1]} bytes do not hold the {k} inputs of x "
            f"({row_bytes} bytes)"
        )
    n = blocks.shape[0]
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"the bias must be a contiguous [{n}], got {bias.shape}")
    if x.stride(1) != 1 or blocks.stride(1) != 1 or blocks.stride(0) % 2 or blocks.data_ptr() % 2:
        # (the fp16 scales are read in place: every block must start on an even address)
        raise ValueError("block_matmul needs rows with unit stride (blocks: even rows and start)")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if m <= FEW_ROWS:
        kernel, fixed = _gemv_kernel()

        def few_grid(meta: dict[str, int]) -> tuple[int]:
            return (-(-n // meta["BLOCK_N"]),)

        with on_device(x):
            kernel[few_grid](
                x, blocks, bias if bias is not None else y, y, m, n, x.stride(0),
                blocks.stride(0), y.stride(0), K=k, NB=-(-k // QK), QTYPE=QTYPES[qtype],
                HAS_BIAS=bias is not None, BLOCK_M=1 << (m - 1).bit_length(), **fixed,
            )  # fmt: skip
        return y
    kernel, fixed = _kernel()

    def grid(meta: dict[str, int]) -> tuple[int]:
        return (-(-m // meta["BLOCK_M"]) * -(-n // meta["BLOCK_N"]),)

    with on_device(x):
        kernel[grid](
            x, blocks, bias if bias is not None else y, y, m, n, x.stride(0), blocks.stride(0),
            y.stride(0), row_bucket(m), K=k, NB=-(-k // QK), QTYPE=QTYPES[qtype],
            HAS_BIAS=bias is not None, **fixed,
        )  # fmt: skip
    return y
