"""``python -m gpu.cpu_kernels.check``: exit 1 if the CPU kernels cannot be built and loaded
on a machine that should build them (a C compiler and an AVX2/FMA CPU), 0 otherwise.

Why: where :func:`gpu.cpu_kernels.load` returns None, the tests of the kernels and of the
fused decode step skip, and the serving path quietly falls back to plain torch. That is right
on a machine without a compiler, and wrong on one whose compiler fails on our C: CI runs this
first so that a broken build fails it instead of making those tests disappear. It compiles
into a fresh folder, so a build cached under ``$MESHSERVE_CACHE`` cannot hide a compiler that
no longer works, then checks that ``load()`` (what the tests use) gives the kernels too.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from gpu.cpu_kernels.build import build_or_raise, cpu_supported, find_compiler, load


def check() -> str | None:
    """None if the kernels build and load (or need not here), else why they do not."""
    compiler = find_compiler()
    if not cpu_supported():
        say("skipped: this CPU has no AVX2/FMA, the kernels do not run here")
        return None
    if compiler is None:
        say("skipped: no C compiler (set CC or put cc/gcc on PATH)")
        return None
    with tempfile.TemporaryDirectory(prefix="meshserve-kernels-check-") as tmp:
        try:
            built = build_or_raise(Path(tmp))
        except (OSError, RuntimeError, ImportError) as exc:
            return f"the build failed: {exc}"
        say(f"built and loaded with {compiler}: {built.path.name}")
    if os.environ.get("MESHSERVE_CPU_KERNELS") == "0":
        return "MESHSERVE_CPU_KERNELS=0 turns them off, and the tests that need them with them"
    if load() is None:
        return "a fresh build works, but gpu.cpu_kernels.load() gives None (see its warning)"
    return None


def say(line: str) -> None:
    sys.stderr.write(f"cpu kernels: {line}\n")


def main() -> int:
    problem = check()
    if problem is not None:
        say(f"FAILED: {problem}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
