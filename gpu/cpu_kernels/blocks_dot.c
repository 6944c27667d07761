/* ---------------------------------------------------------------- block dot products (ISA) */
/*
 * Compiled twice (build.py): QISA avx2 (maddubs + madd, the tested default) and QISA vnni
 * (AVX-512 VNNI's dpbusd on 256-bit vectors, under a target pragma), picked at run time.
 */
#define QCAT_(a, b) a##_##b
#define QCAT(a, b) QCAT_(a, b)
#define QFN(name) QCAT(name, QISA)

/* 8 int32 lanes, each the sum of 4 adjacent u8 * s8 products. */
static inline __m256i QFN(dot_us)(__m256i u, __m256i s) {
#if QVNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* out[r] = dot(weight row, x row r) for R rows of x (blocks xq + r * ldq), before scale and
   bias. The same operations per (row, block) whatever R: the bits do not depend on it. */
static inline __attribute__((always_inline)) void QFN(dot_rows)(
    const int kind, const int R, const uint8_t* wrow, const xblock* xq, i64 ldq, i64 nb,
    float* out, i64 ldo) {
    __m256 acc[4];
    float summ[4];
    for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_setzero_ps();
        summ[r] = 0.0f;
    }
    const i64 bb = block_bytes(kind);
    for (i64 b = 0; b < nb; ++b) {
        const uint8_t* p = wrow + b * bb;
        __m256i wv;
        float dw = 1.0f, mw = 0.0f;
        if (kind == LIN_Q4_0) {
            dw = f16_at(p);
            wv = _mm256_sub_epi8(unpack_nibbles(p + 2), _mm256_set1_epi8(8));
        } else if (kind == LIN_Q4_1) {
            dw = f16_at(p);
            mw = f16_at(p + 2);
            wv = unpack_nibbles(p + 4);
        } else if (kind == LIN_Q8_0) {
            dw = f16_at(p);
            wv = _mm256_loadu_si256((const __m256i*)(p + 2));
        } else {
            wv = _mm256_loadu_si256((const __m256i*)p);
        }
        if (kind == LIN_Q4_1) {  /* codes 0..15: already unsigned */
            for (int r = 0; r < R; ++r) {
                const xblock* x = xq + r * ldq + b;
                const __m256i xs = _mm256_loadu_si256((const __m256i*)x->qs);
                const __m256 dot = _mm256_cvtepi32_ps(QFN(dot_us)(wv, xs));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x->d), dot, acc[r]);
                summ[r] = summ[r] + mw * x->s;
            }
        } else {  /* signed x signed: |w| times x with w's sign */
            const __m256i aw = _mm256_sign_epi8(wv, wv);
            for (int r = 0; r < R; ++r) {
                const xblock* x = xq + r * ldq + b;
                const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)x->qs), wv);
                const __m256 dot = _mm256_cvtepi32_ps(QFN(dot_us)(aw, xs));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x->d), dot, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        float v = hsum8(acc[r]);
        if (kind == LIN_Q4_1) v = v + summ[r];
        out[r * ldo] = v;
    }
}

/* Rows [m0, m1) of x (quantized: xq, ldq blocks per row) against weight rows [n0, n1). */
static inline __attribute__((always_inline)) void QFN(block_rows_kind)(
    const int kind, const xblock* xq, i64 ldq, i64 m0, i64 m1, const uint8_t* w, i64 row_bytes,
    i64 nb, i64 n0, i64 n1, const float* scale, const float* bias, float* y, i64 ldy) {
    for (i64 mc = m0; mc < m1; mc += LIN_M_CHUNK) {
        const i64 mend = imin(m1, mc + LIN_M_CHUNK), m4 = mc + (mend - mc) / 4 * 4;
        for (i64 n = n0; n < n1; ++n) {
            const uint8_t* wrow = w + n * row_bytes;
            for (i64 m = mc; m < m4; m += 4)
                QFN(dot_rows)(kind, 4, wrow, xq + m * ldq, ldq, nb, y + m * ldy + n, ldy);
            for (i64 m = m4; m < mend; ++m)
                QFN(dot_rows)(kind, 1, wrow, xq + m * ldq, ldq, nb, y + m * ldy + n, ldy);
            for (i64 m = mc; m < mend; ++m) {
                float v = y[m * ldy + n];
                if (scale) v = v * scale[n];
                if (bias) v = v + bias[n];
                y[m * ldy + n] = v;
            }
        }
    }
}

static void QFN(block_rows)(int kind, const xblock* xq, i64 ldq, i64 m0, i64 m1,
                            const uint8_t* w, i64 row_bytes, i64 nb, i64 n0, i64 n1,
                            const float* scale, const float* bias, float* y, i64 ldy) {
    switch (kind) {
        case LIN_Q4_0:
            QFN(block_rows_kind)(LIN_Q4_0, xq, ldq, m0, m1, w, row_bytes, nb, n0, n1, scale, bias,
                                 y, ldy);
            break;
        case LIN_Q4_1:
            QFN(block_rows_kind)(LIN_Q4_1, xq, ldq, m0, m1, w, row_bytes, nb, n0, n1, scale, bias,
                                 y, ldy);
            break;
        case LIN_Q8_0:
            QFN(block_rows_kind)(LIN_Q8_0, xq, ldq, m0, m1, w, row_bytes, nb, n0, n1, scale, bias,
                                 y, ldy);
            break;
        default:
            QFN(block_rows_kind)(LIN_INT8, xq, ldq, m0, m1, w, row_bytes, nb, n0, n1, scale, bias,
                                 y, ldy);
    }
}

#undef QFN
#undef QCAT
#undef QCAT_
