"""Tests for gpu/sampling.py (and its logits_filters, sampling_params): distributions (chi-squared),
greedy, seeds, penalties, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from gpu.logits_filters import apply_penalties
from gpu.sampling import Sampler, SamplerInput, SamplerOutput
from gpu.sampling_params import SamplingParams, make_generator


@pytest.fixture(autouse=True)
def _one_thread():
    """The sampler's ops are small: on 2 shared, loaded cores intra-op threads mostly wait on
    each other (10x slower). Tests run on one thread unless they set more themselves."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Distinct, well separated logits over a small vocabulary (no ties near any filter boundary).
LOGITS = torch.tensor(
    [2.0, 1.2, 0.4, 3.1, -0.5, 0.9, 2.6, -1.3, 0.1, 1.7, -2.2, 0.6], dtype=torch.float32
)
V = LOGITS.numel()


def inp_for(params: list[SamplingParams], gens=None, prompts=None, outputs=None) -> SamplerInput:
    n = len(params)
    return SamplerInput(
        params=params,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        generators=gens if gens is not None else [None] * n,
    )


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> np.ndarray:
    """Straightforward float64 reference, in vLLM's order: temperature, min-p (of the whole
    distribution), top-k, then top-p over what is left, renormalised."""
    x = logits.double().numpy() / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = np.ones_like(probs, dtype=bool)
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs.max()
    if p.top_k > 0:
        keep[order[p.top_k :]] = False
    q = np.where(keep, probs, 0.0)
    q /= q.sum()
    if p.top_p < 1.0:
        mass_before = np.cumsum(q[order]) - q[order]
        drop = order[mass_before >= p.top_p]
        keep[drop] = False
    out = np.where(keep, probs, 0.0)
    result: np.ndarray = out / out.sum()
    return result


def check_distribution(tokens: torch.Tensor, expected: np.ndarray) -> float:
    counts = np.bincount(tokens.numpy(), minlength=expected.size)
    support = expected > 0
    assert counts[~support].sum() == 0, f"filtered-out tokens sampled: {counts[~support]}"
    n = counts.sum()
    return float(chisquare(counts[support], expected[support] * n).pvalue)


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.7),
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.75),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.7),
    SamplingParams(temperature=1.3, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.5, top_k=6, top_p=0.95, min_p=0.1),
]


def short_id(p: SamplingParams) -> str:
    default = SamplingParams()
    return (
        ",".join(f"{k}={v}" for k, v in p.__dict__.items() if getattr(default, k) != v) or "default"
    )


@pytest.mark.parametrize("params", CASES, ids=short_id)
def test_batched_shared_generator_matches_filtered_distribution(params: SamplingParams) -> None:
    n = 10000
    sampler = Sampler(generator=torch.Generator().manual_seed(1234))
    out = sampler(LOGITS.expand(n, V), inp_for([params] * n))
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (n,)
    pvalue = check_distribution(out.token_ids, reference_probs(LOGITS, params))
    print(f"chi2 p={pvalue:.3g}")
    assert pvalue > 1e-3


@pytest.mark.parametrize("params", CASES[3:7], ids=short_id)
def test_seeded_generators_match_filtered_distribution(params: SamplingParams) -> None:
    # Many seeded rows, each drawing from its own generator.
    n = 2000
    rows = [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(n)]
    gens = [make_generator(p) for p in rows]
    out = Sampler()(LOGITS.expand(n, V), inp_for(rows, gens))
    pvalue = check_distribution(out.token_ids, reference_probs(LOGITS, params))
    print(f"chi2 p={pvalue:.3g}")
    assert pvalue > 1e-3


def test_chi_squared_has_power() -> None:
    # The same draws are clearly rejected against the unfiltered distribution.
    n = 10000
    sampler = Sampler(generator=torch.Generator().manual_seed(1234))
    out = sampler(LOGITS.expand(n, V), inp_for([SamplingParams(top_p=0.75)] * n))
    counts = np.bincount(out.token_ids.numpy(), minlength=V)
    full = reference_probs(LOGITS, SamplingParams())
    pvalue = chisquare(counts, full * n).pvalue
    print(f"power p={pvalue:.3g}")
    assert pvalue < 1e-6


def test_min_p_comes_before_top_p_as_in_vllm() -> None:
    """With probabilities (.5, .3, .1, .1), min-p .3 keeps the first two; top-p .6 over them
    renormalised (.625, .375) keeps only the first. Top-p first (.5 + .3 reaches .6) and
    min-p after kept two: the order of Hugging Face and vLLM V0, not vLLM's now."""
    logits = torch.tensor([[0.5, 0.3, 0.1, 0.1]]).log()
    params = SamplingParams(top_p=0.6, min_p=0.3)
    assert reference_probs(logits[0], params).tolist() == [1.0, 0.0, 0.0, 0.0]
    sampler = Sampler(generator=torch.Generator().manual_seed(0))
    out = sampler(logits.expand(2000, 4), inp_for([params] * 2000))
    assert set(out.token_ids.tolist()) == {0}


def test_min_tokens_bans_the_stop_tokens_until_reached() -> None:
    """vLLM's min_tokens: under it, neither an EOS (unless ignore_eos) nor a stop_token_ids
    entry may be sampled, greedy or not, however likely; from it on both may."""
    logits = torch.zeros(4, V)
    logits[:, 3] = 50.0  # the EOS here
    logits[:, 6] = 40.0  # a stop_token_ids entry
    greedy = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(6,))
    sampled = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=(6,), seed=1)
    no_eos = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(6,), ignore_eos=True)
    rows = [greedy, sampled, greedy, no_eos]
    outputs = [[9], [9], [9, 9], [9]]  # rows 0, 1, 3 are under min_tokens; row 2 has it
    inp = inp_for(rows, [make_generator(p) for p in rows], outputs=outputs)
    inp.eos_token_ids = (3,)
    out = Sampler()(logits, inp).to_host()
    assert out.token_ids[0] not in (3, 6) and out.token_ids[1] not in (3, 6)
    assert out.token_ids[2] == 3  # reached: the EOS is back
    assert out.token_ids[3] == 3  # ignore_eos: the EOS is no stop token, only id 6 is banned
    # The bans are -inf in the processed logits (what logprobs are taken from).
    processed, _ = Sampler().distributions(logits, inp)
    assert processed[0, 3] == -math.inf and processed[0, 6] == -math.inf
    assert processed[2, 3] == 50.0
    # A constrained row is its grammar's: a complete document allows only a stop token.
    inp.masked_rows = [0]
    assert 0 not in inp.banned_stops() and 1 in inp.banned_stops()


def test_allowed_token_ids_keep_only_theirs() -> None:
    """vLLM's allowed_token_ids: greedy takes the best allowed token, sampling draws only
    allowed ones with their renormalised probabilities; other rows are untouched, and the
    model's own (raw) logprobs ignore the whitelist, as vLLM's do."""
    allowed = (0, 2, 5)  # LOGITS: 2.0, 0.4, 0.9; the overall best is id 3 (3.1)
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=allowed, logprobs=1)
    sampled = SamplingParams(temperature=1.0, allowed_token_ids=allowed)
    free = SamplingParams(temperature=0.0)
    rows = [greedy, free] + [sampled] * 3000
    logits = LOGITS.expand(len(rows), V).contiguous()
    sampler = Sampler(torch.Generator().manual_seed(3))
    out = sampler(logits, inp_for(rows)).to_host()
    assert out.token_ids[0] == 0 and out.token_ids[1] == 3
    assert out.logprobs is not None
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(LOGITS, -1)[0]), abs=1e-6)
    counts = np.bincount(out.token_ids[2:], minlength=V)
    assert set(np.flatnonzero(counts)) <= set(allowed)
    expected = torch.softmax(LOGITS[list(allowed)].double(), -1).numpy() * 3000
    assert chisquare(counts[list(allowed)], expected).pvalue > 1e-3


def test_bad_words_ban_their_last_token_after_their_prefix() -> None:
    """vLLM's bad_words: a one-token word is never sampled; a longer one's last token only
    where the output ends with the rest of it (the prompt does not count), greedy or sampled,
    in spec decoding's distributions too."""
    words = ((3,), (6, 0))  # 3 and 6 are the two best tokens; 0 the third
    greedy = SamplingParams(temperature=0.0, bad_words_token_ids=words)
    sampled = SamplingParams(temperature=0.5, bad_words_token_ids=words, seed=2)
    rows = [greedy, greedy, greedy, sampled]
    outputs = [[], [6], [6, 1], [6]]
    prompts = [[6], [], [], []]
    logits = LOGITS.expand(4, V).contiguous()
    inp = inp_for(rows, [make_generator(p) for p in rows], prompts=prompts, outputs=outputs)
    out = Sampler()(logits, inp).to_host()
    assert out.token_ids == [6, 6, 6, 6]  # 3 is never sampled
    processed, _ = Sampler().distributions(logits, inp)
    assert processed[1, 3] == -math.inf and processed[1, 0] == -math.inf  # after [6]
    assert processed[3, 3] == -math.inf and processed[3, 0] == -math.inf
    assert processed[0, 0] == LOGITS[0] and processed[2, 0] == LOGITS[0]
    assert SamplingParams(bad_words_token_ids=words).bad_word_ends([1, 6]) == (3, 0)


def test_filtered_tokens_never_sampled_large_vocab() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 5000) * 3
    params = [SamplingParams(temperature=1.5, top_k=20), SamplingParams(top_p=0.5)] * 32
    sorted_vals = logits.sort(dim=-1, descending=True).values
    probs = torch.softmax(sorted_vals.double(), -1)
    mass_before = probs.cumsum(-1) - probs
    for _ in range(3):
        tok = Sampler()(logits, inp_for(params)).token_ids
        chosen = logits.gather(1, tok.unsqueeze(1)).squeeze(1)
        rank = (sorted_vals > chosen.unsqueeze(1)).sum(-1)  # tokens strictly more likely
        assert (rank[0::2] < 20).all()  # top_k=20 rows
        assert (mass_before[1::2].gather(1, rank[1::2].unsqueeze(1)) < 0.5).all()  # top_p rows


def test_top_p_candidate_ladder_matches_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows resolved by each rung (top 256, top 4096, full sort) give the cutoff one full sort
    # gives, and keep the tokens a float64 reference keeps.
    from gpu import logits_filters as filters

    torch.manual_seed(8)
    vocab = 6000
    scales = [4.0, 4.0, 1.0, 1.0, 0.3, 0.05, 2.0, 0.3]
    logits = torch.stack([torch.randn(vocab) * sc for sc in scales])
    params = [
        SamplingParams(top_p=0.5),
        SamplingParams(top_p=0.95, top_k=300),
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.99),
        SamplingParams(top_p=0.9, top_k=5000),
        SamplingParams(top_p=0.97),
        SamplingParams(top_p=0.8, top_k=10),
        SamplingParams(top_p=0.999, min_p=0.2),
    ]
    probs = torch.softmax(logits, -1)
    cut = filters.filter_cutoffs(logits, probs, params)
    # the device's path, one full sort with no data-sized step, cuts where the ladder does
    top_p = torch.tensor([p.top_p for p in params])
    laddered = filters.top_p_cutoffs(logits, probs, top_p)
    assert torch.equal(filters.top_p_cutoffs(logits, probs, top_p, ladder=False), laddered)
    monkeypatch.setattr(filters, "TOP_P_CANDIDATES", ())
    full_sort = filters.filter_cutoffs(logits, probs, params)
    assert cut is not None and full_sort is not None
    assert torch.equal(cut, full_sort)
    kept = (logits >= cut.unsqueeze(1)).sum(-1).tolist()
    expected = [int((reference_probs(logits[i], p) > 0).sum()) for i, p in enumerate(params)]
    assert kept == expected
    # every rung is exercised: <= 256, (256, 4096], > 4096 kept tokens
    assert min(kept) <= 256 and any(256 < k <= 4096 for k in kept) and max(kept) > 4096


def test_greedy_is_argmax_and_mixed_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 300)
    greedy = SamplingParams(temperature=0.0)
    out = Sampler()(logits, inp_for([greedy] * 6))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top is None
    assert out.to_host().logprobs is None and out.to_host().top_logprobs is None
    out_bf16 = Sampler()(logits.bfloat16(), inp_for([greedy] * 6))
    assert torch.equal(out_bf16.token_ids, logits.bfloat16().float().argmax(-1))
    # Ties go to the first maximum, and a NaN row to its first NaN, as argmax decides them.
    tied = torch.randint(0, 4, (6, 49152)).float()
    tied[2, 7] = tied[2, 900] = float("nan")
    out = Sampler()(tied, inp_for([greedy] * 6))
    assert torch.equal(out.token_ids, tied.argmax(-1)) and out.token_ids[2] == 7
    # Greedy rows in a batch with sampled rows are still argmax.
    mixed = [greedy, SamplingParams(top_p=0.9), greedy, SamplingParams(temperature=1.8)] * 2
    logits8 = torch.randn(8, 300)
    out = Sampler()(logits8, inp_for(mixed))
    for i in (0, 2, 4, 6):
        assert out.token_ids[i] == logits8[i].argmax()


def test_all_greedy_fast_path_does_no_random_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("fast path must not sort, softmax or draw noise")

    monkeypatch.setattr(torch.Tensor, "sort", boom)
    monkeypatch.setattr(torch.Tensor, "uniform_", boom)
    monkeypatch.setattr(torch, "softmax", boom)
    logits = torch.randn(4, 100)
    out = Sampler()(logits, inp_for([SamplingParams(temperature=0.0)] * 4))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    # Penalised greedy rows also avoid it.
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3)] * 4
    Sampler()(logits, inp_for(params, outputs=[[1, 2]] * 4))


def test_caller_logits_not_modified() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 64)[:, :50]  # a non-contiguous view, as a padded LM head gives
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.7, top_k=5, min_p=0.1),
        SamplingParams(temperature=0.0, frequency_penalty=1.0, repetition_penalty=1.5),
        SamplingParams(top_p=0.5, presence_penalty=0.5),
        SamplingParams(temperature=1.0),
    ]
    Sampler()(logits, inp_for(params, prompts=[[1, 2]] * 4, outputs=[[3, 3, 4]] * 4))
    Sampler()(logits[:1], inp_for([SamplingParams(top_k=3)]))
    assert torch.equal(logits, before)
    # The penalised rows are those of a contiguous copy: same result as contiguous input.
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=1.7, presence_penalty=1.0)] * 4
    hist = [[int(t) for t in row.topk(3).indices] for row in logits]
    a = Sampler()(logits, inp_for(greedy, outputs=hist)).token_ids
    b = Sampler()(logits.contiguous(), inp_for(greedy, outputs=hist)).token_ids
    assert torch.equal(a, b) and not torch.equal(a, logits.argmax(-1))


def run_steps(logits_steps, params, seeded_row, steps_gens):
    """Runs the steps; generators persist across steps (as the engine keeps them)."""
    sampler = Sampler()
    toks = []
    for step_logits in logits_steps:
        out = sampler(step_logits, inp_for(params, steps_gens))
        toks.append(int(out.token_ids[seeded_row]))
    return toks


# The 2-thread case has a vocabulary above torch's parallel grain (32768): a lone row could be
# split across threads (and rounded differently) where a batched one is not.
@pytest.mark.parametrize(("vocab", "steps", "threads"), [(3000, 8, 1), (40000, 2, 2)])
def test_seeded_row_independent_of_batch(vocab: int, steps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(3)
    base = [torch.randn(vocab) * 0.5 for _ in range(steps)]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42)

    alone = run_steps([b.unsqueeze(0) for b in base], [seeded], 0, [make_generator(seeded)])

    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=7),
        SamplingParams(min_p=0.2, seed=7),
        SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5),
        SamplingParams(top_p=0.3, logprobs=3),
    ]
    for pos in (0, 5):
        params = [*others[:pos], seeded, *others[pos:]]
        gens = [make_generator(p) for p in params]
        batched_logits = []
        for b in base:
            rows = [torch.randn(vocab) for _ in others]
            rows.insert(pos, b)
            batched_logits.append(torch.stack(rows))
        torch.manual_seed(100 + pos)  # the shared generator state differs each time
        assert run_steps(batched_logits, params, pos, gens) == alone

    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=43)
    other = run_steps([b.unsqueeze(0) for b in base], [other_seed], 0, [make_generator(other_seed)])
    assert other != alone
    again = run_steps([b.unsqueeze(0) for b in base], [seeded], 0, [make_generator(seeded)])
    assert again == alone


def test_seeded_sampled_row_without_generator_raises() -> None:
    with pytest.raises(ValueError, match="generator"):
        Sampler()(torch.randn(1, 10), inp_for([SamplingParams(seed=1)]))
    # A greedy seeded row needs none.
    Sampler()(torch.randn(1, 10), inp_for([SamplingParams(seed=1, temperature=0.0)]))


def test_presence_frequency_penalties_openai_formula() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, 20)
    outputs = [[1, 1, 1, 5, 7, 7], [], [19, 0, 0]]
    prompts = [[2, 3], [4], [5, 5]]  # prompt tokens do not count for these penalties
    params = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=2.0),
        SamplingParams(presence_penalty=0.0, frequency_penalty=-0.5),
    ]
    got = apply_penalties(logits.clone(), params, prompts, outputs)
    expected = logits.clone()
    for i, p in enumerate(params):
        for tok in set(outputs[i]):
            c = outputs[i].count(tok)
            expected[i, tok] -= c * p.frequency_penalty + p.presence_penalty
    # (torch.testing.assert_close would import torch.distributed: seconds.)
    assert torch.allclose(got, expected, rtol=0, atol=1e-6)


def test_repetition_penalty_matches_transformers() -> None:
    torch.manual_seed(5)
    vocab = 50
    logits = torch.randn(4, vocab) * 2
    prompts = [[1, 2, 3, 3], [10, 11, vocab + 7], [], [49, 0]]  # ids >= vocab are ignored
    outputs = [[4, 1], [], [7, 8, 7], [2, 3, 4, 5, 6]]
    for penalty in (1.3, 0.7):
        params = [SamplingParams(repetition_penalty=penalty)] * 4
        got = apply_penalties(logits.clone(), params, prompts, outputs)
        # HF takes [B, L] input ids; ids >= vocab are clamped and dropped, so they pad.
        seen = [p + o for p, o in zip(prompts, outputs, strict=True)]
        width = max(len(s) for s in seen)
        ids = torch.tensor([s + [vocab] * (width - len(s)) for s in seen]).clamp(max=vocab)
        ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
        assert torch.equal(got, ref)


def test_penalties_order_and_greedy_rows() -> None:
    # Repetition first, then frequency/presence (vLLM's order); greedy rows get penalties too.
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5]])
    p = SamplingParams(
        temperature=0.0,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logprobs=4,
    )
    processed = Sampler(logprobs_mode="processed")
    out = processed(logits, inp_for([p], prompts=[[2]], outputs=[[0, 0]]))
    expected = torch.tensor([[3.0 / 2 - 2 * 0.5 - 0.25, 2.9, -1.0 * 2, 0.5]])
    assert out.token_ids.tolist() == [1]
    host = out.to_host()
    assert host.token_ids == [1] and host.top_logprobs is not None
    got = dict(host.top_logprobs[0])
    ref = torch.log_softmax(expected, -1)[0]
    for tok in range(4):
        assert got[tok] == pytest.approx(float(ref[tok]), abs=1e-6)


def test_penalties_only_on_rows_that_ask() -> None:
    torch.manual_seed(6)
    logits = torch.randn(3, 30)
    params = [
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0, repetition_penalty=1.8, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    hist = [[1, 2, 3]] * 3
    out = Sampler(logprobs_mode="processed")(logits, inp_for(params, prompts=hist, outputs=hist))
    assert out.logprobs is not None
    plain = torch.log_softmax(logits, -1)
    for i in (0, 2):
        assert out.logprobs[i] == pytest.approx(float(plain[i, out.token_ids[i]]), abs=1e-6)
    pen = apply_penalties(logits[1:2].clone(), [params[1]], hist[:1], hist[:1])
    assert out.token_ids[1] == pen.argmax()
    lp = torch.log_softmax(pen, -1)[0, out.token_ids[1]]
    assert out.logprobs[1] == pytest.approx(float(lp), abs=1e-6)


def test_logprobs_sampled_token_and_top_n() -> None:
    torch.manual_seed(7)
    vocab = 500
    logits = torch.randn(5, vocab) * 2
    params = [
        SamplingParams(temperature=0.7, top_k=50, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=20),
        SamplingParams(temperature=1.2),  # does not ask
        SamplingParams(top_p=0.8, logprobs=0),
        SamplingParams(temperature=1.0, min_p=0.05, logprobs=1),
    ]
    out: SamplerOutput = Sampler(logprobs_mode="processed")(logits, inp_for(params))
    host = out.to_host()
    assert out.logprobs is not None and host.logprobs is not None
    assert host.top_logprobs is not None
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (5,)
    assert host.token_ids == out.token_ids.tolist()
    for i, p in enumerate(params):
        if p.logprobs is None:
            assert math.isnan(host.logprobs[i]) and host.top_logprobs[i] == []
            continue
        assert host.logprobs[i] == float(out.logprobs[i])
        temp = 1.0 if p.is_greedy else p.temperature
        ref = torch.log_softmax(logits[i] / temp, -1)
        tok = int(out.token_ids[i])
        assert float(out.logprobs[i]) == pytest.approx(float(ref[tok]), abs=1e-5)
        top = host.top_logprobs[i]
        assert len(top) == p.logprobs
        vals = [v for _, v in top]
        assert vals == sorted(vals, reverse=True)
        if p.logprobs:
            ref_vals, ref_ids = ref.topk(p.logprobs)
            assert [t for t, _ in top] == ref_ids.tolist()
            np.testing.assert_allclose(vals, ref_vals.numpy(), atol=1e-5)
    # No row asks -> None.
    out = Sampler()(logits, inp_for([SamplingParams()] * 5))
    assert out.logprobs is None and out.top is None


def test_raw_logprobs_are_the_models_own() -> None:
    """vLLM's default (raw_logprobs), and OpenAI's: the model's distribution, whatever the
    temperature, penalties, logit bias or min_tokens ban the sampling used; a grammar's mask
    is part of it (a forbidden token is -inf). The processed mode gave token 0 of logits
    (2, 1, 0, -1) -0.145 at temperature 0.5, and a token biased by +5 -0.185 for -3.44."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 4)
    raw = torch.log_softmax(logits[0], -1)
    params = [
        SamplingParams(temperature=0.5, seed=3, logprobs=2),
        SamplingParams(temperature=0.0, logit_bias=((3, 5.0),), logprobs=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.9, min_tokens=3, logprobs=0,
                       stop_token_ids=(0,)),
        SamplingParams(temperature=0.0, logprobs=1),
    ]  # fmt: skip
    inp = inp_for(params, [make_generator(p) for p in params], [[0]] * 4, [[0]] * 4)
    inp.token_bitmask = torch.tensor([[0b0110]] * 4, dtype=torch.int32)  # only 1 and 2
    inp.masked_rows = [3]
    host = Sampler()(logits, inp).to_host()
    assert host.logprobs is not None and host.top_logprobs is not None
    for i in range(3):
        token = host.token_ids[i]
        assert host.logprobs[i] == pytest.approx(float(raw[token]), abs=1e-6)
    assert host.token_ids[1] == 3 and host.logprobs[1] == pytest.approx(float(raw[3]), abs=1e-6)
    assert host.token_ids[2] != 0  # the ban and penalty still shape the sampling
    assert [t for t, _ in host.top_logprobs[0]] == [0, 1]
    masked = torch.log_softmax(torch.tensor([1.0, 0.0]), -1)
    assert host.token_ids[3] == 1 and host.logprobs[3] == pytest.approx(float(masked[0]), abs=1e-6)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("presence_penalty", 2.01),
        ("presence_penalty", -2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("max_tokens", 0),
        ("seed", 1.5),
        ("stop_token_ids", (1, -3)),
    ],
)
def test_invalid_params_raise_naming_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_valid_edges_accepted() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, logprobs=20, max_tokens=1)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3)
    assert SamplingParams(stop_token_ids=[1, 2]).stop_token_ids == (1, 2)  # type: ignore[arg-type]
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams().is_greedy


def test_input_length_mismatch_and_empty_batch() -> None:
    with pytest.raises(ValueError, match="params"):
        Sampler()(torch.randn(2, 10), inp_for([SamplingParams()]))
    out = Sampler()(torch.randn(0, 10), inp_for([]))
    assert out.token_ids.shape == (0,)


def test_top_k_larger_than_vocab_and_min_p_one() -> None:
    logits = LOGITS.expand(200, V)
    out = Sampler()(
        logits, inp_for([SamplingParams(top_k=1000)] * 100 + [SamplingParams(min_p=1.0)] * 100)
    )
    assert set(out.token_ids[100:].tolist()) == {int(LOGITS.argmax())}
    assert len(set(out.token_ids[:100].tolist())) > 3


def test_masked_vocab_entries_never_sampled() -> None:
    # -inf logits (e.g. a padded LM head or a grammar mask) survive every path as probability 0.
    torch.manual_seed(9)
    logits = torch.randn(6, 400)
    logits[:, 200:] = -math.inf
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.9),
        SamplingParams(top_k=300),
        SamplingParams(top_p=0.999, seed=3),
        SamplingParams(min_p=0.0001, presence_penalty=-2.0, repetition_penalty=0.5),
        SamplingParams(top_k=250, top_p=0.99999, frequency_penalty=-2.0),
    ]
    hist = [[250, 399, 5]] * 6
    gens = [make_generator(p) for p in params]
    for _ in range(5):
        out = Sampler()(logits, inp_for(params, gens, prompts=hist, outputs=hist))
        assert (out.token_ids < 200).all()
        assert out.logprobs is not None and math.isfinite(float(out.logprobs[0]))
