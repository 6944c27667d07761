"""Prefix-index handlers: mirror every executor's prefix cache from its KV events, and answer
``index.match`` with each executor's overlap for a prompt's page hashes.

The state is the KV-event stream's: a replica replays the stream from its first message (one
snapshot plus the deltas since, per executor; see ``common.kv_stream``), so a restarted
replica converges to the same view, and any number of replicas answer in the ``index`` queue
group. A replica answers while it replays (a partial view only costs routing quality);
``caught_up`` is set once it has applied everything the stream held when it started.

Each executor numbers its batches; a gap (a lost batch) is logged and heals at that
executor's next snapshot. An executor that sends neither heartbeats nor events for
``executor_timeout_s`` (it died without clearing) is forgotten, and its subject is purged from
the stream: executor ids are new with each process, so a dead one's last snapshot would
otherwise stay until the stream's byte cap, replayed by every restarted index and pushing
out the snapshots of live but idle executors, which are then the oldest messages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from common.config import MeshConfig
from common.kv_stream import ensure_kv_stream, purge_executor
from common.runtime import Service
from common.settings import parse, setting
from common.wire.prefix_index import IndexMatchReply, IndexMatchRequest, KVEventBatch
from common.wire.scheduler import Heartbeat
from services.prefix_index.radix import RadixTree

log = logging.getLogger("meshserve.prefix_index")


@dataclass(frozen=True)
class PrefixIndexConfig:
    mesh: MeshConfig
    executor_timeout_s: float = setting(
        30.0,
        "forget an executor that sent neither heartbeats nor KV events for this long",
        flag="--executor-timeout",
        env="MESHSERVE_INDEX_EXECUTOR_TIMEOUT",
    )

    def __post_init__(self) -> None:
        if self.executor_timeout_s <= 0:
            raise ValueError("executor_timeout_s must be > 0")


def parse_args(argv: list[str] | None = None) -> PrefixIndexConfig:
    return parse(PrefixIndexConfig, argv, "python -m services.prefix_index")


class PrefixIndexService:
    def __init__(self, config: PrefixIndexConfig) -> None:
        self.config = config
        self.svc = Service("prefix-index", config.mesh)
        self.tree = RadixTree()
        self.last_seq: dict[str, int] = {}
        self.last_seen: dict[str, float] = {}  # monotonic time of the last heartbeat or event
        self.caught_up = asyncio.Event()
        self.batches = 0
        self.gaps = 0

    async def ensure(self) -> None:
        """The KV-event stream exists (the index may be first, or a nats-server came back
        without its store)."""
        mesh = self.svc.mesh
        await ensure_kv_stream(
            self.svc.nc.jetstream(), mesh.subjects, mesh.kv_replicas, mesh.region
        )

    async def start(self) -> None:
        await self.svc.connect()
        s = self.svc.subjects
        js = self.svc.nc.jetstream()
        await self.ensure()
        if (await js.stream_info(s.kv_events_stream)).state.messages == 0:
            self.caught_up.set()
        await self.svc.replay(
            s.kv_events_all, KVEventBatch, self.on_events, s.kv_events_stream, ensure=self.ensure
        )
        await self.svc.serve(s.index_match, IndexMatchRequest, self.on_match, queue="index")
        await self.svc.subscribe(s.executor_heartbeat, Heartbeat, self.on_heartbeat)
        period = self.config.executor_timeout_s / 4
        self.svc.reconnect_callbacks.append(self.heard_again)
        self.svc.spawn(self.svc.every(period, self.expire_silent), "expire")

    # -- handlers -------------------------------------------------------------------------------
    async def on_events(self, batch: KVEventBatch, pending: int) -> None:
        executor = batch.executor_id
        last = self.last_seq.get(executor)
        if batch.cleared:
            self.tree.clear(executor)
        elif last is None:
            log.info("joining %s's events at batch %d: partial view until its next snapshot",
                     executor, batch.seq)  # fmt: skip
        elif batch.seq != last + 1:
            self.gaps += 1
            log.warning("missed batches %d..%d of %s: view may be off until its next snapshot",
                        last + 1, batch.seq - 1, executor)  # fmt: skip
        for page_hash in batch.evicted:
            self.tree.evict(executor, page_hash)
        refused = sum(
            not self.tree.store(executor, page_hash, parent_hash)
            for page_hash, parent_hash in batch.stored
        )
        if refused:
            log.warning("ignored %d of %s's pages in batch %d: each would be its own ancestor",
                        refused, executor, batch.seq)  # fmt: skip
        self.last_seq[executor] = batch.seq
        self.last_seen[executor] = time.monotonic()
        self.batches += 1
        if pending == 0:
            self.caught_up.set()

    async def on_match(self, req: IndexMatchRequest) -> IndexMatchReply:
        return IndexMatchReply(self.tree.match(req.page_hashes), len(self.tree.held))

    async def on_heartbeat(self, hb: Heartbeat) -> None:
        self.last_seen[hb.executor_id] = time.monotonic()

    async def expire_silent(self) -> None:
        """Forget executors silent past the timeout. Not while this index is cut off from
        NATS (their silence is its own), and each judged on its latest heartbeat: one can
        arrive while a purge is awaited."""
        if not self.svc.connected:
            return
        for executor in list(self.last_seen):
            seen = self.last_seen.get(executor)
            now = time.monotonic()
            if seen is None or now - seen <= self.config.executor_timeout_s:
                continue
            pages = self.tree.clear(executor)
            del self.last_seen[executor]
            self.last_seq.pop(executor, None)
            log.info("forgot executor %s (%d pages): silent for %.0f s",
                     executor, pages, now - seen)  # fmt: skip
            await self.purge(executor)

    async def heard_again(self) -> None:
        """Reconnected: what every executor said meanwhile was lost to us, so each gets a
        whole timeout from now to be heard again before it is forgotten."""
        now = time.monotonic()
        for executor in self.last_seen:
            self.last_seen[executor] = now

    async def purge(self, executor: str) -> None:
        """Drop a forgotten executor's messages from the stream (every replica does it; the
        second purge finds nothing). Should it be alive after all, its next snapshot (after
        a reconnect, or its interval with changes) tells a restarted index its cache again."""
        try:
            await purge_executor(self.svc.nc.jetstream(), self.svc.subjects, executor)
        except Exception as exc:  # NATS away, or no stream: the byte cap still bounds it
            log.warning("could not purge %s's KV events from the stream: %s", executor, exc)
