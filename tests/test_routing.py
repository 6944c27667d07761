"""Cache-aware routing: the router's choice (unit), and requests landing where their prefix is
cached across a real mesh, with ``usage.prompt_tokens_details.cached_tokens`` to show it."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from common.config import MeshConfig
from common.page_hash import page_hashes
from common.wire.executor import AbortRequests, TokenizedRequest
from common.wire.scheduler import Heartbeat
from common.wire.tokenizer import WireSamplingParams
from services.scheduler.router import Router
from services.scheduler.service import SchedulerService, SchedulerServiceConfig
from tests.mesh import MeshHarness

PAGE = 16


def heartbeat(executor: str, pending_tokens: int = 0, running: int = 0) -> Heartbeat:
    return Heartbeat(
        executor_id=executor,
        running=running,
        waiting=0,
        free_pages=1000,
        total_pages=1000,
        page_size=PAGE,
        max_num_seqs=64,
        pending_tokens=pending_tokens,
    )


def request(tokens: list[int], rid: str = "r") -> TokenizedRequest:
    return TokenizedRequest(
        rid, "inbox", WireSamplingParams(), tokens, page_hashes(tokens, PAGE), 0
    )


def router(policy: str = "kv", **loads: int) -> Router:
    r = Router(policy, max_imbalance=64)
    r.recent.ttl_s = 0  # only what the index reports counts, unless a test says otherwise
    for executor, pending in loads.items():
        r.observe(heartbeat(executor, pending_tokens=pending))
    return r


PROMPT = list(range(3, 3 + 40 * PAGE))  # 40 pages


def test_kv_routes_to_the_executor_holding_the_longest_prefix():
    r = router(a=0, b=0, c=0)
    req = request(PROMPT)
    assert r.pick(req, {"a": 10, "b": 30, "c": 5}) == "b"
    assert r.pick(req, {"a": 10, "c": 5}) == "a"
    # Nothing cached anywhere, equal load: the executors take turns.
    assert {r.pick(req, {}) for _ in range(3)} == {"a", "b", "c"}


def test_kv_accepts_some_extra_load_for_a_long_cached_prefix():
    r = router(a=0, b=20 * PAGE)  # b has 20 pages more queued work than a
    assert r.pick(request(PROMPT), {"b": 35}) == "b"  # but saves 35 pages of prefill


def test_kv_skips_an_overloaded_holder():
    long_prompt = list(range(3, 3 + 120 * PAGE))  # b holds all 120 pages
    r = router(a=0, b=100 * PAGE)  # 100 pages of queued work: over the 64-page guard
    assert r.pick(request(long_prompt), {"b": 120}) == "a"
    r.observe(heartbeat("b", pending_tokens=60 * PAGE))  # back under the guard
    assert r.pick(request(long_prompt), {"b": 120}) == "b"


def test_kv_remembers_where_it_just_sent_a_prefix():
    """Before the index hears of the pages being prefilled, the next request with the same
    prefix follows the first one, even onto the busier executor."""
    r = router(a=0, b=0)
    r.recent.ttl_s = 10
    first, second = request([*PROMPT, 7], "first"), request([*PROMPT, 8], "second")
    chosen = r.pick(first, {})
    assert chosen is not None
    r.assigned(chosen, first, {})
    other = "b" if chosen == "a" else "a"
    assert r.executors[chosen].load > r.executors[other].load
    assert r.overlap(chosen, second, {}) == 40 and r.overlap(other, second, {}) == 0
    assert r.pick(second, {}) == chosen
    r.recent.prune(time.monotonic() + 11)  # 10 s later it is forgotten: the load decides
    assert r.pick(second, {}) == other


async def test_a_restarted_executor_is_not_credited_with_its_old_processs_prefixes():
    """The prefixes routed lately to an executor id outlived the process under it: restarted
    with an empty cache, it drew requests for them (and the old process's migrated requests,
    which carry exactly those pages) on a cache it no longer had."""
    sched = SchedulerService(SchedulerServiceConfig(MeshConfig(instance_id="t"), router="kv"))
    r = sched.router
    r.observe(dataclasses.replace(heartbeat("a"), incarnation="one"))
    r.observe(heartbeat("b"))
    first = request([*PROMPT, 7], "first")
    r.assigned("a", first, {})
    assert r.overlap("a", request([*PROMPT, 8]), {}) == 40

    async def nothing(executor_id: str, incarnation: str = "") -> None:
        return None

    sched.executor_lost = nothing  # type: ignore[method-assign]
    await sched.on_heartbeat(dataclasses.replace(heartbeat("a"), incarnation="two"))
    await sched.settled()
    assert r.overlap("a", request([*PROMPT, 8]), {}) == 0


def test_least_load_and_round_robin_ignore_the_cache():
    ll = router("least-load", a=0, b=5 * PAGE)
    assert ll.pick(request(PROMPT), {"b": 40}) == "a"
    rr = router("round-robin", a=0, b=0)
    picks = [rr.pick(request(PROMPT), {"b": 40}) for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]


def test_no_executor_with_room_means_the_request_waits():
    r = router(a=0)
    r.observe(heartbeat("a", running=80))
    assert r.pick(request(PROMPT), {"a": 40}) is None


async def test_a_request_aborted_while_the_index_answers_is_not_dispatched(monkeypatch):
    """The scheduler awaits the prefix index between peeking at the queue head and popping it;
    an abort that lands then must drop the request, not send it to an executor to run for a
    client that has left."""
    sched = SchedulerService(SchedulerServiceConfig(MeshConfig(instance_id="t"), router="kv"))
    for executor in ("a", "b"):
        sched.router.observe(heartbeat(executor))
    asking, answer = asyncio.Event(), asyncio.Event()

    async def slow_index(req: TokenizedRequest) -> dict[str, int]:
        asking.set()
        await answer.wait()
        return {}

    published: list[str] = []

    async def publish(subject: str, message: object) -> None:
        published.append(subject)

    monkeypatch.setattr(sched, "overlaps", slow_index)
    monkeypatch.setattr(sched.svc, "publish", publish)
    submit = asyncio.create_task(sched.on_submit(request(PROMPT, "gone")))
    await asyncio.wait_for(asking.wait(), 5)
    await sched.on_abort(AbortRequests(["gone"], "client disconnected"))
    answer.set()
    await asyncio.wait_for(submit, 5)
    assert published == [] and sched.queue == [] and not sched.queued
    assert sched.dispatched == 0 and not sched.inflight.assignments


# -- across the mesh -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh(tiny_llama):
    harness = MeshHarness(tiny_llama, executors=2, kv_cache_tokens=1024, router="kv").start()
    # Route on what the index reports, not on the scheduler's memory of recent decisions.
    harness.services[2].router.recent.ttl_s = 0
    yield harness
    harness.stop()


def served_by(mesh: MeshHarness) -> list[int]:
    queries: list[int] = mesh.call(_requests_admitted(mesh))
    return queries


def cached_tokens(out: Completion | ChatCompletionChunk) -> int:
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return out.usage.prompt_tokens_details.cached_tokens or 0


async def _requests_admitted(mesh: MeshHarness) -> list[int]:  # on the mesh's loop
    return [ex.engine.pages.queries for ex in mesh.executor_services]


async def test_requests_follow_their_cached_prefix(mesh, openai_clients):
    rng = random.Random(0)
    client = openai_clients(mesh.base_url)
    system = [rng.randrange(3, 500) for _ in range(8 * PAGE + 5)]  # 8 full pages
    first = await client.completions.create(model="tiny", prompt=[*system, 9], max_tokens=2)
    assert cached_tokens(first) == 0
    holder = next(i for i, ex in enumerate(mesh.executor_services) if ex.engine.pages.queries > 0)
    deadline = time.monotonic() + 5
    while not mesh.index.tree.match(page_hashes(system, PAGE)):  # the index hears of it
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    before = served_by(mesh)
    for i in range(6):  # one at a time: no load to pull them elsewhere
        prompt = system + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))]
        out = await client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        assert cached_tokens(out) == 8 * PAGE, i
        # Until the executor's next heartbeat the scheduler counts what it sent there as
        # still queued; a run of instant requests would add up to a load worth spilling.
        await asyncio.sleep(0.3)
    after = served_by(mesh)
    assert after[holder] > before[holder]
    assert after[1 - holder] == before[1 - holder], "a request went to the other executor"
    # Streaming usage carries it too.
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert cached_tokens(chunks[-1]) == 0  # reported, and nothing of this prompt was cached


async def test_prefix_hit_metrics_match_usage(mesh, openai_clients):
    """Per-executor prefix_cache hits/queries count each request once, as usage reports it."""
    client = openai_clients(mesh.base_url)
    before = mesh.call(_hits_and_queries(mesh))
    prompt = list(range(100, 100 + 3 * PAGE + 3))
    outs = [
        await client.completions.create(model="tiny", prompt=[*prompt, i + 3], max_tokens=1)
        for i in range(3)
    ]
    after = mesh.call(_hits_and_queries(mesh))
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    assert queries == sum(o.usage.prompt_tokens for o in outs if o.usage)
    assert hits == sum(cached_tokens(o) for o in outs) == 2 * 3 * PAGE


async def _hits_and_queries(mesh: MeshHarness) -> list[tuple[int, int]]:
    return [(ex.engine.pages.hits, ex.engine.pages.queries) for ex in mesh.executor_services]


async def test_routing_falls_back_to_load_when_the_index_is_gone(mesh, openai_clients):
    mesh.call(mesh.index.svc.close())
    client = openai_clients(mesh.base_url)
    start = time.monotonic()
    outs = await asyncio.gather(
        *(client.completions.create(model="tiny", prompt=f"no index {i}", max_tokens=2)
          for i in range(6))
    )  # fmt: skip
    assert all(o.choices[0].finish_reason in ("stop", "length") for o in outs)
    assert time.monotonic() - start < 10
