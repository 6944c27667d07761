"""A fixed device time for an executor's steps (the tests' harness and the regions bench): on
these CPUs the tiny model's own step is a fraction of a millisecond, so a sleep stands for a
device step, and an executor's capacity is known whatever the machine's load. Light on
imports: a benchmark's executor process loads this before its engine."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.executor.service import ExecutorService


def slow_step(executor: ExecutorService, step_s: float, prefill_s_per_token: float = 0.0) -> None:
    """``executor``'s engine steps take ``step_s`` longer, and ``prefill_s_per_token`` more
    for each prompt token a step computes: a device's decode step costs about the same at any
    small batch, its prefill grows with the prompt (a chunk of more than one token is a prompt
    chunk; a preempted sequence's recompute pays it again, as on a device; with speculative
    decoding a verify chunk would count as one too, so the benches that pace prefill run
    without it)."""
    engine = executor.engine
    step = engine.step

    def slow() -> Any:
        time.sleep(step_s)
        return step()

    engine.step = slow  # type: ignore[method-assign]
    if not prefill_s_per_token:
        return
    execute = engine.runner.execute

    def paced_execute(chunks: Any, new_tokens: Any, *args: Any, **kwargs: Any) -> Any:
        prompt_tokens = sum(len(t) for t in new_tokens if len(t) > 1)
        time.sleep(prompt_tokens * prefill_s_per_token)
        return execute(chunks, new_tokens, *args, **kwargs)

    engine.runner.execute = paced_execute  # type: ignore[method-assign]
