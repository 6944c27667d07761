"""Faults on a real mesh: every request ends with its text or a clear error, none hangs.

In-process harness for bus, overload, deadline and auth faults; separate processes (as
`meshserve up` runs them) where a process must die: kill -9 of an executor, SIGTERM of the
gateway.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
from collections import Counter

import aiohttp
import pytest

from common.config import NatsAuth
from common.nats_server import LocalNatsServer, free_port_range
from services.launcher.mesh import LocalMesh
from tests.mesh import MeshHarness, metric_value

LONG = {"max_tokens": 240, "ignore_eos": True}


def pid_of(mesh: LocalMesh, name: str) -> int:
    return next(p.pid for n, p in mesh.procs if n == name)


async def stream_outcome(session, base_url, prompt, body=None, timeout=90):
    """Stream one completion: ("ok", its text), or ("error", the status or error chunk), or
    ("hung", the prompt) past ``timeout``."""
    payload = {"model": "tiny", "prompt": prompt, "stream": True, **(body or LONG)}
    text: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            async with session.post(f"{base_url}/completions", json=payload) as resp:
                if resp.status != 200:
                    return "error", f"{resp.status}: {await resp.text()}"
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        return "ok", "".join(text)
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return "error", data.decode()
                    text.extend(c["text"] for c in chunk["choices"])
                return "error", "stream ended without [DONE]"
    except TimeoutError:
        return "hung", prompt
    except (aiohttp.ClientError, ConnectionError) as exc:
        return "error", type(exc).__name__


async def until_running(mesh: LocalMesh, *executors: str, timeout: float = 30) -> None:
    """Until each executor holds streams: a tiny model's streams can end inside a second, so
    a fixed sleep before a kill may kill an idle executor. (The mesh is ready once one
    executor is: another may not serve its /metrics yet.)"""

    def running(name: str) -> float:
        try:
            return metric_value(mesh.metrics_urls[name], "meshserve:num_requests_running")
        except urllib.error.URLError:  # its metrics server is not up yet
            return 0.0

    for name in executors:
        deadline = time.monotonic() + timeout
        while running(name) == 0:
            assert time.monotonic() < deadline, f"{name} never ran a request"
            await asyncio.sleep(0.01)


async def test_kill_9_executor_mid_stream_migrates_every_request(process_mesh):
    """16 streaming clients on two executors; one is killed mid-stream. Every request moves to
    the survivor and its client receives exactly the text of an uninterrupted run."""
    mesh = process_mesh(
        executors=2, max_num_seqs=4, kv_cache_tokens=4096, metrics_port=free_port_range(8)
    )
    base = mesh.base_url + "/v1"
    body = {"max_tokens": 160, "ignore_eos": True, "temperature": 0}
    prompts = [f"request {i} says" for i in range(16)]
    async with aiohttp.ClientSession() as session:
        reference = await asyncio.gather(*(stream_outcome(session, base, p, body) for p in prompts))
        assert all(kind == "ok" for kind, _ in reference), reference
        tasks = [asyncio.create_task(stream_outcome(session, base, p, body)) for p in prompts]
        await until_running(mesh, "executor-0", "executor-1")
        os.kill(pid_of(mesh, "executor-0"), signal.SIGKILL)
        outcomes = await asyncio.gather(*tasks)
        assert [kind for kind, _ in outcomes] == ["ok"] * 16, outcomes
        for (_, want), (_, got), prompt in zip(reference, outcomes, prompts):
            assert got == want, prompt
        # the kill came while executor-0 held streams, not after they had ended
        scheduler = mesh.metrics_urls["scheduler"]
        assert metric_value(scheduler, "meshserve:scheduler_requests_migrated_total") >= 1
        # the mesh keeps serving on the surviving executor
        again = await asyncio.gather(
            *(stream_outcome(session, base, f"after {i}", {"max_tokens": 5}) for i in range(4))
        )
        assert [k for k, _ in again] == ["ok"] * 4


async def test_kill_9_without_migration_fails_streams_clearly(process_mesh, monkeypatch):
    monkeypatch.setenv("MESHSERVE_MIGRATION_LIMIT", "0")  # the scheduler process reads it
    mesh = process_mesh(
        executors=2, max_num_seqs=3, kv_cache_tokens=2048, metrics_port=free_port_range(8)
    )
    base = mesh.base_url + "/v1"
    async with aiohttp.ClientSession() as session:
        tasks = [
            asyncio.create_task(stream_outcome(session, base, f"request {i}", LONG))
            for i in range(8)
        ]
        await until_running(mesh, "executor-0")
        os.kill(pid_of(mesh, "executor-0"), signal.SIGKILL)
        outcomes = await asyncio.gather(*tasks)
        kinds = Counter(kind for kind, _ in outcomes)
        assert kinds["hung"] == 0 and kinds["ok"] >= 1, outcomes
        errors = [detail for kind, detail in outcomes if kind == "error"]
        assert errors and all("executor_failed" in e for e in errors), errors


async def test_sigterm_gateway_under_load_lets_streams_finish(process_mesh):
    mesh = process_mesh(executors=1)
    base = mesh.base_url + "/v1"
    gateway = next(p for n, p in mesh.procs if n == "gateway")
    async with aiohttp.ClientSession() as session:
        tasks = [
            asyncio.create_task(
                stream_outcome(session, base, f"r{i}", {"max_tokens": 120, "ignore_eos": True})
            )
            for i in range(6)
        ]
        await asyncio.sleep(0.3)
        gateway.send_signal(signal.SIGTERM)
        outcomes = await asyncio.gather(*tasks)
        assert [k for k, _ in outcomes] == ["ok"] * 6  # in-flight requests finish
        assert await asyncio.get_running_loop().run_in_executor(None, gateway.wait, 30) == 0
        late = await stream_outcome(session, base, "late", {"max_tokens": 2}, timeout=5)
        assert late[0] == "error"  # refused, not hung


@pytest.fixture
def harness(tiny_llama):
    meshes = []

    def start(**kwargs):
        mesh = MeshHarness(tiny_llama, **kwargs).start()
        meshes.append(mesh)
        return mesh

    yield start
    for mesh in meshes:
        mesh.stop()


async def test_nats_restart_mid_load(harness):
    mesh = harness(executors=1)
    async with aiohttp.ClientSession() as session:
        tasks = [
            asyncio.create_task(stream_outcome(session, mesh.base_url, f"r{i}", timeout=30))
            for i in range(6)
        ]
        await asyncio.sleep(0.3)
        port = mesh.nats.port
        mesh.nats.stop()
        await asyncio.sleep(1.0)
        mesh.nats = LocalNatsServer.start(port=port)
        outcomes = await asyncio.gather(*tasks)
        assert all(kind in ("ok", "error") for kind, _ in outcomes), outcomes
        # services reconnect; new requests succeed again
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            kind, _ = await stream_outcome(session, mesh.base_url, "after", {"max_tokens": 3}, 5)
            if kind == "ok":
                break
            await asyncio.sleep(0.5)
        assert kind == "ok"


async def test_overload_gets_429_with_retry_after(harness):
    mesh = harness(max_num_seqs=1, max_queue=2)
    async with aiohttp.ClientSession() as session:

        async def one(i):
            body = {"model": "tiny", "prompt": f"x{i}", "max_tokens": 120, "ignore_eos": True}
            async with session.post(f"{mesh.base_url}/completions", json=body) as resp:
                return resp.status, resp.headers.get("Retry-After"), await resp.json()

        results = await asyncio.gather(*(one(i) for i in range(12)))
    statuses = Counter(s for s, _, _ in results)
    assert statuses[429] >= 1 and statuses[200] >= 1, statuses
    for status, retry, body in results:
        if status == 429:
            assert retry == "1" and body["error"]["type"] == "rate_limit_error"


async def test_deadline_ends_request_and_frees_pages(harness):
    mesh = harness(request_timeout_s=0.4)
    executor = mesh.executor_services[0]
    step = executor.engine.step

    def slow_step() -> object:  # 250 steps outlast the deadline however fast the machine is
        time.sleep(0.02)
        return step()

    executor.engine.step = slow_step
    async with aiohttp.ClientSession() as session:
        body = {"model": "tiny", "prompt": "slow", "max_tokens": 250, "ignore_eos": True}
        async with session.post(f"{mesh.base_url}/completions", json=body) as resp:
            assert resp.status == 504
            assert (await resp.json())["error"]["type"] == "timeout_error"
    for _ in range(40):
        if not executor.engine.has_unfinished():
            break
        await asyncio.sleep(0.05)
    assert not executor.engine.has_unfinished()
    assert executor.engine.pages.num_free == executor.engine.pages.num_pages
    # Every other stage forgot it too: the executor's abort reached them.
    detok = next(s for s in mesh.services if type(s).__name__ == "DetokenizerService")
    sched = next(s for s in mesh.services if type(s).__name__ == "SchedulerService")
    for _ in range(60):
        if not detok.streams and not executor.requests and not sched.inflight.assignments:
            break
        await asyncio.sleep(0.05)
    assert detok.streams == {} and executor.requests == {}
    assert not sched.queue and not sched.inflight.assignments


async def test_nats_user_password(harness, tiny_llama, openai_clients):
    args = ("--user", "mesh", "--pass", "s3cret")
    mesh = harness(nats_args=args, auth=NatsAuth(user="mesh", password="s3cret"))
    client = openai_clients(mesh.base_url)
    out = await client.completions.create(model="tiny", prompt="auth", max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length")
    from common.config import MeshConfig
    from common.runtime import Service

    intruder = Service("intruder", MeshConfig(mesh.nats.url, auth=NatsAuth("mesh", "wrong")))
    with pytest.raises(PermissionError, match="rejected our credentials"):
        await asyncio.wait_for(intruder.connect(), 10)
