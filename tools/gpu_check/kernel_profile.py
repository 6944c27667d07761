"""Where a decode step's GPU time goes: its kernels by kind, from the torch profiler.

The graphs section's batch-1 step is ~1.4 ms over its weights' read time (the first H200 run);
this says whether the matmuls stream their weights slowly, the small kernels (norms, rotary,
KV append, activation, attention) add up, or the gaps between kernels do. ``profile_steps``
runs a step function under ``torch.profiler`` (CUDA activity: every kernel, those a graph
replay launches too) and ``breakdown`` groups the kernels by :data:`KINDS`, per step: how many,
their summed time, and for the matmuls the bandwidth they reach over the weights' bytes. The
step's measured time minus the summed kernel time is what no kernel covers (launch gaps, host
waits, the tails between dependent kernels).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tools.gpu_check.common import markdown_table

# (kind, substrings of the kernel's name, lower-case); the first kind that matches wins.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("rotary + kv append", ("rope_append",)),  # gpu/attention/rope_append.py
    ("attention", ("batchprefill", "batchdecode", "mergestate", "merge_state", "attention")),
    ("kv append", ("appendpagedkv", "append_paged")),
    ("rotary", ("rope", "rotary")),
    ("norm", ("rmsnorm", "norm")),
    ("activation", ("act_and_mul", "silu", "gelu")),
    ("matmul", ("gemm", "gemv", "cutlass", "xmma", "cublas", "nvjet", "splitk", "matmul")),
    ("copy", ("memcpy", "memset", "copy")),
)


def kernel_kind(name: str) -> str:
    """The :data:`KINDS` entry a kernel's name falls under, else ``other``."""
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


@dataclass(frozen=True)
class KernelTime:
    name: str
    microseconds: float


def profile_steps(step: Callable[[], Any], steps: int) -> list[KernelTime]:
    """Every kernel (and device copy) the device ran during ``steps`` calls of ``step``."""
    from torch._C._autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return [
        KernelTime(e.name, float(e.time_range.elapsed_us()))
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]


def breakdown(
    kernels: Iterable[KernelTime], steps: int, step_ms: float, matmul_bytes: int | None = None
) -> dict[str, Any]:
    """Per kind and step: kernel count and microseconds; ``covered_us`` (all kernels' time),
    ``uncovered_us`` (``step_ms`` minus that), ``matmul_gb_per_s`` (``matmul_bytes`` a step,
    usually the weights', over the matmuls' time) and the slowest kernels by total time."""
    kinds: dict[str, dict[str, float]] = {}
    by_name: dict[str, float] = {}
    for k in kernels:
        row = kinds.setdefault(kernel_kind(k.name), {"count": 0.0, "us": 0.0})
        row["count"] += 1 / steps
        row["us"] += k.microseconds / steps
        by_name[k.name] = by_name.get(k.name, 0.0) + k.microseconds / steps
    covered = sum(r["us"] for r in kinds.values())
    matmul_us = kinds.get("matmul", {}).get("us", 0.0)
    top = sorted(by_name.items(), key=lambda item: -item[1])[:8]
    return {
        "kinds": {
            kind: {"kernels_per_step": round(r["count"], 2), "us_per_step": round(r["us"], 1)}
            for kind, r in sorted(kinds.items(), key=lambda item: -item[1]["us"])
        },
        "kernels_per_step": round(sum(r["count"] for r in kinds.values()), 1),
        "covered_us": round(covered, 1),
        "uncovered_us": round(step_ms * 1000 - covered, 1),
        "matmul_gb_per_s": round(matmul_bytes / matmul_us / 1e3, 1)
        if matmul_bytes and matmul_us
        else None,
        "top_kernels": [{"name": name[:120], "us_per_step": round(us, 1)} for name, us in top],
    }


def breakdown_table(rows: dict[str, dict[str, Any]]) -> str:
    """Markdown: one column per profiled mode, one row per kernel kind and the totals."""
    modes = list(rows)
    kinds = sorted({k for r in rows.values() for k in r["kinds"]})

    def cell(mode: str, kind: str) -> str:
        r = rows[mode]["kinds"].get(kind)
        return "-" if r is None else f"{r['us_per_step']} us ({r['kernels_per_step']})"

    body = [[kind, *(cell(m, kind) for m in modes)] for kind in kinds]
    body.append(["all kernels", *(f"{rows[m]['covered_us']} us" for m in modes)])
    body.append(["not covered by a kernel", *(f"{rows[m]['uncovered_us']} us" for m in modes)])
    body.append(["matmul GB/s", *(str(rows[m]["matmul_gb_per_s"]) for m in modes)])
    return markdown_table(["kernel kind (us a step, kernels a step)", *modes], body)
