"""Which executor holds which request, learned from dispatches and heartbeats (pure; no NATS).

A request is *seen* once its executor lists it in a heartbeat; a seen request that a later
heartbeat no longer lists has finished. When an executor dies, its requests move elsewhere
(``take_executor``); what each had streamed is the detokenizer's to say, not a heartbeat's
(a heartbeat is up to one period old: a request that streamed just before its executor died
would look unstarted, and its client would get the old tokens and then a whole new answer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry.context import Context

from common.wire.executor import TokenizedRequest
from common.wire.scheduler import Heartbeat

# A request's place in the global queue: (priority key, arrival order); kept if it re-queues.
Rank = tuple[float, int]


@dataclass
class Assignment:
    executor_id: str
    request: TokenizedRequest
    rank: Rank
    trace: Context | None = None  # the request's trace, continued if it is routed again
    assigned_at: float = field(default_factory=time.monotonic)
    seen: bool = False


@dataclass
class Inflight:
    unseen_timeout_s: float = 10.0
    assignments: dict[str, Assignment] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.assignments)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.assignments

    def assign(self, executor_id: str, req: TokenizedRequest, rank: Rank) -> Assignment:
        assignment = Assignment(executor_id, req, rank)
        self.assignments[req.request_id] = assignment
        return assignment

    def drop(self, request_id: str) -> None:
        self.assignments.pop(request_id, None)

    def observe(self, hb: Heartbeat) -> None:
        listed = set(hb.request_ids)
        now = time.monotonic()
        for rid, a in list(self.assignments.items()):
            if a.executor_id != hb.executor_id:
                continue
            if rid in listed:
                a.seen = True
            elif a.seen or now - a.assigned_at > self.unseen_timeout_s:
                # Finished (or rejected by the executor, which answered the client itself).
                del self.assignments[rid]

    def guests_by_executor(self) -> dict[str, int]:
        """Executor -> the guests (requests from another region) dispatched to it, unfinished."""
        held: dict[str, int] = {}
        for a in self.assignments.values():
            if a.request.guest:
                held[a.executor_id] = held.get(a.executor_id, 0) + 1
        return held

    def take_executor(self, executor_id: str) -> list[Assignment]:
        """Remove and return a dead executor's requests."""
        mine = [a for a in self.assignments.values() if a.executor_id == executor_id]
        for a in mine:
            del self.assignments[a.request.request_id]
        return mine
