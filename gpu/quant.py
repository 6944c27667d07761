"""Weight (and KV cache) quantization: formats, validation, and the quantizers themselves.

Weights are quantized once at load time from whatever full-precision checkpoint was read (a
Hugging Face folder, or a GGUF file, which ``gpu.gguf`` first dequantizes to fp32):

- ``int8``: symmetric, one fp32 scale per output channel (``W ~= q * scale[:, None]``, ``q``
  in [-127, 127]). Per-channel rounding error is at most ``scale / 2``: a relative error of
  ~0.4% of the row's largest weight. On the CPU kernels the activations are quantized too
  (W8A8, see below); elsewhere they stay in the model dtype.
- ``int4``: group-wise 4-bit, groups of 32 along K, one fp16 scale and minimum per group: the
  GGUF Q4_1 block (``w ~= d * q + m``, ``q`` in [0, 15]), so it runs on the same kernel as a
  Q4_1 file (:func:`quantize_q4_1`). The LM head (with a tied embedding, the embedding too)
  gets 8 bits in blocks of 32 (Q8_0, :func:`quantize_q8_0`), as llama.cpp's 4-bit files keep
  their output tensor wider: at 4 bits it alone costs ~7 points of top-1 agreement here.
- ``gguf``: a GGUF file's own blocks (Q4_0, Q4_1, Q8_0) as they are (``gpu.gguf.blocks``).

Block kernels quantize activations per row and block of 32 to int8 (one fp32 scale ``amax /
127`` per block, round to nearest even), as ggml's CPU path does; :func:`fake_quantize_blocks`
is that step in torch (the reference the kernels are tested against).
- ``fp8``: float8 e4m3 weights with one fp32 scale per output channel, activations quantized
  per token (row) to e4m3 at run time, then ``torch._scaled_mm`` (Hopper's fp8 tensor cores;
  torch also runs it on CPU, which the tests use). Per-token activation scales keep each row's
  result independent of the rest of the batch.

The KV cache can be stored in float8 e4m3 (``--kv-cache-dtype fp8``): half of bf16's bytes
(a quarter of fp32's), no scales (vLLM's and FlashInfer's default: keys and values of these
models sit well inside e4m3's +-448 range).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from gpu.config import ModelError
from gpu.formats import KV_CACHE_DTYPES

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
INT8_MAX = 127.0


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for ``--kv-cache-dtype`` (``auto``: the model's dtype)."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        return FP8
    raise ModelError(f"unknown kv cache dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")


def _row_scales(
    weight: torch.Tensor, qmax: float, amax: torch.Tensor | None = None
) -> torch.Tensor:
    if amax is None:
        amax = weight.abs().amax(dim=1)
    amax = amax.to(device=weight.device, dtype=torch.float32)
    # An all-zero row gets scale 1 (its codes are 0 either way) rather than a division by 0.
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def quantize_int8(
    weight: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (int8 ``[N, K]``, fp32 scales ``[N]``), symmetric per output row.
    ``amax``: each row's largest magnitude when ``weight`` is a slice of its columns (a
    tensor-parallel shard), so the slice gets the whole row's scale and codes."""
    w = weight.to(torch.float32)
    scale = _row_scales(w, INT8_MAX, amax)
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale


def pack_row_blocks(w: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N/8), ceil(K/8), 8, 8]`` (zero padded, same dtype): blocks of 8
    output rows, each a sequence of 8-row x 8-column tiles, the layout the CPU linear kernels
    stream (see ``gpu.cpu_kernels``)."""
    n, k = w.shape
    np_, kp = -(-n // 8) * 8, -(-k // 8) * 8
    padded = torch.zeros((np_, kp), dtype=w.dtype, device=w.device)
    padded[:n, :k] = w
    return padded.view(np_ // 8, 8, kp // 8, 8).permute(0, 2, 1, 3).contiguous()


def unpack_row_blocks(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of :func:`pack_row_blocks`: ``[n, k]``."""
    nb, kb = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(nb * 8, kb * 8)[:n, :k]


def quantize_fp8(
    weight: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (e4m3 ``[N, K]``, fp32 scales ``[N]``), per output row (``amax``:
    as for :func:`quantize_int8`)."""
    w = weight.to(torch.float32)
    scale = _row_scales(w, FP8_MAX, amax)
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.contiguous(), scale


def fused_row_quantization(x: torch.Tensor) -> bool:
    """Whether ``x``'s rows are quantized by one Triton kernel (``gpu.triton_quant``: CUDA, where
    Triton imports) rather than by ~7 torch ones; the codes and scales are the same."""
    if x.device.type != "cuda" or x.dim() != 2 or x.stride(1) != 1:
        return False
    from gpu.attention.rope_append import available

    return available()


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``[M, K]`` -> (int8 ``[M, K]``, fp32 scales ``[M, 1]``), symmetric, one scale
    ``amax / 127`` per row (round to nearest even), so a row's codes depend on that row only."""
    if fused_row_quantization(x):
        from gpu.triton_quant import quantize_rows

        return quantize_rows(x, fp8=False)
    return torch_quantize_rows(x, fp8=False)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``[M, K]`` -> (e4m3 ``[M, K]``, fp32 scales ``[M, 1]``), one scale per row."""
    if fused_row_quantization(x):
        from gpu.triton_quant import quantize_rows

        return quantize_rows(x, fp8=True)
    return torch_quantize_rows(x, fp8=True)


def torch_quantize_rows(x: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two above in torch kernels (the reference the Triton kernel is held to)."""
    amax = x.abs().amax(dim=1, keepdim=True).to(torch.float32)
    scale = torch.clamp(amax, min=1e-12) / (FP8_MAX if fp8 else INT8_MAX)
    v = x.to(torch.float32) / scale
    if fp8:
        return v.clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale
    return torch.round(v).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def fp8_matmul_supported(device: torch.device) -> bool:
    """fp8 tensor cores: compute capability 8.9 (Ada) or 9.x (Hopper). CPU runs ``_scaled_mm``
    too (slowly; for tests and quality reports)."""
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


QK = 32  # weights (and activations) per block
# GGML type name -> bytes per block of 32, for the block kinds the CPU kernels run.
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def fake_quantize_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[M, K]`` as the block kernels see it: each row's blocks of 32 rounded to int8 on
    their own scale (``amax / 127``), dequantized again (fp32, ``[M, K]``)."""
    m, k = x.shape
    kp = -(-k // QK) * QK
    blocks = F.pad(x.to(torch.float32), (0, kp - k)).view(m, kp // QK, QK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv)
    return (q * d).view(m, kp)[:, :k]


def pad_int8_blocks(q: torch.Tensor) -> torch.Tensor:
    """int8 ``[N, K]`` -> ``[N, ceil(K/32) * 32]`` (zero padded): the block kernels' rows."""
    k = q.shape[1]
    return F.pad(q, (0, -(-k // QK) * QK - k)).contiguous()


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` float -> Q4_1 rows ``uint8 [N, ceil(K/32) * 20]`` (K zero padded): per block
    of 32, ``d = (max - min) / 15`` and ``m = min`` in fp16, codes ``round((w - m) / d)`` in
    [0, 15] (against the fp16-rounded ``d`` and ``m``, which is what dequantization uses)."""
    n, k = weight.shape
    kp = -(-k // QK) * QK
    w = F.pad(weight.to(torch.float32), (0, kp - k)).view(n, kp // QK, QK)
    lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    d16 = ((hi - lo) / 15.0).to(torch.float16)
    m16 = lo.to(torch.float16)
    d, m = d16.float(), m16.float()
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((w - m) * inv).clamp_(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)  # ggml's order: low nibbles 0..15, high 16..31
    scales = torch.cat([d16, m16], dim=-1).view(torch.uint8)  # [n, nb, 4]
    return torch.cat([scales, packed], dim=-1).reshape(n, kp // QK * 20).contiguous()


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` float -> Q8_0 rows ``uint8 [N, ceil(K/32) * 34]`` (K zero padded): per block
    of 32, ``d = amax / 127`` in fp16 and codes ``round(w / d)`` (against the fp16 ``d``)."""
    n, k = weight.shape
    kp = -(-k // QK) * QK
    w = F.pad(weight.to(torch.float32), (0, kp - k)).view(n, kp // QK, QK)
    d16 = (w.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.float16)
    d = d16.float()
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(w * inv).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    return torch.cat([d16.view(torch.uint8), q], dim=-1).reshape(n, kp // QK * 34).contiguous()


def dequantize_block_rows(qtype: str, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of GGUF blocks ``uint8 [R, nb * bytes]`` -> fp32 ``[R, k]`` (ggml's formulas: the
    same values as ``gguf.quants.dequantize``)."""
    if qtype not in BLOCK_BYTES:
        raise ModelError(f"no block kernel for GGUF type {qtype}")
    r = rows.shape[0]
    b = rows.view(r, -1, BLOCK_BYTES[qtype])
    d = b[..., :2].contiguous().view(torch.float16).to(torch.float32)
    if qtype == "Q8_0":
        w = d * b[..., 2:].contiguous().view(torch.int8).to(torch.float32)
    else:
        qs = b[..., 4:] if qtype == "Q4_1" else b[..., 2:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).to(torch.float32)
        if qtype == "Q4_0":
            w = d * (q - 8.0)
        else:
            w = d * q + b[..., 2:4].contiguous().view(torch.float16).to(torch.float32)
    return w.reshape(r, -1)[:, :k]


def _head(qtype: str) -> int:
    """Bytes of fp16 scales at the start of a block."""
    return 4 if qtype == "Q4_1" else 2


def repack_x8(qtype: str, rows: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_0 / Q4_1 / Q8_0 rows ``[n, nb * bytes]`` -> the kernels' groups of 8 rows
    ``uint8 [ceil(n/8), nb * 8 * bytes]`` (blocks.c: per group and block, the 8 rows' fp16
    d (and m), then their codes interleaved so that one 4-byte broadcast of x meets 8 rows).
    The same bytes as the file, in another order; :func:`unpack_x8` inverts it."""
    size, head = BLOCK_BYTES[qtype], _head(qtype)
    n = rows.shape[0]
    g = -(-n // 8)
    b = F.pad(rows, (0, 0, 0, g * 8 - n)).view(g, 8, -1, size).transpose(1, 2)  # [g, nb, 8, B]
    nb = b.shape[1]
    scales = [b[..., i : i + 2].reshape(g, nb, 16) for i in range(0, head, 2)]
    qs = b[..., head:]
    if qtype == "Q8_0":
        codes = qs.reshape(g, nb, 8, 8, 4).transpose(2, 3).reshape(g, nb, 256)
    else:
        nib = torch.cat([qs & 15, qs >> 4], dim=-1)  # [g, nb, 8 rows, 32 k]
        nib = nib.view(g, nb, 8, 8, 4).transpose(2, 3)  # [g, nb, 8 j, 8 rows, 4 t]
        codes = (nib[:, :, :4] | (nib[:, :, 4:] << 4)).reshape(g, nb, 128)
    return torch.cat([*scales, codes], dim=-1).reshape(g, nb * 8 * size).contiguous()


def unpack_x8(qtype: str, packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`repack_x8`: GGUF rows ``uint8 [n, nb * bytes]``."""
    size, head = BLOCK_BYTES[qtype], _head(qtype)
    g = packed.shape[0]
    rec = packed.view(g, -1, 8 * size)
    nb = rec.shape[1]
    scales = [rec[..., 8 * i : 8 * i + 16].reshape(g, nb, 8, 2) for i in range(0, head, 2)]
    body = rec[..., 8 * head :]
    if qtype == "Q8_0":
        qs = body.reshape(g, nb, 8, 8, 4).transpose(2, 3).reshape(g, nb, 8, 32)
    else:
        c4 = body.reshape(g, nb, 4, 8, 4)
        nib = torch.cat([c4 & 15, c4 >> 4], dim=2)  # [g, nb, 8 j, 8 rows, 4 t]
        nib = nib.transpose(2, 3).reshape(g, nb, 8, 32)  # [g, nb, rows, k]
        qs = nib[..., :16] | (nib[..., 16:] << 4)
    blocks = torch.cat([*scales, qs], dim=-1)  # [g, nb, 8, size]
    return blocks.transpose(1, 2).reshape(g * 8, nb * size)[:n].contiguous()


@cache
def x8_row_index(qtype: str, nb: int) -> torch.Tensor:
    """Where the bytes of one GGUF row lie in its group of 8 as :func:`repack_x8` stores it:
    ``int64 [8, nb * bytes]``, row ``r`` of the group -> offsets into the group's bytes (a
    block's fp16 scales, then its codes: each 4-bit code byte, low and high nibble, is one byte
    of the repacked vectors, so every kind is a pure byte permutation). Gathering them reads
    a row back without unpacking its group: the embedding of a tied head, each step."""
    size, head = BLOCK_BYTES[qtype], _head(qtype)
    r = torch.arange(8).view(8, 1, 1)
    o = torch.arange(size).view(1, 1, size)  # byte of a file block
    scale = 16 * (o // 2) + 2 * r + o % 2  # the 8 rows' d, then (Q4_1) their m
    i = o - head  # code byte i: piece i // 4 of x, byte i % 4 of row r's 4 in its vector
    code = 8 * head + 32 * (i // 4) + 4 * r + i % 4
    block = torch.arange(nb).view(1, nb, 1) * 8 * size
    return (block + torch.where(o < head, scale, code)).reshape(8, nb * size)


class BlockWeight:
    """A weight ``[n, k]`` kept in GGUF blocks: ``rows`` ``uint8 [n, ceil(k/32) * bytes]``
    (one row of blocks per output feature), as read from a file. Layers that cannot run the
    type natively call :meth:`dequantize`."""

    def __init__(self, qtype: str, rows: torch.Tensor, k: int) -> None:
        if qtype not in BLOCK_BYTES:
            raise ModelError(
                f"no block kernel for GGUF type {qtype} (native: {', '.join(BLOCK_BYTES)})"
            )
        if rows.dtype != torch.uint8 or rows.dim() != 2:
            raise ModelError(f"{qtype} blocks must be uint8 [n, bytes], got {rows.dtype}")
        if rows.shape[1] != -(-k // QK) * BLOCK_BYTES[qtype]:
            raise ModelError(f"{qtype} rows of {rows.shape[1]} bytes do not hold {k} weights")
        self.qtype, self.rows, self.k = qtype, rows, k

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.rows.shape[0]), self.k

    def dequantize(self) -> torch.Tensor:
        return dequantize_block_rows(self.qtype, self.rows, self.k)

    def to(self, device: torch.device) -> BlockWeight:
        """The same blocks on ``device``."""
        return BlockWeight(self.qtype, self.rows.to(device), self.k)

    def row_slice(self, start: int, stop: int) -> BlockWeight:
        """Output rows ``[start, stop)``."""
        return BlockWeight(self.qtype, self.rows[start:stop].contiguous(), self.k)

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight | None:
        """The parts stacked along ``n`` (q/k/v, gate/up), or None where their types or
        widths differ (the caller dequantizes them)."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.k != first.k for p in parts):
            return None
        return BlockWeight(first.qtype, torch.cat([p.rows for p in parts]), first.k)


def block_columns(weight: BlockWeight, start: int, stop: int) -> BlockWeight:
    """Inputs ``[start, stop)`` of a block weight: the split must fall on its blocks of 32
    (``stop`` may be the weight's end)."""
    if start % QK or (stop % QK and stop != weight.k) or not 0 <= start < stop <= weight.k:
        raise ModelError(
            f"cannot split {weight.qtype} blocks of {QK} weights at inputs {start}..{stop}"
        )
    per = BLOCK_BYTES[weight.qtype]
    b0, b1 = start // QK, -(-stop // QK)
    return BlockWeight(weight.qtype, weight.rows[:, b0 * per : b1 * per].contiguous(), stop - start)
