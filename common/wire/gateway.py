"""What a gateway instance receives in its inbox (``gateway.<id>.inbox``): text from the
detokenizers and errors from any stage.

``ErrorEvent`` is also the error answer of every request/reply (``Service.request`` in
``common/runtime.py`` decodes it for any asker).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.wire.codec import Message


@dataclass(frozen=True)
class TextLogprob(Message):
    """A ``WireTokenLogprob`` detokenized: the token and its alternatives as text, and their
    own bytes (a token may hold part of a character, whose text alone is U+FFFD):
    ``top_bytes[i]`` are ``top[i]``'s."""

    token: str
    logprob: float
    token_bytes: list[int]
    top: list[tuple[str, float]] = field(default_factory=list)
    top_bytes: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class TextPromptLogprobs(Message):
    """A ``WirePromptLogprobs`` with its tokens' text: ``texts[id]`` for every token id in it
    (the prompt's and the alternatives')."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]
    texts: dict[int, str]


@dataclass(frozen=True)
class Usage(Message):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class TextDelta(Message):
    request_id: str
    text: str
    finish_reason: str | None = None
    # On a stream's last delta its usage; on its first, the usage so far (the prompt's).
    usage: Usage | None = None
    logprobs: list[TextLogprob] | None = None
    # 1, 2, ... per stream (0: not numbered): the gateway fails a stream with a gap (a message
    # lost on the bus, e.g. with a NATS server of a cluster) rather than serve it with text
    # missing.
    seq: int = 0
    # The generated tokens this delta covers: every token since the previous delta, those whose
    # text is still held back (half a character, a possible stop string) included. The gateway
    # keeps them as the record of what its client has, and resumes a lost stream from them.
    token_ids: list[int] = field(default_factory=list)
    # On a stream's first delta, when asked for: the prompt's logprobs, and (completions'
    # echo of a prompt of token ids) the prompt decoded
    prompt_logprobs: TextPromptLogprobs | None = None
    prompt_text: str | None = None
    # On a stream's first delta: the prompt's last <think> tag (``common.reasoning.think_state``:
    # where the gateway's reasoning parser starts)
    think: str = ""
    # An embedding request's vector, float32 little-endian (``SeqTokens.embedding``)
    embedding: bytes | None = None


@dataclass(frozen=True)
class TextDeltas(Message):
    deltas: list[TextDelta]


@dataclass(frozen=True)
class ErrorEvent(Message):
    """A request failed at some stage; the gateway answers the client with it."""

    request_id: str
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
