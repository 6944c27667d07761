/* ---------------------------------------------------------------- mixture of experts */

/* One linear of a table (decoder.c's layers, the experts below): (kind, weight, scale, bias)
   with kind LIN_F32 (packed fp32, no scale) or a block kind of blocks.c. */
static void table_linear(const i64* lin, const float* x, i64 M, i64 K, i64 N, float* y,
                         int nthreads) {
    const float* scale = (const float*)(intptr_t)lin[2];
    const float* bias = (const float*)(intptr_t)lin[3];
    if (lin[0] != LIN_F32)
        block_linear((int)lin[0], x, M, K, K, (const uint8_t*)(intptr_t)lin[1], N, scale, bias, y,
                     N, nthreads);
    else
        f32_linear(x, M, K, K, (const float*)(intptr_t)lin[1], N, NULL, bias, y, N, nthreads);
}

/*
 * A sparse mixture-of-experts MLP (gpu/moe.py) over T normalised rows x [T, H], in one call,
 * the same steps as the module's torch path: the router's logits (a linear), a softmax over
 * the E experts, each token's k most probable (the lower expert of two equal ones first), their
 * weights renormalised to sum to 1 where `renormalise`; then each expert once, in ascending
 * order, over its tokens gathered in ascending order: gate/up, SwiGLU, down, each row scaled
 * by its token's weight and added into out [T, H] (zeroed here). A shared expert (Qwen2-MoE)
 * then adds sigmoid(x . shared_gate) times its output.
 *
 * `moe` holds MOE_FIELDS int64s (pointers stored as integers): E, k, renormalise, each
 * expert's intermediate size I, the router's linear, the address of the experts' table
 * (E rows of two linears: gate_up [2I, H], down [H, I]), the shared expert's intermediate
 * size (0: none), its two linears and the address of its gate vector [H].
 * scratch: T * (E + 2H + 3 max(I, shared I) + 2k) floats; iscratch: 2 E + 2 T k int64s.
 */
enum {
    MOE_E, MOE_K, MOE_RENORM, MOE_I, MOE_ROUTER, MOE_EXPERTS = MOE_ROUTER + 4, MOE_SHARED_I,
    MOE_SHARED, MOE_SHARED_GATE = MOE_SHARED + 8, MOE_FIELDS
};

/* `logits` [E] become the probabilities (in place); the k best of those, as torch.topk picks
   them (two that round to one probability: the lower expert first). */
static void moe_route(float* logits, i64 E, i64 k, int renorm, i64* experts, float* weights) {
    float top = logits[0], sum = 0.0f;
    for (i64 e = 1; e < E; ++e) top = logits[e] > top ? logits[e] : top;
    for (i64 e = 0; e < E; ++e) {
        logits[e] = expf(logits[e] - top);
        sum += logits[e];
    }
    for (i64 e = 0; e < E; ++e) logits[e] /= sum;
    for (i64 j = 0; j < k; ++j) { /* k is small: k passes */
        i64 best = -1;
        for (i64 e = 0; e < E; ++e) {
            int taken = 0;
            for (i64 i = 0; i < j; ++i) taken |= experts[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        experts[j] = best;
        weights[j] = logits[best];
    }
    if (renorm) {
        float total = 0.0f;
        for (i64 j = 0; j < k; ++j) total += weights[j];
        for (i64 j = 0; j < k; ++j) weights[j] /= total;
    }
}

void moe_mlp(const i64* moe, const float* x, i64 T, i64 H, float* out, float* scratch,
             i64* iscratch, int nthreads) {
    const i64 E = moe[MOE_E], k = moe[MOE_K], I = moe[MOE_I], IS = moe[MOE_SHARED_I];
    const i64* table = (const i64*)(intptr_t)moe[MOE_EXPERTS];
    const i64 Imax = I > IS ? I : IS;
    float* logits = scratch;          /* [T, E] */
    float* xg = logits + T * E;       /* [T, H]: an expert's rows of x */
    float* gu = xg + T * H;           /* [T, 2 Imax] */
    float* act = gu + T * 2 * Imax;   /* [T, Imax] */
    float* y = act + T * Imax;        /* [T, H] */
    float* weights = y + T * H;       /* [T, k] */
    float* pair_w = weights + T * k;  /* [T k]: the pairs' weights, grouped by expert */
    i64* counts = iscratch;           /* [E] */
    i64* cursor = counts + E;         /* [E] */
    i64* chosen = cursor + E;         /* [T, k] */
    i64* pair_t = chosen + T * k;     /* [T k]: the pairs' tokens, grouped by expert */
    table_linear(moe + MOE_ROUTER, x, T, H, E, logits, nthreads);
    memset(counts, 0, (size_t)E * sizeof(i64));
    for (i64 t = 0; t < T; ++t) {
        moe_route(logits + t * E, E, k, (int)moe[MOE_RENORM], chosen + t * k, weights + t * k);
        for (i64 j = 0; j < k; ++j) counts[chosen[t * k + j]]++;
    }
    for (i64 e = 0, at = 0; e < E; ++e) {
        cursor[e] = at;
        at += counts[e];
    }
    for (i64 t = 0; t < T; ++t)
        for (i64 j = 0; j < k; ++j) {
            i64 at = cursor[chosen[t * k + j]]++;
            pair_t[at] = t;
            pair_w[at] = weights[t * k + j];
        }
    memset(out, 0, (size_t)(T * H) * sizeof(float));
    for (i64 e = 0, start = 0; e < E; start += counts[e], ++e) {
        const i64 c = counts[e];
        if (!c) continue;
        for (i64 i = 0; i < c; ++i)
            memcpy(xg + i * H, x + pair_t[start + i] * H, (size_t)H * sizeof(float));
        const i64* lin = table + e * 8;
        table_linear(lin, xg, c, H, 2 * I, gu, nthreads);
        silu_mul(gu, c, I, act, nthreads);
        table_linear(lin + 4, act, c, I, H, y, nthreads);
        for (i64 i = 0; i < c; ++i) {
            float* o = out + pair_t[start + i] * H;
            const float w = pair_w[start + i];
            for (i64 h = 0; h < H; ++h) o[h] += y[i * H + h] * w;
        }
    }
    if (IS) {
        const float* gate = (const float*)(intptr_t)moe[MOE_SHARED_GATE];
        table_linear(moe + MOE_SHARED, x, T, H, 2 * IS, gu, nthreads);
        silu_mul(gu, T, IS, act, nthreads);
        table_linear(moe + MOE_SHARED + 4, act, T, IS, H, y, nthreads);
        for (i64 t = 0; t < T; ++t) {
            float dot = 0.0f;
            for (i64 h = 0; h < H; ++h) dot += x[t * H + h] * gate[h];
            const float g = 1.0f / (1.0f + expf(-dot));
            for (i64 h = 0; h < H; ++h) out[t * H + h] += g * y[t * H + h];
        }
    }
}
