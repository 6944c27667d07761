"""A bounded soak: thousands of requests through `meshserve up`'s processes, with clients that
disconnect mid-stream, clients that leave before their request is even queued, requests that
outlive their deadline, and one executor killed (-9) halfway. At the end every KV page is
free, the detokenizer holds no stream, the scheduler holds no request, and no service's memory
has grown."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import aiohttp
import nats

from common.subjects import Subjects
from common.wire.scheduler import Heartbeat
from tests.mesh import metric_value

REQUESTS = int(os.environ.get("MESHSERVE_SOAK_REQUESTS", "5000"))
WARMUP = REQUESTS // 5
CONCURRENCY = 48


async def wait_healthy(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, f"{url} never turned healthy"
            await asyncio.sleep(0.2)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


async def one(
    session: aiohttp.ClientSession, url: str, rng: random.Random, expiring_url: str
) -> str:
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
    expiring = rng.random() < 0.03
    if expiring:  # through the gateway whose deadline no request can meet: it must expire
        url = expiring_url
        body.update(prompt="mesh", max_tokens=200, ignore_eos=True)
    abort_after = rng.randrange(1, 4) if rng.random() < 0.15 else None
    if rng.random() < 0.05:  # gone within milliseconds: before the scheduler queues it
        try:
            async with asyncio.timeout(rng.uniform(0.0005, 0.01)):
                async with session.post(url, json=body) as resp:
                    await resp.read()
        except TimeoutError:
            return "left early"
        return "ok" if resp.status == 200 else f"http_{resp.status}"
    async with session.post(url, json=body) as resp:
        if resp.status == 504:
            return "expired" if expiring else "timed out"
        if resp.status != 200:
            return f"http_{resp.status}"
        lines = 0
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                return "ok"
            if line.startswith(b'data: {"error"'):
                timed_out = b"request_timeout" in line
                return ("expired" if expiring else "timed out") if timed_out else "error"
            if line.startswith(b"data: "):
                lines += 1
                if abort_after is not None and lines >= abort_after:
                    return "aborted"  # leaving the context closes the connection mid-stream
    return "truncated"


async def drive(url: str, expiring_url: str, count: int, seed: int, halfway=None) -> dict[str, int]:
    """``count`` requests from CONCURRENCY clients; ``halfway()`` runs once half are sent."""
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    remaining = iter(range(count))

    async def worker(session: aiohttp.ClientSession) -> None:
        for i in remaining:
            if halfway is not None and i == count // 2:
                halfway()
            kind = await one(session, url, rng, expiring_url)
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


EXPIRING_DEADLINE_S = 0.05  # a second gateway's --request-timeout-s: 200 tokens never fit


async def test_soak_pages_free_and_memory_flat(process_mesh):
    from common.nats_server import free_port, free_port_range

    mesh = process_mesh(executors=2, kv_cache_tokens=2048, metrics_port=free_port_range(16))
    url = mesh.base_url + "/v1/completions"
    # Requests that outlive their deadline: the same mesh behind a gateway with a deadline no
    # request can meet (the main gateway's is the default 600 s, so none of its requests can
    # expire however slow the machine is).
    port = free_port()
    mesh.spawn(
        "gateway-expiring",
        "services.gateway",
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
        "--max-model-len", "256", "--request-timeout-s", str(EXPIRING_DEADLINE_S),
    )  # fmt: skip
    expiring_url = f"http://127.0.0.1:{port}/v1/completions"
    await wait_healthy(f"http://127.0.0.1:{port}/health")
    warm = await drive(url, expiring_url, WARMUP, seed=1)
    assert warm.get("ok", 0) > WARMUP // 2, warm
    baseline = {name: rss_kib(p.pid) for name, p in mesh.procs}
    victim = next(p for name, p in mesh.procs if name == "executor-1")
    outcomes = await drive(
        url,
        expiring_url,
        REQUESTS - WARMUP,
        seed=2,
        halfway=lambda: os.kill(victim.pid, signal.SIGKILL),
    )
    # Nothing failed, nothing truncated, nothing timed out: the dead executor's requests moved
    # to the other; the only errors are the expiring gateway's deadlines.
    assert set(outcomes) <= {"ok", "aborted", "left early", "expired"}, outcomes
    assert all(outcomes.get(k, 0) > 0 for k in ("aborted", "left early", "expired")), outcomes
    final = {name: rss_kib(p.pid) for name, p in mesh.procs if name != "executor-1"}
    grown = {n: (baseline[n], final[n]) for n in final if final[n] > baseline[n] * 1.10}
    assert not grown, f"memory grew more than 10% (KiB before, after): {grown}"
    heartbeats = await executor_pages(mesh.nats_url, 1)
    assert list(heartbeats) == ["executor-0"]
    for hb in heartbeats.values():
        assert hb.running == 0 and hb.waiting == 0, hb
        assert hb.free_pages == hb.total_pages, hb
    # The scheduler forgets a finished request at its executor's next heartbeat, or (one too
    # short to be listed in any) a heartbeat timeout after it routed it: 2 s.
    urls = mesh.metrics_urls
    tables = {
        (urls["detokenizer-0"], "meshserve:detokenizer_streams"),
        (urls["scheduler"], "meshserve:scheduler_queue_size"),
        (urls["scheduler"], "meshserve:scheduler_inflight_requests"),
    }
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        held = {name: metric_value(url, name) for url, name in tables}
        if not any(held.values()):
            break
        await asyncio.sleep(0.5)
    assert not any(held.values()), held
