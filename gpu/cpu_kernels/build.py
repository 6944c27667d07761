"""Compile the kernels (once per source, flags and Python) and load them."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from functools import cache
from pathlib import Path

import torch

from gpu.cache_dir import cache_root
from gpu.cpu_kernels.wrappers import CpuKernels

logger = logging.getLogger(__name__)

# One translation unit, in this order (later parts call earlier ones). blocks_dot.c is a
# template compiled twice: the AVX2 default, and AVX-512 VNNI under a target pragma (the
# choice between them is made at run time, by the CPU's flags).
PARTS = (
    "prelude.h", "linear.c", "blocks.c", "blocks_dot.c", "blocks_linear.c", "ops.c",
    "attention.c", "shm.c", "moe.c", "decoder.c", "module.c",
)  # fmt: skip
_ISAS = (
    ("#define QISA avx2\n#define QVNNI 0\n", ""),
    (
        '#pragma GCC push_options\n#pragma GCC target("avx512vnni,avx512vl,avx512bw")\n'
        "#define QISA vnni\n#define QVNNI 1\n",
        "#pragma GCC pop_options\n",
    ),
)


def _source() -> str:
    folder = Path(__file__).parent
    out: list[str] = []
    for part in PARTS:
        text = (folder / part).read_text()
        if part == "blocks_dot.c":
            out.extend(f"{pre}{text}#undef QISA\n#undef QVNNI\n{post}" for pre, post in _ISAS)
        else:
            out.append(text)
    return "".join(out)


SOURCE = _source()

FLAGS = (
    "-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared",
)  # fmt: skip
MODULE = "_meshserve_cpu"  # the extension module's name (PyInit__meshserve_cpu)


def cpu_supported() -> bool:
    """AVX2, FMA and F16C (every AVX2 CPU has F16C: GGUF block scales are fp16)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags and " f16c" in flags


def find_compiler() -> str | None:
    """``$CC`` if set (whether or not it works), else ``cc`` or ``gcc`` on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(out: Path) -> None:
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise RuntimeError(f"no Python.h in {include} (install the Python development headers)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "kernels.c"
        src.write_text(SOURCE)
        lib = Path(tmp) / out.name
        proc = subprocess.run(
            [compiler, *FLAGS, f"-I{include}", str(src), "-o", str(lib), "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(lib, out)  # atomic: a concurrent process sees the old file or the new one


@cache
def load() -> CpuKernels | None:
    """The kernels for this process, compiled on first use (about a second) and cached on disk
    under ``$MESHSERVE_CACHE/kernels``; None where they cannot run here (no AVX2/FMA, no
    compiler or Python headers) or with ``MESHSERVE_CPU_KERNELS=0``."""
    if os.environ.get("MESHSERVE_CPU_KERNELS", "1") == "0":
        return None
    return build(cache_root() / "kernels")


def build(folder: Path) -> CpuKernels | None:
    """Compile (unless ``folder`` already holds this source's build) and load the kernels;
    None, with a warning naming why, where that fails."""
    if not cpu_supported():
        logger.info("CPU kernels need AVX2 and FMA; using plain torch ops")
        return None
    try:
        return build_or_raise(folder)
    except (OSError, RuntimeError, ImportError) as exc:
        logger.warning("CPU kernels unavailable, using plain torch ops: %s", exc)
        return None


def build_or_raise(folder: Path) -> CpuKernels:
    """``build`` on a CPU that can run the kernels, raising the reason where that fails."""
    key = SOURCE + " ".join(FLAGS) + sys.version + sysconfig.get_paths()["include"]
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    path = folder / f"{MODULE}.{digest}{suffix}"
    if not path.is_file():
        _build(path)
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return CpuKernels(module, path)
