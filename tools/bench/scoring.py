"""What scoring prompts costs: lm-eval's loglikelihood requests (``echo``, ``logprobs: 1``,
``max_tokens: 1``: the engine's ``prompt_logprobs=1``) against the same prompts answered with
one token and nothing scored.

    python -m tools.bench.scoring [--model PATH] [--prompts 32] [--context 200] [--rounds 3]

In one process, on the engine ``meshserve up``'s executors build (its defaults: the model's
weight format, KV pages, step budget). Each request is a context shared by four prompts (a
multiple-choice question: the context and one continuation) and scored whole, as lm-eval sends
them. The two sides take turns for ``--rounds`` rounds, the same prompts, warmed alike; the
table shows each side's median round. Scoring computes the logits of every prompt position
(not of the last one alone) and takes no prefix-cache hit (a cached position has no logits),
so the shared contexts are computed four times there and once plus three hits without it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from common.tokenizer import Tokenizer
from gpu.engine import Engine
from gpu.sampling_params import SamplingParams
from tools.bench.up_engine import up_engine

TEXT = (
    "the model serves many requests at once and each one shares its pages with others "
    "when their prompts begin alike so a question asked four times costs little"
)
WORDS = TEXT.split(" ")


def prompts_for(tokenizer: Tokenizer, n: int, context: int, seed: int) -> list[list[int]]:
    """``n`` prompts: a context of about ``context`` tokens, then one of four continuations."""
    rng = random.Random(seed)
    out = []
    for q in range(n // 4):
        words = [rng.choice(WORDS) for _ in range(context)]
        ids = tokenizer.encode(" ".join(words))[:context]
        for choice in range(4):
            tail = tokenizer.encode(f" answer {q}-{choice}: " + rng.choice(WORDS))
            out.append(ids + tail)
    return out


def run(engine: Engine, prompts: list[list[int]], scored: bool, name: str) -> float:
    """Seconds to answer every prompt with one token (and score it, if ``scored``)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1 if scored else None)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{name}-{i}", prompt, params)
    got = 0
    while engine.has_unfinished():
        got += sum(out.prompt_logprobs is not None for out in engine.step())
    seconds = time.perf_counter() - start
    assert got == (len(prompts) if scored else 0)
    engine.pages.reset_prefix_cache()  # each round starts cold
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.scoring", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=32, help="a multiple of 4")
    parser.add_argument("--context", type=int, default=200, help="tokens of each context")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    built = up_engine(args.model)
    folder, tokenizer, engine, up = built.folder, built.tokenizer, built.engine, built.up
    prompts = prompts_for(tokenizer, args.prompts, args.context, seed=0)
    run(engine, prompts[:4], True, "warm-scored")
    run(engine, prompts[:4], False, "warm-plain")
    sides: dict[str, list[float]] = {"plain": [], "scored": []}
    for r in range(args.rounds):
        sides["plain"].append(run(engine, prompts, False, f"plain-{r}"))
        sides["scored"].append(run(engine, prompts, True, f"scored-{r}"))
    medians = {k: statistics.median(v) for k, v in sides.items()}
    tokens = sum(len(p) for p in prompts)
    print(
        f"\nmodel {folder.name}, {up.quantization} weights, {torch.get_num_threads()} threads, "
        f"{len(prompts)} prompts ({tokens} tokens, contexts of ~{args.context} tokens shared "
        f"by 4), median of {args.rounds} interleaved rounds\n"
    )
    print("| side | seconds | prompt tokens/s | requests/s |")
    print("|---|---|---|---|")
    for name, label in (("plain", "one token, nothing scored"), ("scored", "prompt_logprobs 1")):
        seconds = medians[name]
        rate = len(prompts) / seconds
        print(f"| {label} | {seconds:.2f} | {tokens / seconds:.0f} | {rate:.1f} |")
    print(f"\nscored / plain time: {medians['scored'] / medians['plain']:.2f}x")


if __name__ == "__main__":
    main()
