"""Per-request fan-in: the gateway's one inbox subscription -> one queue per HTTP request.

Every stage replies to the same inbox subject (``subjects.gateway_inbox(instance_id)``), so one
subscription serves all requests; ``Inbox.deliver`` routes each ``TextDelta`` / ``ErrorEvent``
by its ``request_id`` to the ``RequestStream`` of the HTTP request that owns it (one HTTP
request with ``n`` choices owns ``n`` choice ids, and its own id: the tokenizer answers an
error for the whole request under it, before the request splits into choices).
"""

from __future__ import annotations

import asyncio
import logging

from common.runtime import RequestError
from common.wire.codec import MessageError, decode_any
from common.wire.gateway import ErrorEvent, TextDelta, TextDeltas
from services.gateway.observe import RequestObserver

log = logging.getLogger("meshserve.gateway")

InboxEvent = TextDelta | ErrorEvent


class RequestStream:
    """The events of one HTTP request's sub-requests, in arrival order.

    Iterating yields ``(choice_index, TextDelta)`` until every choice has a finish_reason. An
    ``ErrorEvent`` for any choice, or for ``request_id`` (the whole request), raises
    ``RequestError`` (the request fails as a whole, so the caller aborts the other choices);
    passing the deadline raises a 504 ``RequestError``. ``failure`` then says why, for the
    abort reason.
    """

    def __init__(
        self, request_ids: list[str], deadline: float, request_id: str | None = None
    ) -> None:
        self.request_ids = tuple(request_ids)  # the choices'
        self.request_id = request_id
        self.deadline = deadline  # event-loop time
        self.failure: str | None = None
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._open = set(request_ids)
        self._seq = dict.fromkeys(request_ids, 0)  # TextDelta.seq of the last delta taken
        self._queue: asyncio.Queue[InboxEvent] = asyncio.Queue()
        self.observer: RequestObserver | None = None  # latency metrics, fed as events are taken
        # Event-loop time of the last sign of life (opened, or an event arrived), and how many
        # checks in a row found it unknown to the scheduler (``watchdog.py``).
        self.last_event_at = asyncio.get_running_loop().time()
        self.unknown_checks = 0

    @property
    def routed_ids(self) -> list[str]:
        """Every id whose events belong to this stream: the choices', and the request's."""
        return [*self.request_ids, *([self.request_id] if self.request_id else [])]

    @property
    def unfinished(self) -> list[str]:
        """Sub-requests that are still generating (the ones to abort if the client leaves)."""
        return [rid for rid in self.request_ids if rid in self._open]

    def put(self, event: InboxEvent) -> None:
        self.last_event_at = asyncio.get_running_loop().time()
        self.unknown_checks = 0
        self._queue.put_nowait(event)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, TextDelta]:
        while self._open:
            event = await self._next_event()
            whole = event.request_id == self.request_id and isinstance(event, ErrorEvent)
            if event.request_id not in self._open and not whole:
                continue  # a late event for a choice that already ended
            if isinstance(event, ErrorEvent):
                # The failing stage has dropped that choice. One that failed the whole request
                # may have forwarded some choices already: they all stay open, to be aborted.
                self._open.discard(event.request_id)
                failed = "the request" if whole else "another choice"
                self.failure = f"{failed} failed: {event.message}"
                raise self._failed(
                    RequestError(event.message, event.status, event.type, event.param, event.code)
                )
            if event.seq and event.seq != self._seq[event.request_id] + 1:
                self._open.discard(event.request_id)
                self.failure = f"delta {self._seq[event.request_id] + 1} lost on the way"
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
            self._seq[event.request_id] = event.seq
            if event.finish_reason is not None:
                self._open.discard(event.request_id)
            index = self._index[event.request_id]
            if self.observer is not None:
                self.observer.delta(index, event)
            return index, event
        raise StopAsyncIteration

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

    def fail_all(self, message: str, status: int) -> None:
        """End every open request with an error event (e.g. the bus connection was lost)."""
        for rid, stream in list(self._streams.items()):
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
            if stream is not None:
                stream.put(event)
            # else: the request already ended (finished, aborted, timed out); late events are
            # expected after an abort and are dropped.
