"""The gateway's watchdog: a request the scheduler no longer knows (lost with a restarted
service) is found at once instead of at the request timeout: the gateway resumes it, or, with
resumption off, it ends with a clear 503."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from common.wire.gateway import ErrorEvent
from common.wire.scheduler import RequestStatusReply
from services.gateway.streams import Inbox
from services.gateway.watchdog import check_stalled
from tests.mesh import MeshHarness


class FakeScheduler:
    def __init__(self, known: list[str]) -> None:
        self.known = known
        self.asked: list[list[str]] = []

    async def request(self, subject, message, kind, timeout):
        self.asked.append(list(message.request_ids))
        return RequestStatusReply(self.known)

    @property
    def subjects(self):
        from common.subjects import Subjects

        return Subjects()


async def test_only_a_request_unknown_twice_in_a_row_is_failed():
    inbox = Inbox()
    alive = inbox.open(["alive-0"], 60)
    lost = inbox.open(["lost-0", "lost-1"], 60)
    fresh = inbox.open(["fresh-0"], 60)
    scheduler = FakeScheduler(known=["alive-0", "lost-1"])
    for stream in (alive, lost):
        stream.last_event_at -= 10  # silent for 10 s
    assert await check_stalled(scheduler, inbox, stall_s=5) == 0  # first strike only
    assert scheduler.asked == [["alive-0", "lost-0", "lost-1"]]  # not the fresh one
    for stream in (alive, lost):
        stream.last_event_at -= 10
    assert await check_stalled(scheduler, inbox, stall_s=5) == 1
    with_error = [s for s in (alive, lost, fresh) if not s._queue.empty()]
    assert with_error == [lost]
    error = lost._queue.get_nowait()
    assert isinstance(error, ErrorEvent), error
    assert (error.request_id, error.status, error.code) == ("lost-0", 503, "request_lost")


async def test_every_lost_choice_of_a_stream_is_failed_in_the_same_round():
    """n=3, all three lost with a killed tokenizer: each gets its error (and so its resume)
    now, not one per round after the previous one's continuation has finished."""
    inbox = Inbox()
    lost = inbox.open(["x-0", "x-1", "x-2"], 60)
    scheduler = FakeScheduler(known=[])
    for _ in range(2):
        lost.last_event_at -= 10
        await check_stalled(scheduler, inbox, stall_s=5)
    errors = [lost._queue.get_nowait() for _ in range(lost._queue.qsize())]
    assert all(isinstance(e, ErrorEvent) and e.code == "request_lost" for e in errors)
    assert [e.request_id for e in errors] == ["x-0", "x-1", "x-2"]


async def test_one_choices_strike_does_not_count_towards_another():
    """Strikes were counted per request: choice 0 unknown once, then choice 1 unknown once,
    and choice 1 was failed as lost on its first miss."""
    inbox = Inbox()
    stream = inbox.open(["y-0", "y-1"], 60)
    scheduler = FakeScheduler(known=["y-1"])
    stream.last_event_at -= 10
    assert await check_stalled(scheduler, inbox, stall_s=5) == 0  # y-0: one strike
    scheduler.known = ["y-0"]
    stream.last_event_at -= 10
    assert await check_stalled(scheduler, inbox, stall_s=5) == 0  # y-1: its first
    assert stream.unknown_checks == {"y-1": 1}
    stream.last_event_at -= 10
    assert await check_stalled(scheduler, inbox, stall_s=5) == 1  # y-1's second
    error = stream._queue.get_nowait()
    assert isinstance(error, ErrorEvent) and error.request_id == "y-1"


@pytest.mark.parametrize("max_resumes", [3, 0])
async def test_a_request_lost_with_a_restarted_scheduler_is_resumed_or_gets_a_503(
    tiny_llama, max_resumes
):
    mesh = MeshHarness(tiny_llama, max_num_seqs=1, gateway_options={"max_resumes": max_resumes})
    mesh.start()
    # 240 tokens last >= 2.4 s: on a quiet machine the tiny model's ~1 ms steps would end a
    # busy request within the poll below, and the executor's prompt report of the freed slot
    # would let the third run before it was ever seen queued.
    mesh.slow_steps(0.01)
    try:
        sched = next(s for s in mesh.services if type(s).__name__ == "SchedulerService")
        gateway = mesh.services[-1]
        async with aiohttp.ClientSession() as session:

            async def complete(prompt: str, max_tokens: int):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}
                body["ignore_eos"] = True
                async with session.post(f"{mesh.base_url}/completions", json=body) as resp:
                    return resp.status, await resp.json()

            # One executor slot (and the router's slack of one more): two run, the third waits.
            # As long as the context allows, so they still run when the third is queued on a
            # loaded machine.
            busy = [asyncio.create_task(complete(f"busy {i}", 240)) for i in range(2)]
            await asyncio.sleep(0.3)
            queued = asyncio.create_task(complete("queued", 4))
            for _ in range(500):
                if len(sched.queue) == 1:
                    break
                await asyncio.sleep(0.02)
            assert len(sched.queue) == 1

            async def restart() -> None:  # what a scheduler restart loses: its queue
                sched.queue.clear()
                sched.queued.clear()

            mesh.call(restart())
            started = time.monotonic()
            for _ in range(2):
                mesh.call(check_stalled(gateway.mesh.service, gateway.mesh.inbox, stall_s=0))
            if max_resumes:  # submitted again (nothing was delivered yet): it completes
                status, body = await asyncio.wait_for(queued, 60)
                assert status == 200 and body["usage"]["completion_tokens"] == 4
            else:
                status, body = await asyncio.wait_for(queued, 10)
                assert status == 503 and body["error"]["code"] == "request_lost"
                assert time.monotonic() - started < 5
            for task in busy:  # the running requests are known: they complete
                status, _ = await task
                assert status == 200
    finally:
        mesh.stop()


async def test_a_request_a_backlogged_tokenizer_may_still_hold_is_not_struck():
    """A tokenizer 10 s behind: the scheduler did not know the request yet, the watchdog took
    it for lost twice, and it was resubmitted behind the same backlog (3 times, then a 503).
    While a tokenizer says it is still working through requests older than this one, none is
    struck; once it is past it (or idle), the usual two strikes apply."""
    inbox = Inbox()
    stream = inbox.open(["q-0"], 60)
    scheduler = FakeScheduler(known=[])
    for _ in range(3):
        stream.last_event_at -= 10
        backlog = stream.submitted_at - 20  # working on a request from 20 s before it
        assert await check_stalled(scheduler, inbox, stall_s=5, queued_since=backlog) == 0
    assert stream.unknown_checks == {}
    past_it = stream.submitted_at + 1
    for expected in (0, 1):
        stream.last_event_at -= 10
        assert await check_stalled(scheduler, inbox, stall_s=5, queued_since=past_it) == expected


def test_the_gateway_learns_a_tokenizers_backlog_from_its_presence():
    from common.wire.presence import Presence
    from services.gateway.health import MeshLiveness

    liveness = MeshLiveness()
    liveness.saw(Presence("tokenizer", "tok-0", behind_since=None))
    assert liveness.tokenizers_behind_since() is None
    liveness.saw(Presence("tokenizer", "tok-1", behind_since=1000.0))
    liveness.saw(Presence("tokenizer", "tok-2", behind_since=990.0))
    assert liveness.tokenizers_behind_since() == 990.0
    liveness.saw(Presence("tokenizer", "tok-2", draining=True, behind_since=990.0))
    assert liveness.tokenizers_behind_since() == 1000.0
