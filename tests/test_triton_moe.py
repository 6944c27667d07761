"""The grouped mixture-of-experts matmuls (``gpu/triton_moe.py``) under Triton's interpreter on
the CPU: the pairs' grouping, and the MLP against the module's torch path (``per_op``) and
the fp32 model, shared expert and renormalisation included."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch

from gpu import triton_moe
from gpu.attention import rope_append
from gpu.loader import load_model
from gpu.model import DecoderLayer
from gpu.moe import SparseMoe

pytestmark = pytest.mark.skipif(not rope_append.available(), reason="needs triton")


@pytest.fixture(autouse=True)
def interpreted() -> Iterator[None]:
    assert os.environ.get("TRITON_INTERPRET") == "1"  # (tests/conftest.py turned it on)
    triton_moe._kernel.cache_clear()
    yield
    triton_moe._kernel.cache_clear()


@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(1, 2, 8), (9, 4, 6), (40, 2, 3)])
def test_align_groups_every_pair_by_expert_in_padded_blocks(tokens, top_k, experts) -> None:
    gen = torch.Generator().manual_seed(tokens)
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    sorted_pairs, block_expert = triton_moe.align(chosen, experts)
    pairs = tokens * top_k
    bm = triton_moe.BLOCK_M
    # sizes depend on the batch's shape only (what a CUDA graph needs)
    assert sorted_pairs.numel() == block_expert.numel() * bm
    assert block_expert.numel() == -(-(pairs + min(experts, pairs) * (bm - 1)) // bm)
    real = sorted_pairs[sorted_pairs < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair once
    flat = chosen.flatten()
    for b, expert in enumerate(block_expert.tolist()):
        block = sorted_pairs[b * bm : (b + 1) * bm]
        block = block[block < pairs]
        if expert < 0:
            assert block.numel() == 0
        else:
            assert bool((flat[block] == expert).all())
            assert block.tolist() == sorted(block.tolist())  # a token's order kept
    used = [e for e in block_expert.tolist() if e >= 0]
    assert used == sorted(used) and set(used) == set(flat.tolist())


def bf16_moe(folder: Any) -> tuple[Any, SparseMoe]:
    model = load_model(folder, dtype=torch.bfloat16, cpu_kernels=False, progress=False)
    moe = cast(DecoderLayer, model.layers[0]).moe
    assert moe is not None
    return model, moe


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_grouped_experts_compute_the_torch_path(tiny_models, kind) -> None:
    """bf16, 37 rows, 1 row and none: the grouped matmuls against the per-expert torch path
    (both against fp32), every family's routing (and Qwen2-MoE's shared expert)."""
    model, moe = bf16_moe(tiny_models[kind])
    assert moe.stacked_gate_up is None  # on the CPU only when asked
    assert moe.stack_experts()
    assert moe.stacked_gate_up is not None and moe.stacked_gate_up.shape[0] == len(moe.experts)
    fp32 = cast(DecoderLayer, load_model(tiny_models[kind], progress=False).layers[0]).moe
    assert fp32 is not None
    gen = torch.Generator().manual_seed(2)
    for rows in (37, 1, 0):
        x = torch.randn(rows, model.config.hidden_size, generator=gen)
        grouped = moe(x.to(torch.bfloat16))
        assert grouped.dtype == torch.bfloat16 and grouped.shape == x.shape
        if not rows:
            continue
        per_op = moe.per_op(x.to(torch.bfloat16)).float()
        ref = fp32.per_op(x)
        scale = float(ref.abs().max())
        assert float((grouped.float() - per_op).abs().max()) / scale < 2e-2
        assert float((grouped.float() - ref).abs().max()) / scale < 3e-2


def test_a_shape_off_every_block(tmp_path) -> None:
    """Hidden 40 and experts of 24 (no multiple of the 32-wide tiles), 5 experts, all taken."""
    from tools.gpu_check.check_model import write_synthetic_model

    folder = write_synthetic_model(tmp_path / "m", {
        "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 40, "intermediate_size": 48,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "max_position_embeddings": 64, "num_experts": 5,
        "num_experts_per_tok": 5, "moe_intermediate_size": 24, "norm_topk_prob": True,
    })  # fmt: skip
    _, moe = bf16_moe(folder)
    assert moe.stack_experts()
    x = torch.randn(7, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    grouped, per_op = moe(x).float(), moe.per_op(x).float()
    assert float((grouped - per_op).abs().max()) / float(per_op.abs().max()) < 2e-2


def test_long_steps_run_the_experts_apart_and_a_move_stacks_them_again(
    tiny_models, monkeypatch
) -> None:
    """Steps of more than GROUPED_MAX_TOKENS tokens take the per-expert path (many rows a
    matmul); after ``.to()`` the stacks are the experts' weights in the new dtype."""
    from gpu import moe as moe_module

    model, moe = bf16_moe(tiny_models["qwen3_moe"])
    assert moe.stack_experts()
    called: list[int] = []

    def grouped(self: SparseMoe, x: torch.Tensor) -> torch.Tensor:
        called.append(len(x))
        return x

    monkeypatch.setattr(SparseMoe, "grouped", grouped)
    gen = torch.Generator().manual_seed(4)
    long = torch.randn(moe_module.GROUPED_MAX_TOKENS + 1, 64, generator=gen).to(torch.bfloat16)
    assert float((moe(long) - moe.per_op(long)).abs().max()) == 0.0
    moe(long[:5])
    assert called == [5]
    model.to(torch.float16)
    assert moe.stacked_gate_up is not None and moe.stacked_gate_up.dtype == torch.float16
    expert = cast(Any, moe.experts[1])
    torch.testing.assert_close(
        moe.stacked_gate_up[1].float(), expert.gate_up_proj.dequantized_weight()
    )
