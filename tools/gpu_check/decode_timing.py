"""The GPU check's ``timing`` section: one decode step (``ModelRunner.forward``: plan, all
layers, lm_head, host overhead included) at each batch size, per attention backend, timed with
CUDA events. ``time_decode_step`` also times the ``graphs`` section's modes."""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from gpu.attention.backend import AttentionBackend
from gpu.attention.metadata import BatchMetadata, SeqChunk, build_batch_metadata
from gpu.attention.torch_backend import TorchPagedAttention
from gpu.model import CausalLM
from gpu.runner import ModelRunner
from tools.gpu_check.common import PAGE_SIZE, Report, markdown_table, parse_ints, synchronize


def decode_batch(batch: int, context: int) -> BatchMetadata:
    """One decode step of ``batch`` sequences of ``context`` tokens, sequence ``b`` on pages
    ``b * pages ..`` (the pages every timed step of the check reads)."""
    pages = -(-context // PAGE_SIZE)
    chunks = [
        SeqChunk(tuple(range(b * pages, (b + 1) * pages)), context - 1, 1) for b in range(batch)
    ]
    return build_batch_metadata(chunks, PAGE_SIZE)


def time_decode_step(
    runner: ModelRunner,
    batch: int,
    context: int,
    iters: int = 30,
    warmup: int = 5,
    repeats: int = 3,
) -> dict[str, Any]:
    """ms per decode step (median of ``repeats`` runs of ``iters`` steps) with ``batch``
    sequences of ``context`` tokens; the KV contents do not matter for timing."""
    pages = -(-context // PAGE_SIZE)
    if batch * pages > runner.kv.spec.num_pages:
        raise ValueError("the runner's KV cache is too small for this batch")
    meta = decode_batch(batch, context)
    ids = torch.randint(3, runner.config.vocab_size, (batch,))
    for _ in range(warmup):
        runner.forward(ids, meta)
    synchronize(runner.device)
    samples = []
    for _ in range(repeats):
        if runner.device.type == "cuda":
            event: Any = torch.cuda.Event  # untyped in torch's stubs
            start, end = event(enable_timing=True), event(enable_timing=True)
            start.record()
            for _ in range(iters):
                runner.forward(ids, meta)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                runner.forward(ids, meta)
            samples.append((time.perf_counter() - t0) * 1000 / iters)
    ms = statistics.median(samples)
    return {
        "batch": batch,
        "context": context,
        "ms_per_step": ms,
        "ms_samples": samples,
        "tokens_per_s": batch * 1000.0 / ms,
    }


def timing_section(
    runner: ModelRunner,
    backends: dict[str, AttentionBackend],
    batches: Sequence[int],
    context: int,
    iters: int,
) -> dict[str, Any]:
    rows, results = [], []
    for name, backend in backends.items():
        runner.backend = backend
        for batch in batches:
            try:
                r = time_decode_step(runner, batch, context, iters) | {"backend": name}
            except Exception as exc:
                traceback.print_exc()
                r = {"backend": name, "batch": batch, "error": repr(exc)}
            results.append(r)
            rows.append(
                [
                    name,
                    batch,
                    context,
                    r.get("ms_per_step", float("nan")),
                    r.get("tokens_per_s", float("nan")),
                    r.get("error", ""),
                ]
            )
    table = markdown_table(["attention", "batch", "context", "ms/step", "tokens/s", "error"], rows)
    return {"results": results, "ok": all("error" not in r for r in results), "table": table}


def run_timing_section(
    args: argparse.Namespace, gpu_model: CausalLM, device: torch.device, report: Report
) -> None:
    """The section as the check runs it: ``gpu_model`` with FlashInfer's default decode
    kernel, its other one and torch SDPA; the result goes to ``report``."""
    from gpu.attention.flashinfer_backend import (
        FlashInferPagedAttention,
        decode_uses_tensor_cores,
    )

    cfg = gpu_model.config
    batches = parse_ints(args.batches)
    pages = max(batches) * -(-args.context // PAGE_SIZE) + 1
    runner = ModelRunner(gpu_model, pages, PAGE_SIZE)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    auto_tc = decode_uses_tensor_cores(hq, hkv)
    tc_name = {True: "tensor-core", False: "cuda-core"}
    backends: dict[str, AttentionBackend] = {
        f"flashinfer, {tc_name[auto_tc]} decode (default)": runner.backend,
        f"flashinfer, {tc_name[not auto_tc]} decode": FlashInferPagedAttention(
            hq, hkv, d, device, decode_tensor_cores=not auto_tc
        ),
        "torch sdpa (bf16)": TorchPagedAttention(hq, hkv, d),
    }
    result = timing_section(runner, backends, batches, args.context, args.iters)
    result["model"] = report.data.get("model")
    report.section("timing", result)
