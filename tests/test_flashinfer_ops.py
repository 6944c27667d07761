"""FlashInfer's fused norm, rotary and SwiGLU behind ``gpu.ops`` (``FlashInferOps``).

On the CPU: how ``FlashInferOps`` maps the decoder's ops onto FlashInfer's functions (which
tensor is the residual, where the normalised copy lands, which columns of the qkv row are q
and k, the cos/sin cache's layout) is checked against ``TorchOps`` through a plain stand-in of
those functions, written from flashinfer 0.7.4's documented semantics. On CUDA (marked, skipped
elsewhere): the real kernels against ``TorchOps``.
"""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
import torch.nn.functional as F

from gpu.config import ModelConfig
from gpu.ops import FlashInferOps, TorchOps, make_ops
from gpu.rope import RotaryEmbedding
from tests.models import TINY_BASE


def stand_in() -> types.SimpleNamespace:
    def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
        return F.rms_norm(input.float(), (input.shape[-1],), weight.float(), eps).to(input.dtype)

    def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
        residual.add_(input)  # step 1: residual += input
        input.copy_(rmsnorm(residual, weight, eps))  # step 2: input = norm(residual)

    def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                              is_neox=True):  # fmt: skip
        assert cos_sin_cache.dtype == torch.float32 and is_neox
        half = cos_sin_cache.shape[1] // 2
        cos, sin = cos_sin_cache[positions.long(), :half], cos_sin_cache[positions.long(), half:]
        for t in (query, key):
            x = t.view(t.shape[0], -1, head_size)
            x1, x2 = x[..., :half].float(), x[..., half:].float()
            c, s = cos[:, None], sin[:, None]
            x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype))

    def silu_and_mul(input, out=None, enable_pdl=None):
        h = input.shape[-1] // 2
        return F.silu(input[..., :h]) * input[..., h:]

    return types.SimpleNamespace(
        rmsnorm=rmsnorm, fused_add_rmsnorm=fused_add_rmsnorm, silu_and_mul=silu_and_mul,
        apply_rope_with_cos_sin_cache_inplace=apply_rope_with_cos_sin_cache_inplace,
    )  # fmt: skip


def head_config(hq: int, hkv: int, d: int) -> ModelConfig:
    heads = {"hidden_size": hq * d, "num_attention_heads": hq, "num_key_value_heads": hkv}
    return ModelConfig.from_hf_dict({**TINY_BASE, "model_type": "llama", **heads})


def cos_sin_cache(rope: RotaryEmbedding) -> torch.Tensor:
    half = rope.cos.shape[1] // 2
    return torch.cat((rope.cos[:, :half], rope.sin[:, :half]), dim=-1).float()


def test_add_rms_norm_matches_torch_and_updates_the_residual_stream():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn((5, 32), generator=gen).bfloat16()
    delta = torch.randn((5, 32), generator=gen).bfloat16()
    weight = torch.rand(32, generator=gen).bfloat16()
    ref_hidden = hidden.clone()
    expected = TorchOps().add_rms_norm(ref_hidden, delta.clone(), weight, 1e-5)
    fused = FlashInferOps(stand_in())
    out = fused.add_rms_norm(hidden, delta, weight, 1e-5)
    torch.testing.assert_close(hidden, ref_hidden)  # hidden += delta, in place
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    first = fused.add_rms_norm(hidden, None, weight, 1e-5)  # the first layer: no delta
    torch.testing.assert_close(first, TorchOps().add_rms_norm(hidden, None, weight, 1e-5))
    # float32 (not FlashInfer's) takes the torch path
    h32 = hidden.float()
    plain = TorchOps().add_rms_norm(h32, None, weight.float(), 1e-5)
    torch.testing.assert_close(fused.add_rms_norm(h32, None, weight.float(), 1e-5), plain)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (9, 3), (4, 4)])
def test_rope_rotates_q_and_k_heads_of_the_qkv_row_only(hq, hkv):
    d = 16
    config = head_config(hq, hkv, d)
    rope = RotaryEmbedding(config, "cpu", torch.bfloat16)
    positions = torch.tensor([0, 3, 17, 5, 40])
    gen = torch.Generator().manual_seed(hq)
    qkv = torch.randn((5, (hq + 2 * hkv) * d), generator=gen).bfloat16()
    torch_ops = TorchOps()
    expected = qkv.clone()
    torch_ops.rope_(expected, hq + hkv, d, torch_ops.rope_step(rope, positions))
    fused = FlashInferOps(stand_in())
    step = fused.rope_step(rope, positions)
    assert step.cos_sin_cache is None  # built on CUDA only
    step = type(step)(positions, step.cos, step.sin, cos_sin_cache(rope))
    fused.rope_(qkv, hq + hkv, d, step)
    torch.testing.assert_close(qkv, expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(qkv[:, (hq + hkv) * d :], expected[:, (hq + hkv) * d :])  # v untouched


def test_silu_mul_and_which_ops_a_device_gets():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn((3, 64), generator=gen).bfloat16()
    torch.testing.assert_close(FlashInferOps(stand_in()).silu_mul(x), TorchOps().silu_mul(x))
    assert type(make_ops(None, torch.device("cpu"))) is TorchOps
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    cuda_ops = make_ops(None, torch.device("cuda"))
    assert isinstance(cuda_ops, FlashInferOps) == has_flashinfer  # torch where it is absent


CUDA_READY = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_READY, reason="needs an NVIDIA GPU and flashinfer-python")
def test_flashinfer_kernels_match_torch_ops():
    import flashinfer

    d, hq, hkv = 64, 8, 2
    config = head_config(hq, hkv, d)
    rope = RotaryEmbedding(config, "cuda", torch.bfloat16)
    fused, ref = FlashInferOps(flashinfer), TorchOps()
    positions = torch.arange(7, device="cuda") * 3
    qkv = torch.randn((7, (hq + 2 * hkv) * d), device="cuda").bfloat16()
    expected = qkv.clone()
    ref.rope_(expected, hq + hkv, d, ref.rope_step(rope, positions))
    fused.rope_(qkv, hq + hkv, d, fused.rope_step(rope, positions))
    torch.testing.assert_close(qkv, expected, atol=3e-2, rtol=3e-2)
    hidden, delta = torch.randn((2, 7, 512), device="cuda").bfloat16()
    weight = torch.rand(512, device="cuda").bfloat16()
    ref_hidden = hidden.clone()
    want = ref.add_rms_norm(ref_hidden, delta.clone(), weight, 1e-5)
    torch.testing.assert_close(fused.add_rms_norm(hidden, delta, weight, 1e-5), want,
                               atol=3e-2, rtol=3e-2)  # fmt: skip
    x = torch.randn((7, 256), device="cuda").bfloat16()
    torch.testing.assert_close(fused.silu_mul(x), ref.silu_mul(x), atol=1e-2, rtol=1e-2)
