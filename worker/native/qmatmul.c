/* Skinny matmuls against mlx's affine-quantized weights, for decoding on the CPU.
 *
 * y[m, o] = sum_k x[m, k] * (scale[o, g] * q[o, k] + bias[o, g]),  g = k / group_size
 *
 * The weights keep mlx's packing (little-endian uint32 words, element k of a row in bits
 * [bits * (k % per_word), ...) of word k / per_word), so a 4-bit row of K elements is K / 2
 * bytes with element 2j in the low and 2j + 1 in the high nibble of byte j; 8-bit rows are
 * one byte per element. Scales and biases are float16, one per group.
 *
 * Why: mlx's CPU quantized matmul is scalar code, slower than a float32 BLAS product, so
 * the worker used to decode from a float32 copy and read 8x the bytes of 4-bit weights on
 * every token. Decoding 1..8 rows is bound by those reads; these loops read the packed
 * weights once per call, dequantize in registers (w = scale * q + bias, as mx.dequantize
 * computes it in float32) and multiply in float32, so results match the float32 copy up to
 * summation order.
 *
 * Compiled into each variant of decode.c (which includes this file) by
 * kiln/worker/native/__init__.py; the AVX-512 loops are used in the AVX-512 variant, portable C
 * (vectorized by the compiler) elsewhere. decode.c's forward pass uses them for its float32
 * activations; kiln_qmm serves products inside mlx's graph (loading/packed.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define KILN_QMM_MAX_ROWS 8
/* Products smaller than this many multiply-adds run on the calling thread alone: waking the
 * other threads costs about what a one-row product of a small layer takes. */
static long parallel_macs = 4L * 576 * 1536;
void kiln_set_parallel_macs(long macs) { parallel_macs = macs; }

int kiln_qmm_max_rows(void) { return KILN_QMM_MAX_ROWS; }

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* 4-bit: x is pre-permuted per block of 32 into [16 even elements, 16 odd elements], so the
 * low and high nibbles of 16 bytes line up with two contiguous runs of x. */
static void permute_even_odd(int M, int K, const float *x, float *xp) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * K;
        float *out = xp + (size_t)m * K;
        for (int c = 0; c < K; c += 32)
            for (int j = 0; j < 16; j++) {
                out[c + j] = xr[c + 2 * j];
                out[c + 16 + j] = xr[c + 2 * j + 1];
            }
    }
}

#ifdef __AVX512F__
static inline __attribute__((always_inline)) void q4_row(int M, int K, int gs, const uint8_t *q,
        const uint16_t *s, const uint16_t *b, const float *xp, float *y, int ldy) {
    __m512 acc[KILN_QMM_MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const __m128i low = _mm_set1_epi8(15);
    for (int g = 0; g < K / gs; g++) {
        __m512 sc = _mm512_set1_ps(half_to_float(s[g])), bi = _mm512_set1_ps(half_to_float(b[g]));
        for (int c = g * gs; c < (g + 1) * gs; c += 32) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(q + c / 2));
            __m512 wl = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low)));
            __m512 wh = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low)));
            wl = _mm512_fmadd_ps(wl, sc, bi);
            wh = _mm512_fmadd_ps(wh, sc, bi);
            for (int m = 0; m < M; m++) {
                const float *xe = xp + (size_t)m * K + c;
                acc[m] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xe), acc[m]);
                acc[m] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xe + 16), acc[m]);
            }
        }
    }
    for (int m = 0; m < M; m++) y[(size_t)m * ldy] = _mm512_reduce_add_ps(acc[m]);
}

/* Two output rows at once: each load of x feeds four multiply-adds instead of two, which is
 * what bounds several input rows (x no longer fits the L1 cache at 8 rows of 1536). */
static inline __attribute__((always_inline)) void q4_rows2(int M, int K, int gs, const uint8_t *q,
        size_t row_bytes, const uint16_t *s, const uint16_t *b, size_t G, const float *xp, float *y, int ldy) {
    __m512 acc0[KILN_QMM_MAX_ROWS], acc1[KILN_QMM_MAX_ROWS];
    for (int m = 0; m < M; m++) acc0[m] = acc1[m] = _mm512_setzero_ps();
    const __m128i low = _mm_set1_epi8(15);
    const uint8_t *q1 = q + row_bytes;
    for (int g = 0; g < K / gs; g++) {
        __m512 sc0 = _mm512_set1_ps(half_to_float(s[g])), bi0 = _mm512_set1_ps(half_to_float(b[g]));
        __m512 sc1 = _mm512_set1_ps(half_to_float(s[G + g])), bi1 = _mm512_set1_ps(half_to_float(b[G + g]));
        for (int c = g * gs; c < (g + 1) * gs; c += 32) {
            __m128i b0 = _mm_loadu_si128((const __m128i *)(q + c / 2));
            __m128i b1 = _mm_loadu_si128((const __m128i *)(q1 + c / 2));
            __m512 wl0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b0, low))), sc0, bi0);
            __m512 wh0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b0, 4), low))), sc0, bi0);
            __m512 wl1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b1, low))), sc1, bi1);
            __m512 wh1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b1, 4), low))), sc1, bi1);
            for (int m = 0; m < M; m++) {
                const float *xe = xp + (size_t)m * K + c;
                __m512 even = _mm512_loadu_ps(xe), odd = _mm512_loadu_ps(xe + 16);
                acc0[m] = _mm512_fmadd_ps(wh0, odd, _mm512_fmadd_ps(wl0, even, acc0[m]));
                acc1[m] = _mm512_fmadd_ps(wh1, odd, _mm512_fmadd_ps(wl1, even, acc1[m]));
            }
        }
    }
    for (int m = 0; m < M; m++) {
        y[(size_t)m * ldy] = _mm512_reduce_add_ps(acc0[m]);
        y[(size_t)m * ldy + 1] = _mm512_reduce_add_ps(acc1[m]);
    }
}

static inline __attribute__((always_inline)) void q8_row(int M, int K, int gs, const uint8_t *q,
        const uint16_t *s, const uint16_t *b, const float *x, float *y, int ldy) {
    __m512 acc[KILN_QMM_MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int g = 0; g < K / gs; g++) {
        __m512 sc = _mm512_set1_ps(half_to_float(s[g])), bi = _mm512_set1_ps(half_to_float(b[g]));
        for (int c = g * gs; c < (g + 1) * gs; c += 16) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(q + c));
            __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), sc, bi);
            for (int m = 0; m < M; m++)
                acc[m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + (size_t)m * K + c), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) y[(size_t)m * ldy] = _mm512_reduce_add_ps(acc[m]);
}
#else
/* y[m * ldy] = the sum of row m's 16 partial sums. */
static inline void store_sums(int M, float acc[][16], float *y, int ldy) {
    for (int m = 0; m < M; m++) {
        float t = 0.f;
        for (int j = 0; j < 16; j++) t += acc[m][j];
        y[(size_t)m * ldy] = t;
    }
}

static inline void q4_row(int M, int K, int gs, const uint8_t *q, const uint16_t *s,
        const uint16_t *b, const float *xp, float *y, int ldy) {
    float acc[KILN_QMM_MAX_ROWS][16];
    memset(acc, 0, sizeof acc);
    for (int g = 0; g < K / gs; g++) {
        float sc = half_to_float(s[g]), bi = half_to_float(b[g]);
        for (int c = g * gs; c < (g + 1) * gs; c += 32) {
            float wl[16], wh[16];
            for (int j = 0; j < 16; j++) {
                wl[j] = (float)(q[c / 2 + j] & 15) * sc + bi;
                wh[j] = (float)(q[c / 2 + j] >> 4) * sc + bi;
            }
            for (int m = 0; m < M; m++) {
                const float *xe = xp + (size_t)m * K + c;
                for (int j = 0; j < 16; j++) acc[m][j] += wl[j] * xe[j] + wh[j] * xe[16 + j];
            }
        }
    }
    store_sums(M, acc, y, ldy);
}

static inline void q4_rows2(int M, int K, int gs, const uint8_t *q, size_t row_bytes,
        const uint16_t *s, const uint16_t *b, size_t G, const float *xp, float *y, int ldy) {
    q4_row(M, K, gs, q, s, b, xp, y, ldy);
    q4_row(M, K, gs, q + row_bytes, s + G, b + G, xp, y + 1, ldy);
}

static inline void q8_row(int M, int K, int gs, const uint8_t *q, const uint16_t *s,
        const uint16_t *b, const float *x, float *y, int ldy) {
    float acc[KILN_QMM_MAX_ROWS][16];
    memset(acc, 0, sizeof acc);
    for (int g = 0; g < K / gs; g++) {
        float sc = half_to_float(s[g]), bi = half_to_float(b[g]);
        for (int c = g * gs; c < (g + 1) * gs; c += 16) {
            float w[16];
            for (int j = 0; j < 16; j++) w[j] = (float)q[c + j] * sc + bi;
            for (int m = 0; m < M; m++)
                for (int j = 0; j < 16; j++) acc[m][j] += w[j] * x[(size_t)m * K + c + j];
        }
    }
    store_sums(M, acc, y, ldy);
}
#endif

/* y (M, N) = x (M, K) @ dequantize(q, s, b).T for 1 <= M <= KILN_QMM_MAX_ROWS.
 * bits is 4 or 8; group_size a multiple of 32 dividing K; work holds M * K floats.
 * Returns 0, or -1 when the arguments are outside what the loops handle. */
int kiln_qmm(int bits, int M, int N, int K, int group_size, const uint8_t *q, const uint16_t *s,
             const uint16_t *b, const float *x, float *y, float *work) {
    if (M < 1 || M > KILN_QMM_MAX_ROWS || group_size % 32 || K % group_size || (bits != 4 && bits != 8))
        return -1;
    const float *xk = x;
    if (bits == 4) {
        permute_even_odd(M, K, x, work);
        xk = work;
    }
    size_t row_bytes = (size_t)K * bits / 8, G = (size_t)(K / group_size);
    int parallel = (long)M * N * K >= parallel_macs;
    /* 4-bit output rows are taken two at a time for 2+ input rows; work item t is then the
     * pair 2t, and the last item of an odd N a single row. */
    int pairs = (bits == 4 && M >= 2) ? N / 2 : 0;
    int items = pairs + (N - 2 * pairs);
#define KILN_ROWS(n)                                                                            \
    case n:                                                                                     \
        _Pragma("omp parallel for schedule(static) if(parallel)")                               \
        for (int t = 0; t < items; t++) {                                                       \
            int o = t < pairs ? 2 * t : 2 * pairs + (t - pairs);                                \
            if (t < pairs) q4_rows2(n, K, group_size, q + o * row_bytes, row_bytes, s + o * G, b + o * G, G, xk, y + o, N); \
            else if (bits == 4) q4_row(n, K, group_size, q + o * row_bytes, s + o * G, b + o * G, xk, y + o, N); \
            else q8_row(n, K, group_size, q + o * row_bytes, s + o * G, b + o * G, xk, y + o, N); \
        }                                                                                       \
        break;
    switch (M) {
        KILN_ROWS(1) KILN_ROWS(2) KILN_ROWS(3) KILN_ROWS(4)
        KILN_ROWS(5) KILN_ROWS(6) KILN_ROWS(7) KILN_ROWS(8)
    }
#undef KILN_ROWS
    return 0;
}
