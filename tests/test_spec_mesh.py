"""Speculative decoding through the mesh: the executor asks the speculator service for drafts
between steps (or uses prompt lookup in process); outputs stay those of plain greedy."""

from __future__ import annotations

import pytest

from common.tokenizer import Tokenizer
from gpu.engine import Engine, EngineConfig
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from tests.mesh import MeshHarness, openai_client, wait_for

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
        if mode == "draft":  # every request finished: the speculator frees their drafts
            from services.speculator.service import SpeculatorService

            spec = next(s for s in mesh.services if isinstance(s, SpeculatorService))
            states = spec.proposer.states
            await wait_for(lambda: not states, 5, "the speculator to free finished drafts")
            held = list(states)
    finally:
        mesh.stop()
    assert texts == [offline(p, 24) for p in PROMPTS]
    if mode == "draft":
        assert stats.num_draft_tokens > 0
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert not held, f"the idle speculator still holds drafts of {held}"
    if mode == "no speculator":
        assert stats.num_draft_tokens == 0


async def test_a_finished_sequence_is_freed_by_every_speculator_replica_that_holds_it(
    tiny_llama, nats_server
):
    """Calls go to any replica (queue group), so two may hold a sequence's draft KV; the
    release went with the next call, to one of them, and the other kept the pages until its
    LRU pushed them out."""
    from common.config import MeshConfig
    from common.runtime import Service
    from common.wire.speculator import DraftSeq, ProposeRequest
    from common.wire.tokenizer import WireSamplingParams
    from services.executor.speculation import RemoteProposer
    from services.speculator.service import SpeculatorConfig, SpeculatorService, build_proposer

    replicas = []
    for i in range(2):
        config = SpeculatorConfig(
            MeshConfig(nats_server.url, instance_id=f"spec-{i}"), str(tiny_llama)
        )
        replicas.append(SpeculatorService(config, build_proposer(config)))
    executor = Service("executor", MeshConfig(nats_server.url, instance_id="executor-0"))
    try:
        for replica in replicas:
            await replica.start()
        await executor.connect()
        seqs = [DraftSeq(rid, [5, 6, 7, 8, 9] * 8, 40, 3, WireSamplingParams()) for rid in "ab"]
        free = [r.proposer.pages.num_free for r in replicas]
        for replica in replicas:  # each served a call for both
            reply = await replica.on_propose(ProposeRequest(seqs))
            assert sorted(d.request_id for d in reply.drafts) == ["a", "b"]
        remote = RemoteProposer(executor, timeout_s=1.0)
        remote.release(["a"])
        await remote.propose([], {})  # nothing to draft this step: the release still goes

        def freed() -> bool:
            return all(list(r.proposer.states) == ["b"] for r in replicas)

        await wait_for(freed, 5, "both replicas to free a")
        for replica, before in zip(replicas, free, strict=True):
            held = before - replica.proposer.pages.num_free
            assert held == len(replica.proposer.states["b"].table.pages) > 0
        assert remote.released == []
    finally:
        await executor.close()
        for replica in replicas:
            await replica.svc.close()
