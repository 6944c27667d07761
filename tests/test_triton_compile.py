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
    built = [line.split()[1] for line in lines if line.startswith("ok ")]
    # gemv: bf16, int8 codes, with the norm, with SiLU and the residual add; the W8A16 GEMM
    # with and without a bias; the block matmul per block type; fp8 and int8 row quantization
    assert built == ["gemv"] * 4 + ["w8a16"] * 2 + ["blocks"] * 3 + ["quantize_rows"] * 2 + [
        "rope_append"
    ], done.stdout
    assert not any(line.startswith("FAIL") for line in lines)
