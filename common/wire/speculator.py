"""What a speculator receives: an executor's sequences to draft for (``speculator.propose``,
request/reply), and the sequences that finished (``speculator.release``, to every replica).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.wire.codec import Message
from common.wire.tokenizer import WireSamplingParams


@dataclass(frozen=True)
class DraftSeq(Message):
    """One decoding sequence to draft for. ``token_ids`` are all its accepted tokens (prompt,
    then output): any speculator replica can answer, reusing whatever prefix it holds."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_draft: int  # at most this many tokens
    params: WireSamplingParams


@dataclass(frozen=True)
class ProposeRequest(Message):
    seqs: list[DraftSeq]
    # Finished sequences, from executors that send them with their next call (one replica
    # hears them); executors now publish a ``DraftRelease`` instead.
    released: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DraftRelease(Message):
    """These sequences finished: every replica that holds their draft KV frees it. Published
    to all replicas because any of them may have served a call for one (queue group)."""

    request_ids: list[str]


@dataclass(frozen=True)
class DraftTokens(Message):
    """Draft tokens; for sampled requests, the (truncated) distribution each was drawn from
    as ``q_ids[j]``/``q_probs[j]`` (absent: each token was chosen deterministically)."""

    request_id: str
    token_ids: list[int]
    q_ids: list[list[int]] | None = None
    q_probs: list[list[float]] | None = None


@dataclass(frozen=True)
class ProposeReply(Message):
    drafts: list[DraftTokens]
    speculator_id: str = ""
