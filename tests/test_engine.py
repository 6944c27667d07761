"""The continuous-batching engine against transformers' greedy output, under churn."""

from __future__ import annotations

import dataclasses
import random
from typing import TypedDict

import pytest
import torch

from gpu.config import ModelError
from gpu.engine import Engine, EngineConfig
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling import Sampler, SamplerInput
from gpu.sampling_params import SamplingParams
from gpu.sequence import FinishReason
from gpu.spec_decode import Proposal, verify
from tests.models import hf_model


def hf_greedy(oracle, prompt: list[int], n: int) -> list[int]:
    oracle.generation_config.eos_token_id = None
    with torch.no_grad():
        out = oracle.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


def make_engine(folder, num_pages=256, page_size=4, budget=64, max_seqs=16, caching=True):
    runner = ModelRunner(load_model(folder, progress=False), num_pages, page_size)
    return Engine(runner, EngineConfig(budget, max_seqs, caching), eos_token_ids=[2])


class Greedy(TypedDict):
    """The sampling fields every greedy request here shares (``SamplingParams(**GREEDY)``)."""

    temperature: float
    ignore_eos: bool


GREEDY: Greedy = {"temperature": 0.0, "ignore_eos": True}


def prompts_for(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def oracle(tiny_llama):
    return hf_model(tiny_llama)


def run_until_done(engine: Engine, outputs: dict[str, list[int]], on_step=None) -> None:
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if on_step:
            on_step(step)
        step += 1
        assert step < 5000


def test_greedy_matches_transformers_under_churn(tiny_llama, oracle):
    """Requests join mid-flight, finish at different lengths, one is aborted, and the pool is
    small enough that sequences are preempted and recomputed; every survivor equals HF."""
    engine = make_engine(tiny_llama, num_pages=24, page_size=4, budget=16, max_seqs=8)
    prompts = prompts_for(1, [5, 17, 3, 26, 9, 12, 30, 1])
    max_tokens = [12, 20, 7, 15, 25, 10, 18, 14]
    outputs: dict[str, list[int]] = {}
    for i in range(3):
        engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=max_tokens[i], **GREEDY))

    preempted = set()

    def churn(step: int) -> None:
        for seq in engine.scheduler.waiting:
            if seq.num_preemptions:
                preempted.add(seq.request_id)
        if 3 <= step < 3 + 5:  # the rest join one per step
            i = step
            engine.add_request(
                str(i), prompts[i], SamplingParams(max_tokens=max_tokens[i], **GREEDY)
            )
        if step == 6:
            assert engine.abort("4")
        engine.pages.check_invariants([s.table for s in engine.seqs.values()])

    run_until_done(engine, outputs, churn)
    assert preempted, "the pool was meant to force preemption"
    for i, prompt in enumerate(prompts):
        if i == 4:
            continue
        assert len(outputs[str(i)]) == max_tokens[i]
        assert outputs[str(i)] == hf_greedy(oracle, prompt, max_tokens[i]), f"request {i}"
    assert engine.pages.num_free == engine.pages.num_pages


def test_prefix_hits_and_tiny_budget(tiny_llama, oracle):
    """Shared prefixes are served from cache (and reported), and a 3-token budget chunks every
    prompt, without changing a single output token."""
    engine = make_engine(tiny_llama, num_pages=128, page_size=4, budget=3)
    system = prompts_for(2, [21])[0]
    tails = prompts_for(3, [2, 7, 4])
    first = system + tails[0]
    out = engine.generate([first], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert out == hf_greedy(oracle, first, 6)
    hits_before = engine.pages.hits
    prompts = [system + t for t in tails[1:]]
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=8, **GREEDY))
    engine.add_request("b", prompts[1], SamplingParams(max_tokens=8, **GREEDY))
    outputs: dict[str, list[int]] = {}
    cached = {}
    while engine.has_unfinished():
        for o in engine.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            cached[o.request_id] = o.cached_tokens
    assert cached == {"a": 20, "b": 20}  # 5 full pages of the 21-token system prompt
    assert engine.pages.hits - hits_before == 40
    assert outputs["a"] == hf_greedy(oracle, prompts[0], 8)
    assert outputs["b"] == hf_greedy(oracle, prompts[1], 8)


def test_whole_prompt_cached_still_computes_last_token(tiny_llama, oracle):
    engine = make_engine(tiny_llama, page_size=4)
    prompt = prompts_for(4, [16])[0]
    a = engine.generate([prompt], SamplingParams(max_tokens=5, **GREEDY))[0]
    engine.add_request("again", prompt, SamplingParams(max_tokens=5, **GREEDY))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert outs[0].cached_tokens == 12  # 3 of 4 pages: the last token is always recomputed
    assert [o.new_token_ids[0] for o in outs] == a == hf_greedy(oracle, prompt, 5)


def test_finish_reasons(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = prompts_for(5, [6])[0]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0]
    stop_at = greedy[3]
    engine.add_request(
        "s", prompt, SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(stop_at,))
    )
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert outs[-1].finish_reason is FinishReason.STOP
    assert [o.new_token_ids[0] for o in outs] == greedy[: greedy.index(stop_at) + 1]
    # the stop token is marked (its text is not the completion's); only it
    assert [o.stop_token for o in outs] == [False] * (len(outs) - 1) + [True]
    # context length: the tiny model holds 256 positions
    engine.add_request("long", [5] * 250, SamplingParams(max_tokens=100, **GREEDY))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert outs[-1].finish_reason is FinishReason.LENGTH and len(outs) == 6
    assert not any(o.stop_token for o in outs)


def test_min_tokens_keeps_a_stop_token_from_ending_it_early(tiny_llama):
    """A stop token the greedy run would emit as its second token: with min_tokens 4 it is
    never sampled among the first 4 (the next-best token takes its place), and the run may
    stop on it after."""
    engine = make_engine(tiny_llama)
    prompt = prompts_for(5, [6])[0]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    stop_at = greedy[1]
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop_at,))
    early = engine.generate([prompt], params)[0]
    assert early == greedy[: greedy.index(stop_at) + 1] and len(early) <= 2
    late = engine.generate([prompt], dataclasses.replace(params, min_tokens=4))[0]
    assert stop_at not in late[:4] and len(late) >= 4
    assert late[-1] == stop_at or len(late) == 8
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_bad_requests_are_rejected_clearly(tiny_llama):
    engine = make_engine(tiny_llama)
    with pytest.raises(ModelError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ModelError, match="context length"):
        engine.add_request("l", [5] * 300, SamplingParams())
    with pytest.raises(ModelError, match="out of range"):
        engine.add_request("r", [5, 100000], SamplingParams())
    engine.add_request("ok", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [5, 6], SamplingParams())
    assert not engine.abort("nope")
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert len(outs) == 2


def test_a_request_its_own_settings_leave_no_token_is_refused_or_ends(tiny_llama):
    """allowed_token_ids that min_tokens' stop ban or one-token bad words take away entirely
    are a clear error; a row left no token mid-run (a bad word's prefix completed) ends with
    its EOS, greedy or sampled with speculation's multinomial, never an error in the step."""
    engine = make_engine(tiny_llama)
    for params in (
        SamplingParams(allowed_token_ids=(2,), min_tokens=2, max_tokens=4),  # 2: the EOS
        SamplingParams(allowed_token_ids=(5, 6), bad_words_token_ids=((5,), (6,))),
    ):
        with pytest.raises(ValueError, match="every allowed token is banned"):
            engine.add_request("none", [5, 6], params)
    # After 7 the only allowed token, 7, completes the bad word "7 7": nothing is left.
    for temperature, ignore_eos in ((0.0, False), (0.8, False), (0.0, True)):
        params = SamplingParams(
            temperature=temperature,
            allowed_token_ids=(7,),
            bad_words_token_ids=((7, 7),),
            ignore_eos=ignore_eos,  # (the EOS is no stop token then: the fallback still ends it)
        )
        assert engine.generate([[5, 6]], dataclasses.replace(params, max_tokens=5))[0] == [7, 2]
    params = dataclasses.replace(params, temperature=0.8)
    inp = SamplerInput([params], [[5, 6]], [[7]], [None], eos_token_ids=(2,))
    processed, probs = Sampler().distributions(torch.zeros(1, 50), inp)
    assert processed[0].argmax() == 2 and probs is not None and probs[0, 2] == 1.0
    # Speculative verification of a draft [7] after [7]: both positions are left nothing.
    result = verify(Sampler(), torch.zeros(2, 50), [Proposal([7], [[7]], [[1.0]])], inp)
    assert result.token_ids == [[2]]


def test_seeded_sampling_is_batch_invariant(tiny_llama):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = prompts_for(6, [9])[0]
    alone = make_engine(tiny_llama).generate([prompt], params)[0]
    others = prompts_for(7, [4, 15, 30])
    crowd = make_engine(tiny_llama).generate(
        [*others, prompt], [SamplingParams(temperature=0.8, max_tokens=12)] * 3 + [params]
    )
    assert crowd[3] == alone


def test_thousand_random_requests_leave_every_page_free(tiny_llama):
    """Random arrivals, lengths, aborts and a small pool: the invariants hold at every step and
    every page is free at the end (cached pages are evictable, none referenced)."""
    rng = random.Random(0)
    engine = make_engine(tiny_llama, num_pages=48, page_size=4, budget=48, max_seqs=12)
    shared = prompts_for(8, [12, 9])
    submitted = 0
    live: list[str] = []
    steps = 0
    while submitted < 1000 or engine.has_unfinished():
        for _ in range(rng.randrange(0, 4)):
            if submitted >= 1000:
                break
            prefix = rng.choice(shared) if rng.random() < 0.5 else []
            prompt = prefix + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 12))]
            params = SamplingParams(
                max_tokens=rng.randrange(1, 8),
                temperature=rng.choice([0.0, 1.0]),
                ignore_eos=True,
            )
            rid = f"r{submitted}"
            engine.add_request(rid, prompt, params)
            live.append(rid)
            submitted += 1
        if live and rng.random() < 0.15:
            engine.abort(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finish_reason is not None and out.request_id in live:
                live.remove(out.request_id)
        engine.pages.check_invariants([s.table for s in engine.seqs.values()])
        steps += 1
    assert engine.pages.num_free == engine.pages.num_pages
    assert all(c == 0 for c in engine.pages.ref_counts)
    assert engine.pages.hits > 0
    engine.pages.reset_prefix_cache()
    assert len(engine.pages.free_pages) == engine.pages.num_pages


def test_a_guest_preempted_for_an_own_request_still_matches_transformers(tiny_llama, oracle):
    """One slot: the guest has streamed tokens when an own request arrives; the own request
    runs in the very next step, the guest is recomputed after it and ends as HF's."""
    engine = make_engine(tiny_llama, max_seqs=1)
    guest_prompt, own_prompt = prompts_for(7, [9, 6])
    engine.add_request("guest", guest_prompt, SamplingParams(max_tokens=10, **GREEDY), guest=True)
    outputs: dict[str, list[int]] = {}
    for _ in range(4):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.add_request("own", own_prompt, SamplingParams(max_tokens=5, **GREEDY))
    first = engine.step()
    assert [out.request_id for out in first] == ["own"]
    assert engine.seqs["guest"].num_preemptions == 1
    for out in first:
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    run_until_done(engine, outputs)
    assert outputs["own"] == hf_greedy(oracle, own_prompt, 5)
    assert outputs["guest"] == hf_greedy(oracle, guest_prompt, 10)
    assert engine.pages.num_free == engine.pages.num_pages
