"""The overlapped step loop (``gpu/overlap.py``): the same tokens as one step after another.

On the CPU nothing runs ahead (torch executes each op as it is issued), so these check the
bookkeeping: tokens in flight fed to the next step from the sampled tensor, stop tokens and
limits ending sequences exactly where a plain loop ends them (the wasted row of a stopped
sequence dropped), aborts while a token is in flight, preemption, chunked prefill, the prefix
cache, seeded sampling with penalties and logprobs, grammars; and that every page comes back.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu.attention.metadata import SeqChunk
from gpu.config import ModelError
from gpu.engine import Engine, EngineConfig, StepOutput
from gpu.loader import load_model
from gpu.model import CausalLM
from gpu.runner import ModelRunner, TokenFeed
from gpu.sampling_params import SamplingParams
from gpu.sequence import INFLIGHT_TOKEN

EOS = 2


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> CausalLM:
    return load_model(tiny_llama, progress=False)


def engine_for(
    model: CausalLM, overlap: bool, num_pages: int = 256, budget: int = 64, **config: object
) -> Engine:
    runner = ModelRunner(model, num_pages, 4)
    cfg = EngineConfig(budget, 8, overlap_steps=overlap, **config)  # type: ignore[arg-type]
    return Engine(runner, cfg, eos_token_ids=[EOS])


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


Result = dict[str, dict[str, Any]]
Requests = dict[str, tuple[list[int], SamplingParams]]


def fresh(rids: Iterable[str]) -> Result:
    return {rid: {"tokens": [], "logprobs": [], "finish": None} for rid in rids}


def run(engine: Engine, requests: Requests) -> Result:
    """Every request to the end: its tokens, logprobs and finish reason."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    result = fresh(requests)
    while engine.has_unfinished():
        record(engine.step(), result)
    return result


def record(outputs: list[StepOutput], result: Result) -> None:
    for out in outputs:
        r = result[out.request_id]
        assert r["finish"] is None, f"{out.request_id} emitted after it finished"
        r["tokens"] += out.new_token_ids
        r["logprobs"] += [(lp.token_id, round(lp.logprob, 4)) for lp in out.logprobs or []]
        r["finish"] = out.finish_reason


def both(model: CausalLM, requests: Requests, **kw: object) -> tuple[Result, Result, Engine]:
    plain = run(engine_for(model, False, **kw), requests)  # type: ignore[arg-type]
    engine = engine_for(model, True, **kw)  # type: ignore[arg-type]
    assert engine.overlap is not None
    return plain, run(engine, requests), engine


def test_greedy_and_chunked_prefill_give_the_plain_loops_tokens(model: CausalLM) -> None:
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)
    ps = prompts(0, [3, 40, 17, 90, 1])
    requests = {f"r{i}": (p, greedy) for i, p in enumerate(ps)}
    requests["short"] = (ps[0], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1))
    plain, overlapped, engine = both(model, requests, budget=32)  # 90 tokens: 3 chunks
    assert overlapped == plain
    assert all(r["finish"] == "length" for r in plain.values())
    assert engine.pages.num_free == engine.pages.num_pages and not engine.seqs
    assert engine.overlap is not None and engine.overlap.inflight is None


def test_seeded_sampling_penalties_and_logprobs_match(model: CausalLM) -> None:
    ps = prompts(1, [12, 30, 5])
    kinds = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, logprobs=3),
        SamplingParams(temperature=1.0, seed=5, repetition_penalty=1.3, frequency_penalty=0.5,
                       presence_penalty=0.4, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, ignore_eos=True),
    ]  # fmt: skip
    requests = {f"r{i}": (p, k) for i, (p, k) in enumerate(zip(ps, kinds, strict=True))}
    plain, overlapped, _ = both(model, requests)
    assert overlapped == plain
    assert len(plain["r0"]["logprobs"]) == len(plain["r0"]["tokens"])


def test_a_stop_token_ends_where_the_plain_loop_ends_it(model: CausalLM) -> None:
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16)
    ps = prompts(2, [9, 21])
    free = run(engine_for(model, False), {"a": (ps[0], greedy), "b": (ps[1], greedy)})
    stop = free["a"]["tokens"][5]  # the 6th token a greedy run of "a" produces
    stopping = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16,
                              stop_token_ids=(stop,))  # fmt: skip
    requests = {"a": (ps[0], stopping), "b": (ps[1], greedy)}
    plain, overlapped, engine = both(model, requests)
    assert overlapped == plain
    end = free["a"]["tokens"].index(stop) + 1
    assert plain["a"] == {"tokens": free["a"]["tokens"][:end], "logprobs": [], "finish": "stop"}
    # the step after the stop ran a row for "a" in vain: it was dropped, its pages came back
    assert engine.overlap is not None and engine.overlap.dropped_rows == 1
    assert engine.pages.num_free == engine.pages.num_pages


def test_an_abort_while_a_token_is_in_flight_frees_it_and_emits_nothing(
    model: CausalLM,
) -> None:
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20)
    ps = prompts(3, [14, 6])
    engine = engine_for(model, True)
    for rid, p in zip("ab", ps, strict=True):
        engine.add_request(rid, p, greedy)
    result = fresh("ab")
    while len(result["a"]["tokens"]) < 3:
        record(engine.step(), result)
    assert engine.overlap is not None and engine.overlap.inflight is not None
    assert engine.abort("a")  # its 4th token is on the device
    while engine.has_unfinished():
        record(engine.step(), result)
    assert len(result["a"]["tokens"]) == 3 and result["a"]["finish"] is None
    assert len(result["b"]["tokens"]) == 20 and result["b"]["finish"] == "length"
    assert engine.pages.num_free == engine.pages.num_pages and not engine.seqs


def test_preemption_for_pages_gives_the_same_tokens(model: CausalLM) -> None:
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)
    requests = {f"r{i}": (p, greedy) for i, p in enumerate(prompts(4, [10, 12, 9, 11]))}
    plain, overlapped, engine = both(model, requests, num_pages=20)  # 4 tokens a page
    assert engine.scheduler.num_preempted_for_pages > 0
    assert overlapped == plain
    assert engine.pages.num_free == engine.pages.num_pages


def test_the_prefix_cache_serves_a_repeated_prompt(model: CausalLM) -> None:
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
    prompt = prompts(5, [33])[0]
    engine = engine_for(model, True)
    first = run(engine, {"a": (prompt, greedy)})
    again = run(engine, {"b": (prompt + first["a"]["tokens"], greedy)})
    assert engine.pages.hits > 0  # the prompt's full pages and the output's, committed
    plain = run(engine_for(model, False), {"b": (prompt + first["a"]["tokens"], greedy)})
    assert again == plain


def test_a_step_returns_the_tokens_of_the_step_before_it(model: CausalLM) -> None:
    engine = engine_for(model, True)
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2))
    assert engine.step() == []  # the prompt ran and its first token is on the device
    first = engine.step()  # the first token, while the second is computed
    assert [len(o.new_token_ids) for o in first] == [1] and first[0].finish_reason is None
    last = engine.step()
    assert len(last) == 1 and last[0].finish_reason == "length" and not engine.has_unfinished()


def test_speculative_decoding_keeps_the_plain_loop(
    model: CausalLM, caplog: pytest.LogCaptureFixture
) -> None:
    engine = engine_for(model, True, num_speculative_tokens=2)
    assert engine.overlap is None
    assert "speculative decoding" in caplog.text


def test_an_inflight_token_is_fed_from_the_device_tensor(model: CausalLM) -> None:
    runner = ModelRunner(model, 8, 4)
    prompt = [7, 8, 9, 10, 11]
    runner.execute([SeqChunk((0, 1), 0, 5)], [prompt])
    chunk = [SeqChunk((0, 1), 5, 1)]
    want = runner.execute(chunk, [[42]])
    sampled = torch.tensor([3, 42, 9])  # row 1 holds the token
    fed = runner.execute(chunk, [[INFLIGHT_TOKEN]], feed=TokenFeed(sampled, [0], [1]))
    torch.testing.assert_close(fed, want)
    with pytest.raises(ModelError, match="out of range"):  # in flight but not fed
        runner.execute(chunk, [[INFLIGHT_TOKEN]])
