"""tools/bench/paced.py: the device time a paced executor's steps stand for."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tools.bench import paced


def fake_executor(calls: list[str]) -> Any:
    def execute(chunks: Any, new_tokens: Any, **kwargs: Any) -> str:
        calls.append("execute")
        return "logits"

    runner = SimpleNamespace(execute=execute)
    engine = SimpleNamespace(runner=runner)

    def step() -> Any:
        calls.append("step")
        return engine.runner.execute([], [[1] * 30, [7], [8, 9]], num_logits=None)

    engine.step = step
    return SimpleNamespace(engine=engine)


@pytest.mark.parametrize("per_token", [0.0, 0.001])
def test_a_step_sleeps_its_base_and_its_prompt_tokens(
    per_token: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr("tools.bench.paced.time.sleep", lambda s: calls.append(f"sleep {s:.3f}"))
    executor = fake_executor(calls)
    paced.slow_step(executor, 0.015, per_token)
    assert executor.engine.step() == "logits"
    # 30 + 2 tokens in prompt chunks; the one-token chunk is a decode and costs nothing more
    prompt_sleep = [f"sleep {32 * per_token:.3f}"] if per_token else []
    assert calls == ["sleep 0.015", "step", *prompt_sleep, "execute"]
