"""GGUF blocks on CUDA: the Triton block matmul of ``gpu/triton_blocks.py`` under Triton's
interpreter on the CPU (one fixed block configuration; the device tunes its own) against the
file's rows dequantized by ``gpu.quant`` (held to the ``gguf`` package's values elsewhere),
what it refuses, ``BlockLinear``'s dispatch to it, the warm-up, and a whole mixed-type GGUF
model on it against the dequantized file.

fp16 activations: the interpreter's ``tl.dot`` gives wrong sums for bf16 operands (Triton 3.6);
the kernel is the same for bf16 but for the dtype, which the GPU check runs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpu import triton_blocks, triton_w8a16
from gpu.attention import rope_append
from gpu.linear import BlockLinear, blocks_run_on, warm_triton_linears
from gpu.quant import BLOCK_BYTES, QK, BlockWeight, dequantize_block_rows
from tests.test_gguf_native import gguf_folder  # noqa: F401 (the fixture)

pytestmark = pytest.mark.skipif(not rope_append.available(), reason="needs triton")


@pytest.fixture(autouse=True)
def interpreted() -> Iterator[None]:
    assert os.environ.get("TRITON_INTERPRET") == "1"  # (tests/conftest.py turned it on)
    kernels = (triton_blocks._kernel, triton_blocks._gemv_kernel, triton_w8a16._kernel)
    for kernel in kernels:
        kernel.cache_clear()
    yield
    for kernel in kernels:
        kernel.cache_clear()


def random_blocks(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Rows of random blocks: random codes, and scales (and minimums) of random fp16 values,
    so every byte of the format is exercised, not only what one quantizer writes."""
    gen = torch.Generator().manual_seed(seed)
    nb = -(-k // QK)
    rows = torch.randint(0, 256, (n, nb, BLOCK_BYTES[qtype]), generator=gen, dtype=torch.uint8)
    heads = 2 if qtype == "Q4_1" else 1
    scales = (torch.randn((n, nb, heads), generator=gen) * 0.05).to(torch.float16)
    rows[..., : 2 * heads] = scales.view(torch.uint8)
    return rows.reshape(n, -1)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 40, 96), (5, 33, 64), (3, 24, 70), (8, 24, 200), (17, 24, 70), (40, 64, 200)],
)
def test_block_matmul_is_the_dequantized_linear(qtype: str, m: int, n: int, k: int) -> None:
    """Shapes that are no multiple of a tile (K not even a multiple of a block: the padded
    weights meet zero activations); the bias on odd shapes."""
    rows = random_blocks(qtype, n, k, m + n + k)
    gen = torch.Generator().manual_seed(m * k)
    x = torch.randn((m, k), generator=gen).half()
    bias = torch.randn(n, generator=gen) if m % 2 else None
    y = triton_blocks.block_matmul(x, rows, qtype, bias)
    assert y.shape == (m, n) and y.dtype == torch.float16
    want = F.linear(
        x.double(),
        dequantize_block_rows(qtype, rows, k).double(),
        None if bias is None else bias.double(),
    )
    # up to 8 rows (the matrix-vector kernel) fp32 weights, more the GEMM's weights rounded
    # to fp16 once; then fp32 sums and one fp16 rounding
    assert rel_err(y, want) < 3e-3


def test_block_matmul_refuses_what_it_cannot_run() -> None:
    rows = random_blocks("Q4_1", 24, 64, 0)
    x = torch.randn((3, 64)).half()
    with pytest.raises(ValueError, match="runs Q4_0, Q4_1, Q8_0, got Q6_K"):
        triton_blocks.block_matmul(x, rows, "Q6_K")
    with pytest.raises(ValueError, match="fp16/bf16 rows and uint8 blocks"):
        triton_blocks.block_matmul(x.float(), rows, "Q4_1")
    with pytest.raises(ValueError, match="rows of 40 bytes do not hold the 96 inputs"):
        triton_blocks.block_matmul(torch.randn((3, 96)).half(), rows, "Q4_1")
    with pytest.raises(ValueError, match="the bias must be a contiguous \\[24\\]"):
        triton_blocks.block_matmul(x, rows, "Q4_1", torch.zeros(23))
    with pytest.raises(ValueError, match="unit stride"):
        triton_blocks.block_matmul(x.t().contiguous().t(), rows, "Q4_1")


def test_blocks_stay_blocks_where_a_kernel_runs_them() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert blocks_run_on(cpu, torch.float32) and not blocks_run_on(cpu, torch.bfloat16)
    assert blocks_run_on(cuda, torch.bfloat16) and blocks_run_on(cuda, torch.float16)
    assert not blocks_run_on(cuda, torch.float32)
    assert not blocks_run_on(torch.device("meta"), torch.bfloat16)


@pytest.mark.parametrize("rows_in_step", [1, 9, 40])
def test_block_linear_on_cuda_runs_the_block_matmul(
    rows_in_step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight = BlockWeight("Q4_0", random_blocks("Q4_0", 48, 64, rows_in_step), 64)
    bias = torch.randn(48)
    layer = BlockLinear(weight, bias)
    assert not layer.triton  # on the CPU: the reference (block-quantized activations)
    x = torch.randn((rows_in_step, 1, 64)).half()
    want = F.linear(x.double(), layer.dequantized_weight().double(), bias.double())
    assert rel_err(layer(x), want) > 1e-3  # the activations' blocks
    launched: list[int] = []
    real = triton_blocks.block_matmul

    def counted(x2: torch.Tensor, *args: object) -> torch.Tensor:
        launched.append(x2.shape[0])
        return real(x2, *args)  # type: ignore[arg-type]

    monkeypatch.setattr("gpu.linear.block_matmul", counted)
    layer.triton = True
    y = layer(x)
    assert launched == [rows_in_step] and y.shape == (rows_in_step, 1, 48)
    assert rel_err(y, want) < 3e-3


def test_warm_up_runs_every_bucket_of_each_block_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = [
        BlockLinear(BlockWeight(q, random_blocks(q, 48, 64, i), 64), b)
        for i, (q, b) in enumerate(
            [("Q4_0", None), ("Q4_0", None), ("Q4_1", None), ("Q4_1", torch.zeros(48))]
        )
    ]
    assert warm_triton_linears(layers, 40, torch.float16) == 0  # CPU layers
    for layer in layers:
        layer.triton = True
    seen: list[tuple[int, str, bool]] = []

    def forward(self: BlockLinear, x: torch.Tensor) -> torch.Tensor:
        seen.append((x.shape[0], self.qtype, self.bias is not None))
        return x.new_zeros((x.shape[0], self.out_features))

    monkeypatch.setattr(BlockLinear, "forward", forward)
    # the matrix-vector kernel's row blocks, then the GEMM's buckets 16, 32, 64 (40: the last)
    assert warm_triton_linears(layers, 40, torch.float16) == 3 * 7
    assert sorted({s[0] for s in seen}) == [1, 2, 4, 8, 16, 32, 40]
    assert {s[1:] for s in seen} == {("Q4_0", False), ("Q4_1", False), ("Q4_1", True)}
    seen.clear()
    assert warm_triton_linears(layers, 1, torch.float16) == 3 and {s[0] for s in seen} == {1}
    seen.clear()
    assert warm_triton_linears(layers, 12, torch.float16) == 3 * 5  # 1, 2, 4, 8 and 12


def test_a_gguf_model_on_the_block_matmul_tracks_the_dequantized_file(
    gguf_folder: Path,  # noqa: F811 (the fixture)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The mixed-type tiny GGUF (Q4_0, Q4_1, Q8_0, a tied Q8_0 head, an F16 tensor) kept in
    blocks as CUDA keeps it, in fp16 on the block matmul, against the file dequantized in
    fp32: a prompt of 12 tokens and one of 3."""
    from gpu.loader import load_model
    from gpu.runner import ModelRunner
    from tests.test_quant import greedy_positions

    monkeypatch.setattr("gpu.model.blocks_run_on", lambda device, dtype: True)
    model = load_model(
        gguf_folder, progress=False, quantization="gguf", dtype=torch.float16, cpu_kernels=False
    )
    blocks = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert {m.qtype for m in blocks} == {"Q4_0", "Q4_1", "Q8_0"}
    for module in blocks:
        module.triton = True
    ref_model = load_model(gguf_folder, progress=False, quantization="none", cpu_kernels=False)
    for prompt in ([(17 * i + 5) % 400 for i in range(12)], [3, 250, 399]):
        got = greedy_positions(ModelRunner(model, 16, 16), prompt).double()
        want = greedy_positions(ModelRunner(ref_model, 16, 16), prompt).double()
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
        assert rel_err(got, want) < 2e-2


def test_what_stays_blocks_on_which_device() -> None:
    """Blocks stay blocks where a kernel runs them; an untied embedding in blocks is read by
    rows only, so off the CPU it is dequantized to the model's dtype like any vector table."""
    from gpu.config import ModelConfig
    from gpu.model import EMBEDDING, stays_blocks

    def config(tied: bool) -> ModelConfig:
        return ModelConfig(
            model_type="llama", vocab_size=4, hidden_size=64, intermediate_size=128,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=64, tie_word_embeddings=tied,
        )  # fmt: skip

    blocks = BlockWeight("Q8_0", random_blocks("Q8_0", 4, 64, 0), 64)
    tied, untied = config(True), config(False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    bf16, fp32 = torch.bfloat16, torch.float32
    layer = "model.layers.0.mlp.down_proj.weight"
    assert stays_blocks(layer, blocks, cuda, bf16, untied)
    assert stays_blocks(EMBEDDING, blocks, cuda, bf16, tied)  # the LM head's weight too
    assert not stays_blocks(EMBEDDING, blocks, cuda, bf16, untied)
    assert stays_blocks(EMBEDDING, blocks, cpu, fp32, untied)  # the CPU reads rows of blocks
    assert not stays_blocks(layer, blocks, cuda, fp32, untied)  # no kernel: dequantized
    assert not stays_blocks(layer, blocks, cpu, bf16, untied)
    assert not stays_blocks(layer, torch.zeros(4, 64), cuda, bf16, untied)


def test_block_matmul_of_no_rows() -> None:
    rows = random_blocks("Q4_1", 24, 64, 0)
    y = triton_blocks.block_matmul(torch.zeros((0, 64), dtype=torch.float16), rows, "Q4_1")
    assert y.shape == (0, 24) and y.dtype == torch.float16
