"""A mixture-of-experts MLP on CUDA as two grouped matmuls (Triton), with no host sync.

The torch path (``SparseMoe.per_op``) reads each expert's token count on the host and runs
every expert apart: a sync per layer (no CUDA graph can hold it) and 3 launches per expert.
Here the (token, expert) pairs are grouped by expert on the device (``align``): each expert's
pairs padded to a multiple of ``BLOCK_M`` in one index array of a size fixed by the batch
alone, with each block's expert beside it (-1 past the last). One launch then multiplies
every block by its expert's gate/up weight (rows gathered by token), SwiGLU runs on the
pairs' rows, and a second launch multiplies by the experts' down weights and scales each row
by its routing weight; a sum over each token's k rows gives the output. The experts'
weights are stacked ``[E, N, K]`` (``SparseMoe.stack_experts``; fp16/bf16).

The CPU tests run it under Triton's interpreter (``TRITON_INTERPRET=1``) with one fixed
block configuration; Triton is imported only when the kernel first runs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from gpu.triton_launch import interpreted, on_device

BLOCK_M = 16  # pairs per block: each expert's pair list is padded to a multiple of it
DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def grouped_kernel(  # type: ignore[no-untyped-def]
        a_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, scale_ptr, N, stride_a, stride_we,
        stride_wn, stride_out, num_pairs, top_k, K: tl.constexpr, ROWS_BY_TOKEN: tl.constexpr,
        SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    ):  # fmt: skip
        block = tl.program_id(0)
        expert = tl.load(block_expert_ptr + block)
        if expert < 0:  # a block past the last expert's: no work (and no weights read)
            return
        pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        pair_ok = pair < num_pairs
        row = pair // top_k if ROWS_BY_TOKEN else pair
        row = tl.where(pair_ok, row, 0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(
                a_ptr + row[:, None] * stride_a + ks[None, :],
                mask=pair_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                mask=col_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            if DOT_IN_FP32:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
            else:
                acc += tl.dot(a, w)
        if SCALED:  # each pair's routing weight
            acc = acc * tl.load(scale_ptr + pair, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
        out = out_ptr + pair[:, None].to(tl.int64) * stride_out + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])

    if interpreted():
        return grouped_kernel, {"BLOCK_N": 32, "BLOCK_K": 32}
    configs = [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for n, k, w, s in (
            (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3),
        )
    ]  # fmt: skip
    return triton.autotune(configs, key=["N", "K", "ROWS_BY_TOKEN"])(grouped_kernel), {}


def align(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's chosen experts ``[T, k]`` -> (the pair ids ``t * k + j`` grouped by expert,
    each expert's padded to a multiple of ``BLOCK_M`` with ``T * k`` (no pair); the expert of
    each block of ``BLOCK_M``, -1 for the blocks past the last expert's). Sizes depend on
    ``T``, ``k`` and ``E`` only, and nothing is read on the host."""
    flat = experts.flatten().to(torch.int64)
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    grouped = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first place among the pairs
    rank = torch.arange(pairs, device=flat.device) - first[grouped]
    slots = (padded_ends - padded)[grouped] + rank
    # (at most min(E, pairs) experts have pairs, each padded by at most BLOCK_M - 1)
    num_blocks = -(-(pairs + min(num_experts, pairs) * (BLOCK_M - 1)) // BLOCK_M)
    sorted_pairs = torch.full((num_blocks * BLOCK_M,), pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[slots] = order
    starts = torch.arange(num_blocks, device=flat.device) * BLOCK_M
    block_expert = torch.searchsorted(padded_ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pairs, block_expert


def grouped_matmul(
    a: torch.Tensor,
    weights: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    rows_by_token: bool,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row ``p`` of the result ``[T * k, N]`` is ``a[row] @ weights[e].T`` for pair ``p`` (of
    token ``p // k`` on its expert ``e``), ``row`` the token where ``rows_by_token``, else
    ``p`` itself; ``scale`` ``[T * k]`` multiplies each row."""
    pairs = a.shape[0] * top_k if rows_by_token else a.shape[0]
    n, k = weights.shape[1], weights.shape[2]
    out = torch.empty((pairs, n), dtype=a.dtype, device=a.device)
    if not pairs:
        return out
    if a.stride(1) != 1 or weights.stride(2) != 1 or a.shape[1] != k:
        raise ValueError(f"grouped_matmul needs unit-stride rows of {k}, got {tuple(a.shape)}")
    kernel, fixed = _kernel()

    def grid(meta: dict[str, int]) -> tuple[int, int]:
        return (block_expert.numel(), -(-n // meta["BLOCK_N"]))

    with on_device(a):
        kernel[grid](
            a, weights, out, sorted_pairs, block_expert, scale if scale is not None else out,
            n, a.stride(0), weights.stride(0), weights.stride(1), out.stride(0), pairs, top_k,
            K=k, ROWS_BY_TOKEN=rows_by_token, SCALED=scale is not None, BLOCK_M=BLOCK_M,
            DOT_IN_FP32=interpreted(), **fixed,  # (the interpreter's dot misreads bf16)
        )  # fmt: skip
    return out


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    silu_mul: Any,
) -> torch.Tensor:
    """The experts' part of the MLP: ``x`` ``[T, H]``, the stacked weights ``gate_up``
    ``[E, 2I, H]`` and ``down`` ``[E, H, I]``, each token's experts and routing weights
    ``[T, k]``; ``silu_mul`` the model's SwiGLU. Returns ``[T, H]`` in ``x``'s dtype."""
    t, k = experts.shape
    if not t:
        return torch.zeros_like(x)
    sorted_pairs, block_expert = align(experts, gate_up.shape[0])
    h = grouped_matmul(x, gate_up, sorted_pairs, block_expert, k, rows_by_token=True)
    act = silu_mul(h)
    scale = weights.flatten().contiguous()
    y = grouped_matmul(act, down, sorted_pairs, block_expert, k, False, scale)
    out: torch.Tensor = y.view(t, k, -1).sum(1)  # (accumulated in fp32, rounded once)
    return out
