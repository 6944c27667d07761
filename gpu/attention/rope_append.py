"""Rotary embedding and the paged-KV append in one kernel (Triton; CUDA, fp16/bf16).

Unfused, a decode layer rotates q and k in place (FlashInfer's rotary kernel), then
``append_paged_kv_cache`` reads k and v again to write them into the pages: two launches and
two passes over k. ``rope_append_`` does both in one launch: one program per (token, q or k
head) rotates that head in fp32 from FlashInfer's float32 cos/sin cache (``[max_pos, D]``, the
D/2 frequencies' cos then their sin; NeoX halves, as ``gpu.rope``), writes a q head back in
place, and writes a k head, rotated, and its v head into the token's slot of the paged cache
(``[num_pages, 2, page_size, num_kv_heads, D]``, FlashInfer's NHD layout). The slot is found as
FlashInfer's append finds it: the token's sequence ``b = batch_indices[t]`` and position ``p``,
page ``kv_indices[kv_indptr[b] + p // page_size]``, offset ``p % page_size``. k itself is not
written back: nothing reads it after the append.

``rope_append_reference`` is the same in plain torch (the tests' oracle). Triton is imported
only when the kernel first runs; ``available()`` says whether it can. The CPU tests run the
kernel under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from gpu.triton_launch import on_device

DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def available() -> bool:
    """Whether Triton imports here (the kernels also need CUDA tensors, or the interpreter);
    asked once a process (the quantized linears ask it on every call)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def rope_append_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_ptr, v_ptr, q_row, k_row, v_row,
        pos_ptr, cos_sin_ptr, cache_ptr, batch_ptr, indptr_ptr, indices_ptr,
        page_stride, kv_stride, slot_stride, head_stride,
        NUM_Q: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, HALF)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + i)
        sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + i)
        if h < NUM_Q:
            head = q_ptr + t * q_row + h * (2 * HALF)
            x1 = tl.load(head + i).to(tl.float32)
            x2 = tl.load(head + HALF + i).to(tl.float32)
            tl.store(head + i, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty))
            tl.store(head + HALF + i, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty))
        else:
            kh = h - NUM_Q
            head = k_ptr + t * k_row + kh * (2 * HALF)
            x1 = tl.load(head + i).to(tl.float32)
            x2 = tl.load(head + HALF + i).to(tl.float32)
            b = tl.load(batch_ptr + t).to(tl.int64)
            first = tl.load(indptr_ptr + b).to(tl.int64)
            page = tl.load(indices_ptr + first + pos // PAGE_SIZE).to(tl.int64)
            slot = cache_ptr + page * page_stride + (pos % PAGE_SIZE) * slot_stride
            slot += kh * head_stride
            out_ty = cache_ptr.dtype.element_ty
            tl.store(slot + i, (x1 * cos - x2 * sin).to(out_ty))
            tl.store(slot + HALF + i, (x2 * cos + x1 * sin).to(out_ty))
            v = v_ptr + t * v_row + kh * (2 * HALF)
            tl.store(slot + kv_stride + i, tl.load(v + i).to(tl.float32).to(out_ty))
            tl.store(slot + kv_stride + HALF + i, tl.load(v + HALF + i).to(tl.float32).to(out_ty))

    return rope_append_kernel


def _check_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor
) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[0] != k.shape[0]:
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        raise ValueError(f"{shapes}: want [T, H, D]")
    half = q.shape[2] // 2
    if q.shape[2] != k.shape[2] or q.shape[2] % 2 or half & (half - 1):
        raise ValueError(f"head size {q.shape[2]}: want twice a power of two")
    if any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (q, k, v)):
        raise ValueError("q, k and v must have contiguous heads (views of the qkv rows are)")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.stride(4) != 1:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)}: want [pages, 2, page_size, H, D]")


def rope_append_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    batch_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """Rotate ``q`` ``[T, Hq, D]`` in place and write rotated ``k`` and ``v`` ``[T, Hkv, D]``
    into their slots of ``kv_cache``, in one launch (see the module docstring)."""
    _check_shapes(q, k, v, kv_cache)
    if q.dtype not in DTYPES or kv_cache.dtype not in DTYPES:
        dtypes = f"{q.dtype}/{kv_cache.dtype}"
        raise ValueError(f"fused rotary + append runs in fp16/bf16, not {dtypes}")
    tokens, num_q, d = q.shape
    if tokens == 0:
        return
    page_size = kv_cache.shape[2]
    s = kv_cache.stride()
    grid = (tokens, num_q + k.shape[1])
    with on_device(q):
        _kernel()[grid](
            q, k, v, q.stride(0), k.stride(0), v.stride(0),
            positions, cos_sin_cache, kv_cache, batch_indices, kv_indptr, kv_indices,
            s[0], s[1], s[2], s[3],
            NUM_Q=num_q, HALF=d // 2, PAGE_SIZE=page_size,
            num_warps=1,  # a head of 32-64 values a program
        )  # fmt: skip


def rope_append_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    batch_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """``rope_append_`` in plain torch (fp32 math, one rounding, as the kernel)."""
    _check_shapes(q, k, v, kv_cache)
    pos = positions.long()
    half = q.shape[2] // 2
    cos = cos_sin_cache[pos, :half].unsqueeze(1)
    sin = cos_sin_cache[pos, half:].unsqueeze(1)

    def rotated(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    q.copy_(rotated(q))
    page_size = kv_cache.shape[2]
    first = kv_indptr.long()[batch_indices.long()]
    pages = kv_indices.long()[first + pos // page_size]
    offsets = pos % page_size
    kv_cache[pages, 0, offsets] = rotated(k).to(kv_cache.dtype)
    kv_cache[pages, 1, offsets] = v.to(kv_cache.dtype)
