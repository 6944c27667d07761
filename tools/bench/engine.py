"""Throughput of the continuous-batching engine against sequential transformers ``generate()``.

    python -m tools.bench.engine [--model PATH] [--concurrency 32] [--output-tokens 64]
        [--rounds 2]

Runs, in one process and one run: (1) one request alone through the engine (single-stream
decode tokens/s), (2) N concurrent requests through the engine, (3) the same N prompts through
Hugging Face ``generate()`` one after another (greedy, same output length). Both sides are
warmed the same way (one short untimed run each) and then take turns, (1) (2) (3) per round,
for ``--rounds`` rounds, so a shift of the machine's load over minutes reaches every side; the
table shows each side's median round and the ratio of the medians. fp32 on CPU.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import torch

from common.tokenizer import Tokenizer
from gpu.engine import Engine, EngineConfig
from gpu.gguf import resolve_model_path
from gpu.gguf.blocks import require_whole_folder
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.",
    "How do vaccines work?",
    "Give me three tips for learning to code.",
    "What causes the seasons on Earth?",
    "Summarise the plot of Romeo and Juliet.",
    "Why is the sky blue?",
]


@dataclass(frozen=True)
class Result:
    name: str
    requests: int
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def chat_prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        question = f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})"
        prompts.append(tokenizer.encode_user_turn(question))
    return prompts


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: int, name: str) -> Result:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    engine.pages.reset_prefix_cache()  # no run profits from the previous one's cache
    return Result(name, len(prompts), sum(len(o) for o in outputs), seconds)


def run_decode_only(engine: Engine, prompt: list[int], max_tokens: int) -> Result:
    """Single-stream decode speed: time from the first output token to the last."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("decode-only", prompt, params)
    engine.step()  # the prefill
    start = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - start
    engine.pages.reset_prefix_cache()
    return Result("engine, 1 stream, decode only", 1, produced, seconds)


def load_hf(folder: str) -> Any:
    # transformers takes seconds to import; the mesh and quantization benchmarks import this
    # module for its prompts and engine runs only.
    from transformers import AutoModelForCausalLM

    require_whole_folder(folder, "the transformers baseline")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    model.generation_config.eos_token_id = None
    return model


def run_hf_sequential(model: Any, prompts: list[list[int]], max_tokens: int) -> Result:
    produced = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
            )
            produced += out.shape[1] - len(prompt)
    seconds = time.perf_counter() - start
    return Result("transformers generate(), sequential", len(prompts), produced, seconds)


def median_round(results: list[Result]) -> Result:
    """The run with the median speed (the lower middle one of an even count)."""
    ordered = sorted(results, key=lambda r: r.tokens_per_s)
    return ordered[(len(ordered) - 1) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.engine", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument(
        "--hf-requests",
        type=int,
        default=None,
        help="prompts for the sequential baseline (default: all)",
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2, help="turns of each side")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    runner = ModelRunner(load_model(folder), num_pages=4096, page_size=16)
    engine = Engine(
        runner,
        EngineConfig(max_num_batched_tokens=1024, max_num_seqs=max(64, args.concurrency)),
        tokenizer.eos_token_ids,
    )
    prompts = chat_prompts(tokenizer, args.concurrency)
    hf_prompts = prompts[: args.hf_requests or len(prompts)]
    hf_model = load_hf(str(folder))
    # The same untimed warm-up for both sides: the first calls of new shapes are slow.
    run_engine(engine, prompts[:2], 4, "warm-up")
    run_hf_sequential(hf_model, prompts[:2], 4)
    rounds: list[list[Result]] = []
    for _ in range(args.rounds):
        rounds.append(
            [
                run_decode_only(engine, prompts[0], args.output_tokens),
                run_engine(
                    engine, prompts, args.output_tokens, f"engine, {args.concurrency} concurrent"
                ),
                run_hf_sequential(hf_model, hf_prompts, args.output_tokens),
            ]
        )
    rows = [median_round([r[side] for r in rounds]) for side in range(3)]
    _, batched, hf = rows
    print(
        f"\nmodel {folder.name}, fp32 CPU, {torch.get_num_threads()} threads, "
        f"{args.output_tokens} output tokens per request, median of {args.rounds} "
        "interleaved rounds\n"
    )
    print(f"| {'run':<40} | requests | output tokens | seconds | tokens/s |")
    print(f"|{'-' * 42}|----------|---------------|---------|----------|")
    for r in rows:
        print(
            f"| {r.name:<40} | {r.requests:>8} | {r.output_tokens:>13} | "
            f"{r.seconds:>7.2f} | {r.tokens_per_s:>8.1f} |"
        )
    print(
        f"\nconcurrent engine / sequential transformers: "
        f"{batched.tokens_per_s / hf.tokens_per_s:.1f}x"
    )


if __name__ == "__main__":
    main()
