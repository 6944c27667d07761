"""The GPU check's ``quant`` section: activation rows quantized by one Triton kernel
(``gpu/triton_quant.py``) against the torch kernels of ``gpu.quant`` it replaces before every
W8A8 / fp8 matmul: the same codes and scales, byte for byte, and the time of each (median of
``iters`` calls, CUDA events)."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from gpu.quant import torch_quantize_rows
from tools.gpu_check.common import markdown_table


def _median_us(fn: Any, iters: int) -> float:
    event: Any = torch.cuda.Event  # untyped in torch's stubs
    samples = []
    for _ in range(iters):
        start, end = event(enable_timing=True), event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000)
    return float(statistics.median(samples))


def quant_section(
    device: torch.device,
    shapes: tuple[tuple[int, int], ...] = ((1, 4096), (8, 14336), (64, 4096)),
    iters: int = 50,
) -> dict[str, Any]:
    from gpu.triton_quant import quantize_rows

    results: list[dict[str, Any]] = []
    for fp8 in (True, False):
        for m, k in shapes:
            x = (torch.randn((m, k), device=device) * 3).to(torch.bfloat16)
            q, s = quantize_rows(x, fp8)
            rq, rs = torch_quantize_rows(x, fp8)
            same = torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
            results.append({
                "codes": "fp8" if fp8 else "int8", "rows": m, "k": k, "same": same,
                "triton_us": _median_us(lambda: quantize_rows(x, fp8), iters),  # noqa: B023
                "torch_us": _median_us(lambda: torch_quantize_rows(x, fp8), iters),  # noqa: B023
            })  # fmt: skip
    rows = [[r["codes"], r["rows"], r["k"], r["same"], round(r["triton_us"], 1),
             round(r["torch_us"], 1)] for r in results]  # fmt: skip
    headers = ["codes", "rows", "K", "same bytes", "Triton us", "torch us"]
    return {
        "results": results,
        "ok": all(r["same"] for r in results),
        "table": markdown_table(headers, rows),
    }
