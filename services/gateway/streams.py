"""Per-request fan-in: the gateway's one inbox subscription -> one queue per HTTP request.

Every stage replies to the same inbox subject (``subjects.gateway_inbox(instance_id)``), so one
subscription serves all requests; ``Inbox.deliver`` routes each ``TextDelta`` / ``ErrorEvent``
by its ``request_id`` to the ``RequestStream`` of the HTTP request that owns it (one HTTP
request with ``n`` choices owns ``n`` choice ids, and its own id: the tokenizer answers an
error for the whole request under it, before the request splits into choices; a choice
resumed after a loss in transit owns its continuation's ids too, ``resume.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from opentelemetry.trace import Span

from common.runtime import RequestError
from common.wire.codec import MessageError, decode_any
from common.wire.gateway import ErrorEvent, TextDelta, TextDeltas
from common.wire.tokenizer import GenerateRequest
from services.gateway.observe import RequestObserver
from services.gateway.resume import Resubmitter, continuation, resumable

log = logging.getLogger("meshserve.gateway")

InboxEvent = TextDelta | ErrorEvent


class RequestStream:
    """The events of one HTTP request's sub-requests, in arrival order.

    Iterating yields ``(choice_index, TextDelta)`` until every choice has a finish_reason. A
    choice lost in transit (``resume.RESUMABLE``: an error event with such a code, or a gap in
    its deltas' numbers) is resumed as a continuation when ``resubmitter`` is set and the
    choice has resumes left, and its deltas go on under the continuation's ids; iterating
    never shows the loss. Any other ``ErrorEvent`` for a choice, or one for ``request_id``
    (the whole request), raises ``RequestError`` (the request fails as a whole, so the caller
    aborts the other choices); passing the deadline raises a 504 ``RequestError``.
    ``failure`` then says why, for the abort reason.
    """

    def __init__(
        self, request_ids: list[str], deadline: float, request_id: str | None = None
    ) -> None:
        self.request_id = request_id
        self.deadline = deadline  # event-loop time
        self.failure: str | None = None
        # Every id whose events belong to a choice -> that choice: its own id, and each of its
        # continuations' (the continuation request's id and its one choice's).
        self._choice_of = {rid: i for i, rid in enumerate(request_ids)}
        # Per choice, the ids of the attempt now generating it; the last one is what the
        # scheduler and executors know it by. Events of an earlier attempt are dropped.
        self._attempt: list[tuple[str, ...]] = [(rid,) for rid in request_ids]
        self._open = set(range(len(request_ids)))
        self._seq: dict[str, int] = {}  # TextDelta.seq of the last delta taken, per id
        self._delivered: list[list[int]] = [[] for _ in request_ids]  # tokens taken, per choice
        self.resumes = [0] * len(request_ids)
        # The sub-request ids of attempts that choices were resumed away from (their aborts
        # may have been lost: they may still generate).
        self.left_behind: list[str] = []
        self._queue: asyncio.Queue[InboxEvent] = asyncio.Queue()
        self.observer: RequestObserver | None = None  # latency metrics, fed as events are taken
        self.span: Span | None = None  # a batched prompt's gateway.prompt: ended on release
        # Resumption (``resume.py``), set by ``MeshClient.submit``: the request as submitted,
        # who publishes a continuation, and how many each choice may have (0: none).
        self.origin: GenerateRequest | None = None
        self.resubmitter: Resubmitter | None = None
        self.max_resumes = 0
        # Event-loop time of the last sign of life (opened, or an event arrived), and per
        # sub-request how many checks in a row found it unknown to the scheduler
        # (``watchdog.py``).
        self.last_event_at = asyncio.get_running_loop().time()
        self.unknown_checks: dict[str, int] = {}
        # Wall-clock time its latest attempt was sent into the mesh (the first, or a
        # continuation): a tokenizer still behind on requests older than that may hold it.
        self.submitted_at = time.time()

    @property
    def routed_ids(self) -> list[str]:
        """Every id whose events belong to this stream: the choices' and their continuations',
        and the request's."""
        return [*self._choice_of, *([self.request_id] if self.request_id else [])]

    @property
    def unfinished(self) -> list[str]:
        """Sub-requests that are still generating (the ones to abort if the client leaves)."""
        return [self._attempt[i][-1] for i in sorted(self._open)]

    def abandoned(self, request_id: str) -> bool:
        """An id of an attempt its choice has left (resumed under another id): it may still
        be generating somewhere (across a partition, or where an abort was lost)."""
        index = self._choice_of.get(request_id)
        return index is not None and request_id not in self._attempt[index]

    def put(self, event: InboxEvent) -> bool:
        """Queue ``event``; False, and no sign of life, for an abandoned attempt's: a stream
        still hearing from the attempt it left looked alive to the watchdog while the
        continuation it waits for was lost."""
        if self.abandoned(event.request_id):
            return False
        self.last_event_at = asyncio.get_running_loop().time()
        self.unknown_checks.clear()
        self._queue.put_nowait(event)
        return True

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, TextDelta]:
        while self._open:
            event = await self._next_event()
            rid = event.request_id
            if rid == self.request_id:
                if isinstance(event, ErrorEvent):
                    # The tokenizer failed the whole request; it may have forwarded some
                    # choices already: they all stay open, to be aborted.
                    self.failure = f"the request failed: {event.message}"
                    raise self._failed(self._error(event))
                continue
            index = self._choice_of.get(rid)
            if index is None or index not in self._open or rid not in self._attempt[index]:
                continue  # a late event for a choice that ended, or for an attempt it left
            # A choice that fails here stays open: ``release`` aborts it with the others.
            # The stage that failed it may have dropped it, but a loss in transit (a gap, a
            # request the watchdog found lost) leaves it generating upstream.
            if isinstance(event, ErrorEvent):
                if await self._resume(index, event.status, event.code, event.message):
                    continue
                self.failure = f"a choice failed: {event.message}"
                raise self._failed(self._error(event))
            expected = self._seq.get(rid, 0) + 1
            if event.seq and event.seq != expected:
                why = f"delta {expected} lost on the way"
                if await self._resume(index, 503, "stream_gap", why):
                    continue
                self.failure = why
                raise self._failed(
                    RequestError(
                        "The stream lost part of its text on the way (a message-bus server "
                        "failed); retry the request.",
                        503,
                        "server_error",
                        None,
                        "stream_gap",
                    )
                )
            self._seq[rid] = event.seq
            self._delivered[index].extend(event.token_ids)
            if event.finish_reason is not None:
                self._open.discard(index)
            if self.observer is not None:
                self.observer.delta(index, event)
            return index, event
        raise StopAsyncIteration

    async def _resume(self, index: int, status: int, code: str | None, why: str) -> bool:
        """Continue choice ``index`` after the tokens its client has; False when it may not
        (not a loss in transit, no resumes left, past its deadline, the mesh refused)."""
        if (
            self.resubmitter is None
            or self.origin is None
            or not resumable(status, code)
            or self.resumes[index] >= self.max_resumes
            or asyncio.get_running_loop().time() >= self.deadline
        ):
            return False
        self.resumes[index] += 1
        lost = self._attempt[index][-1]
        delivered = self._delivered[index]
        request = continuation(self.origin, index, delivered, self.resumes[index])
        ids = (request.request_id, *request.choice_ids())
        for rid in ids:
            self._choice_of[rid] = index
        lost_attempt, self._attempt[index] = self._attempt[index], ids  # before publishing:
        try:  # its first events may come at once
            await self.resubmitter.resubmit(self, request, lost)
        except RequestError as exc:
            log.warning("gateway: could not resume %s (%s): %s", lost, why, exc)
            self._attempt[index] = lost_attempt  # what ``release`` then aborts
            return False
        self.left_behind.append(lost)
        log.info(
            "gateway: resumed %s as %s after %d tokens (%s: %s)",
            lost, ids[-1], len(delivered), code, why,
        )  # fmt: skip
        if self.observer is not None:
            self.observer.resumed(index, code or "", len(delivered), self.resumes[index])
        return True

    @staticmethod
    def _error(event: ErrorEvent) -> RequestError:
        return RequestError(event.message, event.status, event.type, event.param, event.code)

    async def _next_event(self) -> InboxEvent:
        try:
            async with asyncio.timeout_at(self.deadline):
                return await self._queue.get()
        except TimeoutError:
            self.failure = "request timed out"
            raise self._failed(
                RequestError(
                    "The request timed out before generation finished.",
                    504,
                    "timeout_error",
                    None,
                    "request_timeout",
                )
            ) from None

    def _failed(self, error: RequestError) -> RequestError:
        if self.observer is not None:
            self.observer.failed(error)
        return error


class Inbox:
    """Routes inbox messages to the open ``RequestStream`` of each request id."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        # Told of each event from an abandoned attempt (``RequestStream.abandoned``): the
        # gateway aborts it again (``MeshClient``).
        self.on_abandoned: Callable[[str], None] | None = None

    def __len__(self) -> int:
        """How many HTTP requests are in flight."""
        return len(set(self._streams.values()))

    def open(
        self, request_ids: list[str], timeout_s: float, request_id: str | None = None
    ) -> RequestStream:
        """A stream for the choices ``request_ids`` of the request ``request_id``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        stream = RequestStream(request_ids, deadline, request_id)
        for rid in stream.routed_ids:
            self._streams[rid] = stream
        return stream

    def close(self, stream: RequestStream) -> None:
        for rid in stream.routed_ids:
            self._streams.pop(rid, None)

    def streams(self) -> list[RequestStream]:
        """The open streams, each once."""
        return list({id(s): s for s in self._streams.values()}.values())

    def route(self, stream: RequestStream, request_ids: list[str]) -> None:
        """Send these ids' events to ``stream`` too (a choice's continuation)."""
        for rid in request_ids:
            self._streams[rid] = stream

    def fail_all(self, message: str, status: int) -> None:
        """End every open request's choices with an error event (e.g. the bus connection was
        lost): each is resumed, if it may be, or fails."""
        for stream in self.streams():
            for rid in stream.unfinished:
                stream.put(ErrorEvent(rid, status, message, "server_error", "mesh_unavailable"))

    def deliver(self, payload: bytes) -> None:
        try:
            message = decode_any(payload, TextDeltas, ErrorEvent)
        except MessageError as exc:
            log.error("gateway: dropping bad inbox message: %s", exc)
            return
        events: list[InboxEvent] = (
            list(message.deltas) if isinstance(message, TextDeltas) else [message]  # type: ignore[list-item]
        )
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is not None and not stream.put(event) and self.on_abandoned is not None:
                self.on_abandoned(event.request_id)
            # else: the request already ended (finished, aborted, timed out); late events are
            # expected after an abort and are dropped.


class BatchedStreams:
    """The streams of a batched completions request (one per prompt) as one: choice ``i`` of
    prompt ``k`` is choice ``k * n + i``. Deltas come in arrival order across the prompts; the
    first failure of any fails the whole request (``MeshClient.release`` then aborts every
    stream's open choices)."""

    def __init__(self, streams: list[RequestStream], n: int) -> None:
        self.streams = streams
        self.n = n
        self._next: dict[asyncio.Task[tuple[int, TextDelta]], int] = {}  # -> its stream
        self._started = False

    @property
    def failure(self) -> str | None:
        return next((s.failure for s in self.streams if s.failure is not None), None)

    @failure.setter
    def failure(self, why: str | None) -> None:
        for stream in self.streams:
            stream.failure = stream.failure or why

    def __aiter__(self) -> BatchedStreams:
        return self

    async def __anext__(self) -> tuple[int, TextDelta]:
        if not self._started:
            self._started = True
            for k in range(len(self.streams)):
                self._ask(k)
        while self._next:
            done, _ = await asyncio.wait(self._next, return_when=asyncio.FIRST_COMPLETED)
            task = min(done, key=lambda t: self._next[t])  # (several: the lowest prompt first)
            k = self._next.pop(task)
            try:
                index, delta = task.result()
            except StopAsyncIteration:
                continue
            except RequestError as exc:  # one prompt failed: the batch fails with it
                self.fail_all(exc, f"prompt {k} of the batch failed: {exc}")
                self.close()
                raise
            except BaseException:
                self.close()
                raise
            self._ask(k)
            return k * self.n + index, delta
        raise StopAsyncIteration

    def fail_all(self, error: RequestError, why: str) -> None:
        """Every prompt's open choices fail with ``error`` (counted as its failures, aborted
        for ``why``), not only the one whose prompt failed."""
        for stream in self.streams:
            if stream.observer is not None:
                stream.observer.failed(error)
            stream.failure = stream.failure or why

    def _ask(self, k: int) -> None:
        task = asyncio.ensure_future(anext(self.streams[k]))
        self._next[task] = k

    def close(self) -> None:
        """Stop waiting on the streams (the request ended: failed, cancelled or done)."""
        for task in self._next:
            task.cancel()
        self._next.clear()
