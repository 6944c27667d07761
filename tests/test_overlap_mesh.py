"""The mesh with an executor that overlaps its steps (``--overlap-steps on``; auto turns it on
for CUDA devices only): what a client streams is what the plain in-process engine generates,
concurrent streams included, and a client that goes away mid-stream leaves no page behind."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from common.tokenizer import Tokenizer
from gpu.engine import Engine, EngineConfig
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from tests.mesh import MeshHarness, openai_client

PROMPTS = ["Hello world", "The quick brown fox", "Serving language models", "café 你好"]


@pytest.fixture(scope="module")
def mesh(tiny_llama: Path) -> Iterator[MeshHarness]:
    harness = MeshHarness(
        tiny_llama, executors=1, kv_cache_tokens=2048, executor_options={"overlap_steps": "on"}
    ).start()
    yield harness
    harness.stop()


def test_the_executor_overlaps(mesh: MeshHarness) -> None:
    assert mesh.executor_services[0].engine.overlap is not None


async def test_concurrent_streams_equal_the_plain_engine(
    mesh: MeshHarness, tiny_llama: Path
) -> None:
    tok = Tokenizer.from_folder(tiny_llama)
    plain = Engine(
        ModelRunner(load_model(tiny_llama, progress=False), 256, 16), EngineConfig(),
        tok.eos_token_ids,
    )  # fmt: skip
    lengths = [5, 12, 30, 1]
    expected = [
        tok.decode(
            plain.generate([tok.encode(p)], SamplingParams(temperature=0.0, max_tokens=n))[0]
        )
        for p, n in zip(PROMPTS, lengths, strict=True)
    ]

    async def stream(client: Any, prompt: str, n: int) -> tuple[str, str | None]:
        chunks = [
            c async for c in await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True
            )
        ]  # fmt: skip
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        return text, chunks[-1].choices[0].finish_reason

    async with openai_client(mesh.base_url) as client:
        results = await asyncio.gather(
            *(stream(client, p, n) for p, n in zip(PROMPTS, lengths, strict=True))
        )
    assert [text for text, _ in results] == expected
    assert all(reason in ("stop", "length") for _, reason in results)


async def test_a_disconnect_mid_stream_frees_every_page(mesh: MeshHarness) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 200, "stream": True,
            "ignore_eos": True}  # fmt: skip
    async with aiohttp.ClientSession() as session:
        resp = await session.post(mesh.base_url + "/completions", json=body)
        for _ in range(3):
            await resp.content.readline()  # tokens are streaming, one is in flight
        resp.close()
    engine = mesh.executor_services[0].engine
    deadline = time.monotonic() + 2.0
    while engine.has_unfinished() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not engine.has_unfinished()
    assert engine.pages.num_free == engine.pages.num_pages


def test_the_executor_reports_its_overlap(mesh: MeshHarness) -> None:
    from prometheus_client import CollectorRegistry

    from common.metrics import ExecutorMetrics

    service = mesh.executor_services[0]
    state = service.engine_state()
    assert state.overlapped_steps and state.overlap_dropped_rows >= 0
    registry = CollectorRegistry()
    ExecutorMetrics(registry, "executor-0", lambda: replace(state, overlap_dropped_rows=3))
    labels = {"executor_id": "executor-0"}
    assert registry.get_sample_value("meshserve:engine_overlapped_steps", labels) == 1
    assert registry.get_sample_value("meshserve:engine_overlap_dropped_rows_total", labels) == 3
