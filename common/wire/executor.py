"""What an executor receives: requests to run (``executor.<id>.submit``) and aborts
(``requests.abort``).

The scheduler receives ``TokenizedRequest`` first (``scheduler.submit``: it queues and routes
it, then forwards it); the scheduler and the detokenizer also act on ``AbortRequests``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.wire.codec import Message
from common.wire.tokenizer import WireSamplingParams


@dataclass(frozen=True)
class WireGrammar(Message):
    """What a constrained request's output must match, as xgrammar EBNF text (built by the
    tokenizer from a JSON schema or a tool-call format; it already parsed, so it compiles).
    ``key`` names it (a hash of the text): each executor compiles a key once, off its step
    loop, and keeps the compiled grammar for the next request with the same schema. The
    compiled form (token masks for one vocabulary) stays in the executor: it is large and
    tied to the executor's tokenizer, while the text is small and crosses any hop."""

    key: str
    ebnf: str


@dataclass(frozen=True)
class TokenizedRequest(Message):
    request_id: str
    reply_to: str
    params: WireSamplingParams
    prompt_token_ids: list[int]
    page_hashes: list[int]
    detok_shard: int
    priority: int = 0
    deadline: float | None = None
    arrival_time: float = 0.0
    # Migration: the tokens an executor that was lost had already streamed for this request
    # (the detokenizer's record). The next executor prefills prompt + these and continues the
    # same stream from there; ``migrations`` counts how often that happened (a limit bounds it).
    output_token_ids: list[int] = field(default_factory=list)
    migrations: int = 0
    grammar: WireGrammar | None = None  # constrained decoding (response_format, tools)


@dataclass(frozen=True)
class AbortRequests(Message):
    """Stop these requests. Without ``executor_id`` they are over everywhere: every service
    forgets them, and one that has not received them yet drops them when they arrive. With it,
    only that executor stops them: the scheduler withdrawing work it moves elsewhere."""

    request_ids: list[str]
    reason: str = "abort"
    executor_id: str = ""
    # Set when the requests failed rather than ended: the executor holding one (it knows the
    # client's inbox) sends this message to the client as a 503 error.
    error: str = ""
