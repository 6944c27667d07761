"""Every Triton kernel of the runtime builds for Hopper (sm_90) here, without a GPU: the
interpreter the other tests use runs a kernel's Python, never Triton's compiler, so a kernel
that the lowering refuses would pass them all (``tools/gpu_check/compile_kernels.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu.attention import rope_append

ROOT = Path(__file__).resolve().parents[1]


def bundled_ptxas() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file()


@pytest.mark.skipif(not rope_append.available(), reason="needs triton")
@pytest.mark.skipif(not bundled_ptxas(), reason="needs the ptxas that Triton's wheel bundles")
def test_every_kernel_builds_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real build, not an earlier run's cache
    done = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check.compile_kernels", "--arch", "90"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert not any(line.startswith("FAIL") for line in lines), done.stdout
    built: dict[str, int] = {}
    for line in lines:
        if line.startswith("ok "):
            built[line.split()[1]] = built.get(line.split()[1], 0) + 1
    # every launch the wrappers make, each in every configuration its autotuner would try:
    # gemv (bf16, int8 with and without a bias, norm + bias, SiLU + add, fp16), the W8A16
    # GEMM (bias or not, fp16), the block matmul (3 types, a bias, fp16), fp8 and int8 row
    # quantization, the fused rotary + KV append, the MoE grouped matmuls (gate/up by token,
    # down by pair with the routing weights; bf16 and fp16, fp32 and bf16 weights, top 2 and
    # top 1; 5 configurations each)
    assert set(built) == {
        "gemv", "w8a16", "blocks", "blocks_gemv", "quantize_rows", "rope_append", "moe_grouped"
    }  # fmt: skip
    assert built["moe_grouped"] == 3 * 2 * 5
    assert built["blocks_gemv"] >= 7
    assert built["quantize_rows"] == 2 and built["rope_append"] == 1
    assert built["w8a16"] >= 3 and built["blocks"] >= 5 and built["gemv"] >= 6
