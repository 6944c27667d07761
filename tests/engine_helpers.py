"""Helpers of the engine tests that run prompts on the tiny Llama: a small engine, and
random prompts in its vocabulary."""

from __future__ import annotations

import random
from typing import Any

from gpu.engine import Engine, EngineConfig, StepOutput
from gpu.model import CausalLM
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams


def engine_for(
    model: CausalLM, budget: int = 16, num_pages: int = 256, overlap: bool = False
) -> Engine:
    """8 sequences at most, ``budget`` tokens a step, pages of 4 tokens, EOS 2."""
    config = EngineConfig(budget, 8, overlap_steps=overlap)
    return Engine(ModelRunner(model, num_pages, 4), config, eos_token_ids=[2])


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def run(
    engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], first_only: str
) -> dict[str, Any]:
    """Run ``requests`` to the end: each one's first output (``first``) and tokens
    (``tokens``); the output field ``first_only`` (prompt logprobs, an embedding) comes with
    the first token alone."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    firsts: dict[str, StepOutput] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            firsts.setdefault(out.request_id, out)
            if out is not firsts[out.request_id]:
                assert getattr(out, first_only) is None  # only with the first token
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return {"first": firsts, "tokens": tokens}
