"""FlashInfer's JIT modules the GPU check (and the model on CUDA) uses: compiled up front in
one parallel ninja run (``prebuild_kernels``), or without a GPU for shipping prebuilt
(``export_aot``: ``make_carry.sh``, the Dockerfile)."""

from __future__ import annotations

import shutil
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def kernel_specs(head_dims: Sequence[int], dtype: torch.dtype) -> list[Any]:
    """FlashInfer's JIT specs of the modules the model uses on CUDA at these head sizes: the
    page (append) module, norm/rope/activation (``gpu.ops.FlashInferOps``), the FA2
    batch-prefill module (which also serves tensor-core decode) and the CUDA-core
    batch-decode module. This leans on FlashInfer internals (0.7.x);
    the arguments are the ones the wrappers' plans pass: fa2, int32 indices, no RoPE, sliding
    window, soft cap, fp16 QK reduction or token-head scales."""
    from flashinfer.jit import gen_act_and_mul_module, gen_batch_decode_module
    from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.page import gen_page_module
    from flashinfer.jit.rope import gen_rope_module

    # The page module, then gpu.ops.FlashInferOps' norm, rotary and SwiGLU modules (the norm
    # module is the CUDA one: device_run.sh sets FLASHINFER_USE_CUDA_NORM=1, the carried
    # files have no CuTe DSL).
    specs = [gen_page_module(), gen_norm_module(), gen_rope_module()]
    specs.append(gen_act_and_mul_module("silu"))
    for d in sorted(set(head_dims)):
        specs.append(
            _gen_batch_prefill_primary_module(
                "fa2", dtype, dtype, dtype, torch.int32, d, d, 0, False, False, False, False
            )
        )
        specs.append(
            gen_batch_decode_module(dtype, dtype, dtype, torch.int32, d, d, 0, False, False)
        )
    return specs


def prebuild_kernels(head_dims: Sequence[int], dtype: torch.dtype) -> dict[str, Any]:
    """Compile the JIT modules the checks will use in one parallel ninja run (FlashInfer
    otherwise builds them one after another on first use); modules shipped prebuilt (see
    ``export_aot``) are skipped. Best effort: on any failure the lazy path still builds what
    it needs, and reports its own error."""
    started = time.perf_counter()
    try:
        from flashinfer.jit import build_jit_specs

        specs = kernel_specs(head_dims, dtype)
        prebuilt = [s.name for s in specs if s.aot_path.exists()]
        build_jit_specs(specs, verbose=False)
    except Exception as exc:
        traceback.print_exc()
        return {"ok": False, "error": repr(exc), "seconds": time.perf_counter() - started}
    return {
        "ok": True,
        "modules": [s.name for s in specs],
        "shipped_prebuilt": prebuilt,
        "seconds": time.perf_counter() - started,
    }


def export_aot(out_dir: Path, head_dims: Sequence[int], dtype: torch.dtype) -> list[Path]:
    """Compile ``kernel_specs`` here (nvcc is enough, no GPU: set FLASHINFER_CUDA_ARCH_LIST)
    and copy each module to ``out_dir/flashinfer/data/aot/<name>/<name>.so``, where FlashInfer
    loads prebuilt modules instead of compiling (falling back to JIT if one fails to load)."""
    from flashinfer.jit import build_jit_specs

    specs = kernel_specs(head_dims, dtype)
    build_jit_specs(specs, verbose=True, skip_prebuilt=False)
    written = []
    for spec in specs:
        dest = out_dir / "flashinfer" / "data" / "aot" / spec.name / f"{spec.name}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, dest)
        written.append(dest)
    return written
