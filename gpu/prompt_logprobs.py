"""vLLM's ``prompt_logprobs``: each prompt token's logprob given the tokens before it, its rank
in that distribution, and the top-N alternatives, delivered with the request's first token.

They come from the prefill chunks' own logits: a chunk of a scoring sequence asks the runner
for the rows of every position it computes (``PromptScoring.rows``) rather than its last one,
and position ``p``'s row scores prompt token ``p + 1``. They are the model's own logprobs (a
``log_softmax`` of the logits, whatever the sampler's ``logprobs_mode``: no penalty, bias or
temperature applies to a prompt, as in vLLM). The scheduler gives a scoring sequence no prefix
cache hit (a cached position has no logits; vLLM does the same), and every scoring sequence of
a step together at most ``PROMPT_CHUNK_TOKENS`` positions (each row is a vocabulary of floats,
more than once: the logits, in fp32, and their ``log_softmax``). A sequence preempted midway is
recomputed from its first token, and the positions already scored are not scored again. Each
chunk's results are copied to the host without a wait (``gpu.transfers.HostCopy``) and read
once, with the first token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpu.transfers import HostCopy, to_device

# The most prompt positions the scoring sequences of one step compute together: with a 152k
# vocabulary their rows then take ~0.8 GB (bf16 logits, fp32 copy, log_softmax), whatever the
# step budget (an 8k-token prompt scores in 16 steps).
PROMPT_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class PromptLogprobs:
    """``logprobs[i]``, ``ranks[i]`` (1: the most likely) and ``top[i]`` (the top-N ``(token
    id, logprob)``, descending) are those of ``token_ids[i + 1]``: the first prompt token has
    none."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]


@dataclass
class PromptScoring:
    """A sequence's prompt logprobs in the making (``Sequence.prompt_scoring``)."""

    num_top: int
    scored: int = 0  # prompt positions scored, from the first
    parts: list[HostCopy] = field(default_factory=list)

    def rows(self, start: int, num_new: int, prompt_len: int) -> int:
        """Logits rows the chunk ``[start, start + num_new)`` needs: one per position not yet
        scored, the trailing ones (the last position samples where the chunk ends the
        prompt); at least one, the last position's."""
        return max(1, start + num_new - max(start, self.scored)) if start < prompt_len else 1

    def queue(
        self,
        logits: torch.Tensor,
        first_row: int,
        start: int,
        num_new: int,
        prompt: list[int],
    ) -> None:
        """Score the chunk's positions (its rows from ``first_row`` on, as ``rows`` counted)
        and queue their copy to the host."""
        first = max(start, self.scored)
        end = min(start + num_new, len(prompt) - 1)  # the last prompt position samples
        if end <= first:
            return
        rows = logits[first_row : first_row + end - first].float()
        lsm = torch.log_softmax(rows, dim=-1)
        targets = to_device(prompt[first + 1 : end + 1], torch.int64, lsm.device).unsqueeze(1)
        chosen = lsm.gather(1, targets)
        ranks = (lsm > chosen).sum(dim=-1) + 1
        tensors = [chosen.squeeze(1), ranks]
        if self.num_top:
            top = lsm.topk(min(self.num_top, lsm.shape[1]), dim=-1)
            tensors += [top.indices, top.values]
        self.parts.append(HostCopy(*tensors))
        self.scored = end

    def result(self, prompt: list[int]) -> PromptLogprobs:
        """Every part read back (one wait each: they were queued steps ago)."""
        logprobs: list[float] = []
        ranks: list[int] = []
        top: list[list[tuple[int, float]]] = []
        for part in self.parts:
            host = part.wait()
            logprobs += host[0]
            ranks += host[1]
            if self.num_top:
                top += [list(zip(i, v, strict=True)) for i, v in zip(host[2], host[3], strict=True)]
            else:
                top += [[] for _ in host[0]]
        self.parts = []
        return PromptLogprobs(list(prompt), logprobs, ranks, top)
