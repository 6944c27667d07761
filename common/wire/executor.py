"""What an executor receives: requests to run (``executor.<id>.submit``) and aborts
(``requests.abort``); with disaggregated prefill and decode, prompts to compute for another
executor (``executor.<id>.prefill``), word that they are in its pages
(``executor.<id>.prefilled``), and the question for its NIXL agent (``executor.<id>.kv_agent``).

The scheduler receives ``TokenizedRequest`` first (``scheduler.submit``: it queues and routes
it, then forwards it); the scheduler and the detokenizer also act on ``AbortRequests``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.wire.codec import Message, id_ok, require
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
    # The grammar holds from the token after this one, the end of the model's reasoning
    # (vLLM's structured outputs with a reasoning parser: the model thinks freely first);
    # None: from the first token. With ``open_token`` (``<think>``), only if the answer's
    # first token is that one (the model opens its reasoning itself).
    after_token: int | None = None
    open_token: int | None = None


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
    # Disaggregated (sent to a decode executor): the prefill executor that computes the
    # prompt and its first token, and that process's incarnation; "" for a local prefill.
    prefill_executor: str = ""
    prefill_incarnation: str = ""
    # A chat prompt's last <think> tag (``common.reasoning.think_state``), for the gateway's
    # reasoning parser (it rides StreamStart and the first TextDelta)
    think: str = ""
    # Its LoRA adapter (an executor's --lora-modules name; "": the base model). The page
    # hashes are that adapter's (``common.page_hash.namespace_root``).
    lora: str = ""
    # Spilled in from another region (set by the scheduler that took it in): its executor
    # preempts it for a request of that region's own clients when its batch is full.
    guest: bool = False


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
    # Set when a scheduler forwards the abort to another region's mesh (where it sent the
    # requests, or, not knowing, every peer); a forwarded abort is never forwarded again.
    from_region: str = ""


ROLES = ("mixed", "prefill", "decode")


@dataclass(frozen=True)
class PrefillRequest(Message):
    """Decode executor -> prefill executor: compute this prompt, stream its first token, and
    write its KV into these pages of mine (every layer; page i holds tokens i*page_size...).
    The pool is at ``layer_bases`` (``common.kv_layout.KVLayout``) behind NIXL agent
    ``agent``; tokens after the first come from ``decode_executor``.

    ``job_id`` names this one job (the same request may be reserved again later, elsewhere or
    here): ``PrefillDone`` and NIXL's notification carry it. ``write_by`` (wall clock, Unix
    seconds) is the lease on the pages: no write may start after it, and a write still running
    then is cancelled, because past it (plus a margin) the decode side reuses the pages whether
    or not it heard from this job."""

    request: TokenizedRequest
    decode_executor: str
    decode_incarnation: str
    agent: str
    layer_bases: list[int]
    page_bytes: int
    num_pages: int
    pages: list[int]
    job_id: str
    write_by: float

    def __post_init__(self) -> None:
        require(
            "PrefillRequest",
            {
                "decode_executor must be a subject-safe id": id_ok(self.decode_executor),
                "layer_bases must be non-empty": bool(self.layer_bases),
                "page_bytes and num_pages must be >= 1": self.page_bytes >= 1
                and self.num_pages >= 1,
                "pages must lie in the pool": all(0 <= p < self.num_pages for p in self.pages),
                "job_id must be non-empty": bool(self.job_id),
                "write_by must be a finite time": math.isfinite(self.write_by),
            },
        )


PREFILL_OUTCOMES = ("written", "finished", "failed")


@dataclass(frozen=True)
class PrefillDone(Message):
    """Prefill executor -> decode executor, after the transfer: ``written`` (the KV is in the
    pages, NIXL's notification follows the data; decode from ``first_token`` on),
    ``finished`` (the first token ended the request: release the pages) or ``failed``
    (``error`` says why: compute the prompt locally). ``job_id`` is the ``PrefillRequest``'s:
    an answer about an earlier job for the same request matches nothing. ``write_may_land``:
    a write was started and not seen to end (a timeout, a failure mid-way), so the pages
    stay out of use until the job's lease is over."""

    request_id: str
    outcome: str
    first_token: int = -1
    error: str = ""
    bytes: int = 0
    seconds: float = 0.0
    job_id: str = ""
    write_may_land: bool = False

    def __post_init__(self) -> None:
        require(
            "PrefillDone",
            {
                "outcome must be one of " + ", ".join(PREFILL_OUTCOMES): (
                    self.outcome in PREFILL_OUTCOMES
                )
            },
        )


@dataclass(frozen=True)
class LoraUpdate(Message):
    """Gateway -> each executor (request/reply; vLLM's /v1/load_lora_adapter and
    /v1/unload_lora_adapter): load the PEFT adapter at ``path`` as ``name``, or, with no
    ``path``, unload ``name``."""

    name: str
    path: str = ""


@dataclass(frozen=True)
class LoraUpdated(Message):
    """The adapters the executor serves now (its next heartbeat says the same); ``changed``:
    this update loaded or unloaded one (a load of a folder it had already is not)."""

    loras: list[str]
    changed: bool = False


@dataclass(frozen=True)
class KVAgentQuery(Message):
    """Prefill executor -> decode executor (request/reply), once per peer process."""

    asker: str


@dataclass(frozen=True)
class KVAgentReply(Message):
    """A NIXL agent's name and metadata (``nixl_agent.get_agent_metadata()``)."""

    agent: str
    metadata: bytes
