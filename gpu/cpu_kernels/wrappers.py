"""Typed Python entries of the CPU kernels: each checks what the C code relies on (dtype,
shape, layout) before handing it data pointers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from gpu.cpu_kernels.decoder import DecoderShape, FusedDecoder, LayerWeights
from gpu.cpu_kernels.moe import PackedMoe
from gpu.cpu_kernels.prepared import (
    LIN_F32,
    QK,
    DecodeAttention,
    PackedLinear,
    check_rope_tables,
    pointer_or_none,
)


class CpuKernels:
    """Typed entry points; each checks what the C code relies on (dtype, shape, layout)."""

    def __init__(self, module: ModuleType, path: Path) -> None:
        self.path = path
        self._f32_linear = module.f32_linear
        self._block_linear = module.block_linear
        self._quantize_x = module.quantize_x
        self._vnni = module.vnni
        self._rms_norm = module.rms_norm
        self._rope = module.rope
        self._silu_mul = module.silu_mul
        self._qk_norm = module.qk_norm
        self._attention = module.paged_decode_attention
        self._decode_layers = module.decode_layers
        self._moe_mlp = module.moe_mlp
        self._shm_allreduce = module.shm_allreduce
        self._shm_allreduce_address = module.shm_allreduce_address()

    def packed_linear(
        self,
        kind: int,
        weight: torch.Tensor,
        n: int,
        k: int,
        scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> PackedLinear:
        """A prepared ``[n, k]`` linear over a weight in the layout of ``kind``
        (``prepared.LIN_*``)."""
        fn = self._f32_linear if kind == LIN_F32 else self._block_linear
        return PackedLinear(fn, kind, weight, n, k, scale, bias)

    def block_linear(
        self,
        kind: int,
        x: torch.Tensor,
        weight: torch.Tensor,
        n: int,
        scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(x @ W.T) (* scale) (+ bias)`` for fp32 ``x`` ``[M, K]`` and ``W`` ``[n, K]`` in rows
        of blocks of ``kind``, ``x`` quantized per block of 32 to int8 first (one-off; layers
        keep a :class:`PackedLinear`)."""
        return self.packed_linear(kind, weight, n, x.shape[-1], scale, bias)(x)

    def quantize_x(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The activation quantization of the block kernels, alone: contiguous fp32 ``x``
        ``[M, K]`` -> (int8 codes ``[M, nb, 32]``, scales ``d`` ``[M, nb]``, ``d * sum(codes)``
        ``[M, nb]``)."""
        if x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or not x.is_contiguous():
            raise ValueError("quantize_x needs contiguous CPU fp32 [M, K]")
        m, k = x.shape
        nb = -(-k // QK)
        # blocks.c's xblock: d, s (fp32), sum (int32), 32 codes
        raw = torch.empty((m, nb, 44), dtype=torch.uint8)
        self._quantize_x(x.data_ptr(), m, k, raw.data_ptr())
        scales = raw[:, :, :8].contiguous().view(torch.float32).view(m, nb, 2)
        return raw[:, :, 12:].contiguous().view(torch.int8), scales[..., 0], scales[..., 1]

    def vnni(self, enable: bool | None = None) -> bool:
        """Whether the block kernels use AVX-512 VNNI (detected at first use); ``enable``
        turns that path off (False) or back on where the CPU has it (True)."""
        return bool(self._vnni(-1 if enable is None else int(enable)))

    def f32_linear(
        self, x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ W.T + bias`` for fp32 ``x`` ``[M, K]`` and fp32 ``W`` ``[n, K]`` packed."""
        return self.packed_linear(LIN_F32, weight, n, x.shape[-1], None, bias)(x)

    def decode_attention(
        self,
        rows: torch.Tensor,
        append_pages: torch.Tensor,
        append_offsets: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        last_page_len: torch.Tensor,
        scale: float,
    ) -> DecodeAttention:
        """One step's decode attention (see :class:`DecodeAttention`)."""
        return DecodeAttention(
            self._attention, rows, append_pages, append_offsets, kv_indptr, kv_indices,
            last_page_len, scale,
        )  # fmt: skip

    def fused_decoder(
        self,
        shape: DecoderShape,
        layers: Sequence[LayerWeights],
        reduce_hook: tuple[int, int] = (0, 0),
    ) -> FusedDecoder:
        """Every decoder layer of an all-decode step in one call (see ``decoder.py``)."""
        return FusedDecoder(self._decode_layers, shape, layers, reduce_hook)

    def packed_moe(
        self,
        router: PackedLinear,
        experts: Sequence[tuple[PackedLinear, PackedLinear]],
        top_k: int,
        renormalise: bool,
        shared: tuple[PackedLinear, PackedLinear, torch.Tensor] | None = None,
    ) -> PackedMoe:
        """A mixture-of-experts MLP in one call (see ``moe.py``)."""
        return PackedMoe(self._moe_mlp, router, experts, top_k, renormalise, shared)

    def shm_allreduce(self, ctx: torch.Tensor, data: torch.Tensor) -> int:
        """``shm.c``'s all-reduce of ``data`` (contiguous CPU fp32, in place); 0 or -1 (a
        rank lost: ``ctx`` says which)."""
        if ctx.dtype != torch.int64 or ctx.numel() != 10 or not ctx.is_contiguous():
            raise ValueError("ctx must be contiguous int64 [10]")
        if data.dtype != torch.float32 or not data.is_cpu or not data.is_contiguous():
            raise ValueError("data must be contiguous CPU fp32")
        return int(self._shm_allreduce(ctx.data_ptr(), data.data_ptr(), data.numel()))

    def shm_allreduce_address(self) -> int:
        """The C function's address (``int(int64* ctx, float* data, int64 n)``)."""
        return int(self._shm_allreduce_address)

    def rms_norm(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        delta: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rms_norm(hidden) * weight``; with ``delta``, ``hidden += delta`` first (in place).
        ``hidden`` (and ``delta``) contiguous fp32 ``[T, H]``, ``weight`` fp32 ``[H]``."""
        t, h = hidden.shape
        if (
            hidden.dtype != torch.float32
            or weight.dtype != torch.float32
            or not hidden.is_cpu
            or not hidden.is_contiguous()
            or weight.shape != (h,)
            or (delta is not None and (delta.shape != hidden.shape or not delta.is_contiguous()))
        ):
            raise ValueError("rms_norm needs contiguous CPU fp32 [T, H] inputs")
        out = torch.empty_like(hidden)
        self._rms_norm(
            hidden.data_ptr(), pointer_or_none(delta), t, h, weight.data_ptr(), eps, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rope_(
        self,
        x: torch.Tensor,
        num_heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Rotate, in place, the first ``num_heads`` heads of each row of ``x`` ``[T, >= heads *
        D]`` (rows may be strided, heads contiguous); ``cos``/``sin`` are full fp32
        ``[max_pos, D]`` tables, ``positions`` int64 ``[T]`` within them."""
        if (
            x.dtype != torch.float32
            or not x.is_cpu
            or x.stride(1) != 1
            or x.shape[1] < num_heads * head_dim
            or positions.dtype != torch.int64
            or positions.shape != (x.shape[0],)
            or not positions.is_contiguous()
        ):
            raise ValueError("rope_ needs fp32 rows with heads contiguous and int64 positions")
        check_rope_tables(cos, sin, head_dim)
        self._rope(
            x.data_ptr(), x.shape[0], x.stride(0), num_heads, head_dim, positions.data_ptr(),
            cos.data_ptr(), sin.data_ptr(),
        )  # fmt: skip

    def qk_norm_(
        self,
        x: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        eps: float,
    ) -> None:
        """Qwen3's head norms, in place: each of the first ``num_heads`` heads of each row of
        ``x`` ``[T, >= (heads + kv_heads) * D]`` (rows may be strided, heads contiguous)
        normalised over D with ``q_weight`` ``[D]``, each of the next ``num_kv_heads`` with
        ``k_weight``."""
        d = q_weight.shape[0]
        if (
            x.dtype != torch.float32
            or not x.is_cpu
            or x.dim() != 2
            or x.stride(1) != 1
            or x.shape[1] < (num_heads + num_kv_heads) * d
            or any(
                w.dtype != torch.float32 or w.shape != (d,) or not w.is_contiguous()
                for w in (q_weight, k_weight)
            )
        ):
            raise ValueError("qk_norm_ needs fp32 rows with heads contiguous and fp32 [D] weights")
        self._qk_norm(
            x.data_ptr(), x.shape[0], x.stride(0), num_heads, num_kv_heads, d,
            q_weight.data_ptr(), k_weight.data_ptr(), eps,
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for contiguous fp32 ``[T, 2I]``."""
        if gate_up.dtype != torch.float32 or not gate_up.is_cpu or not gate_up.is_contiguous():
            raise ValueError("silu_mul needs a contiguous CPU fp32 input")
        t, two_i = gate_up.shape
        out = torch.empty((t, two_i // 2), dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), t, two_i // 2, out.data_ptr(), torch.get_num_threads())
        return out
