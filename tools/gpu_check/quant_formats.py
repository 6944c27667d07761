"""The GPU check's ``formats`` section: the quantized weight formats on CUDA, run last (their
Triton kernels compile and tune for minutes the first time, which must not cost the graphs
section its time).

- model: the section model (SmolLM2, or its stand-in) in int8 weight-only (the default on
  CUDA: Triton), int8 W8A8 (activations per token, ``torch._int_mm``) and int4 (Q4_1 blocks,
  the Triton block matmul), each with CUDA graphs, against the CPU fp32 reference, with the
  bf16 FlashInfer runner as the baseline row (``model_agreement.model_section``; the
  quantized rows are reported, not judged: their error is the format's).
- matmuls: each linear shape of Llama-3-8B at 1, 8 and 64 rows, on random bf16 weights in
  ``COPIES`` copies (so none is served from L2): cuBLAS bf16 against int8 weight-only
  (the matrix-vector kernel up to 8 rows, ``gpu/triton_w8a16.py`` above), int8 W8A8 and
  Q4_1 blocks (``gpu/triton_blocks.py``), each timed from a CUDA graph, in GB/s over its
  own bytes, and each result's error against its own dequantized weight.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gpu.linear import Int8Linear, int8_int_mm, int_mm_fits, warm_triton_linears
from gpu.quant import dequantize_block_rows, quantize_int8, quantize_q4_1
from tools.gpu_check.common import PAGE_SIZE, Report, markdown_table
from tools.gpu_check.gemv_bench import REL_ERR_TOL, measure_path

W8A8_ERR_TOL = 5e-2  # the activations' int8 rounding too (about 1% of the output on random rows)
COPIES = 8
# (name, N, K) of Llama-3-8B's linears: fused qkv, o, fused gate_up, down, the LM head.
LLAMA3_8B_SHAPES = (
    ("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
    ("lm_head", 128256, 4096),
)  # fmt: skip
# (row name, --quantization, W8A8)
MODEL_FORMATS = (
    ("cuda int8 W8A16, cuda graphs", "int8", False),
    ("cuda int8 W8A8 (_int_mm), cuda graphs", "int8", True),
    ("cuda int4 (Q4_1 blocks), cuda graphs", "int4", False),
)


def linear_paths(model: torch.nn.Module) -> dict[str, int]:
    """How many of the model's linears run each path: ``int8 w8a16`` / ``int8 w8a8`` (CUDA's
    int8 kernels), ``int8`` (the CPU's or the dequantizing reference), ``<type> triton`` /
    ``<type>`` (GGUF blocks on the Triton block matmul or not), else the class's format. A
    format that quietly fell back to another path shows here."""
    from gpu.linear import BlockLinear, Linear

    paths: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, Int8Linear):
            path = f"int8 {module.cuda_kernel}" if module.cuda_kernel else "int8"
        elif isinstance(module, BlockLinear):
            path = f"{module.qtype} triton" if module.triton else module.qtype
        elif isinstance(module, Linear):
            path = module.format
        else:
            continue
        paths[path] = paths.get(path, 0) + 1
    return paths


# On CUDA, the path every linear of each format must take (``linear_paths``): the LM head of
# int4 is Q8_0, its layers Q4_1.
CUDA_PATHS = {
    "int8": {"int8 w8a16"},
    "int8 w8a8": {"int8 w8a8"},
    "int4": {"Q4_1 triton", "Q8_0 triton"},
}


def format_runners(
    folder: Path, device: torch.device, pages: int, batch: int, max_rows: int
) -> tuple[dict[str, Any], dict[str, str], dict[str, dict[str, int]]]:
    """A CUDA-graph runner per ``MODEL_FORMATS`` row, its Triton kernels built first, and the
    paths its linears take; a format that fails to load, build or capture, or (on CUDA) runs
    a linear on another path than its own, is an error of its own."""
    from gpu.loader import load_model
    from gpu.runner import ModelRunner

    runners: dict[str, Any] = {}
    errors: dict[str, str] = {}
    paths: dict[str, dict[str, int]] = {}
    for name, quantization, int_mm in MODEL_FORMATS:
        try:
            model = load_model(folder, device=device, progress=False, quantization=quantization)
            if int_mm:
                for module in model.modules():
                    if isinstance(module, Int8Linear):
                        module.use_int_mm()
            paths[name] = linear_paths(model)
            wanted = CUDA_PATHS[f"{quantization} w8a8" if int_mm else quantization]
            if device.type == "cuda" and not set(paths[name]) <= wanted:
                raise RuntimeError(f"linears off the format's CUDA path: {paths[name]}")
            warm_triton_linears(model.modules(), max_rows, model.dtype)
            runner = ModelRunner(model, pages, PAGE_SIZE, cuda_graphs=True)
            runner.capture_graphs(batch)
            runners[name] = runner
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"[:500]
    return runners, errors, paths


def formats_model(args: argparse.Namespace, folder: Path, device: torch.device) -> dict[str, Any]:
    from gpu.loader import load_model
    from gpu.runner import ModelRunner
    from tools.gpu_check.model_agreement import model_prompts, model_section, pages_needed

    cpu_model = load_model(folder, device="cpu", dtype=torch.float32, progress=False)
    prompts, _ = model_prompts(folder, cpu_model.config.vocab_size, args.seed)
    pages = pages_needed(prompts, args.new_tokens)
    chunk = 64
    baseline = ModelRunner(load_model(folder, device=device, progress=False), pages, PAGE_SIZE)
    runners, errors, paths = format_runners(
        folder, device, pages, len(prompts), chunk + len(prompts)
    )
    result = model_section(
        ModelRunner(cpu_model, pages, PAGE_SIZE),
        {"cuda bf16 flashinfer": baseline, **runners},
        "cuda bf16 flashinfer",
        prompts,
        args.new_tokens,
        args.logits_tol,
        chunk,
        reported=list(runners),
    )
    result["build_errors"] = errors
    result["linear_paths"] = paths
    # The section is about the formats: every one built and ran (the bf16 row is the baseline
    # shown beside them, judged in the model section).
    result["ok"] = not errors and all(result[n].get("ok") == "reported" for n in runners)
    return result


def formats_matmuls(
    device: torch.device, seed: int, rows: tuple[int, ...] = (1, 8, 64)
) -> dict[str, Any]:
    """The per-shape table (see the module docstring)."""
    if device.type != "cuda":  # (it times CUDA graphs; on the CPU it would only quantize 8B)
        raise ValueError("the per-shape matmul table needs CUDA")
    from gpu.triton_blocks import block_matmul
    from gpu.triton_gemv import MAX_ROWS, gemv
    from gpu.triton_w8a16 import w8a16_matmul

    gen = torch.Generator(device=device).manual_seed(seed)
    results: list[dict[str, Any]] = []
    for name, n, k in LLAMA3_8B_SHAPES:
        copies = COPIES if name != "lm_head" else 2
        try:  # one shape's failure (memory, say) is its row's, not every row's
            weights = [
                (torch.randn((n, k), generator=gen, device=device) * k**-0.5).to(torch.bfloat16)
                for _ in range(copies)
            ]
            codes = [quantize_int8(w) for w in weights]
            blocks = [quantize_q4_1(w) for w in weights]
        except Exception as exc:
            results.append({"shape": name, "n": n, "k": k, "rows": "-", "setup_error": repr(exc)})
            torch.cuda.empty_cache()
            continue
        for m in rows:
            row: dict[str, Any] = {"shape": name, "n": n, "k": k, "rows": m}
            x = torch.randn((m, k), generator=gen, device=device).to(torch.bfloat16)
            nbytes = weights[0].numel() * 2
            measure_path(row, "cublas", F.linear, x, weights, nbytes, None)
            q0, s0 = codes[0]
            exact = F.linear(x.float(), q0.float() * s0[:, None])

            def weight_only(xs: torch.Tensor, c: tuple[torch.Tensor, torch.Tensor]) -> Any:
                if xs.shape[0] <= MAX_ROWS:
                    return gemv(xs, c[0], scale=c[1])
                return w8a16_matmul(xs, c[0], c[1])

            int8_bytes = q0.numel() + s0.numel() * 4
            measure_path(row, "w8a16", weight_only, x, codes, int8_bytes, exact)
            if int_mm_fits(*q0.shape):
                w8a8 = lambda xs, c: int8_int_mm(xs, c[0], c[1])  # noqa: E731
                measure_path(row, "w8a8", w8a8, x, codes, int8_bytes, exact)
            exact = F.linear(x.float(), dequantize_block_rows("Q4_1", blocks[0], k))
            q4_1 = lambda xs, b: block_matmul(xs, b, "Q4_1")  # noqa: E731
            measure_path(row, "q4_1", q4_1, x, blocks, blocks[0].numel(), exact)
            results.append(row)
        del weights, codes, blocks
        torch.cuda.empty_cache()
    columns: tuple[str, ...] = ("cublas_us", "cublas_gb_s", "w8a16_us", "w8a16_gb_s", "w8a16_err")
    columns += ("w8a8_us", "w8a8_gb_s", "w8a8_err", "q4_1_us", "q4_1_gb_s", "q4_1_err")
    table_rows = [
        [r["shape"], r["n"], r["k"], r["rows"], *(r.get(c, "-") for c in columns),
         ", ".join(c.removesuffix("_error") for c in r if c.endswith("_error")) or "-"]
        for r in results
    ]  # fmt: skip
    headers = ["shape", "N", "K", "rows", "bf16 cuBLAS us", "GB/s", "int8 W8A16 us", "GB/s"]
    headers += ["err", "int8 W8A8 us", "GB/s", "err", "Q4_1 us", "GB/s", "err", "failed"]
    ok = all(
        r.get("w8a16_err", 1.0) <= REL_ERR_TOL
        and r.get("w8a8_err", 0.0) <= W8A8_ERR_TOL
        and r.get("q4_1_err", 1.0) <= REL_ERR_TOL
        and not any(c.endswith("_error") for c in r)
        for r in results
    )
    return {"results": results, "ok": ok, "table": markdown_table(headers, table_rows)}


def run_formats_section(
    args: argparse.Namespace, folder: Path | None, device: torch.device, report: Report
) -> None:
    """Both parts; each part's failure is its own (the other still runs)."""
    result: dict[str, Any] = {}
    tables = []
    if folder is not None:
        try:
            result["model"] = formats_model(args, folder, device)
            tables.append("whole model:\n\n" + result["model"]["table"])
        except Exception as exc:
            result["model"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        report.section("formats", result | {"partial": True})
    try:
        result["matmuls"] = formats_matmuls(device, args.seed)
        tables.append("per-shape matmuls, Llama-3-8B shapes:\n\n" + result["matmuls"]["table"])
    except Exception as exc:
        result["matmuls"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    parts = [p for p in ("model", "matmuls") if p in result]
    result["ok"] = all(result[p].get("ok") for p in parts)
    errors = [f"{p}: {result[p]['error']}" for p in parts if "error" in result[p]]
    result["table"] = "\n\n".join(tables + errors)
    report.section("formats", result)
