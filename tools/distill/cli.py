"""``meshserve distill``: build a draft model for speculative decoding (the recipe:
``tools.distill.recipe``)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def add_distill(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "distill",
        help="distil a small draft model from a target (resumable)",
        description="Distil a draft: the teacher's layers as the start, its own output "
        "distributions over its own answers as the target. Rerun the same command to resume.",
    )
    p.add_argument("--teacher", default=None, help="HF folder or .gguf (default: SmolLM2)")
    p.add_argument("--out", required=True, type=Path, help="folder to write the draft to")
    p.add_argument("--layers", type=int, default=8, help="student layers")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="answers per step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--prompts", type=int, default=128, help="distillation prompts")
    p.add_argument(
        "--self-prompts",
        type=int,
        default=0,
        help="questions the teacher writes itself, answered after the fixed prompts",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="teacher answer length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.set_defaults(func=run_distill)


def run_distill(args: argparse.Namespace) -> int:
    # Imported here: the ``meshserve`` command builds this subcommand's parser in every run
    # (``meshserve up`` too), and only a distillation needs torch.
    import torch

    from gpu.gguf import resolve_model_path
    from tools.distill.recipe import DistillConfig, distill

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = DistillConfig(
        teacher=resolve_model_path(args.teacher),
        out=args.out,
        layers=args.layers,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        checkpoint_every=args.checkpoint_every,
        num_prompts=args.prompts,
        self_prompts=args.self_prompts,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    logging.getLogger("meshserve.distill").info("distill config: %s", config)
    out = distill(config)
    sys.stderr.write(f"draft model written to {out}\n")
    return 0
