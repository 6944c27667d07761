/* ---------------------------------------------------------------- linear layers */

/*
 * y = (x @ W.T) * scale + bias for fp32 x [M, K] and W [N, K] in fp32 (no scale; the macro
 * also takes other weight types with a per-row scale). W is packed in blocks of 8 output rows:
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
DEFINE_LINEAR(f32_linear, float, _mm256_loadu_ps)
