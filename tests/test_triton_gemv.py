"""The Triton matrix-vector kernel (``gpu/triton_gemv.py``) under Triton's interpreter on the
CPU (one fixed block configuration; the device tunes its own): ``F.linear``'s numbers for 1 to
8 rows, shapes that are no multiple of a block, with and without a bias; what it refuses; and
how a CUDA linear dispatches to it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu import triton_gemv
from gpu.attention import rope_append
from gpu.attention.metadata import SeqChunk
from gpu.linear import DenseLinear
from gpu.model import CausalLM
from gpu.runner import ModelRunner

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


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (3, 24, 70), (8, 17, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_norm_silu_and_residual(m: int, n: int, k: int, bias: bool) -> None:
    """Each fused input and the residual add against the unfused float64 ops."""
    gen = torch.Generator().manual_seed(m + n * k)
    dtype = torch.bfloat16
    w = torch.randn((n, k), generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    b64 = None if b is None else b.double()
    hidden = (3 * torch.randn((m, k), generator=gen)).to(dtype)
    norm_w = torch.rand(k, generator=gen).add(0.5).to(dtype)
    gate_up = torch.randn((m, 2 * k), generator=gen).to(dtype)
    residual = torch.randn((m, n), generator=gen).to(dtype)

    def close(y: torch.Tensor, ref: torch.Tensor) -> None:
        assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-2

    normed = F.rms_norm(hidden.double(), (k,), norm_w.double(), 1e-5)
    close(triton_gemv.gemv(hidden, w, b, norm=norm_w, eps=1e-5), F.linear(normed, w.double(), b64))
    g, u = gate_up.double().chunk(2, dim=1)
    close(triton_gemv.gemv(gate_up, w, b, silu=True), F.linear(F.silu(g) * u, w.double(), b64))
    expected = residual.double() + F.linear(normed, w.double(), b64)
    out = residual.clone()
    returned = triton_gemv.gemv(hidden, w, b, norm=norm_w, eps=1e-5, add_to=out)
    assert returned is out
    close(out, expected)
    out = residual.clone()
    triton_gemv.gemv(gate_up, w, b, silu=True, add_to=out)
    close(out, residual.double() + F.linear(F.silu(g) * u, w.double(), b64))


def test_refusals() -> None:
    x = torch.randn((9, 16)).bfloat16()
    w = torch.randn((8, 16)).bfloat16()
    with pytest.raises(ValueError, match="1..8 rows"):
        triton_gemv.gemv(x, w)
    with pytest.raises(ValueError, match="1..8 rows of 16"):
        triton_gemv.gemv(x[:2, :8], w)
    with pytest.raises(ValueError, match="fp16/bf16"):
        triton_gemv.gemv(x[:2].float(), w.float())
    with pytest.raises(ValueError, match="rows of 2 x 16"):
        triton_gemv.gemv(x[:2], w, silu=True)
    with pytest.raises(ValueError, match=r"norm weight must be a contiguous \[16\]"):
        triton_gemv.gemv(x[:2], w, norm=torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"adds into a \[2, 8\]"):
        triton_gemv.gemv(x[:2], w, add_to=torch.zeros((2, 16), dtype=torch.bfloat16))


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


def cuda_layout(model: CausalLM) -> CausalLM:
    """Every dense linear in the ``[N, K]`` layout a CUDA weight gets (set up by hand: the
    tests have no GPU)."""
    for module in model.modules():
        if isinstance(module, DenseLinear) and module.layout == "kn":
            module.weight = module.weight.t().contiguous()
            module.layout = "nk"
    return model


def run_steps(model: CausalLM) -> list[torch.Tensor]:
    """Logits of a 12-token and a 5-token prompt (one step of 17 rows), four decode steps of
    both (2 rows each), then a third sequence's 6-token prompt alone (6 rows: a prefill)."""
    runner = ModelRunner(model, num_pages=8, page_size=16)
    prompts = [[7, 3, 99, 250, 14, 8, 61, 5, 42, 300, 11, 2], [90, 4, 17, 33, 480]]
    pages = [(0, 1), (2, 3)]
    chunks = [SeqChunk(pages[b], 0, len(p)) for b, p in enumerate(prompts)]
    logits = [runner.execute(chunks, prompts)]
    lengths = [len(p) for p in prompts]
    for step in range(4):
        tokens = [[(31 * step + 7 * b) % 500 + 3] for b in range(2)]
        chunks = [SeqChunk(pages[b], lengths[b] + step, 1) for b in range(2)]
        logits.append(runner.execute(chunks, tokens))
    logits.append(runner.execute([SeqChunk((4,), 0, 6)], [[5, 77, 123, 9, 400, 31]]))
    return logits


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_few_row_layers_match_the_unfused_model(
    kind: str, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of at most 8 tokens through ``DecoderLayer.forward_few_rows`` (norms, SiLU and
    residual adds inside the matmuls): about as close to the fp32 model as the unfused bf16
    model is; the 17-row step takes the unfused path. Qwen2 has q/k/v biases and a tied head,
    Qwen3 q/k head norms."""
    from gpu.loader import load_model

    folder = tiny_models[kind]
    reference = run_steps(load_model(folder, progress=False, cpu_kernels=False))
    unfused = run_steps(cuda_layout(load_model(folder, dtype=torch.bfloat16, progress=False)))
    model = cuda_layout(load_model(folder, dtype=torch.bfloat16, progress=False))
    assert model.use_triton_gemv(8, fuse_layers=True) == 4 * 2 + 1
    calls: list[tuple[bool, bool, bool]] = []
    real = triton_gemv.gemv

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(
            (kwargs.get("norm") is not None, kwargs.get("silu", False), "add_to" in kwargs)
        )
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_gemv, "gemv", counted)
    fused = run_steps(model)
    # The 17-row prompt step: unfused layers, its 2 logits rows through the plain kernel. Then
    # four decode steps and the 6-row prompt, each of 2 layers: qkv and gate_up normed, o and
    # down added into the residual (down after SiLU), and the normed head.
    per_layer = [(True, False, False), (False, False, True), (True, False, False)]
    per_layer.append((False, True, True))
    assert calls == [(False, False, False)] + (per_layer * 2 + [(True, False, False)]) * 5
    for ref, plain, few in zip(reference[1:], unfused[1:], fused[1:], strict=True):
        scale = float(ref.abs().max())
        plain_err = float((plain - ref).abs().max()) / scale
        few_err = float((few - ref).abs().max()) / scale
        # (measured: 0.7e-2..1.2e-2 against the unfused 0.7e-2..1.1e-2, qwen3 2.3e-2 against
        # 1.5e-2: its q/k norms round in bf16 twice more; a norm, the SiLU or a residual add
        # left out gives errors of order one)
        bound = 3e-2 if kind == "qwen3" else 2e-2
        assert few_err < bound and few_err <= 2 * plain_err, (few_err, plain_err)
    torch.testing.assert_close(fused[0], unfused[0], rtol=2e-2, atol=2e-2)  # layers unfused


def test_few_row_layers_need_every_linear(tiny_llama: Path) -> None:
    from gpu.loader import load_model

    model = load_model(tiny_llama, dtype=torch.bfloat16, progress=False)
    with pytest.raises(ValueError, match="0 of 9 linears are"):
        model.use_triton_gemv(8, fuse_layers=True)
    assert model.few_row_layers == 0


def test_the_executor_s_setting_is_for_one_cuda_device(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from gpu.replica import build_runner

    with pytest.raises(ValueError, match="off, matmuls, layers, not fast"):
        build_runner(tiny_llama, triton_gemv="fast", progress=False)
    runner = build_runner(tiny_llama, num_pages=4, triton_gemv="layers", progress=False)
    assert runner.model.few_row_layers == 0
    assert "--triton-gemv layers runs on one CUDA device only: ignored" in caplog.text


@pytest.mark.parametrize("fuse_layers", [False, True])
def test_warm_up_builds_every_variant_at_every_row_block(
    fuse_layers: bool, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor's warm-up runs each variant a step of up to 8 tokens can launch once per
    row block (1, 2, 4, 8 rows), so no request waits for Triton's compile or tuning."""
    from gpu.engine import Engine, EngineConfig
    from gpu.loader import load_model

    model = cuda_layout(load_model(tiny_models["qwen2"], dtype=torch.bfloat16, progress=False))
    model.use_triton_gemv(8, fuse_layers=fuse_layers)
    calls: list[tuple[int, int, int, bool, bool, bool, bool]] = []
    real = triton_gemv.gemv

    def counted(x: torch.Tensor, w: torch.Tensor, b: Any = None, **kw: Any) -> torch.Tensor:
        variant = (kw.get("norm") is not None, kw.get("silu", False), kw.get("add_to") is not None)
        calls.append((x.shape[0], *w.shape, b is not None, *variant))
        return real(x, w, b, **kw)

    monkeypatch.setattr(triton_gemv, "gemv", counted)
    calls.clear()
    assert model.warm_triton_gemv() == len(calls)
    h, i, v = 64, 128, 512  # tests/models.py's tiny shape; Qwen2: q/k/v biases, tied head
    shapes = [(h + 2 * 32, h, True), (h, h, False), (2 * i, h, False), (h, i, False)]
    shapes.append((v, h, False))
    plain = {(n, k, b, False, False, False) for n, k, b in shapes}
    fused = {(h + 2 * 32, h, True, True, False, False), (h, h, False, False, False, True)}
    fused |= {(2 * i, h, False, True, False, False), (h, i, False, False, True, True)}
    fused.add((v, h, False, True, False, False))
    # with the layers fused, their linears' plain variants are never launched: the head's is
    # (a longer step's logits rows)
    expected = (fused | {(v, h, False, False, False, False)}) if fuse_layers else plain
    assert {c[0] for c in calls} == {1, 2, 4, 8}
    for rows in (1, 2, 4, 8):
        assert sorted(c[1:] for c in calls if c[0] == rows) == sorted(expected)
    engine = Engine(ModelRunner(model, num_pages=16, page_size=4), EngineConfig())
    report = engine.warm_up()
    assert report.triton_s is not None and report.triton_s > 0
    assert "Triton matmul kernels" in report.describe()
    model.use_triton_gemv(0)
    assert model.warm_triton_gemv() == 0
    assert Engine(ModelRunner(model, 16, 4), EngineConfig()).warm_up().triton_s is None


def test_kernels_launch_on_their_tensors_device() -> None:
    """Triton launches on the current device: a replica on cuda:1 makes its device current
    around each launch (on the CPU, under the interpreter, there is nothing to switch)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from gpu.triton_launch import on_device

    assert isinstance(on_device(torch.zeros(1)), nullcontext)
    guard = on_device(SimpleNamespace(device=torch.device("cuda", 1)))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1


def test_layers_on_a_model_that_cannot_take_them_falls_back_with_warnings(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from gpu.loader import load_model
    from gpu.replica import _use_triton_gemv

    quantized = load_model(tiny_llama, progress=False, quantization="int8")
    _use_triton_gemv(quantized, "layers", "int8")
    assert quantized.few_row_layers == 0
    assert "fused few-row layers need every linear dense fp16/bf16" in caplog.text
    assert "running matmuls instead" in caplog.text
    assert "--triton-gemv layers: no fp16/bf16 dense linear (quantization int8)" in caplog.text
    caplog.clear()
    dense = cuda_layout(load_model(tiny_llama, dtype=torch.bfloat16, progress=False))
    _use_triton_gemv(dense, "layers", "none")
    assert dense.few_row_layers == 8 and caplog.text == ""
