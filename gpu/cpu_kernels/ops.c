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

/* Qwen3's q/k norm, in place on the first Hq + Hkv heads of D at x + t * ld: each q head
   normalised over D with wq, each k head with wk. */
void qk_norm(float* x, i64 T, i64 ld, i64 Hq, i64 Hkv, i64 D, const float* wq, const float* wk,
             float eps) {
    for (i64 t = 0; t < T; ++t)
        for (i64 h = 0; h < Hq + Hkv; ++h) {
            float* a = x + t * ld + h * D;
            rms_norm_row(a, h < Hq ? wq : wk, eps, D, a);  /* (reads each lane before its write) */
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
