"""Check the FlashInfer attention backend on a CUDA host, and time decode steps.

Seven sections, each independent (one failing does not stop the others):

- kernels: FlashInferPagedAttention (bf16) against TorchPagedAttention (fp32, same device) on
  random paged batches that mix prompt chunks and decodes, pure-decode batches (tensor-core and
  CUDA-core decode) and pure-prefill batches; page_size 16; GQA head configs such as 9/3
  (SmolLM2) and 32/8. Also checks that the appended KV pages match bit for bit.
- model: a whole model on CUDA in bf16 with FlashInfer against the same model on the CPU in fp32
  with the torch backend: every generated position's logits (teacher-forced on the CPU's greedy
  tokens, so one early flip does not derail the rest) and greedy agreement. The same CUDA model
  with the torch backend in bf16 runs alongside as the bf16 baseline, and FlashInfer's fast paths
  (``FAST_PATH_RUNNERS``: CUDA graphs, the fused rotary + KV append, both) must meet the same
  bound. Batches are staggered and chunked, so steps mix prefill chunks and decodes before ending
  in pure decode.
- timing: one decode step (every sequence at ~512 tokens of context) at batch 1/8/64 for each
  attention backend, timed with CUDA events around whole ``ModelRunner.forward`` calls
  (plan + all layers + lm_head, host overhead included).
- graphs: the same decode timing on a Llama-3-8B-shaped model with random bf16 weights, eager
  and replayed from CUDA graphs (also with the fused rotary + KV append, the other decode
  wrapper, cuBLASLt), as a fraction of the measured HBM bandwidth, and batch 1's kernels by
  kind (``decode_graphs.py``, ``kernel_profile.py``).
- overlap: whole engine steps one after another against overlapped (``gpu/overlap.py``) on the
  same requests: tokens/s and whether both produced the same tokens (``engine_overlap.py``);
  the graphs section runs it on the 8B shape too.
- quant: activation rows quantized to fp8 / int8 by one Triton kernel against the torch kernels
  it replaces: the same bytes, and the time of each (``row_quant.py``).
- sampling: a mixed batch sampled with no host wait inside the sampler (``sampler_waits.py``).

The default model is SmolLM2-135M (``gpu.gguf.resolve_model_path(None)``); where it is not
installed (an offline GPU host) a random model of SmolLM2's exact shape stands in, which checks
the same code paths and times the same work, and the JSON says so.

Usage (see tools/gpu_check/README.md for the offline GPU host):
    python -m tools.gpu_check.check_flashinfer --out out/flashinfer_check.json [--model PATH]
Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpu.attention.backend import AttentionBackend
from gpu.attention.metadata import SeqChunk, build_batch_metadata
from gpu.attention.torch_backend import TorchPagedAttention
from gpu.config import ModelConfig
from gpu.runner import ModelRunner

PAGE_SIZE = 16
KERNEL_TOL = 2e-2  # max |out - ref| / max |ref| for bf16 inputs against an fp32 reference
LOGITS_TOL = 5e-2  # the same measure on logits, bf16 model against fp32 model
# SmolLM2-135M-Instruct's config.json (Llama architecture); the synthetic stand-in's shape.
SMOLLM2_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
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

BackendFactory = Callable[[int, int, int, bool | None], AttentionBackend]


# --------------------------------------------------------------------------- helpers


def rel_max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in fp32 (inf when ``out`` has a NaN or inf)."""
    out, ref = out.float(), ref.float()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    scale = float(ref.abs().max().item())
    return float((out - ref).abs().max().item()) / (scale if scale > 0 else 1.0)


def rel_l2_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    norm = float(ref.norm().item())
    return float((out - ref).norm().item()) / (norm if norm > 0 else 1.0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, bool):
            return "yes" if value else "NO"
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def flashinfer_factory(device: torch.device, **kwargs: Any) -> BackendFactory:
    """Build FlashInferPagedAttention backends (``kwargs`` go to its constructor)."""
    from gpu.attention.flashinfer_backend import FlashInferPagedAttention

    def make(hq: int, hkv: int, d: int, tensor_cores: bool | None) -> AttentionBackend:
        return FlashInferPagedAttention(
            hq, hkv, d, device, decode_tensor_cores=tensor_cores, **kwargs
        )

    return make


def wrapper_name(backend: AttentionBackend) -> str:
    """Which FlashInfer wrapper the planned step runs (for the report)."""
    if getattr(backend, "decode_only", False):
        cores = "tensor-core" if getattr(backend, "decode_tensor_cores", False) else "cuda-core"
        return f"decode ({cores})"
    return "prefill (causal)"


# --------------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class KernelCase:
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    shapes: tuple[tuple[int, int], ...]  # (num_computed, num_new) per sequence
    decode_tensor_cores: bool | None = None

    @property
    def label(self) -> str:
        tc = {None: "", True: " tc", False: " no-tc"}[self.decode_tensor_cores]
        return f"{self.name} {self.num_q_heads}/{self.num_kv_heads}x{self.head_dim}{tc}"


def batch_shapes(kind: str, rng: random.Random) -> tuple[tuple[int, int], ...]:
    """(num_computed, num_new) per sequence for one kind of step."""
    ps = PAGE_SIZE
    if kind == "mixed":  # decodes beside prompt chunks, fresh and continued
        return (
            (rng.randint(1, 700), 1),
            (0, rng.randint(20, 300)),  # a fresh prompt
            (rng.randint(1, 40) * ps, rng.randint(2, 130)),  # a later chunk, page-aligned start
            (0, 1),  # a one-token prompt: q = kv = 1
            (rng.randint(1, 500), rng.randint(2, 70)),  # a later chunk, unaligned start
            (ps - 1, 1),  # kv_len exactly one page
            (rng.randint(600, 1200), 1),
        )
    if kind == "decode":
        lengths = [0, ps - 1, 2 * ps - 1, 2 * ps] + [rng.randint(1, 1500) for _ in range(12)]
        return tuple((n, 1) for n in lengths)
    if kind == "prefill":  # prompt chunks only, one of them a single token
        return ((0, rng.randint(100, 400)), (rng.randint(1, 300), 64), (rng.randint(5, 50), 1))
    if kind == "long":  # long prompt chunk with a long decode beside it (split-KV paths)
        return ((0, 1500), (3000, 1), (rng.randint(2000, 2500), 200))
    raise ValueError(kind)


def kernel_cases(
    head_configs: Sequence[tuple[int, int]], head_dims: Sequence[int], seed: int
) -> list[KernelCase]:
    rng = random.Random(seed)
    cases = []
    for d in head_dims:
        for hq, hkv in head_configs:
            for kind in ("mixed", "prefill", "long"):
                cases.append(KernelCase(kind, hq, hkv, d, batch_shapes(kind, rng)))
            decode = batch_shapes("decode", rng)
            for tc in (True, False):
                cases.append(KernelCase("decode", hq, hkv, d, decode, tc))
    return cases


def run_kernel_case(
    case: KernelCase,
    device: torch.device,
    make_backend: BackendFactory,
    dtype: torch.dtype = torch.bfloat16,
    layers: int = 2,
    seed: int = 0,
    tol: float = KERNEL_TOL,
) -> dict[str, Any]:
    """Plan once, attend ``layers`` times (fresh caches and q/k/v each), compare with torch."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = case.num_q_heads, case.num_kv_heads, case.head_dim
    pages_per_seq = [-(-(c + n) // PAGE_SIZE) + rng.randint(0, 2) for c, n in case.shapes]
    num_pages = sum(pages_per_seq) + 3
    pool = list(range(num_pages))
    rng.shuffle(pool)  # scattered, out-of-order pages
    chunks, start = [], 0
    for (computed, new), n_pages in zip(case.shapes, pages_per_seq, strict=True):
        chunks.append(SeqChunk(tuple(pool[start : start + n_pages]), computed, new))
        start += n_pages
    meta = build_batch_metadata(chunks, PAGE_SIZE).to(device)
    tokens = meta.num_tokens
    ref_backend = TorchPagedAttention(hq, hkv, d)
    ref_backend.plan(meta)
    backend = make_backend(hq, hkv, d, case.decode_tensor_cores)
    backend.plan(meta)
    rel_max = rel_l2 = cache_diff = 0.0
    for _ in range(layers):
        # Earlier tokens' KV and the unused slots hold random values (identical in both caches).
        cache = torch.randn((num_pages, 2, PAGE_SIZE, hkv, d), generator=gen).to(dtype)
        ref_cache, test_cache = cache.float().to(device), cache.to(device)
        # q, k and v are row-strided views into one projection output, as in the model.
        qkv = torch.randn((tokens, hq + 2 * hkv, d), generator=gen).to(dtype).to(device)
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        ref = ref_backend.attend(q.float(), k.float(), v.float(), ref_cache)
        out = backend.attend(q, k, v, test_cache)
        synchronize(device)
        if tuple(out.shape) != (tokens, hq, d) or out.dtype != dtype:
            raise AssertionError(f"output is {tuple(out.shape)} {out.dtype}")
        rel_max = max(rel_max, rel_max_error(out, ref))
        rel_l2 = max(rel_l2, rel_l2_error(out, ref))
        cache_diff = max(cache_diff, (test_cache.float() - ref_cache).abs().max().item())
    ok = rel_max <= tol and cache_diff == 0.0
    return {
        "case": case.label,
        "heads": f"{hq}/{hkv}",
        "head_dim": d,
        "seqs": len(chunks),
        "tokens": tokens,
        "q_lens": [n for _, n in case.shapes],
        "kv_lens": [c + n for c, n in case.shapes],
        "wrapper": wrapper_name(backend),
        "rel_max": rel_max,
        "rel_l2": rel_l2,
        "cache_max_abs_diff": cache_diff,
        "ok": ok,
    }


def kernels_section(
    device: torch.device,
    make_backend: BackendFactory,
    cases: Sequence[KernelCase],
    seed: int,
    tol: float,
) -> dict[str, Any]:
    results = []
    for i, case in enumerate(cases):
        try:
            results.append(run_kernel_case(case, device, make_backend, seed=seed + i, tol=tol))
        except Exception as exc:  # report and go on with the other cases
            results.append({"case": case.label, "ok": False, "error": repr(exc)})
            traceback.print_exc()
    table = markdown_table(
        ["case", "seqs", "tokens", "wrapper", "rel max err", "rel l2 err", "KV pages", "ok"],
        [
            [
                r["case"],
                r.get("seqs", "-"),
                r.get("tokens", "-"),
                r.get("wrapper", r.get("error", "-")),
                r.get("rel_max", float("nan")),
                r.get("rel_l2", float("nan")),
                "exact" if r.get("cache_max_abs_diff") == 0.0 else r.get("cache_max_abs_diff"),
                r["ok"],
            ]
            for r in results
        ],
    )
    return {"tolerance": tol, "cases": results, "ok": all(r["ok"] for r in results), "table": table}


# --------------------------------------------------------------------------- model


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
) -> dict[str, Any]:
    """``runners[primary]`` (FlashInfer) passes when its logits error is within ``tol`` or
    within 1.5x that of the other runners (the bf16 baseline), and every top-1 disagreement
    with the reference is a near tie; the section passes when it and every runner named in
    ``also_checked`` (FlashInfer's fast paths) pass that bound."""
    started = time.perf_counter()
    ref = run_schedule(ref_runner, prompts, new_tokens, chunk)
    results: dict[str, Any] = {"reference_seconds": time.perf_counter() - started}
    rows = []
    for name, runner in runners.items():
        forced = run_schedule(runner, prompts, new_tokens, chunk, forced=ref.tokens)
        free = run_schedule(runner, prompts, new_tokens, chunk)
        results[name] = compare_traces(ref, forced, free) | {"steps": forced.steps}
    checked = [primary, *also_checked]
    baseline = [results[n]["rel_max"] for n in runners if n not in checked]
    bound = max([tol] + [1.5 * b for b in baseline])
    for name in runners:
        r = results[name]
        r["ok"] = r["rel_max"] <= bound and r["unexplained_disagreements"] == 0
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


def write_synthetic_model(folder: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """A random model of ``config``'s shape in Hugging Face format (config + safetensors).

    Embeddings are wide enough that logits are not flat (as in the test fixtures)."""
    from safetensors.torch import save_file

    from gpu.model import expected_shapes

    folder.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_hf_dict(config)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = 0.8 + 0.4 * torch.rand(shape, generator=gen)
        elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            t = torch.randn(shape, generator=gen) * 0.1
        elif name.endswith(".bias"):
            t = torch.randn(shape, generator=gen) * 0.02
        else:
            t = torch.randn(shape, generator=gen) * (1.0 / shape[1]) ** 0.5
        tensors[name] = t.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def resolve_model(spec: str, workdir: Path) -> tuple[Path, str]:
    """(Hugging Face folder, description). "synthetic" writes the stand-in; "default" falls
    back to it when the default model is not installed."""
    if spec != "synthetic":
        try:
            from gpu.gguf import resolve_model_path

            folder = resolve_model_path(None if spec == "default" else spec, progress=False)
            return folder, f"{spec} -> {folder}"
        except Exception as exc:
            if spec != "default":
                raise
            print(f"[model] default model unavailable ({exc}); using the synthetic stand-in")
            reason = f"default model unavailable: {exc}"
    else:
        reason = "requested"
    folder = write_synthetic_model(workdir / "smollm2-shape-random", SMOLLM2_CONFIG)
    return folder, f"synthetic SmolLM2-135M shape, random weights ({reason})"


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


# --------------------------------------------------------------------------- timing


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
    chunks = [
        SeqChunk(tuple(range(b * pages, (b + 1) * pages)), context - 1, 1) for b in range(batch)
    ]
    meta = build_batch_metadata(chunks, PAGE_SIZE)
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


# --------------------------------------------------------------------------- main


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["capability"] = list(torch.cuda.get_device_capability(0))
    for name in ("flashinfer", "tvm_ffi"):
        try:
            module = __import__(name)
            env[name] = getattr(module, "__version__", "?")
        except Exception as exc:
            env[name] = f"unavailable: {exc!r}"
    nvcc = shutil.which("nvcc")
    env["nvcc"] = nvcc
    env["flashinfer_cuda_arch_list"] = os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
    return env


def kernel_specs(head_dims: Sequence[int], dtype: torch.dtype) -> list[Any]:
    """FlashInfer's JIT specs of the modules the model uses on CUDA at these head sizes: the
    page (append) module, norm/rope/activation (``gpu.ops.FlashInferOps``), the FA2
    batch-prefill module (which also serves tensor-core decode) and the CUDA-core
    batch-decode module. This leans on FlashInfer internals (0.7.x);
    the arguments are the ones the wrappers' plans pass: fa2, int32 indices, no RoPE, sliding
    window, soft cap, fp16 QK reduction or token-head scales."""
    from flashinfer.jit import gen_act_and_mul_module, gen_batch_decode_module
    from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.page import gen_page_module
    from flashinfer.jit.rope import gen_rope_module

    # The page module, then gpu.ops.FlashInferOps' norm, rotary and SwiGLU modules (the norm
    # module is the CUDA one: device_run.sh sets FLASHINFER_USE_CUDA_NORM=1, the carried
    # files have no CuTe DSL).
    specs = [gen_page_module(), gen_norm_module(), gen_rope_module()]
    specs.append(gen_act_and_mul_module("silu"))
    for d in sorted(set(head_dims)):
        specs.append(
            _gen_batch_prefill_primary_module(
                "fa2", dtype, dtype, dtype, torch.int32, d, d, 0, False, False, False, False
            )
        )
        specs.append(
            gen_batch_decode_module(dtype, dtype, dtype, torch.int32, d, d, 0, False, False)
        )
    return specs


def prebuild_kernels(head_dims: Sequence[int], dtype: torch.dtype) -> dict[str, Any]:
    """Compile the JIT modules the checks will use in one parallel ninja run (FlashInfer
    otherwise builds them one after another on first use); modules shipped prebuilt (see
    ``export_aot``) are skipped. Best effort: on any failure the lazy path still builds what
    it needs, and reports its own error."""
    started = time.perf_counter()
    try:
        from flashinfer.jit import build_jit_specs

        specs = kernel_specs(head_dims, dtype)
        prebuilt = [s.name for s in specs if s.aot_path.exists()]
        build_jit_specs(specs, verbose=False)
    except Exception as exc:
        traceback.print_exc()
        return {"ok": False, "error": repr(exc), "seconds": time.perf_counter() - started}
    return {
        "ok": True,
        "modules": [s.name for s in specs],
        "shipped_prebuilt": prebuilt,
        "seconds": time.perf_counter() - started,
    }


def export_aot(out_dir: Path, head_dims: Sequence[int], dtype: torch.dtype) -> list[Path]:
    """Compile ``kernel_specs`` here (nvcc is enough, no GPU: set FLASHINFER_CUDA_ARCH_LIST)
    and copy each module to ``out_dir/flashinfer/data/aot/<name>/<name>.so``, where FlashInfer
    loads prebuilt modules instead of compiling (falling back to JIT if one fails to load)."""
    from flashinfer.jit import build_jit_specs

    specs = kernel_specs(head_dims, dtype)
    build_jit_specs(specs, verbose=True, skip_prebuilt=False)
    written = []
    for spec in specs:
        dest = out_dir / "flashinfer" / "data" / "aot" / spec.name / f"{spec.name}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, dest)
        written.append(dest)
    return written


class Report:
    """Collects section results and rewrites the JSON after each one (a run killed at its
    time limit still leaves what it finished)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"sections": {}, "errors": []}
        path.parent.mkdir(parents=True, exist_ok=True)

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.flush()

    def section(self, name: str, value: dict[str, Any]) -> None:
        self.data["sections"][name] = value
        self.flush()
        if "table" in value:
            print(f"\n### {name}\n\n{value['table']}\n", flush=True)

    def error(self, name: str, exc: BaseException) -> None:
        traceback.print_exc()
        self.data["sections"][name] = {"ok": False, "error": repr(exc)}
        self.data["errors"].append(f"{name}: {exc!r}")
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def parse_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        hq, hkv = item.split("/")
        pairs.append((int(hq), int(hkv)))
    return pairs


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("out/flashinfer_check.json"))
    p.add_argument(
        "--model", default="default", help='"default" (SmolLM2), "synthetic", a folder or .gguf'
    )
    p.add_argument("--sections", default="kernels,model,timing,overlap,quant,sampling,graphs")
    p.add_argument("--head-configs", default="9/3,32/8", help="q/kv head pairs")
    p.add_argument("--head-dims", default="64")
    p.add_argument("--kernel-tol", type=float, default=KERNEL_TOL)
    p.add_argument("--logits-tol", type=float, default=LOGITS_TOL)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prebuild", action="store_true")
    p.add_argument(
        "--prebuild-only", action="store_true", help="only compile the JIT kernels (staging)"
    )
    p.add_argument(
        "--export-aot",
        type=Path,
        metavar="DIR",
        help="compile the kernels without a GPU into DIR/flashinfer/data/aot (make_carry.sh)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.export_aot is not None:
        for path in export_aot(args.export_aot, parse_ints(args.head_dims), torch.bfloat16):
            print(f"[export-aot] {path} ({path.stat().st_size} bytes)")
        return 0
    sections = set(args.sections.split(","))
    report = Report(args.out)
    report.set("env", environment())
    report.set("args", vars(args))
    print(json.dumps(report.data["env"], indent=1), flush=True)
    if not torch.cuda.is_available():
        print("this check needs a CUDA GPU", file=sys.stderr)
        report.set("ok", False)
        return 1
    device = torch.device("cuda", 0)
    torch.manual_seed(args.seed)
    head_configs = parse_pairs(args.head_configs)
    head_dims = parse_ints(args.head_dims)
    # The kernels the sections run: the model's head size 64 (SmolLM2), 128 for the graphs
    # section's 8B shape.
    build_dims = [*head_dims, 64, *([128] if "graphs" in sections else [])]
    if args.prebuild_only:
        prebuilt = prebuild_kernels(build_dims, torch.bfloat16)
        report.set("prebuild", prebuilt)
        report.set("ok", prebuilt["ok"])
        print(f"[prebuild] {prebuilt}", flush=True)
        return 0 if prebuilt["ok"] else 1
    workdir = Path(tempfile.mkdtemp(prefix="flashinfer-check-"))

    prebuild: dict[str, Any] = {"skipped": True}
    builder = None
    if not args.no_prebuild:

        def run_prebuild() -> None:
            prebuild.clear()
            prebuild.update(prebuild_kernels(build_dims, torch.bfloat16))

        builder = threading.Thread(target=run_prebuild, daemon=True)
        builder.start()

    folder: Path | None = None
    if sections & {"model", "timing"}:
        try:  # converting a GGUF overlaps with the kernel build
            folder, description = resolve_model(args.model, workdir)
        except Exception as exc:  # recorded (the run fails), then go on with the stand-in
            report.error("model-resolve", exc)
            folder, description = resolve_model("synthetic", workdir)
        report.set("model", description)
    if builder is not None:
        builder.join()
    report.set("prebuild", prebuild)
    print(f"[prebuild] {prebuild}", flush=True)

    if "kernels" in sections:
        try:
            cases = kernel_cases(head_configs, head_dims, args.seed)
            report.section(
                "kernels",
                kernels_section(
                    device, flashinfer_factory(device), cases, args.seed, args.kernel_tol
                ),
            )
        except Exception as exc:
            report.error("kernels", exc)

    gpu_model = None
    if folder is not None and sections & {"model", "timing"}:
        from gpu.loader import load_model

        try:
            gpu_model = load_model(folder, device=device, dtype=torch.bfloat16, progress=False)
        except Exception as exc:
            report.error("model-load", exc)

    if gpu_model is not None and folder is not None and "model" in sections:
        try:
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
            # The graphs' replays and the fused rotary + KV append, against the same reference.
            for name, graphs, fused in FAST_PATH_RUNNERS:
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
                also_checked=[name for name, _, _ in FAST_PATH_RUNNERS],
            )
            for name, graphs, _ in FAST_PATH_RUNNERS:  # a graph runner that never replayed
                captured = runners[name].graphs
                replays = 0 if captured is None else captured.replays
                result[name]["graph_replays"] = replays
                if graphs and not replays:
                    result[name]["ok"] = result["ok"] = False
            result["prompt_kind"] = prompt_kind
            result["prompt_lengths"] = [len(p) for p in prompts]
            report.section("model", result)
            del ref_runner, cpu_model, fi_runner, torch_runner, runners
        except Exception as exc:
            report.error("model", exc)

    if gpu_model is not None and "timing" in sections:
        try:
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
        except Exception as exc:
            report.error("timing", exc)

    if gpu_model is not None and "overlap" in sections:
        try:
            from tools.gpu_check.engine_overlap import overlap_section

            report.section("overlap", overlap_section(gpu_model, 32, 64, 64))
        except Exception as exc:
            report.error("overlap", exc)

    if "quant" in sections:
        try:
            from tools.gpu_check.row_quant import quant_section

            report.section("quant", quant_section(device))
        except Exception as exc:
            report.error("quant", exc)

    if "sampling" in sections:
        try:
            from tools.gpu_check.sampler_waits import sampling_section

            vocab = 49152  # SmolLM2's
            report.section("sampling", sampling_section(device, [1, 8, 64], vocab, args.iters))
        except Exception as exc:
            report.error("sampling", exc)

    if "graphs" in sections:
        del gpu_model  # the 8B-class model needs the memory
        torch.cuda.empty_cache()
        try:
            from tools.gpu_check.decode_graphs import (
                LLAMA3_8B_CONFIG,
                graphs_section,
                measure_bandwidth,
                random_model,
            )

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
            del big
        except Exception as exc:
            report.error("graphs", exc)

    shutil.rmtree(workdir, ignore_errors=True)
    wanted = {"kernels", "model", "timing", "overlap", "quant", "sampling", "graphs"} & sections
    results = report.data["sections"]
    ok = not report.data["errors"] and all(results.get(s, {}).get("ok") for s in wanted)
    report.set("ok", ok)
    print("\n## Summary\n", flush=True)
    for name in ("kernels", "model", "timing", "overlap", "quant", "sampling", "graphs"):
        if name in results:
            body = results[name].get("table") or f"error: {results[name].get('error')}"
            print(f"### {name}\n\n{body}\n", flush=True)
    for line in report.data["errors"]:
        print(f"error in {line}", flush=True)
    print(f"flashinfer check: {'PASSED' if ok else 'FAILED'} (details: {args.out})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
