"""A prefill executor's half of disaggregation (``--role prefill``).

A decode executor sends a ``PrefillRequest``: the request, and the pages it reserved for the
prompt. The request runs here like any other (chunked prefill, prefix cache) until it samples
its first token, which streams to the detokenizer at once, marked as continuing on the decode
executor. Right after that step, before the next one can touch the pages, the prompt's KV is
written into the reserved pages with NIXL (``kv_transport.py``), the sequence leaves this
engine (its full pages stay in the prefix cache) and ``PrefillDone`` tells the decode side.
No write starts past the job's ``write_by`` and one still running then is cancelled: the decode
side reuses the pages soon after, whether or not it heard from us.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from common.kv_layout import KVLayout
from common.recent_ids import RecentIds
from common.runtime import NoAnswer
from common.wire.executor import AbortRequests, KVAgentQuery, KVAgentReply, PrefillDone
from common.wire.executor import PrefillRequest as Job
from gpu import handoff
from gpu.engine import StepOutput
from services.executor.kv_transport import KVTransport, TransferError, TransferResult
from services.executor.timeline import HANDOFF

if TYPE_CHECKING:
    from services.executor.service import ExecutorService

log = logging.getLogger("meshserve.executor")

PAST_LEASE = "the decode side's lease on its pages (write_by) is over"


class PrefillSide:
    def __init__(self, service: ExecutorService, transport: KVTransport) -> None:
        self.service = service
        self.transport = transport
        self.jobs: dict[str, Job] = {}  # requests computed here for a decode executor
        self.sending: set[asyncio.Future[None]] = set()
        # What each recent job's decode side was told: said again when it asks (a lost
        # answer would hold its pages for as long as this executor lives).
        self.answered: RecentIds[str, tuple[Job, PrefillDone]] = RecentIds(max_size=4096)

    async def on_prefill(self, job: Job) -> None:
        svc, rid = self.service, job.request.request_id
        if job.agent not in self.transport.peers:
            try:
                await self.learn_peer(job)
            except (NoAnswer, RuntimeError, ValueError) as exc:
                await self.done(job, PrefillDone(rid, "failed", error=f"no NIXL peer: {exc}"))
                return
        # Checked after asking for the peer (an abort may come meanwhile, while the job is in
        # no list an abort looks at): the decode side holds the pages until it hears.
        if rid in svc.ended:  # aborted before it came, or while we asked
            await self.done(job, PrefillDone(rid, "failed", error="aborted"))
            return
        if time.time() >= job.write_by:  # its pages' lease is over: nothing may go there
            await self.done(job, PrefillDone(rid, "failed", error=PAST_LEASE))
            return
        self.jobs[rid] = job
        await svc.on_submit(job.request)

    async def learn_peer(self, job: Job) -> None:
        """The decode executor's NIXL agent metadata, asked for once per peer process."""
        svc = self.service
        reply = await svc.svc.request(
            svc.subjects.executor_kv_agent(job.decode_executor),
            KVAgentQuery(svc.config.executor_id),
            KVAgentReply,
            2.0,
        )
        if reply.agent != job.agent:
            raise ValueError(f"{job.decode_executor} now runs agent {reply.agent}, not {job.agent}")
        self.transport.add_peer(reply.metadata)
        log.info("executor: NIXL peer %s (%s) added", job.decode_executor, reply.agent)

    def continues_on(self, request_id: str) -> tuple[str, str] | None:
        job = self.jobs.get(request_id)
        return (job.decode_executor, job.decode_incarnation) if job is not None else None

    async def peer_withdrawn(self, executor_id: str, request_ids: list[str]) -> None:
        """The scheduler moved these requests off decode executor ``executor_id``: stop
        computing them here (their stream goes on elsewhere)."""
        mine = [
            rid
            for rid in request_ids
            if (job := self.jobs.get(rid)) is not None and job.decode_executor == executor_id
        ]
        if mine:
            own = self.service.config.executor_id
            await self.service.on_abort(AbortRequests(mine, "decode side gone", own))

    def forget(self, request_id: str, outcome: str = "failed") -> None:
        """A job that ends here before its KV was written: its decode side holds the pages
        until told that nothing more will be written into them. ``failed``: the decode side
        computes the prompt itself (aborted here, or withdrawn); ``finished``: the request
        ended here, its client told (the decode side only frees the pages)."""
        job = self.jobs.pop(request_id, None)
        if job is not None:
            message = PrefillDone(request_id, outcome, error="ended on the prefill side")
            self.send(job, message)

    def answer_again(self, request_ids: set[str]) -> None:
        """Repeat what was said of these jobs, ended here already, to their decode side."""
        for rid in request_ids:
            said = self.answered.get(rid)
            if said is not None and rid not in self.jobs:
                self.send(*said)

    def send(self, job: Job, message: PrefillDone) -> None:
        task = asyncio.ensure_future(self.done(job, message))
        self.sending.add(task)  # held until sent (the loop keeps only weak references)
        task.add_done_callback(self.sending.discard)

    async def hand_off(self, outputs: list[StepOutput]) -> None:
        """After a step's tokens went out, between steps: write the KV of every job that
        sampled its first token, then tell its decode executor."""
        for out in outputs:
            job = self.jobs.pop(out.request_id, None)
            if job is None:
                continue
            if out.finish_reason is not None:  # the first token ended it
                await self.done(job, PrefillDone(out.request_id, "finished"))
                continue
            await self.write(job, out.new_token_ids[0])

    async def write(self, job: Job, first_token: int) -> None:
        svc, rid = self.service, job.request.request_id
        detached = handoff.detach_prefilled(svc.engine, rid)
        if detached is None:
            await self.done(job, PrefillDone(rid, "failed", error="the sequence is gone"))
            return
        table, _ = detached
        dst = KVLayout(tuple(job.layer_bases), job.page_bytes, job.num_pages)
        started = time.time_ns()
        pair = svc.metrics.kv_transfer_bytes.labels(svc.config.executor_id, job.decode_executor)
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                svc.worker, self.write_within_lease, job, table.pages, dst
            )
        except (TransferError, ValueError) as exc:
            # (kv_transfer_failures: the decode side counts it, as every other way the
            # handoff fails, once)
            log.warning("executor: KV of %s to %s failed: %s", rid, job.decode_executor, exc)
            svc.timelines.kv_transfer(
                rid, job.decode_executor, started, time.time_ns(), 0, len(table.pages), str(exc)
            )
            posted = isinstance(exc, TransferError) and exc.posted
            message = PrefillDone(rid, "failed", error=str(exc), write_may_land=posted)
        else:
            pair.inc(result.bytes)
            svc.metrics.kv_transfer_time.labels(
                svc.config.executor_id, job.decode_executor
            ).observe(result.seconds)
            svc.timelines.kv_transfer(
                rid, job.decode_executor, started, time.time_ns(), result.bytes, len(table.pages)
            )
            message = PrefillDone(rid, "written", first_token, "", result.bytes, result.seconds)
        finally:
            handoff.release(svc.engine, table)
        svc.forget(rid, HANDOFF)
        await self.done(job, message)

    def write_within_lease(self, job: Job, src_pages: list[int], dst: KVLayout) -> TransferResult:
        """The write, given what is left of the lease as its timeout (checked here, on the
        worker thread, right before it starts: a step may have kept the thread meanwhile)."""
        left = job.write_by - time.time()
        if left <= 0:
            raise TransferError(PAST_LEASE)
        return self.transport.write(job.agent, src_pages, dst, job.pages, job.job_id.encode(), left)

    async def done(self, job: Job, message: PrefillDone) -> None:
        svc = self.service
        message = dataclasses.replace(message, job_id=job.job_id)
        self.answered.add(message.request_id, (job, message))
        await svc.try_publish(svc.subjects.executor_prefilled(job.decode_executor), message)
