/* Products straight from a GGUF file's own quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
 * Q5_K, Q6_K, IQ4_NL, IQ4_XS), against 8-bit activations, with integer dot products.
 *
 * Why: a downloaded GGUF (Q4_K_M mixes Q4_K and Q6_K) used to be repacked into mlx's affine
 * layout where one matched and dequantized to float16 where none did (Q6_K, groups of 16), then
 * the CPU worker kept a float32 copy of every matrix beside a packed one: a 669 MB file took
 * 5.3 GB. Here the worker keeps the file's blocks as they are (memory-mapped) and every product
 * reads them in place, as llama.cpp does.
 *
 * One form covers every type: each run of 32 weights (a "group") is 32 unsigned integers u,
 * two integer multipliers c0, c1 (for weights 0-15 and 16-31), a float block scale f, a zero
 * point z and a float offset mt, and weight l is
 *     w_l = f * c_h * (u_l - z) - mt          (h = l / 16)
 * | type | group                  | u                    | c0, c1        | f  | z   | mt       |
 * | Q4_0 | the block              | nibble               | 1, 1          | d  | 8   | 0        |
 * | Q4_1 | the block              | nibble               | 1, 1          | d  | 0   | -m       |
 * | Q5_0 | the block              | nibble + 16 qh bit   | 1, 1          | d  | 16  | 0        |
 * | Q5_1 | the block              | nibble + 16 qh bit   | 1, 1          | d  | 0   | -m       |
 * | Q8_0 | the block              | q + 128 (q ^ 0x80)   | 1, 1          | d  | 128 | 0        |
 * | Q4_K | 1 of 8 per super-block | nibble               | sc_j, sc_j    | d  | 0   | dmin m_j |
 * | Q5_K | 1 of 8 per super-block | nibble + 16 qh bit j | sc_j, sc_j    | d  | 0   | dmin m_j |
 * | Q6_K | 1 of 8 per super-block | 4 low + 2 high bits  | sc_2i, sc_2i+1 (signed) | d | 32 | 0 |
 * | IQ4_NL | the block            | table[nibble] + 128  | 1, 1          | d  | 128 | 0        |
 * | IQ4_XS | 1 of 8 per super-block | table[nibble] + 128 | ls_j - 32, ls_j - 32 | d | 128 | 0  |
 * (IQ4's table is llama.cpp's 16 non-linear levels, -127..113; `- mt` with mt = -m computes
 * d q + m bit for bit, as a - b is a + (-b) in IEEE arithmetic.)
 * Activations are quantized per block of 32 (dx = max|x| / 127, xi = round(x / dx)), and with
 * S_h = sum u_l xi_l and I_h = sum xi_l over half h of the group,
 *     sum_l w_l x_l ~= dx * (f * sum_h c_h (S_h - z I_h) - mt (I_0 + I_1))
 * exactly the product of the weights with the rounded activations (llama.cpp's Q8_0/Q8_K
 * activations do the same; its blocks of 256 for the K types share one activation scale, here
 * every 32 values have their own, which is finer). The dequantization below computes w_l in
 * that order in float32, as gguf-py's reference does, so it is bit-exact with it.
 *
 * Included by decode.c after its activation struct. The AVX-512 VNNI build takes eight groups at
 * a time in 512-bit loops (ggml_tile_k512: Q4_K, Q5_K, Q6_K; ggml_tile_b512: the 32-weight block
 * types); the AVX2 loops serve the AVX2 and AVX-VNNI builds (vpdpbusd on the latter), and on the
 * AVX-512 build IQ4_XS and block rows not a multiple of 256 wide; portable C the others.
 */

enum {
    KILN_AFFINE = 0, KILN_Q4_0 = 2, KILN_Q4_1 = 3, KILN_Q5_0 = 6, KILN_Q5_1 = 7, KILN_Q8_0 = 8,
    KILN_Q4_K = 12, KILN_Q5_K = 13, KILN_Q6_K = 14, KILN_IQ4_NL = 20, KILN_IQ4_XS = 23,
    KILN_X16 = 0x100 /* or'ed with one of KILN_X16_TYPES: the matrix in panels of 16 rows (panels.c) */
};

/* IQ4_NL / IQ4_XS levels (llama.cpp's kvalues_iq4nl) plus 128: the unsigned u of the form. */
static const uint8_t iq4_levels[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

/* The types with panels of 16 rows (panels.c), one list for the pack, the sizes, the tile
 * dispatch and the self-test: a type added here needs its pack, row and tile code there. */
#define KILN_X16_TYPES(X) X(KILN_Q4_K) X(KILN_Q5_K) X(KILN_Q6_K) X(KILN_Q4_0) X(KILN_Q4_1) X(KILN_Q5_0) X(KILN_Q5_1) X(KILN_Q8_0) X(KILN_IQ4_NL) X(KILN_IQ4_XS)
#define KILN_X16_CASE(t) case t:

static inline int ggml_has_panels(int type) {
    switch (type) { KILN_X16_TYPES(KILN_X16_CASE) return 1; }
    return 0;
}

/* Weights in one block of `type`: 256 in the K types' and IQ4_XS's super-blocks, 32 otherwise. */
static inline long ggml_unit_weights(int type) {
    return type == KILN_Q4_K || type == KILN_Q5_K || type == KILN_Q6_K || type == KILN_IQ4_XS ? 256 : 32;
}

/* Bytes of one block of `type` in the file, or 0 for a type the loops do not take. */
static inline long ggml_unit_bytes(int type) {
    switch (type) {
    case KILN_Q4_0: case KILN_IQ4_NL: return 18;
    case KILN_Q4_1: return 20;
    case KILN_Q5_0: return 22;
    case KILN_Q5_1: return 24;
    case KILN_Q8_0: return 34;
    case KILN_Q4_K: return 144;
    case KILN_Q5_K: return 176;
    case KILN_Q6_K: return 210;
    case KILN_IQ4_XS: return 136;
    }
    return 0;
}

/* Bytes of one row of K weights of `type`, or -1 for a type or width the loops do not take. A
 * panel's row (type | KILN_X16) is a 16th of its bytes, which are the file's own. */
long kiln_ggml_row_bytes(int type, long K) {
    const int base = type & ~KILN_X16;
    if (type & KILN_X16 && !ggml_has_panels(base)) return -1;
    const long ub = ggml_unit_bytes(base), uw = ggml_unit_weights(base);
    return ub && K % uw == 0 ? K / uw * ub : -1;
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* Group g of a row: everything but u (see the table above). */
typedef struct {
    float f, mt;
    int c0, c1, z;
    const uint8_t *src; /* where u's bytes start (the meaning depends on the type) */
    int shift;          /* Q4_K/Q5_K: 0 low nibbles / 4 high; Q6_K: which of 4 groups in its half;
                         * Q5_K: + 8 * the bit of qh that is the group's fifth */
    const uint8_t *qh;  /* Q6_K, Q5_K: the high bits (32 bytes); Q5_0/Q5_1: the block's 4 bytes */
} kiln_group;

/* The type's zero point z and whether it has an offset mt (the table above): what the panel
 * loops (panels.c) and the GEMM (gemm.c) take out of their integer sums. */
static inline int ggml_zero_point(int type) {
    switch (type) {
    case KILN_Q4_0: return 8;
    case KILN_Q5_0: return 16;
    case KILN_Q6_K: return 32;
    case KILN_Q8_0: case KILN_IQ4_NL: case KILN_IQ4_XS: return 128;
    }
    return 0;
}

static inline int ggml_has_offset(int type) {
    return type == KILN_Q4_K || type == KILN_Q5_K || type == KILN_Q4_1 || type == KILN_Q5_1;
}

/* Q4_K/Q5_K's 6-bit scale and minimum of group j of a super-block (12 bytes at s). */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Whether the type's 16-byte src holds weights 0-15 in its low nibbles, 16-31 in its high ones. */
static inline int split_nibbles(int type) {
    return type == KILN_Q4_0 || type == KILN_Q4_1 || type == KILN_Q5_0 || type == KILN_Q5_1 || type == KILN_IQ4_NL || type == KILN_IQ4_XS;
}

static inline kiln_group group_of(int type, const uint8_t *row, int g) {
    kiln_group G = {0};
    G.c0 = G.c1 = 1;
    switch (type) {
    case KILN_Q4_0: case KILN_Q8_0: case KILN_IQ4_NL: {
        const uint8_t *b = row + (size_t)g * (type == KILN_Q8_0 ? 34 : 18);
        G.f = f16_at(b);
        G.z = type == KILN_Q4_0 ? 8 : 128;
        G.src = b + 2;
        return G;
    }
    case KILN_Q4_1: {
        const uint8_t *b = row + (size_t)g * 20;
        G.f = f16_at(b);
        G.mt = -f16_at(b + 2);
        G.src = b + 4;
        return G;
    }
    case KILN_Q5_0: case KILN_Q5_1: {
        const int one = type == KILN_Q5_1;
        const uint8_t *b = row + (size_t)g * (one ? 24 : 22);
        G.f = f16_at(b);
        G.mt = one ? -f16_at(b + 2) : 0.f;
        G.z = one ? 0 : 16;
        G.qh = b + 2 + 2 * one;
        G.src = b + 6 + 2 * one;
        return G;
    }
    case KILN_Q4_K: case KILN_Q5_K: {
        const int five = type == KILN_Q5_K;
        const uint8_t *b = row + (size_t)(g / 8) * (five ? 176 : 144);
        int j = g % 8, sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        G.f = f16_at(b);
        G.mt = f16_at(b + 2) * (float)mn;
        G.c0 = G.c1 = sc;
        G.src = b + (five ? 48 : 16) + 32 * (j / 2);
        G.shift = 4 * (j % 2) + 8 * j * five;
        G.qh = five ? b + 16 : NULL;
        return G;
    }
    case KILN_IQ4_XS: {
        const uint8_t *b = row + (size_t)(g / 8) * 136;
        int j = g % 8;
        uint16_t sh;
        memcpy(&sh, b + 2, 2);
        int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4);
        G.f = f16_at(b);
        G.c0 = G.c1 = ls - 32;
        G.z = 128;
        G.src = b + 8 + 16 * j;
        return G;
    }
    default: { /* Q6_K: ql[128], qh[64], scales[16] (int8), d */
        const uint8_t *b = row + (size_t)(g / 8) * 210;
        int j = g % 8, h = j / 4, i = j % 4;
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * h + 2 * i;
        G.f = f16_at(b + 208);
        G.c0 = sc[0];
        G.c1 = sc[1];
        G.z = 32;
        G.src = b + 64 * h + 32 * (i & 1);
        G.shift = i;
        G.qh = b + 128 + 32 * h;
        return G;
    }
    }
}

static inline void group_u(int type, const kiln_group *G, uint8_t u[32]) {
    for (int l = 0; l < 32; l++) {
        const int nib = l < 16 ? G->src[l] & 15 : G->src[l - 16] >> 4;
        switch (type) {
        case KILN_Q4_0: case KILN_Q4_1: u[l] = (uint8_t)nib; break;
        case KILN_Q5_0: case KILN_Q5_1: u[l] = (uint8_t)(nib | ((G->qh[l / 8] >> (l % 8)) & 1) << 4); break;
        case KILN_IQ4_NL: case KILN_IQ4_XS: u[l] = iq4_levels[nib]; break;
        case KILN_Q8_0: u[l] = G->src[l] ^ 0x80; break;
        case KILN_Q4_K: u[l] = (G->src[l] >> G->shift) & 15; break;
        case KILN_Q5_K: u[l] = (uint8_t)(((G->src[l] >> (G->shift & 7)) & 15) | ((G->qh[l] >> (G->shift >> 3)) & 1) << 4); break;
        default: u[l] = (uint8_t)(((G->src[l] >> (4 * (G->shift >> 1))) & 15) | (((G->qh[l] >> (2 * G->shift)) & 3) << 4));
        }
    }
}

#if defined(__AVX2__)
static inline __m256i group_u256(int type, const kiln_group *G);
#endif

/* A group's 32 weights as float32 from its form (G, u), bit-exact with gguf-py's dequantize:
 * never contracted into fused multiply-adds (numpy rounds twice). */
__attribute__((optimize("fp-contract=off"))) static inline void ggml_group_values(const kiln_group *G, const uint8_t u[32], float *o) {
    float s0 = G->f * (float)G->c0, s1 = G->f * (float)G->c1;
#if defined(__AVX2__)
    const __m256i zv = _mm256_set1_epi32(G->z);
    const __m256 mv = _mm256_set1_ps(G->mt);
    for (int e = 0; e < 4; e++) {
        __m256i v = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 8 * e))), zv);
        __m256 p = _mm256_mul_ps(_mm256_set1_ps(e < 2 ? s0 : s1), _mm256_cvtepi32_ps(v));
        _mm256_storeu_ps(o + 8 * e, _mm256_sub_ps(p, mv));
    }
#else
    for (int l = 0; l < 32; l++) o[l] = (l < 16 ? s0 : s1) * (float)((int)u[l] - G->z) - G->mt;
#endif
}

/* Group g of a row in its form: G, and its 32 values u (vector decoding where there is AVX2). */
static inline kiln_group group_at(int type, const uint8_t *row, int g, uint8_t u[32]) {
    kiln_group G = group_of(type, row, g);
#if defined(__AVX2__)
    _mm256_storeu_si256((__m256i *)u, group_u256(type, &G));
#else
    group_u(type, &G, u);
#endif
    return G;
}

/* Group g of a row as 32 float32 weights (ggml_group_values). */
static inline void ggml_dequant_group(int type, const uint8_t *row, int g, float *o) {
    uint8_t u[32];
    const kiln_group G = group_at(type, row, g, u);
    ggml_group_values(&G, u, o);
}

/* Group g of row r of W (q: the file's rows, or panels where type has KILN_X16) as 32 float32
 * weights, bit-exact either way (defined in panels.c, included after this file). */
static inline void ggml_dequant_at(int type, const uint8_t *q, int K, long r, int g, float *o);

/* Rows of K weights as float32 (bit-exact with gguf-py's dequantize); rows[i] picks the row
 * (NULL: rows 0 .. n - 1). */
void kiln_ggml_dequant(int type, int n, int K, const uint8_t *q, const int32_t *rows, float *out) {
#pragma omp parallel for schedule(static) if ((long)n * K >= (1L << 20))
    for (int r = 0; r < n; r++)
        for (int g = 0; g < K / 32; g++) ggml_dequant_at(type, q, K, rows ? rows[r] : r, g, out + (size_t)r * K + g * 32);
}

/* R rows of x (R a constant where it is inlined, so that their sums can stay in registers)
 * against row o of W. */
static inline __attribute__((always_inline)) void exact_rows(const int R, int type, const uint8_t *q, int K, long o, const float *x, float *y, long ldy) {
    float acc[KILN_QMM_MAX_ROWS][32] = {{0}};
    float w[32];
    for (int g = 0; g < K / 32; g++) {
        ggml_dequant_at(type, q, K, o, g, w);
        for (int m = 0; m < R; m++)
            for (int l = 0; l < 32; l++) acc[m][l] += w[l] * x[(size_t)m * K + g * 32 + l];
    }
    for (int m = 0; m < R; m++) {
        float t = 0.f;
        for (int l = 0; l < 32; l++) t += acc[m][l];
        y[m * ldy] = t;
    }
}

/* y (M, N) = x (M, K) @ W.T in float32, each group of W dequantized in registers exactly as
 * kiln_ggml_dequant does: dequantize-then-multiply up to the order of float sums, reading W
 * once for all M rows (each group dequantized once per 8). mlx's forward pass takes it for a few rows (ggml_blocks.py): the exact
 * reference the native pass is checked against, without a float copy of W. */
int kiln_ggml_matmul_f32(int type, int M, int N, int K, const uint8_t *q, const float *x, float *y) {
    if (M < 1 || kiln_ggml_row_bytes(type, K) < 0) return -1;
    int parallel = (long)M * N * K >= parallel_macs;
#pragma omp parallel for schedule(static) if (parallel)
    for (int o = 0; o < N; o++) {
        for (int m0 = 0; m0 < M; m0 += KILN_QMM_MAX_ROWS) {
            const float *xm = x + (size_t)m0 * K;
            float *ym = y + (size_t)m0 * N + o;
#define KILN_EXACT(n) case n: exact_rows(n, type, q, K, o, xm, ym, N); break;
            switch (M - m0 < KILN_QMM_MAX_ROWS ? M - m0 : KILN_QMM_MAX_ROWS) { KILN_EXACT(1) KILN_EXACT(2) KILN_EXACT(3) KILN_EXACT(4) KILN_EXACT(5) KILN_EXACT(6) KILN_EXACT(7) KILN_EXACT(8) }
#undef KILN_EXACT
        }
    }
    return 0;
}

/* x (K floats) as 8-bit values per block of 32 (natural order), their scales, and the sum of
 * each 16 of them. */
static void ggml_quantize_row(int K, const float *x, int8_t *xq, float *d, int32_t *isum) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* The same values as the loop below (max, 127 / max, round to nearest even), 32 at a time:
     * at 8 rows the scalar loop was ~8% of a 1B step. */
    const __m512 sign = _mm512_set1_ps(-0.f);
    for (int blk = 0; blk < K / 32; blk++) {
        const __m512 a = _mm512_loadu_ps(x + blk * 32), b = _mm512_loadu_ps(x + blk * 32 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        d[blk] = amax / 127.f;
        const __m512i va = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), vb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
        _mm_storeu_si128((__m128i *)(xq + blk * 32), _mm512_cvtepi32_epi8(va));
        _mm_storeu_si128((__m128i *)(xq + blk * 32 + 16), _mm512_cvtepi32_epi8(vb));
        isum[2 * blk] = _mm512_reduce_add_epi32(va);
        isum[2 * blk + 1] = _mm512_reduce_add_epi32(vb);
    }
    return;
#endif
    for (int blk = 0; blk < K / 32; blk++) {
        const float *xb = x + blk * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; j++) {
            float v = fabsf(xb[j]);
            amax = v > amax ? v : amax;
        }
        float id = amax > 0.f ? 127.f / amax : 0.f;
        d[blk] = amax / 127.f;
        int s0 = 0, s1 = 0;
        for (int j = 0; j < 32; j++) {
            int v = (int)lrintf(xb[j] * id);
            xq[blk * 32 + j] = (int8_t)v;
            if (j < 16) s0 += v;
            else s1 += v;
        }
        isum[2 * blk] = s0;
        isum[2 * blk + 1] = s1;
    }
}

#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GGML_DOT(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define GGML_DOT(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else /* pairs of u8 x s8 products: |u - z| <= 128 and |xi| <= 127 never saturate int16 */
#define GGML_DOT(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif

static inline float ggml_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256i group_u256(int type, const kiln_group *G) {
    const __m256i low4 = _mm256_set1_epi8(15);
    if (split_nibbles(type)) {
        __m128i v = _mm_loadu_si128((const __m128i *)G->src), m = _mm_set1_epi8(15);
        __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
        if (type == KILN_Q5_0 || type == KILN_Q5_1) { /* bit l of the little-endian qh word: weight l */
            uint32_t qh;
            memcpy(&qh, G->qh, 4);
            const __m256i spread = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
            const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
            __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
            h = _mm256_cmpeq_epi8(_mm256_and_si256(h, bits), bits);
            return _mm256_or_si256(u, _mm256_and_si256(h, _mm256_set1_epi8(16)));
        }
        if (type == KILN_IQ4_NL || type == KILN_IQ4_XS) {
            const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)iq4_levels));
            return _mm256_shuffle_epi8(table, u);
        }
        return u;
    }
    switch (type) {
    case KILN_Q8_0:
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)G->src), _mm256_set1_epi8((char)0x80));
    case KILN_Q4_K: {
        __m256i v = _mm256_loadu_si256((const __m256i *)G->src);
        return _mm256_and_si256(G->shift ? _mm256_srli_epi16(v, 4) : v, low4);
    }
    case KILN_Q5_K: {
        __m256i v = _mm256_loadu_si256((const __m256i *)G->src), hi = _mm256_loadu_si256((const __m256i *)G->qh);
        v = _mm256_and_si256(G->shift & 7 ? _mm256_srli_epi16(v, 4) : v, low4);
        hi = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(G->shift >> 3)), _mm256_set1_epi8(1));
        return _mm256_or_si256(v, _mm256_slli_epi16(hi, 4));
    }
    default: {
        __m256i lo = _mm256_loadu_si256((const __m256i *)G->src), hi = _mm256_loadu_si256((const __m256i *)G->qh);
        lo = _mm256_and_si256(G->shift >= 2 ? _mm256_srli_epi16(lo, 4) : lo, low4);
        __m128i cnt = _mm_cvtsi32_si128(2 * G->shift);
        hi = _mm256_and_si256(_mm256_srl_epi16(hi, cnt), _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    }
}

/* A Q4_K super-block's eight 6-bit scales and eight 6-bit mins (12 bytes) as eight bytes each,
 * unpacked a 32-bit word at a time: bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits
 * of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of scales 4-7
 * (low nibble) and of mins 4-7 (high nibble). */
static inline void q4k_scales(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t w0, w1, w2;
    memcpy(&w0, s, 4);
    memcpy(&w1, s + 4, 4);
    memcpy(&w2, s + 8, 4);
    const uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u);
    const uint32_t mn_hi = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u);
    *sc = (w0 & 0x3f3f3f3fu) | (uint64_t)sc_hi << 32;
    *mn = (w1 & 0x3f3f3f3fu) | (uint64_t)mn_hi << 32;
}

static inline __m256 bytes8_ps(uint64_t v, int is_signed) {
    const __m128i b = _mm_cvtsi64_si128((long long)v);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

/* Q4_K, Q5_K and Q6_K a super-block at a time with 256-bit integer dot products (AVX2's maddubs,
 * AVX-VNNI's vpdpbusd): ggml_tile_k512's scheme (see there) at half the width, one group of 32
 * weights per vector. */
static inline __attribute__((always_inline)) void ggml_tile_k256(const int M, const int type, const uint8_t *row, const int K, const kiln_act *a, int m0, float *y, long ldy) {
    __m256 acc[KILN_QMM_MAX_ROWS], cor[KILN_QMM_MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = cor[m] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(15), two = _mm256_set1_epi8(0x30);
    const __m256i lo_pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), hi_pairs = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    const int q4 = type == KILN_Q4_K || type == KILN_Q5_K, q5 = type == KILN_Q5_K; /* q4: scales and mins */
    const long bytes = q5 ? 176 : q4 ? 144 : 210;
    const __m256i bit4 = _mm256_set1_epi8(16);
    for (int sb = 0; sb < K / 256; sb++) {
        const uint8_t *b = row + (size_t)sb * bytes;
        __m256i u[8];
        __m256 wsc0, wsc1 = _mm256_setzero_ps(), wmn = _mm256_setzero_ps(); /* Q4_K/Q5_K: d * sc and dmin * m per group; Q6_K: d * sc per 16 (two halves) */
        if (q4) {
            uint64_t scb, mnb;
            q4k_scales(b + 4, &scb, &mnb);
            wsc0 = _mm256_mul_ps(_mm256_set1_ps(f16_at(b)), bytes8_ps(scb, 0));
            wmn = _mm256_mul_ps(_mm256_set1_ps(f16_at(b + 2)), bytes8_ps(mnb, 0));
            const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256(); /* Q5_K: bit j of byte l, weight l of group j */
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(b + (q5 ? 48 : 16) + 32 * c));
                u[2 * c] = _mm256_and_si256(v, low4);
                u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                if (q5) {
                    u[2 * c] = _mm256_or_si256(u[2 * c], _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * c), 4), bit4));
                    u[2 * c + 1] = _mm256_or_si256(u[2 * c + 1], _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * c + 1), 4), bit4));
                }
            }
        } else {
            const __m256 d = _mm256_set1_ps(f16_at(b + 208));
            uint64_t s0, s1;
            memcpy(&s0, b + 192, 8);
            memcpy(&s1, b + 200, 8);
            wsc0 = _mm256_mul_ps(d, bytes8_ps(s0, 1));
            wsc1 = _mm256_mul_ps(d, bytes8_ps(s1, 1));
            for (int h = 0; h < 2; h++) {
                const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h)), ql1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)), qh2 = _mm256_srli_epi16(qh, 2);
                u[4 * h] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), two));
                u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh2, 4), two));
                u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, two));
                u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4), _mm256_and_si256(qh2, two));
            }
        }
        const int g0 = sb * 8;
        for (int m = 0; m < M; m++) {
            const long r = m0 + m;
            const int8_t *xq = a->gq + r * a->gq_ld + g0 * 32;
            const __m256 dx = _mm256_loadu_ps(a->gd + r * a->gd_ld + g0);
            const int32_t *is = a->gsum + r * a->gsum_ld + 2 * g0;
            const __m256 is0 = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)is)), is1 = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(is + 8)));
            if (q4) { /* Q4_K, Q5_K lanes of group g: d * sc_g * dx_g; mins per 16: dmin * m * dx */
                const __m256 cf = _mm256_mul_ps(wsc0, dx), mn = _mm256_mul_ps(wmn, dx);
                cor[m] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(mn, lo_pairs), is0, cor[m]);
                cor[m] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(mn, hi_pairs), is1, cor[m]);
                for (int g = 0; g < 8; g++) {
                    const __m256i i = GGML_DOT(_mm256_setzero_si256(), u[g], _mm256_loadu_si256((const __m256i *)(xq + 32 * g)));
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_permutevar8x32_ps(cf, _mm256_set1_epi32(g)), acc[m]);
                }
            } else { /* per 16 weights: d * sc * dx, lanes 4 each; the zero point 32 per 16 */
                const __m256 cf0 = _mm256_mul_ps(wsc0, _mm256_permutevar8x32_ps(dx, lo_pairs)), cf1 = _mm256_mul_ps(wsc1, _mm256_permutevar8x32_ps(dx, hi_pairs));
                cor[m] = _mm256_fmadd_ps(cf0, is0, cor[m]);
                cor[m] = _mm256_fmadd_ps(cf1, is1, cor[m]);
                for (int g = 0; g < 8; g++) {
                    const __m256i i = GGML_DOT(_mm256_setzero_si256(), u[g], _mm256_loadu_si256((const __m256i *)(xq + 32 * g)));
                    const __m256i idx = _mm256_setr_epi32(2 * (g % 4), 2 * (g % 4), 2 * (g % 4), 2 * (g % 4), 2 * (g % 4) + 1, 2 * (g % 4) + 1, 2 * (g % 4) + 1, 2 * (g % 4) + 1);
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_permutevar8x32_ps(g < 4 ? cf0 : cf1, idx), acc[m]);
                }
            }
        }
    }
    for (int m = 0; m < M; m++) {
        const float c = ggml_hsum8(cor[m]);
        y[m * ldy] = ggml_hsum8(acc[m]) - (q4 ? c : 32.f * c);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KILN_GGML_512 1
/* Lane l of 16 takes element (base + l / per) of a vector: spreading per-group (8 lanes each)
 * or per-16-weights (4 lanes each) scales over vpdpbusd's int32 lanes. */
static inline __attribute__((always_inline)) __m512i spread_idx(int base, int per) { /* constants where inlined */
#define KILN_AT(l) base + (l) / per
    return _mm512_setr_epi32(KILN_AT(0), KILN_AT(1), KILN_AT(2), KILN_AT(3), KILN_AT(4), KILN_AT(5), KILN_AT(6), KILN_AT(7),
                             KILN_AT(8), KILN_AT(9), KILN_AT(10), KILN_AT(11), KILN_AT(12), KILN_AT(13), KILN_AT(14), KILN_AT(15));
#undef KILN_AT
}

/* acc (acc2 for vectors 2-3 when split) += the 64-byte vectors u against a row's 256 activations
 * at xq, lanes scaled by cf spread `per` lanes an element (8: a scale per group of 32, 4: per 16). */
static inline __attribute__((always_inline)) void dot4_512(const __m512i u[4], const int8_t *xq, __m512 cf, int per, int split, __m512 *acc, __m512 *acc2) {
    for (int c = 0; c < 4; c++) {
        const __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[c], _mm512_loadu_si512(xq + 64 * c));
        __m512 *into = split && c >= 2 ? acc2 : acc;
        *into = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_permutexvar_ps(spread_idx(c * 16 / per, per), cf), *into);
    }
}

/* One row's share of 256 weights in 64-byte vectors u whose scale and offset go by group of 32
 * (Q4_K/Q5_K's d sc and dmin m; a block type's d and f z - min): lanes of group j take
 * scale_j dx_j, the offsets go per 16 against the activations' sums. */
static inline __attribute__((always_inline)) void row_by_group512(const __m512i u[4], const kiln_act *a, long r, int g, __m512 scale, __m512 offset, int split, __m512 *acc, __m512 *acc2, __m512 *cor) {
    const int8_t *xq = a->gq + r * a->gq_ld + g * 32;
    const __m512 dx8 = _mm512_castps256_ps512(_mm256_loadu_ps(a->gd + r * a->gd_ld + g));
    const __m512 isum = _mm512_cvtepi32_ps(_mm512_loadu_si512(a->gsum + r * a->gsum_ld + 2 * g));
    const __m512 cf = _mm512_mul_ps(scale, dx8);
    *cor = _mm512_fmadd_ps(_mm512_permutexvar_ps(spread_idx(0, 2), _mm512_mul_ps(offset, dx8)), isum, *cor);
    dot4_512(u, xq, cf, 8, split, acc, acc2); /* vector c holds groups 2c and 2c + 1 */
}

/* Q4_K, Q5_K and Q6_K with 512-bit integer dot products, a super-block (256 weights) at a time.
 *
 * Why: the generic loop below (one group of 32 at a time, 256-bit) spent most of its time on
 * scalar work per group (unpacking the 6-bit scales and converting float16 twice per group,
 * scalar corrections per row), so the 1B Q4_K_M decode step was compute-bound at ~6 GB/s of
 * weights while one core streams ~16 GB/s. Here a super-block's weights are unpacked once
 * into four 64-byte vectors in the activations' natural order (for any number of rows), the
 * scales are unpacked a word at a time, and per row each 64 weights cost one vpdpbusd, one
 * conversion, one permute (the per-lane scale d * sc * dx) and one multiply-add; the offsets
 * (Q4_K's mins, Q6_K's zero point 32) are one multiply-add per super-block against the
 * activations' sums per 16. The arithmetic is the generic loop's (same 8-bit activations,
 * same integer sums), only the order of the float sums differs. */
static inline __attribute__((always_inline)) void ggml_tile_k512(const int M, const int type, const uint8_t *row, const int K, const kiln_act *a, int m0, float *y, long ldy) {
    /* One row's sums in two chains (chunks 0-1, 2-3) where registers allow: one chain of four
     * dependent multiply-adds per super-block bounds a single row's step. */
    __m512 acc[KILN_QMM_MAX_ROWS], acc2[KILN_QMM_MAX_ROWS], cor[KILN_QMM_MAX_ROWS];
    const int split = M <= 2;
    for (int m = 0; m < M; m++) acc[m] = acc2[m] = cor[m] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(15), two = _mm512_set1_epi8(0x30);
    const __m512i by2 = spread_idx(0, 2);
    const int q4 = type == KILN_Q4_K || type == KILN_Q5_K, q5 = type == KILN_Q5_K; /* q4: scales and mins */
    const long bytes = q5 ? 176 : q4 ? 144 : 210;
    const __m512i bit4 = _mm512_set1_epi8(16);
    for (int sb = 0; sb < K / 256; sb++) {
        const uint8_t *b = row + (size_t)sb * bytes;
        for (int l = 0; l < 4 * 64; l += 64) _mm_prefetch((const char *)(b + 2048 + l), _MM_HINT_T0);
        __m512i u[4];
        __m512 wsc, wmn = _mm512_setzero_ps(); /* Q4_K/Q5_K: d * sc, dmin * m (8 lanes); Q6_K: d * sc (16) */
        if (q4) {
            uint64_t scb, mnb;
            q4k_scales(b + 4, &scb, &mnb);
            wsc = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(f16_at(b)), bytes8_ps(scb, 0)));
            wmn = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(f16_at(b + 2)), bytes8_ps(mnb, 0)));
            /* Q5_K: qh[32] before the nibbles; bit j of byte l is the fifth bit of weight l of
             * group j. Bytes 0-31: qh, 32-63: qh >> 1, so bit 2c of either half is group 2c's
             * (low half) or 2c + 1's (high half); each byte's bit 0 stays its own under the
             * 16-bit shifts because no shift exceeds 7. */
            const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
            const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 1), 1);
            for (int c = 0; c < 4; c++) { /* 32 bytes: group 2c in the low nibbles, 2c + 1 in the high */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(b + (q5 ? 48 : 16) + 32 * c));
                u[c] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), low4);
                if (q5) u[c] = _mm512_or_si512(u[c], _mm512_and_si512(_mm512_slli_epi16(_mm512_srli_epi16(qh2, 2 * c), 4), bit4));
            }
        } else { /* ql[128], qh[64], scales[16] (int8), d: per half of 128 weights, ql[64] + qh[32] */
            wsc = _mm512_mul_ps(_mm512_set1_ps(f16_at(b + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))));
            for (int h = 0; h < 2; h++) {
                const __m512i ql = _mm512_loadu_si512(b + 64 * h);
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                /* bytes 0-31: qh, 32-63: qh >> 2; bits 0-1 then go with weights 0-63, bits 4-5 with 64-127 */
                const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
                u[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(_mm512_slli_epi16(qh2, 4), two));
                u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_and_si512(qh2, two));
            }
        }
        const int g = sb * 8;
        for (int m = 0; m < M; m++) {
            const long r = m0 + m;
            if (q4) { /* Q4_K, Q5_K per group: d * sc * dx; the mins per 16 weights: dmin * m * dx */
                row_by_group512(u, a, r, g, wsc, wmn, split, &acc[m], &acc2[m], &cor[m]);
                continue;
            }
            /* Q6_K per 16 weights: d * sc * dx; the zero point: 32 * that * sum(xi) */
            const int8_t *xq = a->gq + r * a->gq_ld + g * 32;
            const __m512 dx8 = _mm512_castps256_ps512(_mm256_loadu_ps(a->gd + r * a->gd_ld + g));
            const __m512 isum = _mm512_cvtepi32_ps(_mm512_loadu_si512(a->gsum + r * a->gsum_ld + 2 * g));
            const __m512 cf = _mm512_mul_ps(wsc, _mm512_permutexvar_ps(by2, dx8));
            cor[m] = _mm512_fmadd_ps(_mm512_mul_ps(cf, _mm512_set1_ps(32.f)), isum, cor[m]);
            dot4_512(u, xq, cf, 4, split, &acc[m], &acc2[m]);
        }
    }
    for (int m = 0; m < M; m++) y[m * ldy] = _mm512_reduce_add_ps(_mm512_sub_ps(_mm512_add_ps(acc[m], acc2[m]), cor[m]));
}

static inline uint16_t u16_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* The types of 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) eight blocks at a time,
 * ggml_tile_k512's scheme: per row, 64 weights cost one vpdpbusd, one conversion, one permute
 * and one multiply-add, and every offset -- the zero point z (f z per block) and Q4_1/Q5_1's
 * minimum -- is one multiply-add per eight blocks against the activations' sums per 16.
 *
 * Why: ggml_groups (one block at a time, 256-bit, the zero point by the sign trick, the block
 * scale converted per block and per row) ran a 1B Q4_0 decode step at a third of the bandwidth
 * the K types' loops reach; the eight float16 scales here are one conversion. The sums differ
 * from ggml_groups' only in float order and in taking z I in float32 rather than in integers
 * (|z I| <= 128 * 127 * 32 per block, exact in float32's 24 bits). Rows whose K is not a
 * multiple of 256 take ggml_groups. */
static inline __attribute__((always_inline)) void ggml_tile_b512(const int M, const int type, const uint8_t *row, const int K, const kiln_act *a, int m0, float *y, long ldy) {
    __m512 acc[KILN_QMM_MAX_ROWS], acc2[KILN_QMM_MAX_ROWS], cor[KILN_QMM_MAX_ROWS];
    const int split = M <= 2;
    for (int m = 0; m < M; m++) acc[m] = acc2[m] = cor[m] = _mm512_setzero_ps();
    const long bb = kiln_ggml_row_bytes(type, 32); /* one block */
    const int with_min = type == KILN_Q4_1 || type == KILN_Q5_1;
    const float z = (float)group_of(type, row, 0).z; /* the type's zero point (the table at the top) */
    for (int sb = 0; sb < K / 256; sb++) {
        const uint8_t *b = row + (size_t)sb * 8 * bb;
        for (long l = 0; l < 8 * bb; l += 64) _mm_prefetch((const char *)(b + 8 * bb + l), _MM_HINT_T0);
        /* f (each block's d) and the offset per block: f z - min (w = f (u - z) + min) */
        const __m256 f = _mm256_cvtph_ps(_mm_setr_epi16((short)u16_at(b), (short)u16_at(b + bb), (short)u16_at(b + 2 * bb), (short)u16_at(b + 3 * bb),
                                                         (short)u16_at(b + 4 * bb), (short)u16_at(b + 5 * bb), (short)u16_at(b + 6 * bb), (short)u16_at(b + 7 * bb)));
        __m256 off = _mm256_mul_ps(f, _mm256_set1_ps(z));
        if (with_min)
            off = _mm256_sub_ps(off, _mm256_cvtph_ps(_mm_setr_epi16((short)u16_at(b + 2), (short)u16_at(b + bb + 2), (short)u16_at(b + 2 * bb + 2), (short)u16_at(b + 3 * bb + 2),
                                                                    (short)u16_at(b + 4 * bb + 2), (short)u16_at(b + 5 * bb + 2), (short)u16_at(b + 6 * bb + 2), (short)u16_at(b + 7 * bb + 2))));
        __m512i u[4];
        for (int c = 0; c < 4; c++) {
            const kiln_group G0 = group_of(type, b, 2 * c), G1 = group_of(type, b, 2 * c + 1);
            u[c] = _mm512_inserti64x4(_mm512_castsi256_si512(group_u256(type, &G0)), group_u256(type, &G1), 1);
        }
        for (int m = 0; m < M; m++) row_by_group512(u, a, m0 + m, sb * 8, _mm512_castps256_ps512(f), _mm512_castps256_ps512(off), split, &acc[m], &acc2[m], &cor[m]);
    }
    for (int m = 0; m < M; m++) y[m * ldy] = _mm512_reduce_add_ps(_mm512_sub_ps(_mm512_add_ps(acc[m], acc2[m]), cor[m]));
}
#endif

/* Builds with loops that multiply matrices in panels of 16 rows (panels.c): AVX-512 VNNI's, and
 * AVX-VNNI's and plain AVX2's at 256 bits (Intel's client cores from Alder Lake on have AVX-VNNI
 * and no AVX-512; AMD's before Zen 4 and Intel's before Ice Lake, AVX2 alone). */
#if defined(KILN_GGML_512) || (defined(__AVX2__) && defined(__F16C__))
#define KILN_X16_LOOPS 1
#endif

/* Every group of a row against M rows of activations, for the types without a loop of their own. */
static inline __attribute__((always_inline)) void ggml_groups(const int M, const int type, const uint8_t *row, const int K, const kiln_act *a, int m0, __m256 *acc, float *extra) {
    for (int g = 0; g < K / 32; g++) {
        kiln_group G = group_of(type, row, g);
        const __m256i u = group_u256(type, &G);
        const __m256i sw = _mm256_sub_epi8(u, _mm256_set1_epi8((char)G.z)); /* u - z, signed */
        const __m256i au = G.z ? _mm256_abs_epi8(sw) : u;
        const __m256 cv = _mm256_set_m128(_mm_set1_ps(G.f * (float)G.c1), _mm_set1_ps(G.f * (float)G.c0));
        for (int m = 0; m < M; m++) {
            const long r = m0 + m;
            const __m256i xi = _mm256_loadu_si256((const __m256i *)(a->gq + r * a->gq_ld + g * 32));
            const __m256i i = GGML_DOT(_mm256_setzero_si256(), au, G.z ? _mm256_sign_epi8(xi, sw) : xi);
            const float dx = a->gd[r * a->gd_ld + g];
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(cv, _mm256_set1_ps(dx)), acc[m]);
            if (G.mt != 0.f) {
                const int32_t *is = a->gsum + r * a->gsum_ld + 2 * g;
                extra[m] -= dx * G.mt * (float)(is[0] + is[1]);
            }
        }
    }
}

/* Types with a zero point multiply signed weights (u - z, |u - z| <= 128) as |u - z| by
 * sign(u - z) * xi, which vpdpbusd / maddubs take as unsigned x signed bytes without the zero
 * point's correction; Q4_K's offset is added per group from the activations' sums. */
static inline __attribute__((always_inline)) void ggml_tile(const int M, const kiln_qw *w, int o, const kiln_act *a, int m0, float *y, long ldy) {
    const int K = w->k, type = w->type;
    const uint8_t *row = w->q + (size_t)o * kiln_ggml_row_bytes(type, K);
    if (type == KILN_Q4_K || type == KILN_Q5_K || type == KILN_Q6_K) {
#ifdef KILN_GGML_512
        ggml_tile_k512(M, type, row, K, a, m0, y, ldy);
#else
        ggml_tile_k256(M, type, row, K, a, m0, y, ldy);
#endif
        return;
    }
#ifdef KILN_GGML_512
    if (type != KILN_IQ4_XS && K % 256 == 0) {
        switch (type) { /* one copy per type: its decoding folds into the loop */
        case KILN_Q4_0: ggml_tile_b512(M, KILN_Q4_0, row, K, a, m0, y, ldy); break;
        case KILN_Q8_0: ggml_tile_b512(M, KILN_Q8_0, row, K, a, m0, y, ldy); break;
        default: ggml_tile_b512(M, type, row, K, a, m0, y, ldy); /* Q4_1, Q5_0, Q5_1, IQ4_NL */
        }
        return;
    }
#endif
    __m256 acc[KILN_QMM_MAX_ROWS];
    float extra[KILN_QMM_MAX_ROWS];
    for (int m = 0; m < M; m++) {
        acc[m] = _mm256_setzero_ps();
        extra[m] = 0.f;
    }
    switch (type) { /* one copy of the loop per type: its decoding folds into it */
    case KILN_Q4_0: ggml_groups(M, KILN_Q4_0, row, K, a, m0, acc, extra); break;
    case KILN_Q4_1: ggml_groups(M, KILN_Q4_1, row, K, a, m0, acc, extra); break;
    case KILN_Q5_0: ggml_groups(M, KILN_Q5_0, row, K, a, m0, acc, extra); break;
    case KILN_Q5_1: ggml_groups(M, KILN_Q5_1, row, K, a, m0, acc, extra); break;
    case KILN_Q8_0: ggml_groups(M, KILN_Q8_0, row, K, a, m0, acc, extra); break;
    case KILN_IQ4_NL: ggml_groups(M, KILN_IQ4_NL, row, K, a, m0, acc, extra); break;
    default: ggml_groups(M, type, row, K, a, m0, acc, extra);
    }
    for (int m = 0; m < M; m++) y[m * ldy] = ggml_hsum8(acc[m]) + extra[m];
}
#else
static inline __attribute__((always_inline)) void ggml_tile(const int M, const kiln_qw *w, int o, const kiln_act *a, int m0, float *y, long ldy) {
    const int K = w->k, type = w->type;
    const uint8_t *row = w->q + (size_t)o * kiln_ggml_row_bytes(type, K);
    float acc[KILN_QMM_MAX_ROWS] = {0};
    uint8_t u[32];
    for (int g = 0; g < K / 32; g++) {
        kiln_group G = group_of(type, row, g);
        group_u(type, &G, u);
        for (int m = 0; m < M; m++) {
            const long r = m0 + m;
            const int8_t *xi = a->gq + r * a->gq_ld + g * 32;
            int32_t s0 = 0, s1 = 0;
            for (int l = 0; l < 16; l++) s0 += (int32_t)u[l] * xi[l];
            for (int l = 16; l < 32; l++) s1 += (int32_t)u[l] * xi[l];
            const int32_t *is = a->gsum + r * a->gsum_ld + 2 * g;
            float t = G.f * ((float)G.c0 * (float)(s0 - G.z * is[0]) + (float)G.c1 * (float)(s1 - G.z * is[1])) - G.mt * (float)(is[0] + is[1]);
            acc[m] += a->gd[r * a->gd_ld + g] * t;
        }
    }
    for (int m = 0; m < M; m++) y[m * ldy] = acc[m];
}
#endif

/* a = x's M rows (width K) in 8-bit form: the activations of the standalone products
 * (kiln_ggml_matmul, kiln_ggml_gemm), in buffers of their own rather than the pass's scratch.
 * Returns 0, or -2 out of memory (then nothing is held). Release with ggml_act_free. */
static int ggml_act_quantize(kiln_act *a, int type, int M, int K, const float *x) {
    int8_t *xq = malloc((size_t)M * K);
    float *d = malloc(sizeof(float) * (size_t)M * (K / 32));
    int32_t *is = malloc(sizeof(int32_t) * (size_t)M * (K / 16));
    if (!xq || !d || !is) {
        free(xq); free(d); free(is);
        return -2;
    }
    *a = (kiln_act){.M = M, .K = K, .type = type, .gq = xq, .gd = d, .gsum = is, .gq_ld = K, .gd_ld = K / 32, .gsum_ld = K / 16};
    for (int m = 0; m < M; m++) ggml_quantize_row(K, x + (size_t)m * K, xq + (size_t)m * K, d + (size_t)m * (K / 32), is + (size_t)m * (K / 16));
    return 0;
}

/* Frees what ggml_act_quantize allocated. */
static void ggml_act_free(kiln_act *a) {
    free(a->gq); free(a->gd); free(a->gsum);
}

#ifdef KILN_X16_LOOPS
static void x16_panel(const kiln_qw *w, int p, const kiln_act *a, int m0, int M, float *y, long ldy); /* panels.c */
#endif

/* y (M, N) = x (M, K) @ W.T for W's N rows of `type` blocks, with 8-bit activations (any M).
 * Returns 0, or -1 for a type or width the loops do not take, -2 when out of memory. */
int kiln_ggml_matmul(int type, int M, int N, int K, const uint8_t *q, const float *x, float *y) {
    if (M < 1 || kiln_ggml_row_bytes(type, K) < 0) return -1;
    kiln_act a;
    if (ggml_act_quantize(&a, type, M, K, x) != 0) return -2;
    kiln_qw w = {.q = q, .n = N, .k = K, .type = type};
    int parallel = (long)M * N * K >= parallel_macs;
    if (type & KILN_X16) { /* panels: 16 columns at a time */
#ifdef KILN_X16_LOOPS
#pragma omp parallel for schedule(static) if (parallel)
        for (int p = 0; p < N / 16; p++)
            for (int m0 = 0; m0 < M; m0 += KILN_QMM_MAX_ROWS)
                x16_panel(&w, p, &a, m0, M - m0 < KILN_QMM_MAX_ROWS ? M - m0 : KILN_QMM_MAX_ROWS, y + (size_t)m0 * N, N);
        ggml_act_free(&a);
        return 0;
#else
        ggml_act_free(&a);
        return -1; /* no build without the loops repacks (kiln_has_panels) */
#endif
    }
#pragma omp parallel for schedule(static) if (parallel)
    for (int o = 0; o < N; o++)
        for (int m0 = 0; m0 < M; m0 += KILN_QMM_MAX_ROWS) {
            int rows = M - m0 < KILN_QMM_MAX_ROWS ? M - m0 : KILN_QMM_MAX_ROWS;
            ggml_tile(rows, &w, o, &a, m0, y + (size_t)m0 * N + o, N);
        }
    ggml_act_free(&a);
    return 0;
}

/* 0 where this build's products of each type equal the plain sum over the scalar decoding of
 * the same blocks (for kiln_selftest: a variant whose vector loops disagree is not used). The
 * activations are integers with 127 in every block, so their 8-bit form is exact. */
static int ggml_selftest(void) {
    enum { K = 256 };
    /* type, byte offsets of its float16 fields in a block (-1: none) */
    static const int types[][3] = {
        {KILN_Q4_0, 0, -1}, {KILN_Q4_1, 0, 2}, {KILN_Q5_0, 0, -1}, {KILN_Q5_1, 0, 2}, {KILN_Q8_0, 0, -1},
        {KILN_IQ4_NL, 0, -1}, {KILN_Q4_K, 0, 2}, {KILN_Q5_K, 0, 2}, {KILN_Q6_K, 208, -1}, {KILN_IQ4_XS, 0, -1},
    };
    uint8_t row[K / 32 * 34];
    float x[K];
    int8_t xq[K];
    float d[K / 32];
    int32_t is[K / 16];
    for (int i = 0; i < K; i++) x[i] = i % 32 ? (float)((i * 37) % 255 - 127) : 127.f;
    for (int t = 0; t < (int)(sizeof types / sizeof types[0]); t++) {
        int type = types[t][0];
        long rb = kiln_ggml_row_bytes(type, K);
        for (long i = 0; i < rb; i++) row[i] = (uint8_t)((i * 101 + 7 * t) % 256);
        /* float16 scales: 1/64 (and a minimum or offset of 1/128) where the type has them */
        const uint16_t s1 = 0x2400, s2 = 0x2000;
        const long ub = ggml_unit_bytes(type);
        for (int b = 0; b < K / ggml_unit_weights(type); b++) {
            memcpy(row + b * ub + types[t][1], &s1, 2);
            if (types[t][2] >= 0) memcpy(row + b * ub + types[t][2], &s2, 2);
        }
        double ref = 0.0, mag = 0.0;
        uint8_t u[32];
        for (int g = 0; g < K / 32; g++) {
            kiln_group G = group_of(type, row, g);
            group_u(type, &G, u);
            for (int l = 0; l < 32; l++) {
                double w = (double)G.f * (l < 16 ? G.c0 : G.c1) * ((int)u[l] - G.z) - G.mt;
                ref += w * x[g * 32 + l];
                mag += fabs(w * x[g * 32 + l]);
            }
        }
        ggml_quantize_row(K, x, xq, d, is);
        kiln_act a = {.M = 1, .K = K, .type = type, .gq = xq, .gd = d, .gsum = is, .gq_ld = K, .gd_ld = K / 32, .gsum_ld = K / 16};
        kiln_qw w = {.q = row, .n = 1, .k = K, .type = type};
        float y = 0.f;
        ggml_tile(1, &w, 0, &a, 0, &y, 1);
        if (fabs(y - ref) > 1e-5 * mag + 1e-6) return 1;
    }
    return 0;
}
