"""The Python side of ``decode_layers`` (decoder.c): every decoder layer of an all-decode step
in one C call.

A decode step at batch 1 is ~300 small calls (four linears, two norms, rotary, attention and
SwiGLU per layer); from Python each costs a few microseconds of argument checks, allocations
and dispatch, about as much as the matmuls themselves on the int8 model. ``FusedDecoder``
checks the model's weights once, when it is built, and each step's inputs once per step, then
runs the same kernels in the same order with no Python between them: a sequence gets the same
logits on either path (tests/test_fused_decode.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gpu.cpu_kernels.moe import PackedMoe
from gpu.cpu_kernels.prepared import DecodeAttention, PackedLinear, check_rope_tables

# decoder.c: two norms, q/k head norms, four linears (kind, weight, scale, bias), a moe.c
# descriptor (0: a dense MLP)
LAYER_FIELDS = 21


class ReduceFailed(RuntimeError):
    """The all-reduce hook reported a lost rank; the step's outputs are garbage."""


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as the fused step reads it."""

    input_norm: torch.Tensor  # fp32 [H]
    post_attn_norm: torch.Tensor  # fp32 [H]
    qkv: PackedLinear  # H -> (Hq + 2 Hkv) D
    o: PackedLinear  # Hq D -> H
    gate_up: PackedLinear | None  # H -> 2 I (None with ``moe``)
    down: PackedLinear | None  # I -> H
    q_norm: torch.Tensor | None = None  # fp32 [D]: Qwen3's per-head norms (with k_norm)
    k_norm: torch.Tensor | None = None
    moe: PackedMoe | None = None  # a mixture-of-experts MLP instead of gate_up and down


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


class FusedDecoder:
    def __init__(
        self,
        fn: Callable[..., None],
        shape: DecoderShape,
        layers: Sequence[LayerWeights],
        reduce_hook: tuple[int, int] = (0, 0),
    ) -> None:
        """``reduce_hook``: a tensor-parallel rank's in-place all-reduce as (the address of
        ``int fn(int64* ctx, float* data, int64 n)``, ctx), called after each layer's o_proj
        and down_proj (``gpu.parallel.TensorParallel.reduce_hook``); (0, 0) on one device."""
        h, d, i = shape.hidden, shape.head_dim, shape.intermediate
        qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d
        qd = shape.num_heads * d
        rows: list[list[int]] = []
        moes: list[PackedMoe] = []
        for n, layer in enumerate(layers):
            for name, norm in (("input_norm", layer.input_norm), ("post", layer.post_attn_norm)):
                if norm.dtype != torch.float32 or not norm.is_contiguous() or norm.shape != (h,):
                    raise ValueError(f"layer {n} {name} must be contiguous fp32 [{h}]")
            head_norms = (layer.q_norm, layer.k_norm)
            if (head_norms[0] is None) != (head_norms[1] is None):
                raise ValueError(f"layer {n}: q_norm and k_norm come together")
            for norm in (x for x in head_norms if x is not None):
                if norm.dtype != torch.float32 or not norm.is_contiguous() or norm.shape != (d,):
                    raise ValueError(f"layer {n} q/k norms must be contiguous fp32 [{d}]")
            dims = [(layer.qkv, h, qkv), (layer.o, qd, h)]
            if layer.moe is None:
                if layer.gate_up is None or layer.down is None:
                    raise ValueError(f"layer {n} has neither a dense MLP nor experts")
                dims += [(layer.gate_up, h, 2 * i), (layer.down, i, h)]
            elif layer.moe.hidden != h:
                raise ValueError(f"layer {n}: the experts are not {h} wide")
            for lin, k, out in dims:
                if (lin.k, lin.n) != (k, out):
                    raise ValueError(f"layer {n}: a linear is [{lin.n}, {lin.k}], not [{out}, {k}]")
            row = [layer.input_norm.data_ptr(), layer.post_attn_norm.data_ptr()]
            row += [0 if x is None else x.data_ptr() for x in head_norms]
            for lin, _, _ in dims:
                row.extend(lin.table_entry())
            row += [0] * (4 * (4 - len(dims)))
            row.append(0 if layer.moe is None else layer.moe.descriptor.data_ptr())
            rows.append(row)
            if layer.moe is not None:
                moes.append(layer.moe)
        self._fn = fn
        self._reduce = reduce_hook[0] or None
        self._reduce_ctx = reduce_hook[1] or None
        self.shape = shape
        self.layers = tuple(layers)  # keeps every pointer in the table valid
        self._table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), LAYER_FIELDS)
        self._scratch_per_token = 2 * h + qkv + qd + 3 * i
        self._moes = tuple(moes)
        self._kv_key: tuple[tuple[int, ...], ...] = ()
        self._kv = torch.empty(0, dtype=torch.int64)
        self._kv_pages = 0

    def _kv_pointers(self, kv_layers: Sequence[torch.Tensor], attention: DecodeAttention) -> int:
        """The caches' pointer table (checked when the caches change) and their page size."""
        # Pointer and shape: a cache freed and another allocated at its address is re-checked.
        key = tuple((t.data_ptr(), *t.shape) for t in kv_layers)
        if key != self._kv_key:
            if len(kv_layers) != len(self.layers):
                raise ValueError(f"{len(kv_layers)} KV caches for {len(self.layers)} layers")
            s = self.shape
            for cache in kv_layers:
                attention.check_cache(cache, s.num_heads, s.num_kv_heads, s.head_dim)
            if len({tuple(c.shape) for c in kv_layers}) != 1:
                raise ValueError("every layer's KV cache must have the same shape")
            self._kv = torch.tensor([t.data_ptr() for t in kv_layers], dtype=torch.int64)
            self._kv_key = key
            self._kv_pages = int(kv_layers[0].shape[0])
        elif attention.max_page >= self._kv_pages:
            raise ValueError("decode pages out of range for this cache")
        return int(kv_layers[0].shape[2])

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: DecodeAttention,
        kv_layers: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """Run every layer over ``hidden`` ``[T, H]`` (updated in place: the residual stream);
        returns the last layer's MLP output, for the final norm to add in. Token ``t`` is the
        single new token of sequence ``t`` of ``attention``; ``cos``/``sin`` are the full
        ``[max_pos, D]`` rotary tables."""
        s = self.shape
        t = hidden.shape[0]
        if (
            hidden.dtype != torch.float32
            or not hidden.is_cpu
            or not hidden.is_contiguous()
            or hidden.shape != (t, s.hidden)
        ):
            raise ValueError(f"hidden must be contiguous CPU fp32 [T, {s.hidden}]")
        if attention.num_seqs != t or attention.max_row >= t:
            raise ValueError("the fused decode step needs one decode per token row")
        if positions.dtype != torch.int64 or positions.shape != (t,) or positions.stride(0) != 1:
            raise ValueError("positions must be contiguous int64 [T]")
        check_rope_tables(cos, sin, s.head_dim)
        if t and not 0 <= int(positions.min()) <= int(positions.max()) < cos.shape[0]:
            raise ValueError(f"positions must lie in [0, {cos.shape[0]})")
        page_size = self._kv_pointers(kv_layers, attention)
        delta = torch.empty_like(hidden)
        scratch = torch.empty(t * self._scratch_per_token, dtype=torch.float32)
        moe_floats = moe_ints = None
        if self._moes:  # one scratch for every sparse layer: the largest need of each kind
            sizes = [m.scratch_sizes(t) for m in self._moes]
            moe_floats = torch.empty(max(f for f, _ in sizes), dtype=torch.float32)
            moe_ints = torch.empty(max(i for _, i in sizes), dtype=torch.int64)
        rows, pages, offsets, indptr, indices, last = attention.pointers
        rc = self._fn(
            self._table.data_ptr(), self._kv.data_ptr(), len(self.layers), hidden.data_ptr(),
            delta.data_ptr(), t, s.hidden, s.num_heads, s.num_kv_heads, s.head_dim,
            s.intermediate, s.eps, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows,
            pages, offsets, indptr, indices, last, page_size, attention.scale, scratch.data_ptr(),
            torch.get_num_threads(), self._reduce, self._reduce_ctx,
            None if moe_floats is None else moe_floats.data_ptr(),
            None if moe_ints is None else moe_ints.data_ptr(),
        )  # fmt: skip
        if rc:
            raise ReduceFailed("a tensor-parallel all-reduce failed in the fused decode step")
        return delta
