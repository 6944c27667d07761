"""Two regions in a NATS supercluster (two servers each, JetStream clustered), a whole mesh per
region, the gateway link between them through TCP proxies the test can cut.

Executors are slowed to a fixed step time so each region's capacity is known whatever the
machine's load: two sequences per executor at ~15 ms a step.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.launcher.nats_cluster import ClusterPlan, Supercluster
from tests.mesh import (
    RegionMeshes,
    openai_client,
    resumed,
    runtime_of,
    stream_greedy,
    supercluster_meshes,
    wait_for,
)
from tools.net.tcp_proxy import DelayProxy

REGIONS = ("us-east", "eu-west")
STEP_S = 0.015


@dataclass
class Regions(RegionMeshes):
    proxies: list[DelayProxy]
    supercluster: Supercluster


@pytest.fixture(scope="module")
def regions(tiny_llama: Path) -> Iterator[Regions]:
    plans = [ClusterPlan.free(r, 2, gateways=True) for r in REGIONS]
    proxies = {p.name: [DelayProxy(port).start() for port in p.gateway_ports] for p in plans}
    dial = {r: [proxy.address for proxy in ps] for r, ps in proxies.items()}
    try:
        with supercluster_meshes(tiny_llama, plans, STEP_S, dial) as (supercluster, meshes):
            yield Regions(meshes, [p for ps in proxies.values() for p in ps], supercluster)
    finally:
        for ps in proxies.values():
            for proxy in ps:
                proxy.stop()


async def one(base_url: str, max_tokens: int = 12) -> tuple[float, str]:
    """(TTFT in seconds, text) of one streamed completion."""
    async with openai_client(base_url) as client:
        started = time.perf_counter()
        ttft, text = 0.0, ""
        stream = await client.completions.create(
            model="tiny", prompt="hello region", max_tokens=max_tokens, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            if not ttft:
                ttft = time.perf_counter() - started
            text += chunk.choices[0].text
        return ttft, text


async def closed_loop(base_url: str, clients: int, each: int) -> list[float]:
    """``clients`` clients, each sending ``each`` requests back to back: every TTFT."""

    async def client() -> list[float]:
        return [(await one(base_url))[0] for _ in range(each)]

    results = await asyncio.gather(*(client() for _ in range(clients)))
    return [t for r in results for t in r]


def goodput(ttfts: list[float], slo_s: float) -> int:
    return sum(t <= slo_s for t in ttfts)


async def test_overload_spills_and_a_cut_link_keeps_each_region_serving(regions: Regions) -> None:
    east, west = (regions.meshes[r] for r in REGIONS)
    await wait_for(lambda: regions.sees_peer("us-east"), 10, "eu-west's load report")
    for mesh in (east, west):  # warm-up: both regions serve
        await one(mesh.base_url)

    # Overload us-east (8 clients, capacity 2 sequences): requests spill to eu-west.
    spilled_before = regions.spilled("us-east")
    with_spill = await closed_loop(east.base_url, clients=8, each=3)
    spilled = regions.spilled("us-east") - spilled_before
    assert spilled >= 3, f"only {spilled} requests spilled"
    assert regions.spilled_in("eu-west") >= spilled

    # Cut the gateway link for real: us-east stops counting on eu-west's reports.
    for proxy in regions.proxies:
        proxy.cut()
    await wait_for(lambda: not regions.sees_peer("us-east"), 10, "the cut to be noticed")
    for mesh in (east, west):  # each region keeps serving its own clients
        ttft, text = await one(mesh.base_url)
        assert text and ttft > 0
    spilled_before = regions.spilled("us-east")
    local_only = await closed_loop(east.base_url, clients=8, each=3)
    assert regions.spilled("us-east") == spilled_before  # nothing could spill

    slo = statistics.median(local_only)
    assert goodput(with_spill, slo) > goodput(local_only, slo), (with_spill, local_only)
    assert statistics.mean(with_spill) < statistics.mean(local_only)

    for proxy in regions.proxies:
        proxy.heal()
    await wait_for(lambda: regions.sees_peer("us-east"), 20, "the link to heal")


async def greedy(base_url: str, max_tokens: int) -> tuple[str, str | None]:
    return await stream_greedy(base_url, "hello region", max_tokens)


async def test_streams_spilled_when_the_link_is_cut_are_resumed_at_home(regions: Regions) -> None:
    # (Before the test that takes us-east's executors away: this one needs them.)
    # The region serving them is out of reach: the watchdog finds them lost (that region does
    # not answer for them) and the gateway resumes each from the tokens its client has, at
    # home (a continuation that streamed tokens never spills). Same prompt, greedy: one text.
    east = regions.meshes["us-east"]
    await wait_for(lambda: regions.sees_peer("us-east"), 20, "eu-west's load report")
    expected = await greedy(east.base_url, 100)
    spilled_before = regions.spilled("us-east")
    load = [asyncio.ensure_future(greedy(east.base_url, 100)) for _ in range(8)]
    await wait_for(lambda: regions.spilled("us-east") > spilled_before, 10, "a spill")
    await asyncio.sleep(0.3)  # the spilled streams are under way
    assert not all(t.done() for t in load)
    for proxy in regions.proxies:
        proxy.cut()
    try:
        results = await asyncio.wait_for(asyncio.gather(*load), 90)
        assert results == [expected] * 8
        assert resumed(east) >= 1
    finally:
        for proxy in regions.proxies:
            proxy.heal()
    await wait_for(lambda: regions.sees_peer("us-east"), 20, "the link to heal")


async def test_a_guest_yields_its_slot_to_the_regions_own_client(regions: Regions) -> None:
    # eu-west's executor (2 slots, 1 kept free for its own clients) runs a long guest; two of
    # its own clients arrive together: the second finds no slot, and the guest is preempted
    # for it instead of making it wait out the guest's stream (~0.9 s). The guest is
    # recomputed and its client's text is the uninterrupted one.
    east, west = (regions.meshes[r] for r in REGIONS)
    west_sched = regions.scheduler("eu-west")
    await wait_for(lambda: regions.sees_peer("us-east"), 20, "eu-west's load report")
    expected, _ = await greedy(east.base_url, 60)
    spilled_in = regions.spilled_in("eu-west")
    overload = [asyncio.create_task(greedy(east.base_url, 60)) for _ in range(6)]

    def guest_running() -> bool:
        return any(e.heartbeat.guests for e in west_sched.router.executors.values())

    await wait_for(guest_running, 10, "a guest on eu-west's executor")
    ttfts = [ttft for ttft, _ in await asyncio.gather(*(one(west.base_url, 30) for _ in range(2)))]
    results = await asyncio.gather(*overload)
    assert regions.spilled_in("eu-west") > spilled_in
    assert max(ttfts) < 0.4, ttfts  # a step or two (15 ms each), not the guest's 0.9 s
    assert sum(e.engine_state().guests_yielded for e in west.executor_services) >= 1
    assert all(r == (expected, "length") for r in results), results


async def test_a_region_without_executors_is_served_by_the_other(regions: Regions) -> None:
    east = regions.meshes["us-east"]
    await wait_for(lambda: regions.sees_peer("us-east"), 20, "eu-west's load report")
    for executor in east.executor_services:  # gone without a goodbye
        runtime = runtime_of(executor)
        runtime.stopping.set()
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(runtime.nc.close(), east.loop))
    east_sched = regions.scheduler("us-east")
    await wait_for(lambda: east_sched.home_load().live_executors == 0, 10, "executor loss")
    received = regions.spilled_in("eu-west")
    results = await asyncio.gather(*(one(east.base_url) for _ in range(4)))
    assert all(text for _, text in results)
    assert regions.spilled_in("eu-west") - received == 4
