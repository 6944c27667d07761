"""Every wire message of the mesh: typed, versioned, msgpack-encoded, validated on decode.

A message is a frozen dataclass; on the wire it is a msgpack map with its fields plus ``"t"``
(type name) and ``"v"`` (schema version). ``decode`` checks the tag, the version and every
field's type (nested messages included) and raises ``MessageError`` naming the bad field, so a
malformed message is a clear error for the receiver, never a crash deep in a handler.
Grouped by the lifecycle in DESIGN.md: gateway -> tokenizer -> scheduler -> executor ->
detokenizer -> gateway.

Names: a message that is the wire form of an engine type (``gpu/``) is that type's name with
``Wire`` in front (``WireSamplingParams`` for ``SamplingParams``, ``WireTokenLogprob`` for
``TokenLogprob``), so code that holds both (the executor) says which one it has. Messages with
no engine counterpart carry no prefix; ``TextLogprob`` is a logprob after detokenization (the
token as text), which only the detokenizer and the gateway see.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar, Union, cast

import msgpack

SCHEMA_VERSION = 1

M = TypeVar("M", bound="Message")


class MessageError(ValueError):
    """A payload that is not the message it claims to be."""


class Message:
    """Base of every wire message (subclasses are frozen dataclasses)."""

    VERSION: ClassVar[int] = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def encode(self) -> bytes:
        payload = self.to_dict()
        payload["t"] = type(self).__name__
        payload["v"] = self.VERSION
        return msgpack.packb(payload, use_bin_type=True)  # type: ignore[no-any-return]

    @classmethod
    def decode(cls: type[M], data: bytes) -> M:
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise MessageError(f"{cls.__name__}: payload is not msgpack ({exc})") from exc
        if not isinstance(raw, dict):
            raise MessageError(f"{cls.__name__}: payload is not a map")
        tag, version = raw.pop("t", None), raw.pop("v", None)
        if tag != cls.__name__:
            raise MessageError(f"expected a {cls.__name__} message, got {tag!r}")
        if version != cls.VERSION:
            raise MessageError(f"{cls.__name__}: unsupported schema version {version!r}")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls: type[M], raw: dict[str, Any], path: str = "") -> M:
        where = path or cls.__name__
        kwargs = {}
        for name, convert, required in _plan(cast(Any, cls)):
            if name in raw:
                kwargs[name] = convert(raw[name], f"{where}.{name}")
            elif required:
                raise MessageError(f"{where}: missing field {name!r}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise MessageError(f"{where}: {exc}") from exc


def decode_any(data: bytes, *kinds: type[Message]) -> Message:
    """Decode a payload that may be any of ``kinds`` (chosen by its type tag)."""
    try:
        tag = msgpack.unpackb(data, raw=False, strict_map_key=False).get("t")
    except Exception as exc:
        raise MessageError(f"payload is not a msgpack map ({exc})") from exc
    for kind in kinds:
        if kind.__name__ == tag:
            return kind.decode(data)
    raise MessageError(f"unexpected message type {tag!r}")


def _plain(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_dict()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# Decoding is on every hop of a request, so each message class's field types are turned into
# converter functions once (typing.get_type_hints re-evaluates every annotation string per
# call: it was most of a ~0.6 ms decode of a 50-token request). A converter takes the raw
# value and the field's path (for the error message) and returns the typed value.
Converter = Callable[[Any, str], Any]


@functools.cache
def _plan(cls: Any) -> tuple[tuple[str, Converter, bool], ...]:  # a Message subclass
    hints = typing.get_type_hints(cls)
    return tuple(
        (
            f.name,
            _converter(hints[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    )


def _converter(hint: Any) -> Converter:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return _union(typing.get_args(hint))
    if origin is list or origin is tuple:
        args = typing.get_args(hint)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return _fixed_tuple(args)
        return _sequence(args[0], origin)
    if origin is dict:
        return _mapping(*typing.get_args(hint))
    if isinstance(hint, type) and issubclass(hint, Message):
        return _nested(hint)
    if hint is Any:
        return lambda value, path: value
    if hint is float:
        return _float
    if hint is int:
        return _int
    if hint in (str, bool, bytes):
        return _exact(hint)
    raise TypeError(f"unsupported message field type {hint!r}")


def _union(options: tuple[Any, ...]) -> Converter:
    none_ok = type(None) in options
    converters = [_converter(o) for o in options if o is not type(None)]

    def convert(value: Any, path: str) -> Any:
        if value is None and none_ok:
            return None
        errors = []
        for option in converters:
            try:
                return option(value, path)
            except MessageError as exc:
                errors.append(str(exc))
        raise MessageError(errors[0] if len(errors) == 1 else f"{path}: no variant matches")

    return convert


def _fixed_tuple(args: tuple[Any, ...]) -> Converter:
    converters = [_converter(a) for a in args]

    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, list | tuple):
            raise MessageError(f"{path}: expected a list, got {type(value).__name__}")
        if len(value) != len(converters):
            raise MessageError(f"{path}: expected {len(converters)} items, got {len(value)}")
        return tuple(
            c(v, f"{path}[{i}]") for i, (v, c) in enumerate(zip(value, converters, strict=True))
        )

    return convert


def _sequence(item_hint: Any, origin: Any) -> Converter:
    item = _converter(item_hint)
    # Token ids, hashes and strings: one C-speed type check for the whole list.
    exact = item_hint if item_hint in (int, str) else None

    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, list | tuple):
            raise MessageError(f"{path}: expected a list, got {type(value).__name__}")
        if exact is not None and all(type(v) is exact for v in value):
            items = list(value)
        else:
            items = [item(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items

    return convert


def _mapping(key_hint: Any, value_hint: Any) -> Converter:
    key, val = _converter(key_hint), _converter(value_hint)

    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise MessageError(f"{path}: expected a map, got {type(value).__name__}")
        return {key(k, f"{path} key"): val(v, f"{path}[{k!r}]") for k, v in value.items()}

    return convert


def _nested(kind: type[Message]) -> Converter:
    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise MessageError(f"{path}: expected a map, got {type(value).__name__}")
        return kind.from_dict(value, path)

    return convert


def _float(value: Any, path: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise MessageError(f"{path}: expected a number, got {type(value).__name__}")


def _int(value: Any, path: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise MessageError(f"{path}: expected an integer, got {type(value).__name__}")


def _exact(kind: type) -> Converter:
    def convert(value: Any, path: str) -> Any:
        if isinstance(value, kind):
            return value
        raise MessageError(f"{path}: expected {kind.__name__}, got {type(value).__name__}")

    return convert


# --- range checks ------------------------------------------------------------------------------
# Types are checked by the decoder; values are checked by the messages' ``__post_init__``,
# which raises ValueError (``from_dict`` turns it into a MessageError, so the runtime drops the
# message with a log line). Mesh-state messages (heartbeats, presence) feed routing and health
# for every request: one nonsensical value (a page size of 0) must not reach them.

MAX_ID_LEN = 256  # executor and instance ids travel in subjects and metric labels
MAX_PAGE_SIZE = 1 << 16  # tokens per KV page; real meshes use 1..256
MAX_SHARDS = 1024  # detokenizer shards
# Choices of one request: the tokenizer publishes one message per choice, so a forged n must not
# make it publish millions. Far above any --max-n (OpenAI allows 128).
MAX_CHOICES = 1024


def _require(kind: str, checks: dict[str, bool]) -> None:
    failed = [what for what, ok in checks.items() if not ok]
    if failed:
        raise ValueError(f"{kind}: " + "; ".join(failed))


def _id_ok(value: str) -> bool:
    """An id that may be spliced into a subject: non-empty, bounded, no whitespace or NATS
    wildcards, no empty subject token (dots are allowed: hostnames have them)."""
    return (
        0 < len(value) <= MAX_ID_LEN
        and not any(c.isspace() or c in "*>" for c in value)
        and "" not in value.split(".")
    )


def _time_ok(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def _page_size_ok(value: int) -> bool:
    return 1 <= value <= MAX_PAGE_SIZE


# --- gateway -> tokenizer ---------------------------------------------------------------------


@dataclass(frozen=True)
class WireSamplingParams(Message):
    """The request's sampling and stopping settings as validated by the gateway: the wire form
    of the engine's ``gpu.sampling.SamplingParams``.

    Every field but ``DETOKENIZER_ONLY`` is also a field of ``SamplingParams`` under the same
    name, and ``services.sampling`` converts by name: add a field to both.
    """

    # Applied to text by the detokenizer (it gets them in ``StreamStart``); the engine never
    # sees them.
    DETOKENIZER_ONLY: ClassVar[frozenset[str]] = frozenset({"stop", "skip_special_tokens"})

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True


@dataclass(frozen=True)
class ChatMessage(Message):
    role: str
    content: str


@dataclass(frozen=True)
class GenerateRequest(Message):
    """One prompt and the ``n`` sequences (OpenAI's choices) to generate from it.

    The tokenizer encodes the prompt once and forwards one ``TokenizedRequest`` per choice
    (``choices``): from there on each choice is a request of its own, under its own id. An
    error the tokenizer answers under ``request_id`` itself fails every choice.
    """

    request_id: str
    reply_to: str
    params: WireSamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    priority: int = 0
    deadline: float | None = None  # unix seconds; past it the request fails with a timeout
    arrival_time: float = 0.0
    n: int = 1

    def __post_init__(self) -> None:
        _require(
            "GenerateRequest", {f"n must be within 1..{MAX_CHOICES}": 1 <= self.n <= MAX_CHOICES}
        )

    def choice_ids(self) -> list[str]:
        """The request id of each choice, in choice order (the gateway awaits these)."""
        return [f"{self.request_id}-{i}" for i in range(self.n)]

    def choices(self) -> list[tuple[str, WireSamplingParams]]:
        """Each choice's request id and sampling settings. Choice ``i`` samples with seed + i,
        so seeded choices differ from each other yet repeat across identical requests (the
        gateway keeps seed + n - 1 in range); unseeded choices differ by their own draws, and
        greedy ones are all equal."""
        seed = self.params.seed
        return [
            (cid, self.params if seed is None or i == 0 else replace(self.params, seed=seed + i))
            for i, cid in enumerate(self.choice_ids())
        ]


# --- tokenizer -> scheduler -> executor ---------------------------------------------------------


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


@dataclass(frozen=True)
class Heartbeat(Message):
    """An executor's load, sent periodically; the scheduler routes by it."""

    executor_id: str
    running: int
    waiting: int
    free_pages: int
    total_pages: int
    page_size: int
    max_num_seqs: int
    pending_tokens: int  # prompt tokens still to prefill plus one per running decode
    draining: bool = False
    sent_at: float = 0.0
    # Which requests the executor holds: the scheduler learns from it which have finished,
    # and which to move elsewhere if the executor dies.
    request_ids: list[str] = field(default_factory=list)
    # Random per process start: a restarted executor under the same id is a new incarnation,
    # and the scheduler moves whatever the previous one held at once.
    incarnation: str = ""
    # The longest sequence (prompt + output) it can hold: the model's context or its KV pool,
    # whichever is less. The gateway checks its own --max-model-len against it.
    max_model_len: int = 0

    def __post_init__(self) -> None:
        # Only values no working executor sends: a rejected heartbeat makes the executor look
        # silent, and after the scheduler's timeout its requests are re-routed or failed.
        pages_ok = 0 <= self.free_pages <= self.total_pages
        _require(
            "Heartbeat",
            {
                "executor_id must be a non-empty subject-safe id": _id_ok(self.executor_id),
                "running must be >= 0": self.running >= 0,
                "waiting must be >= 0": self.waiting >= 0,
                "total_pages must be >= 1": self.total_pages >= 1,
                "free_pages must be within 0..total_pages": pages_ok,
                f"page_size must be within 1..{MAX_PAGE_SIZE}": _page_size_ok(self.page_size),
                "max_num_seqs must be >= 1": self.max_num_seqs >= 1,
                "pending_tokens must be >= 0": self.pending_tokens >= 0,
                "sent_at must be a finite time >= 0": _time_ok(self.sent_at),
                "request_ids must be non-empty strings": all(self.request_ids),
            },
        )


# --- every service -> watchers (gateway, scheduler) -----------------------------------------------


@dataclass(frozen=True)
class Presence(Message):
    """An "I am alive" from one service instance, sent about once a second by its runtime
    (``common/runtime.py``) on ``presence.<service>``, and at once when a watcher probes.

    ``draining``: it is shutting down and should not be counted on. The optional facts are
    the ones other stages must agree with: a detokenizer's ``shard``; a tokenizer's
    ``page_size`` (it hashes prompt pages with it; executors must page their KV cache the same
    way or cache-aware routing finds nothing) and ``detok_shards`` (how many detokenizer
    shards requests are spread over).
    """

    service: str
    instance_id: str
    draining: bool = False
    sent_at: float = 0.0
    shard: int | None = None
    page_size: int | None = None
    detok_shards: int | None = None

    def __post_init__(self) -> None:
        # The service name is one subject token of ``presence.<service>``: no dots.
        service_ok = len(self.service) <= 64 and _id_ok(self.service) and "." not in self.service
        shard_ok = self.shard is None or 0 <= self.shard < MAX_SHARDS
        page_ok = self.page_size is None or _page_size_ok(self.page_size)
        shards_ok = self.detok_shards is None or 1 <= self.detok_shards <= MAX_SHARDS
        _require(
            "Presence",
            {
                "service must be a short subject token": service_ok,
                "instance_id must be a non-empty subject-safe id": _id_ok(self.instance_id),
                "sent_at must be a finite time >= 0": _time_ok(self.sent_at),
                f"shard must be within 0..{MAX_SHARDS - 1}": shard_ok,
                f"page_size must be within 1..{MAX_PAGE_SIZE}": page_ok,
                f"detok_shards must be within 1..{MAX_SHARDS}": shards_ok,
            },
        )


@dataclass(frozen=True)
class PresenceProbe(Message):
    """A watcher that just (re)connected asks every service to announce itself now, so its
    view of the mesh is complete at once rather than after a full announcement interval."""

    asker: str = ""


# --- executor -> detokenizer ----------------------------------------------------------------------


@dataclass(frozen=True)
class WireTokenLogprob(Message):
    """One generated token's logprob and its top alternatives, by token id: the wire form of
    the engine's ``gpu.engine.TokenLogprob`` (the detokenizer turns it into a ``TextLogprob``).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


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


@dataclass(frozen=True)
class SeqTokens(Message):
    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    output_tokens: int
    start: StreamStart | None = None
    logprobs: list[WireTokenLogprob] | None = None


@dataclass(frozen=True)
class StepTokens(Message):
    """Every new token of one executor step for one detokenizer shard."""

    executor_id: str
    seqs: list[SeqTokens]
    incarnation: str = ""  # the executor process's (``Heartbeat.incarnation``)


# --- gateway -> scheduler (request/reply) -------------------------------------------------------


@dataclass(frozen=True)
class RequestStatusQuery(Message):
    """The gateway has heard nothing of these requests for a while: are they still alive?"""

    request_ids: list[str]


@dataclass(frozen=True)
class RequestStatusReply(Message):
    """The ids the scheduler holds (queued, or routed to an executor that is alive)."""

    known: list[str]


# --- scheduler -> detokenizer shard (request/reply) ----------------------------------------------


@dataclass(frozen=True)
class StreamProgressRequest(Message):
    """The scheduler moves these requests away from ``executor_id`` (lost): which tokens has
    each streamed? The detokenizer stops accepting their tokens from that executor from now."""

    executor_id: str
    request_ids: list[str]
    incarnation: str = ""  # which process under that id (a restarted one is not withdrawn)


@dataclass(frozen=True)
class StreamProgressReply(Message):
    """Tokens received so far per stream this shard holds (a request absent here and from
    ``ended`` never started); ``ended``: finished or aborted, nothing to move."""

    streamed: dict[str, list[int]]
    ended: list[str] = field(default_factory=list)


# --- detokenizer / any stage -> gateway -----------------------------------------------------------


@dataclass(frozen=True)
class TextLogprob(Message):
    """A ``WireTokenLogprob`` detokenized: the token and its alternatives as text, and the
    token's UTF-8 bytes (a token may hold part of a character)."""

    token: str
    logprob: float
    token_bytes: list[int]
    top: list[tuple[str, float]] = field(default_factory=list)


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
    usage: Usage | None = None
    logprobs: list[TextLogprob] | None = None


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


# --- executor -> prefix-cache index (JetStream) -> scheduler ------------------------------------


@dataclass(frozen=True)
class KVEventBatch(Message):
    """Changes to one executor's prefix cache, in order; one batch per executor step.

    ``seq`` counts an executor's batches from 1 since it started; a gap tells the index it
    missed changes. Apply in this order: ``cleared`` (forget everything the executor held),
    then ``evicted``, then ``stored`` (``(page_hash, parent_hash)``, chained hashes from
    ``common.page_hash``; the parent of a prompt's first page is ``ROOT_HASH``). A batch with
    ``cleared`` followed by stored pages is a full snapshot of the executor's cache.
    """

    executor_id: str
    seq: int
    cleared: bool = False
    evicted: list[int] = field(default_factory=list)
    stored: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class IndexMatchRequest(Message):
    """Scheduler -> index: how much of this prompt does each executor hold?"""

    page_hashes: list[int]
    request_id: str = ""


@dataclass(frozen=True)
class IndexMatchReply(Message):
    """Pages of the prompt's prefix (leading page hashes) each executor holds; absent = 0."""

    overlaps: dict[str, int]
    num_executors: int = 0


# --- executor -> speculator (request/reply) -------------------------------------------------------


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
    released: list[str] = field(default_factory=list)  # finished since the last call: forget


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
