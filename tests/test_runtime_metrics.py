"""Every way a service handles a message is measured (common/runtime.py): request/reply
handlers and JetStream replays too, and their error replies."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import pytest

from common.config import MeshConfig
from common.kv_stream import ROLLUP, ensure_kv_stream
from common.nats_server import LocalNatsServer
from common.runtime import NoAnswer, Service
from common.wire.prefix_index import IndexMatchReply, IndexMatchRequest, KVEventBatch


def handled(svc: Service, message: str) -> float:
    labels = {"service": svc.name, "message": message}
    return svc.registry.get_sample_value("meshserve:messages_handled_total", labels) or 0.0


async def test_served_and_replayed_messages_count_as_handled(nats_server: LocalNatsServer) -> None:
    """Only plain subscriptions were measured: the prefix index's answers and its KV-event
    replay, the speculator's drafts and the detokenizer's progress answers showed nowhere,
    nor did a served request's error reply."""
    svc = Service("prefix-index", MeshConfig(nats_server.url, instance_id="t"))
    await svc.connect()
    try:

        async def match(req: IndexMatchRequest) -> IndexMatchReply:
            if not req.page_hashes:
                raise RuntimeError("boom")
            return IndexMatchReply({"ex": 1}, 1)

        await svc.serve("test.match", IndexMatchRequest, match)
        asker = Service("scheduler", MeshConfig(nats_server.url, instance_id="a"))
        await asker.connect()
        await asker.request("test.match", IndexMatchRequest([5], "r"), IndexMatchReply, 2)
        with pytest.raises(NoAnswer):  # (the 500 error reply)
            await asker.request("test.match", IndexMatchRequest([], "r"), IndexMatchReply, 2)
        await asker.close()
        assert handled(svc, "IndexMatchRequest") == 1
        errors = {"service": "prefix-index", "status": "500"}
        assert svc.registry.get_sample_value("meshserve:error_replies_total", errors) == 1

        s = svc.subjects
        await ensure_kv_stream(svc.nc.jetstream(), s)
        got: list[KVEventBatch] = []

        async def on_events(batch: KVEventBatch, pending: int) -> None:
            got.append(batch)

        nc = await nats.connect(nats_server.url)
        await nc.jetstream().publish(
            s.kv_events("ex"), KVEventBatch("ex", 1, True, [], []).encode(), headers=ROLLUP
        )
        await nc.close()
        await svc.replay(s.kv_events_all, KVEventBatch, on_events, s.kv_events_stream)
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.05)
        assert handled(svc, "KVEventBatch") == 1
    finally:
        await svc.close()


async def test_a_replay_is_not_taken_for_stalled_before_its_first_delivery(
    nats_server: LocalNatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch's first look comes as the replay starts: with the first message not yet
    delivered (a loaded machine) it was taken for stalled and the replay started again, so
    every message was handled twice. A stall is judged against an earlier look only."""
    from nats.js.client import JetStreamContext

    checks: list[Any] = []
    gate = asyncio.Event()
    real_subscribe = JetStreamContext.subscribe

    async def every(self: Service, seconds: float, fn: Any) -> None:
        checks.append(fn)  # the test runs the watch's looks itself

    async def gated(self: JetStreamContext, *args: Any, **kw: Any) -> Any:
        cb = kw.pop("cb")

        async def later(msg: Any) -> None:  # deliveries wait for the gate
            await gate.wait()
            await cb(msg)

        return await real_subscribe(self, *args, **(kw | {"cb": later}))

    monkeypatch.setattr(Service, "every", every)
    monkeypatch.setattr(JetStreamContext, "subscribe", gated)
    svc = Service("prefix-index", MeshConfig(nats_server.url, instance_id="t"))
    await svc.connect()
    try:
        s = svc.subjects
        await ensure_kv_stream(svc.nc.jetstream(), s)
        await svc.nc.jetstream().publish(
            s.kv_events("ex"), KVEventBatch("ex", 1, True, [], []).encode(), headers=ROLLUP
        )
        got: list[KVEventBatch] = []

        async def on_events(batch: KVEventBatch, pending: int) -> None:
            got.append(batch)

        await svc.replay(s.kv_events_all, KVEventBatch, on_events, s.kv_events_stream)
        subscription = svc._replays[s.kv_events_all][0]
        while not checks:  # (the watch's task has not run yet)
            await asyncio.sleep(0)
        await checks[0]()  # the first look, before any delivery
        assert svc._replays[s.kv_events_all][0] is subscription  # not started again
        gate.set()
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.05)
        await checks[0]()  # delivered up to the stream's end: not stalled either
        assert svc._replays[s.kv_events_all][0] is subscription
        assert len(got) == 1 and handled(svc, "KVEventBatch") == 1
    finally:
        await svc.close()
