"""The logits processing ``gpu.sampling.Sampler`` applies before it samples: penalties, logit
bias, and the per-row cutoffs of top-k, top-p and min-p (steps 0, 1 and 4 of the pipeline in
``gpu.sampling``'s docstring, where the choices are explained)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import chain

import torch

from gpu.sampling_params import SamplingParams
from gpu.transfers import move, to_device


def _flat_token_index(
    rows: Sequence[int],
    seqs: Sequence[Iterable[int]],
    lengths: Sequence[int],
    vocab: int,
) -> torch.Tensor | None:
    """Flat indices ``row * V + token`` into a contiguous ``[B, V]`` tensor for every token of
    ``seqs[j]`` (``lengths[j]`` of them) in row ``rows[j]``: one concatenated index tensor for
    the whole batch, no padding, on the host. Ids outside ``[0, V)`` (a tokenizer larger than
    the LM head) are dropped, as Hugging Face does. None when there is no token.
    """
    if sum(lengths) == 0:
        return None
    # Built on the host, where the ids are: dropping the invalid ones has a data-dependent
    # size, which on a device would wait for it.
    tokens = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.int64)
    owner = torch.repeat_interleave(
        torch.tensor(rows, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
    )
    valid = (tokens >= 0) & (tokens < vocab)
    if not bool(valid.all()):
        tokens, owner = tokens[valid], owner[valid]
    return owner * vocab + tokens


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties, in place on contiguous fp32 ``logits``
    ``[B, V]`` (row ``i`` described by ``params[i]`` and its token lists). Returns ``logits``.

    Only rows that set a penalty are touched, and only at the token ids they have seen: the
    work is O(tokens), not O(B * V). Gather/scatter on flat ``row * V + token`` indices:

    - repetition (Hugging Face ``RepetitionPenaltyLogitsProcessor`` / vLLM) over prompt +
      output: ``x < 0 -> x * p`` else ``x / p``; repeated ids all write the same value;
    - frequency and presence (OpenAI) over output ids, one update per distinct id from
      ``torch.unique`` counts: ``x - count * frequency_penalty - presence_penalty``.
    """
    if logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous():
        raise ValueError("apply_penalties needs contiguous fp32 logits [batch, vocab]")
    vocab = logits.shape[1]
    device = logits.device
    flat_logits = logits.view(-1)

    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        idx = _flat_token_index(
            rep_rows,
            [chain(prompt_token_ids[i], output_token_ids[i]) for i in rep_rows],
            [len(prompt_token_ids[i]) + len(output_token_ids[i]) for i in rep_rows],
            vocab,
        )
        if idx is not None:
            idx = move(idx, device)
            rep_all = [p.repetition_penalty for p in params]
            rep = to_device(rep_all, torch.float32, device)[idx // vocab]
            vals = flat_logits[idx]
            flat_logits[idx] = torch.where(vals < 0, vals * rep, vals / rep)

    fp_rows = [
        i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if fp_rows:
        idx = _flat_token_index(
            fp_rows,
            [output_token_ids[i] for i in fp_rows],
            [len(output_token_ids[i]) for i in fp_rows],
            vocab,
        )
        if idx is not None:
            uniq, counts = torch.unique(idx, return_counts=True)  # on the host: sized by data
            uniq, counts = move(uniq, device), move(counts, device)
            row = uniq // vocab
            f32 = torch.float32
            freq = to_device([p.frequency_penalty for p in params], f32, device)
            pres = to_device([p.presence_penalty for p in params], f32, device)
            freq, pres = freq[row], pres[row]
            flat_logits[uniq] = flat_logits[uniq] - counts.to(torch.float32) * freq - pres
    return logits


def apply_logit_bias(
    logits: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[int]
) -> None:
    """Add each row's ``logit_bias`` in place on contiguous fp32 ``logits`` (ids past the LM
    head are dropped, as for penalties): one scatter-add over the listed entries."""
    vocab = logits.shape[1]
    flat: list[int] = []
    values: list[float] = []
    for i in rows:
        for token, bias in params[i].logit_bias:
            if token < vocab:
                flat.append(i * vocab + token)
                values.append(bias)
    if flat:
        device = logits.device
        logits.view(-1).index_add_(
            0, to_device(flat, torch.int64, device), to_device(values, torch.float32, device)
        )


def keep_only(logits: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[int]) -> None:
    """Each listed row keeps only its ``allowed_token_ids`` (ids past the LM head are dropped),
    every other logit -inf, in place on contiguous fp32 ``logits``: the kept values are
    gathered, the rows filled, the values put back (no host wait)."""
    vocab = logits.shape[1]
    flat = []
    for i in rows:
        ids = params[i].allowed_ids  # (a tensor built once per request)
        flat.append(ids[ids < vocab] + i * vocab)
    device = logits.device
    flat_logits = logits.view(-1)
    index = move(torch.cat(flat), device)
    kept = flat_logits.index_select(0, index)
    logits.index_fill_(0, to_device(list(rows), torch.int64, device), -math.inf)
    flat_logits.index_copy_(0, index, kept)


def stop_dead_rows(logits: torch.Tensor, rows: Sequence[int], eos_token_ids: Sequence[int]) -> None:
    """A listed row left no token at all (every logit -inf: its allowed ids, bans and grammar
    exclude each other) gets its EOS instead, in place: the request ends with "stop" rather
    than sample from NaN (garbage, and an error in speculative verification's multinomial,
    which would end the step). On the device, no wait; O(rows x V)."""
    device = logits.device
    index = to_device(list(rows), torch.int64, device)
    sub = logits.index_select(0, index)
    dead = torch.isneginf(sub).all(dim=-1, keepdim=True)
    vocab = logits.shape[1]
    fallback = torch.full((vocab,), -math.inf, device=device)
    stops = [t for t in eos_token_ids if t < vocab] or [0]
    fallback.index_fill_(0, to_device(stops, torch.int64, device), 0.0)
    logits.index_copy_(0, index, torch.where(dead, fallback, sub))


def ban_tokens(logits: torch.Tensor, banned: dict[int, tuple[int, ...]]) -> None:
    """Set ``logits[row, token]`` to -inf for each row's listed tokens (ids past the LM head
    are dropped), in place on contiguous fp32 ``logits``: one scatter."""
    vocab = logits.shape[1]
    flat = [row * vocab + t for row, tokens in banned.items() for t in tokens if t < vocab]
    if flat:
        logits.view(-1).index_fill_(0, to_device(flat, torch.int64, logits.device), -math.inf)


# Top-p looks for its cutoff among the top-K candidates of a row, K taken from this ladder
# (a full sort only for rows whose nucleus is wider than the last rung). The ladder is fixed,
# so which rung resolves a row depends on that row alone, never on the rest of the batch.
# On CPU a full sort of [32, 49152] costs ~100x a topk of 256.
TOP_P_CANDIDATES = (256, 4096)


def _top_p_rung(
    sub: torch.Tensor, sub_probs: torch.Tensor, top_p: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rung of the ladder over rows ``sub``: ``(cutoff, done, mass, p_k)``, the cutoff each
    row would get from its top ``k`` candidates, whether those candidates settle it, their mass
    and the probability of the k-th (``k`` = the vocabulary: one full sort, which settles all)."""
    vocab = sub.shape[1]
    if k < vocab:
        vals, ids = sub.topk(k, dim=-1)
    else:
        vals, ids = sub.sort(dim=-1, descending=True)
    cand = sub_probs.gather(1, ids)
    p_k = cand[:, -1].clone()
    cum = cand.cumsum_(dim=-1)
    below = (cum < top_p.unsqueeze(1)).sum(dim=-1)  # tokens before the crossing one
    n_alive = (vals > -math.inf).sum(dim=-1)
    done = (below < k) | (n_alive < k) | (k == vocab)
    n_keep = torch.minimum(below + 1, n_alive).clamp_(min=1)
    cut = vals.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)
    return cut, done, cum[:, -1], p_k


def top_p_cutoffs(
    masked: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor, ladder: bool = True
) -> torch.Tensor:
    """Logit cutoff of top-p per row: the logit of the last token of the smallest prefix (in
    descending order) whose probability mass reaches ``top_p``.

    ``masked``: logits with top-k losers at -inf; ``probs``: their softmax (the renormalised
    top-k distribution). Every token whose inclusive cumulative mass is below ``top_p`` is kept,
    plus the one that crosses it. Without ``ladder``, one full sort of every row: the same
    cutoffs, and no step whose size depends on the data (which a device would be waited for).
    """
    rows, vocab = masked.shape
    if not ladder:
        return _top_p_rung(masked, probs, top_p, vocab)[0]
    device = masked.device
    out = torch.empty(rows, dtype=torch.float32, device=device)
    todo = torch.arange(rows, device=device)
    # After a rung of k candidates failed: mass of the top k and probability of the k-th. The
    # top k' (k' > k) then hold at most mass + (k' - k) * p_k, so rungs that cannot reach top_p
    # are skipped (a pure shortcut: every rung that resolves a row gives the same cutoff).
    mass = torch.zeros(rows, dtype=torch.float32, device=device)
    p_last = torch.ones(rows, dtype=torch.float32, device=device)
    seen = torch.zeros(rows, dtype=torch.float32, device=device)
    for k in (*(c for c in TOP_P_CANDIDATES if c < vocab), vocab):
        act = todo
        if k < vocab:
            act = todo[mass[todo] + (k - seen[todo]) * p_last[todo] >= top_p[todo]]
            if act.numel() == 0:
                continue
        full = act.numel() == rows
        sub = masked if full else masked.index_select(0, act)
        sub_probs = probs if full else probs.index_select(0, act)
        cut, done, mass[act], p_last[act] = _top_p_rung(sub, sub_probs, top_p[act], k)
        out[act[done]] = cut[done]
        seen[act] = float(k)
        remaining = torch.ones(rows, dtype=torch.bool, device=device)
        remaining[act[done]] = False
        todo = todo[remaining[todo]]
        if todo.numel() == 0:
            break
    return out


def filter_cutoffs(
    xs: torch.Tensor, probs: torch.Tensor, params: Sequence[SamplingParams]
) -> torch.Tensor | None:
    """Per-row logit cutoff of min-p / top-k / top-p for sampled rows ``xs`` ``[S, V]``
    (``probs`` is their softmax). A token survives iff ``logit >= cutoff``. None when no row
    filters anything.

    vLLM's order: min-p (relative to the full distribution's most likely token) and top-k are
    both thresholds on the logits, so together the larger cutoff; top-p then takes its mass
    over what they left, renormalised. Top-p before min-p keeps more: with probabilities
    (.5, .3, .1, .1), top-p .6 and min-p .3 leave one token in vLLM's order, two the other way.
    """
    n, vocab = xs.shape
    device = xs.device
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    k_rows = [i for i in range(n) if top_k[i] < vocab]
    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    min_ps = [p.min_p for p in params]
    use_min_p = any(m > 0.0 for m in min_ps)
    if not k_rows and not p_rows and not use_min_p:
        return None
    cutoff = torch.full((n,), -math.inf, dtype=torch.float32, device=device)

    def subset(rows: list[int], t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = to_device(rows, torch.int64, device)
        return idx, (t if len(rows) == n else t.index_select(0, idx))

    if use_min_p:  # p >= min_p * p_max  <=>  x >= x_max + log(min_p)
        log_min_p = to_device(min_ps, torch.float32, device).log_()
        cutoff = xs.amax(dim=-1) + log_min_p

    if k_rows:  # top-k: the k-th largest value (its ties survive too), no full sort
        idx, sub = subset(k_rows, xs)
        k = to_device([top_k[i] for i in k_rows], torch.int64, device)
        top_vals = sub.topk(max(top_k[i] for i in k_rows), dim=-1).values
        kth = top_vals.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
        cutoff[idx] = torch.maximum(cutoff[idx], kth)

    if p_rows:  # top-p over the renormalised min-p and top-k survivors
        idx, sub = subset(p_rows, xs)
        if use_min_p or any(top_k[i] < vocab for i in p_rows):
            sub = sub.masked_fill(sub < cutoff[idx].unsqueeze(1), -math.inf)
            sub_probs = torch.softmax(sub, dim=-1)
        else:
            sub_probs = probs if len(p_rows) == n else probs.index_select(0, idx)
        top_p = to_device([params[i].top_p for i in p_rows], torch.float32, device)
        # The candidate ladder sizes its subsets by the data: on a device, one full sort.
        ladder = device.type == "cpu"
        cutoff[idx] = top_p_cutoffs(sub, sub_probs, top_p, ladder)  # >= the cutoff so far
    return cutoff
