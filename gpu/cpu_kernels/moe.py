"""The Python side of ``moe_mlp`` (moe.c): a mixture-of-experts MLP in one C call.

A sparse layer in torch ops is ~8 small calls per expert it runs (gather, two matmuls, SwiGLU,
scale, add) and a few for the routing: at decode, dozens of experts' worth of Python per layer,
several times the matmuls' own time on these CPUs. ``PackedMoe`` checks the experts' packed
linears once, when the model is built; a call then checks its input and runs the routing and
every expert in C (also inside the fused decode step: ``decoder.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gpu.cpu_kernels.prepared import PackedLinear

MOE_FIELDS = 19  # moe.c: E, k, renormalise, I, router (4), experts, shared I, shared (8), gate


class PackedMoe:
    def __init__(
        self,
        fn: Callable[..., None],
        router: PackedLinear,
        experts: Sequence[tuple[PackedLinear, PackedLinear]],
        top_k: int,
        renormalise: bool,
        shared: tuple[PackedLinear, PackedLinear, torch.Tensor] | None = None,
    ) -> None:
        """``experts``: each one's (gate_up ``[2I, H]``, down ``[H, I]``); ``shared``: the
        shared expert's two and its gate vector (fp32 ``[H]`` or ``[1, H]``)."""
        h, e = router.k, router.n
        if len(experts) != e or not 0 < top_k <= e:
            raise ValueError(f"{len(experts)} experts for a router of {e}, top {top_k}")
        i = experts[0][1].k
        for n, (gate_up, down) in enumerate(experts):
            if (gate_up.n, gate_up.k, down.n, down.k) != (2 * i, h, h, i):
                raise ValueError(f"expert {n} is not gate_up [{2 * i}, {h}] and down [{h}, {i}]")
        fields = [e, top_k, int(renormalise), i, *router.table_entry()]
        self._experts_table = torch.tensor(
            [[*gu.table_entry(), *down.table_entry()] for gu, down in experts], dtype=torch.int64
        )
        fields.append(self._experts_table.data_ptr())
        shared_i = 0
        if shared is None:
            fields += [0] * 10
        else:
            gate_up, down, gate = shared
            shared_i = down.k
            if (gate_up.n, gate_up.k, down.n) != (2 * shared_i, h, h):
                raise ValueError("the shared expert's linears do not fit the router's width")
            if gate.dtype != torch.float32 or not gate.is_contiguous() or gate.numel() != h:
                raise ValueError(f"the shared expert's gate must be contiguous fp32 [{h}]")
            fields += [shared_i, *gate_up.table_entry(), *down.table_entry(), gate.data_ptr()]
        self.descriptor = torch.tensor(fields, dtype=torch.int64)
        assert self.descriptor.numel() == MOE_FIELDS
        # keeps every pointer in the tables valid
        self._held = (router, tuple(experts), shared)
        self._fn = fn
        self.hidden, self.num_experts, self.top_k = h, e, top_k
        self._floats_per_token = e + 2 * h + 3 * max(i, shared_i) + 2 * top_k

    def scratch_sizes(self, tokens: int) -> tuple[int, int]:
        """How many floats and int64s of scratch moe.c needs for a call over ``tokens`` rows."""
        return tokens * self._floats_per_token, 2 * self.num_experts + 2 * tokens * self.top_k

    def scratch(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        floats, ints = self.scratch_sizes(tokens)
        return torch.empty(floats, dtype=torch.float32), torch.empty(ints, dtype=torch.int64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` normed rows (CPU fp32) -> the MLP's output ``[T, H]``."""
        h = self.hidden
        if x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != h:
            raise ValueError(f"x must be CPU fp32 [T, {h}], got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        t = x.shape[0]
        out = torch.empty_like(x)  # (moe.c zeroes it first)
        if t:
            floats, ints = self.scratch(t)
            self._fn(
                self.descriptor.data_ptr(), x.data_ptr(), t, h, out.data_ptr(),
                floats.data_ptr(), ints.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
        return out
