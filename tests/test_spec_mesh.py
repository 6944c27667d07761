"""Speculative decoding through the mesh: the executor asks the speculator service for drafts
between steps (or uses prompt lookup in process); outputs stay those of plain greedy."""

from __future__ import annotations

import pytest

from common.tokenizer import Tokenizer
from gpu.engine import Engine, EngineConfig
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from tests.mesh import MeshHarness, openai_client

PROMPTS = ["Hello world", "The quick brown fox", "Serving language models fast"]


@pytest.fixture(scope="module")
def offline(tiny_llama):
    tok = Tokenizer.from_folder(tiny_llama)
    engine = Engine(ModelRunner(load_model(tiny_llama, progress=False), 256, 16), EngineConfig())

    def greedy(prompt: str, max_tokens: int) -> str:
        ids = tok.encode(prompt)
        out = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))
        return tok.decode(out[0])

    return greedy


async def complete_all(mesh: MeshHarness) -> list[str]:
    texts = []
    async with openai_client(mesh.base_url) as client:
        for prompt in PROMPTS:
            resp = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=24, temperature=0.0
            )
            texts.append(resp.choices[0].text)
    return texts


@pytest.mark.parametrize("mode", ["draft", "ngram", "no speculator"])
async def test_speculative_mesh_equals_offline_greedy(tiny_llama, offline, mode):
    """draft: the speculator serves the target's own weights, so every draft is accepted;
    ngram: in-process prompt lookup; no speculator: the executor gets no answer and decodes
    without drafts."""
    mesh = MeshHarness(
        tiny_llama,
        kv_cache_tokens=2048,
        speculator="ngram" if mode == "ngram" else "remote",
        num_speculative_tokens=3,
        draft_model=tiny_llama if mode == "draft" else None,
    ).start()
    try:
        texts = await complete_all(mesh)
        stats = mesh.executor_services[0].engine.spec
    finally:
        mesh.stop()
    assert texts == [offline(p, 24) for p in PROMPTS]
    if mode == "draft":
        assert stats.num_draft_tokens > 0
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if mode == "no speculator":
        assert stats.num_draft_tokens == 0
