"""Scheduler handlers: admit (429 when the queue is full), queue by priority, dispatch.

Requests wait here until an executor has room (late binding), highest priority first, then
oldest first. With ``--router kv`` the head of the queue is routed on the prefix index's answer
(pages of its prompt each executor holds) and the executors' load (``router.py``).
State is rebuilt from heartbeats after a restart; one replica is active at a time (a second
replica in the same queue group shares the submit stream but each keeps its own queue).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import logging
import time
from dataclasses import dataclass

from common.config import MeshConfig, env
from common.messages import (
    AbortRequests,
    ErrorEvent,
    Heartbeat,
    IndexMatchReply,
    IndexMatchRequest,
    Presence,
    TokenizedRequest,
)
from common.metrics import SchedulerMetrics
from common.runtime import NoAnswer, RequestError, Service
from services.scheduler.inflight import Inflight
from services.scheduler.router import POLICIES, Router
from services.scheduler.tracing import RouteTraces

log = logging.getLogger("meshserve.scheduler")


@dataclass(frozen=True)
class SchedulerServiceConfig:
    mesh: MeshConfig
    router: str = "least-load"
    max_queue: int = 1024
    heartbeat_timeout_s: float = 2.0
    overlap_weight: float = 2.0  # kv router: cost of one uncached page vs one page of load
    max_imbalance: float = 256.0  # kv router: skip executors this many pages above the lightest
    index_timeout_s: float = 0.1  # kv router: past this, route by load alone

    def __post_init__(self) -> None:
        if self.router not in POLICIES:
            raise ValueError(f"--router must be one of {POLICIES}")
        if self.index_timeout_s <= 0:
            raise ValueError("index_timeout_s must be > 0")
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
    p.add_argument("--overlap-weight", type=float, default=float(env("OVERLAP_WEIGHT", "2.0")))
    p.add_argument("--max-imbalance", type=float, default=float(env("MAX_IMBALANCE", "256")))
    p.add_argument("--index-timeout", type=float, default=float(env("INDEX_TIMEOUT", "0.1")))
    a = p.parse_args(argv)
    return SchedulerServiceConfig(
        MeshConfig.from_args(a),
        a.router,
        a.max_queue,
        a.heartbeat_timeout,
        a.overlap_weight,
        a.max_imbalance,
        a.index_timeout,
    )


class SchedulerService:
    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        self.svc = Service("scheduler", config.mesh)
        self.router = Router(
            config.router,
            overlap_weight=config.overlap_weight,
            max_imbalance=config.max_imbalance,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
        )
        self.dispatching = asyncio.Lock()  # dispatch awaits the index between peek and pop
        self.index_down_until = 0.0
        self.queue: list[tuple[int, int, TokenizedRequest]] = []  # (-priority, order, request)
        self.aborted: set[str] = set()
        self.order = itertools.count()
        self.dispatched = 0
        self.inflight = Inflight(unseen_timeout_s=5 * config.heartbeat_timeout_s)
        self.metrics = SchedulerMetrics(self.svc.registry, lambda: len(self.queue))
        self.routes = RouteTraces(self.svc.tracer, self.metrics)

    async def start(self) -> None:
        await self.svc.connect()
        s = self.svc.subjects
        await self.svc.subscribe(s.scheduler_submit, TokenizedRequest, self.on_submit, "scheduler")
        await self.svc.subscribe(s.executor_heartbeat, Heartbeat, self.on_heartbeat)
        await self.svc.subscribe(s.abort, AbortRequests, self.on_abort)
        await self.svc.watch_presence(self.on_presence)  # the tokenizers' page size
        self.svc.spawn(self.svc.every(0.2, self.sweep), "sweep")

    async def on_submit(self, req: TokenizedRequest) -> None:
        if len(self.queue) >= self.config.max_queue:
            self.metrics.rejected.inc()
            raise RequestError(
                "The server is overloaded: the request queue is full; retry later.",
                status=429,
                type="rate_limit_error",
                code="queue_full",
            )
        self.routes.queued(req)  # the scheduler.route span, a child of the tokenizer's
        heapq.heappush(self.queue, (-req.priority, next(self.order), req))
        await self.dispatch()

    async def on_heartbeat(self, hb: Heartbeat) -> None:
        self.router.observe(hb)
        self.inflight.observe(hb)
        await self.dispatch()

    async def on_presence(self, presence: Presence) -> None:
        if self.router.observe_presence(presence):  # an executor may be routable again
            await self.dispatch()

    async def on_abort(self, msg: AbortRequests) -> None:
        queued = {item[2].request_id for item in self.queue}
        self.aborted.update(rid for rid in msg.request_ids if rid in queued)
        for rid in msg.request_ids:
            self.inflight.drop(rid)
            self.routes.finished(rid)

    async def dispatch(self) -> None:
        async with self.dispatching:
            await self._dispatch()

    async def _dispatch(self) -> None:
        while self.queue:
            req = self.queue[0][2]
            if req.request_id in self.aborted:
                heapq.heappop(self.queue)
                self.aborted.discard(req.request_id)
                self.routes.dropped(req.request_id, "abort")
                continue
            candidates = self.router.candidates()
            if not candidates:
                return  # nobody has room: it waits here, in priority order
            with self.routes.use(req.request_id):  # the index query joins the request's trace
                overlaps = await self.overlaps(req) if len(candidates) > 1 else {}
            if not self.queue or self.queue[0][2] is not req or req.request_id in self.aborted:
                continue  # the queue changed (or the client left) while we asked the index
            executor = self.router.pick(req, overlaps)
            if executor is None:
                return
            _, order, _ = heapq.heappop(self.queue)
            self.router.assigned(executor, req, overlaps)
            self.inflight.assign(executor, req, order)
            with self.routes.use(req.request_id):
                await self.svc.publish(self.svc.subjects.executor_submit(executor), req)
            self.routes.routed(req.request_id, executor)
            self.dispatched += 1

    async def overlaps(self, req: TokenizedRequest) -> dict[str, int]:
        """Each executor's cached pages of the prompt (kv router), or {} if the index is silent.

        A silent index costs one timeout per second, not one per request: routing falls back
        to load alone meanwhile.
        """
        if not self.router.wants_overlaps or not req.block_hashes:
            return {}
        if time.monotonic() < self.index_down_until:
            return {}
        try:
            reply = await self.svc.request(
                self.svc.subjects.index_match,
                IndexMatchRequest(req.block_hashes, req.request_id),
                IndexMatchReply,
                self.config.index_timeout_s,
            )
        except NoAnswer as exc:
            log.warning("scheduler: prefix index did not answer (%s); routing by load", exc)
            self.index_down_until = time.monotonic() + 1.0
            return {}
        return reply.overlaps

    async def executor_lost(self, executor_id: str) -> None:
        """Re-queue what the dead executor had not started; fail what it was streaming."""
        retry, failed = self.inflight.take_executor(executor_id)
        log.warning(
            "scheduler: executor %s is gone; re-routing %d requests, failing %d streams",
            executor_id,
            len(retry),
            len(failed),
        )
        for a in retry:
            self.routes.queued(a.request)
            heapq.heappush(self.queue, (-a.request.priority, a.order, a.request))
        for a in failed:
            await self.svc.publish(
                a.request.reply_to,
                ErrorEvent(
                    a.request.request_id,
                    503,
                    "The executor serving this request failed mid-stream; retry the request.",
                    "server_error",
                    "executor_failed",
                ),
            )

    async def sweep(self) -> None:
        """Fail queued requests whose deadline passed; handle executors that went silent."""
        for executor_id in self.router.forget_dead():
            await self.executor_lost(executor_id)
        now = time.time()
        expired = [item for item in self.queue if item[2].deadline and item[2].deadline < now]
        if expired:
            self.queue = [item for item in self.queue if item not in expired]
            heapq.heapify(self.queue)
            for _, _, req in expired:
                self.routes.dropped(req.request_id, "timeout")
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
