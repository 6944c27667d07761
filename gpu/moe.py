"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) over a flat batch of tokens.

The router scores every expert per token (softmax in fp32) and keeps the top k; each expert
then runs once over the tokens that picked it, gathered into one block (tokens sorted by
expert: one host read of the per-expert counts per layer), and its weighted output is added
back at their rows. Experts are ordinary linears of the model's weight format (``make_linear``:
dense, int8, int4, fp8), gate and up fused into one matmul each as in the dense MLP; the
router and the shared expert's gate stay dense.

Under tensor parallelism every rank holds a slice of every expert (its share of the expert's
intermediate size, as in the dense MLP) and the whole router: each rank's output is a
partial sum that the layer's one all-reduce completes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from gpu.attention.rope_append import available as triton_available
from gpu.config import MoeConfig
from gpu.cpu_kernels.moe import PackedMoe
from gpu.linear import DenseLinear, Linear
from gpu.ops import TorchOps
from gpu.quant import BlockWeight

Weight = torch.Tensor | BlockWeight
MOE_DTYPES = (torch.float16, torch.bfloat16)  # gpu.triton_moe's
# Steps of more tokens (long prompt chunks) run each expert apart, on cuBLAS with many rows:
# the grouped kernel's blocks of 16 pairs re-read an expert's weights every 16 rows.
GROUPED_MAX_TOKENS = 128


class Expert(nn.Module):
    """One SwiGLU expert: gate and up in one matmul, then down."""

    def __init__(self, gate_up: Linear, down: Linear) -> None:
        super().__init__()
        self.gate_up_proj = gate_up
        self.down_proj = down

    def __call__(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(ops.silu_mul(self.gate_up_proj(x)))
        return out


class SparseMoe(nn.Module):
    def __init__(
        self,
        moe: MoeConfig,
        w: Mapping[str, Weight],
        layer: int,
        linear: Callable[..., Linear],
        ops: TorchOps,
        stacked: Callable[[list[Weight]], Weight],
        owned: Callable[[Weight], nn.Parameter],
        row_amax: dict[str, torch.Tensor],
    ) -> None:
        """``stacked``, ``owned``: the model's helpers (``gpu.model``) that fuse weights along
        N and keep a small tensor in memory of its own."""
        super().__init__()
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        # Mixtral keeps the routing weights in fp32 until they scale the experts' outputs;
        # the Qwen families cast them to the model's dtype first (as transformers does).
        self.fp32_weights = moe.names[0] == "block_sparse_moe"
        self.ops = ops
        # (full precision whatever the experts' format, as vLLM keeps it)
        self.router = linear(w[moe.router(layer)], quantization="none")

        def expert(gate: str, up: str, down: str) -> Expert:
            return Expert(
                linear(stacked([w[gate], w[up]])), linear(w[down], row_amax=row_amax.get(down))
            )

        self.experts = nn.ModuleList(expert(*moe.expert(layer, e)) for e in range(moe.num_experts))
        self.shared: Expert | None = None
        self.shared_gate: nn.Parameter | None = None
        if moe.shared_intermediate_size:
            gate, up, down, shared_gate = moe.shared(layer)
            self.shared = expert(gate, up, down)
            self.shared_gate = owned(w[shared_gate])
        self._packed: PackedMoe | None = None
        self._packed_built = False
        # the experts' weights stacked [E, 2I, H] and [E, H, I] for gpu.triton_moe
        self.stacked_gate_up: torch.Tensor | None = None
        self.stacked_down: torch.Tensor | None = None
        first = cast(Expert, self.experts[0]).gate_up_proj
        if isinstance(first, DenseLinear) and first.layout == "nk" and triton_available():
            self.stack_experts()

    def stack_experts(self) -> bool:
        """Run the experts as ``gpu.triton_moe``'s grouped matmuls from now on, where every
        expert is a dense fp16/bf16 linear: their weights stacked into two tensors (on CUDA
        each linear then reads its slice of them, so nothing is held twice). Whether it did."""
        experts = cast(list[Expert], list(self.experts))
        linears = [(e.gate_up_proj, e.down_proj) for e in experts]
        if not all(isinstance(x, DenseLinear) for pair in linears for x in pair):
            return False
        dense = cast(list[tuple[DenseLinear, DenseLinear]], linears)
        dtype = dense[0][0].weight.dtype
        if dtype not in MOE_DTYPES and dense[0][0].layout != "nk":
            dtype = torch.bfloat16  # (an fp32 CPU model, for the interpreter's tests)
        if dtype not in MOE_DTYPES or any(x.bias is not None for p in dense for x in p):
            return False
        stacks = []
        for column in (0, 1):
            parts = [
                pair[column].weight if pair[column].layout == "nk"
                else pair[column].dequantized_weight().to(dtype)
                for pair in dense
            ]  # fmt: skip
            stacks.append(torch.stack(parts))
            for e, pair in enumerate(dense):
                if pair[column].layout == "nk":
                    pair[column].weight = stacks[-1][e]
        self.stacked_gate_up, self.stacked_down = stacks
        return True

    def _apply(self, *args: Any, **kwargs: Any) -> SparseMoe:
        # .to() and friends may replace the tensors the packed call points at, and turn the
        # experts' slices of the stacks into tensors of their own: stacked again after
        self._packed, self._packed_built = None, False
        stacked = self.stacked_gate_up is not None
        self.stacked_gate_up = self.stacked_down = None
        module: SparseMoe = super()._apply(*args, **kwargs)  # type: ignore[no-untyped-call]
        if stacked:
            module.stack_experts()
        return module

    def packed(self) -> PackedMoe | None:
        """The whole MLP as one CPU kernel call, where every linear has a packed kernel (fp32
        on the CPU with the kernels; built once)."""
        if not self._packed_built:
            self._packed_built = True
            self._packed = self._build_packed()
        return self._packed

    def _build_packed(self) -> PackedMoe | None:
        kernels, router = self.router.kernels, self.router.packed()
        if kernels is None or router is None:
            return None
        experts = []
        for expert in cast(list[Expert], list(self.experts)):
            gate_up, down = expert.gate_up_proj.packed(), expert.down_proj.packed()
            if gate_up is None or down is None:
                return None
            experts.append((gate_up, down))
        shared = None
        if self.shared is not None and self.shared_gate is not None:
            gate_up, down = self.shared.gate_up_proj.packed(), self.shared.down_proj.packed()
            if gate_up is None or down is None:
                return None
            shared = (gate_up, down, self.shared_gate.data)
        return kernels.packed_moe(router, experts, self.top_k, self.norm_topk_prob, shared)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts ``[T, k]`` and their weights ``[T, k]``."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights if self.fp32_weights else weights.to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` normed hidden states -> the MLP's output ``[T, H]``."""
        packed = self.packed()
        if packed is not None and x.dtype == torch.float32 and x.is_cpu:
            return packed(x)
        stacked = self.stacked_gate_up
        if (
            stacked is not None
            and self.stacked_down is not None
            and x.dtype == stacked.dtype
            and x.shape[0] <= GROUPED_MAX_TOKENS
        ):
            return self.grouped(x)
        return self.per_op(x)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP with the experts in two grouped matmuls (``gpu.triton_moe``)."""
        from gpu.triton_moe import fused_moe

        assert self.stacked_gate_up is not None and self.stacked_down is not None
        experts, weights = self.route(x)
        out = fused_moe(
            x, self.stacked_gate_up, self.stacked_down, experts, weights, self.ops.silu_mul
        )
        return self._add_shared(x, out)

    def per_op(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP in torch ops (CUDA; the CPU without kernels), which ``moe.c`` repeats."""
        experts, weights = self.route(x)
        out = torch.zeros_like(x)
        chosen = experts.flatten()
        order = torch.argsort(chosen, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(chosen, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        scales = weights.flatten()[order].unsqueeze(1)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = tokens[start : start + count]
                y = expert(x[rows], self.ops) * scales[start : start + count]
                out.index_add_(0, rows, y.to(out.dtype))
                start += count
        return self._add_shared(x, out)

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared is not None and self.shared_gate is not None:
            gate = torch.sigmoid(F.linear(x, self.shared_gate))
            out += gate * self.shared(x, self.ops)
        return out
