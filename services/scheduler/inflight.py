"""Which executor holds which request, learned from dispatches and heartbeats (pure; no NATS).

A request is *seen* once its executor lists it in a heartbeat and *started* once the executor
says it has streamed tokens. A seen request that a later heartbeat no longer lists has finished.
When an executor dies, its requests split in two: those that never streamed can run elsewhere
(re-routed), those that did cannot be resumed transparently (their clients get an error).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.messages import Heartbeat, TokenizedRequest


@dataclass
class Assignment:
    executor_id: str
    request: TokenizedRequest
    order: int  # the request's place in the global queue, kept if it is re-queued
    assigned_at: float = field(default_factory=time.monotonic)
    seen: bool = False
    started: bool = False


@dataclass
class Inflight:
    unseen_timeout_s: float = 10.0
    assignments: dict[str, Assignment] = field(default_factory=dict)

    def assign(self, executor_id: str, req: TokenizedRequest, order: int) -> None:
        self.assignments[req.request_id] = Assignment(executor_id, req, order)

    def drop(self, request_id: str) -> None:
        self.assignments.pop(request_id, None)

    def observe(self, hb: Heartbeat) -> None:
        listed = set(hb.request_ids)
        started = set(hb.started_ids)
        now = time.monotonic()
        for rid, a in list(self.assignments.items()):
            if a.executor_id != hb.executor_id:
                continue
            if rid in listed:
                a.seen = True
                a.started = a.started or rid in started
            elif a.seen or now - a.assigned_at > self.unseen_timeout_s:
                # Finished (or rejected by the executor, which answered the client itself).
                del self.assignments[rid]

    def take_executor(self, executor_id: str) -> tuple[list[Assignment], list[Assignment]]:
        """Remove a dead executor's requests: (not yet streamed, already streaming)."""
        mine = [a for a in self.assignments.values() if a.executor_id == executor_id]
        for a in mine:
            del self.assignments[a.request.request_id]
        return [a for a in mine if not a.started], [a for a in mine if a.started]
