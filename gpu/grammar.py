"""Constrained decoding inside the engine: one xgrammar ``GrammarMatcher`` per constrained
sequence, and the token bitmask of a batch's constrained rows.

The matcher follows the sequence's output tokens: ``next_mask`` fills the allowed-token bitmask
for the next position (the sampler sets every other logit to -inf), ``accept`` advances it by
an emitted token. Speculative verification checks a draft with ``draft_masks``: the mask at
each draft position is filled while the matcher walks the draft, a draft token the grammar
rejects stops the walk (its own mask forbids it, so verification rejects it there), and the
matcher is rolled back to where it started; only the tokens finally emitted are accepted.

The grammar's stop tokens are the engine's end-of-sequence ids: once the document is complete
the mask allows only them, and a matcher that accepted one has terminated (the engine then
finishes the sequence, whatever ``ignore_eos`` says: nothing may follow the document).

A reasoning model's answer (vLLM's structured outputs with a reasoning parser) gets its
grammar after the model ends its reasoning: ``GrammarState``'s ``after_token``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


def bitmask_width(vocab_size: int) -> int:
    return xgr.get_bitmask_shape(1, vocab_size)[1]


class GrammarState:
    """One sequence's position in its grammar.

    ``after_token``: the grammar holds only after the model wrote it (a reasoning model's
    ``</think>``; until then every token is allowed and none reaches the matcher).
    ``open_token`` (with ``after_token``): only if the answer's first token is this one (the
    model opens its block itself: ``<think>``); any other first token starts the grammar at
    once, and the first mask is the grammar's with this token allowed too."""

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        stop_token_ids: Sequence[int],
        after_token: int | None = None,
        open_token: int | None = None,
    ) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        self.end_token = after_token
        # (open_token, waiting_for): the first token may open the block; the block is open
        self.gate = (open_token, None) if open_token is not None else (None, after_token)

    @property
    def waiting_for(self) -> int | None:
        """The token the grammar waits for (None: it holds now, or may from the next)."""
        return self.gate[1]

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def _pass(self, token: int) -> bool | None:
        """Move the gate by one emitted token: None where the token is the model's own
        (reasoning, or the tag that opened or closed it), else whether the grammar takes it."""
        may_open, waiting = self.gate
        if may_open is not None:
            self.gate = (None, self.end_token if token == may_open else None)
            if token == may_open:
                return None
        elif waiting is not None:
            if token == waiting:
                self.gate = (None, None)
            return None
        return bool(self.matcher.accept_token(token))

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advance by emitted tokens; False at the first one the grammar does not allow (the
        rest are not accepted)."""
        return all(self._pass(int(token)) is not False for token in token_ids)

    def next_mask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Fill ``bitmask[row]`` with the tokens allowed next; whether the grammar limits
        them (False while the model reasons: every bit stays set)."""
        may_open, waiting = self.gate
        if waiting is not None:
            bitmask[row] = -1  # (every bit set: every token)
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if may_open is not None:
            bitmask[row, may_open // 32] |= 1 << (may_open % 32)
        return True

    def draft_masks(self, draft: Sequence[int], bitmask: torch.Tensor, row: int) -> list[int]:
        """Fill ``bitmask[row + j]`` for draft positions ``j = 0..len(draft)`` (the last one
        is the bonus position), then roll the matcher back to where it was; returns the
        positions the grammar limits."""
        gate, walked, limited = self.gate, 0, []
        for j in range(len(draft) + 1):
            if self.next_mask(bitmask, row + j):
                limited.append(j)
            if j == len(draft):
                break
            taken = self._pass(int(draft[j]))
            if taken is False:
                break  # rows past a rejected token are never read: verification stops there
            if taken:
                walked += 1
                if self.terminated:
                    break  # a stop token: the engine drops whatever follows it
        if walked:
            self.matcher.rollback(walked)
        self.gate = gate
        return limited


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed, on the CPU (xgrammar fills it there); ``gpu.transfers.move`` moves
    it to the logits' device."""
    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the disallowed logits of ``rows`` to -inf in place (xgrammar's CPU kernel on CPU,
    its Triton kernel on CUDA); the other rows are not touched."""
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
