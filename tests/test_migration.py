"""Migration: a request resumed from the tokens it already streamed continues exactly as an
uninterrupted run (engine level), and the detokenizer and scheduler carry one stream across
executors (service level, on a real nats-server)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from common.config import MeshConfig
from common.tokenizer import Tokenizer
from common.wire.codec import decode_any
from common.wire.detokenizer import (
    SeqTokens,
    StepTokens,
    StreamProgressReply,
    StreamProgressRequest,
    StreamStart,
)
from common.wire.executor import AbortRequests, TokenizedRequest
from common.wire.gateway import ErrorEvent, TextDelta, TextDeltas
from common.wire.scheduler import Heartbeat
from common.wire.tokenizer import WireSamplingParams
from gpu.sampling_params import SamplingParams
from services.detokenizer.service import DetokenizerConfig, DetokenizerService
from services.scheduler.service import SchedulerService, SchedulerServiceConfig
from tests.test_engine import make_engine, prompts_for, run_until_done

PARAMS = [
    SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, ignore_eos=True, max_tokens=24),
    SamplingParams(
        temperature=0.8, seed=11, repetition_penalty=1.3, ignore_eos=True, max_tokens=24
    ),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded", "seeded-penalties"])
def test_a_resumed_request_continues_as_the_uninterrupted_run(tiny_llama, params):
    prompt = prompts_for(5, [13])[0]
    whole: dict[str, list[int]] = {}
    engine = make_engine(tiny_llama)
    engine.add_request("r", prompt, params)
    run_until_done(engine, whole)
    assert len(whole["r"]) == 24
    for cut in (1, 9, 23):
        resumed: dict[str, list[int]] = {}
        other = make_engine(tiny_llama)  # another executor: nothing of "r" cached
        other.add_request("other", prompts_for(6, [7])[0], PARAMS[1])  # shares the batch
        other.add_request("r", prompt, params, output_token_ids=whole["r"][:cut])
        run_until_done(other, resumed)
        assert whole["r"][:cut] + resumed["r"] == whole["r"], cut


def test_a_resumed_request_that_already_has_max_tokens_is_refused(tiny_llama):
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("r", [5, 6], PARAMS[0], output_token_ids=list(range(3, 27)))


# -- the detokenizer: one stream across executors ---------------------------------------------


class Wire:
    """A test's own NATS connection: publishes steps, records what reaches the inbox."""

    def __init__(self, nc, svc: DetokenizerService) -> None:
        self.nc, self.svc = nc, svc
        self.deltas: list[TextDelta] = []

    async def step(self, executor: str, seq: SeqTokens, incarnation: str = "") -> None:
        """Publish one step and wait until the detokenizer has handled it (and what it sent
        the inbox has had a moment to arrive)."""
        handled = self.svc.svc.metrics.messages.labels("detokenizer", "StepTokens")
        before = handled._value.get()
        step = StepTokens(executor, [seq], incarnation)
        await self.nc.publish(self.svc.svc.subjects.detok(0), step.encode())
        await self.nc.flush()
        async with asyncio.timeout(10):
            while handled._value.get() == before:
                await asyncio.sleep(0.005)
        await self.nc.flush()
        await asyncio.sleep(0.05)

    async def until_text(self, text: str, finished: bool = False) -> None:
        """Until the inbox has received ``text`` (deltas travel on after the step's handler),
        and the stream's last delta when ``finished``."""
        async with asyncio.timeout(10):
            while self.text != text or (
                finished and not (self.deltas and self.deltas[-1].finish_reason)
            ):
                await asyncio.sleep(0.01)

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)


@pytest.fixture
async def wire(nats_server, tiny_llama):
    import nats

    svc = DetokenizerService(DetokenizerConfig(MeshConfig(nats_server.url), str(tiny_llama)))
    await svc.start()
    nc = await nats.connect(nats_server.url)
    w = Wire(nc, svc)

    async def on_inbox(msg):
        event = decode_any(msg.data, TextDeltas, ErrorEvent)
        assert isinstance(event, TextDeltas), event
        w.deltas.extend(event.deltas)

    await nc.subscribe("test.inbox", cb=on_inbox)
    yield w
    await nc.close()
    await svc.svc.close()


def start(deadline: float | None = None, migrations: int = 0) -> StreamStart:
    return StreamStart(
        [], True, 3, 0, reply_to="test.inbox", deadline=deadline, migrations=migrations
    )


async def test_a_stream_moves_to_another_executor_without_repeating_or_dropping(wire, tiny_llama):
    ids = Tokenizer.from_folder(tiny_llama).encode("one two three four five six")
    await wire.step("ex-a", SeqTokens("r", ids[:3], None, 3, start()))
    reply = await wire.svc.on_progress(StreamProgressRequest("ex-a", ["r", "never"]))
    assert reply.streamed == {"r": ids[:3]} and reply.ended == []
    # The lost executor's late tokens are dropped; the new one's continue the stream.
    await wire.step("ex-a", SeqTokens("r", [ids[3]], None, 4))
    await wire.step("ex-b", SeqTokens("r", ids[3:5], None, 5, start()))
    await wire.step("ex-a", SeqTokens("r", [ids[5]], None, 5))
    await wire.step("ex-b", SeqTokens("r", ids[5:], "length", len(ids)))
    await wire.until_text(Tokenizer.from_folder(tiny_llama).decode(ids), finished=True)
    assert wire.deltas[-1].finish_reason == "length"
    assert wire.deltas[-1].usage.completion_tokens == len(ids)
    assert wire.svc.streams == {}
    # Asked again (a second loss racing the finish): it has ended, nothing to move.
    reply = await wire.svc.on_progress(StreamProgressRequest("ex-b", ["r"]))
    assert reply.ended == ["r"] and reply.streamed == {}


async def test_a_stream_moves_to_a_restarted_executor_under_the_same_id(wire, tiny_llama):
    """A supervisor restarts the killed executor-0 at once; the request may move to the new
    process under the same id: its tokens continue the stream, the old one's are dropped."""
    tok = Tokenizer.from_folder(tiny_llama)
    ids = tok.encode("red green blue cyan")
    await wire.step("executor-0", SeqTokens("r", ids[:2], None, 2, start()), "old")
    await wire.svc.on_progress(StreamProgressRequest("executor-0", ["r"], "old"))
    await wire.step("executor-0", SeqTokens("r", [ids[2]], None, 3), "old")  # late: dropped
    await wire.step("executor-0", SeqTokens("r", ids[2:], "length", len(ids), start()), "new")
    await wire.until_text(tok.decode(ids), finished=True)
    assert wire.deltas[-1].finish_reason == "length"


async def test_a_stream_sent_back_to_the_same_executor_process_continues(wire, tiny_llama):
    """A slow executor is counted lost, and its request goes back to it (no other had room):
    the new run's start, from the very process it was withdrawn from, takes the stream; the
    old run's late tokens are still dropped."""
    tok = Tokenizer.from_folder(tiny_llama)
    ids = tok.encode("north south east west")
    await wire.step("ex-a", SeqTokens("r", ids[:2], None, 2, start()), "inc1")
    reply = await wire.svc.on_progress(StreamProgressRequest("ex-a", ["r"], "inc1"))
    assert reply.streamed == {"r": ids[:2]}
    await wire.step("ex-a", SeqTokens("r", [ids[2]], None, 3), "inc1")  # the old run: dropped
    await wire.step("ex-a", SeqTokens("r", [ids[2]], None, 3, start()), "inc1")  # the new run
    await wire.step("ex-a", SeqTokens("r", ids[3:], "length", len(ids)), "inc1")
    await wire.until_text(tok.decode(ids), finished=True)
    assert wire.deltas[-1].usage.completion_tokens == len(ids)


async def test_a_request_sent_back_before_it_streamed_anything_streams(wire, tiny_llama):
    """The executor stalled before the request's first token, and the request went back to
    that same process (a one-executor mesh, or it was the only one with room). No stream
    existed, so the new run's start looked like the old run's late one and was dropped, and
    every step after it: the client waited in silence while the run finished unheard. The
    run's migrations tell them apart: the old run's start is dropped, the new one's taken."""
    ids = Tokenizer.from_folder(tiny_llama).encode("sent back at once")
    reply = await wire.svc.on_progress(StreamProgressRequest("ex-a", ["r"], "a1", [0]))
    assert reply.streamed == {} and reply.ended == []
    await wire.step("ex-a", SeqTokens("r", ids[:1], None, 1, start()), "a1")  # the old run
    assert "r" not in wire.svc.streams
    await wire.step("ex-a", SeqTokens("r", ids[:2], None, 2, start(migrations=1)), "a1")
    await wire.step("ex-a", SeqTokens("r", ids[2:], "length", len(ids)), "a1")
    await wire.until_text(Tokenizer.from_folder(tiny_llama).decode(ids), finished=True)
    assert wire.deltas[-1].usage is not None
    assert wire.deltas[-1].usage.completion_tokens == len(ids)


async def test_a_request_paired_again_with_its_lost_decode_executor_streams(wire, tiny_llama):
    """Disaggregated: the decode executor was counted lost before the first token, and the
    request is paired with it again. The prefill side's first token of the new run (marked
    as continuing there) starts the stream; the old run's is dropped."""
    ids = Tokenizer.from_folder(tiny_llama).encode("paired once more")
    await wire.svc.on_progress(StreamProgressRequest("dec", ["r"], "d1", [2]))
    old = SeqTokens("r", ids[:1], None, 1, start(migrations=2), continues_on=("dec", "d1"))
    await wire.step("pre", old, "p1")
    assert "r" not in wire.svc.streams
    new = SeqTokens("r", ids[:1], None, 1, start(migrations=3), continues_on=("dec", "d1"))
    await wire.step("pre", new, "p1")
    assert "r" in wire.svc.streams
    await wire.step("dec", SeqTokens("r", ids[1:], "length", len(ids), start(migrations=3)), "d1")
    await wire.until_text(Tokenizer.from_folder(tiny_llama).decode(ids), finished=True)


async def test_a_late_first_token_for_a_lost_decode_executor_is_dropped(wire, tiny_llama):
    """The decode executor dies while its prefill executor computes a prompt: the prefill
    side's first token, marked as continuing on the dead one, must not start the stream (it
    would then take tokens only from the dead executor); the request's new executor does."""
    tok = Tokenizer.from_folder(tiny_llama)
    ids = tok.encode("one small step")
    reply = await wire.svc.on_progress(StreamProgressRequest("dec", ["r"], "d1"))
    assert reply.streamed == {} and reply.ended == []
    late = SeqTokens("r", ids[:1], None, 1, start(), continues_on=("dec", "d1"))
    await wire.step("pre", late, "p1")
    assert "r" not in wire.svc.streams
    await wire.step("ex-b", SeqTokens("r", ids, "length", len(ids), start()), "b1")
    await wire.until_text(tok.decode(ids), finished=True)


async def test_a_stream_moved_before_its_start_came_is_not_failed(wire, tiny_llama):
    """The scheduler moves a request before its first step reached the detokenizer; the old
    executor's steps then come (the one with the start, then one without): they are dropped,
    not taken for a stream the detokenizer lost (that failed the request, and its new run with
    it), and the new executor's stream goes through."""
    tok = Tokenizer.from_folder(tiny_llama)
    ids = tok.encode("wind and rain")
    reply = await wire.svc.on_progress(StreamProgressRequest("ex-a", ["r"], "a1"))
    assert reply.streamed == {} and reply.ended == []
    await wire.step("ex-a", SeqTokens("r", ids[:1], None, 1, start()), "a1")
    await wire.step("ex-a", SeqTokens("r", ids[1:2], None, 2), "a1")
    assert "r" not in wire.svc.ended
    await wire.step("ex-b", SeqTokens("r", ids, "length", len(ids), start()), "b1")
    await wire.until_text(tok.decode(ids), finished=True)


async def test_a_second_executor_cannot_take_over_a_live_stream(wire, tiny_llama):
    ids = Tokenizer.from_folder(tiny_llama).encode("alpha beta gamma")
    await wire.step("ex-a", SeqTokens("r", ids[:2], None, 2, start()))
    await wire.step("ex-b", SeqTokens("r", ids, None, len(ids), start()))  # a duplicate run
    await wire.until_text(Tokenizer.from_folder(tiny_llama).decode(ids[:2]))
    await asyncio.sleep(0.2)  # and nothing of the duplicate run follows
    assert wire.text == Tokenizer.from_folder(tiny_llama).decode(ids[:2])


async def test_aborted_and_expired_streams_are_forgotten(wire, tiny_llama):
    import time

    ids = Tokenizer.from_folder(tiny_llama).encode("some words here")
    await wire.step("ex-a", SeqTokens("gone", ids[:2], None, 2, start()))
    await wire.step("ex-a", SeqTokens("late", ids[:2], None, 2, start(time.time() + 0.2)))
    await wire.step("ex-a", SeqTokens("moved", ids[:2], None, 2, start()))
    assert set(wire.svc.streams) == {"gone", "late", "moved"}
    await wire.svc.on_abort(AbortRequests(["moved"], "moved", executor_id="ex-a"))
    await wire.svc.on_abort(AbortRequests(["gone"], "client disconnected"))
    assert set(wire.svc.streams) == {"late", "moved"}  # a targeted abort keeps the stream
    await asyncio.sleep(0.3)
    await wire.svc.sweep()
    assert set(wire.svc.streams) == {"moved"}
    # Tokens after the abort (the executor had not seen it yet) start nothing new.
    await wire.step("ex-a", SeqTokens("gone", ids[2:], None, 3, start()))
    assert "gone" not in wire.svc.streams


# -- the scheduler: who moves, who fails -------------------------------------------------------


def tokenized(rid: str, migrations: int = 0) -> TokenizedRequest:
    return TokenizedRequest(
        rid,
        f"inbox.{rid}",
        WireSamplingParams(max_tokens=50),
        [3, 4, 5],
        [],
        0,
        migrations=migrations,
    )


def submitted(published: list[tuple[str, object]], subject: str) -> list[TokenizedRequest]:
    """The messages published on ``subject``, in order; each must be a TokenizedRequest."""
    requests: list[TokenizedRequest] = []
    for sent_on, message in published:
        if sent_on == subject:
            assert isinstance(message, TokenizedRequest), message
            requests.append(message)
    return requests


def beat(executor: str, ids: list[str]) -> Heartbeat:
    return Heartbeat(executor, len(ids), 0, 100, 100, 16, 8, 0, request_ids=ids)


async def test_the_scheduler_moves_a_lost_executors_requests_with_their_streamed_tokens(
    monkeypatch,
):
    sched = SchedulerService(SchedulerServiceConfig(MeshConfig(instance_id="t"), migration_limit=2))
    published: list[tuple[str, object]] = []

    async def publish(subject: str, message: object) -> None:
        published.append((subject, message))

    async def progress(subject, ask, kind, timeout):
        assert isinstance(ask, StreamProgressRequest) and ask.executor_id == "a"
        # each run's migrations: a start from "a" with more is the request's new run there
        moves = dict(zip(ask.request_ids, ask.migrations, strict=True))
        assert moves == {"streaming": 0, "queued": 0, "done": 0, "tired": 2}
        return StreamProgressReply({"streaming": [7, 8, 9], "tired": [1]}, ended=["done"])

    monkeypatch.setattr(sched.svc, "publish", publish)
    monkeypatch.setattr(sched.svc, "request", progress)
    sched.router.observe(beat("a", []))
    for req in (
        tokenized("streaming"),
        tokenized("queued"),
        tokenized("done"),
        tokenized("tired", 2),
    ):
        await sched.on_submit(req)
    assert {a.executor_id for a in sched.inflight.assignments.values()} == {"a"}
    published.clear()
    sched.router.executors["a"].last_seen -= 60  # silent: the sweep finds it dead
    await sched.sweep()
    s = sched.svc.subjects
    withdraw = published[0][1]
    assert published[0][0] == s.abort and isinstance(withdraw, AbortRequests)
    assert withdraw.executor_id == "a" and len(withdraw.request_ids) == 4
    moved = {req.request_id: req for _, req in sched.queue}  # no executor left: they wait
    assert set(moved) == {"streaming", "queued"}
    assert moved["streaming"].output_token_ids == [7, 8, 9]
    assert moved["streaming"].migrations == 1
    assert moved["queued"].output_token_ids == []  # never started: runs from its prompt
    errors = [m for subject, m in published if isinstance(m, ErrorEvent)]
    assert [(e.request_id, e.code) for e in errors] == [("tired", "executor_failed")]
    assert published[-1] == (s.abort, AbortRequests(["tired"], "executor failed"))
    # It resumes where the stream stopped, on the next executor with room.
    published.clear()
    await sched.on_heartbeat(beat("b", []))
    await sched.settled()
    sent = {m.request_id: m for m in submitted(published, s.executor_submit("b"))}
    assert sent["streaming"].output_token_ids == [7, 8, 9]


async def test_without_the_detokenizers_answer_lost_requests_fail_clearly(monkeypatch):
    from common.runtime import NoAnswer

    sched = SchedulerService(SchedulerServiceConfig(MeshConfig(instance_id="t")))
    published: list[object] = []

    async def publish(subject: str, message: object) -> None:
        published.append(message)

    async def silent(*args, **kwargs):
        raise NoAnswer("timeout")

    monkeypatch.setattr(sched.svc, "publish", publish)
    monkeypatch.setattr(sched.svc, "request", silent)
    sched.router.observe(beat("a", []))
    await sched.on_submit(tokenized("x"))
    await sched.executor_lost("a")
    assert sched.queue == []
    assert [m.code for m in published if isinstance(m, ErrorEvent)] == ["executor_failed"]


async def test_a_request_aborted_while_it_migrates_is_not_run_again(monkeypatch):
    """The client leaves while the scheduler asks the detokenizer what a lost executor's
    stream received (the detokenizer answered before it saw the abort): the request is not
    queued again, where it then ran for nobody or held a queue slot until its deadline."""
    sched = SchedulerService(SchedulerServiceConfig(MeshConfig(instance_id="t")))

    async def publish(subject: str, message: object) -> None:
        pass

    async def progress(subject, ask, kind, timeout):
        await sched.on_abort(AbortRequests(["x"], "client disconnected"))
        return StreamProgressReply({"x": [7]}, ended=[])

    monkeypatch.setattr(sched.svc, "publish", publish)
    monkeypatch.setattr(sched.svc, "request", progress)
    sched.router.observe(beat("a", []))
    await sched.on_submit(tokenized("x"))
    await sched.executor_lost("a")
    assert sched.queue == [] and "x" not in sched.queued and "x" not in sched.inflight


async def test_tokens_of_a_stream_this_shard_never_saw_fail_it_clearly(wire, nats_server):
    """A detokenizer that restarted mid-stream has lost its start and text: the stream must
    end with an error (the executor holding it tells the client), not hang."""
    import nats

    nc = await nats.connect(nats_server.url)
    aborts: list[AbortRequests] = []

    async def on_abort(msg):
        aborts.append(AbortRequests.decode(msg.data))

    await nc.subscribe(wire.svc.svc.subjects.abort, cb=on_abort)
    await wire.step("ex-a", SeqTokens("orphan", [5, 6], None, 9))
    await wire.step("ex-a", SeqTokens("orphan", [7], None, 10))
    await nc.close()
    assert len(aborts) == 1  # once, not per step
    assert aborts[0].request_ids == ["orphan"] and "detokenizer restarted" in aborts[0].error
    assert wire.deltas == [] and wire.svc.streams == {}


async def test_a_restarted_executor_under_the_same_id_gives_up_what_the_old_one_held(
    monkeypatch,
):
    """A supervisor restarts a killed executor at once, under the same id: its first heartbeat
    (a new incarnation) must not pass for the old process, whose requests move now."""
    sched = SchedulerService(SchedulerServiceConfig(MeshConfig(instance_id="t")))
    published: list[tuple[str, object]] = []

    async def publish(subject: str, message: object) -> None:
        published.append((subject, message))

    async def progress(subject, ask, kind, timeout):
        return StreamProgressReply({"r": [7, 8]})

    monkeypatch.setattr(sched.svc, "publish", publish)
    monkeypatch.setattr(sched.svc, "request", progress)
    old = Heartbeat("a", 0, 0, 100, 100, 16, 8, 0, incarnation="first")
    await sched.on_heartbeat(old)
    await sched.settled()
    await sched.on_submit(tokenized("r"))
    await sched.on_heartbeat(dataclasses.replace(old, request_ids=["r"]))
    await sched.settled()
    assert "r" in sched.inflight
    published.clear()
    await sched.on_heartbeat(dataclasses.replace(old, incarnation="second"))
    await sched.settled()
    s = sched.svc.subjects
    resent = submitted(published, s.executor_submit("a"))
    assert len(resent) == 1 and resent[0].output_token_ids == [7, 8]
    assert resent[0].migrations == 1
