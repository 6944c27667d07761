"""Compile the runtime's Triton kernels for a CUDA architecture on a machine without a GPU.

    python -m tools.gpu_check.compile_kernels [--arch 90] [--all-configs]

Triton's interpreter (the CPU tests) runs a kernel's Python, not the compiler: a kernel can pass
every interpreted test and still fail to build for the GPU (a type the lowering refuses, a
layout it cannot convert, shared memory over the limit). This builds each one to a cubin with
Triton's bundled ``ptxas``, for the launches the runtime makes: each wrapper
(``gpu.triton_gemv.gemv`` in its variants, ``gpu.triton_w8a16.w8a16_matmul``,
``gpu.triton_blocks.block_matmul`` per block type, ``gpu.triton_quant.quantize_rows``,
``gpu.attention.rope_append.rope_append_``) is called on small CPU tensors with its kernel
replaced by a recorder, and each recorded launch is compiled with ``triton.compile`` against
``GPUTarget("cuda", arch, 32)``, specialised as Triton's launcher would (an int equal to 1 a
constant, ints and pointers divisible by 16 marked so, unless the kernel says not to), in
every autotuning configuration its prune function keeps for the launch
(``--first-config``: the first only; on the device the
autotuner skips a configuration only for running out of resources or ``ptxas`` errors,
any other failure stops the launch). A build whose shared memory exceeds the architecture's
per-block limit fails here too (on the device that shows only when the kernel loads).
Prints one line per build; exit status 1 if any failed. Must run without
``TRITON_INTERPRET`` (``tests/test_triton_compile.py`` runs it in a subprocess).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from gpu.quant import quantize_int8, quantize_q4_1, quantize_q8_0

# Shared memory a block may use (bytes), by compute capability x10 (CUDA's programming guide).
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
TYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int8: "i8",
    torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv",
}  # fmt: skip


@dataclass
class Launch:
    """One recorded kernel launch: the kernel (an autotuner or a JIT function) and its
    arguments by name."""

    name: str
    kernel: Any
    args: dict[str, Any] = field(default_factory=dict)
    keywords: frozenset[str] = frozenset()  # the args passed by keyword (constexprs, mostly)


class Recorder:
    """Stands in for a module's kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, name: str, kernel: Any, launches: list[Launch]) -> None:
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            fn = jit_function(self.kernel)
            named = dict(zip(fn.arg_names, args, strict=False)) | kwargs
            self.launches.append(Launch(self.name, self.kernel, named, frozenset(kwargs)))

        return launch


def jit_function(kernel: Any) -> Any:
    """The JIT function behind an autotuner (or the kernel itself)."""
    from triton.runtime.autotuner import Autotuner

    return kernel.fn if isinstance(kernel, Autotuner) else kernel


@contextmanager
def recording(
    module: ModuleType, name: str, launches: list[Launch], attr: str = "_kernel"
) -> Iterator[None]:
    """``module.<attr>()`` (``_kernel``) answers a recorder of its real kernel (with no fixed
    block sizes: the configurations are the autotuner's)."""
    real = getattr(module, attr)
    built = real()
    if isinstance(built, tuple):  # (kernel, fixed block sizes): only the interpreter fixes any
        recorder = Recorder(name, built[0], launches)
        setattr(module, attr, lambda: (recorder, {}))
    else:
        recorder = Recorder(name, built, launches)
        setattr(module, attr, lambda: recorder)
    try:
        yield
    finally:
        setattr(module, attr, real)


def record_launches() -> list[Launch]:
    """Call every Triton wrapper of the runtime on small tensors, as the model does, and
    return the launches (nothing runs)."""
    from gpu import triton_blocks, triton_gemv, triton_moe, triton_quant, triton_w8a16
    from gpu.attention import rope_append

    launches: list[Launch] = []
    gen = torch.Generator().manual_seed(0)
    k, n = 4096, 64
    bf16 = torch.bfloat16
    w = torch.randn((n, k), generator=gen)
    x1, x64 = torch.randn((1, k)).to(bf16), torch.randn((64, k)).to(bf16)
    codes, scales = quantize_int8(w)
    bias = torch.zeros(n, dtype=bf16)
    with recording(triton_gemv, "gemv", launches):
        triton_gemv.gemv(x1, w.to(bf16))
        triton_gemv.gemv(x1, codes, scale=scales)
        triton_gemv.gemv(x1, codes, torch.zeros(n), scale=scales)  # Int8Linear's fp32 bias
        x8 = torch.randn((8, k)).to(bf16)
        # a Qwen2 layer's qkv: the norm and the bias
        triton_gemv.gemv(x8, w.to(bf16), bias, norm=torch.ones(k, dtype=bf16))
        gate_up = torch.randn((8, 2 * k)).to(bf16)
        triton_gemv.gemv(gate_up, w.to(bf16), silu=True, add_to=torch.zeros((8, n), dtype=bf16))
        triton_gemv.gemv(x8.half(), w.half())  # an fp16 model
    with recording(triton_w8a16, "w8a16", launches):
        triton_w8a16.w8a16_matmul(x64, codes, scales)
        triton_w8a16.w8a16_matmul(x64, codes, scales, torch.zeros(n))  # the fp32 bias
        triton_w8a16.w8a16_matmul(x64.half(), codes, scales)
    per_type = (("Q4_0", _q4_0(w)), ("Q4_1", quantize_q4_1(w)), ("Q8_0", quantize_q8_0(w)))
    with recording(triton_blocks, "blocks", launches):
        for qtype, rows in per_type:
            triton_blocks.block_matmul(x64, rows, qtype)
        triton_blocks.block_matmul(x64, quantize_q4_1(w), "Q4_1", torch.zeros(n))  # fp32 bias
        triton_blocks.block_matmul(x64.half(), quantize_q4_1(w), "Q4_1")
    with recording(triton_blocks, "blocks_gemv", launches, "_gemv_kernel"):
        for qtype, rows in per_type:
            triton_blocks.block_matmul(x1, rows, qtype)
            triton_blocks.block_matmul(torch.randn((8, k)).to(bf16), rows, qtype, torch.zeros(n))
        triton_blocks.block_matmul(x1.half(), quantize_q4_1(w), "Q4_1")
    with recording(triton_quant, "quantize_rows", launches):
        for fp8 in (True, False):
            triton_quant.quantize_rows(x64, fp8)
    with recording(rope_append, "rope_append", launches):
        rope_append.rope_append_(*_rope_step())
    with recording(triton_moe, "moe_grouped", launches):
        experts = torch.tensor([[0, 3], [1, 3], [2, 0]])  # 3 tokens, 2 of 4 experts each
        # Mixtral's fp32 routing weights (bf16, fp16), Qwen's in the model's dtype, top 1
        for dtype, routing, chosen in (
            (bf16, torch.float32, experts), (torch.float16, torch.float32, experts),
            (bf16, bf16, experts[:, :1]),
        ):  # fmt: skip
            w1, w2 = torch.randn((4, 128, 256)).to(dtype), torch.randn((4, 256, 64)).to(dtype)
            triton_moe.fused_moe(
                torch.randn((3, 256)).to(dtype), w1, w2, chosen,
                torch.rand(chosen.shape).to(routing),
                lambda gu: gu[:, : gu.shape[1] // 2].contiguous(),
            )  # fmt: skip
    return launches


def _q4_0(weight: torch.Tensor) -> torch.Tensor:
    """Q4_0 rows (the quantizer is not the point here, only the layout: 18-byte blocks)."""
    n, k = weight.shape
    rows = torch.zeros((n, k // 32, 18), dtype=torch.uint8)
    rows[..., :2] = (
        torch.ones((n, k // 32), dtype=torch.float16).view(torch.uint8).view(n, k // 32, 2)
    )
    return rows.view(n, -1)


def _rope_step() -> tuple[torch.Tensor, ...]:
    """A decode step of 2 tokens for 32/8 heads of 128 on 16-token bf16 pages."""
    t, hq, hkv, d, page = 2, 32, 8, 128, 16
    qkv = torch.randn((t, (hq + 2 * hkv) * d)).to(torch.bfloat16)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    positions = torch.tensor([5, 9], dtype=torch.int32)
    cos_sin = torch.randn((64, d), dtype=torch.float32)
    cache = torch.zeros((4, 2, page, hkv, d), dtype=torch.bfloat16)
    batch = torch.tensor([0, 1], dtype=torch.int32)
    indptr = torch.tensor([0, 1, 2], dtype=torch.int32)
    indices = torch.tensor([0, 1], dtype=torch.int32)
    return q, k, v, positions, cos_sin, cache, batch, indptr, indices


def compile_launch(launch: Launch, arch: int, config: Any | None) -> Any:
    """``triton.compile`` of one launch (with one autotuning ``config``) for ``arch``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = jit_function(launch.kernel)
    args = dict(launch.args)
    options = {"num_warps": args.pop("num_warps", 4), "num_stages": args.pop("num_stages", 3)}
    if config is not None:
        args |= config.kwargs
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    no_special = {
        d if isinstance(d, str) else fn.arg_names[d] for d in getattr(fn, "do_not_specialize", ())
    }
    signature: dict[str, str] = {}
    constants: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, param in enumerate(fn.params):
        value = args[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constants[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:  # (a view may start anywhere, as on the device)
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int) and value == 1 and param.name not in no_special:
            signature[param.name] = "constexpr"  # Triton's launcher makes a 1 a constant
            constants[param.name] = 1
        elif isinstance(value, int):
            signature[param.name] = "i64" if abs(value) >= 2**31 else "i32"
            if value % 16 == 0 and param.name not in no_special:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32"
    source = ASTSource(fn, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def kept_configs(launch: Launch) -> list[Any]:
    """The autotuning configurations the device would try for this launch (after the
    kernel's prune function), or ``[None]`` for a kernel that is not autotuned."""
    configs = getattr(launch.kernel, "configs", None)
    if configs is None:
        return [None]
    prune = getattr(launch.kernel, "early_config_prune", None)
    if prune is None:
        return list(configs)
    # as Triton's autotuner calls it: the positional arguments by name, then the keywords
    positional = {k: v for k, v in launch.args.items() if k not in launch.keywords}
    keywords = {k: v for k, v in launch.args.items() if k in launch.keywords}
    return list(prune(configs, positional, **keywords))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100)")
    parser.add_argument(
        "--first-config", action="store_true", help="each kernel's first autotuning config only"
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    failed = 0
    for launch in record_launches():
        configs = kept_configs(launch)
        for config in configs[:1] if args.first_config else configs:
            started = time.perf_counter()
            what = f"{launch.name} {'' if config is None else config}"
            try:
                compiled = compile_launch(launch, args.arch, config)
                seconds = time.perf_counter() - started
                cubin = len(compiled.asm["cubin"])
                shared = compiled.metadata.shared
                limit = SHARED_LIMIT.get(args.arch)
                if limit is not None and shared > limit:
                    raise RuntimeError(f"{shared} B of shared memory, the limit is {limit} B")
                print(f"ok   {what} ({seconds:.1f}s, cubin {cubin} B, shared {shared} B)")
            except Exception as exc:
                failed += 1
                print(f"FAIL {what}: {type(exc).__name__}: {exc}"[:2000])
            sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
