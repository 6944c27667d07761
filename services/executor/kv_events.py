"""Publish an executor's prefix-cache changes to the KV-event stream, in order, off the step loop.

The step loop hands over each step's events (``add``; never blocks). One task publishes them as
``KVEventBatch`` messages to JetStream: one per step while it keeps up, coalesced when NATS is
slower than the steps. The publisher mirrors the cache it has reported (``{page: parent}``),
which lets it publish a full snapshot (``cleared`` + every page) as a rollup that replaces this
executor's older messages in the stream:

- at start (an empty cache), so the index forgets whatever a previous life of this id held;
- after a failed publish, since the index may have missed a change;
- when the deltas since the last snapshot outgrow the cache, which bounds the stream, or when
  ``snapshot_interval_s`` passed with changes, which bounds how long an index that lost a batch
  stays wrong;
- at shutdown (empty again: the cache goes away with the process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Iterator

from common.kv_stream import ROLLUP, ensure_kv_stream
from common.runtime import Service
from common.wire.prefix_index import KVEventBatch
from gpu.page_manager import KVEvent

log = logging.getLogger("meshserve.executor")

SNAPSHOT_CHUNK = 16384  # pages per message: ~330 KB, under NATS's default 1 MB payload limit


def batch_events(events: Iterable[KVEvent]) -> Iterator[tuple[list[int], list[tuple[int, int]]]]:
    """Split ordered events into (evicted, stored) groups that keep their order when applied
    as "evictions, then stores" (a store followed by an eviction starts a new group)."""
    evicted: list[int] = []
    stored: list[tuple[int, int]] = []
    for event in events:
        if event.kind == "evicted":
            if stored:
                yield evicted, stored
                evicted, stored = [], []
            evicted.append(event.page_hash)
        else:
            stored.append((event.page_hash, event.parent_hash))
    if evicted or stored:
        yield evicted, stored


class KVEventPublisher:
    def __init__(
        self,
        svc: Service,
        executor_id: str,
        snapshot_interval_s: float = 60.0,
        publish_timeout_s: float = 2.0,
        min_deltas_between_snapshots: int = 1024,
    ) -> None:
        self.svc = svc
        self.executor_id = executor_id
        self.subject = svc.subjects.kv_events(executor_id)
        self.snapshot_interval_s = snapshot_interval_s
        self.publish_timeout_s = publish_timeout_s
        self.min_deltas_between_snapshots = min_deltas_between_snapshots
        self.mirror: dict[int, int] = {}  # page hash -> parent hash, as reported
        self.pending: list[KVEvent] = []
        self.seq = 0
        self.need_snapshot = True
        self.deltas_since_snapshot = 0
        self.last_snapshot = time.monotonic()
        self.wake = asyncio.Event()
        self.idle = asyncio.Event()  # nothing pending and nothing in flight
        self.idle.set()
        self.lock = asyncio.Lock()  # one flush at a time, so batches leave in seq order

    async def start(self) -> None:
        await ensure_kv_stream(
            self.svc.nc.jetstream(),
            self.svc.subjects,
            self.svc.mesh.kv_replicas,
            self.svc.mesh.region,
        )
        await self.flush()  # the start-up snapshot: this executor holds nothing yet
        self.svc.reconnect_callbacks.append(self.snapshot_soon)
        self.svc.spawn(self.run(), "kv-events")

    async def snapshot_soon(self) -> None:
        """After a reconnect: the server may have lost the stream (a nats-server back without
        its store), and an idle executor publishes nothing that would notice. The snapshot
        recreates the stream and tells the index this executor's cache again."""
        self.need_snapshot = True
        self.idle.clear()
        self.wake.set()

    def add(self, events: list[KVEvent]) -> None:
        if events:
            self.pending.extend(events)
            self.idle.clear()
            self.wake.set()

    async def run(self) -> None:
        while not self.svc.stopping.is_set():
            # A failed publish is retried by the next snapshot, a second later at most.
            timeout = 1.0 if self.need_snapshot else self.snapshot_interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout)
            self.wake.clear()
            await self.flush()

    async def flush(self) -> None:
        async with self.lock:
            await self._flush()

    async def _flush(self) -> None:
        events, self.pending = self.pending, []
        for event in events:
            if event.kind == "evicted":
                self.mirror.pop(event.page_hash, None)
            else:
                self.mirror[event.page_hash] = event.parent_hash
        self.deltas_since_snapshot += len(events)
        if self.snapshot_due():
            await self.publish_snapshot()
        else:
            for evicted, stored in batch_events(events):
                await self.publish(KVEventBatch(self.executor_id, 0, False, evicted, stored))
        if not self.pending:
            self.idle.set()

    def snapshot_due(self) -> bool:
        if self.need_snapshot:
            return True
        if self.deltas_since_snapshot > 2 * len(self.mirror) + self.min_deltas_between_snapshots:
            return True
        stale = time.monotonic() - self.last_snapshot > self.snapshot_interval_s
        return stale and self.deltas_since_snapshot > 0

    async def publish_snapshot(self) -> None:
        if self.seq:  # not the first: the stream may be gone (a NATS restart without storage)
            with contextlib.suppress(Exception):
                await ensure_kv_stream(
                    self.svc.nc.jetstream(),
                    self.svc.subjects,
                    self.svc.mesh.kv_replicas,
                    self.svc.mesh.region,
                )
        pages = list(self.mirror.items())
        self.need_snapshot = False
        self.deltas_since_snapshot = 0
        self.last_snapshot = time.monotonic()
        first = True
        for start in range(0, max(1, len(pages)), SNAPSHOT_CHUNK):
            chunk = pages[start : start + SNAPSHOT_CHUNK]
            batch = KVEventBatch(self.executor_id, 0, first, [], chunk)
            if not await self.publish(batch, rollup=first):
                return
            first = False

    async def publish(self, batch: KVEventBatch, rollup: bool = False) -> bool:
        """Publish with the next sequence number; on failure, schedule a snapshot."""
        self.seq += 1
        numbered = KVEventBatch(
            batch.executor_id, self.seq, batch.cleared, batch.evicted, batch.stored
        )
        try:
            await self.svc.nc.jetstream().publish(
                self.subject,
                numbered.encode(),
                timeout=self.publish_timeout_s,
                headers=ROLLUP if rollup else None,
            )
        except Exception as exc:  # timeout, no stream, connection lost: all heal the same way
            if not self.need_snapshot:
                log.warning("kv events: publish failed (%s); will resend a snapshot", exc)
            self.need_snapshot = True
            return False
        return True

    async def close(self) -> None:
        """The cache goes away with this process: tell the index (best effort)."""
        async with self.lock:
            self.pending.clear()
            self.mirror.clear()
            self.need_snapshot = True
            await self.publish_snapshot()
