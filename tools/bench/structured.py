"""What constrained decoding costs: engine tokens/s with a JSON schema against unconstrained,
and the time to compile a schema cold and cached.

    python -m tools.bench.structured [--model PATH] [--output-tokens 64] [--rounds 3]

One process, one warm-up for both sides. Each round runs, at 1 and at 16 concurrent requests,
the unconstrained side then the constrained side (A B A B ...), so a shared machine's drifting
load falls on both alike; the table shows the median round. Both sides decode greedily exactly
``--output-tokens`` tokens per request: the unconstrained side with ``ignore_eos``, the
constrained side under a schema (an array of at least 64 strings) that cannot end sooner. The
grammar is compiled before the timed runs, as the executor does off its step loop, so the
difference is what the step loop pays: the bitmask fill per constrained sequence and step,
its application, and the sampler's lost all-greedy fast path.

Compile times: the tokenizer's schema -> EBNF conversion and the executor's compile against
the vocabulary (``GrammarCache``), each cold (a schema never seen) and cached (seen before).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from common.tokenizer import Tokenizer
from common.wire.tokenizer import ResponseFormat
from gpu.engine import Engine, EngineConfig
from gpu.gguf import resolve_model_path
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from services.executor.grammars import GrammarCache, tokenizer_info
from services.tokenizer.grammars import grammar_for
from tools.bench.engine import chat_prompts

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "names": {"type": "array", "items": {"type": "string"}, "minItems": 64},
        "done": {"type": "boolean"},
    },
    "required": ["names", "done"],
}


def schema_format(schema: dict[str, Any]) -> ResponseFormat:
    return ResponseFormat("json_schema", json.dumps(schema))


@dataclass(frozen=True)
class Run:
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def run(engine: Engine, prompts: list[list[int]], max_tokens: int, grammar: Any) -> Run:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=grammar is None)
    ids = [f"r{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params, grammar=grammar)
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return Run(tokens, time.perf_counter() - start)


def timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def unique_schema(i: int) -> dict[str, Any]:
    """A schema whose grammar no cache has seen (an enum value of its own)."""
    return {**SCHEMA, "properties": {**SCHEMA["properties"], "tag": {"enum": [f"run-{i}"]}}}


def compile_times(cache: GrammarCache, repeats: int) -> dict[str, float]:
    """Median seconds: conversion cold/cached, compile cold/cached."""

    async def compile_once(wire: Any) -> float:
        start = time.perf_counter()
        await cache.get(wire)
        return time.perf_counter() - start

    convert_cold, convert_hot, compile_cold, compile_hot = [], [], [], []
    stamp = time.time_ns()
    for i in range(repeats):
        fmt = schema_format(unique_schema(stamp + i))
        wire, seconds = timed(lambda fmt=fmt: grammar_for(fmt, None, "hermes"))
        convert_cold.append(seconds)
        convert_hot.append(timed(lambda fmt=fmt: grammar_for(fmt, None, "hermes"))[1])
        compile_cold.append(asyncio.run(compile_once(wire)))
        compile_hot.append(asyncio.run(compile_once(wire)))
    return {
        "schema -> EBNF (tokenizer), cold": statistics.median(convert_cold),
        "schema -> EBNF (tokenizer), cached": statistics.median(convert_hot),
        "EBNF -> token masks (executor), cold": statistics.median(compile_cold),
        "EBNF -> token masks (executor), cached": statistics.median(compile_hot),
    }


def mask_ms(compiled: Any, tokenizer: Tokenizer, vocab: int, rows: int, repeats: int) -> float:
    """Median ms of the grammar's share of one decode step for ``rows`` constrained sequences
    mid-document: fill their bitmask rows, copy the logits to a working tensor (the sampler's
    lost fast path) and apply the mask. Measured alone, so it holds on a loaded machine."""
    from gpu.grammar import GrammarState, allocate_bitmask, apply_bitmask

    states = [GrammarState(compiled, tokenizer.eos_token_ids) for _ in range(rows)]
    for state in states:
        assert state.accept(tokenizer.encode('{"names": ["Ada", "Bob', add_special_tokens=False))
    logits = torch.randn(rows, vocab)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        bitmask = allocate_bitmask(rows, vocab)
        for i, state in enumerate(states):
            state.next_mask(bitmask, i)
        work = logits.clone()
        apply_bitmask(work, bitmask, list(range(rows)))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.structured", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2)")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    model = load_model(folder)
    engine = Engine(
        ModelRunner(model, num_pages=2048, page_size=16),
        EngineConfig(max_num_batched_tokens=1024, max_num_seqs=64),
        tokenizer.eos_token_ids,
    )
    info, info_s = timed(
        lambda: tokenizer_info(
            tokenizer.backend, model.config.vocab_size, sorted(engine.eos_token_ids)
        )
    )
    cache = GrammarCache(info)
    wire = grammar_for(schema_format(SCHEMA), None, "hermes")
    assert wire is not None
    compiled = asyncio.run(cache.get(wire))
    prompts = chat_prompts(tokenizer, max(args.concurrency))
    for grammar in (None, compiled):  # warm-up, both sides, at the largest batch
        run(engine, prompts, 8, grammar)

    sides: dict[tuple[int, str], list[Run]] = {}
    for _ in range(args.rounds):
        for n in args.concurrency:
            for name, grammar in (("unconstrained", None), ("json_schema", compiled)):
                result = run(engine, prompts[:n], args.output_tokens, grammar)
                if result.tokens != n * args.output_tokens:
                    raise SystemExit(f"{name} at {n}: {result.tokens} tokens, not the same work")
                sides.setdefault((n, name), []).append(result)

    print(
        f"\nmodel {folder.name}, fp32 CPU, {torch.get_num_threads()} threads, "
        f"{args.output_tokens} output tokens per request, median of {args.rounds} rounds\n"
    )
    print("| concurrent | unconstrained tok/s | json_schema tok/s | constrained / free |")
    print("|-----------:|--------------------:|------------------:|-------------------:|")
    for n in args.concurrency:
        free = statistics.median(r.tokens_per_s for r in sides[(n, "unconstrained")])
        constrained = statistics.median(r.tokens_per_s for r in sides[(n, "json_schema")])
        print(f"| {n:>10} | {free:>19.1f} | {constrained:>17.1f} | {constrained / free:>18.3f} |")
    print("\n| concurrent | grammar work per step, ms | unconstrained step, ms | share |")
    print("|---:|---:|---:|---:|")
    for n in args.concurrency:
        free = statistics.median(r.tokens_per_s for r in sides[(n, "unconstrained")])
        step_ms = 1000 * n / free  # a decode step emits one token per sequence
        grammar_ms = mask_ms(compiled, tokenizer, model.config.vocab_size, n, 50)
        print(f"| {n} | {grammar_ms:.3f} | {step_ms:.1f} | {grammar_ms / step_ms:.1%} |")
    print(
        f"\nvocabulary {model.config.vocab_size}; xgrammar tokenizer info built in {info_s:.2f} s"
    )
    print("\n| compile step | median ms |")
    print("|---|---:|")
    for name, seconds in compile_times(cache, 5).items():
        print(f"| {name} | {seconds * 1000:.3f} |")
    cache.close()


if __name__ == "__main__":
    main()
