"""The KV-event stream's life on a real nats-server: whose stream a name is, and what the index
removes from it when an executor dies without clearing."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import nats
import pytest
from nats.js.errors import NotFoundError

from common.config import MeshConfig
from common.kv_stream import (
    MAX_BYTES,
    ROLLUP,
    StreamNameTaken,
    ensure_kv_stream,
    kv_stream_config,
    purge_executor,
)
from common.nats_server import LocalNatsServer
from common.subjects import Subjects
from common.wire.prefix_index import KVEventBatch
from common.wire.scheduler import Heartbeat
from services.prefix_index.service import PrefixIndexConfig, PrefixIndexService


async def test_a_stream_of_another_mesh_is_refused_not_moved(nats_server: LocalNatsServer) -> None:
    """``mesh.v1.us-east`` and ``mesh.v1.us_east`` fold to one stream name. The second mesh
    used to "update" the first's stream onto its own subjects, so the first mesh's executors
    published into no stream and its index replayed nothing."""
    east, other = Subjects("mesh.v1.us-east"), Subjects("mesh.v1.us_east")
    assert east.kv_events_stream == other.kv_events_stream
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await ensure_kv_stream(js, east)
        with pytest.raises(StreamNameTaken) as refused:
            await ensure_kv_stream(js, other)
        text = str(refused.value)
        assert east.kv_events_all in text and "'mesh.v1.us_east'" in text
        assert "--subject-prefix or --region" in text
        info = await js.stream_info(east.kv_events_stream)
        assert info.config.subjects == [east.kv_events_all]
        await js.publish(east.kv_events("ex-1"), b"still ours", timeout=2)

        # The same mesh's stream under an older config is still brought up to date.
        await js.delete_stream(east.kv_events_stream)
        older = dataclasses.replace(kv_stream_config(east), max_bytes=1 << 20)
        await js.add_stream(older)
        await ensure_kv_stream(js, east)
        assert (await js.stream_info(east.kv_events_stream)).config.max_bytes == MAX_BYTES
    finally:
        await nc.close()


def snapshot(executor: str, pages: list[tuple[int, int]]) -> bytes:
    return KVEventBatch(executor, 1, True, [], pages).encode()


def heartbeat(executor: str) -> bytes:
    return Heartbeat(executor, 0, 0, 10, 10, 16, 4, 0, sent_at=time.time()).encode()


async def test_a_forgotten_executor_is_purged_from_the_stream(
    nats_server: LocalNatsServer,
) -> None:
    """Executor ids are new with each process: a dead executor's snapshot stayed in the stream
    until the 1 GiB cap, replayed by every index restart (which forgot it again 30 s later),
    and once the cap was reached it pushed out the oldest messages: the snapshots of live
    executors that had been idle longest."""
    s = Subjects()
    mesh = MeshConfig(nats_server.url, instance_id="index-0")
    index = PrefixIndexService(PrefixIndexConfig(mesh, executor_timeout_s=0.6))
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    fresh: PrefixIndexService | None = None
    try:
        await index.start()
        await js.publish(s.kv_events("ex-dead"), snapshot("ex-dead", [(11, 0)]), headers=ROLLUP)
        await js.publish(s.kv_events("ex-live"), snapshot("ex-live", [(22, 0)]), headers=ROLLUP)
        deadline = time.monotonic() + 10
        while index.tree.pages_of("ex-dead") == set():
            assert time.monotonic() < deadline, "the index never saw ex-dead's snapshot"
            await asyncio.sleep(0.05)
        while True:  # ex-live keeps beating; ex-dead is silent
            await nc.publish(s.executor_heartbeat, heartbeat("ex-live"))
            await asyncio.sleep(0.1)
            if "ex-dead" not in index.last_seen:
                break
            assert time.monotonic() < deadline, "the index never forgot ex-dead"
        for _ in range(3):  # the purge follows the forgetting in the same pass
            await nc.publish(s.executor_heartbeat, heartbeat("ex-live"))
            await asyncio.sleep(0.1)
        with pytest.raises(NotFoundError):
            await js.get_last_msg(s.kv_events_stream, s.kv_events("ex-dead"))
        kept = await js.get_last_msg(s.kv_events_stream, s.kv_events("ex-live"))
        assert kept.data is not None
        assert KVEventBatch.decode(kept.data).stored == [(22, 0)]
        assert index.tree.pages_of("ex-live") == {22}

        # A restarted index replays the live executor only.
        fresh = PrefixIndexService(
            PrefixIndexConfig(dataclasses.replace(mesh, instance_id="index-1"))
        )
        await fresh.start()
        await asyncio.wait_for(fresh.caught_up.wait(), 10)
        assert fresh.tree.pages_of("ex-live") == {22}
        assert fresh.tree.pages_of("ex-dead") == set()
        assert set(fresh.last_seq) == {"ex-live"}
    finally:
        await nc.close()
        for service in (index, fresh):
            if service is not None:
                await service.svc.close()


async def test_a_replay_whose_last_message_was_purged_is_not_taken_for_stalled(
    nats_server: LocalNatsServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A purge leaves the stream's last_seq where it was: an index started after the last
    message was purged saw last_seq past what it was delivered, forever, and replayed the
    whole stream again at every check (every 2 s) until some executor published."""
    monkeypatch.setattr("common.runtime.REPLAY_CHECK_S", 0.1)
    s = Subjects()
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await ensure_kv_stream(js, s)
    await js.publish(s.kv_events("ex-live"), snapshot("ex-live", [(22, 0)]), headers=ROLLUP)
    await js.publish(s.kv_events("ex-gone"), snapshot("ex-gone", []), headers=ROLLUP)
    await purge_executor(js, s, "ex-gone")
    mesh = MeshConfig(nats_server.url, instance_id="index-0")
    index = PrefixIndexService(PrefixIndexConfig(mesh))
    try:
        await index.start()
        await asyncio.wait_for(index.caught_up.wait(), 10)
        await asyncio.sleep(0.2)
        caplog.clear()  # (a check before the first delivery may take it for stalled)
        await asyncio.sleep(1.0)  # ten checks
        assert not [r for r in caplog.records if "stalled" in r.getMessage()]
        assert index.tree.pages_of("ex-live") == {22}
        # A message that does come after it is still waited for: one published now arrives.
        await js.publish(s.kv_events("ex-live"), snapshot("ex-live", [(33, 0)]), headers=ROLLUP)
        deadline = time.monotonic() + 5
        while index.tree.pages_of("ex-live") != {33}:
            assert time.monotonic() < deadline, "the new snapshot never arrived"
            await asyncio.sleep(0.05)
    finally:
        await nc.close()
        await index.svc.close()
