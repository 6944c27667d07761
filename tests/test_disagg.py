"""Disaggregated prefill and decode on a real mesh (`meshserve up --prefill-executors 1
--decode-executors 1`: every service its own process, so the two executors' NIXL agents are
in two processes and the KV pages move between them over UCX)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest
import torch
import torch.nn.functional as F

from common.nats_server import free_port_range
from common.tokenizer import Tokenizer
from gpu.sampling_params import SamplingParams
from services.launcher.mesh import LocalMesh
from tests.mesh import metric_value
from tests.models import hf_model
from tests.test_reliability import pid_of, stream_outcome, until_running

PROMPTS = ["Hello world", "The quick brown fox jumps over", "Serving language models " * 6]


def start_pair(process_mesh, **overrides) -> LocalMesh:
    """A disaggregated mesh whose two executors have both reported to the scheduler."""
    metrics = free_port_range(8)
    mesh: LocalMesh = process_mesh(
        prefill_executors=1, decode_executors=1, metrics_port=metrics, **overrides
    )
    deadline = time.monotonic() + 60
    while not all(executor_live(mesh, name) for name in ("prefill-0", "decode-0")):
        assert time.monotonic() < deadline, "both executors never reported"
        time.sleep(0.2)
    return mesh


def executor_live(mesh: LocalMesh, name: str) -> bool:
    health = mesh.health()
    return health is not None and name in str(health[1].get("stages", {}).get("executor", ""))


def metric(mesh: LocalMesh, service: str, name: str, absent: float | None = None) -> float:
    """A metric's sum on one service; ``absent``: its value when no series exists yet (a
    labelled counter appears with its first increment)."""
    try:
        return metric_value(mesh.metrics_urls[service], name)
    except AssertionError:
        if absent is None:
            raise
        return absent


async def complete(session, base: str, prompt: str, **body) -> str:
    payload = {"model": "tiny", "prompt": prompt, "ignore_eos": True, **body}
    async with session.post(f"{base}/completions", json=payload) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return str(data["choices"][0]["text"])


async def wait_idle(mesh: LocalMesh, executors: list[str], timeout: float = 20) -> None:
    """Until no executor holds a page for a request (cached pages are not held)."""
    deadline = time.monotonic() + timeout
    while True:
        usage = {e: metric(mesh, e, "meshserve:kv_cache_usage_perc") for e in executors}
        if not any(usage.values()):
            return
        assert time.monotonic() < deadline, f"pages still held: {usage}"
        await asyncio.sleep(0.2)


async def test_pair_equals_mixed_engine_and_transformers(process_mesh, offline, tiny_llama):
    mesh = start_pair(process_mesh)
    base = mesh.base_url + "/v1"
    async with aiohttp.ClientSession() as session:
        # The prefill executor scores the prompt (echo, logprobs: vLLM's prompt_logprobs) and
        # sends its logprobs with the first token; the decode executor goes on from there.
        body = {"model": "tiny", "prompt": PROMPTS[2], "echo": True, "logprobs": 1}
        async with session.post(f"{base}/completions", json={**body, "max_tokens": 3}) as resp:
            echoed = (await resp.json())["choices"][0]
        assert echoed["text"].startswith(PROMPTS[2])
        ids = Tokenizer.from_folder(tiny_llama).encode(PROMPTS[2])
        with torch.no_grad():
            logits = hf_model(tiny_llama)(torch.tensor([ids])).logits[0, :-1].float()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1))
        scored = echoed["logprobs"]["token_logprobs"]
        assert len(scored) == len(ids) + 3 and scored[0] is None
        assert scored[1 : len(ids)] == pytest.approx(want.squeeze(1).tolist(), abs=2e-4)
        assert metric(mesh, "prefill-0", "meshserve:kv_transfer_bytes_total") > 0
        # An embedding runs whole on the prefill executor: nothing is reserved on the decode
        # executor or moved to it.
        moved = metric(mesh, "prefill-0", "meshserve:kv_transfer_bytes_total")
        decoded = metric(mesh, "decode-0", "meshserve:prompt_tokens_total", absent=0)
        prefilled = metric(mesh, "prefill-0", "meshserve:prompt_tokens_total")
        async with session.post(f"{base}/embeddings", json={"input": PROMPTS[2]}) as resp:
            vector = torch.tensor((await resp.json())["data"][0]["embedding"])
        assert metric(mesh, "prefill-0", "meshserve:prompt_tokens_total") == prefilled + len(ids)
        assert metric(mesh, "decode-0", "meshserve:prompt_tokens_total", absent=0) == decoded
        assert metric(mesh, "prefill-0", "meshserve:kv_transfer_bytes_total") == moved
        with torch.no_grad():
            hidden = hf_model(tiny_llama).model(torch.tensor([ids])).last_hidden_state[0, -1]
        torch.testing.assert_close(vector, F.normalize(hidden, dim=0), atol=2e-5, rtol=1e-4)
        for prompt in PROMPTS:
            greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            ours, hf = offline(prompt, greedy)
            got = await complete(session, base, prompt, max_tokens=16, temperature=0)
            assert got == ours == hf, prompt
            seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=16, ignore_eos=True)
            want, _ = offline(prompt, seeded)
            got = await complete(session, base, prompt, max_tokens=16, temperature=0.9, seed=7)
            assert got == want, prompt
        moved = metric(mesh, "prefill-0", "meshserve:kv_transfer_bytes_total")
        assert moved > 0  # the prompts' KV went from the prefill executor to the decode one
        # Prefix-cache hits on the prefill side: the same long prompt again.
        hits = metric(mesh, "prefill-0", "meshserve:prefix_cache_hits_total")
        await complete(session, base, PROMPTS[2], max_tokens=4, temperature=0)
        assert metric(mesh, "prefill-0", "meshserve:prefix_cache_hits_total") > hits
        for side in ("prefill-0", "decode-0"):
            assert metric(mesh, side, "meshserve:kv_transfer_failures_total", absent=0) == 0
        await wait_idle(mesh, ["prefill-0", "decode-0"])


async def test_short_prompts_stay_on_the_decode_executor(process_mesh, offline, monkeypatch):
    """--disagg-min-prompt-tokens (the scheduler reads MESHSERVE_DISAGG_MIN_PROMPT_TOKENS): a
    short prompt is prefilled where it decodes, nothing moves; a long one still moves. Both
    give the mixed engine's text."""
    monkeypatch.setenv("MESHSERVE_DISAGG_MIN_PROMPT_TOKENS", "64")
    mesh = start_pair(process_mesh)
    base = mesh.base_url + "/v1"
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    short, long = "Hello world", "Serving language models at scale " * 16
    async with aiohttp.ClientSession() as session:
        assert (
            await complete(session, base, short, max_tokens=8, temperature=0)
            == offline(short, greedy)[0]
        )
        assert metric(mesh, "prefill-0", "meshserve:kv_transfer_bytes_total", absent=0) == 0
        assert (
            await complete(session, base, long, max_tokens=8, temperature=0)
            == offline(long, greedy)[0]
        )
        assert metric(mesh, "prefill-0", "meshserve:kv_transfer_bytes_total", absent=0) > 0
        await wait_idle(mesh, ["prefill-0", "decode-0"])


async def test_killed_prefill_executor_ends_every_request(process_mesh, offline):
    """Requests in flight through the prefill executor when it is killed: each ends with the
    text of an uninterrupted run (the decode executor computes the prompt itself) and no page
    stays reserved there."""
    # 64 tokens a step: the prompts take the prefill executor several steps, so it is seen
    # busy. The reference comes from the engine in this process: a first round through the
    # mesh would leave every prompt cached on both executors, and the prefill executor would
    # then compute one token of each, too briefly to be seen busy.
    mesh = start_pair(process_mesh, kv_transfer_timeout=5, max_num_batched_tokens=64)
    base = mesh.base_url + "/v1"
    body = {"max_tokens": 24, "ignore_eos": True, "temperature": 0}
    prompts = [f"request {i} says " + "words " * (20 + 7 * i) for i in range(12)]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)
    reference = [("ok", offline(p, greedy)[0]) for p in prompts]
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(stream_outcome(session, base, p, body)) for p in prompts]
        await until_running(mesh, "prefill-0")  # it holds prompts reserved on the decode side
        os.kill(pid_of(mesh, "prefill-0"), signal.SIGKILL)
        outcomes = await asyncio.gather(*tasks)
        assert outcomes == reference
        # The decode side computed the killed executor's share itself ...
        assert metric(mesh, "decode-0", "meshserve:kv_transfer_failures_total", absent=0) >= 1
        await wait_idle(mesh, ["decode-0"])  # ... and holds no page for them any more


async def test_killed_decode_executor_ends_every_request(process_mesh):
    """The decode executor killed mid-stream: its requests migrate (to the prefill executor,
    the only one left, which then serves as a mixed one) and end with the same text."""
    mesh = start_pair(process_mesh)
    base = mesh.base_url + "/v1"
    body = {"max_tokens": 120, "ignore_eos": True, "temperature": 0}
    prompts = [f"stream {i} goes on" for i in range(8)]
    async with aiohttp.ClientSession() as session:
        reference = await asyncio.gather(*(stream_outcome(session, base, p, body) for p in prompts))
        assert all(kind == "ok" for kind, _ in reference), reference
        tasks = [asyncio.create_task(stream_outcome(session, base, p, body)) for p in prompts]
        await until_running(mesh, "decode-0")
        os.kill(pid_of(mesh, "decode-0"), signal.SIGKILL)
        outcomes = await asyncio.gather(*tasks)
        assert outcomes == reference
        migrated = metric(mesh, "scheduler", "meshserve:scheduler_requests_migrated_total")
        assert migrated >= 1  # the kill came mid-stream, not after the streams had ended
        await wait_idle(mesh, ["prefill-0"])


async def test_the_kv_transfer_is_a_span_of_the_request_trace(tiny_llama):
    """In one process (the harness): ``executor.kv_transfer`` with its bytes, pages and time
    sits in the request's trace, under the scheduler's span like the prefill executor's; the
    prefix index sees the prompt's pages in both pools, as they are."""
    from tests.mesh import MeshHarness, runtime_of
    from tests.test_prefix_index import wait_for_agreement
    from tools.bench.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    mesh = MeshHarness(
        tiny_llama, roles=("prefill", "decode"), otlp_endpoint=receiver.endpoint
    ).start()
    try:
        async with aiohttp.ClientSession() as session:
            await complete(session, mesh.base_url, PROMPTS[2], max_tokens=6, temperature=0)
        assert mesh.index is not None
        caches = await wait_for_agreement(mesh, mesh.index)
        assert caches["prefill-0"] and caches["decode-0"]

        def transfer(spans):
            return [s for s in spans if s.name == "executor.kv_transfer"]

        def flush() -> None:
            for svc in mesh.executor_services:
                svc.svc.tracing.flush(5)

        assert receiver.wait_for(lambda spans: transfer(spans), poll=flush)
        span = transfer(receiver.spans)[0]
        assert receiver.wait_for(
            lambda spans: any(s.name == "gateway.request" for s in spans),
            poll=lambda: [r.tracing.flush(5) for r in map(runtime_of, mesh.services)],
        )
        roots = [s for s in receiver.spans if s.name == "gateway.request"]
        assert span.trace_id in {r.trace_id for r in roots}
        attrs = span.attributes
        assert attrs["meshserve.kv_transfer.bytes"] > 0 and attrs["meshserve.kv_transfer.pages"] > 0
        assert attrs["meshserve.peer_executor_id"] == "decode-0"
        assert attrs["meshserve.executor_id"] == "prefill-0" and span.status_code != 2
    finally:
        mesh.stop()
        receiver.stop()


async def test_a_guest_prefilled_through_a_handoff_is_a_guest_on_its_decode_executor(
    tiny_llama, monkeypatch
):
    """In one process: a request spilled in from another region (here every submit is taken
    as one) whose prompt is prefilled on the prefill executor runs on the decode executor as
    a guest: its sequence yields its slot to an own request (``gpu/scheduler.py``) and the
    executor's heartbeat counts it, once admitted."""
    from services.scheduler.regions import RegionConfig
    from services.scheduler.service import SchedulerService
    from tests.mesh import MeshHarness, stream_greedy, wait_for

    async def as_guest(self: SchedulerService, req) -> None:
        await self.on_spilled(req)

    monkeypatch.setattr(SchedulerService, "on_submit", as_guest)
    regions = RegionConfig(spill_reserve_executors=0, spill_reserve_seqs=0)
    mesh = MeshHarness(
        tiny_llama, roles=("prefill", "decode"), scheduler_options={"regions": regions}
    ).start()
    mesh.slow_steps(0.02)  # 60 tokens: over a second on the decode executor
    try:
        decode = next(e for e in mesh.executor_services if e.config.role == "decode")
        sched = next(s for s in mesh.services if isinstance(s, SchedulerService))
        stream = asyncio.ensure_future(stream_greedy(mesh.base_url, PROMPTS[2], 60))

        def admitted_guest() -> bool:
            return any(rid in decode.engine.seqs for rid in decode.guests)

        await wait_for(admitted_guest, 20, "the guest admitted on decode-0")
        rid = next(iter(decode.guests))
        assert decode.engine.seqs[rid].guest

        def beat_guests() -> int:
            return sched.router.executors["decode-0"].heartbeat.guests

        await wait_for(lambda: beat_guests() == 1 or stream.done(), 5, "a heartbeat with it")
        assert beat_guests() == 1
        text, finish = await stream
        assert text and finish == "length"
        # (the scheduler hears of the end from decode-0's next heartbeat, after the client)
        await wait_for(
            lambda: sched.inflight.guests_by_executor().get("decode-0", 0) == 0,
            5,
            "the scheduler counts the guest finished",
        )
    finally:
        mesh.stop()
