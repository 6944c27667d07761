"""What a detokenizer shard receives: an executor step's tokens (``detok.<shard>``) and the
scheduler's question of what each stream has received (``detok.<shard>.progress``,
request/reply).
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field

from common.wire.codec import Message


@dataclass(frozen=True)
class WireTokenLogprob(Message):
    """One generated token's logprob and its top alternatives, by token id: the wire form of
    the engine's ``gpu.engine.TokenLogprob`` (the detokenizer turns it into a ``TextLogprob``).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class WirePromptLogprobs(Message):
    """The engine's ``gpu.prompt_logprobs.PromptLogprobs`` (vLLM's ``prompt_logprobs``):
    ``logprobs[i]``, ``ranks[i]`` and ``top[i]`` (the top-N ``(token id, logprob)``) are those
    of ``token_ids[i + 1]``, the first prompt token having none."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class StreamStart(Message):
    """What the detokenizer needs to know about a request, sent once with its first tokens
    from an executor (per-request fields never ride along in every step's message)."""

    stop: list[str]
    skip_special_tokens: bool
    prompt_tokens: int
    cached_tokens: int
    # The request's W3C trace context (traceparent/tracestate): a StepTokens message carries
    # many requests, so their contexts travel here rather than in the NATS headers.
    trace: dict[str, str] = field(default_factory=dict)
    reply_to: str = ""  # the gateway inbox its text goes to
    deadline: float | None = None  # unix seconds: past it, the detokenizer forgets the stream
    # Tokens generated before this executor's first ones, whose text the client already has
    # (``TokenizedRequest.output_token_ids``). A shard that holds the stream (a migration)
    # ignores them; one that starts it (the gateway resumed a lost request under a new id)
    # replays them without sending their text, so its state is the lost stream's.
    output_token_ids: list[int] = field(default_factory=list)
    # The prompt's last ids (``PROMPT_TAIL_TOKENS``): the context the first token is decoded
    # in. A SentencePiece decoder (Llama 2, Mistral) strips the leading space of the first
    # token it decodes, so "▁Paris" alone is "Paris" where the completion reads " Paris".
    prompt_tail: list[int] = field(default_factory=list)
    # ``TokenizedRequest.migrations`` of this run: a request moved off an executor and sent
    # back to the very same process has one more than the run it was moved from, which is how
    # the detokenizer tells the new run's start from the old run's late one.
    migrations: int = 0
    # vLLM's: no stop string completed within the first ``min_tokens`` output tokens ends the
    # stream; ``include_stop_str_in_output`` keeps the stop string (or stop token) that ends it.
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    # Completions' echo with a prompt of token ids: the detokenizer decodes them for the first
    # delta (``TextDelta.prompt_text``); empty otherwise, and for a continuation.
    echo_prompt_ids: list[int] = field(default_factory=list)
    think: str = ""  # ``TokenizedRequest.think``, for the first delta


PROMPT_TAIL_TOKENS = 5  # (common.tokenizer.IncrementalDetokenizer's context)


@dataclass(frozen=True)
class SeqTokens(Message):
    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    output_tokens: int
    start: StreamStart | None = None
    logprobs: list[WireTokenLogprob] | None = None
    # Disaggregated prefill: the stream's next tokens come from this (decode) executor and
    # incarnation; the detokenizer takes them from there on.
    continues_on: tuple[str, str] | None = None
    # The last token is the stop token that ended the request (``StepOutput.stop_token``):
    # counted, recorded and given its logprob, but no text.
    stop_token: bool = False
    # With a request's first token, when it asked for them
    prompt_logprobs: WirePromptLogprobs | None = None
    # With an embedding request's token: its vector, float32 little-endian (``gpu.pooling``)
    embedding: bytes | None = None


@dataclass(frozen=True)
class StepTokens(Message):
    """Every new token of one executor step for one detokenizer shard."""

    executor_id: str
    seqs: list[SeqTokens]
    incarnation: str = ""  # the executor process's (``Heartbeat.incarnation``)


@dataclass(frozen=True)
class StreamProgressRequest(Message):
    """The scheduler moves these requests away from ``executor_id`` (lost): which tokens has
    each streamed? The detokenizer stops accepting their tokens from that executor from now."""

    executor_id: str
    request_ids: list[str]
    incarnation: str = ""  # which process under that id (a restarted one is not withdrawn)
    # per request id: the migrations of the run moved off (``StreamStart.migrations``); empty:
    # not said (a start from that process is then a new run only once the old one's came)
    migrations: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.migrations and len(self.migrations) != len(self.request_ids):
            raise ValueError("StreamProgressRequest: one migrations count per request id")


@dataclass(frozen=True)
class StreamProgressReply(Message):
    """Tokens received so far per stream this shard holds (a request absent here and from
    ``ended`` never started); ``ended``: finished or aborted, nothing to move."""

    streamed: dict[str, list[int]]
    ended: list[str] = field(default_factory=list)


def float32_bytes(values: list[float]) -> bytes:
    """An embedding as it travels: float32, little-endian (what OpenAI's base64 encodes)."""
    packed = array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def float32_values(data: bytes) -> array[float]:
    """``float32_bytes`` read back (a ValueError for a length that is not whole floats)."""
    if len(data) % 4:
        raise ValueError(f"an embedding of {len(data)} bytes is not float32 values")
    packed = array("f")
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed
