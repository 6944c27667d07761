/* ---------------------------------------------------------------- block-quantized linears */

/*
 * y = x @ W.T (* scale) + bias with W in blocks of 32 weights along K, as GGUF stores them
 * (ggml's block_q4_0 / block_q4_1 / block_q8_0, each row a run of blocks), or int8 with one
 * scale per output row (LIN_INT8: [N][ceil(K/32)*32], zero padded). x is first quantized per
 * row and block of 32 to int8 (one fp32 scale d = amax/127 per block, and s = d * sum(q) for
 * Q4_1's offset term), as ggml's own CPU path does (Q8_0 / Q8_1 activations); a block's dot
 * product is then an integer multiply-add (maddubs + madd, or VNNI's dpbusd: the same int32
 * lanes), scaled into an fp32 accumulator.
 *
 * Determinism: y[m][n] is one accumulator over blocks in order, a fixed horizontal sum, then
 * the Q4_1 offset sum, * scale, + bias; x's quantization depends on its own row only. So a row
 * gets the same bits whatever shares its batch, whatever the tile or thread split, and on the
 * AVX2 and VNNI paths alike (integer sums are exact).
 */
enum { LIN_F32 = 0, LIN_INT8 = 1, LIN_Q4_0 = 2, LIN_Q4_1 = 3, LIN_Q8_0 = 4, LIN_Q4_0X8 = 5,
       LIN_Q4_1X8 = 6, LIN_Q8_0X8 = 7 };
#define QK 32
/*
 * Bytes ahead of a block kernel's weight loads that it asks to have in L2 (prefetcht1). A
 * thread reads its rows (or groups of 8 rows) as one sequential stream, and at batch 1 this
 * VM's hardware prefetcher alone kept too few misses in flight: the same kernels ran 1.6x
 * (int8 rows) and 1.7x (Q4_1 groups) faster in a decode step with the hint 8 KB ahead (4 KB:
 * a little slower; 16 KB: no faster). A hint past the weight's end only fetches lines no one
 * reads. Results do not depend on it.
 */
#define LIN_PREFETCH 8192

typedef struct {
    float d;      /* scale: x ~= d * qs */
    float s;      /* d * sum(qs), for Q4_1's min term */
    int32_t sum;  /* sum(qs), for Q4_0's offset of 8 */
    int8_t qs[QK];
} xblock;

/*
 * Kinds repacked at load (LIN_Q4_0X8 / LIN_Q4_1X8 / LIN_Q8_0X8; gpu.quant.repack_x8): rows in
 * groups of 8, and per group and block of 32 one record: the 8 rows' fp16 d (and m), then the
 * codes as 4 vectors of 32 bytes. Byte 4r + t of vector j holds row r's codes k = 4j + t (low
 * nibble) and k = 4(j + 4) + t (high nibble). Broadcasting 4 bytes of x then gives, per int32
 * lane, one row's 4-product dot: 8 rows per multiply-add and no horizontal sums (llama.cpp's
 * repacked Q4_0x8 layout does the same). LIN_Q8_0X8 likewise: the 8 fp16 d, then 8 vectors
 * of 32 signed codes, byte 4r + t of vector j being row r's code k = 4j + t.
 */

/* Bytes per block of 32 weights of each kind (0: not a block kind). */
static inline i64 block_bytes(int kind) {
    switch (kind) {
        case LIN_INT8: return 32;
        case LIN_Q4_0: return 18;
        case LIN_Q4_1: return 20;
        case LIN_Q8_0: return 34;
        case LIN_Q4_0X8: return 18;  /* per row: a group's record is 8 rows' bytes */
        case LIN_Q4_1X8: return 20;
        case LIN_Q8_0X8: return 34;
        default: return 0;
    }
}

static inline float f16_at(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* One row of K floats -> ceil(K/32) blocks (the tail zero padded). Rounding: to nearest even
   (cvtps_epi32 under the default MXCSR), i.e. torch.round; gpu.quant.fake_quantize_blocks is
   the same computation in torch. */
static void quantize_x_row(const float* x, i64 K, xblock* out) {
    const i64 nb = (K + QK - 1) / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (i64 b = 0; b < nb; ++b) {
        float tmp[QK];
        const float* src = x + b * QK;
        if ((b + 1) * QK > K) {
            memset(tmp, 0, sizeof tmp);
            memcpy(tmp, src, (size_t)(K - b * QK) * sizeof(float));
            src = tmp;
        }
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_loadu_ps(src + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float d = _mm_cvtss_f32(m) / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        __m256i q[4];
        __m256i sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
            q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
            sum = _mm256_add_epi32(sum, q[i]);
        }
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        __m256i p01 = _mm256_packs_epi32(q[0], q[1]);
        __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
        __m256i p = _mm256_packs_epi16(p01, p23);
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)out[b].qs, p);
        out[b].d = d;
        out[b].sum = _mm_cvtsi128_si32(s4);
        out[b].s = d * (float)out[b].sum;
    }
}

/* 32 4-bit codes of a block (low nibbles: elements 0..15, high: 16..31) as bytes 0..15. */
static inline __m256i unpack_nibbles(const uint8_t* qs) {
    const __m128i t = _mm_loadu_si128((const __m128i*)qs);
    const __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}
