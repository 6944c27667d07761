"""The GPU check's ``graphs`` section: decode steps of an 8B-class model, eager and from CUDA
graphs, against the GPU's measured HBM bandwidth.

At batch 1 a decode step of a model whose weights dominate should take about as long as
reading them once: ``weights_read_ms = weight bytes / measured bandwidth``. The section builds
a Llama-3-8B-shaped model with random bf16 weights directly on the GPU (no checkpoint is
written; 16 GB), measures the bandwidth with a device-to-device copy, and times decode steps
(``decode_timing.time_decode_step``: whole ``ModelRunner.forward`` calls, host overhead
included) at each batch size, eager and replayed from the graphs the runner captures
(``gpu/graph_runner.py``), the graphs also with the fused rotary + KV append
(``gpu/attention/rope_append.py``) and with the decode wrapper the heuristic did not pick
(:data:`MODES`, one after the other in one run). Per row: ms/step, tokens/s, the bytes a step
reads (weights + the batch's KV), the fraction of the measured bandwidth that is, and ms/step
over the weights' read time. The issue's target: graphs at batch 1 within 1.3x of the weights'
read time (the best graphs mode is judged). The profiled modes' batch-1 kernels are grouped
by kind (``kernel_profile.py``): where the time over the weights' read goes.

On the CPU (the tests) the same code times a small model eagerly and reports the graph rows
as skipped.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from gpu.config import ModelConfig
from gpu.linear import Linear
from gpu.model import CausalLM, Weight, expected_shapes
from gpu.runner import ModelRunner
from tools.gpu_check.common import Report, markdown_table, parse_ints
from tools.gpu_check.decode_timing import decode_batch, time_decode_step
from tools.gpu_check.gemv_bench import gemv_section
from tools.gpu_check.kernel_profile import breakdown, breakdown_table, profile_steps

PAGE_SIZE = 16
TRITON_ROWS = 8  # gpu.triton_gemv.MAX_ROWS (imported there only on CUDA)
TARGET_RATIO = 1.3  # graphs, batch 1: ms/step at most this times the weights' read time
# Meta-Llama-3-8B's config.json shape (weights random): 8.0e9 parameters, 16 GB in bf16.
LLAMA3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def random_model(
    config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0
) -> CausalLM:
    """A model of ``config``'s shape with random weights made on ``device`` (scaled as the
    check's synthetic model is, so activations stay finite)."""
    cfg = ModelConfig.from_hf_dict(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, Weight] = {}
    for name, shape in expected_shapes(cfg).items():
        t = torch.empty(shape, device=device, dtype=dtype)
        if name.endswith("norm.weight"):
            t.uniform_(0.8, 1.2, generator=gen)
        elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            t.normal_(0.0, 0.1, generator=gen)
        else:
            t.normal_(0.0, (1.0 / shape[-1]) ** 0.5, generator=gen)
        weights[name] = t
    return CausalLM(cfg, weights, device=device, dtype=dtype)


def weight_bytes(model: CausalLM) -> int:
    """Bytes a decode step reads for the weights: every linear (the LM head included) and the
    norms; the embedding reads one row per token (negligible, not counted)."""
    linears: list[Linear] = [model.lm_head]
    linears += [m for m in model.layers.modules() if isinstance(m, Linear)]
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
    return sum(linear.weight_bytes() for linear in linears) + norms


def kv_bytes(runner: ModelRunner, batch: int, context: int) -> int:
    """Bytes of KV a decode step of ``batch`` sequences of ``context`` tokens reads."""
    spec = runner.kv.spec
    elem = torch.empty((), dtype=spec.dtype).element_size()
    return batch * context * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * elem


def measure_bandwidth(device: torch.device, gib: float = 2.0, repeats: int = 5) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of ``repeats``."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            event: Any = torch.cuda.Event  # untyped in torch's stubs
            start, end = event(enable_timing=True), event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        samples.append(2 * n / seconds)
    return float(statistics.median(samples))


@dataclass(frozen=True)
class Mode:
    """One way of running the decode steps: graphs or not, and the runner's options."""

    name: str
    graphs: bool
    fused_rope_append: bool = False
    other_decode_kernel: bool = False  # the decode wrapper decode_uses_tensor_cores did not pick
    blas: str | None = None  # torch.backends.cuda.preferred_blas_library while it runs
    triton_gemv: bool = (
        False  # steps of <= 8 rows: the Triton matrix-vector kernel (gpu/triton_gemv.py)
    )
    # with triton_gemv: the norms, SiLU and residual adds inside those matmuls
    # (DecoderLayer.forward_few_rows)
    few_row_layers: bool = False
    profiled: bool = False  # the batch-1 step's kernels by kind (kernel_profile.py)


MODES = (
    Mode("eager", graphs=False, profiled=True),
    Mode("cuda graphs", graphs=True, profiled=True),
    Mode("cuda graphs, fused rope+append", graphs=True, fused_rope_append=True, profiled=True),
    Mode("cuda graphs, other decode kernel", graphs=True, other_decode_kernel=True),
    Mode("cuda graphs, cublasLt", graphs=True, blas="cublaslt", profiled=True),
    Mode("cuda graphs, triton gemv", graphs=True, triton_gemv=True, profiled=True),
    Mode(
        "cuda graphs, triton gemv + fused rope+append",
        graphs=True,
        triton_gemv=True,
        fused_rope_append=True,
    ),
    Mode(
        "cuda graphs, triton few-row layers",
        graphs=True,
        triton_gemv=True,
        few_row_layers=True,
        profiled=True,
    ),
    Mode(
        "cuda graphs, triton few-row layers + fused rope+append",
        graphs=True,
        triton_gemv=True,
        few_row_layers=True,
        fused_rope_append=True,
        profiled=True,
    ),
)
# A mode's logits may differ from the first mode's (eager) by bf16 rounding over 32 layers;
# a step computed wrongly (a norm, an add, a page missed) differs by about the logits' size.
LOGITS_TOL = 0.1


def mode_runner(model: CausalLM, mode: Mode, pages: int) -> ModelRunner:
    backend = None
    if mode.other_decode_kernel and model.device.type == "cuda":
        from gpu.attention.flashinfer_backend import (
            FlashInferPagedAttention,
            decode_uses_tensor_cores,
        )

        c = model.local_config
        heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        backend = FlashInferPagedAttention(
            *heads, model.device, decode_tensor_cores=not decode_uses_tensor_cores(*heads[:2])
        )
    return ModelRunner(
        model, pages, PAGE_SIZE, backend=backend, cuda_graphs=mode.graphs,
        fused_rope_append=mode.fused_rope_append,
    )  # fmt: skip


def graphs_section(
    model: CausalLM,
    batches: Sequence[int],
    context: int,
    iters: int,
    bandwidth: float,
    modes: Sequence[Mode] = MODES,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Decode timings per mode (eager, graphs and the graphs' variants) and batch, with
    bandwidth fractions, and where a mode is ``profiled`` (on CUDA) its batch-1 kernels.
    ``progress`` gets the rows so far after each mode (a run cut short keeps them)."""
    pages = max(batches) * -(-context // PAGE_SIZE) + 1
    weights = weight_bytes(model)
    weights_ms = weights / bandwidth * 1000
    results: list[dict[str, Any]] = []
    profiles: dict[str, dict[str, Any]] = {}
    references: dict[int, torch.Tensor] = {}  # per batch, the first mode's logits
    for mode in modes:
        cuda = model.device.type == "cuda"
        gemv = triton_gemv(model, mode.triton_gemv, mode.few_row_layers)
        started = time.perf_counter()
        with blas_library(mode.blas if cuda else None), gemv:
            mode_rows = time_mode(
                model, mode, pages, batches, context, iters, profiles, weights, references
            )
        # (capture, Triton's compiles and tuning, timing, profile: the device run's budget)
        mode_s = round(time.perf_counter() - started, 1)
        results += [r | {"mode_s": mode_s} for r in mode_rows]
        if progress is not None:
            progress({"partial": True, "results": list(results), "profiles": dict(profiles)})
    for r in results:
        if "ms_per_step" in r:
            step_bytes = weights + r.pop("kv_bytes")
            r |= {
                "bytes_per_step": step_bytes,
                "bandwidth_fraction": step_bytes / (r["ms_per_step"] / 1000) / bandwidth,
                "vs_weights_read": r["ms_per_step"] / weights_ms,
            }
    rows = [
        [r["mode"], r["batch"], r.get("ms_per_step", float("nan")),
         r.get("tokens_per_s", float("nan")), r.get("bandwidth_fraction", float("nan")),
         r.get("vs_weights_read", float("nan")), r.get("logits_rel_err", float("nan")),
         r.get("error", r.get("skipped", r.get("note", "")))]
        for r in results
    ]  # fmt: skip
    headers = ["mode", "batch", "ms/step", "tokens/s", "HBM fraction", "x weights read"]
    headers += ["logits vs first", "note"]
    timed = [r for r in results if r["batch"] == 1 and "ms_per_step" in r and "error" not in r]
    graph_modes = {m.name for m in modes if m.graphs}
    graphed = [r for r in timed if r["mode"] in graph_modes]
    best = min(graphed, key=lambda r: r["ms_per_step"], default=None)
    table = markdown_table(headers, rows) + (
        f"\n\nweights {weights / 1e9:.2f} GB, measured bandwidth {bandwidth / 1e9:.0f} GB/s, "
        f"weights read {weights_ms:.2f} ms; context {context} tokens per sequence"
    )
    good = {m: p for m, p in profiles.items() if "error" not in p}
    if good:
        table += "\n\nbatch 1, kernels by kind:\n\n" + breakdown_table(good)
    try:  # new kernels: their failure must not take the timings above with it
        matmuls = gemv_section(model)
    except Exception as exc:
        matmuls = {"ok": False, "error": repr(exc)[:500], "table": f"failed: {exc!r}"[:500]}
    table += "\n\nper-shape matmuls (weights rotated over the layers):\n\n" + matmuls["table"]
    return {
        "results": results,
        "profiles": profiles,
        "weight_bytes": weights,
        "bandwidth_bytes_per_s": bandwidth,
        "weights_read_ms": weights_ms,
        "context": context,
        "logits_tol": LOGITS_TOL,
        "target_ratio": TARGET_RATIO,
        "best_graphs_mode": None if best is None else best["mode"],
        "target_met": None if best is None else best["vs_weights_read"] <= TARGET_RATIO,
        "matmuls": matmuls,
        "ok": all("error" not in r for r in results) and matmuls["ok"],
        "table": table,
    }


@contextmanager
def triton_gemv(model: CausalLM, on: bool, fuse_layers: bool = False) -> Iterator[None]:
    """``model.use_triton_gemv`` for steps of up to 8 rows inside (CUDA; ``fuse_layers``: the
    few-row layers too), cuBLAS after."""
    if not on or model.device.type != "cuda":
        yield
        return
    from gpu.triton_gemv import MAX_ROWS

    model.use_triton_gemv(MAX_ROWS, fuse_layers=fuse_layers)
    try:
        yield
    finally:
        model.use_triton_gemv(0)


@contextmanager
def blas_library(name: str | None) -> Iterator[None]:
    """``torch.backends.cuda.preferred_blas_library(name)`` inside, the previous one after."""
    if name is None:
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def time_mode(
    model: CausalLM,
    mode: Mode,
    pages: int,
    batches: Sequence[int],
    context: int,
    iters: int,
    profiles: dict[str, dict[str, Any]],
    weights: int,
    references: dict[int, torch.Tensor] | None = None,
) -> list[dict[str, Any]]:
    """``mode``'s rows (``kv_bytes``: the batch's KV a step reads); its profile into
    ``profiles``. Each batch's step logits are held to ``references`` (the first mode's,
    which it records): ``logits_rel_err``, and an ``error`` past ``LOGITS_TOL``."""
    results: list[dict[str, Any]] = []
    runner = mode_runner(model, mode, pages)
    fill_kv(runner)
    capture_s = None
    if mode.graphs:
        if not runner.cuda_graphs:
            reason = "needs CUDA and the FlashInfer backend"
            return [{"mode": mode.name, "batch": b, "skipped": reason} for b in batches]
        try:
            capture_s = runner.capture_graphs(max(batches))
        except Exception as exc:
            traceback.print_exc()
            return [{"mode": mode.name, "batch": b, "error": repr(exc)} for b in batches]
    for batch in batches:
        try:
            r = time_decode_step(runner, batch, context, iters)
        except Exception as exc:
            traceback.print_exc()
            results.append({"mode": mode.name, "batch": batch, "error": repr(exc)})
            continue
        r |= {
            "mode": mode.name,
            "capture_s": capture_s,
            "rotates_in_append": runner.backend.rotates_qk,
            "kv_bytes": kv_bytes(runner, batch, context),
        }
        if references is not None:
            try:
                r |= held_to(references, batch, step_logits(runner, batch, context))
            except Exception as exc:  # this row's error; the other modes still run
                traceback.print_exc()
                r["error"] = f"the step's logits: {exc!r}"
        if mode.triton_gemv and batch > TRITON_ROWS:
            r["note"] = f"cuBLAS: more than {TRITON_ROWS} rows"
        results.append(r)
        if mode.profiled and batch == 1 and model.device.type == "cuda":
            try:
                profiles[mode.name] = profile_decode(runner, context, r["ms_per_step"], weights)
            except Exception as exc:
                traceback.print_exc()
                profiles[mode.name] = {"error": repr(exc)}
    return results


def fill_kv(runner: ModelRunner, seed: int = 0) -> None:
    """The KV pool filled with the same values in every mode's runner, so their steps over it
    can be compared."""
    gen = torch.Generator(device=runner.device).manual_seed(seed)
    for layer in runner.kv.layers:
        layer.normal_(0.0, 1.0, generator=gen)


def step_logits(runner: ModelRunner, batch: int, context: int) -> torch.Tensor:
    """The logits (float32, on the CPU) of one decode step of ``batch`` sequences of
    ``context`` tokens over the timed pages, with fixed token ids (the step rewrites only its
    own slot, so what ran before does not change them)."""
    ids = (torch.arange(batch) * 7919 + 11) % runner.config.vocab_size
    return runner.forward(ids, decode_batch(batch, context)).float().cpu()


def held_to(
    references: dict[int, torch.Tensor], batch: int, logits: torch.Tensor
) -> dict[str, Any]:
    """The row's ``logits_rel_err`` against the batch's reference (this one becomes it where
    there is none yet), with an ``error`` past ``LOGITS_TOL``."""
    reference = references.setdefault(batch, logits)
    err = float((logits - reference).abs().max() / reference.abs().max().clamp_min(1e-30))
    row: dict[str, Any] = {"logits_rel_err": err}
    if not err <= LOGITS_TOL:  # (NaN too)
        row["error"] = f"logits differ from the first mode's: rel max {err:.3g}"
    return row


def profile_decode(
    runner: ModelRunner, context: int, step_ms: float, weights: int, steps: int = 20
) -> dict[str, Any]:
    """The kernels of ``steps`` batch-1 decode steps of ``runner``, by kind (the matmuls'
    GB/s over the weights' bytes)."""
    meta = decode_batch(1, context)
    ids = torch.tensor([5])
    runner.forward(ids, meta)
    kernels = profile_steps(lambda: runner.forward(ids, meta), steps)
    if not kernels:  # CUPTI saw nothing: a table of zeros would read as all launch gaps
        raise RuntimeError("the profiler recorded no kernel")
    return breakdown(kernels, steps, step_ms, matmul_bytes=weights)


def run_graphs_section(
    args: argparse.Namespace, device: torch.device, sections: set[str], report: Report
) -> None:
    """The section as the check runs it: the measured bandwidth, the Llama-3-8B-shaped model,
    its modes (``report`` gets the rows after each) and, with ``overlap`` among ``sections``,
    its engine steps at batch 64 (``engine_overlap.py``)."""
    bandwidth = measure_bandwidth(device)
    big = random_model(LLAMA3_8B_CONFIG, device, torch.bfloat16, args.seed)
    result = graphs_section(
        big, parse_ints(args.batches), args.context, args.iters, bandwidth,
        progress=lambda partial: report.section("graphs", partial),
    )  # fmt: skip
    result["model"] = "Llama-3-8B shape, random bf16 weights"
    if "overlap" in sections:
        from tools.gpu_check.engine_overlap import overlap_section

        try:
            result["overlap"] = overlap_section(big, 64, 64, 64)
            result["table"] += "\n\nengine steps (batch 64):\n\n"
            result["table"] += result["overlap"]["table"]
        except Exception as exc:
            traceback.print_exc()
            result["overlap"] = {"error": repr(exc)}
    report.section("graphs", result)
