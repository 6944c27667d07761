"""The GPU check's ``model`` section: the whole model on CUDA in bf16 (FlashInfer, its fast
paths, and the torch backend as the bf16 baseline) against the same model on the CPU in fp32,
served as staggered, chunked batches; every position's logits (teacher-forced) and greedy
agreement."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpu.attention.metadata import SeqChunk
from gpu.attention.torch_backend import TorchPagedAttention
from gpu.model import CausalLM
from gpu.runner import ModelRunner
from tools.gpu_check.common import PAGE_SIZE, Report, markdown_table, rel_max_error

LOGITS_TOL = 5e-2  # the same measure on logits, bf16 model against fp32 model
PROMPT_TEXTS = (
    "Hello",
    "The capital of France is",
    "Write a short poem about the sea.\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Paged attention keeps the key and value cache of every sequence in fixed-size pages, so "
    "memory is handed out page by page and sequences of very different lengths share one pool "
    "without fragmentation. " * 6 + "Summarise the idea above in one sentence:",
)
SYNTHETIC_PROMPT_LENGTHS = (1, 6, 9, 17, 260)


@dataclass
class Trace:
    """What one schedule run produced, per prompt."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]  # [new_tokens, vocab] float32 on the CPU
    steps: dict[str, int] = field(default_factory=dict)


def pages_needed(prompts: Sequence[Sequence[int]], new_tokens: int) -> int:
    return sum(-(-(len(p) + new_tokens) // PAGE_SIZE) for p in prompts) + 1


def run_schedule(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    chunk: int = 64,
    stagger: int = 2,
    forced: Sequence[Sequence[int]] | None = None,
    seed: int = 0,
) -> Trace:
    """Serve ``prompts`` together: prompt i joins at step ``i * stagger``, its prompt goes in
    ``chunk``-token pieces, then one token per step. The next token is the argmax, or
    ``forced[i][k]`` (teacher forcing). Steps mix prompt chunks and decodes."""
    n = len(prompts)
    pool = list(range(runner.kv.spec.num_pages))
    random.Random(seed).shuffle(pool)
    tables, start = [], 0
    for p in prompts:
        count = -(-(len(p) + new_tokens) // PAGE_SIZE)
        if start + count > len(pool):
            raise ValueError("the runner's KV cache has too few pages for these prompts")
        tables.append(tuple(pool[start : start + count]))
        start += count
    tokens = [list(p) for p in prompts]
    computed = [0] * n
    generated: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    steps = {"total": 0, "mixed": 0, "decode_only": 0, "prefill_only": 0}
    step = 0
    while any(len(g) < new_tokens for g in generated):
        chunks: list[SeqChunk] = []
        feeds: list[Sequence[int]] = []
        active: list[int] = []
        for i in range(n):
            if step < i * stagger or len(generated[i]) >= new_tokens:
                continue
            prompt_left = len(prompts[i]) - computed[i]
            count = min(chunk, prompt_left) if prompt_left > 0 else 1
            chunks.append(SeqChunk(tables[i], computed[i], count))
            feeds.append(tokens[i][computed[i] : computed[i] + count])
            active.append(i)
        step += 1
        if not chunks:
            continue
        out = runner.execute(chunks, feeds).float().cpu()
        kinds = {c.num_new == 1 for c in chunks}
        steps["total"] += 1
        key = "mixed" if len(kinds) == 2 else ("decode_only" if True in kinds else "prefill_only")
        steps[key] += 1
        for row, i in enumerate(active):
            computed[i] += chunks[row].num_new
            if computed[i] < len(tokens[i]):
                continue  # mid-prompt chunk: its logits are not used
            pos = len(generated[i])
            nxt = int(forced[i][pos]) if forced is not None else int(out[row].argmax())
            generated[i].append(nxt)
            tokens[i].append(nxt)
            logits[i].append(out[row])
    return Trace(generated, [torch.stack(x) for x in logits], steps)


def compare_traces(ref: Trace, forced: Trace, free: Trace) -> dict[str, Any]:
    """Logits error per position and top-1 agreement of a teacher-forced run; a disagreement
    counts as explained when the reference's own margin between the two tokens is within
    twice the logits error there (a near tie that bf16 may flip)."""
    rel_errors: list[float] = []
    positions = agree = unexplained = 0
    free_equal = 0
    first_divergence: list[int | None] = []
    for ref_tok, ref_lg, lg, free_tok in zip(
        ref.tokens, ref.logits, forced.logits, free.tokens, strict=True
    ):
        for pos in range(len(ref_tok)):
            r, g = ref_lg[pos], lg[pos]
            rel_errors.append(rel_max_error(g, r))
            positions += 1
            pick = int(g.argmax())
            if pick == ref_tok[pos]:
                agree += 1
                continue
            margin = float(r[ref_tok[pos]] - r[pick])
            err = float((g - r).abs().max()) if bool(torch.isfinite(g).all()) else float("inf")
            if margin > 2 * err:
                unexplained += 1
        same = [a == b for a, b in zip(ref_tok, free_tok, strict=True)]
        free_equal += all(same)
        first_divergence.append(None if all(same) else same.index(False))
    return {
        "positions": positions,
        "rel_max": max(rel_errors),
        "rel_median": statistics.median(rel_errors),
        "top1_agreement": agree / positions,
        "unexplained_disagreements": unexplained,
        "free_greedy_identical": free_equal,
        "free_greedy_first_divergence": first_divergence,
        "prompts": len(ref.tokens),
    }


# (name, CUDA graphs, fused rotary + KV append): the model section's fast-path runners.
FAST_PATH_RUNNERS = (
    ("cuda bf16 flashinfer, fused rope+append", False, True),
    ("cuda bf16 flashinfer, cuda graphs", True, False),
    ("cuda bf16 flashinfer, cuda graphs + fused", True, True),
)


def model_section(
    ref_runner: ModelRunner,
    runners: dict[str, ModelRunner],
    primary: str,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    tol: float,
    chunk: int = 64,
    also_checked: Sequence[str] = (),
    reported: Sequence[str] = (),
) -> dict[str, Any]:
    """``runners[primary]`` (FlashInfer) passes when its logits error is within ``tol`` or
    within 1.5x that of the other runners (the bf16 baseline), and every top-1 disagreement
    with the reference is a near tie; the section passes when it and every runner named in
    ``also_checked`` (FlashInfer's fast paths) pass that bound. Runners named in ``reported``
    (quantized weights: their error is the format's) are measured and shown, but neither set
    the bound nor decide the section."""
    started = time.perf_counter()
    ref = run_schedule(ref_runner, prompts, new_tokens, chunk)
    results: dict[str, Any] = {"reference_seconds": time.perf_counter() - started}
    rows = []
    for name, runner in runners.items():
        try:
            forced = run_schedule(runner, prompts, new_tokens, chunk, forced=ref.tokens)
            free = run_schedule(runner, prompts, new_tokens, chunk)
        except Exception as exc:
            if name not in reported:
                raise
            # a reported runner's failure is its row's result, not the section's end
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500], "ok": "failed"}
            rows.append([name, *["-"] * 7, results[name]["error"][:80]])
            continue
        results[name] = compare_traces(ref, forced, free) | {"steps": forced.steps}
    checked = [primary, *also_checked]
    baseline = [results[n]["rel_max"] for n in runners if n not in [*checked, *reported]]
    bound = max([tol] + [1.5 * b for b in baseline])
    for name in runners:
        r = results[name]
        if "error" in r:
            continue
        r["ok"] = r["rel_max"] <= bound and r["unexplained_disagreements"] == 0
        if name in reported:
            r["ok"] = "reported"
        rows.append(
            [
                name,
                r["prompts"],
                r["positions"],
                r["rel_max"],
                r["rel_median"],
                r["top1_agreement"],
                r["unexplained_disagreements"],
                f"{r['free_greedy_identical']}/{r['prompts']}",
                r["ok"],
            ]
        )
    results["bound"] = bound
    results["ok"] = all(results[n]["ok"] for n in checked)
    results["reference_tokens"] = ref.tokens
    results["table"] = markdown_table(
        [
            "runner (vs cpu fp32 torch)",
            "prompts",
            "positions",
            "logits rel max",
            "rel median",
            "top-1 agree",
            "unexplained",
            "free greedy equal",
            "ok",
        ],
        rows,
    )
    return results


def random_prompts(vocab_size: int, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def model_prompts(folder: Path, vocab_size: int, seed: int = 0) -> tuple[list[list[int]], str]:
    tokenizer_file = folder / "tokenizer.json"
    if tokenizer_file.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_file))
        prompts = [tok.encode(t, add_special_tokens=False).ids for t in PROMPT_TEXTS]
        if all(prompts):
            return prompts, "text prompts (tokenizer.json)"
    return random_prompts(vocab_size, SYNTHETIC_PROMPT_LENGTHS, seed), "random token ids"


def run_model_section(
    args: argparse.Namespace,
    gpu_model: CausalLM,
    folder: Path,
    report: Report,
    section: str = "model",
) -> None:
    """The section as the check runs it: ``gpu_model`` (CUDA bf16) with FlashInfer, its fast
    paths and the torch backend against ``folder``'s model on the CPU in fp32; the result
    goes to ``report`` as ``section``."""
    from gpu.attention.flashinfer_backend import FlashInferPagedAttention
    from gpu.loader import load_model

    cfg = gpu_model.config
    prompts, prompt_kind = model_prompts(folder, cfg.vocab_size, args.seed)
    pages = pages_needed(prompts, args.new_tokens)
    cpu_model = load_model(folder, device="cpu", dtype=torch.float32, progress=False)
    ref_runner = ModelRunner(cpu_model, pages, PAGE_SIZE)
    fi_runner = ModelRunner(gpu_model, pages, PAGE_SIZE)
    if not isinstance(fi_runner.backend, FlashInferPagedAttention):
        raise AssertionError(f"CUDA runner picked {type(fi_runner.backend).__name__}")
    torch_backend = TorchPagedAttention(
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    )
    torch_runner = ModelRunner(gpu_model, pages, PAGE_SIZE, backend=torch_backend)
    runners = {"cuda bf16 flashinfer": fi_runner, "cuda bf16 torch-sdpa": torch_runner}
    # The graphs' replays and the fused rotary + KV append, against the same reference (a
    # mixture of experts decodes eagerly: no graph runners).
    fast_paths = [r for r in FAST_PATH_RUNNERS if cfg.moe is None or not r[1]]
    for name, graphs, fused in fast_paths:
        runner = ModelRunner(
            gpu_model, pages, PAGE_SIZE, cuda_graphs=graphs, fused_rope_append=fused
        )
        if graphs:
            runner.capture_graphs(len(prompts))
        runners[name] = runner
    result = model_section(
        ref_runner,
        runners,
        "cuda bf16 flashinfer",
        prompts,
        args.new_tokens,
        args.logits_tol,
        also_checked=[name for name, _, _ in fast_paths],
    )
    for name, graphs, _ in fast_paths:  # a graph runner that never replayed
        captured = runners[name].graphs
        replays = 0 if captured is None else captured.replays
        result[name]["graph_replays"] = replays
        if graphs and not replays:
            result[name]["ok"] = result["ok"] = False
    result["prompt_kind"] = prompt_kind
    result["prompt_lengths"] = [len(p) for p in prompts]
    report.section(section, result)
