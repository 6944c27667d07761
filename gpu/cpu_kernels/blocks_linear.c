/* ---------------------------------------------------------------- block linears: entry */

/* 1: the VNNI path runs (the CPU has AVX-512 VNNI, VL and BW, and MESHSERVE_CPU_VNNI is not
   0). */
static int use_vnni = -1;

static int vnni_enabled(void) {
    if (use_vnni < 0) {
        const char* env = getenv("MESHSERVE_CPU_VNNI");
        int want = !(env && env[0] == '0');
        __builtin_cpu_init();
        use_vnni = want && __builtin_cpu_supports("avx512vnni") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
    }
    return use_vnni;
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W.T for a block kind (see blocks.c).
   x is quantized first, on the calling thread: that is 1/N of the matmul's work, and a barrier
   between a parallel quantization and the matmul costs a scheduler time slice on a busy
   machine (a thread still descheduled) - more than the whole matmul at batch 1. */
void block_linear(int kind, const float* x, i64 M, i64 K, i64 ldx, const uint8_t* w, i64 N,
                  const float* scale, const float* bias, float* y, i64 ldy, int nthreads) {
    const i64 nb = (K + QK - 1) / QK, row_bytes = nb * block_bytes(kind);
    xblock* xq = malloc((size_t)(M * nb) * sizeof(xblock) + 1);
    if (!xq) return;  /* the Python side checks sizes; an allocation failure leaves y unset */
    for (i64 m = 0; m < M; ++m) quantize_x_row(x + m * ldx, K, xq + m * nb);
    const int vnni = vnni_enabled();
    int parallel = nthreads > 1 && M * N * K >= (i64)1 << 17;
    const int x8 = kind == LIN_Q4_0X8 || kind == LIN_Q4_1X8 || kind == LIN_Q8_0X8;
    _Pragma("omp parallel num_threads(nthreads) if (parallel)")
    {
        i64 lo, hi;
        if (x8) {  /* whole groups of 8 rows */
            split((N + 7) / 8, 1, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
            if (lo < hi) {
                if (vnni)
                    x8_rows_vnni(kind, xq, nb, 0, M, w, 8 * row_bytes, nb, N, lo, hi, bias, y, ldy);
                else
                    x8_rows_avx2(kind, xq, nb, 0, M, w, 8 * row_bytes, nb, N, lo, hi, bias, y, ldy);
            }
        } else {
        split(N, 4, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        if (lo < hi) {
            if (vnni)
                block_rows_vnni(kind, xq, nb, 0, M, w, row_bytes, nb, lo, hi, scale, bias, y, ldy);
            else
                block_rows_avx2(kind, xq, nb, 0, M, w, row_bytes, nb, lo, hi, scale, bias, y, ldy);
        }
        }
    }
    free(xq);
}

/* The activation quantization alone (tests hold it to gpu.quant's torch version). */
void quantize_x(const float* x, i64 M, i64 K, xblock* out) {
    const i64 nb = (K + QK - 1) / QK;
    for (i64 m = 0; m < M; ++m) quantize_x_row(x + m * K, K, out + m * nb);
}
