"""Trust on the wire: mesh-state messages are range-checked on decode, so a forged or broken
heartbeat is dropped before it reaches the router; and an executor whose KV page size is not
the mesh's (the tokenizer's) is refused work with an error, not silently routed to."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import aiohttp
import msgpack
import nats
import pytest

from common.mesh_facts import mesh_page_size, page_size_refusals
from common.wire.codec import MessageError
from common.wire.presence import Presence
from common.wire.scheduler import Heartbeat
from services.scheduler.router import Router
from services.scheduler.service import SchedulerService
from tests.mesh import MeshHarness

# --- range checks --------------------------------------------------------------------------------

GOOD_BEAT: dict[str, Any] = dict(
    executor_id="executor-0",
    running=1,
    waiting=0,
    free_pages=10,
    total_pages=16,
    page_size=16,
    max_num_seqs=8,
    pending_tokens=3,
    sent_at=1.0,
)


def forged(kind: str, **fields: Any) -> bytes:
    """A payload as any NATS client could publish it, bypassing the class's own checks."""
    payload: bytes = msgpack.packb({**fields, "t": kind, "v": 1}, use_bin_type=True)
    return payload


def test_a_sane_heartbeat_round_trips() -> None:
    beat = Heartbeat(**GOOD_BEAT, request_ids=["a", "b"])
    assert Heartbeat.decode(beat.encode()) == beat


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("page_size", 0),
        ("page_size", -16),
        ("page_size", 1 << 20),
        ("running", -1),
        ("waiting", -1),
        ("pending_tokens", -5),
        ("total_pages", 0),
        ("free_pages", -1),
        ("free_pages", 17),  # more free pages than it has
        ("max_num_seqs", 0),
        ("sent_at", math.nan),
        ("sent_at", -1.0),
        ("executor_id", ""),
        ("executor_id", "a.>"),  # would be a wildcard in executor.<id>.submit
        ("executor_id", "a b"),
        ("executor_id", "x" * 300),
        ("request_ids", [""]),
    ],
)
def test_a_heartbeat_out_of_range_is_a_message_error(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        Heartbeat(**(GOOD_BEAT | {field: value}))
    with pytest.raises(MessageError, match=field):
        Heartbeat.decode(forged("Heartbeat", **(GOOD_BEAT | {field: value})))


def test_a_hostname_with_dots_is_a_valid_executor_id() -> None:
    Heartbeat(**(GOOD_BEAT | {"executor_id": "gpu-1.example.com-3f2a1c"}))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("service", ""),
        ("service", "presence.fake"),  # one subject token
        ("service", "*"),
        ("instance_id", ""),
        ("shard", -1),
        ("page_size", 0),
        ("detok_shards", 0),
        ("sent_at", math.inf),
    ],
)
def test_a_presence_out_of_range_is_a_message_error(field: str, value: Any) -> None:
    good: dict[str, Any] = {
        "service": "tokenizer",
        "instance_id": "tok-1",
        "sent_at": 2.0,
        "page_size": 16,
    }
    with pytest.raises(MessageError, match=field):
        Presence.decode(forged("Presence", **(good | {field: value})))
    assert Presence.decode(Presence(**good).encode()) == Presence(**good)


# --- one page size for the mesh (pure) -----------------------------------------------------------


def test_the_tokenizers_page_size_wins_over_the_executors() -> None:
    assert mesh_page_size([32], {"a": 16, "b": 16}) == (32, "the tokenizer's")
    assert mesh_page_size([], {"a": 16, "b": 32, "c": 32}) == (32, "the other executors'")
    assert mesh_page_size([], {"a": 16, "b": 32}) == (16, "the other executors'")  # first seen
    assert mesh_page_size([], {}) == (None, "")
    assert page_size_refusals([16], {"a": 16}) == {}
    (reason,) = page_size_refusals([16], {"a": 16, "b": 32}).values()
    assert "b has page_size 32" in reason and "tokenizer's is 16" in reason


def beat(executor: str, page_size: int = 16, pending_tokens: int = 0) -> Heartbeat:
    return Heartbeat(executor, 0, 0, 100, 100, page_size, 8, pending_tokens)


def test_the_router_refuses_an_executor_paging_unlike_the_tokenizer(caplog) -> None:
    router = Router("least-load")
    router.observe(beat("a", 16, pending_tokens=500))  # busy: a load-only router would skip it
    with caplog.at_level(logging.ERROR, logger="meshserve.scheduler"):
        router.observe(beat("b", 32))  # idle, but pages by 32
        router.observe(beat("b", 32))
    assert router.candidates() == ["a"]
    assert list(router.refused) == ["b"]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors  # said once, loudly, not per heartbeat
    assert "executor b has page_size 32" in errors[0] and "refusing to route" in errors[0]
    # The tokenizer announces 32: now a is the odd one out, and b gets the work.
    assert router.observe_presence(Presence("tokenizer", "tok", page_size=32))
    assert router.candidates() == ["b"] and list(router.refused) == ["a"]
    assert not router.observe_presence(Presence("scheduler", "s"))  # no page size: no change


def test_a_departed_tokenizers_page_size_still_counts() -> None:
    router = Router("least-load", tokenizer_ttl_s=0.0)
    router.observe_presence(Presence("tokenizer", "tok", page_size=32))
    time.sleep(0.01)  # its announcement is past the TTL: it is no longer live
    router.observe(beat("a", 16))
    router.observe(beat("b", 32))
    assert router.candidates() == ["b"]


# --- forged heartbeats on a running mesh ---------------------------------------------------------


@pytest.fixture(scope="module")
def mesh(tiny_llama):
    harness = MeshHarness(tiny_llama).start()
    yield harness
    harness.stop()


def scheduler(mesh: MeshHarness) -> SchedulerService:
    return next(s for s in mesh.services if isinstance(s, SchedulerService))


async def forge_heartbeats(mesh: MeshHarness, payload: bytes, stop: asyncio.Event) -> None:
    """Publish ``payload`` on the heartbeat subject as fast as a real executor does."""
    assert mesh.nats is not None
    nc = await nats.connect(mesh.nats.url)
    subject = mesh.mesh_config("forger").subjects.executor_heartbeat
    try:
        while not stop.is_set():
            await nc.publish(subject, payload)
            await nc.flush()
            await asyncio.sleep(0.1)
    finally:
        await nc.close()


async def completions_while_forging(mesh: MeshHarness, payload: bytes) -> list[int]:
    stop = asyncio.Event()
    forger = asyncio.create_task(forge_heartbeats(mesh, payload, stop))
    statuses = []
    try:
        await asyncio.sleep(0.3)  # the scheduler and the gateway have heard it
        timeout = aiohttp.ClientTimeout(total=20)  # a request sent to a ghost would hang
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for i in range(6):
                body = {"model": "tiny", "prompt": f"forged {i}", "max_tokens": 2}
                async with http.post(mesh.base_url + "/completions", json=body) as resp:
                    statuses.append(resp.status)
    finally:
        stop.set()
        await forger
    return statuses


async def test_a_heartbeat_with_page_size_0_is_dropped(mesh) -> None:
    payload = forged("Heartbeat", **(GOOD_BEAT | {"executor_id": "forged", "page_size": 0}))
    assert await completions_while_forging(mesh, payload) == [200] * 6
    sched = scheduler(mesh)
    assert "forged" not in sched.router.executors
    assert sched.router.candidates() == ["executor-0"]
    gateway = mesh.services[-1]
    assert "forged" not in gateway.mesh.liveness.executors.recent()


async def test_an_executor_with_another_page_size_is_never_routed_to(mesh, caplog) -> None:
    # Valid on the wire, idle (a least-load router's favourite), but paging by 32 tokens
    # while the tokenizer hashes pages of 16: it must get nothing.
    ghost = Heartbeat(**(GOOD_BEAT | {"executor_id": "ghost", "page_size": 32, "running": 0}))
    with caplog.at_level(logging.ERROR, logger="meshserve.scheduler"):
        statuses = await completions_while_forging(mesh, ghost.encode())
    assert statuses == [200] * 6
    assert "executor ghost has page_size 32, but the tokenizer's is 16" in caplog.text
    sched = scheduler(mesh)
    assert "ghost" in sched.router.refused
    assert all(a.executor_id != "ghost" for a in sched.inflight.assignments.values())


def test_the_gateway_says_once_when_an_executor_holds_less_context_than_it_accepts(caplog):
    from common.config import MeshConfig
    from services.gateway.config import GatewayConfig
    from services.gateway.mesh_client import MeshClient

    client = MeshClient(GatewayConfig(mesh=MeshConfig(instance_id="gw"), max_model_len=8192))
    short = Heartbeat(**{**GOOD_BEAT, "max_model_len": 2048})
    roomy = Heartbeat(**{**GOOD_BEAT, "executor_id": "big", "max_model_len": 8192})
    with caplog.at_level("ERROR"):
        for beat in (short, short, roomy):
            asyncio.run(client._on_heartbeat(beat))
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "holds at most 2048 tokens" in errors[0], errors
    assert "accepts 8192" in errors[0]
