"""Kernel calls checked once and made many times: a packed linear (checked when the model is
built) and one step's decode attention (checked once per step). The fused decoder
(``decoder.py``) reads their pointers, and ``CpuKernels`` (``wrappers.py``) builds them."""

from __future__ import annotations

from collections.abc import Callable

import torch

# Linear kinds, as blocks.c numbers them: fp32 in 8-row tiles, else rows of 32-weight blocks.
LIN_F32 = 0
LIN_INT8 = 1  # int8 + one fp32 scale per row (W8A8: the activations are quantized too)
LIN_Q4_0 = 2  # GGUF block_q4_0: fp16 d, 16 bytes of 4-bit codes (w = d * (q - 8))
LIN_Q4_1 = 3  # GGUF block_q4_1: fp16 d, fp16 m, 16 bytes of codes (w = d * q + m)
LIN_Q8_0 = 4  # GGUF block_q8_0: fp16 d, 32 int8 codes (w = d * q)
LIN_Q4_0X8 = 5  # Q4_0 repacked in groups of 8 rows (gpu.quant.repack_x8)
LIN_Q4_1X8 = 6  # Q4_1 likewise
LIN_Q8_0X8 = 7  # Q8_0 likewise
BLOCK_BYTES = {
    LIN_INT8: 32, LIN_Q4_0: 18, LIN_Q4_1: 20, LIN_Q8_0: 34, LIN_Q4_0X8: 18, LIN_Q4_1X8: 20,
    LIN_Q8_0X8: 34,
}  # fmt: skip
GROUPED = (LIN_Q4_0X8, LIN_Q4_1X8, LIN_Q8_0X8)
QK = 32  # weights per block


def pointer_or_none(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    # Cheap (these run ~10 times per layer per step) but enough to never hand C a bad pointer.
    if t.dtype != dtype or not t.is_cpu:
        raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")


def check_rope_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    """Raise unless ``cos``/``sin`` are full contiguous fp32 ``[max_pos, head_dim]`` tables."""
    if (
        cos.dtype != torch.float32
        or sin.dtype != torch.float32
        or cos.shape != sin.shape
        or cos.dim() != 2
        or cos.shape[1] != head_dim
        or not (cos.is_contiguous() and sin.is_contiguous())
    ):
        raise ValueError("cos/sin must be contiguous fp32 [max_pos, head_dim] tables")


class PackedLinear:
    """``x @ W.T (* scale) (+ bias)`` for one weight in a kernel layout: fp32 packed by
    ``gpu.quant.pack_row_blocks`` (``LIN_F32``), or ``[n, ceil(k/32) * block bytes]`` rows of
    blocks (int8 with per-row ``scale``; GGUF Q4_0 / Q4_1 / Q8_0 without): checked once here,
    so a call costs one allocation and one C call."""

    def __init__(
        self,
        fn: Callable[..., None],
        kind: int,
        weight: torch.Tensor,
        n: int,
        k: int,
        scale: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        if kind == LIN_F32:
            want: tuple[int, ...] = (-(-n // 8), -(-k // 8), 8, 8)
            dtypes: tuple[torch.dtype, ...] = (torch.float32,)
        elif kind in GROUPED:
            want = (-(-n // 8), -(-k // QK) * 8 * BLOCK_BYTES[kind])
            dtypes = (torch.uint8,)
        elif kind in BLOCK_BYTES:
            want = (n, -(-k // QK) * BLOCK_BYTES[kind])
            dtypes = (torch.int8,) if kind == LIN_INT8 else (torch.uint8,)
        else:
            raise ValueError(f"unknown linear kind {kind}")
        if weight.shape != want or not weight.is_contiguous():
            raise ValueError(f"kernel weight {tuple(weight.shape)} does not hold [{n}, {k}]")
        _check(weight, dtypes[0], "weight")
        if (scale is not None) != (kind == LIN_INT8):
            raise ValueError("int8 weights take one scale per row; other kinds none")
        for name, t in (("scale", scale), ("bias", bias)):
            if t is not None:
                _check(t, torch.float32, name)
                if t.shape != (n,) or not t.is_contiguous():
                    raise ValueError(f"{name} must be contiguous [{n}], got {tuple(t.shape)}")
        self._fn = fn
        self.weight, self.scale, self.bias = weight, scale, bias  # keeps the pointers valid
        self.n, self.k = n, k
        self.kind = kind
        self._pointers = (weight.data_ptr(), n, pointer_or_none(scale), pointer_or_none(bias))

    def table_entry(self) -> list[int]:
        """(kind, weight, scale, bias) as decoder.c's layer table holds a linear."""
        w, _, scale, bias = self._pointers
        return [self.kind, w, scale or 0, bias or 0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"x must be CPU fp32 [M, {self.k}], got {x.dtype} {tuple(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty((m, self.n), dtype=torch.float32)
        w, n, scale, bias = self._pointers
        if self.kind == LIN_F32:
            self._fn(
                x.data_ptr(), m, self.k, x.stride(0), w, n, scale, bias, y.data_ptr(), n,
                torch.get_num_threads(),
            )  # fmt: skip
        else:
            self._fn(
                self.kind, x.data_ptr(), m, self.k, x.stride(0), w, n, scale, bias, y.data_ptr(),
                n, torch.get_num_threads(),
            )  # fmt: skip
        return y


class DecodeAttention:
    """One step's decode metadata for ``paged_decode_attention``, checked once per step; each
    layer then calls it with its q/k/v views, output and cache.

    Decode ``b`` has its single query at token ``rows[b]``; its K/V go to
    ``(append_pages[b], append_offsets[b])`` of the cache first; its pages are
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, the last holding ``last_page_len[b]`` keys.
    """

    def __init__(
        self,
        fn: Callable[..., None],
        rows: torch.Tensor,
        append_pages: torch.Tensor,
        append_offsets: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        last_page_len: torch.Tensor,
        scale: float,
    ) -> None:
        b = rows.numel()
        i64s = (("rows", rows), ("append_pages", append_pages), ("append_offsets", append_offsets))
        for name, t in i64s:
            _check(t, torch.int64, name)
            if t.shape != (b,) or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous [{b}]")
        i32s = (("kv_indptr", kv_indptr), ("kv_indices", kv_indices))
        for name, t in (*i32s, ("last_page_len", last_page_len)):
            _check(t, torch.int32, name)
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if kv_indptr.shape != (b + 1,) or last_page_len.shape != (b,):
            raise ValueError("kv_indptr must be [B + 1] and last_page_len [B]")
        self._fn = fn
        self._tensors = (rows, append_pages, append_offsets, kv_indptr, kv_indices, last_page_len)
        # rows, append_pages, append_offsets, kv_indptr, kv_indices, last_page_len
        self.pointers = tuple(t.data_ptr() for t in self._tensors)
        self.rows = rows
        self.num_seqs = b
        self.max_row = int(rows.max()) if b else -1
        self.max_page = int(append_pages.max()) if b else -1
        if kv_indices.numel():
            self.max_page = max(self.max_page, int(kv_indices.max()))
        self.scale = scale

    def check_cache(self, kv_cache: torch.Tensor, hq: int, hkv: int, d: int) -> None:
        """Raise unless ``kv_cache`` is one layer's contiguous fp32 CPU cache
        ``[pages, 2, page_size, hkv, d]`` holding every page this step touches."""
        if kv_cache.dtype != torch.float32 or not kv_cache.is_cpu:
            raise ValueError("kv_cache must be a CPU fp32 tensor")
        if d % 8 or hq % hkv or hq // hkv > 64 or kv_cache.shape[3:] != (hkv, d):
            raise ValueError("paged_decode_attention needs head_dim % 8 == 0, GQA group <= 64")
        if not kv_cache.is_contiguous() or kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            raise ValueError("paged_decode_attention needs a contiguous [P, 2, ps, Hkv, D] cache")
        if self.max_page >= kv_cache.shape[0]:
            raise ValueError("decode pages out of range for this cache")

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> None:
        """``q``/``out`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` (heads contiguous, rows may
        be strided), ``kv_cache`` one layer's ``[pages, 2, page_size, Hkv, D]``, all fp32."""
        hq, d = q.shape[1], q.shape[2]
        hkv = k.shape[1]
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
            if t.dtype != torch.float32 or not t.is_cpu:
                raise ValueError(f"{name} must be a CPU fp32 tensor")
        self.check_cache(kv_cache, hq, hkv, d)
        if (q.stride(1), q.stride(2), k.stride(1), k.stride(2), out.stride(1), out.stride(2)) != (
            d,
            1,
            d,
            1,
            d,
            1,
        ) or v.stride() != k.stride():
            raise ValueError("paged_decode_attention needs contiguous heads")
        if self.max_row >= min(q.shape[0], out.shape[0]):
            raise ValueError("decode rows out of range for these tensors")
        rows, pages, offsets, indptr, indices, last = self.pointers
        self._fn(
            q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), out.data_ptr(),
            out.stride(0), rows, self.num_seqs, kv_cache.data_ptr(), pages, offsets, indptr,
            indices, last, hq, hkv, d, kv_cache.shape[2], self.scale, torch.get_num_threads(),
        )  # fmt: skip
