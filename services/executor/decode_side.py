"""A decode executor's half of disaggregation (``--role decode``).

A request the scheduler paired with a prefill executor first gets pages here, reserved for its
prompt (``gpu.handoff.reserve``); a ``PrefillRequest`` tells the prefill executor where they
are. It computes the prompt, streams the first token and writes the KV into those pages; once
its ``PrefillDone`` says "written" and NIXL's notification (which follows the data) has
arrived, the sequence joins the running batch with its prompt computed and decodes token two.

Failures end with the request computed here instead (local prefill): the prefill side
reports a failure, nothing arrives within ``--kv-transfer-timeout``, or the prefill executor's
heartbeats stop (or a new incarnation appears). The detokenizer says which tokens the prefill
side streamed (and drops any it still sends), and the request is prefilled here, in fresh
pages, with them, so the stream goes on without a gap or a repeat. The reserved pages are
released only once nothing can write into them any more: a late write into pages given to
another sequence would corrupt it. That is when the prefill side says it is done with them,
or when their lease ends: each job carries ``write_by`` (our deadline, on the prefill host's
wall clock), past which the prefill side starts no write and cancels one still running, and the
pages are kept ``FENCE_MARGIN_S`` longer (a cancelled write may still land). Silence is no
proof: a prefill executor whose heartbeats stopped (partitioned from the bus, paused, swapping)
may still write when it wakes. Every method that touches the engine runs between steps
(``apply``, from the step loop).

The hosts' clocks need not agree: each heartbeat of a prefill executor says when it was sent
on its clock, and ``sent_at - received_at`` is its clock's lead over ours less the message's
transit time. The largest of the last few is never more than the true lead, so a deadline
moved by it onto the peer's clock comes no later than ours, whatever the skew.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.runtime import NoAnswer
from common.wire.detokenizer import StreamProgressReply, StreamProgressRequest
from common.wire.executor import (
    AbortRequests,
    KVAgentQuery,
    KVAgentReply,
    PrefillDone,
    PrefillRequest,
    TokenizedRequest,
)
from common.wire.gateway import ErrorEvent
from common.wire.scheduler import Heartbeat
from gpu import handoff
from gpu.page_manager import PageTable
from services.executor.kv_transport import KVTransport
from services.sampling import sampling_params

if TYPE_CHECKING:
    from services.executor.service import ExecutorService

log = logging.getLogger("meshserve.executor")

POLL_S = 0.002  # how often an idle step loop looks for NIXL notifications
PEER_TIMEOUT_S = 2.0  # a prefill peer silent this long is dead (the scheduler's default too)
FENCE_MARGIN_S = 5.0  # pages are reused this long after their lease ends (a cancel, clock drift)
CLOCK_SAMPLES = 8  # heartbeats a peer's clock offset is taken over (a clock step ages out)


@dataclass
class Reservation:
    request: TokenizedRequest
    pages: list[int]
    job_id: str
    deadline: float  # monotonic: past it, compute the prompt here (the lease ends then too)
    done: PrefillDone | None = None
    notified: bool = False  # NIXL's notification: the bytes are in our pages


@dataclass
class Held:
    """Pages of an ended reservation that the prefill side might still write into."""

    table: PageTable
    fenced_at: float  # monotonic: nothing can write into them after this
    done: bool = False  # it said it is done with them


@dataclass(frozen=True)
class Resume:
    """A request falling back to local prefill, once the detokenizer has answered."""

    request: TokenizedRequest
    streamed: list[int] | None  # None: no answer (the request fails)
    ended: bool = False


def peer_of(req: TokenizedRequest) -> tuple[str, str]:
    return (req.prefill_executor, req.prefill_incarnation)


class DecodeSide:
    def __init__(self, service: ExecutorService, transport: KVTransport) -> None:
        self.service = service
        self.transport = transport
        self.reservations: dict[str, Reservation] = {}
        self.held: dict[str, Held] = {}  # by job id
        self.resumes: list[Resume] = []
        self.changed = asyncio.Event()
        self.peers_seen: dict[str, tuple[str, float]] = {}  # executor -> (incarnation, when)
        # executor -> its clock's lead over ours less transit, per recent heartbeat
        self.clock_leads: dict[str, deque[float]] = {}
        self.tasks: set[asyncio.Future[None]] = set()
        self.jobs_sent = 0

    def fire(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)  # held until done (the loop keeps only weak references)
        task.add_done_callback(self.tasks.discard)

    async def on_heartbeat(self, hb: Heartbeat) -> None:
        if hb.role != "prefill":
            return
        seen = self.peers_seen.get(hb.executor_id)
        if seen is not None and seen[0] != hb.incarnation:  # a new process: maybe a new host
            self.clock_leads.pop(hb.executor_id, None)
        self.peers_seen[hb.executor_id] = (hb.incarnation, time.monotonic())
        if hb.sent_at > 0:
            leads = self.clock_leads.setdefault(hb.executor_id, deque(maxlen=CLOCK_SAMPLES))
            leads.append(hb.sent_at - time.time())

    def clock_lead(self, executor: str) -> float:
        """How far ``executor``'s wall clock is ahead of ours, at most (0: no heartbeat said;
        the lease then assumes the clocks agree within ``FENCE_MARGIN_S``)."""
        leads = self.clock_leads.get(executor)
        return max(leads) if leads else 0.0

    def peer_alive(self, peer: tuple[str, str], now: float) -> bool:
        seen = self.peers_seen.get(peer[0])
        return seen is not None and seen[0] == peer[1] and now - seen[1] <= PEER_TIMEOUT_S

    async def on_kv_agent(self, query: KVAgentQuery) -> KVAgentReply:
        return KVAgentReply(self.transport.name, self.transport.metadata)

    async def on_prefilled(self, message: PrefillDone) -> None:
        reservation = self.reservations.get(message.request_id)
        if reservation is not None and reservation.job_id == message.job_id:
            reservation.done = message
            self.service.wake.set()
        held = self.held.get(message.job_id)
        if held is not None and not message.write_may_land:
            held.done = True
            self.service.wake.set()

    def withdraw(self, request_id: str) -> bool:
        """End a reservation (an abort, a deadline; between steps), holding its pages."""
        r = self.reservations.pop(request_id, None)
        if r is None:
            return False
        self.hold(r)
        return True

    def hold(self, r: Reservation) -> None:
        table = handoff.withdraw(self.service.engine, r.request.request_id)
        if table is None:
            return
        if r.done is not None and not r.done.write_may_land:  # nothing more comes
            handoff.release(self.service.engine, table)
            return
        self.held[r.job_id] = Held(table, r.deadline + FENCE_MARGIN_S)
        self.changed.set()

    def forget(self, request_id: str) -> None:
        self.reservations.pop(request_id, None)

    @property
    def busy(self) -> bool:
        return self.waiting or bool(self.held)

    @property
    def waiting(self) -> bool:
        """Requests still to be admitted here (their KV or the detokenizer's answer to come);
        held pages are not: a drain need not outwait their lease, since once this process
        has gone, a late write has nowhere to land."""
        return bool(self.reservations or self.resumes)

    # -- between steps ---------------------------------------------------------------------
    async def reserve(self, req: TokenizedRequest) -> bool:
        """Reserve pages for ``req``'s prompt and ask its prefill executor to fill them; False
        when there is no room (the caller computes it here). Raises on a bad request."""
        svc, rid = self.service, req.request_id
        pages = handoff.reserve(
            svc.engine, rid, req.prompt_token_ids, sampling_params(req.params), req.guest, req.lora
        )
        if pages is None:
            return False
        now, window = time.monotonic(), svc.config.kv_transfer_timeout_s
        self.jobs_sent += 1
        job_id = f"{svc.incarnation}-{self.jobs_sent}"
        self.reservations[rid] = Reservation(req, pages, job_id, now + window)
        # A peer not heard from yet counts as alive from now (it was routed to, so it lives).
        self.peers_seen.setdefault(req.prefill_executor, (req.prefill_incarnation, now))
        layout = svc.engine.runner.kv.layout()
        job = PrefillRequest(
            request=req,
            decode_executor=svc.config.executor_id,
            decode_incarnation=svc.incarnation,
            agent=self.transport.name,
            layer_bases=list(layout.layer_bases),
            page_bytes=layout.page_bytes,
            num_pages=layout.num_pages,
            pages=pages,
            job_id=job_id,
            write_by=time.time() + window + self.clock_lead(req.prefill_executor),
        )
        subject = svc.subjects.executor_prefill(req.prefill_executor)
        try:
            await svc.svc.publish(subject, job, context=svc.timelines.context(rid))
        except Exception as exc:  # the bus is gone: compute it here
            log.warning("executor: could not ask %s to prefill %s: %s", subject, rid, exc)
            self.reservations[rid].deadline = 0.0
        self.changed.set()
        return True

    async def apply(self) -> None:
        """Admit the sequences whose KV arrived; fall back for the ones that failed."""
        svc = self.service
        self.poll()
        now = time.monotonic()
        for rid, r in list(self.reservations.items()):
            done = r.done
            if done is not None and done.outcome == "written" and r.notified:
                del self.reservations[rid]
                handoff.admit_prefilled(svc.engine, rid, done.first_token)
            elif done is not None and done.outcome == "finished":
                del self.reservations[rid]
                svc.engine.abort(rid)  # the first token ended it: give the pages back
                svc.forget(rid, "stop")
            elif done is not None and done.outcome == "failed":
                self.fall_back(rid, done.error)
            elif now > r.deadline:
                self.fall_back(rid, "no KV arrived in time")
            elif not self.peer_alive(peer_of(r.request), now):
                self.fall_back(rid, "the prefill executor is gone")
        for job_id, held in list(self.held.items()):
            if held.done or now > held.fenced_at:
                del self.held[job_id]
                handoff.release(svc.engine, held.table)
        resumes, self.resumes = self.resumes, []
        for resume in resumes:
            await self.resume(resume)

    def poll(self) -> None:
        notes = self.transport.notifications()
        if not notes:
            return
        by_job = {r.job_id: r for r in self.reservations.values()}
        for note in notes:
            r = by_job.get(note.decode(errors="replace"))
            if r is not None:
                r.notified = True

    def fall_back(self, rid: str, why: str) -> None:
        svc = self.service
        r = self.reservations.pop(rid)
        self.hold(r)
        peer = r.request.prefill_executor
        log.warning("executor: %s from %s: %s; computing it here", rid, peer, why)
        svc.metrics.kv_transfer_failures.labels(peer, svc.config.executor_id).inc()
        if r.done is None:  # it may still be computing: stop it (it then says it is done)
            stop = AbortRequests([rid], "computed on its decode executor", executor_id=peer)
            self.fire(svc.try_publish_quietly(svc.subjects.abort, stop))
        self.fire(self.ask_progress(r.request))

    async def ask_progress(self, req: TokenizedRequest) -> None:
        """What the prefill side streamed (the detokenizer drops its tokens from now on)."""
        svc = self.service
        ask = StreamProgressRequest(
            req.prefill_executor, [req.request_id], req.prefill_incarnation, [req.migrations]
        )
        try:
            reply = await svc.svc.request(
                svc.subjects.detok_progress(req.detok_shard), ask, StreamProgressReply, 2.0
            )
        except NoAnswer as exc:
            log.error("executor: detokenizer did not answer for %s: %s", req.request_id, exc)
            self.resumes.append(Resume(req, None))
        else:
            ended = req.request_id in reply.ended
            self.resumes.append(Resume(req, reply.streamed.get(req.request_id, []), ended))
        svc.wake.set()

    async def resume(self, resume: Resume) -> None:
        svc, req = self.service, resume.request
        rid = req.request_id
        if svc.requests.get(rid) is not req:
            return  # aborted meanwhile, or moved off and sent back here as a new run
        if resume.ended:
            svc.forget(rid, "stop")
            return
        if resume.streamed is None:
            error = ErrorEvent(
                rid, 503, "The prompt's KV transfer failed and the stream could not be resumed; "
                "retry.", "server_error", "kv_transfer_failed",
            )  # fmt: skip
            await svc.fail_request(rid, error)
            return
        svc.timelines.prefilled_elsewhere(rid, False)  # computed here after all
        try:
            svc.engine.add_request(
                rid,
                req.prompt_token_ids,
                sampling_params(req.params),
                resume.streamed,
                guest=req.guest,
                lora=req.lora,
            )
        except ValueError as exc:  # e.g. the stream already has max_tokens
            await svc.fail_request(rid, ErrorEvent(rid, 400, str(exc)))

    def ready(self, r: Reservation, now: float) -> bool:
        """Does ``apply`` have something to do for this reservation?"""
        if now > r.deadline:
            return True
        if r.done is not None:
            return r.notified or r.done.outcome != "written"
        return not self.peer_alive(peer_of(r.request), now)

    async def pump(self) -> None:
        """While reservations wait and the step loop is idle, look for NIXL notifications
        (and deadlines) often enough that a transfer's end starts its decode at once."""
        while True:
            if self.held:
                self.service.wake.set()  # apply() releases what it can; cheap when idle
            if not self.reservations:
                if self.held:
                    await asyncio.sleep(0.1)
                    continue
                self.changed.clear()
                await self.changed.wait()
                continue
            self.poll()
            now = time.monotonic()
            if any(self.ready(r, now) for r in self.reservations.values()):
                self.service.wake.set()
            await asyncio.sleep(POLL_S)
