"""Fused CPU kernels for the decode path (AVX2 + FMA, OpenMP), compiled once on first use.

Why: decode reads every weight once per step, and at batch 1 a step is also ~270 small ops.
On these CPUs MKL's fp32 GEMV streams weights at ~17 GB/s (of ~28 available), torch has no
fast weight-only int8 matmul for AVX2 (``torch._weight_int8pack_mm`` is vectorised for AVX-512
only; fbgemm's is W8A8 with one activation scale per batch), and RMSNorm, rotary and SwiGLU
are chains of tiny kernels. These kernels cover exactly that path:

- ``f32_linear`` / ``int8_linear``: ``y = (x @ W.T) (* scale) (+ bias)`` with fp32 or int8
  (weight-only, one scale per output channel) weights packed in 8-row blocks
  (``gpu.quant.pack_row_blocks``) so a thread streams them sequentially: ~28 GB/s at batch 1;
  register-tiled (4 rows x 2 columns) for batches.
- ``rms_norm`` (residual add fused in), ``rope`` (in place on the q/k heads of the fused qkv
  output), ``silu_mul`` (SwiGLU), and ``paged_decode_attention`` (append the step's K/V to the
  paged cache, then one query per sequence straight from its pages; no gather copy, no mask).

Determinism: every output element is computed in a fixed order that depends only on its own
row (8-lane partial sums over K in order, a fixed horizontal sum, then the tail), never on how
many rows share the call or how they are split across threads. So a sequence's logits are the
same bits whatever else is in the batch: batch invariance holds exactly on this path.

The module is plain C with a minimal CPython binding (no torch headers: it compiles in about
a second; torch's own extension toolchain takes minutes here), built with the system C
compiler into ``$MESHSERVE_CACHE/kernels/`` keyed by a hash of the source, flags and Python.
Tensors cross as data pointers, validated by the wrappers below. It links ``libgomp.so.1`` by
soname, so inside a torch process it shares torch's OpenMP runtime and thread pool (no second
set of spinning threads). Where there is no compiler, no Python headers or no AVX2,
:func:`load` returns None and callers use their plain torch path (the reference the kernels
are tested against).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

typedef int64_t i64;

static inline i64 imin(i64 a, i64 b) { return a < b ? a : b; }

/* A fixed-order horizontal sum: part of the bit-exact contract. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 load_i8x8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

/* exp(x) on 8 lanes (Cephes polynomial, relative error ~2e-7); inputs below -88 give ~0. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
    __m256 fx = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
    e = _mm256_slli_epi32(e, 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float exp1(float x) {
    float in[8] = {x, 0, 0, 0, 0, 0, 0, 0}, out[8];
    _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(in)));
    return out[0];
}

/* [lo, hi) of `n` items for thread `t` of `nt`, in whole blocks of `align`. */
static inline void split(i64 n, i64 align, int t, int nt, i64* lo, i64* hi) {
    i64 blocks = (n + align - 1) / align;
    *lo = imin(n, blocks * t / nt * align);
    *hi = imin(n, blocks * (t + 1) / nt * align);
}

/* ---------------------------------------------------------------- linear layers */

/*
 * y = (x @ W.T) * scale + bias for fp32 x [M, K] and W [N, K] in int8 (weight-only, one scale
 * per output row) or fp32 (no scale). W is packed in blocks of 8 output rows:
 * [ceil(N/8)][ceil(K/8)][8 rows][8 k], zero padded. At batch 1 a thread then reads its blocks as
 * one sequential stream (an int8 block step is one cache line); row-major [N][K] read 8 rows at
 * a time streams at about half the speed here, and so does MKL's fp32 GEMV.
 *
 * Every y[m][n] is one accumulator over k in steps of 8, in order, then a fixed horizontal sum,
 * the scalar tail, * scale, + bias: the same in every tile and thread split, so a row's result
 * never depends on the other rows of the batch.
 */
#define PACK 8

static inline float lin_finish(__m256 acc, const float* x, i64 ntail, float tail_w[8],
                               const float* scale, const float* bias) {
    float s = hsum8(acc);
    for (i64 k = 0; k < ntail; ++k) s = fmaf(x[k], tail_w[k], s);
    if (scale) s = s * *scale;
    if (bias) s = s + *bias;
    return s;
}

#define DEFINE_LINEAR(NAME, WT, LOADW)                                                        \
/* One row of x against a whole 8-row block (rows n..n+nvalid-1). */                          \
static void NAME##_1x8(const float* x, const WT* blk, i64 K, const float* scale,             \
                       const float* bias, float* y, int nvalid) {                             \
    __m256 acc[PACK];                                                                         \
    for (int j = 0; j < PACK; ++j) acc[j] = _mm256_setzero_ps();                              \
    const i64 K8 = K & ~(i64)7;                                                               \
    const WT* p = blk;                                                                        \
    for (i64 k = 0; k < K8; k += 8, p += PACK * 8) {                                          \
        __m256 xv = _mm256_loadu_ps(x + k);                                                   \
        for (int j = 0; j < PACK; ++j) acc[j] = _mm256_fmadd_ps(xv, LOADW(p + 8 * j), acc[j]); \
    }                                                                                         \
    for (int j = 0; j < nvalid; ++j) {                                                        \
        float tw[8];                                                                          \
        for (i64 k = 0; k < K - K8; ++k) tw[k] = (float)p[8 * j + k];                         \
        y[j] = lin_finish(acc[j], x + K8, K - K8, tw, scale ? scale + j : NULL,               \
                          bias ? bias + j : NULL);                                            \
    }                                                                                         \
}                                                                                             \
/* Four rows of x against rows j0, j0+1 of a block (a weight vector feeds 4 FMAs). */         \
static void NAME##_4x2(const float* x, i64 ldx, const WT* blk, int j0, i64 K,                \
                       const float* scale, const float* bias, float* y, i64 ldy, int nvalid) { \
    __m256 acc[4][2];                                                                         \
    for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();                  \
    const i64 K8 = K & ~(i64)7;                                                               \
    const WT* p = blk + 8 * j0;                                                               \
    for (i64 k = 0; k < K8; k += 8, p += PACK * 8) {                                          \
        __m256 w0 = LOADW(p), w1 = LOADW(p + 8);                                              \
        for (int i = 0; i < 4; ++i) {                                                         \
            __m256 xv = _mm256_loadu_ps(x + i * ldx + k);                                     \
            acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);                                   \
            acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);                                   \
        }                                                                                     \
    }                                                                                         \
    for (int j = 0; j < nvalid && j < 2; ++j) {                                               \
        float tw[8];                                                                          \
        for (i64 k = 0; k < K - K8; ++k) tw[k] = (float)p[8 * j + k];                         \
        for (int i = 0; i < 4; ++i)                                                           \
            y[i * ldy + j0 + j] = lin_finish(acc[i][j], x + i * ldx + K8, K - K8, tw,         \
                                             scale ? scale + j0 + j : NULL,                   \
                                             bias ? bias + j0 + j : NULL);                    \
    }                                                                                         \
}                                                                                             \
void NAME(const float* x, i64 M, i64 K, i64 ldx, const WT* w, i64 N, const float* scale,     \
          const float* bias, float* y, i64 ldy, int nthreads) {                               \
    const i64 nblocks = (N + PACK - 1) / PACK, block = (K + 7) / 8 * 8 * PACK;               \
    int parallel = nthreads > 1 && M * N * K >= (i64)1 << 17;                                 \
    _Pragma("omp parallel num_threads(nthreads) if (parallel)")                               \
    {                                                                                         \
        i64 b0, b1;                                                                           \
        split(nblocks, 1, omp_get_thread_num(), omp_get_num_threads(), &b0, &b1);             \
        for (i64 mc = 0; mc < M; mc += LIN_M_CHUNK) {                                         \
            i64 mend = imin(M, mc + LIN_M_CHUNK), m4 = mc + (mend - mc) / 4 * 4;              \
            for (i64 b = b0; b < b1; ++b) {                                                   \
                const WT* blk = w + b * block;                                                \
                i64 n = b * PACK;                                                             \
                int nvalid = (int)imin(PACK, N - n);                                          \
                const float* sc = scale ? scale + n : NULL;                                   \
                const float* bb = bias ? bias + n : NULL;                                     \
                for (int j0 = 0; j0 < nvalid; j0 += 2)                                        \
                    for (i64 m = mc; m < m4; m += 4)                                          \
                        NAME##_4x2(x + m * ldx, ldx, blk, j0, K, sc, bb, y + m * ldy + n,    \
                                   ldy, nvalid - j0);                                         \
                for (i64 m = m4; m < mend; ++m)                                               \
                    NAME##_1x8(x + m * ldx, blk, K, sc, bb, y + m * ldy + n, nvalid);         \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}

#define LIN_M_CHUNK 64  /* rows of x kept hot in L2 while a thread sweeps its blocks */
DEFINE_LINEAR(int8_linear, int8_t, load_i8x8)
DEFINE_LINEAR(f32_linear, float, _mm256_loadu_ps)

/* ---------------------------------------------------------------- norms, rotary, SwiGLU */

static void rms_norm_row(const float* x, const float* w, float eps, i64 H, float* out) {
    __m256 acc = _mm256_setzero_ps();
    i64 H8 = H & ~(i64)7, i;
    for (i = 0; i < H8; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (; i < H; ++i) ss = fmaf(x[i], x[i], ss);
    float inv = 1.0f / sqrtf(ss / (float)H + eps);
    __m256 iv = _mm256_set1_ps(inv);
    for (i = 0; i < H8; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                                _mm256_mul_ps(_mm256_loadu_ps(x + i), iv)));
    for (; i < H; ++i) out[i] = w[i] * (x[i] * inv);
}

/* out = rms_norm(hidden) * w; with delta: hidden += delta first (written back). */
void rms_norm(float* hidden, const float* delta, i64 T, i64 H, const float* w, float eps,
              float* out, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && T * H >= 65536)
    for (i64 t = 0; t < T; ++t) {
        float* h = hidden + t * H;
        if (delta) {
            const float* d = delta + t * H;
            i64 i = 0;
            for (; i + 8 <= H; i += 8)
                _mm256_storeu_ps(h + i, _mm256_add_ps(_mm256_loadu_ps(h + i),
                                                      _mm256_loadu_ps(d + i)));
            for (; i < H; ++i) h[i] += d[i];
        }
        rms_norm_row(h, w, eps, H, out + t * H);
    }
}

/* HF rotate_half convention, in place on `heads` heads of D at x + t * ld. Tables [*, D]. */
void rope(float* x, i64 T, i64 ld, i64 heads, i64 D, const i64* positions, const float* cos_t,
          const float* sin_t) {
    i64 half = D / 2;
    for (i64 t = 0; t < T; ++t) {
        const float* c = cos_t + positions[t] * D;
        const float* s = sin_t + positions[t] * D;
        for (i64 h = 0; h < heads; ++h) {
            float* a = x + t * ld + h * D;
            float* b = a + half;
            i64 i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 av = _mm256_loadu_ps(a + i), bv = _mm256_loadu_ps(b + i);
                __m256 ra = _mm256_sub_ps(_mm256_mul_ps(av, _mm256_loadu_ps(c + i)),
                                          _mm256_mul_ps(bv, _mm256_loadu_ps(s + i)));
                __m256 rb = _mm256_add_ps(_mm256_mul_ps(bv, _mm256_loadu_ps(c + half + i)),
                                          _mm256_mul_ps(av, _mm256_loadu_ps(s + half + i)));
                _mm256_storeu_ps(a + i, ra);
                _mm256_storeu_ps(b + i, rb);
            }
            for (; i < half; ++i) {
                float av = a[i], bv = b[i];
                a[i] = av * c[i] - bv * s[i];
                b[i] = bv * c[half + i] + av * s[half + i];
            }
        }
    }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i] */
void silu_mul(const float* gu, i64 T, i64 I, float* out, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && T * I >= 65536)
    for (i64 t = 0; t < T; ++t) {
        const float* g = gu + t * 2 * I;
        const float* u = g + I;
        float* o = out + t * I;
        i64 i = 0;
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; ++i) o[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
}

/* ---------------------------------------------------------------- paged decode attention */

/* q . k over D (a multiple of 8) with 4 partial sums (a short FMA chain), combined in a
   fixed order. */
static inline float dot(const float* a, const float* b, i64 D) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (i64 d = 0; d < D; d += 8)
        acc[(d >> 3) & 3] =
            _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc[(d >> 3) & 3]);
    return hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

/* p[0:L] <- exp(p - max), returns the sum. */
static float softmax_numerators(float* p, i64 L, float mx) {
    __m256 sum8 = _mm256_setzero_ps(), mxv = _mm256_set1_ps(mx);
    i64 t = 0;
    for (; t + 8 <= L; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), mxv));
        _mm256_storeu_ps(p + t, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum8(sum8);
    for (; t < L; ++t) {
        p[t] = exp1(p[t] - mx);
        sum += p[t];
    }
    return sum;
}

/* o[0:D] = sum_t p[t] * V[t] / sum over the sequence's pages (V rows at vbase + page, slot). */
static void weighted_values(const float* p, const float* cache, const int32_t* pages,
                            i64 L, i64 ps, i64 page_stride, i64 tok, i64 voff, i64 D,
                            float inv, float* o) {
    if (D == 64) {  /* the common head size: the 8 accumulators stay in registers */
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
        for (i64 t = 0; t < L; ++t) {
            const float* vp = cache + (i64)pages[t / ps] * page_stride + (t % ps) * tok + voff;
            __m256 pt = _mm256_set1_ps(p[t]);
            for (int i = 0; i < 8; ++i)
                a[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vp + 8 * i), a[i]);
        }
        __m256 iv = _mm256_set1_ps(inv);
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(a[i], iv));
        return;
    }
    for (i64 d = 0; d < D; ++d) o[d] = 0.0f;
    for (i64 t = 0; t < L; ++t) {
        const float* vp = cache + (i64)pages[t / ps] * page_stride + (t % ps) * tok + voff;
        __m256 pt = _mm256_set1_ps(p[t]);
        for (i64 d = 0; d < D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pt, _mm256_loadu_ps(vp + d),
                                                    _mm256_loadu_ps(o + d)));
    }
    for (i64 d = 0; d < D; ++d) o[d] *= inv;
}

/*
 * One query token per sequence. rows[b]: the token row of sequence b in q/k/v/out (rows of
 * ld floats; heads of D floats inside a row). cache: [num_pages, 2, ps, Hkv, D]. The new
 * token's K/V is written to (append_pages[b], append_offsets[b]) first, then each query head
 * of sequence b attends to all L_b keys (pages kv_indices[kv_indptr[b]:kv_indptr[b+1]], the
 * last one holding last_len[b] keys). D must be a multiple of 8. Work items are (sequence,
 * KV head): the G query heads sharing a KV head score each key while it is in L1.
 */
void paged_decode_attention(const float* q, i64 q_ld, const float* k, const float* v, i64 kv_ld,
                            float* out, i64 out_ld, const i64* rows, i64 B, float* cache,
                            const i64* append_pages, const i64* append_offsets,
                            const int32_t* kv_indptr, const int32_t* kv_indices,
                            const int32_t* last_len, i64 Hq, i64 Hkv, i64 D, i64 ps, float scale,
                            int nthreads) {
    const i64 tok = Hkv * D, page_stride = 2 * ps * tok, G = Hq / Hkv;
    i64 max_len = 1, work = 0;
    for (i64 b = 0; b < B; ++b) {
        i64 r = rows[b];
        float* kd = cache + append_pages[b] * page_stride + append_offsets[b] * tok;
        memcpy(kd, k + r * kv_ld, tok * sizeof(float));
        memcpy(kd + ps * tok, v + r * kv_ld, tok * sizeof(float));
        i64 L = (i64)(kv_indptr[b + 1] - kv_indptr[b] - 1) * ps + last_len[b];
        if (L > max_len) max_len = L;
        work += L;
    }
    int parallel = nthreads > 1 && work * Hq * D >= 65536;
    #pragma omp parallel num_threads(nthreads) if (parallel)
    {
        float* p = (float*)malloc(G * (max_len + 8) * sizeof(float));
        i64 lo, hi;
        split(B * Hkv, 1, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (i64 item = lo; item < hi; ++item) {
            i64 b = item / Hkv, kvh = item % Hkv;
            const int32_t* pages = kv_indices + kv_indptr[b];
            i64 npages = kv_indptr[b + 1] - kv_indptr[b];
            i64 L = (npages - 1) * ps + last_len[b];
            const float* q0 = q + rows[b] * q_ld + kvh * G * D;
            float mx[64];  /* G <= 64 (checked by the caller) */
            for (i64 g = 0; g < G; ++g) mx[g] = -INFINITY;
            for (i64 pg = 0, t = 0; pg < npages; ++pg) {
                const float* kbase = cache + (i64)pages[pg] * page_stride + kvh * D;
                i64 n = imin(ps, L - pg * ps);
                for (i64 o = 0; o < n; ++o, ++t)
                    for (i64 g = 0; g < G; ++g) {
                        float s = dot(q0 + g * D, kbase + o * tok, D) * scale;
                        p[g * (max_len + 8) + t] = s;
                        if (s > mx[g]) mx[g] = s;
                    }
            }
            for (i64 g = 0; g < G; ++g) {
                float* pg_ = p + g * (max_len + 8);
                float sum = softmax_numerators(pg_, L, mx[g]);
                weighted_values(pg_, cache, pages, L, ps, page_stride, tok, ps * tok + kvh * D, D,
                                1.0f / sum, out + rows[b] * out_ld + (kvh * G + g) * D);
            }
        }
        free(p);
    }
}

/* ---------------------------------------------------------------- Python bindings */
/* METH_FASTCALL functions taking plain ints (data pointers) and floats: ~0.3 us per call,
   where ctypes spends ~5 us converting a dozen arguments. The GIL is released while a
   kernel runs. */

typedef union { void* p; i64 i; double f; } Arg;

static int parse(PyObject* const* args, Py_ssize_t nargs, const char* sig, Arg* out) {
    Py_ssize_t n = (Py_ssize_t)strlen(sig);
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", n, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* o = args[i];
        if (sig[i] == 'P') out[i].p = o == Py_None ? NULL : PyLong_AsVoidPtr(o);
        else if (sig[i] == 'I') out[i].i = PyLong_AsLongLong(o);
        else out[i].f = PyFloat_AsDouble(o);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

/* The Python entry of a DEFINE_LINEAR kernel (both share one argument list). */
#define DEFINE_PY_LINEAR(name)                                                                \
    static PyObject* py_##name(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {     \
        Arg a[11];                                                                            \
        if (parse(args, nargs, "PIIIPIPPPII", a) < 0) return NULL;                           \
        Py_BEGIN_ALLOW_THREADS                                                                \
        name(a[0].p, a[1].i, a[2].i, a[3].i, a[4].p, a[5].i, a[6].p, a[7].p, a[8].p, a[9].i,  \
             (int)a[10].i);                                                                   \
        Py_END_ALLOW_THREADS                                                                  \
        Py_RETURN_NONE;                                                                       \
    }

DEFINE_PY_LINEAR(int8_linear)
DEFINE_PY_LINEAR(f32_linear)

static PyObject* py_rms_norm(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    Arg a[8];
    if (parse(args, nargs, "PPIIPFPI", a) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rms_norm(a[0].p, a[1].p, a[2].i, a[3].i, a[4].p, (float)a[5].f, a[6].p, (int)a[7].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject* py_rope(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    Arg a[8];
    if (parse(args, nargs, "PIIIIPPP", a) < 0) return NULL;
    rope(a[0].p, a[1].i, a[2].i, a[3].i, a[4].i, a[5].p, a[6].p, a[7].p);
    Py_RETURN_NONE;
}

static PyObject* py_silu_mul(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    Arg a[5];
    if (parse(args, nargs, "PIIPI", a) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    silu_mul(a[0].p, a[1].i, a[2].i, a[3].p, (int)a[4].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject* py_paged_decode_attention(PyObject* self, PyObject* const* args,
                                           Py_ssize_t nargs) {
    Arg a[21];
    if (parse(args, nargs, "PIPPIPIPIPPPPPPIIIIFI", a) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    paged_decode_attention(a[0].p, a[1].i, a[2].p, a[3].p, a[4].i, a[5].p, a[6].i, a[7].p,
                           a[8].i, a[9].p, a[10].p, a[11].p, a[12].p, a[13].p, a[14].p, a[15].i,
                           a[16].i, a[17].i, a[18].i, (float)a[19].f, (int)a[20].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"int8_linear", (PyCFunction)(void (*)(void))py_int8_linear, METH_FASTCALL, NULL},
    {"f32_linear", (PyCFunction)(void (*)(void))py_f32_linear, METH_FASTCALL, NULL},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL, NULL},
    {"rope", (PyCFunction)(void (*)(void))py_rope, METH_FASTCALL, NULL},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL, NULL},
    {"paged_decode_attention", (PyCFunction)(void (*)(void))py_paged_decode_attention,
     METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_meshserve_cpu", NULL, -1, methods};

PyMODINIT_FUNC PyInit__meshserve_cpu(void) { return PyModule_Create(&module); }
"""

FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared")
MODULE = "_meshserve_cpu"  # the extension module's name (PyInit__meshserve_cpu)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    # Cheap (these run ~10 times per layer per step) but enough to never hand C a bad pointer.
    if t.dtype != dtype or not t.is_cpu:
        raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")


class PackedLinear:
    """``x @ W.T (* scale) (+ bias)`` for one weight packed by ``gpu.quant.pack_row_blocks``
    (int8 with per-row ``scale``, or fp32 without): checked once here, so a call costs one
    allocation and one C call."""

    def __init__(
        self,
        fn: Callable[..., None],
        weight: torch.Tensor,
        n: int,
        k: int,
        scale: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        if weight.shape != (-(-n // 8), -(-k // 8), 8, 8) or not weight.is_contiguous():
            raise ValueError(f"packed weight {tuple(weight.shape)} does not hold [{n}, {k}]")
        _check(weight, torch.int8 if scale is not None else torch.float32, "weight")
        for name, t in (("scale", scale), ("bias", bias)):
            if t is not None:
                _check(t, torch.float32, name)
                if t.shape != (n,) or not t.is_contiguous():
                    raise ValueError(f"{name} must be contiguous [{n}], got {tuple(t.shape)}")
        self._fn = fn
        self.weight, self.scale, self.bias = weight, scale, bias  # keeps the pointers valid
        self.n, self.k = n, k
        self._pointers = (weight.data_ptr(), n, _ptr(scale), _ptr(bias))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"x must be CPU fp32 [M, {self.k}], got {x.dtype} {tuple(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty((m, self.n), dtype=torch.float32)
        w, n, scale, bias = self._pointers
        self._fn(
            x.data_ptr(), m, self.k, x.stride(0), w, n, scale, bias, y.data_ptr(), n,
            torch.get_num_threads(),
        )  # fmt: skip
        return y


class DecodeAttention:
    """One step's decode metadata for ``paged_decode_attention``, checked once per step; each
    layer then calls it with its q/k/v views, output and cache.

    Decode ``b`` has its single query at token ``rows[b]``; its K/V go to
    ``(append_pages[b], append_offsets[b])`` of the cache first; its pages are
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, the last holding ``last_page_len[b]`` keys.
    """

    def __init__(
        self,
        fn: Callable[..., None],
        rows: torch.Tensor,
        append_pages: torch.Tensor,
        append_offsets: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        last_page_len: torch.Tensor,
        scale: float,
    ) -> None:
        b = rows.numel()
        i64s = (("rows", rows), ("append_pages", append_pages), ("append_offsets", append_offsets))
        for name, t in i64s:
            _check(t, torch.int64, name)
            if t.shape != (b,) or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous [{b}]")
        i32s = (("kv_indptr", kv_indptr), ("kv_indices", kv_indices))
        for name, t in (*i32s, ("last_page_len", last_page_len)):
            _check(t, torch.int32, name)
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if kv_indptr.shape != (b + 1,) or last_page_len.shape != (b,):
            raise ValueError("kv_indptr must be [B + 1] and last_page_len [B]")
        self._fn = fn
        self._tensors = (rows, append_pages, append_offsets, kv_indptr, kv_indices, last_page_len)
        self._meta = tuple(t.data_ptr() for t in self._tensors)
        self.rows = rows
        self.num_seqs = b
        self.max_row = int(rows.max()) if b else -1
        self.max_page = int(append_pages.max()) if b else -1
        if kv_indices.numel():
            self.max_page = max(self.max_page, int(kv_indices.max()))
        self.scale = scale

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> None:
        """``q``/``out`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` (heads contiguous, rows may
        be strided), ``kv_cache`` one layer's ``[pages, 2, page_size, Hkv, D]``, all fp32."""
        hq, d = q.shape[1], q.shape[2]
        hkv = k.shape[1]
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("kv_cache", kv_cache)):
            if t.dtype != torch.float32 or not t.is_cpu:
                raise ValueError(f"{name} must be a CPU fp32 tensor")
        if d % 8 or hq % hkv or hq // hkv > 64 or kv_cache.shape[3:] != (hkv, d):
            raise ValueError("paged_decode_attention needs head_dim % 8 == 0, GQA group <= 64")
        if (
            (q.stride(1), q.stride(2), k.stride(1), k.stride(2), out.stride(1), out.stride(2))
            != (d, 1, d, 1, d, 1)
            or v.stride() != k.stride()
            or not kv_cache.is_contiguous()
        ):
            raise ValueError("paged_decode_attention needs contiguous heads and cache")
        if self.max_row >= min(q.shape[0], out.shape[0]) or self.max_page >= kv_cache.shape[0]:
            raise ValueError("decode rows or pages out of range for these tensors")
        rows, pages, offsets, indptr, indices, last = self._meta
        self._fn(
            q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), out.data_ptr(),
            out.stride(0), rows, self.num_seqs, kv_cache.data_ptr(), pages, offsets, indptr,
            indices, last, hq, hkv, d, kv_cache.shape[2], self.scale, torch.get_num_threads(),
        )  # fmt: skip


class CpuKernels:
    """Typed entry points; each checks what the C code relies on (dtype, shape, layout)."""

    def __init__(self, module: ModuleType, path: Path) -> None:
        self.path = path
        self._int8_linear = module.int8_linear
        self._f32_linear = module.f32_linear
        self._rms_norm = module.rms_norm
        self._rope = module.rope
        self._silu_mul = module.silu_mul
        self._attention = module.paged_decode_attention

    def packed_linear(
        self,
        weight: torch.Tensor,
        n: int,
        k: int,
        scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> PackedLinear:
        """A prepared ``[n, k]`` linear over a packed weight: int8 with ``scale``, else fp32."""
        fn = self._int8_linear if scale is not None else self._f32_linear
        return PackedLinear(fn, weight, n, k, scale, bias)

    def int8_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(x @ W.T) * scale + bias`` for fp32 ``x`` ``[M, K]``, int8 ``W`` ``[N, K]`` packed
        by ``gpu.quant.pack_row_blocks`` and fp32 ``scale`` ``[N]`` (one-off; layers keep a
        :class:`PackedLinear`)."""
        return self.packed_linear(weight, scale.shape[0], x.shape[-1], scale, bias)(x)

    def f32_linear(
        self, x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ W.T + bias`` for fp32 ``x`` ``[M, K]`` and fp32 ``W`` ``[n, K]`` packed."""
        return self.packed_linear(weight, n, x.shape[-1], None, bias)(x)

    def decode_attention(
        self,
        rows: torch.Tensor,
        append_pages: torch.Tensor,
        append_offsets: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        last_page_len: torch.Tensor,
        scale: float,
    ) -> DecodeAttention:
        """One step's decode attention (see :class:`DecodeAttention`)."""
        return DecodeAttention(
            self._attention, rows, append_pages, append_offsets, kv_indptr, kv_indices,
            last_page_len, scale,
        )  # fmt: skip

    def rms_norm(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        delta: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rms_norm(hidden) * weight``; with ``delta``, ``hidden += delta`` first (in place).
        ``hidden`` (and ``delta``) contiguous fp32 ``[T, H]``, ``weight`` fp32 ``[H]``."""
        t, h = hidden.shape
        if (
            hidden.dtype != torch.float32
            or weight.dtype != torch.float32
            or not hidden.is_cpu
            or not hidden.is_contiguous()
            or weight.shape != (h,)
            or (delta is not None and (delta.shape != hidden.shape or not delta.is_contiguous()))
        ):
            raise ValueError("rms_norm needs contiguous CPU fp32 [T, H] inputs")
        out = torch.empty_like(hidden)
        self._rms_norm(
            hidden.data_ptr(), _ptr(delta), t, h, weight.data_ptr(), eps, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rope_(
        self,
        x: torch.Tensor,
        num_heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Rotate, in place, the first ``num_heads`` heads of each row of ``x`` ``[T, >= heads *
        D]`` (rows may be strided, heads contiguous); ``cos``/``sin`` are full fp32
        ``[max_pos, D]`` tables, ``positions`` int64 ``[T]`` within them."""
        if (
            x.dtype != torch.float32
            or not x.is_cpu
            or x.stride(1) != 1
            or x.shape[1] < num_heads * head_dim
            or positions.dtype != torch.int64
            or positions.shape != (x.shape[0],)
            or not positions.is_contiguous()
            or cos.shape != sin.shape
            or cos.shape[1] != head_dim
            or cos.dtype != torch.float32
            or sin.dtype != torch.float32
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            raise ValueError("rope_ needs fp32 rows, int64 positions, contiguous fp32 tables")
        self._rope(
            x.data_ptr(), x.shape[0], x.stride(0), num_heads, head_dim, positions.data_ptr(),
            cos.data_ptr(), sin.data_ptr(),
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for contiguous fp32 ``[T, 2I]``."""
        if gate_up.dtype != torch.float32 or not gate_up.is_cpu or not gate_up.is_contiguous():
            raise ValueError("silu_mul needs a contiguous CPU fp32 input")
        t, two_i = gate_up.shape
        out = torch.empty((t, two_i // 2), dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), t, two_i // 2, out.data_ptr(), torch.get_num_threads())
        return out


def _cpu_supported() -> bool:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _build(out: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise RuntimeError(f"no Python.h in {include} (install the Python development headers)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "kernels.c"
        src.write_text(SOURCE)
        lib = Path(tmp) / out.name
        proc = subprocess.run(
            [compiler, *FLAGS, f"-I{include}", str(src), "-o", str(lib), "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(lib, out)  # atomic: a concurrent process sees the old file or the new one


@cache
def load() -> CpuKernels | None:
    """The kernels for this process, compiled on first use (about a second) and cached on disk
    under ``$MESHSERVE_CACHE/kernels``; None where they cannot run here (no AVX2/FMA, no
    compiler or Python headers) or with ``MESHSERVE_CPU_KERNELS=0``."""
    if os.environ.get("MESHSERVE_CPU_KERNELS", "1") == "0":
        return None
    from gpu.gguf import cache_root

    return build(cache_root() / "kernels")


def build(folder: Path) -> CpuKernels | None:
    """Compile (unless ``folder`` already holds this source's build) and load the kernels;
    None, with a warning naming why, where that fails."""
    if not _cpu_supported():
        logger.info("CPU kernels need AVX2 and FMA; using plain torch ops")
        return None
    key = SOURCE + " ".join(FLAGS) + sys.version + sysconfig.get_paths()["include"]
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    path = folder / f"{MODULE}.{digest}{suffix}"
    try:
        if not path.is_file():
            _build(path)
        loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
        spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
        if spec is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return CpuKernels(module, path)
    except (OSError, RuntimeError, ImportError) as exc:
        logger.warning("CPU kernels unavailable, using plain torch ops: %s", exc)
        return None
