"""Pick an executor for a request from the executors' reported load (pure; no NATS).

Cost of sending a request to executor e (as Dynamo's KV router scores workers):
    overlap_weight * (request pages not cached on e) + (sequences on e) + (pages e must prefill)
lowest wins. Without prefix-cache knowledge every executor has zero overlap and the rule
reduces to least load. Executors are only offered work while they have room (late binding): a
request waits in the scheduler's global queue, where priority and fairness are decided, rather
than in an executor's local queue.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from common.messages import Heartbeat, TokenizedRequest

POLICIES = ("kv", "least-load", "round-robin")


@dataclass
class ExecutorState:
    heartbeat: Heartbeat
    last_seen: float = field(default_factory=time.monotonic)
    assigned_since_heartbeat: int = 0
    assigned_tokens_since_heartbeat: int = 0

    @property
    def sequences(self) -> int:
        hb = self.heartbeat
        return hb.running + hb.waiting + self.assigned_since_heartbeat

    @property
    def pending_pages(self) -> float:
        tokens = self.heartbeat.pending_tokens + self.assigned_tokens_since_heartbeat
        return tokens / self.heartbeat.page_size

    def has_room(self, slack: float) -> bool:
        return not self.heartbeat.draining and self.sequences < self.heartbeat.max_num_seqs * (
            1 + slack
        )


@dataclass
class Router:
    policy: str = "least-load"
    overlap_weight: float = 1.0
    heartbeat_timeout_s: float = 2.0
    slack: float = 0.25  # how far past max_num_seqs an executor's local queue may grow
    executors: dict[str, ExecutorState] = field(default_factory=dict)
    _rr: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown router policy {self.policy!r}; choose from {POLICIES}")

    def observe(self, hb: Heartbeat) -> None:
        state = self.executors.get(hb.executor_id)
        if state is None:
            self.executors[hb.executor_id] = ExecutorState(hb)
        else:
            state.heartbeat = hb
            state.last_seen = time.monotonic()
            state.assigned_since_heartbeat = 0
            state.assigned_tokens_since_heartbeat = 0

    def alive(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [
            eid
            for eid, s in self.executors.items()
            if now - s.last_seen <= self.heartbeat_timeout_s
        ]

    def forget_dead(self, now: float | None = None) -> list[str]:
        living = set(self.alive(now))
        dead = [eid for eid in self.executors if eid not in living]
        for eid in dead:
            del self.executors[eid]
        return dead

    def cost(self, state: ExecutorState, req: TokenizedRequest, overlap_pages: int) -> float:
        page_size = state.heartbeat.page_size
        request_pages = -(-len(req.prompt_token_ids) // page_size)
        uncached = max(0, request_pages - overlap_pages)
        weight = self.overlap_weight if self.policy == "kv" else 1.0
        return weight * uncached + state.sequences + state.pending_pages

    def pick(self, req: TokenizedRequest, overlaps: dict[str, int] | None = None) -> str | None:
        """The executor to send ``req`` to now, or None if none has room (it keeps waiting)."""
        candidates = sorted(e for e in self.alive() if self.executors[e].has_room(self.slack))
        if not candidates:
            return None
        if self.policy == "round-robin":
            return candidates[next(self._rr) % len(candidates)]
        overlaps = overlaps or {}
        return min(
            candidates,
            key=lambda e: (self.cost(self.executors[e], req, overlaps.get(e, 0)), e),
        )

    def assigned(self, executor_id: str, req: TokenizedRequest) -> None:
        state = self.executors[executor_id]
        state.assigned_since_heartbeat += 1
        state.assigned_tokens_since_heartbeat += len(req.prompt_token_ids)
