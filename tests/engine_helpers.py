"""Helpers of the engine tests that run prompts on the tiny Llama: a small engine, and
random prompts in its vocabulary."""

from __future__ import annotations

import random

from gpu.engine import Engine, EngineConfig
from gpu.model import CausalLM
from gpu.runner import ModelRunner


def engine_for(
    model: CausalLM, budget: int = 16, num_pages: int = 256, overlap: bool = False
) -> Engine:
    """8 sequences at most, ``budget`` tokens a step, pages of 4 tokens, EOS 2."""
    config = EngineConfig(budget, 8, overlap_steps=overlap)
    return Engine(ModelRunner(model, num_pages, 4), config, eos_token_ids=[2])


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]
