"""The prefix-cache index: its radix tree, its view against the executors' real caches over
NATS/JetStream, and its rebuild from the stream after a restart."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import openai
import pytest

from common.config import MeshConfig
from common.nats_server import LocalNatsServer
from common.page_hash import ROOT_HASH, page_hashes
from common.wire.prefix_index import KVEventBatch
from gpu.engine import Engine, EngineConfig
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from services.executor.kv_events import batch_events
from services.prefix_index.radix import RadixTree
from services.prefix_index.service import PrefixIndexConfig, PrefixIndexService
from tests.mesh import MeshHarness, openai_client

PAGE = 16


def contiguous_overlap(cached: set[int], hashes: list[int]) -> int:
    """What an executor's own prefix cache would reuse: leading pages without a gap."""
    n = 0
    while n < len(hashes) and hashes[n] in cached:
        n += 1
    return n


def random_prompts(rng: random.Random, count: int, prefixes: list[list[int]]) -> list[list[int]]:
    prompts = []
    for _ in range(count):
        head = rng.choice(prefixes)
        cut = rng.randrange(len(head) // 2, len(head) + 1)  # share part or all of a prefix
        prompts.append(head[:cut] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))])
    return prompts


# -- the radix tree alone ------------------------------------------------------------------------


def test_radix_tree_matches_a_brute_force_model_under_random_operations():
    rng = random.Random(0)
    chains = [page_hashes([rng.randrange(500) for _ in range(8 * 4)], 4) for _ in range(6)]
    # Chains share prefixes: chain i continues chain i // 2's first pages.
    for i in range(1, len(chains)):
        base = chains[i // 2][: rng.randrange(1, 5)]
        tail = page_hashes([rng.randrange(500) for _ in range(4 * 4)], 4, parent=base[-1])
        chains[i] = base + tail
    parent_of = {h: (c[i - 1] if i else ROOT_HASH) for c in chains for i, h in enumerate(c)}
    tree = RadixTree()
    model: dict[str, set[int]] = {e: set() for e in "abc"}
    for _ in range(3000):
        executor, op = rng.choice("abc"), rng.random()
        if op < 0.55:
            h = rng.choice(list(parent_of))
            tree.store(executor, h, parent_of[h])
            model[executor].add(h)
        elif op < 0.97 and model[executor]:
            h = rng.choice(sorted(model[executor]))
            assert tree.evict(executor, h)
            model[executor].discard(h)
        else:
            tree.clear(executor)
            model[executor].clear()
        tree.check()
        assert tree.view() == {e: s for e, s in model.items() if s}
        chain = rng.choice(chains)
        expected = {e: contiguous_overlap(s, chain) for e, s in model.items()}
        assert tree.match(chain) == {e: n for e, n in expected.items() if n}
    for executor in "abc":
        tree.clear(executor)
    assert tree.num_nodes == 0  # nothing held, nothing left over


def test_a_page_stored_before_its_parent_is_found_once_the_parent_is():
    a, b = page_hashes(list(range(8)), 4)
    tree = RadixTree()
    tree.store("x", b, a)  # the parent page is not known yet
    assert tree.match([a, b]) == {}
    tree.store("y", a, ROOT_HASH)
    assert tree.match([a, b]) == {"y": 1}
    tree.store("x", a, ROOT_HASH)
    assert tree.match([a, b]) == {"x": 2, "y": 1}
    tree.check()


def test_a_page_that_would_be_its_own_ancestor_is_refused():
    """Chained hashes never form a cycle, but a corrupt or forged batch can name one: its
    nodes were cut off from the root and never pruned, whatever was evicted."""
    a, b, c = page_hashes(list(range(12)), 4)
    tree = RadixTree()
    assert not tree.store("x", a, a)  # its own parent
    assert not tree.store("x", ROOT_HASH, a)
    assert tree.num_nodes == 0 and tree.held == {}
    assert tree.store("x", c, b) and tree.store("x", b, a)  # a, b: placeholders
    assert not tree.store("x", a, c)  # a -> b -> c -> a
    assert not tree.store("x", a, b)
    assert tree.pages_of("x") == {b, c}
    tree.check()
    assert tree.store("x", a, ROOT_HASH)
    assert tree.match([a, b, c]) == {"x": 3}
    for page in (a, b, c):
        tree.evict("x", page)
    assert tree.num_nodes == 0
    tree.check()


# -- the index against real engines (no NATS) ------------------------------------------------------


async def test_an_executor_heard_while_the_expiry_pass_purges_another_is_kept():
    """The expiry pass judged every executor on the time it started: one that beat and sent a
    fresh snapshot while the pass purged another was wiped too. Nor does an index cut off
    from NATS forget anyone (the silence is its own); reconnected, each gets a new timeout."""
    from types import SimpleNamespace

    from common.wire.scheduler import Heartbeat

    index = PrefixIndexService(PrefixIndexConfig(MeshConfig(instance_id="idx")))
    link = SimpleNamespace(is_connected=True)
    index.svc._nc = link  # type: ignore[assignment]
    for executor, page in (("ex-a", 7), ("ex-b", 8)):
        await index.on_events(KVEventBatch(executor, 1, True, [], [(page, ROOT_HASH)]), 0)
        index.last_seen[executor] -= index.config.executor_timeout_s + 1
    purged: list[str] = []

    async def purge(executor: str) -> None:
        purged.append(executor)
        if executor == "ex-a":  # meanwhile ex-b beats again, with a fresh snapshot
            await index.on_heartbeat(Heartbeat("ex-b", 0, 0, 10, 10, 16, 8, 0))
            await index.on_events(KVEventBatch("ex-b", 2, True, [], [(8, ROOT_HASH)]), 0)

    index.purge = purge  # type: ignore[method-assign]
    link.is_connected = False
    await index.expire_silent()
    assert purged == [] and index.tree.pages_of("ex-a") == {7}
    link.is_connected = True
    await index.heard_again()  # reconnected: a whole timeout for each to be heard
    await index.expire_silent()
    assert purged == []
    index.last_seen["ex-a"] -= index.config.executor_timeout_s + 1
    index.last_seen["ex-b"] -= index.config.executor_timeout_s + 1
    await index.expire_silent()
    assert purged == ["ex-a"] and index.tree.pages_of("ex-b") == {8}
    assert index.tree.match([8]) == {"ex-b": 1}


async def test_index_view_equals_engine_caches_step_by_step(tiny_llama):
    """Two engines under random load with evictions; after every step the index, fed the
    batches an executor would publish, holds exactly each engine's cache."""
    rng = random.Random(1)
    model = load_model(tiny_llama, progress=False)
    engines = {
        f"ex{i}": Engine(ModelRunner(model, num_pages=24, page_size=PAGE), EngineConfig(128, 8))
        for i in range(2)
    }
    index = PrefixIndexService(PrefixIndexConfig(MeshConfig(instance_id="t")))
    seq = dict.fromkeys(engines, 0)
    for executor in engines:  # what an executor publishes when it starts
        seq[executor] += 1
        await index.on_events(KVEventBatch(executor, seq[executor], cleared=True), 0)
    prefixes = [[rng.randrange(3, 500) for _ in range(80)] for _ in range(5)]
    stored = evicted = 0
    for n, prompt in enumerate(random_prompts(rng, 60, prefixes)):
        engine = engines[rng.choice(list(engines))]
        engine.add_request(f"r{n}", prompt, SamplingParams(max_tokens=rng.randrange(1, 6)))
        for _ in range(rng.randrange(0, 4)):
            for executor, eng in engines.items():
                eng.step()
                events = eng.drain_kv_events()
                stored += sum(e.kind == "stored" for e in events)
                evicted += sum(e.kind == "evicted" for e in events)
                for ev, st in batch_events(events):
                    seq[executor] += 1
                    await index.on_events(KVEventBatch(executor, seq[executor], False, ev, st), 0)
                assert index.tree.pages_of(executor) == set(eng.pages.hash_to_page)
        hashes = page_hashes(prompt, PAGE)
        overlaps = (await index.on_match(_match(hashes))).overlaps
        for executor, eng in engines.items():
            expected = contiguous_overlap(set(eng.pages.hash_to_page), hashes)
            assert overlaps.get(executor, 0) == expected
    assert stored > 48 and evicted > 0, (stored, evicted)  # the pools really turned over
    assert index.gaps == 0
    index.tree.check()


def _match(hashes: list[int]):  # the scheduler's question
    from common.wire.prefix_index import IndexMatchRequest

    return IndexMatchRequest(hashes)


# -- over NATS: executors publish, the index replays -----------------------------------------------


@pytest.fixture(scope="module")
def mesh(tiny_llama):
    # 32 pages per executor and prompts of up to ~7 pages: caches turn over all the time.
    harness = MeshHarness(tiny_llama, executors=2, kv_cache_tokens=512, router="kv").start()
    yield harness
    harness.stop()


async def _views(mesh: MeshHarness, index: PrefixIndexService):
    """(each executor's real cache, the index's view of it), read together on the mesh loop."""

    async def read():
        busy = any(
            ex.engine.has_unfinished() or ex.pending_adds or not ex.kv_events.idle.is_set()
            for ex in mesh.executor_services
        )
        actual = {
            ex.config.executor_id: set(ex.engine.pages.hash_to_page)
            for ex in mesh.executor_services
        }
        seen = {e: index.tree.pages_of(e) for e in actual}
        return busy, actual, seen

    return mesh.call(read())


async def wait_for_agreement(mesh: MeshHarness, index: PrefixIndexService, timeout: float = 15):
    deadline = time.monotonic() + timeout
    while True:
        busy, actual, seen = await _views(mesh, index)
        if not busy and actual == seen:
            return actual
        if time.monotonic() > deadline:
            missing = {e: len(actual[e] - seen[e]) for e in actual}
            extra = {e: len(seen[e] - actual[e]) for e in actual}
            pytest.fail(f"index disagrees: busy={busy} missing={missing} extra={extra}")
        await asyncio.sleep(0.05)


async def run_random_traffic(mesh: MeshHarness, seed: int, count: int) -> int:
    """Random prompts sharing prefixes, some clients hanging up mid-stream; returns how many
    distinct full pages the prompts hold (far more than the executors can keep)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randrange(40, 110))] for _ in range(16)]
    prompts = random_prompts(rng, count, prefixes)
    client = openai_client(mesh.base_url)

    async def complete(prompt: list[int]) -> None:
        await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=rng.randrange(1, 12),
            extra_body={"ignore_eos": True},
        )

    async def hang_up(prompt: list[int]) -> None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 60, "stream": True}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            resp = await session.post(mesh.base_url + "/completions", json=body)
            await resp.content.readline()
            resp.close()

    async with client:
        for start in range(0, len(prompts), 8):
            batch = prompts[start : start + 8]
            await asyncio.gather(
                *(hang_up(p) if rng.random() < 0.15 else complete(p) for p in batch)
            )
    return len({h for p in prompts for h in page_hashes(p, PAGE)})


async def test_index_view_equals_the_union_of_executor_caches(mesh):
    pages = await run_random_traffic(mesh, seed=2, count=64)
    assert pages > 2 * (2 * 32)  # twice what both caches hold: evictions happened
    actual = await wait_for_agreement(mesh, mesh.index)
    assert all(actual.values()), "both executors should hold something"
    mesh.index.tree.check()
    assert mesh.index.gaps == 0


async def test_index_rebuilds_from_the_stream_after_a_restart(mesh):
    old = mesh.index
    await run_random_traffic(mesh, seed=3, count=24)
    actual = await wait_for_agreement(mesh, old)

    async def start_replicas(ids: tuple[int, ...]) -> list[PrefixIndexService]:
        replicas = [
            PrefixIndexService(PrefixIndexConfig(mesh.mesh_config(f"index-{i}"))) for i in ids
        ]
        for r in replicas:
            await r.start()
        await asyncio.wait_for(asyncio.gather(*(r.caught_up.wait() for r in replicas)), 10)
        return replicas

    mesh.call(old.svc.close())
    replicas: list[PrefixIndexService] = []
    try:
        await run_random_traffic(mesh, seed=4, count=24)  # changes the index never saw live
        # Snapshots roll up often here, so the replay starts from one.
        for ex in mesh.executor_services:
            ex.kv_events.min_deltas_between_snapshots = 16
        await run_random_traffic(mesh, seed=5, count=24)
        replicas = mesh.call(start_replicas((1, 2)))
        mesh.index = replicas[0]
        actual = await wait_for_agreement(mesh, replicas[0])
        await wait_for_agreement(mesh, replicas[1])
        assert replicas[0].tree.view() == replicas[1].tree.view()
        assert all(actual.values())
        async with openai_client(mesh.base_url) as client:
            out = await client.completions.create(
                model="tiny", prompt="still routing", max_tokens=2
            )
        assert out.choices[0].finish_reason in ("stop", "length")
        # The stream stays small: one snapshot plus recent deltas per executor.
        js = mesh.executor_services[0].svc.nc.jetstream()
        info = mesh.call(js.stream_info(mesh.executor_services[0].svc.subjects.kv_events_stream))
        assert info.state.messages < 200, info.state
    finally:
        for r in replicas[1:]:
            mesh.call(r.svc.close())
        if mesh.index is old:  # failed before the replicas took over: the next test needs one
            mesh.index = mesh.call(start_replicas((3,)))[0]


async def test_executor_leaving_clears_its_pages(mesh):
    await run_random_traffic(mesh, seed=6, count=8)
    await wait_for_agreement(mesh, mesh.index)
    ex = mesh.executor_services[1]
    assert mesh.index.tree.pages_of(ex.config.executor_id)
    mesh.call(ex.kv_events.close())  # what ExecutorService.stop() sends first
    deadline = time.monotonic() + 5
    while mesh.index.tree.pages_of(ex.config.executor_id):
        assert time.monotonic() < deadline, "the index kept a departed executor's pages"
        await asyncio.sleep(0.05)


async def test_the_index_follows_a_nats_server_back_without_its_store(tiny_llama):
    """A nats-server restarted without its store (``meshserve up``'s, a pod's empty volume)
    has lost the KV-event stream: the index creates it again and replays it, and every
    executor, idle or not, snapshots its cache into it after its reconnect, so the index
    agrees with the caches again. It had failed to resubscribe and kept its old view, deaf to
    the new stream until its sequence numbers passed the old one's."""
    harness = MeshHarness(tiny_llama, executors=2, kv_cache_tokens=512, router="kv").start()
    index = harness.index
    assert index is not None
    try:
        await run_random_traffic(harness, seed=7, count=12)
        await wait_for_agreement(harness, index)
        assert harness.nats is not None
        port = harness.nats.port
        harness.nats.stop()  # (its store folder goes with it)
        await asyncio.sleep(1.0)
        harness.nats = LocalNatsServer.start(
            port=port, extra_args=harness.nats_args, config=harness.nats_config
        )
        async with openai_client(harness.base_url) as client:
            deadline = time.monotonic() + 20
            while True:  # the services reconnect
                try:
                    await client.completions.create(model="tiny", prompt="back", max_tokens=2)
                    break
                except openai.APIError:
                    assert time.monotonic() < deadline, "the mesh did not come back"
                    await asyncio.sleep(0.5)
        await run_random_traffic(harness, seed=8, count=12)
        await wait_for_agreement(harness, index, timeout=30)
        ids = [ex.config.executor_id for ex in harness.executor_services]
        assert all(index.tree.pages_of(e) for e in ids)
    finally:
        harness.stop()
