"""Warm-up (``gpu/warmup.py``): the kernels are built and one step of each kind runs before the
executor's first heartbeat, and nothing of it stays behind (pages, requests, cache counters,
KV events)."""

from __future__ import annotations

import asyncio
import logging
import time

import nats
import pytest

from common.wire.scheduler import Heartbeat
from gpu.engine import Engine, EngineConfig
from gpu.loader import load_model
from gpu.page_manager import PageTable
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from gpu.warmup import warmup_prompt_tokens
from tests.mesh import tiny_executor


def make_engine(folder, page_size: int = 4, num_pages: int = 64) -> Engine:
    model = load_model(folder, progress=False)
    runner = ModelRunner(model, num_pages=num_pages, page_size=page_size)
    return Engine(runner, EngineConfig(max_num_batched_tokens=64, max_num_seqs=8))


def test_prompt_length_fits_page_budget_and_context():
    assert warmup_prompt_tokens(16, 512, 4096) == 17  # one page and one token
    assert warmup_prompt_tokens(16, 8, 4096) == 8  # the step budget caps it
    assert warmup_prompt_tokens(16, 512, 10) == 8  # room for two decoded tokens
    with pytest.raises(ValueError, match="no room for a prompt and two decoded tokens"):
        warmup_prompt_tokens(16, 1, 4096)


def test_warm_up_runs_both_kinds_and_leaves_nothing_behind(tiny_llama):
    engine = make_engine(tiny_llama)
    pages = engine.pages
    report = engine.warm_up()
    assert report.prompt_tokens == 5  # page_size 4 + 1: the append crosses a page boundary
    assert report.prefill_s > 0 and report.decode_s > 0 and report.sample_s > 0
    assert report.graphs_s is None and "CUDA graphs" not in report.describe()  # CPU: eager
    assert "a decode step" in report.describe()
    # Every page free again, none hashed; no request, no cache counters, no KV event.
    assert pages.num_free == pages.num_pages and not pages.evictable and not pages.hash_to_page
    pages.check_invariants([])
    assert not engine.seqs and not engine.has_unfinished()
    assert (pages.queries, pages.hits) == (0, 0)
    assert engine.drain_kv_events() == []
    assert engine.num_forward_passes == 0 and engine.num_steps == 0


def test_outputs_after_warm_up_equal_a_cold_engine(tiny_llama):
    prompts = [[1, 5, 9, 13, 17, 21, 25], [3, 4]]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    cold = make_engine(tiny_llama).generate(prompts, params)
    warm = make_engine(tiny_llama)
    warm.warm_up()
    assert warm.generate(prompts, params) == cold
    warm.pages.check_invariants([])


def test_warm_up_refuses_while_a_request_runs(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="before the first request"):
        engine.warm_up()
    assert engine.has_unfinished()  # the request is untouched


def test_warm_up_needs_free_pages(tiny_llama):
    # The warm-up's 5 + 2 tokens need 2 pages of 4; with one of the 2 held, it says so.
    engine = make_engine(tiny_llama, page_size=4, num_pages=2)
    held = PageTable()
    assert engine.pages.allocate(held, 4)
    with pytest.raises(ValueError, match="cannot warm up: 7 tokens need 2 pages, 1 free"):
        engine.warm_up()
    assert engine.pages.num_free == 1
    engine.pages.check_invariants([held])


async def test_first_heartbeat_comes_after_the_warm_up(nats_server, tiny_llama, caplog):
    service = tiny_executor(nats_server.url, tiny_llama, "ex-warm", heartbeat_s=0.05)
    config = service.config
    nc = await nats.connect(nats_server.url)
    beats: list[Heartbeat] = []

    async def on_beat(msg) -> None:
        beats.append(Heartbeat.decode(msg.data))

    await nc.subscribe(config.mesh.subjects.executor_heartbeat, cb=on_beat)
    await nc.flush()
    subscribed_at = time.time()
    try:
        with caplog.at_level(logging.INFO, logger="meshserve.executor"):
            await service.start()
            async with asyncio.timeout(10):
                while not beats:
                    await asyncio.sleep(0.01)
        warmed = [r for r in caplog.records if "warmed up in" in r.getMessage()]
        assert len(warmed) == 1, [r.getMessage() for r in caplog.records]
        assert "a prompt chunk of 5 tokens" in warmed[0].getMessage()
        assert service.warmup is not None and service.warmup.total_s > 0
        first = beats[0]
        assert first.sent_at >= warmed[0].created >= subscribed_at
        # The warm-up's pages are all free in the first report the scheduler sees.
        assert first.free_pages == first.total_pages == config.num_pages
        assert first.running == first.waiting == 0 and first.request_ids == []
    finally:
        await nc.close()
        await service.stop()
