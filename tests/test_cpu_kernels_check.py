"""``python -m gpu.cpu_kernels.check`` (run by CI): a compiler that fails on the kernels fails
the check, where the kernel tests themselves would only skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu.cpu_kernels.build import cpu_supported, find_compiler

pytestmark = pytest.mark.skipif(not cpu_supported(), reason="the kernels need AVX2/FMA")


def run_check(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpu.cpu_kernels.check"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_compiler_that_fails_fails_the_check(tmp_path: Path) -> None:
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\necho "cc: error: unrecognized option -mavx2" >&2\nexit 1\n')
    cc.chmod(0o755)
    out = run_check(CC=str(cc))
    assert out.returncode == 1, out.stderr
    assert "FAILED" in out.stderr and "unrecognized option -mavx2" in out.stderr


def test_a_missing_compiler_named_by_cc_fails_the_check(tmp_path: Path) -> None:
    out = run_check(CC=str(tmp_path / "no-such-cc"))
    assert out.returncode == 1 and "no-such-cc" in out.stderr, out.stderr


def test_no_compiler_at_all_is_a_skip(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env["PATH"] = str(tmp_path)  # nothing in it; python is run by its full path
    out = subprocess.run(
        [sys.executable, "-m", "gpu.cpu_kernels.check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "skipped: no C compiler" in out.stderr, out.stderr


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler here")
def test_a_working_compiler_passes_the_check() -> None:
    out = run_check()
    assert out.returncode == 0 and "built and loaded" in out.stderr, out.stderr
