"""The executor's load reports on a real nats-server: a sequence that ends is reported at once,
not a heartbeat period later (``ExecutorService.report_freed_slots``)."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from common.wire.detokenizer import StepTokens
from common.wire.executor import TokenizedRequest
from common.wire.scheduler import Heartbeat
from common.wire.tokenizer import WireSamplingParams
from tests.mesh import tiny_executor

PERIOD_S = 30.0  # far longer than the test: every beat but the first is an early one


@pytest.mark.parametrize(
    "b_tokens",
    [
        6,  # both end in one step (or one step apart, if b was admitted a step later)
        7,  # b always ends a step or two after a: its report comes too soon after a's and
        # must be sent late, not dropped
    ],
)
async def test_a_finished_sequence_is_reported_before_the_next_period(
    nats_server, tiny_llama, b_tokens: int
):
    service = tiny_executor(nats_server.url, tiny_llama, "ex-beat", heartbeat_s=PERIOD_S)
    nc = await nats.connect(nats_server.url)
    beats: list[tuple[float, Heartbeat]] = []
    finished_at: dict[str, float] = {}
    s = service.config.mesh.subjects

    async def on_beat(msg) -> None:
        beats.append((time.monotonic(), Heartbeat.decode(msg.data)))

    async def on_step(msg) -> None:
        for seq in StepTokens.decode(msg.data).seqs:
            if seq.finish_reason:
                finished_at[seq.request_id] = time.monotonic()

    await nc.subscribe(s.executor_heartbeat, cb=on_beat)
    await nc.subscribe(s.detok(0), cb=on_step)
    await nc.flush()
    try:
        await service.start()
        async with asyncio.timeout(10):
            while not beats:  # the first periodic one
                await asyncio.sleep(0.01)
        for rid, max_tokens in (("a", 6), ("b", b_tokens)):
            params = WireSamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            req = TokenizedRequest(rid, "test.inbox", params, [5, 6, 7, 8, 9], [], 0)
            await nc.publish(s.executor_submit("ex-beat"), req.encode())
        await nc.flush()
        async with asyncio.timeout(10):
            while len(finished_at) < 2 or not any(hb.running == 0 for _, hb in beats[1:]):
                await asyncio.sleep(0.01)
        report_at, report = next((t, hb) for t, hb in beats[1:] if hb.running == 0)
        # The report that both have ended, with every page free again, came right after the
        # last one's final tokens: the next periodic beat is PERIOD_S away.
        assert report.request_ids == [] and report.waiting == 0
        assert report.free_pages == report.total_pages
        assert report_at - max(finished_at.values()) < 1.0
    finally:
        await nc.close()
        await service.stop()
        service.worker.shutdown()
