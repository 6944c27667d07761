"""Failure paths of disaggregated prefill/decode between the two executors, each on a real
nats-server with the peer played by the test: a decode executor holds a request's reserved
pages until its prefill executor says it will write nothing more into them, so every way a
prefill job can end must say so, and a request its client left must not be computed. Pages
whose prefill side went silent stay held until their lease ends, and no write starts past it.
Also an executor whose step raises leaves the mesh at once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client

from common.nats_server import LocalNatsServer
from common.wire.detokenizer import (
    StepTokens,
    StreamProgressReply,
    StreamProgressRequest,
    StreamStart,
)
from common.wire.executor import AbortRequests, PrefillDone, PrefillRequest, TokenizedRequest
from common.wire.gateway import ErrorEvent
from common.wire.scheduler import Heartbeat
from common.wire.tokenizer import WireSamplingParams
from gpu.engine import StepOutput
from services.executor import decode_side
from services.executor.__main__ import drain_and_stop
from services.executor.kv_transport import TransferError
from services.executor.prefill_side import PAST_LEASE
from services.executor.service import ExecutorService
from tests.mesh import tiny_executor, wait_for

PARAMS = WireSamplingParams(max_tokens=40, ignore_eos=True)
PROMPT = list(range(5, 25))


def request(rid: str, prefill_incarnation: str, prompt: list[int] = PROMPT) -> TokenizedRequest:
    return TokenizedRequest(
        rid, "test.inbox", PARAMS, prompt, [], 0,
        prefill_executor="pre-0", prefill_incarnation=prefill_incarnation,
    )  # fmt: skip


class PrefillPeer:
    """A prefill executor ``pre-0`` with the decode executor ``dec-0`` played by the test: it
    records every ``PrefillDone`` sent there."""

    def __init__(self, ex: ExecutorService, nc: Client) -> None:
        self.ex, self.nc = ex, nc
        self.done: list[PrefillDone] = []

    async def on_done(self, msg) -> None:
        self.done.append(PrefillDone.decode(msg.data))

    def job(self, rid: str, prompt: list[int] = PROMPT, lease_s: float = 30) -> PrefillRequest:
        req = request(rid, self.ex.incarnation, prompt)
        return PrefillRequest(
            req, "dec-0", "d1", "dec-agent", [0], 64, 64, [0, 1, 2, 3, 4], f"job-{rid}",
            time.time() + lease_s,
        )  # fmt: skip

    async def answers(self, count: int) -> list[tuple[str, str]]:
        await wait_for(lambda: len(self.done) >= count, 10, f"{count} PrefillDone")
        return [(d.request_id, d.outcome) for d in self.done]


@pytest.fixture
async def prefill(nats_server: LocalNatsServer, tiny_llama):
    ex = tiny_executor(nats_server.url, tiny_llama, "pre-0", role="prefill")
    await ex.svc.connect()  # handlers called directly; no step loop: as if a step were running
    assert ex.prefill_side is not None and ex.transport is not None
    ex.transport.peers.add("dec-agent")  # (as if its NIXL metadata were known already)
    nc = await nats.connect(nats_server.url)
    peer = PrefillPeer(ex, nc)
    await nc.subscribe(ex.subjects.executor_prefilled("dec-0"), cb=peer.on_done)
    await nc.flush()
    yield peer
    await nc.close()
    await ex.svc.close()
    ex.transport.close()


async def test_a_prefill_job_aborted_before_it_runs_frees_its_decode_sides_pages(prefill):
    ex, side = prefill.ex, prefill.ex.prefill_side
    await ex.on_abort(AbortRequests(["early"]))  # the client left before the job came
    await side.on_prefill(prefill.job("early"))
    await side.on_prefill(prefill.job("waiting"))  # waits for the step in progress
    assert [r.request_id for r in ex.pending_adds] == ["waiting"]
    await ex.on_abort(AbortRequests(["waiting"]))
    assert await prefill.answers(2) == [("early", "failed"), ("waiting", "failed")]
    assert side.jobs == {} and ex.pending_adds == [] and ex.requests == {}


async def test_a_job_aborted_while_its_decode_sides_agent_is_asked_for_is_answered(
    prefill, monkeypatch
):
    """The first job from a decode executor waits for its NIXL metadata; an abort meanwhile
    must still end it with an answer (it was in no list an abort looks at)."""
    ex, side = prefill.ex, prefill.ex.prefill_side
    asked = asyncio.Event()
    answer = asyncio.Event()

    async def learn_peer(job: PrefillRequest) -> None:
        asked.set()
        await answer.wait()
        side.transport.peers.add(job.agent)

    monkeypatch.setattr(side, "learn_peer", learn_peer)
    job = dataclasses.replace(prefill.job("r"), agent="new-agent")
    task = asyncio.create_task(side.on_prefill(job))
    await asyncio.wait_for(asked.wait(), 5)
    await ex.on_abort(AbortRequests(["r"]))
    answer.set()
    await task
    assert await prefill.answers(1) == [("r", "failed")]
    assert side.jobs == {} and ex.pending_adds == [] and "r" not in ex.requests


async def test_a_lost_answer_is_said_again_when_the_decode_side_asks(prefill):
    """The decode side, having heard nothing, falls back and sends a targeted abort: the prefill
    side, done with the job already, repeats its answer (else the pages stay held)."""
    ex, side = prefill.ex, prefill.ex.prefill_side
    await ex.on_abort(AbortRequests(["r"]))
    await side.on_prefill(prefill.job("r"))
    await prefill.answers(1)
    await ex.on_abort(AbortRequests(["r", "unknown"], "computed on its decode executor", "pre-0"))
    assert await prefill.answers(2) == [("r", "failed"), ("r", "failed")]
    assert [d.job_id for d in prefill.done] == ["job-r", "job-r"]  # (its job, not another)
    await asyncio.sleep(0.2)
    assert len(prefill.done) == 2  # nothing said of a job it never had


async def test_a_prefill_job_refused_here_ends_it_on_the_decode_side_too(prefill):
    """Its client has a 400 already: the decode side frees the pages ("finished") instead of
    computing the prompt itself ("failed")."""
    ex, side = prefill.ex, prefill.ex.prefill_side
    too_long = list(range(5, 5 + ex.engine.max_seq_len + 8))
    await side.on_prefill(prefill.job("long", too_long))
    await ex.apply_pending()
    assert await prefill.answers(1) == [("long", "finished")]
    assert side.jobs == {} and "long" not in ex.requests


async def test_no_write_starts_past_the_decode_sides_lease(prefill, monkeypatch):
    """A job whose lease is over when it comes is refused; one whose lease ends while its
    prompt is computed is not written (the decode side may have reused the pages): the decode
    side hears "failed" either way, and this side gives the prompt's pages back."""
    ex, side = prefill.ex, prefill.ex.prefill_side
    writes: list[str] = []
    monkeypatch.setattr(ex.transport, "write", lambda *args: writes.append(args[0]))
    await side.on_prefill(prefill.job("late", lease_s=-0.1))
    assert side.jobs == {} and ex.pending_adds == []
    await side.on_prefill(prefill.job("slow", lease_s=0.5))
    await ex.apply_pending()
    assert "slow" in ex.engine.seqs
    await asyncio.sleep(0.6)  # the step computing its prompt took past the lease
    outputs = ex.engine.step()
    assert [o.request_id for o in outputs] == ["slow"]
    await side.hand_off(outputs)
    assert await prefill.answers(2) == [("late", "failed"), ("slow", "failed")]
    assert {d.error for d in prefill.done} == {PAST_LEASE}
    assert writes == []
    assert "slow" not in ex.engine.seqs and ex.engine.pages.num_free == ex.engine.pages.num_pages


@pytest.mark.parametrize("posted", [False, True], ids=["refused", "timed-out"])
async def test_a_write_that_failed_mid_way_says_its_bytes_may_still_land(
    prefill, monkeypatch, posted: bool
):
    ex, side = prefill.ex, prefill.ex.prefill_side

    def fail(*args):
        raise TransferError("the transfer did not finish in time", posted=posted)

    monkeypatch.setattr(ex.transport, "write", fail)
    await side.on_prefill(prefill.job("w"))
    await ex.apply_pending()
    await side.hand_off(ex.engine.step())
    assert await prefill.answers(1) == [("w", "failed")]
    assert prefill.done[0].write_may_land is posted
    # One failure, counted once: by the decode side, which falls back on this answer (both
    # sides counted it, under the same labels, and the dashboard summed them).
    assert failures(ex, "pre-0", "dec-0") == 0


def failures(ex: ExecutorService, prefill: str, decode: str) -> float:
    """``kv_transfer_failures_total`` of the (prefill, decode) pair on ``ex``."""
    return float(ex.metrics.kv_transfer_failures.labels(prefill, decode)._value.get())


class DecodeHost:
    """A decode executor ``dec-0`` (stepping) with the prefill executor ``pre-0`` and the
    detokenizer played by the test."""

    def __init__(self, ex: ExecutorService, nc: Client) -> None:
        self.ex, self.nc = ex, nc
        self.jobs: list[PrefillRequest] = []
        self.tokens: dict[str, list[int]] = {}
        self.starts: dict[str, StreamStart] = {}
        self.asked: list[float] = []  # when the detokenizer was asked what was streamed
        self.asks: list[StreamProgressRequest] = []
        self.answered = asyncio.Event()
        self.aborted_before_answer = False
        self.peer_clock_lead: float | None = None  # pre-0's heartbeats carry no time

    async def on_job(self, msg) -> None:
        self.jobs.append(PrefillRequest.decode(msg.data))

    async def on_step(self, msg) -> None:
        for seq in StepTokens.decode(msg.data).seqs:
            self.tokens.setdefault(seq.request_id, []).extend(seq.token_ids)
            if seq.start is not None:
                self.starts[seq.request_id] = seq.start

    async def answer_progress(self, msg) -> None:
        """Nothing was streamed."""
        self.asked.append(time.monotonic())
        self.asks.append(StreamProgressRequest.decode(msg.data))
        await msg.respond(StreamProgressReply({}, []).encode())

    async def abort_then_answer(self, msg) -> None:
        """The client leaves while the detokenizer answers (within the 2 s the decode side
        waits: past that it fails the request, which would hide a lost abort)."""
        ask = StreamProgressRequest.decode(msg.data)
        await self.nc.publish(self.ex.subjects.abort, AbortRequests(ask.request_ids).encode())
        await self.nc.flush()
        await asyncio.sleep(0.5)
        self.aborted_before_answer = all(r not in self.ex.requests for r in ask.request_ids)
        await msg.respond(StreamProgressReply({}, []).encode())
        self.answered.set()

    async def resend_then_answer(self, msg) -> None:
        """The scheduler, having counted this executor lost, moves the request off it and
        sends it back here (a new run, paired again) while the detokenizer answers."""
        ask = StreamProgressRequest.decode(msg.data)
        s, jobs = self.ex.subjects, len(self.jobs)
        for rid in ask.request_ids:
            await self.nc.publish(s.abort, AbortRequests([rid], "moved", "dec-0").encode())
            again = dataclasses.replace(request(rid, "p1"), migrations=1)
            await self.nc.publish(s.executor_submit("dec-0"), again.encode())
        await self.nc.flush()
        await wait_for(lambda: len(self.jobs) > jobs, 5, "the new run's prefill job")
        await msg.respond(StreamProgressReply({}, []).encode())
        self.answered.set()

    async def beat(self) -> None:
        while True:  # the prefill peer lives
            lead = self.peer_clock_lead
            sent_at = 0.0 if lead is None else time.time() + lead
            hb = Heartbeat(
                "pre-0", 0, 0, 64, 64, 4, 8, 0, incarnation="p1", role="prefill", sent_at=sent_at
            )
            await self.nc.publish(self.ex.subjects.executor_heartbeat, hb.encode())
            await asyncio.sleep(0.2)

    async def submit(self, rid: str, prompt: list[int] = PROMPT) -> PrefillRequest:
        """Send ``rid`` (paired with ``pre-0``) and return the prefill job it brings."""
        sent = len(self.jobs)
        await self.nc.publish(
            self.ex.subjects.executor_submit("dec-0"), request(rid, "p1", prompt).encode()
        )
        await wait_for(lambda: len(self.jobs) > sent, 10, "the prefill job")
        return self.jobs[-1]

    async def say(self, message: PrefillDone) -> None:
        await self.nc.publish(self.ex.subjects.executor_prefilled("dec-0"), message.encode())
        await self.nc.flush()


@contextlib.asynccontextmanager
async def decode_host(
    nats_url: str, model, *, beat: bool = True, on_progress: str = "answer", **config
) -> AsyncIterator[DecodeHost]:
    """A started decode executor and the test's stand-ins for its peers (``DecodeHost``):
    ``pre-0`` beats unless ``beat`` is False; the detokenizer answers "nothing streamed",
    after the client left (``on_progress="abort"``) or the request was moved off and sent
    back here (``"resend"``)."""
    ex = tiny_executor(nats_url, model, "dec-0", role="decode", **config)
    await ex.start()
    nc = await nats.connect(nats_url)
    host = DecodeHost(ex, nc)
    s = ex.subjects
    progress = {
        "answer": host.answer_progress,
        "abort": host.abort_then_answer,
        "resend": host.resend_then_answer,
    }[on_progress]
    await nc.subscribe(s.executor_prefill("pre-0"), cb=host.on_job)
    await nc.subscribe(s.detok(0), cb=host.on_step)
    await nc.subscribe(s.detok_progress(0), cb=progress)
    beating = asyncio.create_task(host.beat()) if beat else None
    try:
        yield host
    finally:
        if beating is not None:
            beating.cancel()
        await nc.close()
        await ex.svc.close()
        assert ex.transport is not None
        ex.transport.close()


async def held_until_the_lease_ends(
    host: DecodeHost, job: PrefillRequest, sent: float, lease: float, margin: float
) -> None:
    """The request computed here runs to its end while the job's pages stay held, and they
    come back only once its lease and the margin are over."""
    ex = host.ex
    side, total = ex.decode_side, ex.engine.pages.num_pages
    assert side is not None
    await wait_for(lambda: len(host.tokens.get("r", [])) == PARAMS.max_tokens, 20, "r")
    if time.monotonic() - sent < lease - 0.5:  # (a slow machine got past the lease)
        assert list(side.held) == [job.job_id]
        assert ex.engine.pages.num_free == total - len(job.pages)
    await wait_for(lambda: not side.held, lease + 5, "the lease's end")
    assert time.monotonic() - sent >= lease + margin - 0.1
    assert ex.engine.pages.num_free == total


async def test_a_client_abort_during_the_fall_back_to_local_prefill_is_kept(
    nats_server: LocalNatsServer, tiny_llama
) -> None:
    """The prefill side failed; while the decode side asks the detokenizer what was streamed,
    the client leaves: the request must not then be computed here, and its pages come back."""
    async with decode_host(nats_server.url, tiny_llama, on_progress="abort") as host:
        ex = host.ex
        total = ex.engine.pages.num_pages
        job = await host.submit("r")
        assert ex.engine.pages.num_free < total  # reserved for the prompt
        await host.say(PrefillDone("r", "failed", error="no NIXL peer", job_id=job.job_id))
        await asyncio.wait_for(host.answered.wait(), 10)
        await asyncio.sleep(1.0)  # the answer arrives, and steps would have run
        assert host.aborted_before_answer
        assert host.tokens.get("r", []) == []
        assert ex.decode_side is not None and not ex.decode_side.busy
        assert "r" not in ex.engine.seqs
        assert ex.engine.pages.num_free == total


async def test_pages_evicted_for_a_reservation_are_told_to_the_index_at_once(
    nats_server: LocalNatsServer, tiny_llama
) -> None:
    """Reserving pages for a prefill executor's write evicts cached ones, between steps: the
    evictions were published after the next step, which on an otherwise idle decode executor
    comes only with the prefill side's answer, so the index kept routing prompts here for a
    prefix that was gone."""
    async with decode_host(nats_server.url, tiny_llama, kv_cache_tokens=64) as host:
        ex = host.ex
        pages = ex.engine.pages
        local = TokenizedRequest(
            "warm", "test.inbox", dataclasses.replace(PARAMS, max_tokens=2),
            list(range(100, 140)), [], 0, migrations=1,
        )  # fmt: skip
        await host.nc.publish(ex.subjects.executor_submit("dec-0"), local.encode())
        await wait_for(lambda: len(host.tokens.get("warm", [])) == 2, 20, "warm's tokens")
        await wait_for(lambda: ex.kv_events.idle.is_set() and "warm" not in ex.requests, 5, "")
        # (the stream starts with the prompt's tail: the context its first token reads in)
        assert host.starts["warm"].prompt_tail == local.prompt_token_ids[-5:]
        assert host.starts["warm"].migrations == 1  # (the run a late start is told from)
        cached = set(pages.hash_to_page)
        assert set(ex.kv_events.mirror) == cached and len(cached) == 10
        steps = ex.engine.num_steps
        await host.submit("r", list(range(200, 236)))  # 9 pages: some cached ones must go
        evicted = cached - set(pages.hash_to_page)
        assert evicted and "r" in ex.engine.reserved
        await wait_for(lambda: not evicted & set(ex.kv_events.mirror), 2, "the evictions")
        assert set(ex.kv_events.mirror) == set(pages.hash_to_page)
        assert ex.engine.num_steps == steps, "a step ran: it would have published them anyway"


async def test_the_lease_is_given_on_the_prefill_hosts_clock(
    nats_server: LocalNatsServer, tiny_llama
) -> None:
    """``write_by`` is a wall-clock time read on the prefill host. With that host's clock 20 s
    behind, a lease written on the decode host's clock gave it 20 s more than the decode side
    waits, past the 5 s margin: a late write landed in pages by then given to another
    sequence. The lead each heartbeat shows (less its transit) moves the deadline onto the
    peer's clock, never later than ours."""
    async with decode_host(nats_server.url, tiny_llama) as host:
        side = host.ex.decode_side
        assert side is not None
        lease = host.ex.config.kv_transfer_timeout_s
        for rid, lead in (("behind", -20.0), ("ahead", 7.0)):
            host.peer_clock_lead = lead
            side.clock_leads.clear()  # (a beat in flight may still bring the old lead)
            await wait_for(
                lambda lead=lead: lead - 0.5 < side.clock_lead("pre-0") <= lead,  # type: ignore[misc]
                5,
                "a timed heartbeat",
            )
            job = await host.submit(rid)
            assert job.request.request_id == rid
            assert job.write_by - time.time() == pytest.approx(lease + lead, abs=1)


async def test_a_fall_back_overtaken_by_the_requests_new_run_leaves_it_alone(
    nats_server: LocalNatsServer, tiny_llama
) -> None:
    """The prefill side failed; while the decode side asks the detokenizer what was streamed,
    the scheduler moves the request off this executor and sends it back (a new run, paired
    again). The old fall-back then found the id in use and failed the new run with a 400."""
    async with decode_host(nats_server.url, tiny_llama, on_progress="resend") as host:
        ex, side = host.ex, host.ex.decode_side
        assert side is not None
        errors: list[ErrorEvent] = []

        async def on_inbox(msg) -> None:
            errors.append(ErrorEvent.decode(msg.data))

        await host.nc.subscribe("test.inbox", cb=on_inbox)
        job = await host.submit("r")
        await host.say(PrefillDone("r", "failed", error="no NIXL peer", job_id=job.job_id))
        await asyncio.wait_for(host.answered.wait(), 10)
        await asyncio.sleep(1.0)  # the answer arrives, and the step loop applies it
        assert errors == []
        assert ex.requests["r"].migrations == 1 and "r" in ex.engine.reserved
        second = host.jobs[-1]
        assert second.job_id != job.job_id and side.reservations["r"].job_id == second.job_id


async def test_pages_of_a_silent_prefill_executor_are_held_until_their_lease_ends(
    nats_server: LocalNatsServer, tiny_llama, monkeypatch
) -> None:
    """The prefill executor goes silent: the decode executor computes the prompt itself, in
    other pages, at once, but keeps the reserved ones until the job's lease is over (silence
    is no proof that it will not write: partitioned or paused, it may wake and write). An
    answer about another job of the same request changes nothing."""
    monkeypatch.setattr(decode_side, "FENCE_MARGIN_S", 1.0)
    lease = 8.0
    async with decode_host(
        nats_server.url, tiny_llama, beat=False, kv_transfer_timeout_s=lease
    ) as host:
        side = host.ex.decode_side
        assert side is not None
        job = await host.submit("r")
        sent = time.monotonic()
        assert job.write_by - time.time() == pytest.approx(lease, abs=1)
        await host.say(PrefillDone("r", "failed", error="an earlier job", job_id=job.job_id + "0"))
        await asyncio.sleep(0.5)
        assert side.reservations["r"].done is None and not host.asked
        # No heartbeat from pre-0: past 2 s of silence the decode side computes it here.
        await held_until_the_lease_ends(host, job, sent, lease, 1.0)
        # It fell back on the silence (2 s), not at the end of the lease.
        assert host.asked and host.asked[0] - sent < decode_side.PEER_TIMEOUT_S + 2 < lease
        assert host.asks[0] == StreamProgressRequest("pre-0", ["r"], "p1", [0])
        assert "r" not in host.ex.requests


async def test_pages_a_failed_write_may_still_land_in_are_held_until_the_lease_ends(
    nats_server: LocalNatsServer, tiny_llama, monkeypatch
) -> None:
    """The prefill side's write timed out mid-way: the decode executor computes the prompt
    itself at once but keeps the reserved pages out of use until the lease is over (a
    cancelled RDMA write is not known to have stopped), where "failed" released them."""
    monkeypatch.setattr(decode_side, "FENCE_MARGIN_S", 0.5)
    lease = 4.0
    async with decode_host(nats_server.url, tiny_llama, kv_transfer_timeout_s=lease) as host:
        job = await host.submit("r")
        sent = time.monotonic()
        await host.say(
            PrefillDone("r", "failed", error="timed out", job_id=job.job_id, write_may_land=True)
        )
        await held_until_the_lease_ends(host, job, sent, lease, 0.5)
        assert failures(host.ex, "pre-0", "dec-0") == 1


async def test_an_executor_whose_step_fails_goes_silent_and_stops_at_once(
    nats_server: LocalNatsServer, tiny_llama
) -> None:
    """A step that raises (CUDA out of memory, say) leaves the engine's state past trusting:
    no more heartbeats (the scheduler then moves its requests within its timeout, where a
    drain would have reported them as running here for 30 s) and a failure exit."""
    ex = tiny_executor(nats_server.url, tiny_llama, "ex-0")
    await ex.start()
    nc = await nats.connect(nats_server.url)
    beats: list[tuple[float, Heartbeat]] = []

    async def on_beat(msg) -> None:
        beats.append((time.monotonic(), Heartbeat.decode(msg.data)))

    await nc.subscribe(ex.subjects.executor_heartbeat, cb=on_beat)

    def fail() -> list[StepOutput]:
        raise RuntimeError("CUDA out of memory (simulated)")

    ex.engine.step = fail  # type: ignore[method-assign]
    try:
        submit = TokenizedRequest("r", "test.inbox", PARAMS, PROMPT, [], 0)
        await nc.publish(ex.subjects.executor_submit("ex-0"), submit.encode())
        await asyncio.wait_for(ex.svc.shutdown_requested.wait(), 10)
        failed_at = time.monotonic()
        assert ex.broken and "CUDA out of memory" in ex.broken_because
        with pytest.raises(SystemExit) as info:
            async with asyncio.timeout(10):  # (in this task: a task's SystemExit ends the loop)
                await drain_and_stop(ex)
        assert info.value.code == 3
        assert time.monotonic() - failed_at < 8  # not the 30 s drain
        assert not [hb for at, hb in beats if at > failed_at + 0.1]
    finally:
        await nc.close()
