"""A bounded soak: thousands of requests with random client aborts through `meshserve up`'s
processes. At the end every KV page is free and no service's memory has grown."""

from __future__ import annotations

import asyncio
import os
import random
import time

import aiohttp
import nats

from common.messages import Heartbeat
from common.subjects import Subjects

REQUESTS = int(os.environ.get("MESHSERVE_SOAK_REQUESTS", "5000"))
WARMUP = REQUESTS // 5
CONCURRENCY = 48


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random) -> str:
    body = {
        "model": "tiny",
        "prompt": " ".join(
            rng.choice(["mesh", "cache", "page", "token", "你好"])
            for _ in range(rng.randrange(1, 40))
        ),
        "max_tokens": rng.randrange(1, 24),
        "stream": True,
        "temperature": rng.choice([0.0, 0.8]),
    }
    abort_after = rng.randrange(1, 4) if rng.random() < 0.15 else None
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return f"http_{resp.status}"
        lines = 0
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                return "ok"
            if line.startswith(b"data: "):
                lines += 1
                if abort_after is not None and lines >= abort_after:
                    return "aborted"  # leaving the context closes the connection mid-stream
    return "truncated"


async def drive(url: str, count: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    remaining = iter(range(count))

    async def worker(session: aiohttp.ClientSession) -> None:
        for _ in remaining:
            kind = await one(session, url, rng)
            outcomes[kind] = outcomes.get(kind, 0) + 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(CONCURRENCY)))
    return outcomes


async def executor_pages(nats_url: str, executors: int) -> dict[str, Heartbeat]:
    nc = await nats.connect(nats_url)
    seen: dict[str, Heartbeat] = {}

    async def on_hb(msg) -> None:
        hb = Heartbeat.decode(msg.data)
        seen[hb.executor_id] = hb

    await nc.subscribe(Subjects().executor_heartbeat, cb=on_hb)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        idle = [hb for hb in seen.values() if hb.running == 0 and hb.waiting == 0]
        if len(idle) == executors:
            break
        await asyncio.sleep(0.1)
    await nc.close()
    return seen


async def test_soak_pages_free_and_memory_flat(process_mesh):
    mesh = process_mesh(executors=2, kv_cache_tokens=2048)
    url = mesh.base_url + "/v1/completions"
    warm = await drive(url, WARMUP, seed=1)
    assert warm.get("ok", 0) > WARMUP // 2, warm
    baseline = {name: rss_kib(p.pid) for name, p in mesh.procs}
    outcomes = await drive(url, REQUESTS - WARMUP, seed=2)
    assert set(outcomes) <= {"ok", "aborted"}, outcomes  # nothing failed, nothing truncated
    assert outcomes.get("aborted", 0) > 0
    final = {name: rss_kib(p.pid) for name, p in mesh.procs}
    grown = {n: (baseline[n], final[n]) for n in final if final[n] > baseline[n] * 1.10}
    assert not grown, f"memory grew more than 10% (KiB before, after): {grown}"
    heartbeats = await executor_pages(mesh.nats_url, 2)
    assert len(heartbeats) == 2
    for hb in heartbeats.values():
        assert hb.running == 0 and hb.waiting == 0, hb
        assert hb.free_pages == hb.total_pages, hb
