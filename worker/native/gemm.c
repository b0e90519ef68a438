/* Prompt-sized products against a GGUF's blocks: a quantized-activation GEMM.
 *
 * Why: ggml.c's loops multiply one weight row against up to 8 activation rows at a time,
 * which suits decoding (a few rows, bound by reading the weights once) but not a prefill chunk
 * of hundreds of rows: there every 32 weights were decoded from their block again for each 8
 * rows, every 32 products paid a float conversion and two multiply-adds, and a 1,000-token
 * prompt went through mlx instead (dequantized pieces, float32 BLAS), ~2x llama-server's time.
 *
 * Here the columns are taken a tile of 16 at a time: the tile's blocks are decoded once into
 * 8-bit values interleaved by column (for each 4 consecutive weights, the 16 columns' 4 bytes
 * side by side) plus a float scale per column and half-group, then every 8 rows of the chunk
 * multiply against that tile while it is in cache: one vpdpbusd takes 4 activation bytes
 * (broadcast) against 16 columns' 4 weights, 64 products, and the scales are applied once per
 * 16 (or 32) weights per row, as 16-wide vectors. The activations are the pass's own 8-bit
 * form (per 32 values, ggml.c), so the result is, as there, exactly the product of the weights
 * with the rounded activations up to float32 sums; the arithmetic per group is ggml.c's
 * (u - z) * c_h * f - mt, only regrouped.
 *
 * Compiled where the build has AVX-512 VNNI (512-bit vectors); other builds keep ggml.c's
 * loops for every row count (KILN_GEMM is then undefined). Included by decode.c after ggml.c.
 */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define KILN_GEMM 1
#define GEMM_COLS 16
#define GEMM_ROWS 8
_Static_assert(GEMM_COLS == X16_ROWS, "a panel (panels.c) is one column tile");
/* Fewer rows than this go through ggml.c's tiles: decoding a column tile costs about what
 * multiplying it by a few rows does. */
#define GEMM_MIN_ROWS 16

/* One thread's decoded column tile, grown as needed and kept for its later products. */
static __thread uint8_t *gemm_buf;
static __thread size_t gemm_cap;

static void *gemm_scratch(size_t bytes) {
    if (bytes > gemm_cap) {
        free(gemm_buf);
        gemm_buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        gemm_cap = gemm_buf ? bytes : 0;
    }
    return gemm_buf;
}

/* Columns o0 .. o0 + n - 1 (n <= 16) of W decoded: u (K / 32 groups x 8 quads x 16 columns x 4
 * bytes), s0 / s1 the float scale f * c_h of each half-group and mt the offset (K / 32 x 16
 * each); columns past n are zero. */
static void gemm_pack(int type, const uint8_t *q, long rb, int o0, int n, int K, uint8_t *u, float *s0, float *s1, float *mt) {
    const int G = K / 32;
    for (int c = 0; c < GEMM_COLS; c++) {
        if (c >= n) {
            for (int g = 0; g < G; g++) {
                for (int k = 0; k < 8; k++) memset(u + ((size_t)(g * 8 + k) * GEMM_COLS + c) * 4, 0, 4);
                s0[g * GEMM_COLS + c] = s1[g * GEMM_COLS + c] = mt[g * GEMM_COLS + c] = 0.f;
            }
            continue;
        }
        const uint8_t *row = q + (size_t)(o0 + c) * rb;
        for (int g = 0; g < G; g++) {
            kiln_group grp = group_of(type, row, g);
            uint32_t v[8];
            _mm256_storeu_si256((__m256i *)v, group_u256(type, &grp));
            uint32_t *dst = (uint32_t *)(u + ((size_t)g * 8 * GEMM_COLS + c) * 4);
            for (int k = 0; k < 8; k++) dst[k * GEMM_COLS] = v[k];
            s0[g * GEMM_COLS + c] = grp.f * (float)grp.c0;
            s1[g * GEMM_COLS + c] = grp.f * (float)grp.c1;
            mt[g * GEMM_COLS + c] = grp.mt;
        }
    }
}

/* Rows r0 .. r0 + R - 1 (R <= 8) of the activations against one decoded tile: y[r * ldy + c]
 * for c < n. */
static inline __attribute__((always_inline)) void gemm_rows(int R, int type, int K, const kiln_act *a, int r0, const uint8_t *u, const float *s0,
                                                            const float *s1, const float *mt, float *y, long ldy, int n) {
    const int G = K / 32, z = ggml_zero_point(type), halves = type == KILN_Q6_K, offset = ggml_has_offset(type);
    __m512 acc[GEMM_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const __m512i *wv = (const __m512i *)(u + (size_t)g * 8 * GEMM_COLS * 4);
        const __m512i w0 = _mm512_load_si512(wv), w1 = _mm512_load_si512(wv + 1), w2 = _mm512_load_si512(wv + 2), w3 = _mm512_load_si512(wv + 3);
        const __m512i w4 = _mm512_load_si512(wv + 4), w5 = _mm512_load_si512(wv + 5), w6 = _mm512_load_si512(wv + 6), w7 = _mm512_load_si512(wv + 7);
        const __m512 sc0 = _mm512_load_ps(s0 + g * GEMM_COLS);
        const __m512 sc1 = halves ? _mm512_load_ps(s1 + g * GEMM_COLS) : sc0;
        const __m512 mv = offset ? _mm512_load_ps(mt + g * GEMM_COLS) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const long row = r0 + r;
            const int32_t *x = (const int32_t *)(a->gq + row * a->gq_ld + g * 32);
            const int32_t *is = a->gsum + row * a->gsum_ld + 2 * g;
            const float dx = a->gd[row * a->gd_ld + g];
            __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_set1_epi32(x[0]));
            i0 = _mm512_dpbusd_epi32(i0, w1, _mm512_set1_epi32(x[1]));
            i0 = _mm512_dpbusd_epi32(i0, w2, _mm512_set1_epi32(x[2]));
            i0 = _mm512_dpbusd_epi32(i0, w3, _mm512_set1_epi32(x[3]));
            __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w4, _mm512_set1_epi32(x[4]));
            i1 = _mm512_dpbusd_epi32(i1, w5, _mm512_set1_epi32(x[5]));
            i1 = _mm512_dpbusd_epi32(i1, w6, _mm512_set1_epi32(x[6]));
            i1 = _mm512_dpbusd_epi32(i1, w7, _mm512_set1_epi32(x[7]));
            const __m512 dv = _mm512_set1_ps(dx);
            if (halves) { /* Q6_K: each half its own scale */
                i0 = _mm512_sub_epi32(i0, _mm512_set1_epi32(z * is[0]));
                i1 = _mm512_sub_epi32(i1, _mm512_set1_epi32(z * is[1]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(sc0, dv), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(sc1, dv), acc[r]);
            } else {
                __m512i i = _mm512_add_epi32(i0, i1);
                if (z) i = _mm512_sub_epi32(i, _mm512_set1_epi32(z * (is[0] + is[1])));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(sc0, dv), acc[r]);
                if (offset) acc[r] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(dx * (float)(is[0] + is[1])), acc[r]);
            }
        }
    }
    const __mmask16 keep = (__mmask16)((1u << n) - 1);
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (size_t)r * ldy, keep, acc[r]);
}

static size_t gemm_tile_bytes(int K) { return (size_t)K * GEMM_COLS + 3 * sizeof(float) * (size_t)(K / 32) * GEMM_COLS; }

/* Column tile t (16 columns from 16 t) of W (N x K, `type` blocks) against all a->M rows,
 * into y (M x N, rows ldy apart). Returns -2 when its scratch cannot be had. */
static int gemm_column_tile(const kiln_qw *w, int t, const kiln_act *a, float *y, long ldy) {
    const int K = w->k, G = K / 32, o0 = t * GEMM_COLS, n = w->n - o0 < GEMM_COLS ? w->n - o0 : GEMM_COLS;
    uint8_t *u = gemm_scratch(gemm_tile_bytes(K));
    if (!u) return -2;
    float *s0 = (float *)(u + (size_t)K * GEMM_COLS), *s1 = s0 + (size_t)G * GEMM_COLS, *mt = s1 + (size_t)G * GEMM_COLS;
    if (w->type & KILN_X16) x16_gemm_pack(w->type, w->q + (size_t)t * x16_panel_bytes(w->type, K), K, u, s0, s1, mt); /* tile t is panel t */
    else gemm_pack(w->type, w->q, kiln_ggml_row_bytes(w->type, K), o0, n, K, u, s0, s1, mt);
    const int type = x16_base(w->type); /* the tile is the same for a matrix in panels */
    for (int r0 = 0; r0 < a->M; r0 += GEMM_ROWS) {
        int R = a->M - r0 < GEMM_ROWS ? a->M - r0 : GEMM_ROWS;
        float *yr = y + (size_t)r0 * ldy + o0;
        switch (type) { /* one instance per type, so the checks on it fold away */
        case KILN_Q4_K:
            if (R == GEMM_ROWS) gemm_rows(GEMM_ROWS, KILN_Q4_K, K, a, r0, u, s0, s1, mt, yr, ldy, n);
            else gemm_rows(R, KILN_Q4_K, K, a, r0, u, s0, s1, mt, yr, ldy, n);
            break;
        case KILN_Q6_K:
            if (R == GEMM_ROWS) gemm_rows(GEMM_ROWS, KILN_Q6_K, K, a, r0, u, s0, s1, mt, yr, ldy, n);
            else gemm_rows(R, KILN_Q6_K, K, a, r0, u, s0, s1, mt, yr, ldy, n);
            break;
        case KILN_Q4_0: gemm_rows(R, KILN_Q4_0, K, a, r0, u, s0, s1, mt, yr, ldy, n); break;
        case KILN_Q8_0: gemm_rows(R, KILN_Q8_0, K, a, r0, u, s0, s1, mt, yr, ldy, n); break;
        case KILN_Q5_K: gemm_rows(R, KILN_Q5_K, K, a, r0, u, s0, s1, mt, yr, ldy, n); break;
        default: gemm_rows(R, type, K, a, r0, u, s0, s1, mt, yr, ldy, n); break; /* Q4_1, Q5_0, Q5_1, IQ4 */
        }
    }
    return 0;
}
#endif

/* 1 where this build has the GEMM (prefill chunks of a GGUF's blocks are then worth taking
 * through the native pass). */
int kiln_has_gemm(void) {
#ifdef KILN_GEMM
    return 1;
#else
    return 0;
#endif
}

/* 1 where the GEMM takes products of `rows` activation rows against GGUF blocks. */
static int gemm_takes(int rows) {
#ifdef KILN_GEMM
    return rows >= GEMM_MIN_ROWS;
#else
    (void)rows;
    return 0;
#endif
}

/* y (M, N) = x (M, K) @ W.T for W's N rows of `type` blocks, through the GEMM where this build
 * has it (else ggml.c's tiles, which kiln_ggml_matmul uses): for tests and benchmarks of the
 * prefill products. Returns 0, -1 for a type or width the loops do not take, -2 out of memory. */
int kiln_ggml_gemm(int type, int M, int N, int K, const uint8_t *q, const float *x, float *y) {
#ifdef KILN_GEMM
    if (M < 1 || N < 1 || kiln_ggml_row_bytes(type, K) < 0) return -1;
    kiln_act a;
    if (ggml_act_quantize(&a, type, M, K, x) != 0) return -2;
    kiln_qw w = {.q = q, .n = N, .k = K, .type = type};
    int tiles = (N + GEMM_COLS - 1) / GEMM_COLS, failed = 0;
#pragma omp parallel for schedule(dynamic, 1) if ((long)M * N * K >= parallel_macs) reduction(| : failed)
    for (int t = 0; t < tiles; t++) failed |= gemm_column_tile(&w, t, &a, y, N) != 0;
    ggml_act_free(&a);
    return failed ? -2 : 0;
#else
    return kiln_ggml_matmul(type, M, N, K, q, x, y);
#endif
}
