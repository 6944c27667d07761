/* ---------------------------------------------------------------- block dot products (ISA) */
/*
 * Compiled twice (build.py): QISA avx2 (maddubs + madd, the tested default) and QISA vnni
 * (AVX-512 VNNI's dpbusd, on 256-bit vectors and for one row of x against grouped weights on
 * 512-bit ones, under a target pragma), picked at run time.
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

/* acc + the u8 * s8 dots of 4 adjacent bytes, per int32 lane. */
static inline __m256i QFN(dot_acc)(__m256i acc, __m256i u, __m256i s) {
#if QVNNI
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* A grouped record's bytes (repacked 4-bit kinds and Q8_0, see blocks.c): 8 fp16 scales, for
   Q4_1 8 fp16 mins, then the codes. */
static inline i64 QFN(x8_record_bytes)(int q41, int q80) { return q80 ? 272 : q41 ? 160 : 144; }

/* Block b's record: hints the bytes LIN_PREFETCH ahead if asked, loads the scales (and Q4_1's
   mins; zero otherwise) and returns where its codes start. */
static inline __attribute__((always_inline)) const uint8_t* QFN(x8_record)(
    const uint8_t* grp, i64 b, i64 rec, int q41, int prefetch, __m256* d8, __m256* m8) {
    const uint8_t* p = grp + b * rec;
    if (prefetch)
        for (i64 o = 0; o < rec; o += 64)
            _mm_prefetch((const char*)(p + LIN_PREFETCH + o), _MM_HINT_T1);
    *d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    *m8 = q41 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16))) : _mm256_setzero_ps();
    return p + (q41 ? 32 : 16);
}

#if QVNNI
/*
 * dot_x8 for one row of x on 512-bit vectors: each zmm holds two of a record's 32-byte code
 * vectors (j, j + 1), and one vpermd spreads x's 4-byte pieces j and j + 1 over its two
 * halves, so a block takes half the instructions of the 256-bit loop. The two halves' int32
 * lanes are added at the end of the block: the same integer as the 256-bit loop's, so the
 * same bits after it (integer sums are exact).
 */
static inline __attribute__((always_inline)) void QFN(dot_x8_one)(
    const int kind, const uint8_t* grp, const xblock* xq, i64 nb, float* out, int nvalid,
    int prefetch) {
    const int q41 = kind == LIN_Q4_1X8, q80 = kind == LIN_Q8_0X8;
    const i64 rec = QFN(x8_record_bytes)(q41, q80);
    __m256 acc = _mm256_setzero_ps(), summ = _mm256_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i pick[4] = {
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
        _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5),
        _mm512_setr_epi32(6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7),
    };
    for (i64 b = 0; b < nb; ++b) {
        __m256 d8, m8;
        const uint8_t* c = QFN(x8_record)(grp, b, rec, q41, prefetch, &d8, &m8);
        const xblock* x = xq + b;
        const __m512i xz = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)x->qs));
        __m512i dot = _mm512_setzero_si512();
        if (q80) {  /* (x + 128) . w - 128 * sum(w): x made unsigned, w's signs kept */
            const __m512i xu = _mm512_xor_si512(xz, _mm512_set1_epi8((char)0x80));
            __m512i wsum = _mm512_setzero_si512();
            for (int j = 0; j < 4; ++j) {
                const __m512i w = _mm512_loadu_si512((const void*)(c + 64 * j));
                dot = _mm512_dpbusd_epi32(dot, _mm512_permutexvar_epi32(pick[j], xu), w);
                wsum = _mm512_dpbusd_epi32(wsum, _mm512_set1_epi8(1), w);
            }
            dot = _mm512_sub_epi32(dot, _mm512_slli_epi32(wsum, 7));
        } else {  /* zmm k of the codes: vectors 2k, 2k + 1 (low nibbles: j, high: j + 4) */
            for (int k = 0; k < 2; ++k) {
                const __m512i v = _mm512_loadu_si512((const void*)(c + 64 * k));
                dot = _mm512_dpbusd_epi32(dot, _mm512_and_si512(v, low),
                                          _mm512_permutexvar_epi32(pick[k], xz));
                dot = _mm512_dpbusd_epi32(dot, _mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                          _mm512_permutexvar_epi32(pick[k + 2], xz));
            }
        }
        __m256i d = _mm256_add_epi32(_mm512_castsi512_si256(dot),
                                     _mm512_extracti64x4_epi64(dot, 1));
        if (!q41 && !q80) d = _mm256_sub_epi32(d, _mm256_set1_epi32(8 * x->sum));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(x->d)), _mm256_cvtepi32_ps(d), acc);
        if (q41) summ = _mm256_fmadd_ps(m8, _mm256_set1_ps(x->s), summ);
    }
    float v[8];
    _mm256_storeu_ps(v, q41 ? _mm256_add_ps(acc, summ) : acc);
    for (int j = 0; j < nvalid; ++j) out[j] = v[j];
}
#endif

/* out[r * ldo + j] = dot(weight row j of a group of 8, x row r) for R rows of x (repacked
   4-bit kinds, see blocks.c), j < nvalid. One accumulator lane per weight row, over blocks in
   order, whatever R. `prefetch`: hint the weight bytes LIN_PREFETCH ahead (the first call on a
   group does; the others read it from L1). */
static inline __attribute__((always_inline)) void QFN(dot_x8)(
    const int kind, const int R, const uint8_t* grp, const xblock* xq, i64 ldq, i64 nb,
    float* out, i64 ldo, int nvalid, int prefetch) {
#if QVNNI
    if (R == 1) {
        QFN(dot_x8_one)(kind, grp, xq, nb, out, nvalid, prefetch);
        return;
    }
#endif
    const int q41 = kind == LIN_Q4_1X8, q80 = kind == LIN_Q8_0X8;
    const i64 rec = QFN(x8_record_bytes)(q41, q80);
    __m256 acc[4], summ[4];
    for (int r = 0; r < R; ++r) acc[r] = summ[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (i64 b = 0; b < nb; ++b) {
        __m256 d8, m8;
        const uint8_t* c = QFN(x8_record)(grp, b, rec, q41, prefetch, &d8, &m8);
        __m256i w[8], sw[8];  /* Q8_0: |w|, and w for its signs */
        if (q80) {
            for (int j = 0; j < 8; ++j) {
                sw[j] = _mm256_loadu_si256((const __m256i*)(c + 32 * j));
                w[j] = _mm256_sign_epi8(sw[j], sw[j]);
            }
        } else {
            for (int j = 0; j < 4; ++j) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(c + 32 * j));
                w[j] = _mm256_and_si256(v, low);
                w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
        }
        for (int r = 0; r < R; ++r) {
            const xblock* x = xq + r * ldq + b;
            __m256i dot = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) {
                int32_t four;
                memcpy(&four, x->qs + 4 * j, 4);
                __m256i xs = _mm256_set1_epi32(four);
                if (q80) xs = _mm256_sign_epi8(xs, sw[j]);
                dot = QFN(dot_acc)(dot, w[j], xs);
            }
            if (!q41 && !q80) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * x->sum));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(x->d)),
                                     _mm256_cvtepi32_ps(dot), acc[r]);
            if (q41) summ[r] = _mm256_fmadd_ps(m8, _mm256_set1_ps(x->s), summ[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        float v[8];
        _mm256_storeu_ps(v, q41 ? _mm256_add_ps(acc[r], summ[r]) : acc[r]);
        for (int j = 0; j < nvalid; ++j) out[r * ldo + j] = v[j];
    }
}

/* Rows [m0, m1) of x against the weight rows of groups [g0, g1) (repacked 4-bit kinds). */
static inline __attribute__((always_inline)) void QFN(x8_rows_kind)(
    const int kind, const xblock* xq, i64 ldq, i64 m0, i64 m1, const uint8_t* w, i64 group_bytes,
    i64 nb, i64 N, i64 g0, i64 g1, const float* bias, float* y, i64 ldy) {
    for (i64 mc = m0; mc < m1; mc += LIN_M_CHUNK) {
        const i64 mend = imin(m1, mc + LIN_M_CHUNK), m4 = mc + (mend - mc) / 4 * 4;
        for (i64 g = g0; g < g1; ++g) {
            const uint8_t* grp = w + g * group_bytes;
            const i64 n = g * 8;
            const int nvalid = (int)imin(8, N - n);
            for (i64 m = mc; m < m4; m += 4)
                QFN(dot_x8)(kind, 4, grp, xq + m * ldq, ldq, nb, y + m * ldy + n, ldy, nvalid,
                            m == mc);
            for (i64 m = m4; m < mend; ++m)
                QFN(dot_x8)(kind, 1, grp, xq + m * ldq, ldq, nb, y + m * ldy + n, ldy, nvalid,
                            m == mc);
            if (bias)
                for (i64 m = mc; m < mend; ++m)
                    for (int j = 0; j < nvalid; ++j) y[m * ldy + n + j] += bias[n + j];
        }
    }
}

static void QFN(x8_rows)(int kind, const xblock* xq, i64 ldq, i64 m0, i64 m1, const uint8_t* w,
                         i64 group_bytes, i64 nb, i64 N, i64 g0, i64 g1, const float* bias,
                         float* y, i64 ldy) {
    if (kind == LIN_Q4_1X8)
        QFN(x8_rows_kind)(LIN_Q4_1X8, xq, ldq, m0, m1, w, group_bytes, nb, N, g0, g1, bias, y, ldy);
    else if (kind == LIN_Q8_0X8)
        QFN(x8_rows_kind)(LIN_Q8_0X8, xq, ldq, m0, m1, w, group_bytes, nb, N, g0, g1, bias, y, ldy);
    else
        QFN(x8_rows_kind)(LIN_Q4_0X8, xq, ldq, m0, m1, w, group_bytes, nb, N, g0, g1, bias, y, ldy);
}

/* out[r] = dot(weight row, x row r) for R rows of x (blocks xq + r * ldq), before scale and
   bias. The same operations per (row, block) whatever R: the bits do not depend on it.
   `prefetch` as for dot_x8 (a block is at most 34 bytes: one hint per block covers every
   line). */
static inline __attribute__((always_inline)) void QFN(dot_rows)(
    const int kind, const int R, const uint8_t* wrow, const xblock* xq, i64 ldq, i64 nb,
    float* out, i64 ldo, int prefetch) {
    __m256 acc[4];
    float summ[4];
    for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_setzero_ps();
        summ[r] = 0.0f;
    }
    const i64 bb = block_bytes(kind);
    for (i64 b = 0; b < nb; ++b) {
        const uint8_t* p = wrow + b * bb;
        if (prefetch) _mm_prefetch((const char*)(p + LIN_PREFETCH), _MM_HINT_T1);
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
                QFN(dot_rows)(kind, 4, wrow, xq + m * ldq, ldq, nb, y + m * ldy + n, ldy,
                              m == mc);
            for (i64 m = m4; m < mend; ++m)
                QFN(dot_rows)(kind, 1, wrow, xq + m * ldq, ldq, nb, y + m * ldy + n, ldy,
                              m == mc);
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
