"""One linear-layer interface; weight formats plug in behind it.

The model only calls ``Linear.forward`` (``y = x @ W.T + b``); how the weight is stored is
the layer's business, chosen once at load time by :func:`make_linear`:

- fp32 / bf16 (``DenseLinear``): on CPU the fp32 kernel of ``gpu.cpu_kernels`` over 8-row
  blocks (else ``x @ W_t`` with ``W_t`` ``[K, N]``); ``F.linear`` on CUDA.
- int8 (``Int8Linear``): int8 ``[N, K]`` + one fp32 scale per output channel, weight-only.
  CPU: the AVX2 kernel of ``gpu.cpu_kernels``; CUDA: ``torch._weight_int8pack_mm`` where the
  torch build has it; else (and as the reference) dequantize + matmul.
- fp8 (``Fp8Linear``): e4m3 ``[N, K]`` + one fp32 scale per output channel, activations cast
  to e4m3 per token, ``torch._scaled_mm`` with row-wise scales (Ada/Hopper tensor cores; torch
  also runs it on CPU, slowly: tests and quality reports).

Every format keeps each output row a function of its own input row only (no per-batch
activation scales), so a request's output does not depend on what shares its batch.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from gpu.config import ModelError
from gpu.cpu_kernels import CpuKernels, PackedLinear
from gpu.formats import check_quantization
from gpu.quant import (
    fp8_matmul_supported,
    pack_row_blocks,
    quantize_fp8,
    quantize_fp8_rows,
    quantize_int8,
    unpack_row_blocks,
)

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

    def weight_bytes(self) -> int:
        """Bytes read from memory per forward pass for the weight (and its scales)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def dequantized_weight(self) -> torch.Tensor:
        """The weight this layer effectively multiplies by, ``[N, K]`` fp32."""
        raise NotImplementedError

    bias: torch.Tensor | None
    kernels: CpuKernels | None = None
    _prepared: PackedLinear | None = None

    def packed(self) -> PackedLinear | None:
        """The prepared CPU kernel call for fp32 inputs, where this layer has one (re-made if
        a ``.to()`` or state-dict load replaced the tensors it points at)."""
        if self.kernels is None:
            return None
        weight, scale = self.kernel_operands()
        self._prepared = _packed(
            self.kernels, self._prepared, weight, self.out_features, self.in_features, scale,
            self.bias,
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
    return kernels.packed_linear(weight, n, k, scale, bias)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "nk":
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


class Int8Linear(Linear):
    """int8 weight-only, one fp32 scale per output channel (see ``gpu.quant.quantize_int8``)."""

    format = "int8"
    qweight: torch.Tensor
    scale: torch.Tensor
    scale_x: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        kernels: CpuKernels | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(int(weight.shape[1]), int(weight.shape[0]))
        q, scale = quantize_int8(weight)
        device = weight.device
        self.kernels = kernels if device.type == "cpu" else None
        # The CPU kernel reads the weight in its blocked layout; everything else [N, K].
        self.register_buffer("qweight", q if self.kernels is None else pack_row_blocks(q))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.to(torch.float32))
        self.int8pack = device.type == "cuda" and _int8pack_mm_works(device, dtype)
        # The scale in the activations' dtype, as torch._weight_int8pack_mm wants it.
        self.register_buffer("scale_x", scale.to(dtype) if self.int8pack else None)
        self._prepared: PackedLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        prepared = self.packed()
        if prepared is not None and x2.dtype == torch.float32:
            y = prepared(x2)
        elif self.int8pack and self.scale_x is not None:
            y = torch._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scale_x)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        else:  # reference: dequantize, then a dense matmul
            y = F.linear(x2, self.int8_weight().to(x2.dtype)) * self.scale.to(x2.dtype)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.qweight, self.scale

    def int8_weight(self) -> torch.Tensor:
        """The int8 codes ``[N, K]``."""
        if self.kernels is None:
            return self.qweight
        return unpack_row_blocks(self.qweight, self.out_features, self.in_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.int8_weight().to(torch.float32) * self.scale[:, None]


class Fp8Linear(Linear):
    """e4m3 weight with per-output-channel scales; activations quantized to e4m3 per token, then
    one ``torch._scaled_mm`` with row-wise scales (fp32 accumulation)."""

    format = "fp8"
    qweight: torch.Tensor
    scale: torch.Tensor  # [1, N]
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(int(weight.shape[1]), int(weight.shape[0]))
        q, scale = quantize_fp8(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.view(1, -1).contiguous())
        self.register_buffer("bias", bias)
        # cuBLASLt's fp8 GEMM needs K and N in multiples of 16; other shapes dequantize.
        self.scaled_mm = weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        xq, x_scale = quantize_fp8_rows(x2)
        # Row-wise scaling on CUDA produces bf16; on CPU fp32 is allowed (and exact).
        out_dtype = torch.float32 if x2.device.type == "cpu" else torch.bfloat16
        if self.scaled_mm:
            y = torch._scaled_mm(
                xq, self.qweight.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=out_dtype
            )
        else:
            y = (xq.to(torch.float32) @ self.qweight.to(torch.float32).t()) * x_scale * self.scale
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.to(torch.float32) * self.scale.view(-1, 1)


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    quantization: str = "none",
    kernels: CpuKernels | None = None,
    dtype: torch.dtype = torch.float32,
) -> Linear:
    """The layer for ``weight`` ``[N, K]`` (already on its device) in the chosen format.

    ``dtype`` is the activations' (and, for ``none``, the weight's) dtype; quantized formats
    take ``weight`` in any float dtype and quantize it from fp32.
    """
    check_quantization(quantization)
    if quantization == "int8":
        return Int8Linear(weight, bias, kernels, dtype)
    if quantization == "fp8":
        if not fp8_matmul_supported(weight.device):
            raise ModelError(
                "fp8 weights need an fp8 GPU (compute capability >= 8.9, e.g. Hopper) or the CPU"
            )
        return Fp8Linear(weight, None if bias is None else bias.to(dtype))
    return DenseLinear(weight.to(dtype), None if bias is None else bias.to(dtype), kernels)


_INT8PACK_OK: dict[tuple[str, torch.dtype], bool] = {}


def _int8pack_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build has ``_weight_int8pack_mm`` for ``device`` and ``dtype``
    (CUDA support arrived after the CPU one); probed once with a tiny call."""
    key = (str(device), dtype)
    if key not in _INT8PACK_OK:
        try:
            g = torch.Generator().manual_seed(0)
            x = torch.randint(-4, 5, (3, 64), generator=g).to(device, dtype)
            w = torch.randint(-127, 128, (48, 64), generator=g, dtype=torch.int8).to(device)
            s = (torch.rand(48, generator=g) + 0.5).to(device, dtype)
            got = torch._weight_int8pack_mm(x, w, s).float()
            want = (x.float() @ w.float().t()) * s.float()
            ok = bool(torch.allclose(got, want, rtol=2e-2, atol=1e-2 * float(want.abs().max())))
        except (RuntimeError, NotImplementedError):
            ok = False
        if not ok:
            logger.info("torch._weight_int8pack_mm unavailable on %s: int8 dequantizes", device)
        _INT8PACK_OK[key] = ok
    return _INT8PACK_OK[key]
