"""The Triton matrix-vector kernel (``gpu/triton_gemv.py``) under Triton's interpreter on the
CPU (one fixed block configuration; the device tunes its own): ``F.linear``'s numbers for 1 to
8 rows, shapes that are no multiple of a block, with and without a bias; what it refuses; and
how a CUDA linear dispatches to it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpu import triton_gemv
from gpu.attention import rope_append
from gpu.linear import DenseLinear

pytestmark = pytest.mark.skipif(not rope_append.available(), reason="needs triton")


@pytest.fixture(autouse=True)
def interpreted() -> Iterator[None]:
    assert os.environ.get("TRITON_INTERPRET") == "1"  # (tests/conftest.py turned it on)
    triton_gemv._kernel.cache_clear()
    yield
    triton_gemv._kernel.cache_clear()


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (3, 64, 70), (8, 17, 33), (5, 8, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_is_f_linear(m: int, n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn((m, k), generator=gen).to(dtype)
    w = torch.randn((n, k), generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = triton_gemv.gemv(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    # one rounding of an fp32 sum: within a couple of output ulps of the float64 result
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-2


def test_refusals() -> None:
    x = torch.randn((9, 16)).bfloat16()
    w = torch.randn((8, 16)).bfloat16()
    with pytest.raises(ValueError, match="1..8 rows"):
        triton_gemv.gemv(x, w)
    with pytest.raises(ValueError, match="1..8 rows of 16"):
        triton_gemv.gemv(x[:2, :8], w)
    with pytest.raises(ValueError, match="fp16/bf16"):
        triton_gemv.gemv(x[:2].float(), w.float())


def test_a_cuda_linear_takes_it_for_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DenseLinear`` in its CUDA layout (``[N, K]`` for ``F.linear``), set up by hand here."""
    w = torch.randn((24, 40)).bfloat16()
    layer = DenseLinear(w)
    layer.layout, layer.weight = "nk", w.contiguous()  # what a CUDA weight gets
    x = torch.randn((3, 40)).bfloat16()
    layer.triton_rows = 2
    assert torch.equal(layer(x), F.linear(x, w))  # 3 rows > 2: cuBLAS's path
    layer.triton_rows = 8
    calls: list[int] = []
    real = triton_gemv.gemv

    def counted(*args: torch.Tensor | None) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_gemv, "gemv", counted)
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=2e-2, atol=5e-2)
    assert calls == [1]


def test_only_cuda_dense_linears_switch(tiny_llama: Path) -> None:
    from gpu.loader import load_model

    model = load_model(tiny_llama, progress=False)
    assert model.use_triton_gemv(8) == 0  # CPU linears keep their own kernels
    with pytest.raises(ValueError, match="at most 8 rows"):
        model.use_triton_gemv(9)
