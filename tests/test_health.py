"""Health covers every stage: each service announces its presence, the gateway tracks live
members per stage, and a required stage with no live member turns ``/health`` 503 and fails
new requests at once (503 ``stage_unavailable``) instead of letting them wait for their
deadline. Unit tests of the gateway's view, then a real mesh losing and regaining a stage."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import nats
import pytest

from common.config import MeshConfig
from common.nats_server import LocalNatsServer
from common.wire.presence import Presence
from common.wire.scheduler import Heartbeat
from services.detokenizer.service import DetokenizerConfig, DetokenizerService
from services.gateway import GatewayConfig, GatewayServer
from services.gateway.health import MeshLiveness
from services.prefix_index.service import PrefixIndexConfig, PrefixIndexService
from services.scheduler.service import SchedulerService, SchedulerServiceConfig
from services.tokenizer.service import TokenizerConfig, TokenizerService
from tests.mesh import MeshHarness, runtime_of
from tests.test_gateway_unit import FakeMesh

# --- the gateway's view of the mesh (pure) -------------------------------------------------------


def beat(executor: str = "ex0", page_size: int = 16, draining: bool = False) -> Heartbeat:
    return Heartbeat(executor, 0, 0, 100, 100, page_size, 8, 0, draining, time.time())


def whole_mesh(liveness: MeshLiveness, *, page_size: int = 16, detok_shards: int = 1) -> None:
    liveness.saw(Presence("tokenizer", "tok", page_size=page_size, detok_shards=detok_shards))
    liveness.saw(Presence("scheduler", "sched"))
    liveness.saw(Presence("detokenizer", "detok", shard=0))
    liveness.saw_heartbeat(beat())


def test_every_required_stage_without_a_member_is_named() -> None:
    liveness = MeshLiveness()
    assert list(liveness.missing()) == ["tokenizer", "scheduler", "detokenizer", "executor"]
    assert liveness.missing()["tokenizer"] == "no live tokenizer in the mesh"
    whole_mesh(liveness)
    assert liveness.missing() == {} and liveness.problem() is None


def test_a_draining_member_does_not_count() -> None:
    liveness = MeshLiveness()
    whole_mesh(liveness)
    liveness.saw(Presence("scheduler", "sched", draining=True))
    assert list(liveness.missing()) == ["scheduler"]
    liveness.saw(Presence("scheduler", "sched-2"))  # a replacement
    assert liveness.missing() == {}


async def test_a_silent_member_expires_after_the_ttl() -> None:
    liveness = MeshLiveness(presence_ttl_s=0.1)
    whole_mesh(liveness)
    await asyncio.sleep(0.15)
    liveness.saw_heartbeat(beat())
    assert list(liveness.missing()) == ["tokenizer", "scheduler", "detokenizer"]


def test_each_detokenizer_shard_needs_a_member() -> None:
    liveness = MeshLiveness()
    whole_mesh(liveness, detok_shards=3)  # shard 0 only
    assert liveness.missing() == {
        "detokenizer shard 1": "no live detokenizer for shard 1 in the mesh",
        "detokenizer shard 2": "no live detokenizer for shard 2 in the mesh",
    }
    liveness.saw(Presence("detokenizer", "d2", shard=2))
    assert list(liveness.missing()) == ["detokenizer shard 1"]
    assert liveness.report()["detokenizer"]["shards"] == {"0": ["detok"], "1": [], "2": ["d2"]}


def test_optional_stages_are_reported_and_required_only_when_configured() -> None:
    liveness = MeshLiveness()
    whole_mesh(liveness)
    report = liveness.report()
    assert report["prefix-index"] == {"required": False, "live": []}
    assert report["speculator"] == {"required": False, "live": []}
    assert liveness.missing() == {}
    strict = MeshLiveness(["tokenizer", "prefix-index"])
    strict.saw(Presence("tokenizer", "tok"))
    assert strict.missing() == {"prefix-index": "no live prefix-index in the mesh"}
    strict.saw(Presence("prefix-index", "index-0"))
    assert strict.missing() == {} and strict.report()["prefix-index"]["required"]
    with pytest.raises(ValueError, match="unknown stages"):
        MeshLiveness(["tokeniser"])


def test_executor_paging_unlike_the_tokenizer_does_not_count() -> None:
    liveness = MeshLiveness()
    whole_mesh(liveness)
    liveness.saw_heartbeat(beat("ex0", page_size=32))
    why = liveness.missing()["executor"]
    assert "no live executor" in why and "page_size 32" in why and "16" in why
    assert list(liveness.report()["executor"]["refused"]) == ["ex0"]
    liveness.saw_heartbeat(beat("ex1", page_size=16))
    assert liveness.missing() == {}


def test_draining_executors_are_named() -> None:
    liveness = MeshLiveness()
    whole_mesh(liveness)
    liveness.saw_heartbeat(beat(draining=True))
    assert "every executor is draining" in liveness.missing()["executor"]


# --- the start-up grace (a gateway on a bare bus) ------------------------------------------------


@pytest.fixture(scope="module")
def bus() -> Any:
    server = LocalNatsServer.start(jetstream=False)
    yield server
    server.stop()


async def gateway(bus: LocalNatsServer, **settings: Any) -> GatewayServer:
    config = GatewayConfig(
        mesh=MeshConfig(bus.url, f"gw-{uuid.uuid4().hex[:6]}"),
        host="127.0.0.1",
        port=0,
        served_model_name="tiny",
        max_model_len=64,
        shutdown_timeout_s=0.5,
        **settings,
    )
    server = GatewayServer(config)
    await server.start()
    return server


async def test_within_the_grace_a_request_waits_for_the_first_announcement(bus) -> None:
    server = await gateway(bus, required_stages=("tokenizer",), startup_grace_s=5.0)
    nc = await nats.connect(bus.url)
    fake = FakeMesh(nc, server.config.mesh.subjects)  # answers for every stage after it
    await fake.start()
    url = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/health") as resp:
                assert resp.status == 503
                body = await resp.json()
                assert body["status"] == "starting" and body["missing"] == ["tokenizer"]

            async def announce_soon() -> None:
                await asyncio.sleep(0.3)
                tok = Presence("tokenizer", "late-tok", sent_at=time.time())
                await nc.publish(server.config.mesh.subjects.presence("tokenizer"), tok.encode())

            announcing = asyncio.create_task(announce_soon())
            started = time.monotonic()
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
            assert 0.25 < time.monotonic() - started < 3
            await announcing
            async with http.get(url + "/health") as resp:
                assert resp.status == 200
    finally:
        await server.stop()
        await fake.stop()
        await nc.close()


async def test_after_the_grace_a_missing_stage_fails_the_request_at_once(bus) -> None:
    server = await gateway(bus, required_stages=("scheduler",), startup_grace_s=0.5)
    url = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as http:
            started = time.monotonic()
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 503
                assert resp.headers["Retry-After"] == "1"
                error = (await resp.json())["error"]
            assert 0.4 < time.monotonic() - started < 3  # the grace, then at once
            assert error["code"] == "stage_unavailable"
            assert error["type"] == "server_error"
            assert "no live scheduler in the mesh" in error["message"]
            async with http.get(url + "/health") as resp:
                assert resp.status == 503
                health = await resp.json()
            assert health["status"] == "unavailable" and health["missing"] == ["scheduler"]
    finally:
        await server.stop()


# --- a real mesh loses a stage and gets it back --------------------------------------------------


@pytest.fixture(scope="module")
def mesh(tiny_llama):
    harness = MeshHarness(tiny_llama).start()
    yield harness
    harness.stop()


def health_url(mesh: MeshHarness) -> str:
    return f"http://127.0.0.1:{mesh.port}/health"


async def wait_health(
    http: aiohttp.ClientSession,
    mesh: MeshHarness,
    accept: Callable[[int, dict[str, Any]], bool],
    timeout: float,
) -> tuple[int, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        async with http.get(health_url(mesh)) as resp:
            status, body = resp.status, await resp.json()
        if accept(status, body):
            return status, body
        assert time.monotonic() < deadline, f"/health stayed {status} {body}"
        await asyncio.sleep(0.1)


async def chat(http: aiohttp.ClientSession, mesh: MeshHarness) -> tuple[int, dict[str, Any]]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with http.post(mesh.base_url + "/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


def new_instance(mesh: MeshHarness, stage: str) -> Any:
    name = f"{stage}-{uuid.uuid4().hex[:4]}"
    model = str(mesh.model)
    if stage == "tokenizer":
        return TokenizerService(TokenizerConfig(mesh.mesh_config(name), model, mesh.page_size))
    if stage == "scheduler":
        config = SchedulerServiceConfig(mesh.mesh_config(name), mesh.router, mesh.max_queue)
        return SchedulerService(config)
    if stage == "detokenizer":
        return DetokenizerService(DetokenizerConfig(mesh.mesh_config(name), model))
    if stage == "prefix-index":
        return PrefixIndexService(PrefixIndexConfig(mesh.mesh_config(name)))
    raise AssertionError(stage)


async def crash(service: Any) -> None:
    """As ``kill -9`` looks from the bus: no goodbye, the connection just ends."""
    runtime = runtime_of(service)
    runtime.stopping.set()  # its loops (presence included) end with the connection
    await runtime.nc.close()
    await runtime.close()  # releases tasks and tracing; nothing reaches the bus any more


async def start(service: Any) -> None:
    await service.start()
    runtime_of(service).ready.set()


def replace(mesh: MeshHarness, stage: str, how: str) -> None:
    """Take the running ``stage`` out of the mesh (``crash`` or clean ``close``)."""
    old = next(s for s in mesh.services if runtime_of(s).name == stage)
    mesh.services.remove(old)
    closer = getattr(old, "stop", None) or runtime_of(old).close  # as MeshHarness.stop does
    mesh.call(crash(old) if how == "crash" else closer())


def bring_back(mesh: MeshHarness, stage: str) -> None:
    fresh = new_instance(mesh, stage)
    mesh.call(start(fresh))
    mesh.services.insert(0, fresh)  # stopped last, after the gateway


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.mark.parametrize(
    ("stage", "how"), [("tokenizer", "crash"), ("scheduler", "close"), ("detokenizer", "close")]
)
async def test_a_lost_stage_fails_fast_and_recovers(mesh, http, stage, how) -> None:
    await wait_health(http, mesh, lambda status, _: status == 200, timeout=5)
    replace(mesh, stage, how)
    # A clean close says goodbye at once; a crash is noticed when its presence times out (3 s).
    _, body = await wait_health(
        http, mesh, lambda status, b: status == 503 and stage in b.get("missing", []), timeout=8
    )
    assert f"no live {stage} in the mesh" in body["reason"]
    assert body["stages"][stage]["live"] == []

    started = time.monotonic()
    status, answer = await chat(http, mesh)
    elapsed = time.monotonic() - started
    assert status == 503, answer
    assert answer["error"]["code"] == "stage_unavailable"
    assert f"no live {stage} in the mesh" in answer["error"]["message"]
    assert elapsed < 5 < mesh.request_timeout_s  # at once, not at the request's deadline

    bring_back(mesh, stage)
    await wait_health(http, mesh, lambda status, _: status == 200, timeout=5)
    status, answer = await chat(http, mesh)
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] is not None


async def test_optional_stages_do_not_make_the_mesh_unhealthy(mesh, http) -> None:
    _, body = await wait_health(http, mesh, lambda status, _: status == 200, timeout=5)
    assert body["stages"]["prefix-index"] == {"required": False, "live": ["index-0"]}
    assert body["stages"]["speculator"] == {"required": False, "live": []}
    assert body["stages"]["executor"]["live"] == ["executor-0"]
    replace(mesh, "prefix-index", "close")
    _, body = await wait_health(
        http, mesh, lambda _, b: b["stages"]["prefix-index"]["live"] == [], timeout=5
    )
    assert body["status"] == "ok"
    status, answer = await chat(http, mesh)
    assert status == 200, answer
    bring_back(mesh, "prefix-index")
