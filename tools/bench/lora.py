"""What serving LoRA adapters costs: the same batch of greedy requests on the base model alone,
with every request on one adapter, and split between two adapters.

    python -m tools.bench.lora [--model PATH] [--requests 16] [--new-tokens 48] [--rank 16] \\
        [--rounds 3]

In one process, on the engine ``meshserve up``'s executors build (its defaults). The adapters
are random PEFT adapters of every projection at ``--rank`` (``tests.models.write_tiny_lora``,
written to a temporary folder); what they compute does not matter here, only what it costs.
Each step with adapter rows runs the per-op decoder (the fused CPU decode step and CUDA graphs
serve only steps without them: the "per-op decoder" side is the base model on that path), and
each adapter adds two small matmuls per fused linear and layer on its rows (and a gather and
a scatter where its rows are not one run). The sides take turns for ``--rounds`` rounds, the
same prompts, warmed alike, the prefix cache reset before each; the table shows each side's
median round.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpu.engine import Engine
from gpu.lora import LoraSet, load_adapter
from gpu.sampling_params import SamplingParams
from tests.models import write_tiny_lora
from tools.bench.up_engine import up_engine


def run(
    engine: Engine,
    prompts: list[list[int]],
    loras: list[str],
    new: int,
    name: str,
    fused: bool = True,
) -> float:
    """Seconds to generate ``new`` tokens for every prompt (prompt ``i`` on ``loras[i]``);
    ``fused``: the one-call CPU decode step where a step has no adapter rows."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    engine.runner.model.fuse_decode = fused
    engine.pages.reset_prefix_cache()
    start = time.perf_counter()
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"{name}-{i}", prompt, params, lora=lora)
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(out.new_token_ids) for out in engine.step())
    seconds = time.perf_counter() - start
    assert produced == new * len(prompts)
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.lora", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    built = up_engine(args.model)
    folder, engine, up = built.folder, built.engine, built.up
    runner = engine.runner
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            load_adapter(
                name,
                write_tiny_lora(Path(tmp) / name, folder, rank=args.rank, seed=seed),
                runner.config,
            )
            for seed, name in enumerate(("a", "b"))
        ]
    runner.load_loras(LoraSet(adapters))
    rng = random.Random(0)
    vocab = runner.config.vocab_size
    prompts = [
        [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]
    n = args.requests
    # (name: adapters per request, the fused decode step allowed)
    sides = {
        "base model only": ([""] * n, True),
        "base model, per-op decoder": ([""] * n, False),
        "all on adapter a": (["a"] * n, True),
        "half a, half b": (["a" if i % 2 else "b" for i in range(n)], True),
    }
    for name, (loras, fused) in sides.items():  # warm every path alike
        run(engine, prompts[:2], loras[:2], 4, f"warm-{name}", fused)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name, (loras, fused) in sides.items():
            seconds = run(engine, prompts, loras, args.new_tokens, f"{name}-{r}", fused)
            times[name].append(seconds)
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"\nmodel {folder.name}, {up.quantization} weights, {torch.get_num_threads()} threads, "
        f"{n} requests of {args.prompt_tokens} prompt + {args.new_tokens} new tokens, "
        f"rank-{args.rank} adapters of every projection, median of {args.rounds} "
        "interleaved rounds\n"
    )
    print("| side | seconds | output tokens/s | vs base |")
    print("|---|---|---|---|")
    base = medians["base model only"]
    for name, seconds in medians.items():
        rate = n * args.new_tokens / seconds
        print(f"| {name} | {seconds:.2f} | {rate:.1f} | {base / seconds:.2f}x |")


if __name__ == "__main__":
    main()
