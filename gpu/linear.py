"""One linear-layer interface; weight formats plug in behind it.

The model only calls ``Linear.forward`` (``y = x @ W.T + b``); how the weight is stored is
the layer's business, chosen once at load time by :func:`make_linear`:

- fp32 / bf16 (``DenseLinear``): on CPU the fp32 kernel of ``gpu.cpu_kernels`` over 8-row
  blocks (else ``x @ W_t`` with ``W_t`` ``[K, N]``); ``F.linear`` on CUDA.
- int8 (``Int8Linear``): int8 ``[N, K]`` + one fp32 scale per output channel. CPU: W8A8, the
  activations quantized per block of 32 to int8 and an integer multiply-add (the block kernel
  of ``gpu.cpu_kernels``; without it, the same math in torch); CUDA: weight-only (W8A16), the
  codes read as stored and widened in registers by Triton kernels (``gpu.triton_gemv`` for a
  few rows, ``gpu.triton_w8a16`` for more), else dequantize + matmul. Activations per token
  to int8 and one ``torch._int_mm`` (``int8_int_mm``, ``Int8Linear.use_int_mm``) is kept for
  the GPU check to time against: one scale a row lost too much (``gpu.triton_w8a16``).
- GGUF blocks (``BlockLinear``): Q4_0 / Q4_1 / Q8_0 rows of 32-weight blocks, as the file has
  them (``gguf``), or quantized to Q4_1 at load (``int4``); activations quantized per block to
  int8 as for int8. On CUDA the file's rows go to the Triton block matmul
  (``gpu.triton_blocks``, activations unquantized); without either kernel they dequantize at
  load.
- fp8 (``Fp8Linear``): e4m3 ``[N, K]`` + one fp32 scale per output channel, activations cast
  to e4m3 per token, ``torch._scaled_mm`` with row-wise scales (Ada/Hopper tensor cores; torch
  also runs it on CPU, slowly: tests and quality reports).

Every format keeps each output row a function of its own input row only (no per-batch
activation scales), so a request's output does not depend on what shares its batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gpu.attention.rope_append import available as triton_available
from gpu.config import ModelError
from gpu.cpu_kernels import CpuKernels, PackedLinear
from gpu.cpu_kernels.prepared import (
    LIN_F32,
    LIN_INT8,
    LIN_Q4_0,
    LIN_Q4_0X8,
    LIN_Q4_1,
    LIN_Q4_1X8,
    LIN_Q8_0,
    LIN_Q8_0X8,
    QK,
)
from gpu.formats import check_quantization
from gpu.quant import (
    BlockWeight,
    dequantize_block_rows,
    fake_quantize_blocks,
    fp8_matmul_supported,
    pack_row_blocks,
    pad_int8_blocks,
    quantize_fp8,
    quantize_fp8_rows,
    quantize_int8,
    quantize_int8_rows,
    quantize_q4_1,
    quantize_q8_0,
    repack_x8,
    unpack_row_blocks,
    unpack_x8,
    x8_row_index,
)
from gpu.triton_blocks import QTYPES as BLOCK_QTYPES
from gpu.triton_blocks import block_matmul
from gpu.triton_gemv import MAX_ROWS as GEMV_MAX_ROWS
from gpu.triton_gemv import gemv, row_blocks
from gpu.triton_w8a16 import DTYPES as W8A16_DTYPES
from gpu.triton_w8a16 import row_buckets, w8a16_matmul

# GGML type name -> the kernels' linear kind (as the file lays it out; 4-bit repacked).
BLOCK_KINDS = {"Q4_0": LIN_Q4_0, "Q4_1": LIN_Q4_1, "Q8_0": LIN_Q8_0}
GROUPED_KINDS = {"Q4_0": LIN_Q4_0X8, "Q4_1": LIN_Q4_1X8, "Q8_0": LIN_Q8_0X8}

logger = logging.getLogger(__name__)


class Linear(nn.Module):
    """The interface: ``forward(x [..., K]) -> [..., N]``, plus what reports and tests read."""

    format = "abstract"

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    def weight_bytes(self) -> int:
        """Bytes read from memory per forward pass for the weight (and its scales)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def dequantized_weight(self) -> torch.Tensor:
        """The weight this layer effectively multiplies by, ``[N, K]`` fp32."""
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight, ``[len(ids), K]`` fp32: a tied embedding
        reads its vectors here, so the table lives in one form only (the LM head's)."""
        return self.dequantized_weight()[ids]

    bias: torch.Tensor | None
    kernels: CpuKernels | None = None
    kind = LIN_F32
    _prepared: PackedLinear | None = None

    def packed(self) -> PackedLinear | None:
        """The prepared CPU kernel call for fp32 inputs, where this layer has one (re-made if
        a ``.to()`` or state-dict load replaced the tensors it points at)."""
        if self.kernels is None:
            return None
        weight, scale = self.kernel_operands()
        self._prepared = _packed(
            self.kernels, self._prepared, self.kind, weight, self.out_features, self.in_features,
            scale, self.bias,
        )  # fmt: skip
        return self._prepared

    def kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed weight and per-row scale (None: fp32) the CPU kernel multiplies by."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.format}"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls ~120 linears: skip nn.Module's hook dispatch (~2 us each; the
        # runtime registers no hooks).
        return self.forward(x)


def _packed(
    kernels: CpuKernels,
    prepared: PackedLinear | None,
    kind: int,
    weight: torch.Tensor,
    n: int,
    k: int,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> PackedLinear:
    """``prepared`` while it still holds these very tensors (a ``.to()`` or state-dict load
    replaces them), else a fresh one."""
    if prepared is not None and prepared.weight is weight and prepared.bias is bias:
        return prepared
    return kernels.packed_linear(kind, weight, n, k, scale, bias)


class DenseLinear(Linear):
    """fp32/bf16 weight, stored in the layout its matmul streams fastest:

    - ``packed`` (fp32 on CPU with ``kernels``): 8-row blocks for ``CpuKernels.f32_linear``,
      ~1.6x MKL's GEMV bandwidth at batch 1 here, and the same bits for a row whatever the batch;
    - ``kn`` (other CPU cases): ``[K, N]`` for ``x @ W_t`` (MKL streams that layout ~2x faster
      than ``F.linear``'s ``[N, K]`` at batch 1);
    - ``nk`` (CUDA): ``[N, K]`` for ``F.linear`` (cuBLAS).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        kernels: CpuKernels | None = None,
    ) -> None:
        super().__init__(int(weight.shape[1]), int(weight.shape[0]))
        self.format = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(weight.dtype, "dense")
        cpu = weight.device.type == "cpu"
        self.kernels = kernels if cpu and weight.dtype == torch.float32 else None
        if self.kernels is not None:
            self.layout, stored = "packed", pack_row_blocks(weight)
        elif cpu:
            self.layout, stored = "kn", weight.t().contiguous()
        else:
            self.layout, stored = "nk", weight.contiguous()
        self.register_buffer("weight", stored)
        self.register_buffer("bias", bias)
        self._prepared: PackedLinear | None = None
        # Steps of at most this many rows take the Triton matrix-vector kernel (CUDA, fp16/bf16;
        # ``CausalLM.use_triton_gemv``); 0: cuBLAS for every step.
        self.triton_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "nk":
            if 0 < x.shape[0] <= self.triton_rows and x.dim() == 2:
                from gpu.triton_gemv import gemv

                return gemv(x, self.weight, self.bias)
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features)
        prepared = self.packed()
        if prepared is not None and x2.dtype == torch.float32:
            y = prepared(x2)
        elif self.layout == "packed":
            y = F.linear(x2, self.dequantized_weight().to(x2.dtype), self.bias)
        elif self.bias is None:
            y = torch.mm(x2, self.weight)
        else:
            y = torch.addmm(self.bias, x2, self.weight)
        return y.view(*x.shape[:-1], self.out_features)

    def kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight, None

    def dequantized_weight(self) -> torch.Tensor:
        if self.layout == "packed":
            return unpack_row_blocks(self.weight, self.out_features, self.in_features)
        w = self.weight.t() if self.layout == "kn" else self.weight
        return w.to(torch.float32)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.layout == "packed":  # [N/8, K/8, 8, 8]: row n is [n // 8, :, n % 8, :]
            picked = self.weight[ids // 8, :, ids % 8, :]
            return picked.reshape(ids.shape[0], -1)[:, : self.in_features]
        if self.layout == "kn":
            return self.weight[:, ids].t().to(torch.float32)
        return self.weight[ids]


# torch._int_mm's shape rules on CUDA (aten/src/ATen/native/cuda/Blas.cpp, _int_mm_out_cuda):
# A [M, K] and B [K, N] int8, M > 16, K and N positive multiples of 8; the result is int32.
INT_MM_MIN_ROWS = 17
INT_MM_ALIGN = 8


def int_mm_fits(n: int, k: int) -> bool:
    """Whether a ``[N, K]`` int8 weight meets ``torch._int_mm``'s K and N rules."""
    return n > 0 and k > 0 and n % INT_MM_ALIGN == 0 and k % INT_MM_ALIGN == 0


def int8_int_mm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8: ``x`` ``[M, K]`` quantized per row to int8, times the int8 weight ``[N, K]`` in
    one ``torch._int_mm`` (exact int32 sums), rescaled by the row's and the channel's scales;
    fp32 ``[M, N]``. Fewer than ``INT_MM_MIN_ROWS`` rows are padded with zero rows (a decode
    step's batch) and cut off again: each row's result depends on that row only."""
    m = x.shape[0]
    xq, x_scale = quantize_int8_rows(x)
    if m < INT_MM_MIN_ROWS:
        xq = F.pad(xq, (0, 0, 0, INT_MM_MIN_ROWS - m))
    acc = torch._int_mm(xq, qweight.t())[:m]
    return acc.to(torch.float32) * x_scale * scale.view(1, -1)


class Int8Linear(Linear):
    """int8, one fp32 scale per output channel (see ``gpu.quant.quantize_int8``): W8A8 on CPU
    (activations quantized per block of 32), weight-only on CUDA (``cuda_kernel``)."""

    format = "int8"
    kind = LIN_INT8
    qweight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        kernels: CpuKernels | None = None,
        row_amax: torch.Tensor | None = None,
    ) -> None:
        super().__init__(int(weight.shape[1]), int(weight.shape[0]))
        q, scale = quantize_int8(weight, row_amax)
        device = weight.device
        self.kernels = kernels if device.type == "cpu" else None
        # The CPU kernel reads rows padded to whole blocks of 32; everything else [N, K].
        self.register_buffer("qweight", q if self.kernels is None else pad_int8_blocks(q))
        self.w8a8 = device.type == "cpu"
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.to(torch.float32))
        # CUDA: "w8a16" (Triton, fp16/bf16 activations), "w8a8" (use_int_mm), or None: the
        # reference below (dequantize, then a dense matmul). Tests set it on CPU tensors to run
        # the Triton kernels under the interpreter.
        self.cuda_kernel: str | None = None
        if device.type == "cuda" and triton_available():
            self.cuda_kernel = "w8a16"
        self._prepared: PackedLinear | None = None

    def use_int_mm(self) -> bool:
        """W8A8 on int8 tensor cores (activations per token, ``int8_int_mm``) instead of
        weight-only, where ``torch._int_mm``'s shape rules allow it; the GPU check's
        comparison. Returns whether this layer switched."""
        if self.qweight.device.type == "cuda" and int_mm_fits(*self.qweight.shape):
            self.cuda_kernel = "w8a8"
            return True
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        prepared = self.packed()
        if prepared is not None and x2.dtype == torch.float32:
            y = prepared(x2)
        elif self.cuda_kernel == "w8a16" and x2.dtype in W8A16_DTYPES:
            x2 = x2.contiguous()
            q = self.int8_weight()
            if 0 < x2.shape[0] <= GEMV_MAX_ROWS:
                y = gemv(x2, q, self.bias, scale=self.scale)
            else:
                y = w8a16_matmul(x2, q, self.scale, self.bias)
        elif self.cuda_kernel == "w8a8":
            y = int8_int_mm(x2, self.qweight, self.scale)
            if self.bias is not None:
                y = y + self.bias
            y = y.to(x.dtype)
        else:  # reference: dequantize, then a dense matmul (on CPU of W8A8's activations)
            xa = fake_quantize_blocks(x2).to(x2.dtype) if self.w8a8 else x2
            y = F.linear(xa, self.int8_weight().to(x2.dtype)) * self.scale.to(x2.dtype)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.qweight, self.scale

    def int8_weight(self) -> torch.Tensor:
        """The int8 codes ``[N, K]``."""
        if self.kernels is None:
            return self.qweight
        return self.qweight[:, : self.in_features]

    def dequantized_weight(self) -> torch.Tensor:
        return self.int8_weight().to(torch.float32) * self.scale[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.int8_weight()[ids].to(torch.float32) * self.scale[ids, None]


def blocks_run_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether GGUF blocks stay blocks on ``device`` for activations of ``dtype``: the CPU's
    own kernels (fp32), or the Triton block matmul on CUDA (fp16/bf16); elsewhere they are
    dequantized at load."""
    if device.type == "cpu":
        return dtype == torch.float32
    return device.type == "cuda" and dtype in W8A16_DTYPES and triton_available()


def warm_triton_linears(modules: Iterable[nn.Module], max_rows: int, dtype: torch.dtype) -> int:
    """Run each Triton matmul variant the model's quantized CUDA linears can launch in a step
    of up to ``max_rows`` rows (the matrix-vector kernels at each row block up to 8, the
    int8 W8A16 or block GEMM at each tuning bucket above), on
    zeros: compiled and tuned before the first request or a CUDA graph's capture needs them
    (the warm-up); ``dtype``: the activations'. Returns how many calls it made."""
    variants: dict[tuple[str, int, int, bool], Int8Linear | BlockLinear] = {}
    for module in modules:
        if isinstance(module, Int8Linear) and module.cuda_kernel == "w8a16":
            kind = "int8"
        elif isinstance(module, BlockLinear) and module.triton:
            kind = module.qtype
        else:
            continue
        key = (kind, module.out_features, module.in_features, module.bias is not None)
        variants.setdefault(key, module)
    if max_rows < 1 or dtype not in W8A16_DTYPES:  # (other dtypes dequantize: nothing to build)
        return 0
    # The matrix-vector kernels are compiled per power-of-two row block, the GEMMs tuned per
    # bucket (a bucket's last row count stands for it).
    buckets = {min(b, max_rows) for b in row_buckets(max_rows)}
    few = row_blocks(min(max_rows, GEMV_MAX_ROWS))
    calls = 0
    for (_, _, k, _), linear in variants.items():
        for m in sorted({*few, *(m for m in buckets if m > GEMV_MAX_ROWS)}):
            linear(torch.zeros((m, k), dtype=dtype, device=linear.device))
            calls += 1
    return calls


class BlockLinear(Linear):
    """A weight in GGUF blocks of 32 (Q4_0, Q4_1, Q8_0: ``gpu.quant.BlockWeight``) on the CPU
    block kernels, activations quantized per block to int8; on CUDA through the Triton block
    matmul (``gpu.triton_blocks``: the file's rows as they are, activations unquantized).
    ``format`` is ``gguf-<type>`` for a file's own blocks, ``int4`` for weights quantized to
    Q4_1 at load. Without either (a reference for tests) it multiplies the dequantized weight
    by the block-quantized activations."""

    blocks: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: BlockWeight,
        bias: torch.Tensor | None = None,
        kernels: CpuKernels | None = None,
        fmt: str | None = None,
    ) -> None:
        n, k = weight.shape
        super().__init__(k, n)
        self.qtype = weight.qtype
        self.format = fmt or f"gguf-{weight.qtype.lower()}"
        self.kernels = kernels
        # 4-bit blocks are repacked once for the kernel (groups of 8 rows; same size), and
        # held only so: the file's layout comes back from them on demand (unpack_x8).
        self.grouped = kernels is not None and weight.qtype in GROUPED_KINDS
        if self.grouped:
            self.kind = GROUPED_KINDS[weight.qtype]
            stored = repack_x8(weight.qtype, weight.rows)
        else:
            self.kind = BLOCK_KINDS[weight.qtype]
            stored = weight.rows.contiguous()
        self.register_buffer("blocks", stored)
        self.register_buffer("bias", None if bias is None else bias.to(torch.float32))
        self._prepared: PackedLinear | None = None
        # CUDA: the Triton block matmul for fp16/bf16 activations (tests set it on CPU tensors
        # to run it under the interpreter).
        self.triton = (
            stored.device.type == "cuda" and not self.grouped and weight.qtype in BLOCK_QTYPES
            and triton_available()
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        prepared = self.packed()
        if prepared is not None and x2.dtype == torch.float32:
            y = prepared(x2)
        elif self.triton and x2.dtype in W8A16_DTYPES:
            y = block_matmul(x2.contiguous(), self.blocks, self.qtype, self.bias)
        else:
            y = F.linear(fake_quantize_blocks(x2), self.dequantized_weight(), self.bias)
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.blocks, None

    def block_rows(self) -> torch.Tensor:
        """The weight as GGUF rows of blocks ``uint8 [N, nb * bytes]`` (the file's layout)."""
        if self.grouped:
            return unpack_x8(self.qtype, self.blocks, self.out_features)
        return self.blocks

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_block_rows(self.qtype, self.block_rows(), self.in_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.grouped:  # each row's bytes gathered from its group of 8
            index = x8_row_index(self.qtype, -(-self.in_features // QK))
            rows = self.blocks[ids // 8].gather(1, index[ids % 8])
            return dequantize_block_rows(self.qtype, rows, self.in_features)
        return dequantize_block_rows(self.qtype, self.blocks[ids], self.in_features)


class Fp8Linear(Linear):
    """e4m3 weight with per-output-channel scales; activations quantized to e4m3 per token, then
    one ``torch._scaled_mm`` with row-wise scales (fp32 accumulation)."""

    format = "fp8"
    qweight: torch.Tensor
    scale: torch.Tensor  # [1, N]
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        row_amax: torch.Tensor | None = None,
    ) -> None:
        super().__init__(int(weight.shape[1]), int(weight.shape[0]))
        q, scale = quantize_fp8(weight, row_amax)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.view(1, -1).contiguous())
        self.register_buffer("bias", bias)
        # cuBLASLt's fp8 GEMM needs K and N in multiples of 16; other shapes dequantize.
        self.scaled_mm = q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        xq, x_scale = quantize_fp8_rows(x2)
        # Row-wise scaling on CUDA produces bf16; on CPU fp32 is allowed (and exact). The bias
        # is added in the GEMM's epilogue where it has the output's dtype.
        cuda = x2.device.type == "cuda"
        out_dtype = torch.bfloat16 if cuda else torch.float32
        bias = self.bias
        fused_bias = bias if bias is not None and bias.dtype == out_dtype else None
        if self.scaled_mm:
            # Hopper's fast accumulation (CUTLASS's row-wise kernel): fp32 partial sums promoted
            # less often; what vLLM's fp8 GEMMs use.
            y = torch._scaled_mm(
                xq, self.qweight.t(), scale_a=x_scale, scale_b=self.scale, bias=fused_bias,
                out_dtype=out_dtype, use_fast_accum=cuda,
            )  # fmt: skip
        else:
            y = (xq.to(torch.float32) @ self.qweight.to(torch.float32).t()) * x_scale * self.scale
            fused_bias = None
        y = y.to(x.dtype)
        if bias is not None and fused_bias is None:
            y = y + bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.to(torch.float32) * self.scale.view(-1, 1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].to(torch.float32) * self.scale.view(-1)[ids, None]


def make_linear(
    weight: torch.Tensor | BlockWeight,
    bias: torch.Tensor | None = None,
    quantization: str = "none",
    kernels: CpuKernels | None = None,
    dtype: torch.dtype = torch.float32,
    lm_head: bool = False,
    row_amax: torch.Tensor | None = None,
) -> Linear:
    """The layer for ``weight`` ``[N, K]`` (already on its device) in the chosen format
    (``lm_head``: the model's output layer, which ``int4`` keeps at 8 bits).

    ``row_amax``: where ``weight`` is a tensor-parallel rank's columns of a row-parallel layer
    (``gpu.parallel.shard``), each row's largest magnitude over the whole row: int8 and fp8
    take their per-row scales from it, so the rank multiplies by exactly the codes and scales
    of the unsplit layer (block formats need nothing: the split falls on their blocks).

    ``dtype`` is the activations' (and, for ``none``, the weight's) dtype; quantized formats
    take ``weight`` in any float dtype and quantize it from fp32. A ``BlockWeight`` (GGUF
    blocks, ``gguf`` / ``auto``) runs as it is on the CPU kernels or CUDA's block matmul
    (``blocks_run_on``; else the same math in torch); ``int4`` keeps 4-bit blocks as they
    are (Q8_0 blocks, and the LM head's, are quantized again); any other format dequantizes
    it first.
    """
    check_quantization(quantization)
    if isinstance(weight, BlockWeight):
        if quantization in ("gguf", "auto"):
            # The block kernels, or (no compiler) the same math in torch (CausalLM dequantizes
            # blocks for other devices and dtypes).
            return BlockLinear(weight, bias, kernels)
        if quantization == "int4" and weight.qtype in ("Q4_0", "Q4_1") and not lm_head:
            return BlockLinear(weight, bias, kernels, "int4")  # (4-bit already: as they are)
        weight = weight.dequantize()
    if quantization == "int4":
        quantize = quantize_q8_0 if lm_head else quantize_q4_1
        qtype = "Q8_0" if lm_head else "Q4_1"
        blocks = BlockWeight(qtype, quantize(weight.to("cpu")), int(weight.shape[1]))
        if kernels is not None and weight.device.type == "cpu":
            return BlockLinear(blocks, bias, kernels, "int4")
        if weight.device.type == "cuda" and blocks_run_on(weight.device, dtype):
            return BlockLinear(blocks.to(weight.device), bias, None, "int4")
        dense = blocks.dequantize().to(weight.device, dtype)
        return DenseLinear(dense, None if bias is None else bias.to(dtype), kernels)
    if quantization == "int8":
        return Int8Linear(weight, bias, kernels, row_amax)
    if quantization == "fp8":
        if not fp8_matmul_supported(weight.device):
            raise ModelError(
                "fp8 weights need an fp8 GPU (compute capability >= 8.9, e.g. Hopper) or the CPU"
            )
        return Fp8Linear(weight, None if bias is None else bias.to(dtype), row_amax)
    return DenseLinear(weight.to(dtype), None if bias is None else bias.to(dtype), kernels)
