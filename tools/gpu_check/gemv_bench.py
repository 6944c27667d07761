"""The graphs section's per-shape matmul table: each distinct linear of the model at a few rows,
cuBLAS (``F.linear``) against the Triton matrix-vector kernel (``gpu/triton_gemv.py``). The
quantized formats' table (``quant_formats.py``) times its paths with ``measure_path`` too.

A decode step at batch 1 is the weights' read, so what matters is the bandwidth each matmul
reaches: per (N, K) shape and row count, both timed as a decode step runs them, from a CUDA
graph (one call on each layer's weight of that shape, so none is served from the L2 cache;
median of 10 replays over the calls), the GB/s that is over the weight's bytes, and the
Triton result's error against cuBLAS's (relative to the largest output). On the CPU it reports
the shapes and skips the rest.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from gpu.linear import DenseLinear
from gpu.model import CausalLM
from tools.gpu_check.common import markdown_table

# bf16 outputs: one rounding of the fp32 sum is 2^-8 relative; the two sum in different orders.
REL_ERR_TOL = 2e-2


def weights_by_shape(model: CausalLM) -> dict[tuple[int, int], list[torch.Tensor]]:
    """The dense ``[N, K]`` weights of the model's linears, grouped by shape."""
    shapes: dict[tuple[int, int], list[torch.Tensor]] = {}
    for module in model.modules():
        if isinstance(module, DenseLinear) and module.layout == "nk":
            n, k = module.weight.shape
            shapes.setdefault((int(n), int(k)), []).append(module.weight)
    return shapes


def _graph_us(fn: Any, x: torch.Tensor, weights: Sequence[Any], replays: int) -> float:
    """Microseconds a call: the calls over every weight of the shape captured in one CUDA
    graph (as a decode step replays them: no host launch cost in the number), replayed."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:
            fn(x, w)  # warm: autotuning, cuBLAS's handles and workspace, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    event: Any = torch.cuda.Event  # untyped in torch's stubs
    samples = []
    for _ in range(replays):
        start, end = event(enable_timing=True), event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / len(weights))
    return float(statistics.median(samples))


def measure_path(
    row: dict[str, Any],
    name: str,
    fn: Any,
    x: torch.Tensor,
    operands: Sequence[Any],
    nbytes: int,
    exact: torch.Tensor | None,
    replays: int = 10,
) -> None:
    """One path's error against ``exact`` (``<name>_err``; none for a reference), time and
    GB/s over ``nbytes`` into ``row``; a path that fails records why (``<name>_error``) and
    the others still run."""
    try:
        if exact is not None:
            err = (fn(x, operands[0]).float() - exact).abs().max() / exact.abs().max()
            row[f"{name}_err"] = float(err)
        us = _graph_us(fn, x, operands, replays)
        row[f"{name}_us"] = us
        row[f"{name}_gb_s"] = nbytes / us / 1e3
    except Exception as exc:
        row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]


def time_shape(weights: list[torch.Tensor], m: int, replays: int = 10) -> dict[str, Any]:
    """cuBLAS and the Triton kernel on ``m`` random rows against weights of one shape."""
    from gpu.triton_gemv import gemv

    x = torch.randn((m, weights[0].shape[1]), device=weights[0].device, dtype=weights[0].dtype)
    row: dict[str, Any] = {}
    nbytes = weights[0].numel() * weights[0].element_size()
    measure_path(row, "cublas", F.linear, x, weights, nbytes, None, replays)
    ref = F.linear(x, weights[0]).float()
    measure_path(row, "triton", gemv, x, weights, nbytes, ref, replays)
    if "triton_err" in row:
        row["rel_err"] = row.pop("triton_err")
    return row


def gemv_section(model: CausalLM, rows: tuple[int, ...] = (1, 8)) -> dict[str, Any]:
    shapes = weights_by_shape(model)
    results: list[dict[str, Any]] = []
    cuda = model.device.type == "cuda"
    for (n, k), weights in shapes.items():
        for m in rows:
            row: dict[str, Any] = {"n": n, "k": k, "rows": m, "layers": len(weights)}
            if not cuda:
                results.append(row | {"skipped": "needs CUDA"})
                continue
            row |= time_shape(weights, m)
            results.append(row)
    table_rows = [
        [r["n"], r["k"], r["rows"], r.get("cublas_us", "-"), r.get("cublas_gb_s", "-"),
         r.get("triton_us", "-"), r.get("triton_gb_s", "-"), r.get("rel_err", r.get("skipped")),
         ", ".join(c.removesuffix("_error") for c in r if c.endswith("_error")) or "-"]
        for r in results
    ]  # fmt: skip
    headers = ["N", "K", "rows", "cuBLAS us", "cuBLAS GB/s", "Triton us", "Triton GB/s", "err"]
    headers.append("failed (see JSON)")
    ok = all(
        r.get("rel_err", 0.0) <= REL_ERR_TOL and not any(c.endswith("_error") for c in r)
        for r in results
    )
    return {"results": results, "ok": ok, "table": markdown_table(headers, table_rows)}
