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
 * KV head): the G query heads sharing a KV head score each key while it is in L1. With fewer
 * items than 4 per thread (a batch of one has Hkv = 3 here: a 2 : 1 split) an item is one
 * query head instead, which evens the threads' shares; a head's result is computed the same
 * way in either case, so its bits do not depend on the batch.
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
    /* From ~30 keys per head of SmolLM2 on: two threads beat one by more than the fork. */
    int parallel = nthreads > 1 && work * Hq * D >= 16384;
    const i64 per_kv = B * Hkv < 4 * (i64)nthreads ? G : 1;  /* items per (sequence, KV head) */
    #pragma omp parallel num_threads(nthreads) if (parallel)
    {
        float* p = (float*)malloc(G * (max_len + 8) * sizeof(float));
        i64 lo, hi;
        split(B * Hkv * per_kv, 1, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (i64 item = lo; item < hi; ++item) {
            const i64 bk = item / per_kv, part = item % per_kv;
            const i64 b = bk / Hkv, kvh = bk % Hkv;
            const i64 g0 = G * part / per_kv, g1 = G * (part + 1) / per_kv;
            const int32_t* pages = kv_indices + kv_indptr[b];
            i64 npages = kv_indptr[b + 1] - kv_indptr[b];
            i64 L = (npages - 1) * ps + last_len[b];
            const float* q0 = q + rows[b] * q_ld + kvh * G * D;
            float mx[64];  /* G <= 64 (checked by the caller) */
            for (i64 g = g0; g < g1; ++g) mx[g] = -INFINITY;
            for (i64 pg = 0, t = 0; pg < npages; ++pg) {
                const float* kbase = cache + (i64)pages[pg] * page_stride + kvh * D;
                i64 n = imin(ps, L - pg * ps);
                for (i64 o = 0; o < n; ++o, ++t)
                    for (i64 g = g0; g < g1; ++g) {
                        float s = dot(q0 + g * D, kbase + o * tok, D) * scale;
                        p[g * (max_len + 8) + t] = s;
                        if (s > mx[g]) mx[g] = s;
                    }
            }
            for (i64 g = g0; g < g1; ++g) {
                float* pg_ = p + g * (max_len + 8);
                float sum = softmax_numerators(pg_, L, mx[g]);
                weighted_values(pg_, cache, pages, L, ps, page_stride, tok, ps * tok + kvh * D, D,
                                1.0f / sum, out + rows[b] * out_ld + (kvh * G + g) * D);
            }
        }
        free(p);
    }
}
