"""The decoder's non-matmul ops: plain torch (the reference), fused CPU kernels, FlashInfer's.

``TorchOps`` is what every device can run and what the kernels are tested against.
``KernelOps`` replaces each op with one call into ``gpu.cpu_kernels`` (fp32 CPU tensors):
the residual add fused into the RMSNorm, the rotary embedding applied in place to the q/k heads
of the fused qkv output, and SiLU(gate) * up in one pass. Per decoder layer that is 3 calls
instead of ~15 small torch kernels.

``FlashInferOps`` (CUDA, fp16/bf16) does the same with FlashInfer's kernels:
``fused_add_rmsnorm`` (the residual add and the norm in one kernel), rotary in place from a
float32 cos/sin cache (``apply_rope_with_cos_sin_cache_inplace`` on the q and k heads of the
qkv output, strided views, no copy) and ``silu_and_mul``; where FlashInfer is missing
``make_ops`` returns ``TorchOps``.

Contract shared by all: ``add_rms_norm(hidden, delta, ...)`` adds ``delta`` into ``hidden`` in
place (the residual stream) and returns the normalised copy; ``rope_`` rotates in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gpu.cpu_kernels import CpuKernels
from gpu.rope import RotaryEmbedding


@dataclass(frozen=True)
class RopeStep:
    """One step's rotary inputs, built once per step and shared by every layer."""

    positions: torch.Tensor  # int64 [T] (int32 in a CUDA graph's fixed buffer)
    cos: torch.Tensor  # [T, 1, D] (TorchOps) or the full [max_pos, D] table (the others)
    sin: torch.Tensor
    cos_sin_cache: torch.Tensor | None = None  # FlashInferOps: float32 [max_pos, D]


class TorchOps:
    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if delta is not None:
            hidden.add_(delta)
        return F.rms_norm(hidden, (hidden.shape[-1],), weight, eps)

    def rope_step(self, rope: RotaryEmbedding, positions: torch.Tensor) -> RopeStep:
        cos, sin = rope.cos_sin(positions)
        return RopeStep(positions, cos, sin)

    def rope_(self, x: torch.Tensor, num_heads: int, head_dim: int, step: RopeStep) -> None:
        """Rotate the first ``num_heads`` heads of each row of ``x`` ``[T, >= heads * D]``."""
        heads = x[:, : num_heads * head_dim].view(x.shape[0], num_heads, head_dim)
        heads.copy_(RotaryEmbedding.apply(heads, step.cos, step.sin))

    def qk_norm_(
        self,
        x: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        eps: float,
    ) -> None:
        """Qwen3's head norms, in place on the fused qkv output ``x`` ``[T, >= (heads +
        kv_heads) * D]``: each q head RMS-normalised over D with ``q_weight``, each k head
        with ``k_weight``."""
        d, t = q_weight.shape[0], x.shape[0]
        for weight, start, heads in ((q_weight, 0, num_heads), (k_weight, num_heads, num_kv_heads)):
            part = x[:, start * d : (start + heads) * d].view(t, heads, d)
            part.copy_(F.rms_norm(part, (d,), weight, eps))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        half = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :half]) * gate_up[:, half:]


class KernelOps(TorchOps):
    """Fused CPU kernels for fp32 tensors; anything else takes the torch path."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if hidden.dtype != torch.float32 or not hidden.is_contiguous():
            return super().add_rms_norm(hidden, delta, weight, eps)
        if delta is not None and not delta.is_contiguous():
            delta = delta.contiguous()
        return self.kernels.rms_norm(hidden, weight, eps, delta)

    def rope_step(self, rope: RotaryEmbedding, positions: torch.Tensor) -> RopeStep:
        if rope.cos.dtype != torch.float32:
            return super().rope_step(rope, positions)
        return RopeStep(positions, rope.cos, rope.sin)

    def rope_(self, x: torch.Tensor, num_heads: int, head_dim: int, step: RopeStep) -> None:
        if x.dtype != torch.float32 or step.cos.dim() != 2:
            super().rope_(x, num_heads, head_dim, step)
            return
        self.kernels.rope_(x, num_heads, head_dim, step.positions, step.cos, step.sin)

    def qk_norm_(
        self,
        x: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        eps: float,
    ) -> None:
        if x.dtype != torch.float32 or x.stride(1) != 1:
            super().qk_norm_(x, q_weight, k_weight, num_heads, num_kv_heads, eps)
            return
        self.kernels.qk_norm_(x, q_weight, k_weight, num_heads, num_kv_heads, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype != torch.float32 or not gate_up.is_contiguous():
            return super().silu_mul(gate_up)
        return self.kernels.silu_mul(gate_up)


class FlashInferOps(TorchOps):
    """FlashInfer's fused kernels for fp16/bf16 CUDA tensors; anything else takes the torch
    path. ``fi`` is the ``flashinfer`` module."""

    FUSED_DTYPES = (torch.float16, torch.bfloat16)

    def __init__(self, fi: Any) -> None:
        self.fi = fi

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if hidden.dtype not in self.FUSED_DTYPES or hidden.dim() != 2:
            return super().add_rms_norm(hidden, delta, weight, eps)
        if delta is None:
            out: torch.Tensor = self.fi.rmsnorm(hidden, weight, eps)
            return out
        # fused_add_rmsnorm(input, residual): residual += input, then input = norm(residual):
        # the residual stream is ``hidden``, and the normalised copy lands in ``delta``'s
        # memory (the layer's output, not read again), so no new tensor is allocated.
        delta = delta.contiguous()
        self.fi.fused_add_rmsnorm(delta, hidden, weight, eps)
        return delta

    def rope_step(self, rope: RotaryEmbedding, positions: torch.Tensor) -> RopeStep:
        return RopeStep(positions, rope.cos, rope.sin, rope.cos_sin_cache)

    def rope_(self, x: torch.Tensor, num_heads: int, head_dim: int, step: RopeStep) -> None:
        cache = step.cos_sin_cache
        if x.dtype not in self.FUSED_DTYPES or cache is None:
            cos = step.cos[step.positions].unsqueeze(1)
            sin = step.sin[step.positions].unsqueeze(1)
            super().rope_(x, num_heads, head_dim, RopeStep(step.positions, cos, sin))
            return
        # The row is q, k, v (the fused qkv output); ``num_heads`` counts the q and k heads.
        # k is as wide as v, which is what follows them, so q ends where k's width before
        # the rotated part's end. Both are strided views: the kernel reads their strides.
        width = num_heads * head_dim
        q_width = width - (int(x.shape[1]) - width)
        self.fi.apply_rope_with_cos_sin_cache_inplace(
            step.positions, x[:, :q_width], x[:, q_width:width], head_dim, cache, is_neox=True
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype not in self.FUSED_DTYPES or not gate_up.is_contiguous():
            return super().silu_mul(gate_up)
        out: torch.Tensor = self.fi.silu_and_mul(gate_up)
        return out


def make_ops(kernels: CpuKernels | None, device: torch.device | None = None) -> TorchOps:
    """The fused CPU kernels where given; FlashInfer's on CUDA where it is installed; else
    plain torch."""
    if kernels is not None:
        return KernelOps(kernels)
    if device is not None and device.type == "cuda":
        try:
            import flashinfer
        except ImportError:
            return TorchOps()
        return FlashInferOps(flashinfer)
    return TorchOps()
