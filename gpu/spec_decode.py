"""Speculative decoding: proposals, lossless verification, and how many tokens to draft.

A proposer (``gpu.proposers``: prompt lookup or a draft model) drafts ``k`` tokens for a
decoding sequence. The draft joins the sequence's target (``num_tokens + k``, DESIGN.md "The
step loop"), so the scheduler computes the last real token and the ``k`` drafts in one forward
pass like any other chunk; the ``k + 1`` logits rows are then verified here by the rejection
rule of Leviathan et al. (2023) and Chen et al. (2023):

- draft token ``x_j ~ q_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``;
- at the first rejection the token is drawn from ``norm(max(0, p_j - q_j))`` and the rest of
  the draft is dropped;
- when all ``k`` are accepted a bonus token is drawn from ``p_k``.

Every emitted token is then distributed exactly as the target's own sampler would draw it
(``p`` is ``Sampler.distributions``: penalties, temperature, top-k/top-p/min-p), whatever the
draft. Greedy requests have ``p`` one-hot at the target's argmax: drafts are accepted while
they equal it and the correction is the argmax, so the tokens are those of plain greedy
decoding. A deterministic proposer (prompt lookup, a greedy draft model) has ``q`` one-hot at
its token: acceptance probability ``p(x)``, residual ``p`` without ``x``.

The random draws come from the request's own generator when it is seeded, so a seeded request
is reproducible for a given proposer; it is distributed like, but not token-for-token equal
to, the same request decoded without speculation (the draws are spent differently).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from gpu.sampling import Sampler, SamplerInput
from gpu.sampling_params import SamplingParams
from gpu.transfers import to_device, to_host


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one sequence, and the distribution each was drawn from.

    ``q_ids[j]``/``q_probs[j]``: the support of the draft's distribution at draft position
    ``j`` and its probabilities (a truncated, renormalised distribution is exact as long as the
    token was drawn from it). None: every token was chosen deterministically (greedy draft,
    prompt lookup), i.e. ``q`` is one-hot on it.
    """

    token_ids: list[int]
    q_ids: list[list[int]] | None = None
    q_probs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        if (self.q_ids is None) != (self.q_probs is None):
            raise ValueError("q_ids and q_probs come together")
        if self.q_ids is None or self.q_probs is None:
            return
        k = len(self.token_ids)
        if len(self.q_ids) != k or len(self.q_probs) != k:
            raise ValueError(f"{k} draft tokens need {k} draft distributions")
        for j, (tok, ids, probs) in enumerate(
            zip(self.token_ids, self.q_ids, self.q_probs, strict=True)
        ):
            if len(ids) != len(probs):
                raise ValueError(f"draft distribution {j}: {len(ids)} ids, {len(probs)} probs")
            if not any(t == tok and q > 0 for t, q in zip(ids, probs, strict=True)):
                raise ValueError(f"draft token {j} ({tok}) has no probability under its q")

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncated(self, n: int) -> Proposal:
        if n >= len(self.token_ids):
            return self
        if self.q_ids is None or self.q_probs is None:
            return Proposal(self.token_ids[:n])
        return Proposal(self.token_ids[:n], self.q_ids[:n], self.q_probs[:n])


@dataclass(frozen=True)
class DraftRequest:
    """One sequence that will decode next step: everything a proposer needs to draft for it.

    ``token_ids`` are the sequence's accepted tokens (prompt, then output); ``num_draft`` is
    how many tokens to propose (at most; fewer or none is always fine).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_draft: int
    params: SamplingParams


class Proposer(Protocol):
    """Drafts tokens for a batch of sequences; may keep per-sequence state between calls."""

    def propose(self, requests: list[DraftRequest]) -> dict[str, Proposal]:
        """A proposal per request id it has one for (a missing id just decodes normally)."""
        ...

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished or aborted sequences."""
        ...


@dataclass
class SpecStats:
    """Counters since start (Prometheus-style: monotonically increasing)."""

    num_spec_steps: int = 0  # sequence-steps that verified at least one draft token
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of which accepted
    num_emitted_tokens: int = 0  # tokens those steps gave the client (after stop/length cuts)
    accepted_at: list[int] = field(default_factory=list)  # accepted_at[j]: draft position j

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying target step for one sequence: 1 + accepted drafts,
        less whatever a stop token or ``max_tokens`` cut off."""
        return self.num_emitted_tokens / self.num_spec_steps if self.num_spec_steps else 0.0

    def record(self, num_draft: int, num_accepted: int, num_emitted: int) -> None:
        self.num_spec_steps += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted
        while len(self.accepted_at) < num_accepted:
            self.accepted_at.append(0)
        for j in range(num_accepted):
            self.accepted_at[j] += 1


@dataclass
class DraftLength:
    """How many tokens to draft for one sequence next time: ``k`` adapts to its acceptance.

    All accepted: one more (up to ``max_k``). A rejection: one fewer (down to 1). Nothing
    accepted at ``k == 1``: no drafts for ``PAUSE_STEPS`` steps, then try 1 again, so a draft
    that cannot follow a sequence stops costing proposer time and verification positions.
    """

    max_k: int
    k: int = -1
    paused: int = 0

    PAUSE_STEPS = 8

    def __post_init__(self) -> None:
        if self.k < 0:
            self.k = self.max_k

    def next(self) -> int:
        """The draft length for the coming step (0: do not draft)."""
        if self.paused > 0:
            self.paused -= 1
            return 0
        return self.k

    def update(self, num_draft: int, num_accepted: int) -> None:
        if num_accepted == num_draft:
            self.k = min(self.max_k, self.k + 1)
        elif num_accepted == 0 and self.k <= 1:
            self.paused = self.PAUSE_STEPS
        else:
            self.k = max(1, self.k - 1)


@dataclass(frozen=True)
class Verification:
    """Per sequence the tokens to append (accepted drafts, then one target token); and the
    processed logits rows (``rows[i] + j`` is sequence ``i``'s position ``j``) for logprobs."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    processed: torch.Tensor
    row_starts: list[int]


def verify(
    sampler: Sampler, logits: torch.Tensor, drafts: Sequence[Proposal], inp: SamplerInput
) -> Verification:
    """Verify each sequence's draft against the target logits of its ``len(draft) + 1``
    positions (``logits`` rows in batch order). ``inp`` has one row per sequence: its params,
    tokens so far and generator; its ``token_bitmask``/``masked_rows``, if any, index the
    logits rows. Penalties at draft position ``j`` see the drafts before it. A draft token
    a row's mask forbids has probability 0 there, so it is always rejected.
    """
    rows = [len(d) + 1 for d in drafts]
    if sum(rows) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for drafts needing {sum(rows)}")
    # A bitmask (constrained sequences) already describes the logits rows, drafts included.
    row_inp = SamplerInput(
        [], [], [], [], inp.token_bitmask, inp.masked_rows, eos_token_ids=inp.eos_token_ids
    )
    starts = []
    for i, draft in enumerate(drafts):
        starts.append(len(row_inp.params))
        for j in range(len(draft) + 1):
            row_inp.params.append(inp.params[i])
            row_inp.prompt_token_ids.append(inp.prompt_token_ids[i])
            row_inp.output_token_ids.append(inp.output_token_ids[i] + draft.token_ids[:j])
            row_inp.generators.append(inp.generators[i])
    processed, probs = sampler.distributions(logits, row_inp)
    # Everything is decided on the device first and read back with one wait (gpu/transfers).
    sampled = [i for i in range(len(drafts)) if not (inp.params[i].is_greedy or probs is None)]
    draws: list[torch.Tensor] = []
    for i in sampled:
        assert probs is not None
        gen = inp.generators[i] or sampler.generator
        draws.extend(_draw_sampled(drafts[i], probs[starts[i] : starts[i] + rows[i]], gen))
    argmax, *drawn = to_host(processed.argmax(dim=-1), *draws)
    outcome = dict(zip(sampled, zip(drawn[::2], drawn[1::2], strict=True), strict=True))
    tokens, accepted = [], []
    for i, draft in enumerate(drafts):
        r0 = starts[i]
        if i in outcome:
            out = _resolve_sampled(draft.token_ids, *outcome[i])
        else:
            out = _verify_greedy(draft.token_ids, argmax[r0 : r0 + rows[i]])
        tokens.append(out)
        accepted.append(len(out) - 1)
    return Verification(tokens, accepted, processed, starts)


def _verify_greedy(draft: list[int], argmax: list[int]) -> list[int]:
    for j, tok in enumerate(draft):
        if argmax[j] != tok:
            return [*draft[:j], argmax[j]]
    return [*draft, argmax[len(draft)]]


def _draw_sampled(
    draft: Proposal, probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for one sequence, on the device; ``probs`` ``[k + 1, V]``.

    Returns whether each draft token is rejected (``[k]``) and, for every position ``j``, a
    token drawn from where the sequence goes on if ``j`` is the first rejection (the residual
    ``max(p - q, 0)``) or, at ``j = k``, from ``p`` (the bonus). Only the draw at the first
    rejection is used; drawing at every position keeps the host from choosing the row, which
    would wait for the device.
    """
    k = len(draft)
    device = probs.device
    ids = to_device(draft.token_ids, torch.int64, device)
    p_x = probs[:k].gather(1, ids.unsqueeze(1)).squeeze(1)
    if draft.q_ids is None or draft.q_probs is None:
        q_x = torch.ones(k, dtype=probs.dtype, device=device)  # one fixed token: q = 1 there
        q = torch.zeros_like(probs[:k]).scatter_(1, ids.unsqueeze(1), 1.0)
    else:
        q_x = to_device(
            [
                sum(q for t, q in zip(qi, qp, strict=True) if t == tok)
                for tok, qi, qp in zip(draft.token_ids, draft.q_ids, draft.q_probs, strict=True)
            ],
            probs.dtype,
            device,
        )
        rows = [j for j, qi in enumerate(draft.q_ids) for _ in qi]
        flat_ids = [t for qi in draft.q_ids for t in qi]
        flat_probs = [v for qp in draft.q_probs for v in qp]
        q = torch.zeros_like(probs[:k]).index_put_(
            (to_device(rows, torch.int64, device), to_device(flat_ids, torch.int64, device)),
            to_device(flat_probs, probs.dtype, device),
            accumulate=True,
        )
    u = torch.rand(k, generator=generator, device=device, dtype=probs.dtype)
    # accept iff u < p/q, written without the division (p = 0 always rejects)
    rejected = u * q_x >= p_x
    residual = (probs[:k] - q).clamp_(min=0.0)
    # p <= q everywhere happens only when p == q: then p itself
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, probs[:k], residual)
    dists = torch.cat([residual, probs[k:]])
    return rejected, torch.multinomial(dists, 1, generator=generator).squeeze(1)


def _resolve_sampled(draft: list[int], rejected: list[bool], draws: list[int]) -> list[int]:
    """The tokens :func:`_draw_sampled`'s outcome appends: the drafts before the first
    rejection, then the draw there (or the bonus draw when none is rejected)."""
    n = rejected.index(True) if True in rejected else len(draft)
    return [*draft[:n], draws[n]]
