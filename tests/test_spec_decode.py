"""Speculative decoding is lossless: greedy outputs are unchanged, sampled tokens keep the
target's distribution, an identical draft is always accepted, a bad one never changes a token."""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest
import torch
from scipy.stats import chisquare

from gpu.engine import Engine, EngineConfig, TokenLogprob
from gpu.loader import load_model
from gpu.proposers import DraftModelProposer, NgramProposer
from gpu.runner import ModelRunner
from gpu.sampling import Sampler, SamplerInput
from gpu.sampling_params import SamplingParams
from gpu.sequence import FinishReason
from gpu.spec_decode import DraftLength, DraftRequest, Proposal, verify
from tests.models import hf_model, write_tiny_model


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def bad_draft(tmp_path_factory):
    """Same shape and tokenizer as the tiny target, different random weights."""
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "bad", "llama", seed=1)


def make_engine(folder, proposer=None, k=0, num_pages=256, page_size=4, budget=64, max_seqs=16):
    runner = ModelRunner(load_model(folder, progress=False), num_pages, page_size)
    config = EngineConfig(budget, max_seqs, True, num_speculative_tokens=k)
    return Engine(runner, config, eos_token_ids=[2], proposer=proposer)


def draft_model(folder, num_pages=256, seed=0, top_n=32):
    runner = ModelRunner(load_model(folder, progress=False), num_pages, 4)
    return DraftModelProposer(runner, top_n=top_n, generator=torch.Generator().manual_seed(seed))


def prompts_for(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], join_at=None):
    """Step to completion, adding requests mid-flight, checking page bookkeeping each step."""
    join_at = join_at or {}
    outputs: dict[str, list[int]] = {}
    finish = {}
    pending = dict(requests)
    step = 0
    while pending or engine.has_unfinished():
        for rid in [r for r in pending if join_at.get(r, 0) <= step]:
            engine.add_request(rid, *pending.pop(rid))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
        engine.pages.check_invariants([s.table for s in engine.seqs.values()])
        step += 1
        assert step < 5000
    assert engine.pages.num_free == engine.pages.num_pages
    return outputs, finish


@pytest.mark.parametrize("proposer", ["identical", "bad", "ngram"])
def test_greedy_with_speculation_equals_without(tiny_llama, bad_draft, proposer):
    """Requests join mid-flight in a small pool (preemption) with a 16-token budget (drafts cut
    short); every output equals plain greedy decoding."""
    prompts = prompts_for(1, [5, 17, 3, 26, 9, 12, 30, 1])
    max_tokens = [12, 20, 7, 15, 25, 10, 18, 14]
    requests = {str(i): (p, greedy(m)) for i, (p, m) in enumerate(zip(prompts, max_tokens))}
    join_at = {str(i): max(0, i - 2) for i in range(len(prompts))}
    plain, _ = run(make_engine(tiny_llama, num_pages=40, budget=16, max_seqs=8), requests)
    prop = {
        "identical": lambda: draft_model(tiny_llama, num_pages=64),
        "bad": lambda: draft_model(bad_draft, num_pages=64),
        "ngram": lambda: NgramProposer(max_n=3, min_n=1),
    }[proposer]()
    engine = make_engine(tiny_llama, prop, k=4, num_pages=40, budget=16, max_seqs=8)
    spec, _ = run(engine, requests, join_at)
    assert spec == plain
    assert engine.spec.num_draft_tokens > 0
    if proposer == "bad":
        assert engine.spec.acceptance_rate < 0.5


def test_identical_draft_accepts_every_token(tiny_llama):
    engine = make_engine(tiny_llama, draft_model(tiny_llama), k=4)
    prompts = prompts_for(2, [6, 11, 20])
    outputs = engine.generate(prompts, greedy(21))
    stats = engine.spec
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    # 20 tokens after the first, 5 per step (4 drafts + the bonus): 4 steps per request
    assert stats.num_spec_steps == 3 * 4
    assert stats.mean_accepted_length == 5.0
    assert outputs == make_engine(tiny_llama).generate(prompts, greedy(21))


def test_greedy_speculation_matches_transformers(tiny_llama, bad_draft):
    oracle = hf_model(tiny_llama)
    oracle.generation_config.eos_token_id = None
    prompt = prompts_for(3, [13])[0]
    engine = make_engine(tiny_llama, draft_model(bad_draft), k=3)
    out = engine.generate([prompt], greedy(16))[0]
    with torch.no_grad():
        ref = oracle.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0
        )
    assert out == ref[0, len(prompt) :].tolist()


def test_stop_token_and_max_tokens_inside_an_accepted_draft(tiny_llama):
    prompt = prompts_for(4, [7])[0]
    plain = make_engine(tiny_llama).generate([prompt], greedy(12))[0]
    stop_at = plain[4]
    engine = make_engine(tiny_llama, draft_model(tiny_llama), k=4)
    requests = {
        "stop": (prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,))),
        "len": (prompt, greedy(7)),
    }
    outputs, finish = run(engine, requests)
    assert outputs["stop"] == plain[: plain.index(stop_at) + 1]
    assert finish["stop"] is FinishReason.STOP
    assert outputs["len"] == plain[:7] and finish["len"] is FinishReason.LENGTH
    assert engine.spec.num_accepted_tokens == engine.spec.num_draft_tokens


def test_tokens_cut_by_a_stop_inside_an_accepted_draft_are_not_counted_as_emitted(tiny_llama):
    """Tokens per verify step count what the client gets: with an identical draft (k=4) the
    first token is sampled plainly, then each verify step covers 5 positions; a stop token in
    the second one's window ends the request there and the rest of that window is cut."""
    prompt = prompts_for(4, [7])[0]
    plain = make_engine(tiny_llama).generate([prompt], greedy(12))[0]
    stop_at = next(t for i, t in enumerate(plain) if 6 <= i <= 9 and t not in plain[:i])
    engine = make_engine(tiny_llama, draft_model(tiny_llama), k=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,))
    out = engine.generate([prompt], params)[0]
    assert out == plain[: plain.index(stop_at) + 1]
    stats = engine.spec
    assert stats.num_spec_steps == 2 and stats.num_accepted_tokens == 8
    assert stats.num_emitted_tokens == len(out) - 1  # not 2 * (4 + 1)
    assert stats.mean_accepted_length == (len(out) - 1) / 2


def test_logprobs_with_speculation_equal_logprobs_without(tiny_llama):
    prompt = prompts_for(5, [9])[0]
    params = greedy(9, logprobs=3)

    def collect(engine):
        engine.add_request("r", prompt, params)
        entries: list[TokenLogprob] = []
        while engine.has_unfinished():
            for out in engine.step():
                entries.extend(out.logprobs or [])
        return entries

    plain = collect(make_engine(tiny_llama))
    spec = collect(make_engine(tiny_llama, draft_model(tiny_llama), k=4))
    assert [e.token_id for e in spec] == [e.token_id for e in plain]
    for a, b in zip(spec, plain):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def target_marginal(folder, prompt: list[int], temperature: float, top_k: int) -> torch.Tensor:
    """Exact distribution of the second output token: sum over t1 of p(t1) p(t2 | t1)."""
    oracle = hf_model(folder)

    def dist(logits: torch.Tensor) -> torch.Tensor:
        logits = logits / temperature
        cut = logits.topk(top_k, dim=-1).values[..., -1:]
        return torch.softmax(logits.masked_fill(logits < cut, -float("inf")), dim=-1)

    with torch.no_grad():
        p1 = dist(oracle(torch.tensor([prompt])).logits[0, -1])
        firsts = torch.nonzero(p1).flatten()
        batch = torch.tensor([[*prompt, int(t)] for t in firsts])
        p2 = dist(oracle(batch).logits[:, -1])
    return (p1[firsts].unsqueeze(1) * p2).sum(0)


def test_a_seeded_request_drafted_by_a_model_is_reproducible(tiny_llama):
    """Its drafts come from its own seed, not the proposer's shared generator (torch's global
    one in the speculator service): the same output twice, alone or among sampled
    neighbours. The target drafts for itself, so most drafts are accepted and decide tokens."""
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    noisy = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompt, *others = prompts_for(6, [9, 7, 8, 5])

    def engine() -> Engine:
        runner = ModelRunner(load_model(tiny_llama, progress=False), 256, 4)
        built: Engine = make_engine(tiny_llama, DraftModelProposer(runner), k=3)
        return built

    alone = engine().generate([prompt], params)[0]
    assert engine().generate([prompt], params)[0] == alone
    crowded = engine().generate([prompt, *others], [params, noisy, noisy, noisy])[0]
    assert crowded == alone


@pytest.mark.parametrize("draft", ["bad", "truncated"])
def test_sampled_tokens_follow_the_target_distribution(tiny_llama, bad_draft, draft):
    """Chi-squared at the second output position (the first one speculation decides): the
    draft is either a different model or the target itself truncated to its top 3 tokens
    (so both accepted and rejected drafts occur); half the requests carry their own seed."""
    torch.manual_seed(0)
    prompt = prompts_for(6, [6])[0]
    temperature, top_k, n = 0.9, 12, 1500
    proposer = (
        draft_model(bad_draft, num_pages=512)
        if draft == "bad"
        else draft_model(tiny_llama, num_pages=512, top_n=3)
    )
    engine = make_engine(tiny_llama, proposer, k=3, num_pages=512, budget=2048, max_seqs=256)
    params = [
        SamplingParams(
            temperature=temperature,
            top_k=top_k,
            max_tokens=3,  # the first token, then a draft of one and the bonus
            ignore_eos=True,
            seed=1000 + i if i % 2 else None,
        )
        for i in range(n)
    ]
    outputs = engine.generate([prompt] * n, params)
    rate = engine.spec.acceptance_rate
    assert (0.0 < rate < 0.9) if draft == "truncated" else rate < 0.9
    expected = target_marginal(tiny_llama, prompt, temperature, top_k) * n
    observed = torch.bincount(torch.tensor([o[1] for o in outputs]), minlength=expected.numel())
    assert observed[expected == 0].sum() == 0, "a token the target never samples was emitted"
    big = expected >= 5  # chi-squared needs expected counts >= 5: pool the rest
    obs = [*observed[big].tolist(), int(observed[~big].sum())]
    exp = [*expected[big].tolist(), float(expected[~big].sum())]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    # The marginal is fp32: rescale so both sums agree to scipy's tolerance (it checks them).
    exp = [e * sum(obs) / sum(exp) for e in exp]
    assert chisquare(obs, exp).pvalue > 1e-3


@pytest.mark.parametrize("sparse_q", [True, False])
def test_rejection_sampler_output_is_distributed_as_p(sparse_q):
    """The verification rule alone: drafts drawn from q (or one fixed token), outputs ~ p."""
    gen = torch.Generator().manual_seed(0)
    vocab, n = 8, 20000
    p = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.1, 0.05, 0.0])
    q = torch.tensor([0.05, 0.4, 0.05, 0.3, 0.0, 0.1, 0.0, 0.1])  # q puts mass where p has none
    xs = torch.multinomial(q, n, replacement=True, generator=gen).tolist() if sparse_q else [1] * n
    support = [i for i in range(vocab) if q[i] > 0]
    drafts = [
        Proposal([x], [support], [[float(q[i]) for i in support]]) if sparse_q else Proposal([x])
        for x in xs
    ]
    logits = torch.log(p).repeat(2 * n, 1)  # 2 rows per sequence: the draft and the bonus
    sampler = Sampler(torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0)
    inp = SamplerInput([params] * n, [[]] * n, [[]] * n, [None] * n)
    result = verify(sampler, logits, drafts, inp)
    firsts = torch.tensor([t[0] for t in result.token_ids])
    observed = torch.bincount(firsts, minlength=vocab)
    assert observed[7] == 0
    expected = (p[:7] * n).double()
    expected *= observed[:7].sum().item() / expected.sum().item()  # fp32 sums differ a hair
    assert chisquare(observed[:7].tolist(), expected.tolist()).pvalue > 1e-3
    accepted = sum(result.num_accepted) / n
    expected_acc = torch.minimum(p, q).sum() if sparse_q else p[1]
    assert accepted == pytest.approx(float(expected_acc), abs=0.02)


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    ngram = NgramProposer(max_n=3, min_n=1)
    assert ngram.lookup([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3], 3) == [5, 7, 1]
    assert ngram.lookup([5, 6, 7], 3) == []
    assert ngram.lookup([4, 4, 4, 4], 2) == [4]  # the match runs into the context's end
    req = DraftRequest("a", [1, 2, 3, 1, 2], 3, 2, SamplingParams())
    assert ngram.propose([req]) == {"a": Proposal([3, 1])}


def test_draft_length_adapts_down_and_pauses():
    length = DraftLength(max_k=4)
    assert length.next() == 4
    length.update(4, 1)
    assert length.next() == 3
    for _ in range(3):
        length.update(length.k, 0)
    assert length.k == 1
    length.update(1, 0)  # nothing accepted at k = 1: pause
    assert [length.next() for _ in range(DraftLength.PAUSE_STEPS)] == [0] * DraftLength.PAUSE_STEPS
    assert length.next() == 1
    length.update(1, 1)
    assert length.next() == 2


def test_draft_model_state_is_incremental_and_bounded(tiny_llama):
    """After the first call the draft computes only new tokens; a full pool evicts the least
    recently used sequence; release frees everything."""
    proposer = draft_model(tiny_llama, num_pages=24)
    params = greedy()
    calls = []
    real_execute = proposer.runner.execute

    def counting(chunks, tokens, **kw):
        calls.append(sum(len(t) for t in tokens))
        return real_execute(chunks, tokens, **kw)

    proposer.runner.execute = counting
    prompt = prompts_for(7, [30])[0]
    first = proposer.propose([DraftRequest("a", prompt, 30, 4, params)])["a"]
    assert calls == [30, 1, 1, 1]
    calls.clear()
    # all four accepted, then the bonus: the cache held three drafts, so two tokens are new
    tokens = [*prompt, *first.token_ids, 7]
    second = proposer.propose([DraftRequest("a", tokens, 30, 4, params)])["a"]
    assert calls == [2, 1, 1, 1]
    calls.clear()
    # one accepted, then a correction: the other cached drafts roll back, one token is new
    tokens = [*tokens, second.token_ids[0], (second.token_ids[1] + 1) % 512]
    proposer.propose([DraftRequest("a", tokens, 30, 4, params)])
    assert calls == [1, 1, 1, 1]
    # 24 pages of 4 tokens: a second long sequence evicts the idle first one
    proposer.propose([DraftRequest("b", prompts_for(8, [60])[0], 60, 4, params)])
    assert "a" not in proposer.states
    proposer.release(["b"])
    assert proposer.pages.num_free == proposer.pages.num_pages


class AlwaysDraft:
    """Drafts token 7 at every allowed position (mostly rejected: the pages are what counts)."""

    def propose(self, requests: list[DraftRequest]) -> dict[str, Proposal]:
        return {r.request_id: Proposal([7] * r.num_draft) for r in requests}

    def release(self, request_ids: Iterable[str]) -> None:
        pass


def test_a_draft_never_preempts_a_neighbour_mid_prompt(tiny_llama):
    """A decodes with drafts while B's prompt is computed in chunks behind it: drafts take
    only the pages B's next chunk leaves (they took them first, and B was preempted, its
    prompt computed again, twice in this run; the pool holds both without drafts)."""
    runner = ModelRunner(load_model(tiny_llama, progress=False), 12, 4)
    config = EngineConfig(8, 16, True, num_speculative_tokens=4, adaptive_speculation=False)
    engine = Engine(runner, config, eos_token_ids=[2], proposer=AlwaysDraft())
    engine.add_request("a", [11, 12, 13, 14, 15], greedy(20))
    engine.step()
    engine.add_request("b", list(range(100, 130)), greedy(2))
    drafted = 0
    while engine.has_unfinished():
        drafted += sum(r.num_draft for r in engine.draft_requests())
        engine.step()
    assert engine.scheduler.num_preempted_for_pages == 0
    assert drafted > 0  # drafts still ran where pages were left


def test_a_draft_never_takes_the_page_a_decoding_neighbour_needs(tiny_llama):
    """After both prefills one page is free and b, its page full, needs it for its decode;
    a, served first, drafted into it and b was preempted (each step while a drafted)."""
    runner = ModelRunner(load_model(tiny_llama, progress=False), 4, 4)
    config = EngineConfig(64, 4, True, num_speculative_tokens=3, adaptive_speculation=False)
    engine = Engine(runner, config, eos_token_ids=[2], proposer=AlwaysDraft())
    engine.add_request("a", [10, 11, 12, 13, 14], greedy(8))
    engine.add_request("b", [20, 21, 22, 23], greedy(8))
    engine.step()  # the prefills: a holds 2 pages (room for 8 tokens), b 1 page, full
    assert engine.pages.num_free == 1
    assert {r.request_id: r.num_draft for r in engine.draft_requests()} == {"a": 2, "b": 3}
    engine.step()
    assert engine.scheduler.num_preempted_for_pages == 0


def test_drafts_leave_the_batch_tokens_later_sequences_need(tiny_llama):
    """A budget of 4 tokens: a's 1 + 3 drafts took it all, every step, and b's prompt waited
    until a was done; drafts now get only what the running sequences leave."""
    runner = ModelRunner(load_model(tiny_llama, progress=False), 64, 4)
    config = EngineConfig(4, 4, True, num_speculative_tokens=3, adaptive_speculation=False)
    engine = Engine(runner, config, eos_token_ids=[2], proposer=AlwaysDraft())
    engine.add_request("a", [10, 11, 12], greedy(20))
    engine.add_request("b", [20, 21, 22], greedy(20))
    steps = 0
    while engine.seqs["b"].num_computed < 3:
        engine.step()
        steps += 1
        assert steps <= 3, "b's prompt starved behind a's drafts"


def test_drafts_only_take_free_pages(tiny_llama):
    """A draft shrinks to the pages that are free now instead of preempting a neighbour."""
    prompt = prompts_for(9, [7])[0]
    for num_pages, expected in [(2, []), (3, [4]), (4, [4])]:
        engine = make_engine(tiny_llama, NgramProposer(), k=4, num_pages=num_pages)
        engine.add_request("a", prompt, greedy(9))
        engine.step()  # the prefill: 7 + 1 tokens fill the first two 4-token pages
        assert [r.num_draft for r in engine.draft_requests()] == expected


@pytest.mark.parametrize("bad", [10_000, -1], ids=["past-the-vocabulary", "negative"])
def test_a_draft_whose_distribution_names_an_id_out_of_range_is_dropped(tiny_llama, bad: int):
    """A sampled request's draft carries its distribution's support (q_ids): an id past the
    target's vocabulary made the verify step raise (the executor then left the mesh) and a
    negative one wrapped to the last id, skewing the sample."""
    engine = make_engine(tiny_llama, k=2)
    sampled = SamplingParams(temperature=1.0, seed=3, ignore_eos=True, max_tokens=6)
    engine.add_request("s", [5, 6, 7, 8], sampled)
    engine.step()  # its prefill: the next step decodes and may verify a draft
    asked = {r.request_id: r.num_draft for r in engine.draft_requests()}
    assert asked.get("s", 0) >= 1
    draft = Proposal([9], [[9, bad]], [[0.5, 0.5]])
    engine.set_drafts({"s": draft})
    assert engine.seqs["s"].draft is None
    engine.set_drafts({"s": Proposal([9], [[9, 10]], [[0.5, 0.5]])})  # in range: kept
    assert engine.seqs["s"].draft is not None
    outs = engine.step()
    assert [o.request_id for o in outs] == ["s"]
