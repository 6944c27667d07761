"""Fused CPU kernels for the decode path (AVX2 + FMA, OpenMP), compiled once on first use.

Why: decode reads every weight once per step, and at batch 1 a step is also ~270 small ops.
On these CPUs MKL's fp32 GEMV streams weights at ~17 GB/s (of ~28 available), torch has no
fast weight-only int8 matmul for AVX2 (``torch._weight_int8pack_mm`` is vectorised for AVX-512
only; fbgemm's is W8A8 with one activation scale per batch), and RMSNorm, rotary and SwiGLU
are chains of tiny kernels. These kernels cover exactly that path:

- ``f32_linear``: ``y = x @ W.T + bias`` with fp32 weights packed in 8-row blocks
  (``gpu.quant.pack_row_blocks``) so a thread streams them sequentially: ~28 GB/s at batch 1;
  register-tiled (4 rows x 2 columns) for batches.
- ``block_linear`` (blocks.c, blocks_dot.c, blocks_linear.c): weights in rows of 32-weight
  blocks - GGUF Q4_0 / Q4_1 / Q8_0 as the file has them, or int8 with one scale per row - and
  activations quantized per row and block to int8 (as ggml's CPU path does); each block's dot
  product is an integer multiply-add (``maddubs`` + ``madd``; on AVX-512 VNNI CPUs ``dpbusd``,
  picked at run time: the same int32 sums, so the same bits), scaled into fp32. One weight
  row meets 4 activation rows at a time in batches. Each thread's weight stream is hinted
  8 KB ahead into L2: at batch 1 the kernels otherwise wait on memory here (blocks.c).
- ``rms_norm`` (residual add fused in), ``rope`` (in place on the q/k heads of the fused qkv
  output), ``silu_mul`` (SwiGLU), and ``paged_decode_attention`` (append the step's K/V to the
  paged cache, then one query per sequence straight from its pages; no gather copy, no mask).

Determinism: every output element is computed in a fixed order that depends only on its own
row (8-lane partial sums over K - or over blocks - in order, a fixed horizontal sum, then the
tail), never on how many rows share the call or how they are split across threads; block
kernels quantize each activation row on its own scales. So a sequence's logits are the
same bits whatever else is in the batch: batch invariance holds exactly on this path.

The module is plain C (the ``*.c`` files here, compiled as one unit in the order of
``build.PARTS``) with a minimal CPython binding (no torch headers: it compiles in about
a second; torch's own extension toolchain takes minutes here), built with the system C
compiler into ``$MESHSERVE_CACHE/kernels/`` keyed by a hash of the source, flags and Python.
Tensors cross as data pointers, validated by the wrappers below. It links ``libgomp.so.1`` by
soname, so inside a torch process it shares torch's OpenMP runtime and thread pool (no second
set of spinning threads). Where there is no compiler, no Python headers or no AVX2/F16C,
:func:`load` returns None and callers use their plain torch path (the reference the kernels
are tested against).
"""

from gpu.cpu_kernels.build import build, load
from gpu.cpu_kernels.decoder import FusedDecoder
from gpu.cpu_kernels.prepared import DecodeAttention, PackedLinear
from gpu.cpu_kernels.wrappers import CpuKernels

__all__ = ["CpuKernels", "DecodeAttention", "FusedDecoder", "PackedLinear", "build", "load"]
