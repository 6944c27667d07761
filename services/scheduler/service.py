"""Scheduler handlers: admit (429 when the queue is full), queue by priority, dispatch, and
move requests off executors that are lost.

Requests wait here until an executor has room (late binding). Priorities follow vLLM: a LOWER
value runs first (default 0); each priority level is worth ``priority_aging_s`` seconds of
waiting, so a request is overtaken only by those that arrived less than that long after it per
level, and none starves. With ``--router kv`` the head of the queue is routed on the prefix
index's answer (pages of its prompt each executor holds) and the executors' load
(``router.py``). When an executor goes silent, each request it held continues elsewhere
(migration): the detokenizer says which tokens its stream has received, and the request is
resubmitted with them so the next executor prefills prompt + those and the client's stream
goes on. State is rebuilt from heartbeats after a restart; one replica is active at a time (a
second replica in the same queue group shares the submit stream but each keeps its own queue).
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.config import MeshConfig
from common.metrics import SchedulerMetrics
from common.recent_ids import RecentIds
from common.runtime import NoAnswer, RequestError, Service
from common.settings import parse, setting
from common.wire.detokenizer import StreamProgressReply, StreamProgressRequest
from common.wire.executor import AbortRequests, TokenizedRequest
from common.wire.gateway import ErrorEvent
from common.wire.prefix_index import IndexMatchReply, IndexMatchRequest
from common.wire.presence import Presence
from common.wire.scheduler import Heartbeat, RequestStatusQuery, RequestStatusReply
from services.scheduler.guests import DECODE_POOL, MIXED_POOL, GuestPlacement, guest_pool
from services.scheduler.inflight import Assignment, Inflight, Rank
from services.scheduler.pairing import route
from services.scheduler.regions import QueueEstimate, RegionConfig, RegionLoad
from services.scheduler.router import POLICIES, Router
from services.scheduler.spill import RegionSpill
from services.scheduler.tracing import RouteTraces

log = logging.getLogger("meshserve.scheduler")


@dataclass(frozen=True)
class SchedulerServiceConfig:
    mesh: MeshConfig
    router: str = setting("least-load", "how a request picks its executor", choices=POLICIES)
    max_queue: int = setting(1024, "requests waiting for an executor; past it, 429")
    heartbeat_timeout_s: float = setting(
        2.0,
        "an executor silent this long is lost (its requests move)",
        flag="--heartbeat-timeout",
    )
    overlap_weight: float = setting(
        2.0, "kv router: cost of one uncached page against one page of load"
    )
    max_imbalance: float = setting(
        256.0, "kv router: skip executors this many pages above the lightest"
    )
    index_timeout_s: float = setting(
        0.1, "kv router: past this, route by load alone", flag="--index-timeout"
    )
    migration_limit: int = setting(
        3,
        "how often one request may move off a lost executor and continue on another "
        "(0: never; its client gets an executor_failed error instead)",
    )
    priority_aging_s: float = setting(
        1.0,
        "seconds of waiting one priority level is worth (lower priority values run "
        "first, as in vLLM; aging bounds how long a request can be overtaken)",
        flag="--priority-aging",
    )
    disagg_min_prompt_tokens: int = setting(
        0,
        "disaggregation: a prompt with fewer uncached tokens than this is prefilled on its "
        "decode executor, not moved from a prefill one (0: every prompt is moved)",
    )
    progress_timeout_s: float = 1.0  # the detokenizer's answer on what a stream received
    # Spillover to other regions (regions.py, spill.py); off without --region/--peer-regions.
    regions: RegionConfig = field(default_factory=RegionConfig)

    def __post_init__(self) -> None:
        if self.router not in POLICIES:
            raise ValueError(f"--router must be one of {POLICIES}")
        if self.index_timeout_s <= 0:
            raise ValueError("index_timeout_s must be > 0")
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if self.migration_limit < 0:
            raise ValueError("migration_limit must be >= 0")
        if self.priority_aging_s < 0:
            raise ValueError("priority_aging_s must be >= 0")
        if self.disagg_min_prompt_tokens < 0:
            raise ValueError("disagg_min_prompt_tokens must be >= 0")


def log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("scheduler: a dispatch pass failed", exc_info=task.exception())


def parse_args(argv: list[str] | None = None) -> SchedulerServiceConfig:
    return parse(SchedulerServiceConfig, argv, "python -m services.scheduler")


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
        self.dispatch_again = False  # something changed while a dispatch pass ran
        self.pass_task: asyncio.Future[None] | None = None  # ``dispatch_soon``'s
        self.index_down_until = 0.0
        self.queue: list[tuple[Rank, TokenizedRequest]] = []  # a heap: lowest rank first
        self.queued: set[str] = set()  # the ids in ``queue``
        self.ended: RecentIds[str, bool] = RecentIds()  # aborted: drop if they arrive later
        self.order = itertools.count()
        self.dispatched = 0
        # A request its executor never listed is taken as finished after a heartbeat timeout
        # (it was too short to be in any heartbeat); if it was in fact lost on the way, the
        # gateway's watchdog finds the scheduler no longer knows it and fails it clearly.
        self.inflight = Inflight(unseen_timeout_s=config.heartbeat_timeout_s)
        self.metrics = SchedulerMetrics(
            self.svc.registry, lambda: len(self.queue), lambda: len(self.inflight)
        )
        self.routes = RouteTraces(self.svc.tracer, self.metrics)
        self.estimate = QueueEstimate()
        self.spill = RegionSpill(self.svc, config.regions, self.home_load)
        self.guestless_since: float | None = None  # monotonic; see ``return_guests``
        # LoRA adapter -> since when no live executor of its pool serves it (monotonic)
        self.unserved_since: dict[str, float] = {}

    async def start(self) -> None:
        await self.svc.connect()
        s = self.svc.subjects
        await self.svc.subscribe(s.scheduler_submit, TokenizedRequest, self.on_submit, "scheduler")
        await self.svc.subscribe(s.scheduler_spill, TokenizedRequest, self.on_spilled, "scheduler")
        await self.spill.start()
        await self.svc.subscribe(s.executor_heartbeat, Heartbeat, self.on_heartbeat)
        await self.svc.subscribe(s.abort, AbortRequests, self.on_abort)
        await self.svc.serve(s.scheduler_status, RequestStatusQuery, self.on_status, "scheduler")
        await self.svc.watch_presence(self.on_presence)  # the tokenizers' page size
        self.svc.spawn(self.svc.every(0.2, self.sweep), "sweep")

    async def on_submit(self, req: TokenizedRequest) -> None:
        await self.admit(req, may_spill=True)

    async def on_spilled(self, req: TokenizedRequest) -> None:
        """A request another region's scheduler sent here: a guest, never sent on. The sender
        counted on our spare slots as last reported (up to a poll old), so this side keeps the
        reserve itself: a guest queues behind every request of our own clients and is
        dispatched only while the region keeps ``--spill-reserve-seqs`` slots free after it
        (``GuestPlacement.guest_room``), and only to our guest executors, so at least
        ``--spill-reserve-executors`` executors hold none (``guests.py``); its executor
        preempts it for one of our clients' requests when its batch is full
        (``TokenizedRequest.guest``)."""
        self.spill.received()
        if req.lora:  # (no region spills these now; an older one might)
            await self.svc.publish(req.reply_to, region_unavailable(req.request_id))
            return
        await self.admit(dataclasses.replace(req, guest=True), may_spill=False)

    async def admit(self, req: TokenizedRequest, may_spill: bool) -> None:
        rid = req.request_id
        if rid in self.ended:
            log.info("scheduler: dropping %s: it was aborted before it was queued", rid)
            return
        if rid in self.queued or rid in self.inflight:
            # A replayed message: one request id runs on one executor at a time.
            log.warning("scheduler: ignoring a second submit of %s", rid)
            return
        if may_spill and self.spill.spillable(req):
            decision = self.spill.decide(req)
            if decision.spilled(self.svc.mesh.region):
                await self.spill.send(req, decision)
                return
        if len(self.queue) >= self.config.max_queue:
            self.metrics.rejected.inc()
            raise RequestError(
                "The server is overloaded: the request queue is full; retry later.",
                status=429,
                type="rate_limit_error",
                code="queue_full",
            )
        self.routes.queued(req)  # the scheduler.route span, a child of the tokenizer's
        key = req.priority * self.config.priority_aging_s + time.monotonic()
        if req.guest:
            key = math.inf  # after all of our own, in arrival order among themselves
        rank = (key, next(self.order))
        self.push(rank, req)
        await self.dispatch()

    def push(self, rank: Rank, req: TokenizedRequest) -> None:
        heapq.heappush(self.queue, (rank, req))
        self.queued.add(req.request_id)

    def remove_queued(self, request_ids: set[str]) -> list[TokenizedRequest]:
        """Take these requests out of the queue (wherever they are in it); return them."""
        removed = [req for _, req in self.queue if req.request_id in request_ids]
        if removed:
            self.queue = [item for item in self.queue if item[1].request_id not in request_ids]
            heapq.heapify(self.queue)
            self.queued.difference_update(r.request_id for r in removed)
        return removed

    async def on_status(self, ask: RequestStatusQuery) -> RequestStatusReply:
        """Which of these requests are queued here or held by an executor we route to? One
        that is neither was lost on the way (a tokenizer or scheduler restarted) or has an
        executor that cannot be replaced: its gateway fails it instead of letting it wait."""
        here = [rid for rid in ask.request_ids if rid in self.queued or rid in self.inflight]
        if ask.from_region:  # another region's question: what we hold ourselves
            return RequestStatusReply(here)
        rest = [rid for rid in ask.request_ids if rid not in set(here)]
        return RequestStatusReply(here + await self.spill.alive_elsewhere(rest))

    async def on_heartbeat(self, hb: Heartbeat) -> None:
        if self.router.restarted(hb):  # the old process died; its requests move now
            old = self.router.forget(hb.executor_id).heartbeat.incarnation
            await self.executor_lost(hb.executor_id, old)
        self.router.observe(hb)
        self.inflight.observe(hb)
        self.dispatch_soon()

    async def on_presence(self, presence: Presence) -> None:
        if self.router.observe_presence(presence):  # an executor may be routable again
            self.dispatch_soon()

    async def on_abort(self, msg: AbortRequests) -> None:
        if msg.executor_id:
            return  # our own withdrawal of work from one executor
        ids = set(msg.request_ids)
        held = (self.queued, self.inflight, self.ended)
        await self.spill.forward_abort(msg, {r for r in ids if not any(r in h for h in held)})
        self.ended.add_all(ids, True)
        for req in self.remove_queued(ids):
            self.routes.dropped(req.request_id, "abort")
        for rid in ids:
            self.inflight.drop(rid)

    async def end_everywhere(self, request_ids: list[str], reason: str) -> None:
        """Every stage of this region forgets these requests. They are marked ended here
        first: ``on_abort`` would take our own abort for one of requests we never held, and
        send it on to the peer regions."""
        self.ended.add_all(request_ids, True)
        await self.svc.publish(self.svc.subjects.abort, AbortRequests(request_ids, reason))

    def dispatch_soon(self) -> None:
        """``dispatch`` in a task of its own: heartbeats and presence are handled one after
        another (one subscription each), so a handler that ran the pass (one index question
        per queued request) held every later heartbeat behind it, and behind a slow index the
        sweep took executors that were beating for lost."""
        if self.dispatching.locked() or (self.pass_task is not None and not self.pass_task.done()):
            self.dispatch_again = True
            return
        self.pass_task = asyncio.ensure_future(self.dispatch())
        self.pass_task.add_done_callback(log_failure)

    async def settled(self) -> None:
        """Wait for a dispatch pass started by ``dispatch_soon`` (tests, shutdown)."""
        while self.pass_task is not None and not self.pass_task.done():
            await asyncio.shield(self.pass_task)

    async def dispatch(self) -> None:
        """Route what the queue and the executors' room allow; while a pass is running (it
        may be waiting on the index), have it make one more instead of waiting behind it."""
        if self.dispatching.locked():
            self.dispatch_again = True
            return
        async with self.dispatching:
            self.dispatch_again = True
            while self.dispatch_again:
                self.dispatch_again = False
                await self._dispatch()

    async def _dispatch(self) -> None:
        """Requests in priority order, while their executors have room. One on a LoRA adapter
        that finds none on the executors serving it waits without holding the rest up: those
        after it may go on, to the other executors only (each pool keeps its order)."""
        skipped: set[str] = set()  # adapter requests held back this pass
        try:
            while (item := self.next_queued(skipped)) is not None:
                if not await self._dispatch_one(item, skipped):
                    return
        finally:
            self.router.held_back = set()

    def next_queued(self, skipped: set[str]) -> tuple[Any, TokenizedRequest] | None:
        if not skipped:
            return self.queue[0] if self.queue else None
        return min((i for i in self.queue if i[1].request_id not in skipped), default=None)

    def hold_back(self, req: TokenizedRequest, skipped: set[str]) -> bool:
        """An adapter request that found no room: passed over this pass, its adapter's
        executors kept from the requests after it. False for any other request: it waits at
        the head, in priority order."""
        if not req.lora:
            return False
        skipped.add(req.request_id)
        self.router.held_back |= set(self.router.serving(req.lora))
        return True

    def adapter_unserved(self, req: TokenizedRequest) -> bool:
        """No live executor of the request's pool has served its adapter for a heartbeat
        timeout (briefly: a restart, a start-up, a heartbeat late), while others are live."""
        roles = DECODE_POOL if "decode" in self.router.live_roles() else MIXED_POOL
        if self.router.serving(req.lora, roles) or not self.router.pool():
            self.unserved_since.pop(req.lora, None)
            return False
        since = self.unserved_since.setdefault(req.lora, time.monotonic())
        return time.monotonic() - since >= self.config.heartbeat_timeout_s

    async def fail_unserved(self, req: TokenizedRequest) -> None:
        """An unknown model, for a request that has streamed nothing; one that has (moved off
        a lost executor) fails as the others its executor held do, retryable."""
        if not req.output_token_ids:
            await self.fail_queued({req.request_id}, "unknown adapter", unserved_adapter(req))
            return
        await self.fail_queued({req.request_id}, "executor failed", executor_failed)
        await self.end_everywhere([req.request_id], "executor failed")

    async def _dispatch_one(self, item: tuple[Any, TokenizedRequest], skipped: set[str]) -> bool:
        """Route ``item`` if its executors have room; False to end the pass."""
        rank, req = item
        if req.lora and self.adapter_unserved(req):
            await self.fail_unserved(req)
            return True
        candidates = self.router.candidates(lora=req.lora)
        if not candidates:
            # nobody has room: it waits here, in priority order (an adapter's request
            # lets the others go on)
            return self.hold_back(req, skipped)
        with self.routes.use(req.request_id):  # the index query joins the request's trace
            overlaps = await self.overlaps(req) if len(candidates) > 1 else {}
        if self.next_queued(skipped) is not item:
            return True  # the queue changed (or the client left) while we asked the index
        placement = self.placement()
        reserve = self.config.regions.spill_reserve_seqs if req.guest else 0
        if req.guest and not placement.guest_room(self.router, reserve, guest_pool(self.router)):
            return False  # the region's reserve (guests queue behind all of its own)
        chosen = route(
            self.router,
            req,
            overlaps,
            min_prompt_tokens=self.config.disagg_min_prompt_tokens,
            placement=placement,
            prefill_keep_free=reserve,
        )
        if chosen is None:
            return self.hold_back(req, skipped)
        if self.queue[0] is item:
            heapq.heappop(self.queue)
            self.queued.discard(req.request_id)
        else:
            self.remove_queued({req.request_id})
        executor = chosen.executor
        if chosen.prefill:  # disaggregated: the decode side asks the prefill side
            self.router.assigned(chosen.prefill, req, overlaps)
            self.router.assigned(executor, req, decode_only=True)
            incarnation = self.router.executors[chosen.prefill].heartbeat.incarnation
        else:
            self.router.assigned(executor, req, overlaps)
            incarnation = ""
        if chosen.prefill or req.prefill_executor:  # (a migrated one may carry an old pair)
            req = dataclasses.replace(
                req, prefill_executor=chosen.prefill, prefill_incarnation=incarnation
            )
        assignment = self.inflight.assign(executor, req, rank)
        with self.routes.use(req.request_id):
            await self.svc.publish(self.svc.subjects.executor_submit(executor), req)
        assignment.trace = self.routes.routed(req.request_id, executor)
        self.dispatched += 1
        self.estimate.dispatched()
        return True

    async def overlaps(self, req: TokenizedRequest) -> dict[str, int]:
        """Each executor's cached pages of the prompt (kv router), or {} if the index is silent.

        A silent index costs one timeout per second, not one per request: routing falls back
        to load alone meanwhile.
        """
        if not self.router.wants_overlaps or not req.page_hashes:
            return {}
        if time.monotonic() < self.index_down_until:
            return {}
        try:
            reply = await self.svc.request(
                self.svc.subjects.index_match,
                IndexMatchRequest(req.page_hashes, req.request_id),
                IndexMatchReply,
                self.config.index_timeout_s,
            )
        except NoAnswer as exc:
            log.warning("scheduler: prefix index did not answer (%s); routing by load", exc)
            self.index_down_until = time.monotonic() + 1.0
            return {}
        return reply.overlaps

    async def executor_lost(self, executor_id: str, incarnation: str = "") -> None:
        """Move every request the lost executor held to another one, streamed or not.

        The executor is told to stop them first, in case it is only late rather than dead
        (one request id runs on one executor at a time); the detokenizer says which tokens
        each stream has received and from then on drops that executor's tokens for them. A
        request whose stream is unknown (its shard did not answer) or that has moved
        ``migration_limit`` times already fails with a clear error instead.
        """
        lost = self.inflight.take_executor(executor_id)
        if not lost:
            return
        ids = [a.request.request_id for a in lost]
        await self.svc.publish(
            self.svc.subjects.abort,
            AbortRequests(ids, "moved to another executor", executor_id=executor_id),
        )
        progress = await self.stream_progress(executor_id, incarnation, lost)
        failed: list[TokenizedRequest] = []
        moved = 0
        for a in lost:
            req, rid = a.request, a.request.request_id
            known = progress.get(req.detok_shard)
            if known is not None and rid in known.ended:
                continue  # it finished (or was aborted) before the executor went
            if rid in self.ended:
                continue  # aborted while the detokenizer answered: not to be run again
            if known is None or req.migrations >= self.config.migration_limit:
                failed.append(req)
                continue
            streamed = known.streamed.get(rid, [])
            resumed = dataclasses.replace(
                req, output_token_ids=streamed, migrations=req.migrations + 1
            )
            self.routes.queued(resumed, a.trace)
            self.push(a.rank, resumed)
            self.metrics.migrated.inc()
            moved += 1
        log.warning(
            "scheduler: executor %s is gone; moved %d requests elsewhere, failed %d",
            executor_id,
            moved,
            len(failed),
        )
        for req in failed:
            self.metrics.executor_failed.inc()
            await self.svc.publish(req.reply_to, executor_failed(req.request_id))
        if failed:  # every stage forgets them (the detokenizer's stream state included)
            await self.end_everywhere([r.request_id for r in failed], "executor failed")

    async def stream_progress(
        self, executor_id: str, incarnation: str, lost: list[Assignment]
    ) -> dict[int, StreamProgressReply]:
        """Each detokenizer shard's answer for its share of ``lost`` (absent: no answer)."""
        by_shard: dict[int, list[TokenizedRequest]] = {}
        for a in lost:
            by_shard.setdefault(a.request.detok_shard, []).append(a.request)

        async def ask(shard: int, reqs: list[TokenizedRequest]) -> StreamProgressReply | None:
            ids, migrations = [r.request_id for r in reqs], [r.migrations for r in reqs]
            try:
                return await self.svc.request(
                    self.svc.subjects.detok_progress(shard),
                    StreamProgressRequest(executor_id, ids, incarnation, migrations),
                    StreamProgressReply,
                    self.config.progress_timeout_s,
                )
            except NoAnswer as exc:
                log.error("scheduler: detokenizer shard %d did not answer: %s", shard, exc)
                return None

        shards = list(by_shard)
        replies = await asyncio.gather(*(ask(shard, by_shard[shard]) for shard in shards))
        return {shard: r for shard, r in zip(shards, replies, strict=True) if r is not None}

    async def sweep(self) -> None:
        """Fail queued requests whose deadline passed; handle executors that went silent."""
        for executor_id, incarnation in self.router.forget_dead().items():
            await self.executor_lost(executor_id, incarnation)
        now = time.time()
        expired = {req.request_id for _, req in self.queue if req.deadline and req.deadline < now}
        await self.fail_queued(
            expired,
            "timeout",
            lambda rid: ErrorEvent(
                rid, 504, "request timed out waiting for an executor", "timeout_error",
                "queue_timeout",
            ),
        )  # fmt: skip
        self.ended.prune()
        self.spill.prune()  # (where each spilled request went: bounded, but kept until pruned)
        await self.return_guests()
        await self.spill_queued()
        await self.dispatch()

    async def fail_queued(
        self, request_ids: set[str], reason: str, error: Callable[[str], ErrorEvent]
    ) -> list[TokenizedRequest]:
        """Take these requests out of the queue and send each ``error(its id)`` on its
        stream; ``reason`` ends its route span. Returns them."""
        removed = self.remove_queued(request_ids)
        for req in removed:
            self.routes.dropped(req.request_id, reason)
            await self.svc.publish(req.reply_to, error(req.request_id))
        return removed

    async def return_guests(self) -> None:
        """Send queued guests back to their region when no executor here has been able to
        take one for a heartbeat timeout (every executor lost, or no more live than
        ``--spill-reserve-executors``).

        Else a guest would wait here for its deadline, while its home's watchdog, asking us,
        hears that it is alive. Each gets a resumable 503 on its stream: its gateway (at home)
        continues it from the tokens its client has, at home or in another region, as after
        any loss in transit (``services/gateway/resume.py``); a guest that streamed nothing
        is simply submitted again. Every stage here forgets it.
        """
        if self.placement().guest_executors(self.router, guest_pool(self.router)):
            self.guestless_since = None
            return
        # Not at the first sweep that finds none: an executor restarting is out of the router
        # while its old requests move (up to the detokenizer's answer), and a scheduler just
        # started has heard no heartbeat yet.
        now = time.monotonic()
        if self.guestless_since is None:
            self.guestless_since = now
        if now - self.guestless_since < self.config.heartbeat_timeout_s:
            return
        queued_guests = {req.request_id for _, req in self.queue if req.guest}
        if not queued_guests:
            return
        guests = await self.fail_queued(queued_guests, "returned", region_unavailable)
        await self.end_everywhere([req.request_id for req in guests], "returned to its region")
        self.spill.returned_total.inc(len(guests))
        log.warning("scheduler: no executor here may take a guest; returned %d", len(guests))

    def placement(self) -> GuestPlacement:
        return GuestPlacement(
            self.inflight.guests_by_executor(), self.config.regions.spill_reserve_executors
        )

    def home_load(self) -> RegionLoad:
        """This region's load (``regions.py``): live executors and the estimated queue time."""
        now = time.monotonic()
        live = self.router.pool()
        # The wait of a request of our own clients: guests queue behind it and yield their
        # executor slots to it, so neither their number nor their waits count.
        own = [req.request_id for _, req in self.queue if not req.guest]
        waits = [now - route.queued_at for rid in own if (route := self.routes.open.get(rid))]
        own_queued = len(own)
        has_room = bool(self.router.candidates())
        queue_ms = self.estimate.queue_ms(own_queued, max(waits, default=0.0), has_room, now)
        # Only the slots a guest may take: on the guest executors, beyond the region's reserve.
        placement = self.placement()
        spare = 0
        if not self.queue:
            spare = placement.spare_seqs(self.router, self.config.regions.spill_reserve_seqs)
        guest_executors = len(placement.guest_executors(self.router, guest_pool(self.router)))
        return RegionLoad(
            self.svc.mesh.region,
            len(live),
            queue_ms,
            spare_seqs=spare,
            guest_executors=guest_executors,
        )

    async def spill_queued(self) -> None:
        """With no live executor here, queued requests go to another region as well (new ones
        do at submit); those that already streamed tokens wait for an executor here."""
        if not self.spill.enabled or self.home_load().live_executors > 0:
            return
        for _, req in sorted(self.queue, key=lambda item: item[0]):
            if not self.spill.spillable(req):
                continue
            decision = self.spill.decide(req)
            if decision.spilled(self.svc.mesh.region):
                self.remove_queued({req.request_id})
                route = self.routes.open.pop(req.request_id, None)
                if route is not None:  # its scheduler.route span ends here, not in error
                    route.span.set_attribute("meshserve.region", decision.region)
                    route.span.end()
                with self.routes.use(req.request_id):
                    await self.spill.send(req, decision)


def unserved_adapter(req: TokenizedRequest) -> Callable[[str], ErrorEvent]:
    """The error of a request on a LoRA adapter no live executor serves (as an unknown model:
    the gateway named it, the executors that had it are gone or never had it)."""
    message = f"The model `{req.lora}` (a LoRA adapter) is served by no executor now."
    return lambda rid: ErrorEvent(
        rid, 404, message, "invalid_request_error", "model_not_found", "model"
    )


def executor_failed(request_id: str) -> ErrorEvent:
    """A request whose executor was lost once it had streamed (retryable: its gateway may
    resume it)."""
    return ErrorEvent(
        request_id, 503, "The executor serving this request failed mid-stream; retry the "
        "request.", "server_error", "executor_failed",
    )  # fmt: skip


def region_unavailable(request_id: str) -> ErrorEvent:
    """A guest this region cannot serve, back to its home gateway (retryable: it resumes it
    elsewhere)."""
    return ErrorEvent(
        request_id, 503, "The region serving this request has no executor for it; retry the "
        "request.", "server_error", "region_unavailable",
    )  # fmt: skip
