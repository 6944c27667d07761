"""The decoder's non-matmul ops, twice: plain torch (the reference) and fused CPU kernels.

``TorchOps`` is what every device can run and what the kernels are tested against.
``KernelOps`` replaces each op with one call into ``gpu.cpu_kernels`` (fp32 CPU tensors):
the residual add fused into the RMSNorm, the rotary embedding applied in place to the q/k heads
of the fused qkv output, and SiLU(gate) * up in one pass. Per decoder layer that is 3 calls
instead of ~15 small torch kernels.

Contract shared by both: ``add_rms_norm(hidden, delta, ...)`` adds ``delta`` into ``hidden`` in
place (the residual stream) and returns the normalised copy; ``rope_`` rotates in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu.cpu_kernels import CpuKernels
from gpu.rope import RotaryEmbedding


@dataclass(frozen=True)
class RopeStep:
    """One step's rotary inputs, built once per step and shared by every layer."""

    positions: torch.Tensor  # int64 [T]
    cos: torch.Tensor  # [T, 1, D] (TorchOps) or the full [max_pos, D] table (KernelOps)
    sin: torch.Tensor


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

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype != torch.float32 or not gate_up.is_contiguous():
            return super().silu_mul(gate_up)
        return self.kernels.silu_mul(gate_up)


def make_ops(kernels: CpuKernels | None) -> TorchOps:
    return TorchOps() if kernels is None else KernelOps(kernels)
