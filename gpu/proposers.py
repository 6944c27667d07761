"""The two proposers of speculative decoding: prompt lookup (no model) and a draft model.

Both implement ``gpu.spec_decode.Proposer``: ``propose(requests)`` drafts up to
``request.num_draft`` tokens per sequence; ``release(ids)`` forgets finished sequences.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from gpu.attention.metadata import SeqChunk
from gpu.page_manager import PageManager, PageTable
from gpu.runner import ModelRunner
from gpu.sampling import Sampler, SamplerInput
from gpu.spec_decode import DraftRequest, Proposal
from gpu.transfers import to_host


class NgramProposer:
    """Prompt lookup decoding: if the context's last ``n`` tokens (``n`` from ``max_n`` down to
    ``min_n``) occurred before, propose the tokens that followed their most recent earlier
    occurrence. Free to run and strong wherever outputs copy their input (summaries, code
    edits, extraction, RAG); deterministic, so ``q`` is one-hot."""

    def __init__(self, max_n: int = 4, min_n: int = 2, max_context: int = 4096) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n = max_n
        self.min_n = min_n
        self.max_context = max_context  # only the recent context is searched

    def propose(self, requests: list[DraftRequest]) -> dict[str, Proposal]:
        proposals = {}
        for req in requests:
            draft = self.lookup(req.token_ids[-self.max_context :], req.num_draft)
            if draft:
                proposals[req.request_id] = Proposal(draft)
        return proposals

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows over tokens[:-1]: every earlier n-gram that has a token after it
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return [int(t) for t in tokens[start : start + k]]
        return []

    def release(self, request_ids: Iterable[str]) -> None:
        pass  # stateless


@dataclass
class _DraftState:
    """What the draft model's KV cache holds for one sequence."""

    token_ids: list[int] = field(default_factory=list)  # tokens whose KV is (or is to be) held
    num_computed: int = 0
    table: PageTable = field(default_factory=PageTable)


class DraftModelProposer:
    """A small draft model with its own paged KV cache and per-sequence state.

    Each call extends each sequence's state incrementally: the longest common prefix of what
    the cache holds and the sequence's tokens now is kept (the accepted drafts included), the
    rest is rolled back (pages released), and only the new tokens are computed, normally one or
    two, before the draft loop runs ``k`` single-token steps for the whole batch. A sequence
    the proposer has never seen (or evicted) is prefilled, so any replica can serve any call.

    Greedy requests get the draft's argmax (``q`` one-hot). Sampled requests draw from the
    draft's own distribution under the request's sampling settings, truncated to its ``top_n``
    most likely tokens and renormalised; that truncated ``q`` is sent along, and it is exactly
    the distribution the token was drawn from, so verification stays lossless.

    Pages are LRU: when the pool is full the least recently used sequence not in the batch is
    forgotten (its next call prefills it again).
    """

    def __init__(
        self,
        runner: ModelRunner,
        top_n: int = 32,
        max_batched_tokens: int = 2048,
        generator: torch.Generator | None = None,
    ) -> None:
        self.runner = runner
        self.pages = PageManager(
            runner.kv.spec.num_pages, runner.page_size, enable_prefix_caching=False
        )
        self.top_n = top_n
        self.max_batched_tokens = max_batched_tokens
        self.sampler = Sampler(generator)
        self.states: OrderedDict[str, _DraftState] = OrderedDict()  # least recently used first
        self.num_forward_passes = 0

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            state = self.states.pop(rid, None)
            if state is not None:
                self.pages.free(state.table)

    def propose(self, requests: list[DraftRequest]) -> dict[str, Proposal]:
        batch = [r for r in requests if self._fits(r)]
        states = []
        for req in batch:
            state = self.states.pop(req.request_id, None) or _DraftState()
            self.states[req.request_id] = state  # most recently used
            self._sync(state, req.token_ids)
            states.append(state)
        kept = [
            (r, s)
            for r, s in zip(batch, states, strict=True)
            if self._reserve(s, len(r.token_ids) + r.num_draft - 1, {q.request_id for q in batch})
        ]
        if not kept:
            return {}
        logits = self._catch_up([s for _, s in kept])
        return self._draft([r for r, _ in kept], [s for _, s in kept], logits)

    # -- state --------------------------------------------------------------------------------
    def _fits(self, req: DraftRequest) -> bool:
        return req.num_draft > 0 and len(req.token_ids) + req.num_draft <= min(
            self.runner.max_model_len, self.runner.kv.spec.num_tokens
        )

    def _sync(self, state: _DraftState, token_ids: list[int]) -> None:
        """Keep the common prefix (at least one token is always recomputed: its logits start
        the draft), roll the rest back."""
        held = state.token_ids[: state.num_computed]
        common = 0
        for a, b in zip(held, token_ids, strict=False):
            if a != b:
                break
            common += 1
        state.num_computed = min(common, len(token_ids) - 1)
        state.token_ids = list(token_ids)
        self.pages.truncate(state.table, state.num_computed)

    def _reserve(self, state: _DraftState, num_tokens: int, busy: set[str]) -> bool:
        """Pages for ``num_tokens``; evicts idle sequences (LRU first) when the pool is full."""
        while not self.pages.allocate(state.table, num_tokens):
            victim = next((rid for rid in self.states if rid not in busy), None)
            if victim is None:
                return False
            self.release([victim])
        return True

    # -- compute ------------------------------------------------------------------------------
    def _catch_up(self, states: list[_DraftState]) -> torch.Tensor:
        """Compute every state's pending tokens (in chunks of at most ``max_batched_tokens``
        per pass); the logits ``[B, V]`` of each one's last token."""
        rows: list[torch.Tensor | None] = [None] * len(states)
        while any(r is None for r in rows):
            budget = self.max_batched_tokens
            chunks, tokens, members = [], [], []
            for i, st in enumerate(states):
                pending = len(st.token_ids) - st.num_computed
                if rows[i] is not None or budget <= 0:
                    continue
                n = min(pending, budget)
                budget -= n
                chunks.append(SeqChunk(tuple(st.table.pages), st.num_computed, n))
                tokens.append(st.token_ids[st.num_computed : st.num_computed + n])
                members.append(i)
            logits = self.runner.execute(chunks, tokens)
            self.num_forward_passes += 1
            for row, i in enumerate(members):
                st = states[i]
                st.num_computed += chunks[row].num_new
                if st.num_computed == len(st.token_ids):
                    rows[i] = logits[row]
        return torch.stack([r for r in rows if r is not None])

    def _draft(
        self, requests: list[DraftRequest], states: list[_DraftState], logits: torch.Tensor
    ) -> dict[str, Proposal]:
        drafts: list[list[int]] = [[] for _ in requests]
        q_ids: list[list[list[int]]] = [[] for _ in requests]
        q_probs: list[list[list[float]]] = [[] for _ in requests]
        active = list(range(len(requests)))
        while True:
            tokens = self._sample(requests, active, drafts, logits, q_ids, q_probs)
            for i, tok in zip(active, tokens, strict=True):
                drafts[i].append(tok)
            active = [i for i in active if len(drafts[i]) < requests[i].num_draft]
            if not active:
                break
            chunks = []
            for i in active:
                st = states[i]
                st.token_ids.append(drafts[i][-1])
                chunks.append(SeqChunk(tuple(st.table.pages), st.num_computed, 1))
                st.num_computed += 1
            logits = self.runner.execute(chunks, [[drafts[i][-1]] for i in active])
            self.num_forward_passes += 1
        proposals = {}
        for i, req in enumerate(requests):
            if req.params.is_greedy:
                proposals[req.request_id] = Proposal(drafts[i])
            else:
                proposals[req.request_id] = Proposal(drafts[i], q_ids[i], q_probs[i])
        return proposals

    def _sample(
        self,
        requests: list[DraftRequest],
        active: list[int],
        drafts: list[list[int]],
        logits: torch.Tensor,
        q_ids: list[list[list[int]]],
        q_probs: list[list[list[float]]],
    ) -> list[int]:
        """One draft token per active sequence: argmax for greedy requests, else a draw from
        the top-``top_n`` truncation of the draft's distribution (recorded in q_ids/q_probs)."""
        reqs = [requests[i] for i in active]
        inp = SamplerInput(
            params=[r.params for r in reqs],
            prompt_token_ids=[r.token_ids[: r.num_prompt_tokens] for r in reqs],
            output_token_ids=[
                r.token_ids[r.num_prompt_tokens :] + drafts[i]
                for r, i in zip(reqs, active, strict=True)
            ],
            generators=[None] * len(reqs),
        )
        processed, probs = self.sampler.distributions(logits, inp)
        if probs is None:
            (tokens,) = to_host(processed.argmax(dim=-1))
            return [int(t) for t in tokens]
        # Every row is drawn on the device and read back with one wait; greedy rows keep
        # their argmax and ignore their draw.
        top = probs.topk(min(self.top_n, probs.shape[1]), dim=-1)
        q = top.values / top.values.sum(dim=-1, keepdim=True)
        picks = torch.multinomial(q, 1, generator=self.sampler.generator).squeeze(1)
        for row, i in enumerate(active):
            seed = requests[i].params.seed
            if seed is not None and not requests[i].params.is_greedy:
                # Its own draw, fixed by its seed and the position drafted: a seeded request's
                # output must not hang on what else this proposer serves.
                position = len(requests[i].token_ids) + len(drafts[i])
                own = torch.Generator(q.device).manual_seed(draft_seed(seed, position))
                picks[row] = torch.multinomial(q[row], 1, generator=own)[0]
        tokens, ids, values, picked = to_host(processed.argmax(dim=-1), top.indices, q, picks)
        for row, i in enumerate(active):
            if requests[i].params.is_greedy:
                continue
            tokens[row] = ids[row][picked[row]]
            kept = [j for j, v in enumerate(values[row]) if v > 0]  # q's support only
            q_ids[i].append([ids[row][j] for j in kept])
            q_probs[i].append([values[row][j] for j in kept])
        return [int(t) for t in tokens]


def draft_seed(seed: int, position: int) -> int:
    """A generator seed for drafting ``position`` of a request seeded ``seed`` (mixed so that
    neighbouring seeds and positions give unrelated streams)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    return (mixed ^ (mixed >> 31)) & ((1 << 63) - 1)
