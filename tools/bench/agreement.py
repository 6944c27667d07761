"""How often a draft would be accepted, measured without speculating: teacher-forced.

    python -m tools.bench.agreement --draft DIR [--model PATH] [--prompts 16] [--max-tokens 128]

The target answers the held-out chat prompts greedily (the engine); then the target and the
draft (Hugging Face transformers, fp32) score each whole answer in one pass. Printed, over the
answer positions: how often the draft's top token is the target's (what greedy verification
accepts), and the mean of sum_i min(p_i, q_i) at temperatures 1 and 0.7 (the probability that
the rejection-sampling rule accepts a sampled draft token). With k draft tokens and a per-token
rate a, a verify step yields about 1 + a + a^2 + ... + a^k tokens.
"""

from __future__ import annotations

import argparse

import torch

from common.tokenizer import Tokenizer
from gpu.engine import Engine, EngineConfig
from gpu.gguf import resolve_model_path
from gpu.gguf.blocks import require_whole_folder
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from tools.distill.chat_prompts import held_out_prompts

TEMPERATURES = (1.0, 0.7)


def answers(
    target: str, prompts: list[list[int]], max_tokens: int, eos: list[int]
) -> list[list[int]]:
    runner = ModelRunner(load_model(target, progress=False), num_pages=1024, page_size=16)
    engine = Engine(runner, EngineConfig(4096, len(prompts)), eos)
    return engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))


def agreement(
    target: object, draft: object, prompts: list[list[int]], outs: list[list[int]]
) -> dict[str, float]:
    """Greedy agreement and the sampled acceptance rates over every answer position."""
    totals = {"greedy": 0.0, **{f"T={t}": 0.0 for t in TEMPERATURES}}
    positions = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt + out])
        rows = slice(len(prompt) - 1, len(prompt) + len(out) - 1)  # row i predicts out[i]
        with torch.no_grad():
            p_logits = target(ids).logits[0, rows].float()  # type: ignore[operator]
            q_logits = draft(ids).logits[0, rows].float()  # type: ignore[operator]
        totals["greedy"] += float((p_logits.argmax(-1) == q_logits.argmax(-1)).sum())
        for t in TEMPERATURES:
            p, q = torch.softmax(p_logits / t, -1), torch.softmax(q_logits / t, -1)
            totals[f"T={t}"] += float(torch.minimum(p, q).sum())
        positions += len(out)
    return {name: total / positions for name, total in totals.items()} | {"positions": positions}


def main(argv: list[str] | None = None) -> None:
    # transformers takes seconds to import: only this command needs it, not a test of the
    # functions above.
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.agreement", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default=None, help="target: HF folder or .gguf (SmolLM2)")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts (<= 16)")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    folder = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    prompts = [tokenizer.encode_user_turn(text) for text in held_out_prompts(args.prompts)]
    outs = answers(str(folder), prompts, args.max_tokens, list(tokenizer.eos_token_ids))
    require_whole_folder(folder, "the agreement benchmark")
    load = AutoModelForCausalLM.from_pretrained
    target = load(folder, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    draft = load(args.draft, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    result = agreement(target, draft, prompts, outs)
    print(
        f"\ndraft {args.draft}, {len(prompts)} held-out prompts, {result['positions']:.0f} "
        "answer positions (the target's greedy answers)\n"
    )
    print("| draft's top token = target's | accepted, T=1 | accepted, T=0.7 |")
    print("|---|---|---|")
    print(f"| {result['greedy']:.3f} | {result['T=1.0']:.3f} | {result['T=0.7']:.3f} |")


if __name__ == "__main__":
    main()
