"""The scheduler's side of regions: learn the other regions' load and round trip, send a
request to another region when ``regions.choose_region`` says so, and keep answering for it.

Each region runs a whole mesh under its own subjects (``MeshConfig.region``); this is the only
part of it that talks to another region on purpose:

- every ``status_interval_s`` it asks each peer region's scheduler for its load
  (``scheduler.region_status``, request/reply); the time the answer took is the inter-region
  round trip, measured over the real gateway link, without trusting clocks;
- a spilled request is published whole to the peer's ``scheduler.spill`` (its queue group
  there: one scheduler takes it, queues it as its own and never sends it on). Its ``reply_to``
  is still this region's gateway inbox, so the stream comes back across the gateway to the
  gateway the client is connected to;
- this scheduler remembers where it sent each one: the gateway's watchdog asks *this*
  scheduler whether a request is alive, and the question is forwarded to the region that holds
  it; an abort (the client left) is forwarded there too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.trace import SpanKind
from prometheus_client import Counter, Gauge

from common.metrics import PREFIX
from common.recent_ids import RecentIds
from common.runtime import NoAnswer, Service
from common.wire.executor import AbortRequests, TokenizedRequest
from common.wire.scheduler import (
    RegionStatus,
    RegionStatusQuery,
    RequestStatusQuery,
    RequestStatusReply,
)
from services.scheduler.regions import Decision, RegionConfig, RegionLoad, choose_region

log = logging.getLogger("meshserve.scheduler")

MAX_QUEUE_MS = 1e9  # what "no estimate" is sent as (msgpack carries no infinity we rely on)
# How long the gateway's watchdog question (about spilled requests) waits for the region
# holding them. Under the watchdog's own wait for this scheduler (1 s, ``ASK_TIMEOUT_S`` in
# services/gateway/watchdog.py): past it the watchdog takes the scheduler as silent and
# resumes nothing, so across a partition that drops packets (no "no responders" then) spilled
# streams would wait until the servers drop their gateway connection, tens of seconds.
REMOTE_STATUS_TIMEOUT_S = 0.5


@dataclass
class PeerReport:
    status: RegionStatus
    rtt_ms: float
    at: float  # monotonic


class RegionSpill:
    def __init__(
        self,
        svc: Service,
        config: RegionConfig,
        home_load: Callable[[], RegionLoad],
    ) -> None:
        self.svc = svc
        self.config = config
        self.home = svc.mesh.region
        self.home_load = home_load
        self.peers: dict[str, PeerReport] = {}
        # request id -> the region serving it; kept as long as a request may live
        self.spilled: RecentIds[str, str] = RecentIds(ttl_s=900.0)
        self.spilled_total = Counter(
            PREFIX + "scheduler_requests_spilled",
            "Requests this region's scheduler sent to another region, by why and where.",
            ["from_region", "to_region", "reason"],
            registry=svc.registry,
        )
        self.received_total = Counter(
            PREFIX + "scheduler_requests_spilled_in",
            "Requests another region's scheduler sent here.",
            registry=svc.registry,
        )
        self.returned_total = Counter(
            PREFIX + "scheduler_guests_returned",
            "Guests sent back to their region because no executor here could take them.",
            registry=svc.registry,
        )
        self.rtt = Gauge(
            PREFIX + "scheduler_region_rtt_seconds",
            "Round trip to each peer region's scheduler (its last load report).",
            ["region"],
            registry=svc.registry,
        )

    @property
    def enabled(self) -> bool:
        return bool(self.home and self.config.peer_regions)

    async def start(self) -> None:
        await self.svc.serve(
            self.svc.subjects.scheduler_region_status,
            RegionStatusQuery,
            self.on_status_query,
            "scheduler",
        )
        if self.enabled:
            self.svc.spawn(self.svc.every(self.config.status_interval_s, self.poll), "regions")

    async def on_status_query(self, ask: RegionStatusQuery) -> RegionStatus:
        load = self.home_load()
        return RegionStatus(
            self.home,
            load.live_executors,
            min(load.queue_ms, MAX_QUEUE_MS),
            load.spare_seqs,
            load.guest_executors,
        )

    async def poll(self) -> None:
        await asyncio.gather(*(self.ask(region) for region in self.config.peer_regions))

    async def ask(self, region: str) -> None:
        started = time.perf_counter()
        try:
            status = await self.svc.request(
                self.svc.mesh.subjects_of(region).scheduler_region_status,
                RegionStatusQuery(self.home),
                RegionStatus,
                self.config.stale_s,
            )
        except NoAnswer:  # the report ages out: that region is not counted on
            report = self.peers.get(region)
            if report is not None and time.monotonic() - report.at > self.config.stale_s:
                # nor is its last round trip shown as if it still answered
                with contextlib.suppress(KeyError):
                    self.rtt.remove(region)
            return
        rtt_ms = 1000.0 * (time.perf_counter() - started)
        self.peers[region] = PeerReport(status, rtt_ms, time.monotonic())
        self.rtt.labels(region).set(rtt_ms / 1000.0)

    def remotes(self, prompt_tokens: int) -> list[RegionLoad]:
        """Fresh peer reports as loads for a request of ``prompt_tokens`` (cold cache there:
        the index of another region is not asked)."""
        fresh = {r: self.peers[r] for r in self.answering_peers()}
        return [
            RegionLoad(
                r,
                p.status.live_executors,
                p.status.queue_ms,
                p.rtt_ms,
                prompt_tokens,
                p.status.spare_seqs,
                p.status.guest_executors,
            )
            for r, p in fresh.items()
        ]

    def decide(self, req: TokenizedRequest, cached_tokens: int = 0) -> Decision:
        home = self.home_load()
        prompt = len(req.prompt_token_ids) + len(req.output_token_ids)
        home = RegionLoad(
            home.region, home.live_executors, home.queue_ms, 0.0, max(0, prompt - cached_tokens)
        )
        return choose_region(
            home,
            self.remotes(prompt),
            self.config.spill_queue_ms,
            self.config.prefill_ms_per_token,
        )

    def spillable(self, req: TokenizedRequest) -> bool:
        """A request of our own clients that has streamed nothing yet: its stream state is
        only in this region's detokenizer, so one that has (a migrated one) continues here. A
        guest is never sent on (``return_guests`` sends it home): its home region holds it as
        spilled here, and an abort would go back and forth between two regions that each
        think the other runs it. Nor a request on a LoRA adapter: what another region's
        executors serve is not known here."""
        return self.enabled and not req.output_token_ids and not req.guest and not req.lora

    async def send(self, req: TokenizedRequest, decision: Decision) -> None:
        """Publish ``req`` to ``decision.region``'s scheduler, in a span of its own."""
        with self.svc.tracer.start_as_current_span(
            "scheduler.spill",
            kind=SpanKind.PRODUCER,
            attributes={
                "meshserve.request_id": req.request_id,
                "meshserve.region": decision.region,
                "meshserve.from_region": self.home,
                "meshserve.spill_reason": decision.reason,
                "meshserve.spill_cost_ms": decision.cost_ms,
            },
        ):
            await self.svc.publish(self.svc.mesh.subjects_of(decision.region).scheduler_spill, req)
        self.spilled.add(req.request_id, decision.region)
        self.spilled_total.labels(self.home, decision.region, decision.reason).inc()

    def received(self) -> None:
        self.received_total.inc()

    async def alive_elsewhere(self, request_ids: list[str]) -> list[str]:
        """Which of ``request_ids`` (not held here) a peer region still holds.

        A request we spilled is asked of the region we sent it to. One we have no record of
        is asked of every peer that answers our load polls: this scheduler may have restarted
        (or the record expired) while it ran there as a guest, and a guest that is only slow
        must not be failed and run again here. A peer that holds it is remembered as where it
        runs, so its abort goes there."""
        if not self.enabled:
            return []
        by_region: dict[str, list[str]] = {}
        answering = self.answering_peers()
        for rid in request_ids:
            region = self.spilled.get(rid)
            for r in (region,) if region is not None else answering:
                by_region.setdefault(r, []).append(rid)

        async def ask(region: str, ids: list[str]) -> list[str]:
            try:
                reply = await self.svc.request(
                    self.svc.mesh.subjects_of(region).scheduler_status,
                    RequestStatusQuery(ids, from_region=self.home),
                    RequestStatusReply,
                    REMOTE_STATUS_TIMEOUT_S,
                )
            except NoAnswer:
                return []  # unreachable: its stream cannot reach the client either
            for rid in set(reply.known) & set(ids):
                self.spilled.add(rid, region)
            return [rid for rid in reply.known if rid in ids]

        answers = await asyncio.gather(*(ask(r, ids) for r, ids in by_region.items()))
        return list(dict.fromkeys(rid for known in answers for rid in known))

    def answering_peers(self) -> list[str]:
        """Peers whose load report is fresh: the ones counted on for a spill, and asked a
        blind question (about a request we have no record of), which so waits for no region
        that has stopped answering; the gateway's watchdog waits 1 s for the whole answer."""
        now = time.monotonic()
        return [r for r, p in self.peers.items() if now - p.at <= self.config.stale_s]

    async def forward_abort(self, msg: AbortRequests, unknown: set[str]) -> None:
        """Send an abort on to the regions running its requests: a spilled one to where it
        went, one this scheduler does not hold (``unknown``: it may have restarted while the
        request ran elsewhere as a guest) to every peer, which drops ids it never had. An
        abort that came from a peer goes nowhere (it would circle between two regions)."""
        if not self.enabled or msg.from_region:
            return
        by_region: dict[str, list[str]] = {}
        for rid in msg.request_ids:
            region = self.spilled.get(rid)
            if region is not None:
                targets: tuple[str, ...] = (region,)
            else:
                targets = self.config.peer_regions if rid in unknown else ()
            for r in targets:
                by_region.setdefault(r, []).append(rid)
        for region, ids in by_region.items():
            await self.svc.publish(
                self.svc.mesh.subjects_of(region).abort,
                AbortRequests(ids, msg.reason, error=msg.error, from_region=self.home),
            )

    def prune(self) -> None:
        self.spilled.prune()
