"""The block kernels (GGUF Q4_0 / Q4_1 / Q8_0, and int8 rows) against the ``gguf`` package.

The reference of a kernel's output is the ``gguf`` package's dequantized weight times the
activations as the kernel quantizes them (``gpu.quant.fake_quantize_blocks``), in float64: the
kernel must match it within fp32 rounding. Random blocks, then the real SmolLM2 tensors.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from gpu import cpu_kernels
from gpu.config import ModelError
from gpu.cpu_kernels.prepared import (
    LIN_INT8,
    LIN_Q4_0,
    LIN_Q4_0X8,
    LIN_Q4_1,
    LIN_Q4_1X8,
    LIN_Q8_0,
    LIN_Q8_0X8,
)
from gpu.quant import (
    BLOCK_BYTES,
    dequantize_block_rows,
    fake_quantize_blocks,
    pad_int8_blocks,
    quantize_int8,
    quantize_q4_1,
    repack_x8,
    unpack_x8,
    x8_row_index,
)

KERNELS = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(
    KERNELS is None, reason="CPU kernels need AVX2/FMA and a C compiler"
)
KINDS = {"Q4_0": LIN_Q4_0, "Q4_1": LIN_Q4_1, "Q8_0": LIN_Q8_0}
GROUPED = {"Q4_0": LIN_Q4_0X8, "Q4_1": LIN_Q4_1X8, "Q8_0": LIN_Q8_0X8}


def run_both_layouts(qtype: str, x: torch.Tensor, rows: torch.Tensor, bias=None):
    """The kernel on the file's rows and on their repacked groups of 8 (what layers hold)."""
    n = rows.shape[0]
    grouped = repack_x8(qtype, rows)
    assert torch.equal(unpack_x8(qtype, grouped, n), rows)
    k = kernels()
    return (
        k.block_linear(KINDS[qtype], x, rows, n, None, bias),
        k.block_linear(GROUPED[qtype], x, grouped, n, None, bias),
    )


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_row_gathered_from_its_group_is_the_files_row(qtype):
    """x8_row_index (an embedding row read from a tied head's groups) gives each row's file
    bytes, for every row of a weight whose last group is padded."""
    g = torch.Generator().manual_seed(11)
    rows = gguf_blocks(torch.randn(21, 96, generator=g) * 0.05, qtype)[0]
    grouped = repack_x8(qtype, rows)
    ids = torch.tensor([20, 0, 7, 8, 13, 20])
    index = x8_row_index(qtype, rows.shape[1] // BLOCK_BYTES[qtype])
    assert torch.equal(grouped[ids // 8].gather(1, index[ids % 8]), rows[ids])


def kernels() -> cpu_kernels.CpuKernels:
    assert KERNELS is not None
    return KERNELS


def gguf_blocks(w: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of blocks ``uint8 [N, bytes]``, the gguf package's dequantization ``[N, K]``)."""
    t = getattr(GGMLQuantizationType, qtype)
    raw = gguf.quants.quantize(w.numpy(), t)
    ref = torch.from_numpy(np.array(gguf.quants.dequantize(raw, t), dtype=np.float32))
    return torch.from_numpy(raw.copy()).view(torch.uint8).reshape(w.shape[0], -1), ref


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = fake_quantize_blocks(x).double() @ w.double().t()
    return (y if bias is None else y + bias.double()).float()


def assert_rounding_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 accumulation over K (<= 1536) of products that are exact: ~1e-6 of the scale."""
    scale = float(ref.abs().max())
    assert float((y - ref).abs().max()) <= 2e-6 * scale + 1e-7, float((y - ref).abs().max())


@needs_kernels
@pytest.mark.parametrize("qtype", list(KINDS))
@pytest.mark.parametrize("shape", [(70, 576), (8, 32), (33, 1536)])
@pytest.mark.parametrize("m", [1, 4, 5, 70])
def test_block_kernel_matches_gguf_dequantized(qtype, shape, m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(*shape, generator=g) * 0.05
    blocks, ref_w = gguf_blocks(w, qtype)
    # our torch dequantization (embedding rows, references) is the gguf package's, bit for bit
    assert torch.equal(dequantize_block_rows(qtype, blocks, shape[1]), ref_w)
    x, bias = torch.randn(m, shape[1], generator=g), torch.randn(shape[0], generator=g)
    for y in run_both_layouts(qtype, x, blocks, bias):
        assert_rounding_close(y, reference(x, ref_w, bias))


@needs_kernels
def test_random_bytes_blocks_any_codes():
    """Blocks straight from random bytes (every code, extreme scales within fp16)."""
    g = torch.Generator().manual_seed(7)
    n, k = 24, 256
    for qtype, size in (("Q4_0", 18), ("Q4_1", 20), ("Q8_0", 34)):
        raw = torch.randint(0, 256, (n, k // 32, size), generator=g, dtype=torch.uint8)
        scales = (torch.rand(n, k // 32, 2, generator=g) * 0.1 - 0.05).to(torch.float16)
        raw[..., :2] = scales[..., :1].view(torch.uint8)
        if qtype == "Q4_1":
            raw[..., 2:4] = scales[..., 1:].view(torch.uint8)
        if qtype == "Q8_0":  # ggml's quantizer never writes -128; its dequantizer reads it
            codes = raw[..., 2:].view(torch.int8)
            codes.clamp_(-127, 127)
        rows = raw.reshape(n, -1).contiguous()
        t = getattr(GGMLQuantizationType, qtype)
        ref_w = torch.from_numpy(np.array(gguf.quants.dequantize(rows.numpy(), t), np.float32))
        x = torch.randn(3, k, generator=g) * 10
        for y in run_both_layouts(qtype, x, rows):
            assert_rounding_close(y, reference(x, ref_w))


@needs_kernels
def test_activation_quantization_is_the_torch_one():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 70, generator=g) * 3
    x[2] = 0.0  # an all-zero block: scale 0, codes 0
    x[3, :32] = torch.linspace(-2.5, 2.5, 32)  # exact halves round to even
    codes, d, s = kernels().quantize_x(x)
    got = (codes.float() * d[..., None]).view(6, -1)[:, :70]
    assert torch.equal(got, fake_quantize_blocks(x))
    assert torch.equal(s, d * codes.float().sum(-1))
    assert codes.abs().max() <= 127


@needs_kernels
@pytest.mark.parametrize(
    "kind", [LIN_Q4_0, LIN_Q4_1, LIN_Q8_0, LIN_INT8, LIN_Q4_0X8, LIN_Q4_1X8, LIN_Q8_0X8]
)
def test_rows_do_not_depend_on_batch_split_or_isa(kind):
    """The bits of a row: the same alone, in a batch, and on the AVX2 and VNNI paths."""
    g = torch.Generator().manual_seed(kind)
    w = torch.randn(130, 96, generator=g) * 0.05
    if kind == LIN_INT8:
        q, scale = quantize_int8(w)
        rows, sc = pad_int8_blocks(q), scale
    else:
        qtype = {v: q for q, v in (*KINDS.items(), *GROUPED.items())}[kind]
        rows, sc = gguf_blocks(w, qtype)[0], None
        if kind in GROUPED.values():
            rows = repack_x8(qtype, rows)
    x = torch.randn(41, 96, generator=g)
    k = kernels()
    full = k.block_linear(kind, x, rows, 130, sc)
    for part in (slice(0, 1), slice(5, 6), slice(3, 20), slice(37, 41)):
        assert torch.equal(k.block_linear(kind, x[part], rows, 130, sc), full[part])
    had_vnni = k.vnni()
    try:
        k.vnni(False)
        assert not k.vnni()
        assert torch.equal(k.block_linear(kind, x, rows, 130, sc), full)
    finally:
        k.vnni(had_vnni)


def test_int4_is_q4_1_within_half_a_step():
    """int4 quantizes any weight into Q4_1 blocks: each weight within half a step (plus the
    fp16 rounding of the block's scale and minimum) of its value; gguf reads our blocks."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 100, generator=g) * 0.05  # K not a multiple of 32: the tail is padded
    rows = quantize_q4_1(w)
    assert rows.shape == (40, 4 * 20) and rows.dtype == torch.uint8
    deq = dequantize_block_rows("Q4_1", rows, 100)
    blocks = torch.nn.functional.pad(w, (0, 28)).view(40, 4, 32)
    step = ((blocks.amax(-1) - blocks.amin(-1)) / 15).repeat_interleave(32, 1)[:, :100]
    assert ((deq - w).abs() <= step * 0.5 * 1.01 + 1e-4).all()
    via_gguf = gguf.quants.dequantize(rows.numpy(), GGMLQuantizationType.Q4_1)
    assert torch.equal(torch.from_numpy(np.array(via_gguf, np.float32))[:, :100], deq)


def test_unsupported_block_type_is_named():
    rows = torch.zeros(2, 144, dtype=torch.uint8)
    with pytest.raises(ModelError, match="no block kernel for GGUF type Q4_K"):
        dequantize_block_rows("Q4_K", rows, 256)


@needs_kernels
def test_real_smollm2_tensors_match_gguf():
    """Every native tensor type of the default model's file, on real weights: a Q4_1 layer
    of each shape and the Q8_0 embedding (the tied LM head)."""
    from gpu.gguf import default_gguf_path
    from gpu.gguf.reader import read_gguf

    try:
        path = default_gguf_path()
    except ModelError as exc:
        pytest.skip(str(exc))
    tensors = {t.name: t for t in read_gguf(path).tensors}
    g = torch.Generator().manual_seed(11)
    names = ["blk.3.attn_q.weight", "blk.3.attn_k.weight", "blk.7.ffn_down.weight"]
    names += ["blk.12.ffn_up.weight", "token_embd.weight"]
    for name in names:
        t = tensors[name]
        k, n = int(t.shape[0]), int(t.shape[1])
        rows = torch.from_numpy(np.array(t.data)).reshape(n, -1)
        values = np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        ref_w = torch.from_numpy(values).reshape(n, k)
        assert t.tensor_type.name in KINDS
        x = torch.randn(3, k, generator=g)
        for y in run_both_layouts(t.tensor_type.name, x, rows):
            assert_rounding_close(y, reference(x, ref_w))
