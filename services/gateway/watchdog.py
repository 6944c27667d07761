"""Requests that went silent: ask the scheduler whether they are still alive, fail those lost.

A request travels gateway -> tokenizer -> scheduler -> executor as one-way messages, so one
that dies with a process on the way (a tokenizer killed while it held it, a scheduler
restarted with it queued, an executor lost after a scheduler restart, so no one can move it)
would leave its client waiting for the whole request timeout. Every ``STALL_S`` the gateway
asks the scheduler about its requests that have had no event for that long; one the scheduler
does not know in two checks in a row (the second one ``STALL_S`` later, so a request still
being tokenized, or being moved off a lost executor, is not mistaken for lost) gets a 503
``request_lost`` event: its stream resumes it from the tokens its client has (``resume.py``),
or, with no resumes left, fails with it (the client can retry). A scheduler that does not
answer changes nothing: health reports it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol, TypeVar

from common.runtime import NoAnswer
from common.subjects import Subjects
from common.wire.codec import Message
from common.wire.gateway import ErrorEvent
from common.wire.scheduler import RequestStatusQuery, RequestStatusReply
from services.gateway.streams import Inbox

log = logging.getLogger("meshserve.gateway")

STALL_S = 5.0  # silence before a request is checked; a queued request is only ever checked
STRIKES = 2  # consecutive "unknown" answers before it is failed
ASK_TIMEOUT_S = 1.0

M = TypeVar("M", bound=Message)


class Asker(Protocol):
    """What the watchdog needs of its service (a ``common.runtime.Service``): the subjects, and
    a request that waits for one answer."""

    @property
    def subjects(self) -> Subjects: ...

    async def request(
        self, subject: str, message: Message, reply_kind: type[M], timeout: float, /
    ) -> M: ...


async def check_stalled(
    service: Asker, inbox: Inbox, stall_s: float = STALL_S, queued_since: float | None = None
) -> int:
    """One round: returns how many requests (choices) it failed. ``queued_since``: a
    tokenizer is still working through requests that arrived then (wall clock) with more
    behind (``MeshLiveness.tokenizers_behind_since``); a request sent after it may be
    waiting there, unknown to the scheduler yet, and gets no strike."""
    now = asyncio.get_running_loop().time()
    stalled = [s for s in inbox.streams() if now - s.last_event_at >= stall_s and s.unfinished]
    if not stalled:
        return 0
    ids = [rid for s in stalled for rid in s.unfinished]
    try:
        reply = await service.request(
            service.subjects.scheduler_status,
            RequestStatusQuery(ids),
            RequestStatusReply,
            ASK_TIMEOUT_S,
        )
    except NoAnswer as exc:
        log.warning("gateway: the scheduler did not answer about stalled requests: %s", exc)
        return 0
    known = set(reply.known)
    failed = 0
    for stream in stalled:
        stream.last_event_at = now  # checked: again after another STALL_S
        strikes, unfinished = stream.unknown_checks, stream.unfinished
        for rid in list(strikes):
            if rid in known or rid not in unfinished:
                del strikes[rid]  # alive (queued, or running), or done with
        unknown = [rid for rid in unfinished if rid not in known]
        if queued_since is not None and stream.submitted_at >= queued_since:
            continue  # maybe queued at a tokenizer behind on older requests
        for rid in unknown:
            strikes[rid] = strikes.get(rid, 0) + 1
        # each its own strikes: one choice's do not count towards another's
        lost = [rid for rid in unknown if strikes[rid] >= STRIKES]
        if not lost:
            continue
        log.warning("gateway: %s lost in the mesh", ", ".join(lost))
        # Every lost choice at once: a stream's silence is checked as a whole, and a resumed
        # choice's events would keep it from looking silent while the others wait.
        for rid in lost:
            stream.put(
                ErrorEvent(
                    rid,
                    503,
                    "The request was lost in the mesh (a service restarted); retry the request.",
                    "server_error",
                    "request_lost",
                )
            )
        failed += len(lost)
    return failed
