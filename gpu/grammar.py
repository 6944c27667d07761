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

``after_token`` (a reasoning model's ``</think>``): the grammar holds only after the model
wrote that token; until then every token is allowed and none reaches the matcher (vLLM's
structured outputs with a reasoning parser).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


def bitmask_width(vocab_size: int) -> int:
    return xgr.get_bitmask_shape(1, vocab_size)[1]


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        stop_token_ids: Sequence[int],
        after_token: int | None = None,
    ) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        self.waiting_for = after_token  # the grammar starts after it (None: it has)

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advance by emitted tokens; False at the first one the grammar does not allow (the
        rest are not accepted)."""
        for token in token_ids:
            if self.waiting_for is not None:
                if int(token) == self.waiting_for:
                    self.waiting_for = None
            elif not self.matcher.accept_token(int(token)):
                return False
        return True

    def next_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Fill ``bitmask[row]`` with the tokens allowed next."""
        if self.waiting_for is not None:
            bitmask[row] = -1  # (every bit set: every token)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def draft_masks(self, draft: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        """Fill ``bitmask[row + j]`` for draft positions ``j = 0..len(draft)`` (the last one
        is the bonus position), then roll the matcher back to where it was."""
        waiting, walked = self.waiting_for, 0
        for j in range(len(draft) + 1):
            self.next_mask(bitmask, row + j)
            if j == len(draft):
                break
            if self.waiting_for is not None:  # still reasoning: the grammar may start here
                if int(draft[j]) == self.waiting_for:
                    self.waiting_for = None
                continue
            if not self.matcher.accept_token(int(draft[j])):
                break  # rows past a rejected token are never read: verification stops there
            walked += 1
            if self.terminated:
                break  # a stop token: the engine drops whatever follows it
        if walked:
            self.matcher.rollback(walked)
        self.waiting_for = waiting


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed, on the CPU (xgrammar fills it there); ``gpu.transfers.move`` moves
    it to the logits' device."""
    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the disallowed logits of ``rows`` to -inf in place (xgrammar's CPU kernel on CPU,
    its Triton kernel on CUDA); the other rows are not touched."""
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
