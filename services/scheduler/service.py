"""Scheduler handlers: admit (429 when the queue is full), queue by priority, dispatch.

Requests wait here until an executor has room (late binding), highest priority first, then
oldest first. State is rebuilt from heartbeats after a restart; one replica is active at a time
(a second replica in the same queue group shares the submit stream but each keeps its own queue).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import time
from dataclasses import dataclass

from common.config import MeshConfig, env
from common.messages import AbortRequests, ErrorEvent, Heartbeat, TokenizedRequest
from common.runtime import RequestError, Service
from services.scheduler.router import POLICIES, Router


@dataclass(frozen=True)
class SchedulerServiceConfig:
    mesh: MeshConfig
    router: str = "least-load"
    max_queue: int = 1024
    heartbeat_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.router not in POLICIES:
            raise ValueError(f"--router must be one of {POLICIES}")
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")


def parse_args(argv: list[str] | None = None) -> SchedulerServiceConfig:
    p = argparse.ArgumentParser("python -m services.scheduler")
    MeshConfig.add_args(p)
    p.add_argument("--router", choices=POLICIES, default=env("ROUTER", "least-load"))
    p.add_argument("--max-queue", type=int, default=int(env("MAX_QUEUE", "1024")))
    p.add_argument(
        "--heartbeat-timeout", type=float, default=float(env("HEARTBEAT_TIMEOUT", "2.0"))
    )
    a = p.parse_args(argv)
    return SchedulerServiceConfig(
        MeshConfig.from_args(a), a.router, a.max_queue, a.heartbeat_timeout
    )


class SchedulerService:
    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        self.svc = Service("scheduler", config.mesh)
        self.router = Router(config.router, heartbeat_timeout_s=config.heartbeat_timeout_s)
        self.queue: list[tuple[int, int, TokenizedRequest]] = []  # (-priority, order, request)
        self.aborted: set[str] = set()
        self.order = itertools.count()
        self.dispatched = 0

    async def start(self) -> None:
        await self.svc.connect()
        s = self.svc.subjects
        await self.svc.subscribe(s.scheduler_submit, TokenizedRequest, self.on_submit, "scheduler")
        await self.svc.subscribe(s.executor_heartbeat, Heartbeat, self.on_heartbeat)
        await self.svc.subscribe(s.abort, AbortRequests, self.on_abort)
        self.svc.spawn(self.svc.every(0.2, self.sweep), "sweep")

    async def on_submit(self, req: TokenizedRequest) -> None:
        if len(self.queue) >= self.config.max_queue:
            raise RequestError(
                "The server is overloaded: the request queue is full; retry later.",
                status=429,
                type="rate_limit_error",
                code="queue_full",
            )
        heapq.heappush(self.queue, (-req.priority, next(self.order), req))
        await self.dispatch()

    async def on_heartbeat(self, hb: Heartbeat) -> None:
        self.router.observe(hb)
        await self.dispatch()

    async def on_abort(self, msg: AbortRequests) -> None:
        queued = {item[2].request_id for item in self.queue}
        self.aborted.update(rid for rid in msg.request_ids if rid in queued)

    async def dispatch(self) -> None:
        while self.queue:
            req = self.queue[0][2]
            if req.request_id in self.aborted:
                heapq.heappop(self.queue)
                self.aborted.discard(req.request_id)
                continue
            executor = self.router.pick(req)
            if executor is None:
                return  # nobody has room: it waits here, in priority order
            heapq.heappop(self.queue)
            self.router.assigned(executor, req)
            await self.svc.publish(self.svc.subjects.executor_submit(executor), req)
            self.dispatched += 1

    async def sweep(self) -> None:
        """Fail queued requests whose deadline passed; forget executors that went silent."""
        self.router.forget_dead()
        now = time.time()
        expired = [item for item in self.queue if item[2].deadline and item[2].deadline < now]
        if expired:
            self.queue = [item for item in self.queue if item not in expired]
            heapq.heapify(self.queue)
            for _, _, req in expired:
                await self.svc.publish(
                    req.reply_to,
                    ErrorEvent(
                        req.request_id,
                        504,
                        "request timed out waiting for an executor",
                        "timeout_error",
                        "queue_timeout",
                    ),
                )
        await self.dispatch()
