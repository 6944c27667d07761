/* ---------------------------------------------------------------- fused decode step */

/*
 * Every decoder layer of a step whose T tokens are all single-token decodes (token t belongs
 * to sequence t), in one call: the same kernels, in the same order, on the same kind of
 * buffers as gpu.model's per-op path, so a sequence gets the same bits either way, minus the
 * ~300 Python calls per step between them (at batch 1 those cost as much as the matmuls).
 *
 * `table` holds LAYER_FIELDS int64s per layer (pointers stored as integers): the two norms,
 * Qwen3's q and k head norms (0 where the model has none), then four linears; a linear is
 * (kind, weight, scale, bias) with kind LIN_F32 (packed fp32, no scale) or a block kind of
 * blocks.c (LIN_INT8 with per-row scales; LIN_Q4_0 / Q4_1 / Q8_0, GGUF blocks, no scale).
 * A mixture-of-experts layer's last field is the address of its moe.c descriptor (its
 * gate_up and down fields unused): its MLP is moe_mlp, on moe_scratch and moe_iscratch.
 * `kv` holds each layer's cache [pages, 2, ps, Hkv, D].
 *
 * hidden [T, H] is the residual stream (embeddings in, updated in place); the last layer's MLP
 * output goes to delta [T, H], for the final norm to add in. scratch holds
 * T * (2H + QKV + Hq*D + 3I) floats.
 *
 * `reduce` (NULL on one device) is a tensor-parallel rank's all-reduce, `reduce(ctx, data, n)`:
 * called in place on the attention output and on the MLP output of each layer, the two
 * partial sums of its row-parallel o_proj and down_proj (gpu/parallel): shm_allreduce, or a
 * Python callback (Gloo). A nonzero return (a rank lost) ends the call with that code.
 */
typedef int (*reduce_fn)(i64* ctx, float* data, i64 n);
enum {
    F_IN_NORM, F_POST_NORM, F_Q_NORM, F_K_NORM,
    F_QKV, F_O = F_QKV + 4, F_GATE_UP = F_O + 4, F_DOWN = F_GATE_UP + 4, F_MOE = F_DOWN + 4,
    LAYER_FIELDS
};

int decode_layers(const i64* table, const i64* kv, i64 nlayers, float* hidden, float* delta,
                   i64 T, i64 H, i64 Hq, i64 Hkv, i64 D, i64 I, float eps,
                   const i64* positions, const float* cos_t, const float* sin_t,
                   const i64* rows, const i64* append_pages, const i64* append_offsets,
                   const int32_t* kv_indptr, const int32_t* kv_indices, const int32_t* last_len,
                   i64 ps, float scale, float* scratch, int nthreads, reduce_fn reduce,
                   i64* reduce_ctx, float* moe_scratch, i64* moe_iscratch) {
    const i64 QKV = (Hq + 2 * Hkv) * D, QD = Hq * D;
    float* x = scratch;              /* [T, H]: the normalised input of a matmul */
    float* qkv = x + T * H;          /* [T, QKV] */
    float* attn = qkv + T * QKV;     /* [T, Hq * D] */
    float* o = attn + T * QD;        /* [T, H] */
    float* gu = o + T * H;           /* [T, 2I] */
    float* act = gu + T * 2 * I;     /* [T, I] */
    const float* d = NULL;
    for (i64 l = 0; l < nlayers; ++l) {
        const i64* f = table + l * LAYER_FIELDS;
        float* cache = (float*)(intptr_t)kv[l];
        rms_norm(hidden, d, T, H, (const float*)(intptr_t)f[F_IN_NORM], eps, x, nthreads);
        table_linear(f + F_QKV, x, T, H, QKV, qkv, nthreads);
        if (f[F_Q_NORM])
            qk_norm(qkv, T, QKV, Hq, Hkv, D, (const float*)(intptr_t)f[F_Q_NORM],
                    (const float*)(intptr_t)f[F_K_NORM], eps);
        rope(qkv, T, QKV, Hq + Hkv, D, positions, cos_t, sin_t);
        paged_decode_attention(qkv, QKV, qkv + QD, qkv + QD + Hkv * D, QKV, attn, QD, rows, T,
                               cache, append_pages, append_offsets, kv_indptr, kv_indices,
                               last_len, Hq, Hkv, D, ps, scale, nthreads);
        table_linear(f + F_O, attn, T, QD, H, o, nthreads);
        if (reduce && reduce(reduce_ctx, o, T * H)) return -1;
        rms_norm(hidden, o, T, H, (const float*)(intptr_t)f[F_POST_NORM], eps, x, nthreads);
        if (f[F_MOE]) {
            moe_mlp((const i64*)(intptr_t)f[F_MOE], x, T, H, delta, moe_scratch, moe_iscratch,
                    nthreads);
        } else {
            table_linear(f + F_GATE_UP, x, T, H, 2 * I, gu, nthreads);
            silu_mul(gu, T, I, act, nthreads);
            table_linear(f + F_DOWN, act, T, I, H, delta, nthreads);
        }
        if (reduce && reduce(reduce_ctx, delta, T * H)) return -1;
        d = delta;
    }
    return 0;
}
