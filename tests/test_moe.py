"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE). Their logits and greedy output
against transformers are in tests/test_model.py, under tensor parallelism in
tests/test_tensor_parallel.py; here: the config, the routing, quantized experts, LoRA on
their attention, what is refused, and one through the mesh."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from gpu.attention.metadata import SeqChunk
from gpu.config import ModelConfig, ModelError
from gpu.linear import BlockLinear, DenseLinear, Int8Linear
from gpu.loader import load_model
from gpu.lora import LoraSet, load_adapter
from gpu.model import DecoderLayer
from gpu.moe import SparseMoe
from gpu.runner import ModelRunner
from tests.models import hf_model, merged_hf_model, write_tiny_lora
from tests.test_lora import greedy
from tests.test_model import PAGE, greedy_continue, run_chunked

QWEN3_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 96,
    "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "num_experts": 16, "num_experts_per_tok": 4,
    "moe_intermediate_size": 24, "norm_topk_prob": True,
}  # fmt: skip


def moe_of(model: Any, layer: int) -> SparseMoe | None:
    return cast(DecoderLayer, model.layers[layer]).moe


def test_the_config_reads_each_familys_experts() -> None:
    """Qwen3-MoE's own config says ``num_experts`` (transformers 5 writes ``num_local_experts``);
    ``mlp_only_layers`` and ``decoder_sparse_step`` leave layers dense, as transformers does."""
    sparsity = {"decoder_sparse_step": 2, "mlp_only_layers": [3]}
    config = ModelConfig.from_hf_dict({**QWEN3_MOE, **sparsity})
    assert config.moe is not None
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (16, 4, 24)
    assert config.moe.norm_topk_prob and config.moe.shared_intermediate_size == 0
    assert [config.sparse_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert config.moe.expert(1, 15)[2] == "model.layers.1.mlp.experts.15.down_proj.weight"
    mixtral = {**QWEN3_MOE, "model_type": "mixtral", "num_local_experts": 8}
    del mixtral["num_experts"]
    moe = ModelConfig.from_hf_dict(mixtral).moe
    assert moe is not None and moe.norm_topk_prob and moe.intermediate_size == 96
    assert moe.expert(0, 2) == tuple(
        f"model.layers.0.block_sparse_moe.experts.2.{n}.weight" for n in ("w1", "w3", "w2")
    )
    shared = {**QWEN3_MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 48}
    moe = ModelConfig.from_hf_dict(shared).moe
    assert moe is not None and moe.shared_intermediate_size == 48
    assert moe.shared(0)[3] == "model.layers.0.mlp.shared_expert_gate.weight"
    assert ModelConfig.from_hf_dict({**QWEN3_MOE, "model_type": "qwen3"}).moe is None
    with pytest.raises(ModelError, match="num_experts_per_tok=17 must be 1..num_experts=16"):
        ModelConfig.from_hf_dict({**QWEN3_MOE, "num_experts_per_tok": 17})
    # an unset key takes transformers' default for the family
    unset = {k: v for k, v in shared.items() if "expert" not in k and "moe_" not in k}
    moe = ModelConfig.from_hf_dict(unset).moe
    assert moe is not None
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (60, 4, 1408)
    assert moe.shared_intermediate_size == 5632
    with pytest.raises(ModelError, match="qkv_bias: false"):
        ModelConfig.from_hf_dict({**shared, "qkv_bias": False})


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_the_fixtures_route_tokens_to_many_experts(tiny_models, kind) -> None:
    """Else the comparisons with transformers would not test the routing: the tiny models'
    tokens spread over most experts, and a token's top-k weights are as each family sets them
    (renormalised to 1 for Mixtral and this Qwen3-MoE, not for this Qwen2-MoE)."""
    model = load_model(tiny_models[kind], progress=False)
    moe = moe_of(model, 0)
    assert moe is not None
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    experts, weights = moe.route(x)
    assert len(set(experts.flatten().tolist())) >= len(moe.experts) - 1
    sums = weights.sum(-1)
    if kind == "qwen2_moe":
        assert bool((sums < 0.99).all())
    else:
        torch.testing.assert_close(sums, torch.ones_like(sums))
    if kind == "qwen3_moe":  # mlp_only_layers=[1]
        assert moe_of(model, 1) is None


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_experts_track_fp32(tiny_models, fmt) -> None:
    """Every expert is quantized (the routers stay dense) and the model's next-token
    distribution stays close to fp32's, teacher-forced on one prompt."""
    folder = tiny_models["qwen3_moe"]
    prompt = [random.Random(3).randrange(3, 512) for _ in range(60)]

    def log_probs(model: Any) -> torch.Tensor:
        runner = ModelRunner(model, 16, PAGE)
        out = runner.execute([SeqChunk(tuple(range(16)), 0, len(prompt))], [prompt], True)
        return torch.log_softmax(out, -1)

    ref = log_probs(load_model(folder, progress=False))
    model = load_model(folder, progress=False, quantization=fmt)
    moe = moe_of(model, 0)
    assert moe is not None
    kind = Int8Linear if fmt == "int8" else BlockLinear
    for expert in moe.experts:
        assert isinstance(expert.gate_up_proj, kind) and isinstance(expert.down_proj, kind)
    assert isinstance(moe.router, DenseLinear) and moe.router.format == "fp32"
    got = log_probs(model)
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    assert 0 < kl < {"int8": 0.002, "int4": 0.05}[fmt]


def test_an_adapter_on_the_attention_runs_and_one_on_the_experts_is_refused(
    tiny_models, tmp_path
) -> None:
    """LoRA on a mixture-of-experts model: its attention projections, mixed with the base in
    one step, give transformers' output with the adapter merged in; a pair for a sparse
    layer's MLP is refused by name (layer 1 of the fixture is dense, layer 0 is not)."""
    base = tiny_models["qwen3_moe"]
    attention = write_tiny_lora(tmp_path / "attn", base, ("q_proj", "k_proj", "v_proj", "o_proj"))
    mlp = write_tiny_lora(tmp_path / "mlp", base, ("q_proj", "gate_proj"))
    model = load_model(base, progress=False)
    with pytest.raises(ModelError, match="layer 0's MLP is a mixture of experts"):
        load_adapter("mlp", mlp, model.config)
    runner = ModelRunner(model, num_pages=128, page_size=PAGE)
    runner.load_loras(LoraSet([load_adapter("attn", attention, model.config)]))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 9, 7)]
    slots = [0, 1, 1]
    logits, tables = run_chunked(runner, prompts, [3] * len(prompts), slots)
    firsts = [int(lg[-1].argmax()) for lg in logits]
    decoded = greedy_continue(runner, prompts, tables, firsts, 6, slots)
    oracles = {0: hf_model(base), 1: merged_hf_model(base, attention)}
    for prompt, slot, tokens in zip(prompts, slots, decoded, strict=True):
        assert tokens == greedy(oracles[slot], prompt, 6), slot
    assert greedy(oracles[0], prompts[1], 6) != decoded[1]  # the adapter changes the output


def test_the_fused_few_row_layers_refuse_a_mixture_of_experts(tiny_models) -> None:
    model = load_model(tiny_models["mixtral"], progress=False)
    with pytest.raises(ValueError, match="do not take a mixture of experts"):
        model.use_triton_gemv(8, fuse_layers=True)
    assert model.few_row_layers == 0


def test_a_config_naming_more_layers_than_the_checkpoint_has_experts_for(
    tiny_models, tmp_path
) -> None:
    """A missing expert is named, as any missing tensor."""
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_models["qwen2_moe"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts", config.get("num_experts")) + 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"missing tensors: .*experts\.8\.down_proj"):
        load_model(folder, progress=False)


@pytest.fixture(scope="module")
def moe_mesh(tiny_models: dict[str, Path]):
    from tests.mesh import MeshHarness

    harness = MeshHarness(tiny_models["qwen3_moe"]).start()
    yield harness
    harness.stop()


async def test_the_mesh_serves_a_mixture_of_experts_model(moe_mesh, tiny_models) -> None:
    """Through the gateway, streamed and not, batched: transformers' greedy text."""
    import asyncio

    from common.tokenizer import Tokenizer
    from tests.mesh import openai_client

    folder = tiny_models["qwen3_moe"]
    oracle, tok = hf_model(folder), Tokenizer.from_folder(folder)
    client = openai_client(moe_mesh.base_url)
    prompts = [list(range(40 + i, 70 + 3 * i)) for i in range(4)]

    async def one(ids: list[int], stream: bool) -> str:
        kwargs: dict[str, Any] = dict(
            model="tiny", prompt=ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        if not stream:
            text: str = (await client.completions.create(**kwargs)).choices[0].text
            return text
        chunks = await client.completions.create(**kwargs, stream=True)
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    texts = await asyncio.gather(*(one(ids, i % 2 == 1) for i, ids in enumerate(prompts)))
    for ids, text in zip(prompts, texts, strict=True):
        assert text == tok.decode(greedy(oracle, ids, 10))


def test_weights_are_moved_and_quantized_one_at_a_time(tiny_models, monkeypatch) -> None:
    """Loading converts each tensor as a layer reads it, and a quantized layer frees its
    full-precision copy at once: at most a few are held at any time (not every expert of
    every layer in bf16 before any is quantized)."""
    import weakref

    from gpu import model as model_module

    read = model_module.DeviceWeights.__getitem__
    held: list[weakref.ref[Any]] = []
    peak = 0

    def counting(self: Any, name: str) -> Any:
        nonlocal peak
        weight = read(self, name)
        held.append(weakref.ref(weight))
        peak = max(peak, sum(ref() is not None for ref in held))
        return weight

    monkeypatch.setattr(model_module.DeviceWeights, "__getitem__", counting)
    folder = tiny_models["mixtral"]
    load_model(folder, dtype=torch.bfloat16, quantization="int8", cpu_kernels=False, progress=False)
    assert len(held) > 30 and peak <= 3, (len(held), peak)


@pytest.mark.parametrize(("kind", "fmt"), [("qwen2_moe", "none"), ("qwen3_moe", "int8")])
def test_the_one_call_cpu_kernel_computes_the_torch_ops(tiny_models, kind, fmt) -> None:
    """``moe.c`` (routing, every expert, the shared one) against the module's torch ops over
    the same packed linears: the same experts and outputs to rounding, for a batch of rows,
    one row and none; also with every expert taken by every token."""
    from gpu import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("CPU kernels need AVX2/FMA and a C compiler")
    model = load_model(tiny_models[kind], progress=False, quantization=fmt)
    moe = moe_of(model, 0)
    assert moe is not None and moe.packed() is not None
    g = torch.Generator().manual_seed(1)
    for rows in (37, 1, 0):
        x = torch.randn(rows, model.config.hidden_size, generator=g)
        ours, ref = moe(x), moe.per_op(x)
        assert ours.shape == ref.shape == x.shape
        if rows:
            assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-5, rows
    moe.top_k, moe._packed_built = len(moe.experts), False  # every expert, every token
    x = torch.randn(5, model.config.hidden_size, generator=g)
    ours, ref = moe(x), moe.per_op(x)
    assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-5


def test_the_fused_decode_step_with_experts_computes_the_torch_ops(tmp_path) -> None:
    """A model of widths no multiple of 8 (hidden 72, experts of 20, 5 experts, 3 a token,
    a shared expert of 36): a decode step in one C call (``moe.c`` inside the fused step)
    against the same step with the experts in torch ops, to rounding, on every row."""
    from gpu import cpu_kernels
    from tests.test_fused_decode import Counting, scattered_sequences
    from tools.gpu_check.check_model import write_synthetic_model

    if cpu_kernels.load() is None:
        pytest.skip("CPU kernels need AVX2/FMA and a C compiler")
    folder = write_synthetic_model(tmp_path / "m", {
        "model_type": "qwen2_moe", "vocab_size": 512, "hidden_size": 72,
        "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 3,
        "num_key_value_heads": 1, "head_dim": 24, "max_position_embeddings": 128,
        "num_experts": 5, "num_experts_per_tok": 3, "moe_intermediate_size": 20,
        "shared_expert_intermediate_size": 36, "mlp_only_layers": [1],
    })  # fmt: skip
    model = load_model(folder, progress=False)
    sparse = [m for m in (moe_of(model, i) for i in range(3)) if m is not None]
    assert len(sparse) == 2 and all(m.packed() is not None for m in sparse)
    fused = model.fused_decoder()
    assert fused is not None
    counting = Counting(fused)
    model._fused = counting  # type: ignore[assignment]
    runner = ModelRunner(model, 40, PAGE)
    tables, prompts = scattered_sequences(2, [1, 5, 9, 14], PAGE, 40)
    prefill = [SeqChunk(t, 0, len(p)) for t, p in zip(tables, prompts, strict=True)]
    tokens = [[t] for t in runner.execute(prefill, prompts).argmax(-1).tolist()]
    chunks = [SeqChunk(t, len(p), 1) for t, p in zip(tables, prompts, strict=True)]
    saved = [c.clone() for c in runner.kv.layers]
    one_call = runner.execute(chunks, tokens)
    assert counting.calls == 1
    for cache, before in zip(runner.kv.layers, saved, strict=True):
        cache.copy_(before)
    model.fuse_decode = False
    for moe in sparse:  # the experts in torch ops
        moe._packed, moe._packed_built = None, True
    torch_ops = runner.execute(chunks, tokens)
    assert counting.calls == 1
    assert float((one_call - torch_ops).abs().max() / torch_ops.abs().max()) < 1e-5
