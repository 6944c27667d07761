"""The one-kernel row quantization (``gpu/triton_quant.py``) under Triton's interpreter on the
CPU: bit for bit the codes and scales of ``gpu.quant``'s torch versions, for fp8 e4m3 and int8,
from fp32, bf16 and fp16 activations, on rows that reach every rounding case."""

from __future__ import annotations

import pytest
import torch

from gpu.attention import rope_append
from gpu.quant import fused_row_quantization, quantize_fp8_rows, quantize_int8_rows
from gpu.triton_quant import BLOCK, quantize_rows

pytestmark = pytest.mark.skipif(not rope_append.available(), reason="needs triton")


def rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different magnitudes (e4m3's subnormals to large), one all zero, one with
    values whose scaled form falls exactly between two codes, more than a block long."""
    gen = torch.Generator().manual_seed(0)
    width = BLOCK * 2 + 52
    mags = torch.tensor([1e-3, 1.0, 30.0, 1e4, 0.0, 1.0, 0.1])[:, None]
    x = torch.randn((7, width), generator=gen) * mags
    # row 5: amax 448 (scale 1), so these scale to themselves: ties between two e4m3 codes
    # (9.5 between 9 and 10 where the step is 1; 17 and 19 where it is 2), e4m3 subnormals
    # (steps of 2^-9) and a negative zero
    x[5, :9] = torch.tensor([448.0, 9.5, 10.5, 17.0, 19.0, -2.25, 3 * 2**-10, 2**-10, -0.0])
    # row 6: amax 127 (int8's scale 1): ties between two integers
    x[6, :6] = torch.tensor([127.0, 2.5, -3.5, 4.5, 0.5, -0.5])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8", [True, False])
def test_codes_and_scales_are_torch_s_bit_for_bit(dtype: torch.dtype, fp8: bool) -> None:
    x = rows(dtype)
    q, scale = quantize_rows(x, fp8)
    want_q, want_scale = (quantize_fp8_rows if fp8 else quantize_int8_rows)(x)
    assert q.dtype == want_q.dtype and scale.shape == want_scale.shape == (7, 1)
    assert torch.equal(scale, want_scale)
    assert torch.equal(
        q.view(torch.uint8) if fp8 else q, want_q.view(torch.uint8) if fp8 else want_q
    )


def test_no_rows_and_bad_shapes() -> None:
    q, scale = quantize_rows(torch.empty((0, 16)), fp8=True)
    assert q.shape == (0, 16) and scale.shape == (0, 1)
    with pytest.raises(ValueError, match=r"\[M, K\] rows"):
        quantize_rows(torch.randn((4, 8)).t(), fp8=False)


def test_only_cuda_rows_take_the_kernel() -> None:
    assert not fused_row_quantization(torch.randn((2, 8)))  # the torch kernels on the CPU
