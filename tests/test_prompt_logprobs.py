"""vLLM's prompt_logprobs in the engine (``gpu/prompt_logprobs.py``): each prompt token's
logprob, rank and top-N against transformers, through chunked prefill, a prefix the cache
holds, a batch shared with decoding sequences, preemption midway and the overlapped loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu.engine import Engine
from gpu.loader import load_model
from gpu.model import CausalLM
from gpu.prompt_logprobs import PromptLogprobs, PromptScoring
from gpu.sampling_params import SamplingParams
from gpu.scheduler import Scheduler
from gpu.sequence import Sequence
from tests.engine_helpers import engine_for, prompt
from tests.engine_helpers import run as run_requests
from tests.models import hf_model

TOP = 3


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> CausalLM:
    return load_model(tiny_llama, progress=False)


@pytest.fixture(scope="module")
def oracle(tiny_llama: Path):
    return hf_model(tiny_llama)


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    return run_requests(engine, requests, "prompt_logprobs")


def assert_matches_transformers(got: PromptLogprobs | None, ids: list[int], oracle) -> None:
    assert got is not None and got.token_ids == ids
    with torch.no_grad():
        lsm = torch.log_softmax(oracle(torch.tensor([ids])).logits[0].float(), -1)
    assert len(got.logprobs) == len(got.ranks) == len(got.top) == len(ids) - 1
    for p in range(len(ids) - 1):
        want = lsm[p, ids[p + 1]].item()
        assert got.logprobs[p] == pytest.approx(want, abs=2e-4), p
        # (a random model's distribution is flat: neighbours lie within rounding)
        above = [int((lsm[p] > want + tol).sum()) + 1 for tol in (2e-4, -2e-4)]
        assert above[0] <= got.ranks[p] <= above[1], p
        top = lsm[p].topk(TOP)
        assert [v for _, v in got.top[p]] == pytest.approx(top.values.tolist(), abs=2e-4), p
        for t, v in got.top[p]:
            assert lsm[p, t].item() == pytest.approx(v, abs=2e-4), p


def test_prompt_logprobs_match_transformers_through_chunks_and_a_cached_prefix(
    model: CausalLM, oracle
) -> None:
    """A 45-token prompt in 16-token chunks, its prefix cached by an earlier request (not used:
    a cached position has no logits), beside a sequence that only decodes; the decoding one's
    tokens are those it has alone, and the first token after the prompt is the same with and
    without scoring."""
    engine = engine_for(model)
    ids = prompt(1, 45)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=TOP)
    alone = run(engine, {"warm": (ids, greedy), "other": (prompt(2, 9), greedy)})
    both = run(engine, {"scored": (ids, scored), "other2": (prompt(2, 9), greedy)})
    first = both["first"]["scored"]
    assert first.cached_tokens == 0 and alone["first"]["warm"].prompt_logprobs is None
    assert_matches_transformers(first.prompt_logprobs, ids, oracle)
    assert both["tokens"]["scored"] == alone["tokens"]["warm"]
    assert both["tokens"]["other2"] == alone["tokens"]["other"]
    assert engine.pages.num_free == engine.pages.num_pages and not engine.seqs


def test_overlapped_steps_and_no_top(model: CausalLM, oracle) -> None:
    """The overlapped loop gives the same, and prompt_logprobs 0 the token's own alone."""
    ids = prompt(3, 30)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)
    plain = run(engine_for(model), {"a": (ids, params), "b": (prompt(4, 20), params)})
    over = run(engine_for(model, overlap=True), {"a": (ids, params), "b": (prompt(4, 20), params)})
    assert over["tokens"] == plain["tokens"]
    for rid, want_ids in (("a", ids), ("b", prompt(4, 20))):
        assert_matches_transformers(over["first"][rid].prompt_logprobs, want_ids, oracle)
    bare = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    got = run(engine_for(model), {"c": (ids, bare)})["first"]["c"].prompt_logprobs
    assert got is not None and got.top == [[]] * 29
    assert got.logprobs == pytest.approx(plain["first"]["a"].prompt_logprobs.logprobs, abs=1e-5)


def test_a_sequence_preempted_midway_scores_each_position_once(
    model: CausalLM, oracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool too small for two long prompts preempts one while it scores; recomputed from its
    first token, it scores the positions it had not and none twice."""
    engine = engine_for(model, budget=8, num_pages=14)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=TOP)
    a, b = prompt(5, 26), prompt(6, 26)
    midway: list[int] = []  # positions scored when a scoring sequence was preempted
    preempt = Scheduler._preempt

    def spy(self: Scheduler, seq: Sequence) -> None:
        if seq.prompt_scoring is not None:
            midway.append(seq.prompt_scoring.scored)
        preempt(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    result = run(engine, {"a": (a, params), "b": (b, params)})
    assert midway and all(0 < n < 25 for n in midway)
    assert_matches_transformers(result["first"]["a"].prompt_logprobs, a, oracle)
    assert_matches_transformers(result["first"]["b"].prompt_logprobs, b, oracle)


def test_the_scoring_sequences_of_a_step_share_its_scoring_rows(model: CausalLM) -> None:
    """Four scoring prompts and a budget of 1,000: a step computes at most 512 scoring
    positions in all (a logits row each), not 512 each; a plain prompt beside them is not held
    to that, and whatever waits behind the scoring rows waits its turn."""
    engine = engine_for(model, budget=1000, num_pages=1024)
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    engine.add_request("plain", prompt(20, 250), SamplingParams(temperature=0.0, max_tokens=1))
    for i in range(4):
        engine.add_request(f"s{i}", prompt(10 + i, 200), scored)
    plan = engine.scheduler.schedule()
    assert [(item.seq.request_id, item.num_new) for item in plan.scheduled] == [
        ("plain", 250),
        ("s0", 200),
        ("s1", 200),
        ("s2", 112),
    ]
    while engine.has_unfinished():  # and every prompt is scored whole
        for out in engine.step():
            if out.request_id != "plain":
                assert out.prompt_logprobs is not None and len(out.prompt_logprobs.ranks) == 199


def test_rows_and_positions_of_each_chunk() -> None:
    """Each chunk asks for one row per position not yet scored (one at least), and a chunk
    recomputed after a preemption scores nothing again; position p's row scores token p + 1,
    the prompt's last position samples."""
    ids = list(range(10, 30))  # 20 tokens; logits row for position p is one-hot at p + 11
    scoring = PromptScoring(num_top=1)

    def chunk(start: int, n: int) -> int:
        rows = scoring.rows(start, n, len(ids))
        logits = torch.full((rows, 40), -10.0)
        for r in range(rows):
            logits[r, start + n - rows + r + 11] = 10.0  # its position's next prompt token
        scoring.queue(logits, 0, start, n, ids)
        return rows

    assert [chunk(0, 8), chunk(8, 8)] == [8, 8]
    assert [chunk(0, 8), chunk(8, 4), chunk(12, 6)] == [1, 1, 2]  # recomputed, then 16, 17
    assert chunk(18, 2) == 2  # positions 18 (scores token 19) and 19 (samples)
    assert scoring.rows(20, 1, len(ids)) == 1  # decoding
    result = scoring.result(ids)
    assert len(result.logprobs) == 19 and result.ranks == [1] * 19
    assert [top[0][0] for top in result.top] == ids[1:]
