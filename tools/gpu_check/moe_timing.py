"""The GPU check's ``qwen3_moe`` timing: one decode step of the mixture-of-experts model at each
batch size with its experts as ``gpu.triton_moe``'s two grouped matmuls against one expert at a
time in torch ops (``SparseMoe.per_op``: a host read of the experts' token counts per layer),
the same runner and KV, taking turns per batch size (``decode_timing.time_decode_step``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from gpu.model import CausalLM, DecoderLayer
from gpu.moe import SparseMoe
from gpu.runner import ModelRunner
from tools.gpu_check.common import PAGE_SIZE, Report, markdown_table, parse_ints
from tools.gpu_check.decode_timing import time_decode_step

MODES = ("grouped (triton)", "per expert (torch)")


def moe_timing(model: CausalLM, batches: Sequence[int], context: int, iters: int) -> dict[str, Any]:
    """ms per decode step and tokens/s per batch size and mode; the experts are left grouped
    where they were."""
    layers = cast(list[DecoderLayer], list(model.layers))
    sparse: list[SparseMoe] = [layer.moe for layer in layers if layer.moe is not None]
    stacks = [(m.stacked_gate_up, m.stacked_down) for m in sparse]
    if not sparse or any(gate_up is None for gate_up, _ in stacks):
        return {"ok": False, "error": "the experts are not stacked (not dense fp16/bf16?)"}
    pages = max(batches) * -(-context // PAGE_SIZE) + 1
    runner = ModelRunner(model, pages, PAGE_SIZE)
    results: list[dict[str, Any]] = []
    try:
        for batch in batches:
            for mode in MODES:
                for moe, (gate_up, down) in zip(sparse, stacks, strict=True):
                    grouped = mode == MODES[0]
                    moe.stacked_gate_up = gate_up if grouped else None
                    moe.stacked_down = down if grouped else None
                    results.append(time_decode_step(runner, batch, context, iters) | {"mode": mode})
    finally:
        for moe, (gate_up, down) in zip(sparse, stacks, strict=True):
            moe.stacked_gate_up, moe.stacked_down = gate_up, down
    rows = [[r["mode"], r["batch"], context, r["ms_per_step"], r["tokens_per_s"]] for r in results]
    table = markdown_table(["experts", "batch", "context", "ms/step", "tokens/s"], rows)
    return {"ok": True, "results": results, "table": table}


def run_moe_timing(args: Any, model: CausalLM, report: Report) -> None:
    """The timing as the check runs it (its --batches, --context, --iters)."""
    torch.manual_seed(0)
    result = moe_timing(model, parse_ints(args.batches), args.context, args.iters)
    report.section("qwen3_moe_timing", result)
