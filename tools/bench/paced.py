"""A fixed device time for an executor's steps (the tests' harness and the regions bench): on
these CPUs the tiny model's own step is a fraction of a millisecond, so a sleep stands for a
device step, and an executor's capacity is known whatever the machine's load. Light on
imports: a benchmark's executor process loads this before its engine."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.executor.service import ExecutorService


def slow_step(executor: ExecutorService, step_s: float) -> None:
    """``executor``'s engine steps take ``step_s`` longer."""
    step = executor.engine.step

    def slow() -> Any:
        time.sleep(step_s)
        return step()

    executor.engine.step = slow  # type: ignore[method-assign]
