"""A request inside the engine: its tokens, how many are computed, and its pages."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gpu.page_manager import PageTable
from gpu.sampling_params import SamplingParams
from gpu.spec_decode import DraftLength, Proposal

if TYPE_CHECKING:  # xgrammar (~0.9 s to import) loads with the first constrained request
    from gpu.grammar import GrammarState
    from gpu.pooling import PromptPooling
    from gpu.prompt_logprobs import PromptScoring


# Stands for a token the device has sampled and the host not yet read (the overlapped step
# loop, ``gpu/overlap.py``): the runner feeds it from the device.
INFLIGHT_TOKEN = -1


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token (EOS or the request's stop_token_ids); stop strings: detokenizer
    LENGTH = "length"  # max_tokens, or the model's context length
    ABORT = "abort"


@dataclass
class Sequence:
    """``num_computed`` catches up with the target ``num_tokens + len(draft)`` (prompt +
    output + draft tokens): one rule for prefill chunks, decodes, prefix hits (start at the
    cached length), preemption (back to 0) and speculative verification (the draft's positions
    are computed like any chunk, then the rejected ones fall back off ``num_computed``)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache (first admit)
    num_preemptions: int = 0
    admitted: bool = False
    finish_reason: FinishReason | None = None
    table: PageTable = field(default_factory=PageTable)
    generator: torch.Generator | None = None  # a seeded request's own, kept across steps
    draft: Proposal | None = None  # speculative tokens to verify in the next step
    draft_length: DraftLength | None = None  # adaptive k (speculation on)
    grammar: GrammarState | None = None  # constrained decoding: follows the output tokens
    # Spilled in from another region: a full batch preempts it for a sequence of this
    # region's own clients (``Scheduler._yield_guests``).
    guest: bool = False
    # 1 while the token sampled last step is still on the device (counted in ``num_tokens``,
    # not in ``output_token_ids``: ``token_ids_at`` gives INFLIGHT_TOKEN for it).
    num_inflight: int = 0
    # vLLM's prompt_logprobs, scored by the prefill chunks until the first token carries them
    prompt_scoring: PromptScoring | None = None
    # An embedding request's vector (gpu.pooling), pooled by the prefill chunks
    pooling: PromptPooling | None = None
    adapter: int = 0  # its LoRA adapter's slot in the runner (``gpu.lora.LoraSet``; 0: none)

    @property
    def every_prompt_position(self) -> bool:
        """Whether every prompt position must be computed here, none taken from the prefix
        cache: a cached position has no logits to score (``gpu.prompt_logprobs``) and no
        hidden state to pool (mean and CLS pooling, ``gpu.pooling``)."""
        return self.prompt_scoring is not None or (
            self.pooling is not None and self.pooling.every_position
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def num_draft(self) -> int:
        return len(self.draft) if self.draft is not None else 0

    @property
    def num_pending(self) -> int:
        """Tokens still to compute before the next sample (drafts included)."""
        return self.num_tokens + self.num_draft - self.num_computed

    def token_ids_at(self, start: int, n: int) -> list[int]:
        """``n`` tokens of prompt + output (+ the in-flight one) + draft from ``start``."""
        known = self.all_token_ids
        tokens = known[start : start + n]
        if len(tokens) < n and self.num_inflight and start + n > len(known):
            tokens.append(INFLIGHT_TOKEN)
        if len(tokens) < n and self.draft is not None:
            offset = max(0, start - self.num_tokens)
            tokens += self.draft.token_ids[offset : offset + n - len(tokens)]
        return tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
