"""The GPU check's ``graphs`` section: decode steps of an 8B-class model, eager and from CUDA
graphs, against the GPU's measured HBM bandwidth.

At batch 1 a decode step of a model whose weights dominate should take about as long as
reading them once: ``weights_read_ms = weight bytes / measured bandwidth``. The section builds
a Llama-3-8B-shaped model with random bf16 weights directly on the GPU (no checkpoint is
written; 16 GB), measures the bandwidth with a device-to-device copy, and times decode steps
(``check_flashinfer.time_decode_step``: whole ``ModelRunner.forward`` calls, host overhead
included) at each batch size, once eager and once replayed from the graphs the runner captures
(``gpu/graph_runner.py``). Per row: ms/step, tokens/s, the bytes a step reads (weights + the
batch's KV), the fraction of the measured bandwidth that is, and ms/step over the weights' read
time. The issue's target: graphs at batch 1 within 1.3x of the weights' read time.

On the CPU (the tests) the same code times a small model eagerly and reports the graph rows
as skipped.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from gpu.config import ModelConfig
from gpu.linear import Linear
from gpu.model import CausalLM, Weight, expected_shapes
from gpu.runner import ModelRunner

PAGE_SIZE = 16
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


def graphs_section(
    model: CausalLM,
    batches: Sequence[int],
    context: int,
    iters: int,
    bandwidth: float,
) -> dict[str, Any]:
    """Decode timings eager and from CUDA graphs per batch, with bandwidth fractions."""
    from tools.gpu_check.check_flashinfer import markdown_table, time_decode_step

    pages = max(batches) * -(-context // PAGE_SIZE) + 1
    weights = weight_bytes(model)
    weights_ms = weights / bandwidth * 1000
    results: list[dict[str, Any]] = []
    modes: list[tuple[str, bool]] = [("eager", False), ("cuda graphs", True)]
    for mode, graphs in modes:
        runner = ModelRunner(model, pages, PAGE_SIZE, cuda_graphs=graphs)
        capture_s = None
        if graphs:
            if not runner.cuda_graphs:
                for batch in batches:
                    reason = "needs CUDA and the FlashInfer backend"
                    results.append({"mode": mode, "batch": batch, "skipped": reason})
                continue
            try:
                capture_s = runner.capture_graphs(max(batches))
            except Exception as exc:
                traceback.print_exc()
                results += [{"mode": mode, "batch": b, "error": repr(exc)} for b in batches]
                continue
        for batch in batches:
            try:
                r = time_decode_step(runner, batch, context, iters)
            except Exception as exc:
                traceback.print_exc()
                results.append({"mode": mode, "batch": batch, "error": repr(exc)})
                continue
            step_bytes = weights + kv_bytes(runner, batch, context)
            seconds = r["ms_per_step"] / 1000
            r |= {
                "mode": mode,
                "capture_s": capture_s,
                "bytes_per_step": step_bytes,
                "bandwidth_fraction": step_bytes / seconds / bandwidth,
                "vs_weights_read": r["ms_per_step"] / weights_ms,
            }
            results.append(r)
        del runner
    rows = [
        [r["mode"], r["batch"], r.get("ms_per_step", float("nan")),
         r.get("tokens_per_s", float("nan")), r.get("bandwidth_fraction", float("nan")),
         r.get("vs_weights_read", float("nan")), r.get("error", r.get("skipped", ""))]
        for r in results
    ]  # fmt: skip
    headers = ["mode", "batch", "ms/step", "tokens/s", "HBM fraction", "x weights read", "note"]
    target = next(
        (r for r in results if r["mode"] == "cuda graphs" and r["batch"] == 1 and "error" not in r),
        None,
    )
    return {
        "results": results,
        "weight_bytes": weights,
        "bandwidth_bytes_per_s": bandwidth,
        "weights_read_ms": weights_ms,
        "context": context,
        "target_ratio": TARGET_RATIO,
        "target_met": None
        if target is None or "skipped" in target
        else target["vs_weights_read"] <= TARGET_RATIO,
        "ok": all("error" not in r for r in results),
        "table": markdown_table(headers, rows)
        + f"\n\nweights {weights / 1e9:.2f} GB, measured bandwidth {bandwidth / 1e9:.0f} GB/s, "
        f"weights read {weights_ms:.2f} ms; context {context} tokens per sequence",
    }
