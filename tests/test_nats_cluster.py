"""A NATS cluster of three servers under streaming load: kill -9 one of them.

What holds: every request completes (none errors, none hangs) with the greedy text of a run
after the kill, the mesh keeps serving on the two servers left, and the prefix index keeps the
executors' view (the KV-event stream is replicated at R3; a failed event publish is followed by
a snapshot). Core NATS is at-most-once, so messages in flight on the killed server's
connections are lost: a stream that loses a step, its start, a delta or the whole request is
resumed by the gateway as a continuation from the tokens its client has
(``services/gateway/resume.py``; docs/deploy.md, "What a server loss costs").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.launcher.nats_cluster import ClusterPlan, NatsCluster
from tests.mesh import MeshHarness, resumed, runtime_of, stream_greedy
from tests.test_prefix_index import wait_for_agreement

log = logging.getLogger(__name__)

STEP_S = 0.01


@pytest.fixture
def cluster_mesh(tiny_llama: Path) -> Iterator[tuple[NatsCluster, MeshHarness]]:
    cluster = NatsCluster.start(ClusterPlan.free("meshserve", 3))
    mesh: MeshHarness | None = None
    try:
        cluster.wait_jetstream()
        mesh = MeshHarness(
            tiny_llama, executors=2, router="kv", nats_url=cluster.url, kv_replicas=3
        ).start()
        mesh.slow_steps(STEP_S)  # streams last long enough to be cut
        yield cluster, mesh
    finally:
        if mesh is not None:
            mesh.stop()
        cluster.stop()


async def stream(base_url: str, prompt: str, max_tokens: int = 40) -> tuple[str, str | None]:
    return await stream_greedy(base_url, prompt, max_tokens)


async def test_kill_9_one_of_three_servers_under_streaming_load(cluster_mesh: Any) -> None:
    cluster, mesh = cluster_mesh
    gateway = runtime_of(mesh.services[-1])
    # The worst server to lose: the gateway's own (every stream of every client goes to it).
    assert gateway.nc.connected_url is not None
    port = gateway.nc.connected_url.port
    victim = cluster.plan.client_ports.index(port)
    prompts = [f"prompt number {i} " * 6 for i in range(12)]
    before = await asyncio.gather(*(stream(mesh.base_url, p, 8) for p in prompts[:4]))
    load = [asyncio.ensure_future(stream(mesh.base_url, p)) for p in prompts]
    await asyncio.sleep(0.3)  # streams are under way
    assert not all(t.done() for t in load)
    cluster.kill(victim)
    # Every stream completes, well within the watchdog's reach: a request lost whole is found
    # in two of its rounds (5 s apart) after the scheduler forgets it (10 s at most), then
    # resumed. No exception is allowed: gather raises the first.
    results = await asyncio.wait_for(asyncio.gather(*load), 90)
    assert all(text for text, _ in before)
    assert gateway.nc.connected_url is not None and gateway.nc.connected_url.port != port
    # The two servers left serve every request, with the same greedy text as the streams cut.
    again = await asyncio.gather(*(stream(mesh.base_url, p) for p in prompts))
    assert all(finish == "length" for _, finish in again)
    assert all(finish == "length" for _, finish in results)
    for i, (r, a) in enumerate(zip(results, again, strict=True)):
        assert r == a, f"stream {i} differs from the run after the kill"
    # The index still agrees with every executor's cache, old pages and new.
    actual = await wait_for_agreement(mesh, mesh.index)
    assert all(actual.values())
    log.info("cluster kill: %d choices resumed", resumed(mesh))
