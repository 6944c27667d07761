"""``--quantization gguf`` / ``auto``: a GGUF model run in its own blocks, each tensor in its
own type (a tiny Llama written with Q4_0, Q4_1, Q8_0 and F16 tensors), against the same math
in torch and the dequantized file; the fused decode step; the engine's invariants."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as T

from gpu import cpu_kernels
from gpu.attention.metadata import SeqChunk
from gpu.config import ModelError
from gpu.engine import Engine, EngineConfig
from gpu.gguf import resolve_model_path
from gpu.linear import BlockLinear, DenseLinear
from gpu.loader import load_model
from gpu.quant import BlockWeight
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from tests.models import write_tiny_model
from tests.test_gguf import write_gguf
from tests.test_tokenizer import train_byte_level_bpe

KERNELS = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(
    KERNELS is None, reason="CPU kernels need AVX2/FMA and a C compiler"
)

# Per tensor type, as mixed as real files are (Q4_K_M files mix 4- and 6-bit tensors): layer 1's
# v is F16, so its fused qkv cannot stay in blocks and runs dequantized.
QTYPES = {
    "layers.1.self_attn.v_proj": T.F16,
    "q_proj": T.Q4_0,
    "k_proj": T.Q4_0,
    "v_proj": T.Q4_0,
    "o_proj": T.Q8_0,
    "gate_proj": T.Q4_1,
    "up_proj": T.Q4_1,
    "down_proj": T.Q4_1,
    "embed_tokens": T.Q8_0,
}


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied tiny Llama as a mixed-type GGUF, converted (the folder names its source)."""
    root = tmp_path_factory.mktemp("gguf_native")
    bpe = train_byte_level_bpe()
    orig = write_tiny_model(
        root / "orig", "llama", vocab_size=bpe.get_vocab_size(), tie_word_embeddings=True
    )
    path = write_gguf(orig, root / "tiny-mixed.gguf", bpe, qtypes=QTYPES)
    return resolve_model_path(str(path), cache_dir=root / "cache", progress=False)


def formats_of(model: Any) -> set[str]:
    return {m.format for m in model.modules() if isinstance(m, (BlockLinear, DenseLinear))}


def logits(model: Any, tokens: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, 16, 4)
    chunk = [SeqChunk(tuple(range(16)), 0, len(tokens))]
    return runner.execute(chunk, [tokens], all_logits=True)


def prompt(seed: int, n: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def test_each_tensor_keeps_its_type(gguf_folder):
    model = load_model(gguf_folder, progress=False, quantization="gguf", cpu_kernels=False)
    layer0, layer1 = model.layers[0], model.layers[1]
    qtypes = {
        name: m.qtype if isinstance(m, BlockLinear) else str(getattr(m, "format", ""))
        for name, m in (
            ("qkv0", layer0.qkv_proj), ("qkv1", layer1.qkv_proj), ("o", layer0.o_proj),
            ("gate_up", layer0.gate_up_proj), ("down", layer0.down_proj), ("head", model.lm_head),
        )
    }  # fmt: skip
    # layer 1: q/k Q4_0 + v F16 cannot share blocks: dequantized
    assert qtypes == {
        "qkv0": "Q4_0", "qkv1": "fp32", "o": "Q8_0", "gate_up": "Q4_1", "down": "Q4_1",
        "head": "Q8_0",
    }  # fmt: skip
    assert model.embed_tokens is None  # tied: the embedding is the head's blocks
    assert formats_of(model) == {"gguf-q4_0", "gguf-q4_1", "gguf-q8_0", "fp32"}


@needs_kernels
def test_native_blocks_match_torch_math_and_the_dequantized_file(gguf_folder):
    """The kernels against the same math in torch (dequantized blocks times the activations
    quantized per block): float rounding; against the dequantized file in fp32 (what
    ``none`` runs): close, the difference being the int8 activations."""
    tokens = prompt(1, 21)
    native = logits(load_model(gguf_folder, progress=False, quantization="gguf"), tokens)
    torch_math = logits(
        load_model(gguf_folder, progress=False, quantization="gguf", cpu_kernels=False), tokens
    )
    torch.testing.assert_close(native, torch_math, rtol=1e-4, atol=1e-4)
    fp32 = logits(load_model(gguf_folder, progress=False, quantization="none"), tokens)
    assert 0 < float((native - fp32).abs().max()) < 0.05 * float(fp32.abs().max())
    # and auto picks the blocks for a GGUF model on CPU
    auto = load_model(gguf_folder, progress=False, quantization="auto")
    assert formats_of(auto) == {"gguf-q4_0", "gguf-q4_1", "gguf-q8_0", "fp32"}
    assert torch.equal(logits(auto, tokens), native)


def test_auto_is_fp32_for_a_checkpoint_and_gguf_needs_a_gguf(tiny_llama):
    assert formats_of(load_model(tiny_llama, progress=False, quantization="auto")) == {"fp32"}
    with pytest.raises(ModelError, match="--quantization gguf needs a model converted from a GGUF"):
        load_model(tiny_llama, progress=False, quantization="gguf")


def test_unsupported_tensor_type_is_a_clear_error():
    with pytest.raises(ModelError, match=r"no block kernel for GGUF type Q4_K \(native: Q4_0"):
        BlockWeight("Q4_K", torch.zeros(4, 144, dtype=torch.uint8), 256)
    with pytest.raises(ModelError, match="rows of 20 bytes do not hold 64 weights"):
        BlockWeight("Q4_1", torch.zeros(4, 20, dtype=torch.uint8), 64)


class Counting:
    def __init__(self, fused: cpu_kernels.FusedDecoder) -> None:
        self.fused, self.calls = fused, 0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return self.fused(*args, **kwargs)


@needs_kernels
def test_fused_decode_gives_the_per_op_bits(gguf_folder):
    model = load_model(gguf_folder, progress=False, quantization="gguf")
    fused = model.fused_decoder()
    assert fused is not None
    counting = Counting(fused)
    model._fused = counting  # type: ignore[assignment]
    runner = ModelRunner(model, 32, 4)
    prompts = [prompt(s, n) for s, n in ((2, 3), (3, 9), (4, 14))]
    tables = [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9), (10, 11, 12, 13, 14)]
    first = runner.execute([SeqChunk(t, 0, len(p)) for t, p in zip(tables, prompts)], prompts)
    tokens = [[t] for t in first.argmax(-1).tolist()]
    for step in range(3):
        chunks = [SeqChunk(t, len(p) + step, 1) for t, p in zip(tables, prompts)]
        saved = [c.clone() for c in runner.kv.layers]
        model.fuse_decode = False
        per_op = runner.execute(chunks, tokens)
        after = [c.clone() for c in runner.kv.layers]
        for c, s in zip(runner.kv.layers, saved):
            c.copy_(s)
        model.fuse_decode = True
        got = runner.execute(chunks, tokens)
        assert counting.calls == step + 1
        assert torch.equal(got, per_op)
        assert all(torch.equal(a, b) for a, b in zip(runner.kv.layers, after))
        tokens = [[t] for t in got.argmax(-1).tolist()]


def engine(folder: Path, num_pages: int = 48, budget: int = 48, max_seqs: int = 12) -> Engine:
    model = load_model(folder, progress=False, quantization="gguf")
    return Engine(ModelRunner(model, num_pages, 4), EngineConfig(budget, max_seqs, True), [2])


def test_outputs_do_not_depend_on_the_batch(gguf_folder):
    alone_prompt, others = prompt(6, 9), [prompt(7, 4), prompt(8, 15), prompt(9, 30)]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True),
    ):
        alone = engine(gguf_folder).generate([alone_prompt], params)[0]
        crowd = engine(gguf_folder).generate(
            [*others, alone_prompt], [SamplingParams(temperature=0.8, max_tokens=10)] * 3 + [params]
        )
        assert crowd[3] == alone


def test_page_accounting_holds(gguf_folder):
    rng = random.Random(22)
    eng = engine(gguf_folder, num_pages=24, budget=24, max_seqs=8)
    live: list[str] = []
    for i in range(50):
        params = SamplingParams(max_tokens=rng.randrange(1, 9), temperature=rng.choice([0.0, 1.0]))
        eng.add_request(f"r{i}", prompt(i, rng.randrange(1, 14)), params)
        live.append(f"r{i}")
        if rng.random() < 0.15:
            eng.abort(live.pop(rng.randrange(len(live))))
        eng.step()
        eng.pages.check_invariants([s.table for s in eng.seqs.values()])
    while eng.has_unfinished():
        eng.step()
        eng.pages.check_invariants([s.table for s in eng.seqs.values()])
    assert eng.pages.num_free == eng.pages.num_pages


@needs_kernels
def test_a_mixture_of_experts_runs_its_experts_in_their_blocks(tmp_path: Path) -> None:
    """A Qwen3-MoE GGUF whose experts are Q8_0 and Q4_1 (stacked [E, N, K] in the file, as
    llama.cpp writes them): each expert keeps its rows' blocks (moe.c runs them), per op and
    in the fused decode step, close to the dequantized file's model."""
    bpe = train_byte_level_bpe()
    orig = write_tiny_model(tmp_path / "orig", "qwen3_moe", vocab_size=bpe.get_vocab_size())
    qtypes = {"gate_proj": T.Q8_0, "up_proj": T.Q8_0, "down_proj": T.Q4_1}
    path = write_gguf(orig, tmp_path / "moe.gguf", bpe, arch="qwen3moe", qtypes=qtypes)
    folder = resolve_model_path(str(path), cache_dir=tmp_path / "cache", progress=False)
    blocks = load_model(folder, progress=False, quantization="gguf")
    layers: Any = blocks.layers
    moe = layers[0].moe
    assert moe is not None and moe.packed() is not None
    kinds = {(e.gate_up_proj.qtype, e.down_proj.qtype) for e in moe.experts}
    assert kinds == {("Q8_0", "Q4_1")}
    assert layers[1].moe is None  # (the fixture's dense layer)
    assert blocks.fused_decoder() is not None
    tokens = prompt(5, 40)
    ours, ref = logits(blocks, tokens), logits(load_model(folder, progress=False), tokens)
    assert float((ours - ref).abs().max() / ref.abs().max()) < 5e-2
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9
    # the experts have no fp32 copy in the folder: every load reads them from the file
    from safetensors import safe_open

    from gpu.gguf.blocks import in_source

    kept = in_source(folder)
    assert len(kept) == 3 * 8  # layer 0's experts (layer 1 is dense), three projections
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert not set(kept) & set(f.keys())
    from gpu.gguf.blocks import require_whole_folder

    with pytest.raises(ModelError, match="transformers does not read"):
        require_whole_folder(folder, "distillation's teacher")
    path.touch()  # the file changed: what the folder lacks is nowhere
    with pytest.raises(ModelError, match="reads its experts from the GGUF file"):
        load_model(folder, progress=False)
