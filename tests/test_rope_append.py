"""The fused rotary + paged-KV append kernel (``gpu/attention/rope_append.py``).

On the CPU the Triton kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, numpy
underneath) over the same pointers and strides it gets on CUDA; it is checked against the
plain-torch reference, and the reference against the model's own pieces (``gpu.rope``'s
rotation in fp32, the torch backend's append slots from ``build_batch_metadata``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu.attention import flashinfer_backend as fb
from gpu.attention import rope_append
from gpu.attention.metadata import SeqChunk, build_batch_metadata
from gpu.config import ModelConfig
from gpu.rope import RotaryEmbedding, cos_sin_cache
from tests.models import TINY_BASE

pytestmark = pytest.mark.skipif(not rope_append.available(), reason="needs triton")

PAGE_SIZE = 4


@pytest.fixture
def interpreted() -> Iterator[None]:
    """The kernel built under the interpreter, and built again afterwards."""
    assert os.environ.get("TRITON_INTERPRET") == "1"  # (tests/conftest.py turned it on)
    rope_append._kernel.cache_clear()
    yield
    rope_append._kernel.cache_clear()


def step(hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """A mixed step (a prompt chunk, decodes, a chunk that crosses a page) over scattered
    pages: the qkv rows, the metadata, a cache full of noise and the cos/sin cache."""
    gen = torch.Generator().manual_seed(seed)
    chunks = [
        SeqChunk((7, 2, 9), 0, 10),  # a prompt of 10 tokens over 3 pages
        SeqChunk((4,), 2, 1),  # a decode at position 2
        SeqChunk((0, 5, 8), 6, 3),  # positions 6..8: pages 5 then 8
        SeqChunk((3, 1), 7, 1),  # the first token of its second page
    ]
    meta = build_batch_metadata(chunks, PAGE_SIZE)
    tokens = meta.num_tokens
    qkv = torch.randn((tokens, (hq + 2 * hkv) * d), generator=gen).to(dtype)
    cache = torch.randn((10, 2, PAGE_SIZE, hkv, d), generator=gen).to(dtype)
    config = ModelConfig.from_hf_dict(
        {**TINY_BASE, "model_type": "llama", "hidden_size": hq * d,
         "num_attention_heads": hq, "num_key_value_heads": hkv}
    )  # fmt: skip
    return {
        "qkv": qkv, "cache": cache, "cos_sin": cos_sin_cache(config),
        "positions": meta.positions.to(torch.int32), "batch": meta.batch_indices,
        "indptr": meta.kv_indptr, "indices": meta.kv_indices,
        "pages": meta.append_pages, "offsets": meta.append_offsets,
        "rope_fp32": torch.stack(RotaryEmbedding(config, "cpu", torch.float32).cos_sin(
            meta.positions.long())),
    }  # fmt: skip


def split(qkv: torch.Tensor, hq: int, hkv: int, d: int) -> list[torch.Tensor]:
    return list(torch.split_with_sizes(qkv.view(qkv.shape[0], -1, d), [hq, hkv, hkv], dim=1))


def run(fn: object, s: dict[str, torch.Tensor], hq: int, hkv: int, d: int) -> None:
    q, k, v = split(s["qkv"], hq, hkv, d)
    fn(q, k, v, s["positions"], s["cos_sin"], s["cache"], s["batch"], s["indptr"], s["indices"])  # type: ignore[operator]


@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 16), (6, 2, 32), (2, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.usefixtures("interpreted")
def test_kernel_matches_the_reference(hq: int, hkv: int, d: int, dtype: torch.dtype) -> None:
    ours, ref = step(hq, hkv, d, dtype), step(hq, hkv, d, dtype)
    run(rope_append.rope_append_, ours, hq, hkv, d)
    run(rope_append.rope_append_reference, ref, hq, hkv, d)
    # q rotated in place, every slot (the untouched ones too) as the reference has them; one
    # rounding of fp32 math on both sides (numpy and torch may order it differently: 1 ulp).
    torch.testing.assert_close(ours["qkv"], ref["qkv"], atol=0, rtol=1e-2)
    torch.testing.assert_close(ours["cache"], ref["cache"], atol=0, rtol=1e-2)


def test_reference_is_the_models_rotation_and_the_backends_slots() -> None:
    hq, hkv, d = 4, 2, 16
    s = step(hq, hkv, d, torch.float32)
    before = s["cache"].clone()
    q0, k0, v0 = (t.clone() for t in split(s["qkv"], hq, hkv, d))
    run(rope_append.rope_append_reference, s, hq, hkv, d)
    cos, sin = s["rope_fp32"]
    q, _, v = split(s["qkv"], hq, hkv, d)
    torch.testing.assert_close(q, RotaryEmbedding.apply(q0, cos, sin))
    torch.testing.assert_close(v, v0)  # v is read, never written
    written = before.clone()
    written[s["pages"], 0, s["offsets"]] = RotaryEmbedding.apply(k0, cos, sin)
    written[s["pages"], 1, s["offsets"]] = v0
    torch.testing.assert_close(s["cache"], written)
    assert not torch.equal(s["cache"], before)


def test_bad_inputs_are_refused_before_any_launch() -> None:
    s = step(4, 2, 16, torch.bfloat16)
    q, k, v = split(s["qkv"], 4, 2, 16)
    args = (s["positions"], s["cos_sin"], s["cache"], s["batch"], s["indptr"], s["indices"])
    with pytest.raises(ValueError, match="fp16/bf16"):
        rope_append.rope_append_(q.float(), k.float(), v.float(), *args)
    with pytest.raises(ValueError, match="want \\[T, H, D\\]"):
        rope_append.rope_append_(q, k, v[:, :1], *args)
    with pytest.raises(ValueError, match="kv_cache"):
        rope_append.rope_append_(q, k, v, *args[:2], s["cache"][:, 0], *args[3:])


@pytest.mark.usefixtures("interpreted")
def test_model_with_the_fused_append_matches_the_reference(tiny_llama: Path) -> None:
    """The check's whole-model comparison with the FlashInfer backend's stand-in: bf16 with
    the fused kernel (the layer then leaves q and k unrotated) against fp32 torch, beside the
    stand-in's own rotation and append."""
    from gpu.loader import load_model
    from gpu.runner import ModelRunner
    from tests.test_flashinfer_backend import make_fake_flashinfer
    from tools.gpu_check import model_agreement as ma

    prompts = ma.random_prompts(512, (1, 9, 40), seed=3)
    pages = ma.pages_needed(prompts, 4)
    ref = ModelRunner(load_model(tiny_llama), pages, 16)
    bf16 = load_model(tiny_llama, dtype=torch.bfloat16)
    cfg = bf16.config
    runners = {}
    fakes = {}
    for name, table in (("fused", cos_sin_cache(cfg)), ("unfused", None)):
        fakes[name] = make_fake_flashinfer()
        backend = fb.FlashInferPagedAttention(
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, "cpu",
            workspace_bytes=64, flashinfer_module=fakes[name], rope_cache=table,
        )  # fmt: skip
        assert backend.rotates_qk == (table is not None)
        runners[name] = ModelRunner(bf16, pages, 16, backend=backend)
    result = ma.model_section(ref, runners, "fused", prompts, 4, 5e-2, chunk=16)
    assert result["ok"], result["table"]
    assert fakes["fused"].appends == 0 and fakes["unfused"].appends > 0
    assert fakes["fused"].runs.count("FakeDecode") > 0  # decode steps went through it too
