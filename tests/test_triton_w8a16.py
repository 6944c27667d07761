"""Weight-only int8 on CUDA, run under Triton's interpreter on the CPU (one fixed block
configuration; the device tunes its own): the GEMM of ``gpu/triton_w8a16.py`` and the
matrix-vector kernel's int8 variant against the dequantized weight's ``F.linear``, what they
refuse, ``Int8Linear``'s dispatch between them, and the warm-up that compiles every variant.

The interpreter's ``tl.dot`` gives wrong sums for bf16 operands (Triton 3.6), so the GEMM is
checked in fp16 here, the same kernel as bf16's but for the dtype; the GPU check runs bf16."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpu import triton_gemv, triton_w8a16
from gpu.attention import rope_append
from gpu.linear import Int8Linear, make_linear, warm_triton_linears
from gpu.quant import quantize_int8

pytestmark = pytest.mark.skipif(not rope_append.available(), reason="needs triton")


@pytest.fixture(autouse=True)
def interpreted() -> Iterator[None]:
    assert os.environ.get("TRITON_INTERPRET") == "1"  # (tests/conftest.py turned it on)
    for module in (triton_gemv, triton_w8a16):
        module._kernel.cache_clear()
    yield
    for module in (triton_gemv, triton_w8a16):
        module._kernel.cache_clear()


def codes(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random weight, its int8 codes and their per-channel scales."""
    w = torch.randn((n, k), generator=torch.Generator().manual_seed(seed))
    q, scale = quantize_int8(w)
    return w, q, scale


def dequantized_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, b: object = None):
    bias = None if b is None else torch.as_tensor(b).double()
    return F.linear(x.double(), q.double() * scale.double()[:, None], bias)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(("m", "n", "k"), [(9, 40, 96), (16, 32, 32), (33, 64, 70), (70, 17, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a16_matmul_is_the_dequantized_linear(m: int, n: int, k: int, bias: bool) -> None:
    """Shapes that are no multiple of a tile in any of M, N and K; one fp16 rounding of
    an fp32 sum of exact products (the codes widen to fp16 without loss)."""
    _, q, scale = codes(n, k, m + n + k)
    gen = torch.Generator().manual_seed(m * k)
    x = torch.randn((m, k), generator=gen).half()
    b = torch.randn(n, generator=gen) if bias else None
    y = triton_w8a16.w8a16_matmul(x, q, scale, b)
    assert y.shape == (m, n) and y.dtype == torch.float16
    assert rel_err(y, dequantized_linear(x, q, scale, b)) < 2e-3
    # each row's result is its own: the first rows alone give the same numbers
    torch.testing.assert_close(triton_w8a16.w8a16_matmul(x[:5], q, scale, b), y[:5])


def test_w8a16_matmul_refuses_what_it_cannot_run() -> None:
    _, q, scale = codes(24, 32, 0)
    x = torch.randn((20, 32)).half()
    with pytest.raises(ValueError, match="fp16/bf16 rows of 32 and int8 codes"):
        triton_w8a16.w8a16_matmul(x.float(), q, scale)
    with pytest.raises(ValueError, match="fp16/bf16 rows of 32 and int8 codes"):
        triton_w8a16.w8a16_matmul(x[:, :30], q, scale)
    with pytest.raises(ValueError, match="contiguous fp32 \\[24\\]"):
        triton_w8a16.w8a16_matmul(x, q, scale.half())
    with pytest.raises(ValueError, match="the bias must be a contiguous \\[24\\]"):
        triton_w8a16.w8a16_matmul(x, q, scale, torch.zeros(12))
    with pytest.raises(ValueError, match="unit stride"):
        triton_w8a16.w8a16_matmul(x.t().contiguous().t(), q, scale)
    assert triton_w8a16.w8a16_matmul(x[:0], q, scale).shape == (0, 24)


def test_row_buckets_cover_every_step_length() -> None:
    assert [triton_w8a16.row_bucket(m) for m in (1, 16, 17, 32, 33, 4096, 10_000)] == [
        16, 16, 32, 32, 64, 4096, 4096,
    ]  # fmt: skip
    assert triton_w8a16.row_buckets(1) == [16]
    assert triton_w8a16.row_buckets(40) == [16, 32, 64]
    assert triton_w8a16.row_buckets(100_000)[-1] == triton_w8a16.MAX_BUCKET
    for max_rows in (9, 100, 2048, 5000):
        buckets = set(triton_w8a16.row_buckets(max_rows))
        assert {triton_w8a16.row_bucket(m) for m in range(1, max_rows + 1)} == buckets


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (3, 64, 70), (8, 17, 33)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_reads_int8_codes_with_their_scales(
    m: int, n: int, k: int, dtype: torch.dtype
) -> None:
    _, q, scale = codes(n, k, m * n + k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn((m, k), generator=gen).to(dtype)
    b = torch.randn(n, generator=gen)
    y = triton_gemv.gemv(x, q, b, scale=scale)
    assert y.dtype == dtype
    # one rounding of an fp32 sum to the output's dtype (bf16: 2^-8, fp16: 2^-11 relative)
    tol = 5e-3 if dtype == torch.bfloat16 else 1e-3
    assert rel_err(y, dequantized_linear(x, q, scale, b)) < tol
    # the fused residual add takes the scales too
    residual = torch.randn((m, n), generator=gen).to(dtype)
    want = dequantized_linear(x, q, scale) + residual.double()
    got = triton_gemv.gemv(x, q, scale=scale, add_to=residual.clone())
    assert rel_err(got, want) < tol


def test_gemv_refuses_int8_without_fitting_scales() -> None:
    _, q, scale = codes(24, 32, 1)
    x = torch.randn((2, 32)).bfloat16()
    with pytest.raises(ValueError, match="gemv runs fp16/bf16"):
        triton_gemv.gemv(x, q)  # codes without their scales
    with pytest.raises(ValueError, match="int8 weights on fp16/bf16 rows"):
        triton_gemv.gemv(x, q.bfloat16(), scale=scale)
    with pytest.raises(ValueError, match="contiguous fp32 \\[24\\]"):
        triton_gemv.gemv(x, q, scale=scale[:12])


def int8_layer(n: int, k: int, bias: bool, seed: int) -> Int8Linear:
    w, _, _ = codes(n, k, seed)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed)) if bias else None
    layer = make_linear(w, b, "int8", dtype=torch.float16)
    assert isinstance(layer, Int8Linear)
    return layer


@pytest.mark.parametrize("rows", [1, 8, 9, 40])
def test_int8_linear_on_cuda_is_weight_only(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's int8 dispatch (set on CPU tensors here): up to 8 rows the matrix-vector kernel,
    more the GEMM; both the codes times the unquantized activations, where the CPU path
    quantizes the activations in blocks of 32."""
    layer = int8_layer(48, 64, True, rows)
    assert layer.cuda_kernel is None and not layer.use_int_mm()  # on CPU: the CPU path
    x = torch.randn((rows, 64), generator=torch.Generator().manual_seed(7)).half()
    want = dequantized_linear(x, layer.int8_weight(), layer.scale, layer.bias)
    assert rel_err(layer(x), want) > 1e-3  # the CPU path's activation blocks
    launched: list[str] = []
    for module, name in ((triton_gemv, "gemv"), (triton_w8a16, "w8a16_matmul")):
        real = getattr(module, name)

        def counted(*args: object, _real: object = real, _name: str = name, **kw: object) -> object:
            launched.append(_name)
            return _real(*args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(f"gpu.linear.{name}", counted)
    layer.cuda_kernel = "w8a16"
    y = layer(x.view(rows, 1, 64)).view(rows, 48)
    assert launched == ["gemv" if rows <= triton_gemv.MAX_ROWS else "w8a16_matmul"]
    assert rel_err(y, want) < 1e-2
    # no rows (a step with no logits rows): an empty result, as every other path gives
    assert layer(x[:0]).shape == (0, 48)
    layer.cuda_kernel = "w8a8"  # the check's comparison: activations per token, _int_mm
    per_token = layer(x)
    assert 1e-3 < rel_err(per_token, want) < 3e-2


def test_warm_triton_linears_runs_every_variant_once(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = [int8_layer(48, 64, False, 1), int8_layer(48, 64, False, 2)]
    layers += [int8_layer(40, 64, True, 3), int8_layer(64, 48, False, 4)]
    assert (
        warm_triton_linears(layers, 40, torch.float16) == 0
    )  # CPU layers: no CUDA kernels to warm
    for layer in layers:
        layer.cuda_kernel = "w8a16"
    seen: list[tuple[int, int, int, bool]] = []

    def forward(self: Int8Linear, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.float16
        seen.append((x.shape[0], self.out_features, self.in_features, self.bias is not None))
        return x.new_zeros((x.shape[0], self.out_features))

    monkeypatch.setattr(Int8Linear, "forward", forward)
    assert warm_triton_linears(layers, 40, torch.float16) == len(seen) == 3 * 7
    # the 4 matrix-vector row blocks, then the GEMM's buckets 16, 32 and 64 (its last, 40 rows)
    assert sorted({s[0] for s in seen}) == [1, 2, 4, 8, 16, 32, 40]
    assert {s[1:] for s in seen} == {(48, 64, False), (40, 64, True), (64, 48, False)}
    seen.clear()
    assert warm_triton_linears(layers, 4, torch.float16) == 3 * 3 and {s[0] for s in seen} == {
        1,
        2,
        4,
    }


def test_int8_model_on_the_cuda_kernels_tracks_the_dequantized_model(tiny_llama: Path) -> None:
    """The whole model on CUDA's int8 kernels (fp16 under the interpreter) against the same
    codes times unquantized fp32 activations: a prompt of 12 tokens (the GEMM) and one of 5
    (the matrix-vector kernel)."""
    from gpu.loader import load_model
    from gpu.runner import ModelRunner
    from tests.test_quant import greedy_positions, prompts_for

    def run(kernel: str | None, prompt: list[int]) -> torch.Tensor:
        dtype = torch.float32 if kernel is None else torch.float16
        model = load_model(tiny_llama, progress=False, quantization="int8", dtype=dtype)
        for module in model.modules():
            if isinstance(module, Int8Linear):
                module.cuda_kernel, module.w8a8 = kernel, False
        return greedy_positions(ModelRunner(model, 16, 16), prompt).float()

    for prompt in prompts_for(10, [12, 5]):
        ref, got = run(None, prompt), run("w8a16", prompt)
        assert (ref.argmax(-1) == got.argmax(-1)).float().mean() >= 0.9
        assert rel_err(got, ref.double()) < 2e-2


def test_tuning_prunes_row_tiles_taller_than_the_bucket() -> None:
    """The GEMMs' autotuning prune (this one's and gpu.triton_blocks'; the interpreter runs
    one fixed configuration, so it runs on the device only): a bucket keeps the
    configurations whose row tiles are no taller than it, and one always remains."""
    triton = pytest.importorskip("triton")

    configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_B": 2}, num_warps=4)
        for m in (16, 32, 64, 128)
    ]
    prune = triton_w8a16.prune_to_bucket
    for bucket, tallest in ((16, 16), (32, 32), (64, 64), (4096, 128)):
        kept = prune(configs, {"BUCKET": bucket, "N": 64, "K": 64})
        assert max(c.kwargs["BLOCK_M"] for c in kept) == tallest
        assert len(kept) == [16, 32, 64, 128].index(tallest) + 1
    assert prune(configs[1:], {"BUCKET": 16}) == configs[1:2]  # none fits: the first


def test_the_engine_warm_up_builds_the_quantized_matmuls(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine.warm_up builds every Triton matmul a step of up to the step budget can launch,
    before its first step (and so before any CUDA graph's capture)."""
    import gpu.warmup
    from gpu.engine import Engine, EngineConfig
    from gpu.loader import load_model
    from gpu.runner import ModelRunner

    model = load_model(tiny_llama, progress=False, quantization="int8")
    runner = ModelRunner(model, num_pages=16, page_size=4)
    calls: list[tuple[int, int, torch.dtype]] = []
    steps_before: list[int] = []
    real_execute = runner.execute

    def execute(*args: object, **kwargs: object) -> torch.Tensor:
        steps_before.append(len(calls))
        return real_execute(*args, **kwargs)  # type: ignore[arg-type]

    def warm(modules: object, rows: int, dtype: torch.dtype) -> int:
        calls.append((len(list(modules)), rows, dtype))  # type: ignore[call-overload]
        return 0

    monkeypatch.setattr(gpu.warmup, "warm_triton_linears", warm)
    monkeypatch.setattr(runner, "execute", execute)
    Engine(runner, EngineConfig(max_num_batched_tokens=48)).warm_up()
    assert calls == [(len(list(model.modules())), 48, model.dtype)]
    assert steps_before and all(n == 1 for n in steps_before)  # after it, not before
