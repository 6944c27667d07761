"""A region that loses every executor while it serves another region's spilled requests sends
them back: each continues at home from the tokens its client has, long before its deadline.

Two regions in a NATS supercluster (two servers each), a whole mesh per region, one executor
each with two slots at a fixed ~15 ms a step (as in ``test_supercluster.py``, whose module
fixture this test cannot share: it takes eu-west's executor away for good).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.metrics import counter_total
from services.launcher.nats_cluster import ClusterPlan, Supercluster
from tests.mesh import (
    RegionMeshes,
    resumed,
    runtime_of,
    stream_greedy,
    supercluster_meshes,
    wait_for,
)

REGIONS = ("us-east", "eu-west")
STEP_S = 0.015


@dataclass
class Regions(RegionMeshes):
    supercluster: Supercluster


@pytest.fixture
def regions(tiny_llama: Path) -> Iterator[Regions]:
    plans = [ClusterPlan.free(r, 2, gateways=True) for r in REGIONS]
    with supercluster_meshes(tiny_llama, plans, STEP_S) as (supercluster, meshes):
        yield Regions(meshes, supercluster)


async def greedy(base_url: str) -> tuple[str, str | None]:
    return await stream_greedy(base_url, "hello region", 100)


async def test_guests_of_a_region_that_loses_its_executors_finish_at_home(
    regions: Regions,
) -> None:
    east, west = (regions.meshes[r] for r in REGIONS)
    west_sched = regions.scheduler("eu-west")
    await wait_for(lambda: regions.sees_peer("us-east"), 20, "eu-west's load report")
    expected = await greedy(east.base_url)

    # us-east (2 slots) gets 6 streams of 100 steps: some spill to eu-west.
    load = [asyncio.ensure_future(greedy(east.base_url)) for _ in range(6)]

    def guest_streaming() -> bool:
        return any(e.heartbeat.guests for e in west_sched.router.executors.values())

    await wait_for(guest_streaming, 10, "a guest streaming on eu-west's executor")
    await asyncio.sleep(0.3)  # a few of its tokens reach the client
    for executor in west.executor_services:  # gone without a goodbye
        runtime = runtime_of(executor)
        runtime.stopping.set()
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(runtime.nc.close(), west.loop))

    # eu-west notices after its heartbeat timeout (2 s) and returns its guests; us-east's
    # gateway continues each at home. Without the return they would wait in eu-west's queue
    # for their 120 s deadline while us-east's watchdog hears they are alive.
    results = await asyncio.wait_for(asyncio.gather(*load), 40)
    assert results == [expected] * 6
    returned = counter_total(west_sched.spill.returned_total)
    assert returned >= 1
    assert resumed(east) >= returned
    assert not west_sched.queue and not west_sched.inflight
    assert west_sched.home_load().live_executors == 0
