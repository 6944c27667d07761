"""Tensor parallelism on the CPU (gloo): a replica split over 2 ranks (processes) gives the
outputs of the unsplit one and of transformers, in every case the engine meets; a rank that
dies fails the group at once, not after a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
import torch

from gpu.config import ModelConfig, ModelError
from gpu.engine import Engine, EngineConfig
from gpu.linear import Int8Linear
from gpu.model import DecoderLayer
from gpu.parallel.group import ParallelGroupLost
from gpu.parallel.shard import Shard, shard_config
from gpu.replica import build_runner
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from tests.mesh import MeshHarness
from tests.models import hf_model, write_tiny_model
from tests.test_disagg import PROMPTS, complete
from tests.test_engine import GREEDY, hf_greedy, prompts_for, run_until_done
from tests.test_nats_cluster import stream

POOL: dict[str, Any] = dict(num_pages=24, page_size=4)  # small: the churn below preempts


@pytest.fixture(autouse=True, scope="module")
def keep_threads() -> Iterator[None]:
    """build_runner gives each rank its share of the threads, this process included: give
    the tests after these their threads back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def engine_on(runner: ModelRunner) -> Engine:
    return Engine(runner, EngineConfig(max_num_batched_tokens=16, max_num_seqs=8), [2])


@pytest.fixture(scope="module")
def qwen2(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["qwen2"]


def runners(folder: Path, quantization: str = "none") -> Iterator[tuple[ModelRunner, ModelRunner]]:
    one = build_runner(folder, quantization=quantization, progress=False, **POOL)
    two = build_runner(
        folder, quantization=quantization, progress=False, tensor_parallel_size=2, **POOL
    )
    try:
        yield one, two
    finally:
        two.close()


@pytest.fixture(scope="module")
def llama_pair(tiny_llama: Path) -> Iterator[tuple[ModelRunner, ModelRunner]]:
    yield from runners(tiny_llama)


def churn(engine: Engine, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, list[int]]:
    """Requests joining mid-flight through a pool small enough to preempt, with 16-token
    chunks: the engine's hard cases in one run. Returns each request's tokens."""
    outputs: dict[str, list[int]] = {}
    preempted: set[str] = set()
    for i in range(3):
        engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=max_tokens[i], **GREEDY))

    def join(step: int) -> None:
        preempted.update(s.request_id for s in engine.scheduler.waiting if s.num_preemptions)
        if 3 <= step < len(prompts):
            params = SamplingParams(max_tokens=max_tokens[step], **GREEDY)
            engine.add_request(str(step), prompts[step], params)
        engine.pages.check_invariants([s.table for s in engine.seqs.values()])

    run_until_done(engine, outputs, join)
    assert preempted, "the pool was meant to force preemption"
    assert engine.pages.num_free == engine.pages.num_pages
    return outputs


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
def test_greedy_tp2_equals_tp1_and_transformers(kind: str, tiny_models: dict[str, Path]) -> None:
    folder = tiny_models[kind]
    oracle = hf_model(folder)
    prompts = prompts_for(7, [5, 17, 3, 26, 9, 12, 30])
    max_tokens = [12, 20, 7, 15, 25, 10, 18]
    for one, two in runners(folder):
        assert two.peers is not None and two.kv.spec.num_kv_heads == 1  # 2 KV heads, 2 ranks
        assert two.model.tp is not None
        reduces_before = two.model.tp.num_collectives
        split = churn(engine_on(two), prompts, max_tokens)
        assert two.model.tp.num_collectives > reduces_before
        assert split == churn(engine_on(one), prompts, max_tokens)
        for i, prompt in enumerate(prompts):
            assert split[str(i)] == hf_greedy(oracle, prompt, max_tokens[i]), f"request {i}"


def test_prefix_cache_hits_under_tp2(llama_pair, tiny_llama: Path) -> None:
    """Pages cached by one request serve the next on every rank (the same page ids index
    each rank's pool), with outputs unchanged."""
    oracle = hf_model(tiny_llama)
    _, two = llama_pair
    engine = engine_on(two)
    system = prompts_for(2, [21])[0]
    first, second = [*system, 40, 41], [*system, 50, 51, 52]
    assert engine.generate([first], SamplingParams(max_tokens=6, **GREEDY))[0] == hf_greedy(
        oracle, first, 6
    )
    engine.add_request("b", second, SamplingParams(max_tokens=6, **GREEDY))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert outs[0].cached_tokens == 20
    assert [t for o in outs for t in o.new_token_ids] == hf_greedy(oracle, second, 6)


def test_embeddings_under_tp2(llama_pair, tiny_llama: Path) -> None:
    """Rank 0 pools the hidden state every rank holds whole: the mean and the last token's,
    as transformers' base model gives them."""
    _, two = llama_pair
    engine = engine_on(two)
    ids = prompts_for(4, [23])[0]
    for mode in ("mean", "last"):
        params = SamplingParams(max_tokens=1, pooling=mode, pooling_normalize=False, **GREEDY)
        engine.add_request(mode, ids, params)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.embedding for o in engine.step()})
    with torch.no_grad():
        hidden = hf_model(tiny_llama).model(torch.tensor([ids])).last_hidden_state[0]
    for mode, want in (("mean", hidden.mean(0)), ("last", hidden[-1])):
        torch.testing.assert_close(torch.tensor(outs[mode]), want, atol=2e-5, rtol=1e-4)


def test_seeded_sampling_equal_under_tp2(llama_pair) -> None:
    one, two = llama_pair
    prompts = prompts_for(9, [6, 11, 4])
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=s) for s in (1, 2, 3)]

    def sample(runner: ModelRunner) -> list[list[int]]:
        engine = engine_on(runner)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(str(i), prompt, p)
        outputs: dict[str, list[int]] = {}
        run_until_done(engine, outputs)
        return [outputs[str(i)] for i in range(len(prompts))]

    assert sample(two) == sample(one)


def test_int8_under_tp2(tiny_llama: Path) -> None:
    """int8 splits its codes with their per-row scales (row-parallel layers keep the whole
    row's scale): the split replica computes what the unsplit int8 one does."""
    prompts = prompts_for(11, [5, 17, 3, 26, 9, 12, 30])
    max_tokens = [12, 20, 7, 15, 25, 10, 18]
    for one, two in runners(tiny_llama, "int8"):
        full = cast(Int8Linear, cast(DecoderLayer, one.model.layers[0]).o_proj)
        half = cast(Int8Linear, cast(DecoderLayer, two.model.layers[0]).o_proj)
        assert half.format == "int8"
        assert torch.equal(half.scale, full.scale)  # whole-row scales
        assert torch.equal(half.int8_weight(), full.int8_weight()[:, : half.in_features])
        assert churn(engine_on(two), prompts, max_tokens) == churn(
            engine_on(one), prompts, max_tokens
        )


@pytest.mark.parametrize("quantization", ["auto", "int8"])
def test_an_awq_checkpoint_under_tp2(tiny_llama: Path, tmp_path: Path, quantization: str) -> None:
    """An AWQ checkpoint's blocks split on their 32-weight blocks (auto keeps them) or, for a
    format that does not keep blocks, dequantized first: the split replica generates what
    the unsplit one does."""
    from tests.test_prequantized import write_quantized

    folder = write_quantized(tiny_llama, tmp_path / "awq", "awq", 32)
    prompts = prompts_for(13, [5, 17, 3, 26, 9, 12, 30])
    max_tokens = [12, 20, 7, 15, 25, 10, 18]
    for one, two in runners(folder, quantization):
        fmt = cast(DecoderLayer, two.model.layers[0]).o_proj.format
        assert fmt == ("gguf-q4_1" if quantization == "auto" else "int8")
        assert churn(engine_on(two), prompts, max_tokens) == churn(
            engine_on(one), prompts, max_tokens
        )


def test_heads_that_do_not_divide_are_refused(tiny_llama: Path, tmp_path: Path) -> None:
    """A clear error before any rank starts; fewer KV heads than ranks are replicated."""
    with pytest.raises(ModelError) as err:
        build_runner(tiny_llama, tensor_parallel_size=3, progress=False)
    assert str(err.value).endswith(
        "cannot be split 3 ways by tensor parallelism: 4 attention heads, 2 KV heads (neither "
        "divides the other), intermediate size 128 not divisible by 3"
    )
    gqa = write_tiny_model(tmp_path / "gqa", "llama", num_attention_heads=4, num_key_value_heads=1)
    local = shard_config(ModelConfig.from_folder(gqa), 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.head_dim) == (2, 1, 16)
    assert [Shard(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "gloo"])
def test_a_killed_rank_fails_the_step_within_seconds(tiny_llama: Path, shared_memory: bool) -> None:
    runner = build_runner(
        tiny_llama, tensor_parallel_size=2, progress=False, shared_memory=shared_memory, **POOL
    )
    try:
        assert runner.model.tp is not None
        assert (runner.model.tp.shm is not None) == shared_memory
        engine = engine_on(runner)
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=200, **GREEDY))
        engine.step()
        assert runner.peers is not None
        os.kill(runner.peers.pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ParallelGroupLost, match="rank"):
            for _ in range(1000):
                engine.step()
        assert time.monotonic() - start < 10
    finally:
        runner.close()


def test_gqa_with_one_kv_head_replicated_on_both_ranks(tmp_path: Path) -> None:
    """Also the Gloo all-reduce (the path without shared memory), fused decode included."""
    folder = write_tiny_model(tmp_path / "mqa", "llama", num_key_value_heads=1)
    oracle = hf_model(folder)
    prompts = prompts_for(13, [9, 21])
    runner = build_runner(
        folder, tensor_parallel_size=2, progress=False, shared_memory=False, **POOL
    )
    try:
        assert runner.kv.spec.num_kv_heads == 1
        assert runner.model.tp is not None and runner.model.tp.shm is None
        outs = engine_on(runner).generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
        assert outs == [hf_greedy(oracle, p, 8) for p in prompts]
    finally:
        runner.close()


@pytest.fixture
def tp_mesh(tiny_llama: Path) -> Iterator[MeshHarness]:
    mesh = MeshHarness(tiny_llama, executors=2, tensor_parallel=(2, 1), router="round-robin")
    mesh.start()
    try:
        yield mesh
    finally:
        mesh.stop()


async def test_a_killed_rank_moves_the_executors_streams_elsewhere(tp_mesh: MeshHarness) -> None:
    """The executor whose rank died goes silent and leaves; the scheduler moves its streams to
    the other executor, and each client still gets the whole greedy text."""
    split, whole = tp_mesh.executor_services
    assert split.engine.runner.peers is not None and whole.engine.runner.peers is None
    prompts = [f"prompt number {i} " * 4 for i in range(6)]
    expected = await asyncio.gather(*(stream(tp_mesh.base_url, p) for p in prompts))
    assert all(finish == "length" for _, finish in expected)
    tp_mesh.slow_steps(0.03)
    load = [asyncio.ensure_future(stream(tp_mesh.base_url, p)) for p in prompts]
    deadline = time.monotonic() + 30
    while not (split.started and whole.started):  # streams under way on both executors
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    held = set(split.requests)
    state = split.engine_state()  # what its /metrics says of the split
    assert state.tensor_parallel_size == 2 and state.collective_seconds > 0
    assert whole.engine_state().tensor_parallel_size == 1
    os.kill(split.engine.runner.peers.pids[0], signal.SIGKILL)
    start = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*load), 60)
    assert results == expected
    assert held, "the split executor held none of the streams"
    assert split.broken
    assert time.monotonic() - start < 30


async def test_meshserve_up_with_tensor_parallel_size_2(process_mesh, offline) -> None:
    """The user's path: ``meshserve up --tensor-parallel-size 2``, every service its own
    process and the executor's second rank a child of it; greedy and seeded outputs equal
    the unsplit engine's (and transformers')."""
    mesh = process_mesh(tensor_parallel_size=2)
    base = mesh.base_url + "/v1"
    async with aiohttp.ClientSession() as session:
        for prompt in PROMPTS:
            greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            ours, hf = offline(prompt, greedy)
            assert await complete(session, base, prompt, max_tokens=16, temperature=0) == ours == hf
            seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=16, ignore_eos=True)
            want, _ = offline(prompt, seeded)
            got = await complete(session, base, prompt, max_tokens=16, temperature=0.9, seed=7)
            assert got == want, prompt


def test_closing_waits_for_every_rank_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stuck rank (in a collective with a dead peer) was given 5 s in turn: 35 s at
    TP=8, as long as the launcher's whole stop stage for executors. One deadline now."""
    import io
    import subprocess

    from gpu.parallel import launch

    waited: list[float] = []
    clock = [100.0]

    class Stuck:
        stdout = None

        def __init__(self) -> None:
            self.stdin = io.BytesIO()
            self.killed = False

        def wait(self, timeout: float | None = None) -> int:
            if self.killed:
                return -9
            waited.append(timeout or 0.0)
            clock[0] += timeout or 0.0  # it waited that long, in vain
            raise subprocess.TimeoutExpired("rank", timeout or 0.0)

        def kill(self) -> None:
            self.killed = True

    group = launch.RankGroup.__new__(launch.RankGroup)
    workers = [Stuck() for _ in range(7)]
    group.workers = workers  # type: ignore[assignment]
    monkeypatch.setattr(launch, "CLOSE_WAIT_S", 1.0)
    monkeypatch.setattr("gpu.parallel.launch.time.monotonic", lambda: clock[0])
    group.close()
    assert all(w.killed for w in workers)
    assert sum(waited) <= 1.0 + 1e-6  # not 7 x 1.0


def test_every_rank_builds_its_triton_matmuls_before_it_is_ready(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's warm-up builds only its own kernels: a rank that built its Triton matmuls in
    its first steps would hold the others at the next all-reduce. The executor's step budget
    reaches every rank's spec, and a rank warms up before it writes its ready byte."""
    import gpu.parallel.worker as worker
    import gpu.replica as replica
    from gpu.parallel.launch import RankSpec

    specs: list[RankSpec] = []

    class Refused(Exception):
        pass

    def group(spec: RankSpec) -> None:
        specs.append(spec)
        raise Refused

    monkeypatch.setattr(replica, "RankGroup", group)
    with pytest.raises(Refused):
        build_runner(tiny_llama, tensor_parallel_size=2, max_num_batched_tokens=96, **POOL)
    assert specs[0].warm_rows == 96
    assert RankSpec.from_json(specs[0].to_json()).warm_rows == 96

    events: list[Any] = []
    model = object()

    class FakeModel:
        dtype = torch.float16

        def modules(self) -> list[object]:
            return [model]

    from gpu.parallel.group import TensorParallel

    monkeypatch.setattr(TensorParallel, "connect", lambda *a, **k: FakeGroup())
    monkeypatch.setattr(worker, "load_model", lambda *a, **k: FakeModel())
    monkeypatch.setattr(worker, "ModelRunner", lambda *a, **k: "runner")
    monkeypatch.setattr(
        worker, "warm_triton_linears", lambda mods, rows, dtype: events.append((mods, rows, dtype))
    )
    monkeypatch.setattr(worker, "run_steps", lambda *a: events.append("steps"))

    class FakeGroup:
        def close(self) -> None:
            events.append("closed")

    read_fd, write_fd = os.pipe()
    real_write = os.write

    def write(fd: int, data: bytes) -> int:
        if fd == write_fd:
            events.append(data)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    worker.serve(replace(specs[0], device="cpu"), 1, write_fd)
    os.close(read_fd)
    assert events == [([model], 96, torch.float16), b"R", "steps", "closed"]


def test_a_gguf_mixture_of_experts_splits_its_blocks_under_any_format(tmp_path: Path) -> None:
    """Q8_0 experts of 32 rows read from the file (not in the converted folder) split 2 ways
    into 16-row shares, which no 32-weight block boundary allows: dequantized first unless
    the format keeps blocks, so the split replica decodes what the unsplit one does."""
    from gguf import GGMLQuantizationType as T

    from gpu.gguf import resolve_model_path
    from tests.test_gguf import write_gguf
    from tests.test_tokenizer import train_byte_level_bpe

    bpe = train_byte_level_bpe()
    orig = write_tiny_model(tmp_path / "orig", "qwen2_moe")  # (512 ids: more than the BPE)
    path = write_gguf(orig, tmp_path / "moe.gguf", bpe, arch="qwen2moe",
                      qtypes={"experts": T.Q8_0})  # fmt: skip
    folder = resolve_model_path(str(path), cache_dir=tmp_path / "cache", progress=False)
    prompts = prompts_for(13, [5, 17, 3, 26, 9, 12, 30])
    max_tokens = [12, 20, 7, 15, 25, 10, 18]
    for one, two in runners(folder):
        assert churn(engine_on(two), prompts, max_tokens) == churn(
            engine_on(one), prompts, max_tokens
        )
