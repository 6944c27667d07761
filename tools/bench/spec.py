"""Speculative decoding on held-out chat prompts: acceptance and speed, with and without.

    python -m tools.bench.spec [--draft out/draft-smollm2-16l] [--model PATH] [-k 4]
        [--prompts 8] [--max-tokens 128] [--concurrency 1] [--fixed-k] [--repeat 2]

In one process and one run, the same held-out prompts (``HELD_OUT`` in
``tools.distill.chat_prompts``, never seen by ``meshserve distill``) go through the engine
three times, greedy: without speculation, with the draft model proposing ``k`` tokens (when
``--draft`` is given), and with prompt lookup (n-gram) proposing ``k``.
Prints one table: output tokens, seconds, tokens/s, target forward passes and output tokens
per target pass (the headline: what the client gets for each pass of the big model), draft
tokens verified and accepted, the acceptance rate, and the mean tokens emitted per verifying
target step (1 + accepted drafts, less what a stop token or max_tokens cut, per sequence).
Greedy outputs of every run are checked against the run without speculation. Each
configuration runs ``--repeat`` times in turn and the best time is kept. fp32 on CPU (CUDA
when ``--device cuda``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.tokenizer import Tokenizer
from gpu.engine import Engine, EngineConfig
from gpu.gguf import resolve_model_path
from gpu.loader import load_model
from gpu.proposers import DraftModelProposer, NgramProposer
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from gpu.spec_decode import Proposer
from tools.distill.chat_prompts import held_out_prompts


@dataclass(frozen=True)
class RunResult:
    name: str
    outputs: list[list[int]]
    seconds: float
    forward_passes: int
    draft_passes: int
    drafted: int
    accepted: int
    spec_steps: int
    emitted: int
    accepted_at: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def acceptance(self) -> str:
        return f"{self.accepted / self.drafted:.3f}" if self.drafted else "-"

    @property
    def mean_accepted_length(self) -> str:
        return f"{self.emitted / self.spec_steps:.3f}" if self.spec_steps else "1.000"


def run(
    name: str,
    runner: ModelRunner,
    eos: list[int],
    prompts: list[list[int]],
    args: argparse.Namespace,
    proposer: Proposer | None = None,
) -> RunResult:
    k = args.k if proposer is not None else 0
    config = EngineConfig(
        max_num_batched_tokens=2048,
        max_num_seqs=max(1, args.concurrency),
        num_speculative_tokens=k,
        adaptive_speculation=not args.fixed_k,
    )
    engine = Engine(runner, config, eos, proposer)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    drafts_before = getattr(proposer, "num_forward_passes", 0)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), args.concurrency):
        outputs += engine.generate(prompts[i : i + args.concurrency], params)
    seconds = time.perf_counter() - start
    s = engine.spec
    return RunResult(
        name,
        outputs,
        seconds,
        engine.num_forward_passes,
        getattr(proposer, "num_forward_passes", 0) - drafts_before,
        s.num_draft_tokens,
        s.num_accepted_tokens,
        s.num_spec_steps,
        s.num_emitted_tokens,
        list(s.accepted_at),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.spec", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default=None, help="target: HF folder or .gguf (SmolLM2)")
    parser.add_argument("--draft", type=Path, default=None, help="draft model folder")
    parser.add_argument("-k", type=int, default=4, help="draft tokens per step (max)")
    parser.add_argument("--fixed-k", action="store_true", help="do not adapt k per sequence")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts (<= 16)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=1, help="requests decoded together")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-ngram", action="store_true", help="skip the prompt-lookup run")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each, best time kept")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    folder = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    prompts = [tokenizer.encode_user_turn(q) for q in held_out_prompts(args.prompts)]
    eos = list(tokenizer.eos_token_ids)
    pages = 4096
    target = ModelRunner(load_model(folder, device=device, progress=False), pages, 16)
    runs: list[tuple[str, Proposer | None]] = [("no speculation", None)]
    draft_name = "none"
    if args.draft is not None:
        draft_model = load_model(args.draft, device=device, progress=False)
        draft_runner = ModelRunner(draft_model, pages, 16)
        if draft_runner.config.vocab_size != target.config.vocab_size:
            raise SystemExit("the draft's vocabulary differs from the target's")
        generator = torch.Generator(device).manual_seed(0)
        draft = DraftModelProposer(draft_runner, generator=generator)
        runs.append((f"draft model, k={args.k}", draft))
        draft_name = f"{args.draft.name} ({draft_runner.config.num_hidden_layers} layers)"
    if not args.no_ngram:
        runs.append((f"n-gram, k={args.k}", NgramProposer()))
    warm = argparse.Namespace(**{**vars(args), "max_tokens": 16})
    for _, proposer in runs:  # first calls of new shapes are slow (allocator, kernels)
        run("warm-up", target, eos, prompts[:1], warm, proposer)
    # Round-robin repeats, best time of each: a shared machine's load shifts over minutes,
    # and taking runs in turn spreads that over all of them. Counters do not change.
    repeats: dict[str, list[RunResult]] = {name: [] for name, _ in runs}
    for _ in range(args.repeat):
        for name, proposer in runs:
            repeats[name].append(run(name, target, eos, prompts, args, proposer))
    results = [min(rs, key=lambda r: r.seconds) for rs in repeats.values()]
    base = results[0]
    out = sys.stdout
    out.write(
        f"\ntarget {folder.name} ({target.config.num_hidden_layers} layers), draft "
        f"{draft_name}, {device.type} "
        f"fp32, {torch.get_num_threads()} threads, {len(prompts)} held-out chat prompts, "
        f"greedy, max {args.max_tokens} tokens, concurrency {args.concurrency}, "
        f"{'fixed' if args.fixed_k else 'adaptive'} k, best of {args.repeat} runs\n\n"
    )
    out.write(
        "| run | output tokens | seconds | tokens/s | speed-up | target passes "
        "| tokens/target pass | draft passes | drafted | accepted | acceptance "
        "| tokens/verify step | same output |\n"
    )
    out.write("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    for r in results:
        out.write(
            f"| {r.name} | {r.output_tokens} | {r.seconds:.1f} | {r.tokens_per_s:.2f} | "
            f"{r.tokens_per_s / base.tokens_per_s:.2f}x | {r.forward_passes} | "
            f"{r.output_tokens / r.forward_passes:.3f} | {r.draft_passes} | {r.drafted} | "
            f"{r.accepted} | {r.acceptance} | {r.mean_accepted_length} | "
            f"{'yes' if r.outputs == base.outputs else 'NO'} |\n"
        )
    for r in results[1:]:
        if r.accepted_at:
            out.write(f"\n{r.name}: accepted at draft position 1..k: {r.accepted_at}\n")


if __name__ == "__main__":
    main()
