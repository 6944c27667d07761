"""The graphs section's per-shape matmul table: each distinct linear of the model at a few rows,
cuBLAS (``F.linear``) against the Triton matrix-vector kernel (``gpu/triton_gemv.py``), and the
same weights as int8 codes: weight-only (``Int8Linear``'s CUDA path: the matrix-vector kernel
up to 8 rows, ``gpu/triton_w8a16.py`` above) against activations quantized per token and one
``torch._int_mm`` (W8A8, ``gpu.linear.int8_int_mm``), and as Q4_1 blocks of 32 (``int4``) through
the Triton block matmul (``gpu/triton_blocks.py``).

A decode step at batch 1 is the weights' read, so what matters is the bandwidth each matmul
reaches: per (N, K) shape and row count, both timed as a decode step runs them, from a CUDA
graph (one call on each layer's weight of that shape, so none is served from the L2 cache;
median of 10 replays over the calls), the GB/s that is over the weight's bytes (int8: the
codes' and scales'), and each result's error against its reference (relative to the largest
output): the Triton kernel's against cuBLAS's, the int8 ones against the codes' dequantized
weight times the activations. On the CPU it reports
the shapes and skips the rest.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from gpu.linear import DenseLinear, int8_int_mm, int_mm_fits
from gpu.model import CausalLM
from gpu.quant import dequantize_block_rows, quantize_int8, quantize_q4_1
from tools.gpu_check.common import markdown_table

# bf16 outputs: one rounding of the fp32 sum is 2^-8 relative; the two sum in different orders.
REL_ERR_TOL = 2e-2
# W8A8: the activations' int8 rounding too (about 1% of the largest output on random rows).
W8A8_ERR_TOL = 5e-2


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


def _measure(
    row: dict[str, Any],
    name: str,
    fn: Any,
    x: torch.Tensor,
    operands: Sequence[Any],
    nbytes: int,
    exact: torch.Tensor | None,
    replays: int,
) -> None:
    """One path's error against ``exact`` (``<name>_err``; none for cuBLAS, the reference),
    time and GB/s over ``nbytes`` into ``row``; a path that fails records why
    (``<name>_error``) and the others still run."""
    try:
        if exact is not None:
            err = (fn(x, operands[0]).float() - exact).abs().max() / exact.abs().max()
            row[f"{name}_err"] = float(err)
        us = _graph_us(fn, x, operands, replays)
        row[f"{name}_us"] = us
        row[f"{name}_gb_s"] = nbytes / us / 1e3
    except Exception as exc:
        row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]


def time_shape(
    weights: list[torch.Tensor],
    codes: list[tuple[torch.Tensor, torch.Tensor]],
    blocks: list[torch.Tensor],
    m: int,
    replays: int = 10,
) -> dict[str, Any]:
    """cuBLAS, the Triton kernel (up to its row limit), the two int8 paths (``codes``: each
    weight's int8 codes and scales) and the Q4_1 block matmul (``blocks``: each weight's rows
    of blocks) on ``m`` random rows against weights of one shape."""
    from gpu.triton_blocks import block_matmul
    from gpu.triton_gemv import MAX_ROWS, gemv
    from gpu.triton_w8a16 import w8a16_matmul

    x = torch.randn((m, weights[0].shape[1]), device=weights[0].device, dtype=weights[0].dtype)
    row: dict[str, Any] = {}
    nbytes = weights[0].numel() * weights[0].element_size()
    _measure(row, "cublas", F.linear, x, weights, nbytes, None, replays)
    if m <= MAX_ROWS:
        ref = F.linear(x, weights[0]).float()
        _measure(row, "triton", gemv, x, weights, nbytes, ref, replays)
        if "triton_err" in row:
            row["rel_err"] = row.pop("triton_err")
    q0, s0 = codes[0]
    int8_bytes = q0.numel() + s0.numel() * 4
    exact = F.linear(x.float(), q0.float() * s0[:, None])

    def weight_only(xs: torch.Tensor, c: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if m <= MAX_ROWS:
            return gemv(xs, c[0], scale=c[1])
        return w8a16_matmul(xs, c[0], c[1])

    _measure(row, "w8a16", weight_only, x, codes, int8_bytes, exact, replays)
    if int_mm_fits(*q0.shape):
        w8a8 = lambda xs, c: int8_int_mm(xs, c[0], c[1])  # noqa: E731
        _measure(row, "w8a8", w8a8, x, codes, int8_bytes, exact, replays)
    exact = F.linear(x.float(), dequantize_block_rows("Q4_1", blocks[0], weights[0].shape[1]))
    q4_1 = lambda xs, b: block_matmul(xs, b, "Q4_1")  # noqa: E731
    _measure(row, "q4_1", q4_1, x, blocks, blocks[0].numel(), exact, replays)
    return row


def gemv_section(model: CausalLM, rows: tuple[int, ...] = (1, 8, 64)) -> dict[str, Any]:
    shapes = weights_by_shape(model)
    results: list[dict[str, Any]] = []
    cuda = model.device.type == "cuda"
    for (n, k), weights in shapes.items():
        codes = [quantize_int8(w) for w in weights] if cuda else []
        blocks = [quantize_q4_1(w) for w in weights] if cuda else []
        for m in rows:
            row: dict[str, Any] = {"n": n, "k": k, "rows": m, "layers": len(weights)}
            if not cuda:
                results.append(row | {"skipped": "needs CUDA"})
                continue
            row |= time_shape(weights, codes, blocks, m)
            results.append(row)
        del codes, blocks
    columns: tuple[str, ...] = ("cublas_us", "cublas_gb_s", "triton_us", "triton_gb_s", "rel_err")
    columns += ("w8a16_us", "w8a16_gb_s", "w8a16_err", "w8a8_us", "w8a8_gb_s", "w8a8_err")
    columns += ("q4_1_us", "q4_1_gb_s", "q4_1_err")
    table_rows = [
        [
            r["n"],
            r["k"],
            r["rows"],
            *(r.get(c, r.get("skipped", "-")) for c in columns),
            ", ".join(k.removesuffix("_error") for k in r if k.endswith("_error")) or "-",
        ]
        for r in results
    ]
    headers = ["N", "K", "rows", "cuBLAS us", "cuBLAS GB/s", "Triton us", "Triton GB/s", "err"]
    headers += ["int8 W8A16 us", "GB/s", "err", "int8 W8A8 us", "GB/s", "err"]
    headers += ["Q4_1 us", "GB/s", "err", "failed (see JSON)"]
    ok = all(
        r.get("rel_err", 0.0) <= REL_ERR_TOL
        and r.get("w8a16_err", 0.0) <= REL_ERR_TOL
        and r.get("w8a8_err", 0.0) <= W8A8_ERR_TOL
        and r.get("q4_1_err", 0.0) <= REL_ERR_TOL
        and not any(k.endswith("_error") for k in r)
        for r in results
    )
    return {"results": results, "ok": ok, "table": markdown_table(headers, table_rows)}
