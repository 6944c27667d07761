"""The fused decode step (every layer in one C call) against the per-op path it replaces."""

from __future__ import annotations

import random

import pytest
import torch

from gpu import cpu_kernels
from gpu.attention.metadata import SeqChunk
from gpu.engine import Engine, EngineConfig
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(
    KERNELS is None, reason="CPU kernels need AVX2/FMA and a C compiler"
)


class Counting:
    """Wraps the model's FusedDecoder to count the steps that went through it."""

    def __init__(self, fused: cpu_kernels.FusedDecoder) -> None:
        self.fused, self.calls = fused, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fused(*args, **kwargs)


def scattered_sequences(seed: int, lengths: list[int], ps: int, num_pages: int):
    """Chunks of prompts of ``lengths`` on shuffled pages, with room for 3 more tokens each."""
    rng = random.Random(seed)
    pages = list(range(num_pages))
    rng.shuffle(pages)
    tables, start = [], 0
    for n in lengths:
        count = -(-(n + 3) // ps)
        tables.append(tuple(pages[start : start + count]))
        start += count
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
    return tables, prompts


@pytest.mark.parametrize(
    ("kind", "fmt"),
    [
        *[("llama", "none"), ("llama", "int8"), ("llama", "int4"), ("qwen3", "none")],
        *[("qwen3", "int8"), ("qwen2_moe", "none"), ("qwen3_moe", "int8"), ("mixtral", "int4")],
    ],
)
def test_fused_decode_step_gives_the_per_op_bits(tiny_models, kind, fmt):
    """Sequences of different lengths (partial and full last pages, scattered pages): a decode
    step's logits and the K/V it appends are bit-identical on both paths (qwen3: its q/k head
    norms too, with heads wider than hidden / heads; the mixtures of experts: their one-call
    MLPs, a dense layer among them in qwen3_moe, a shared expert in qwen2_moe)."""
    model = load_model(tiny_models[kind], progress=False, quantization=fmt)
    fused = model.fused_decoder()
    assert fused is not None
    counting = Counting(fused)
    model._fused = counting  # type: ignore[assignment]
    ps, num_pages = 4, 40
    runner = ModelRunner(model, num_pages, ps)
    tables, prompts = scattered_sequences(1, [1, 4, 7, 13], ps, num_pages)
    prefill = [SeqChunk(t, 0, len(p)) for t, p in zip(tables, prompts)]
    first = runner.execute(prefill, prompts).argmax(-1).tolist()
    assert counting.calls == 0  # prompts take the per-op path
    tokens = [[t] for t in first]
    for step in range(3):
        chunks = [SeqChunk(t, len(p) + step, 1) for t, p in zip(tables, prompts)]
        model.fuse_decode = False
        cache_before = [c.clone() for c in runner.kv.layers]
        per_op = runner.execute(chunks, tokens)
        cache_per_op = [c.clone() for c in runner.kv.layers]
        for c, saved in zip(runner.kv.layers, cache_before):
            c.copy_(saved)
        model.fuse_decode = True
        got = runner.execute(chunks, tokens)
        assert counting.calls == step + 1
        assert torch.equal(got, per_op)
        assert all(torch.equal(a, b) for a, b in zip(runner.kv.layers, cache_per_op))
        tokens = [[t] for t in got.argmax(-1).tolist()]


@pytest.mark.parametrize("fmt", ["none", "int8", "int4"])
def test_engine_outputs_equal_with_and_without_fusion(tiny_llama, fmt):
    """Whole generations, greedy and seeded sampling, batched with prompts arriving mid-way
    (mixed steps take the per-op path, all-decode steps the fused one): the same tokens."""
    outputs = []
    for fuse in (False, True):
        model = load_model(tiny_llama, progress=False, quantization=fmt)
        model.fuse_decode = fuse
        fused = model.fused_decoder()
        assert fused is not None
        counting = Counting(fused)
        model._fused = counting  # type: ignore[assignment]
        engine = Engine(ModelRunner(model, 64, 4), EngineConfig(32, 8, True), eos_token_ids=[2])
        rng = random.Random(5)
        params = [
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
        ]
        done: dict[str, list[int]] = {}
        for i in range(6):
            prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(2, 20))]
            engine.add_request(f"r{i}", prompt, params[i % 2])
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
        while engine.has_unfinished():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
        outputs.append(done)
        assert (counting.calls > 0) == fuse
    assert outputs[0] == outputs[1]
    assert all(len(v) == 12 for v in outputs[1].values())


def test_no_fused_decoder_without_kernels_or_for_fp8(tiny_llama):
    assert load_model(tiny_llama, progress=False, cpu_kernels=False).fused_decoder() is None
    assert load_model(tiny_llama, progress=False, quantization="fp8").fused_decoder() is None


def test_fused_decoder_rejects_bad_inputs(tiny_llama):
    model = load_model(tiny_llama, progress=False)
    fused = model.fused_decoder()
    assert fused is not None
    runner = ModelRunner(model, 8, 4)
    c = model.config
    assert KERNELS is not None
    attention = KERNELS.decode_attention(
        torch.arange(2), torch.tensor([0, 1]), torch.tensor([0, 0]),
        torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([1, 1], dtype=torch.int32), 0.25,
    )  # fmt: skip
    hidden = torch.zeros(2, c.hidden_size)
    pos = torch.zeros(2, dtype=torch.int64)
    cos, sin = model.rope.cos, model.rope.sin
    with pytest.raises(ValueError, match="hidden"):
        fused(torch.zeros(2, c.hidden_size + 1), pos, cos, sin, attention, runner.kv.layers)
    with pytest.raises(ValueError, match="one decode per token"):
        fused(torch.zeros(3, c.hidden_size), torch.zeros(3, dtype=torch.int64), cos, sin,
              attention, runner.kv.layers)  # fmt: skip
    with pytest.raises(ValueError, match="positions must lie"):
        fused(hidden, torch.tensor([0, cos.shape[0]]), cos, sin, attention, runner.kv.layers)
    with pytest.raises(ValueError, match="KV caches"):
        fused(hidden, pos, cos, sin, attention, runner.kv.layers[:1])
    small = ModelRunner(model, 1, 4)  # page 1 is out of range
    with pytest.raises(ValueError, match="pages out of range"):
        fused(hidden, pos, cos, sin, attention, small.kv.layers)
    # The good call still works after the rejected ones.
    out = fused(hidden.clone(), pos, cos, sin, attention, runner.kv.layers)
    assert out.shape == hidden.shape and torch.isfinite(out).all()
