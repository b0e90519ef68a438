/* A whole forward pass of a llama-family decoder (llama, qwen2 biases, qwen3 q/k norms) for a
 * few new tokens per row, in one call: embedding, RMSNorms, q/k/v (+ bias, + per-head norm),
 * RoPE, the KV append into the caller's cache buffers, attention over each row's past (left
 * padding skipped, causal among the new tokens), o-proj, SwiGLU, residuals, the final norm and
 * the output head.
 *
 * Why: with the weights' products in C, the decode step of a small model was dominated by what
 * ran between them (numpy per layer, ctypes per call, one thread for the small ops). Here one
 * OpenMP team runs the whole pass: every product is split over the team by output columns, even
 * at one row, and the small steps between them run on one thread behind a barrier.
 *
 * Activations. Where the CPU has integer dot products (AVX-512 VNNI, AVX-VNNI, AVX2's maddubs,
 * Arm's dotprod) the input of each product is quantized to 8 bits per block of 32 (scale =
 * max |x| / 127, round to nearest), and each block of 4- or 8-bit weights is multiplied in
 * integers: with mlx's affine weights w = s * q + b,
 *     sum_k x_k w_k = sum_blocks s * d * sum(q * xi)  +  sum_groups b * sum(x_k)
 * where d is the block's activation scale and xi its 8-bit values, and the sums of the second
 * term are those of the rounded values (d * sum(xi)): the result is then exactly the product of
 * the weights with the rounded activations, whose error scales with |w|, not with the group's
 * offset b (exact sums there doubled the error on affine weights). This is what llama.cpp does
 * (Q8_1 activations, which carry d * sum(xi), against Q4_1 weights). Elsewhere,
 * or when asked, the products dequantize in registers and multiply in float32 (qmatmul.c).
 *
 * This file is compiled once per instruction-set variant (see __init__.py); the variant's
 * macros (__AVX512VNNI__, __AVXVNNI__, __AVX2__, __ARM_FEATURE_DOTPROD) pick the loops.
 */
#include "qmatmul.c"

#include <stdlib.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#endif

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__) || defined(__AVX2__)
#define KILN_INT8_AVX 1
#define KILN_INT8 1
#elif defined(__ARM_FEATURE_DOTPROD)
#define KILN_INT8_NEON 1
#define KILN_INT8 1
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KILN_VARIANT "avx512vnni"
#elif defined(__AVXVNNI__)
#define KILN_VARIANT "avxvnni"
#elif defined(__AVX2__)
#define KILN_VARIANT "avx2"
#elif defined(__ARM_FEATURE_DOTPROD)
#define KILN_VARIANT "dotprod"
#else
#define KILN_VARIANT "portable"
#endif

const char *kiln_variant(void) { return KILN_VARIANT; }
int kiln_has_int8(void) {
#ifdef KILN_INT8
    return 1;
#else
    return 0;
#endif
}

/* ---- the model, as the caller lays it out (mirrored by ctypes Structures) ------------------ */

typedef struct {
    const uint8_t *q;     /* (n, k * bits / 8) packed as mlx packs it */
    const uint16_t *s;    /* (n, k / gs) float16 scales */
    const uint16_t *b;    /* (n, k / gs) float16 biases */
    const float *bias;    /* (n,) added after the product, or NULL */
    int bits, gs, n, k;
    int type;             /* 0: the mlx layout above; else a GGML type (ggml.c): q is the file's
                           * blocks, (n, kiln_ggml_row_bytes(type, k)), s and b unused */
} kiln_qw;

typedef struct {
    const float *attn_norm, *mlp_norm;
    const float *q_norm, *k_norm; /* per-head RMSNorm weights (head_dim,), or NULL */
    kiln_qw q, k, v, o, gate, up, down;
} kiln_layer;

typedef struct {
    int n_layers, hidden, inter, heads, kv_heads, head_dim, vocab, rope_traditional;
    float eps, scale;
    const double *inv_freq; /* (head_dim / 2,) RoPE frequencies, already times the RoPE scale */
    const float *embedding; /* (vocab, hidden) float32 */
    const float *final_norm;
    kiln_qw head;
    const kiln_layer *layers;
    kiln_qw embed_q; /* the embedding as GGML blocks where `embedding` is NULL */
} kiln_model;

/* One layer's cache: (B, kv_heads, capacity, position) buffers, strides in bytes. A position
 * holds one head's key (or value) vector, as `kind` says: KILN_KV_FLOAT32, head_dim floats; or
 * KILN_KV_INT8, head_dim int8 values in blocks of KILN_KV_BLOCK, each block's float32 scale after
 * them (llama.cpp's q8_0 in content, 36 bytes per 32 values where float32 takes 128). */
typedef struct {
    char *keys, *values;
    long k_row, k_head, v_row, v_head, kind;
} kiln_cache;

enum { KILN_KV_FLOAT32 = 0, KILN_KV_INT8 = 1 };
#define KILN_KV_BLOCK 32

/* Bytes of one position of a cache of this kind (the Python side sizes buffers alike). */
static inline long kv_position_bytes(long kind, int D) {
    return kind == KILN_KV_INT8 ? D + 4L * (D / KILN_KV_BLOCK) : 4L * D;
}

/* The position `pos` of row b, KV head g of a key or value buffer. */
static inline char *kv_at(char *base, long row, long head, int b, int g, long pos, long position_bytes) {
    return base + b * row + g * head + pos * position_bytes;
}

/* Write D floats to a position: copied, or rounded to 8 bits per block of 32 with the block's
 * largest magnitude as 127 (the scale is that over 127, so every value is within half a step). */
static void kv_store(char *dst, const float *x, int D, long kind) {
    if (kind != KILN_KV_INT8) {
        memcpy(dst, x, sizeof(float) * D);
        return;
    }
    int8_t *q = (int8_t *)dst;
    float *scales = (float *)(dst + D);
    for (int blk = 0; blk < D / KILN_KV_BLOCK; blk++) {
        const float *xb = x + blk * KILN_KV_BLOCK;
        float amax = 0.f;
        for (int i = 0; i < KILN_KV_BLOCK; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        for (int i = 0; i < KILN_KV_BLOCK; i++) q[blk * KILN_KV_BLOCK + i] = (int8_t)lrintf(xb[i] * id);
        scales[blk] = d;
    }
}

/* D floats of an 8-bit position. */
static inline void kv_load_int8(float *out, const char *src, int D) {
    const int8_t *q = (const int8_t *)src;
    const float *scales = (const float *)(src + D);
    for (int blk = 0; blk < D / KILN_KV_BLOCK; blk++) {
        const float d = scales[blk];
#pragma omp simd
        for (int i = 0; i < KILN_KV_BLOCK; i++) out[blk * KILN_KV_BLOCK + i] = d * (float)q[blk * KILN_KV_BLOCK + i];
    }
}

/* q . k for an 8-bit key position: a sum per block, times its scale. */
static inline float kv_dot_int8(const float *q, const char *k, int D) {
    const int8_t *k8 = (const int8_t *)k;
    const float *scales = (const float *)(k + D);
    float dot = 0.f;
    for (int blk = 0; blk < D / KILN_KV_BLOCK; blk++) {
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int i = 0; i < KILN_KV_BLOCK; i++) s += q[blk * KILN_KV_BLOCK + i] * (float)k8[blk * KILN_KV_BLOCK + i];
        dot += s * scales[blk];
    }
    return dot;
}

/* o += w * v for an 8-bit value position: each block's scale folded into the weight. */
static inline void kv_add_int8(float *o, float w, const char *v, int D) {
    const int8_t *v8 = (const int8_t *)v;
    const float *scales = (const float *)(v + D);
    for (int blk = 0; blk < D / KILN_KV_BLOCK; blk++) {
        const float wd = w * scales[blk];
#pragma omp simd
        for (int i = 0; i < KILN_KV_BLOCK; i++) o[blk * KILN_KV_BLOCK + i] += wd * (float)v8[blk * KILN_KV_BLOCK + i];
    }
}

/* ---- small vector helpers ------------------------------------------------------------------ */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* KILN_DEFINE_EXP(name, vf, vi): `static vf name(vf x)` = e^x lane by lane, for a float
 * vector type vf and the int32 vector type vi of its width (Cephes' expf, within 2 ulp; any x:
 * clamped to [-87, 88]). Why a macro: exp8 here and attention.c's expk (as wide as its key tile)
 * are the same polynomial, and one definition keeps its constants in one place while each width stays a
 * single vector expression (portable vector code: the compiler emits SSE, AVX, AVX-512 or NEON
 * for it; glibc's expf is scalar). */
#define KILN_DEFINE_EXP(name, vf, vi)                                                              \
    static inline vf name(vf x) {                                                                  \
        const vf lo = (vf){0} - 87.f, hi = (vf){0} + 88.f;                                         \
        x = (vf)(((vi)lo & (x < lo)) | ((vi)x & ~(x < lo)));                                       \
        x = (vf)(((vi)hi & (x > hi)) | ((vi)x & ~(x > hi)));                                       \
        vf fx = x * 1.44269504088896341f + 0.5f;                                                   \
        vi n = __builtin_convertvector(fx, vi);                                                    \
        n += (vi)(__builtin_convertvector(n, vf) > fx); /* truncation to floor: -1 where it rounded up */ \
        vf nf = __builtin_convertvector(n, vf);                                                    \
        vf r = x - nf * 0.693359375f;                                                              \
        r = r - nf * -2.12194440e-4f;                                                              \
        vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                            \
        p = p * r + 8.3334519073e-3f;                                                              \
        p = p * r + 4.1665795894e-2f;                                                              \
        p = p * r + 1.6666665459e-1f;                                                              \
        p = p * r + 5.0000001201e-1f;                                                              \
        p = p * (r * r) + r + 1.0f;                                                                \
        vi e = (n + 127) << 23;                                                                    \
        return p * (vf)e;                                                                          \
    }

/* e^x, 8 lanes. */
KILN_DEFINE_EXP(exp8, v8f, v8i)

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* p[j] = e^(p[j] - top) for j < n; returns their sum. */
static float softmax_exp(float *p, int n, float top) {
    float total = 0.f;
    int j = 0;
    v8f sum = {0};
    for (; j + 8 <= n; j += 8) {
        v8f e = exp8(load8(p + j) - top);
        store8(p + j, e);
        sum += e;
    }
    for (int i = 0; i < 8; i++) total += sum[i];
    for (; j < n; j++) {
        p[j] = expf(p[j] - top);
        total += p[j];
    }
    return total;
}

/* g[j] = silu(g[j]) * u[j] */
static void swiglu(float *g, const float *u, int n) {
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        v8f x = load8(g + j);
        store8(g + j, x / (1.0f + exp8(-x)) * load8(u + j));
    }
    for (; j < n; j++) g[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

static void rms_norm(const float *x, const float *w, float eps, int n, float *out) {
    float ss = 0.f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* ---- activations as a product's input ------------------------------------------------------ */

/* One product input of M rows of K values, in the form its weights' loops read it. */
typedef struct {
    int M, K, bits, gs;
    const float *x; /* (M, K) as computed */
    float *xp;      /* float path: (M, K), 4-bit: permuted per 32 into [16 even, 16 odd] */
#ifdef KILN_INT8
    int8_t *xq;     /* (M, xq_ld) 8-bit values, per pair of blocks [A.h0, B.h0, A.h1, B.h1] */
    float *dexp;    /* (M, dexp_ld) per pair: [dA x4, dB x4] */
    float *xsum;    /* (M, g_ld) per weight group: the sum of its rounded values, d * sum(xi) */
    long xq_ld, dexp_ld, g_ld;
#endif
    int type;       /* the weights' GGML type (0: mlx's layout): the g* fields below then */
    int8_t *gq;     /* (M, gq_ld) 8-bit values in natural order, per block of 32 */
    float *gd;      /* (M, gd_ld) their scales, one per 32 */
    int32_t *gsum;  /* (M, gsum_ld) the sum of each 16 of them */
    long gq_ld, gd_ld, gsum_ld;
} kiln_act;

#include "ggml.c"
#include "panels.c"
#include "gemm.c"

#ifdef KILN_INT8
/* Block b's two halves: h0 = the 16 values the low nibbles (4-bit) or the first 16 bytes
 * (8-bit) of its weights meet, h1 the others. A pair of blocks is stored [A.h0, B.h0, A.h1,
 * B.h1] so that one 32-byte load of weights and two of activations give int32 lanes 0-3 for
 * block A and 4-7 for block B; a lone last block is [h0, h1]. */
static void quantize_row(int K, int bits, int gs, const float *x, int8_t *xq, float *dexp, float *xsum) {
    int nb = K / 32, G = K / gs;
    for (int g = 0; g < G; g++) xsum[g] = 0.f;
    for (int blk = 0; blk < nb; blk++) {
        const float *xb = x + blk * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; j++) {
            float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int8_t v[32];
        int isum = 0;
        for (int j = 0; j < 32; j++) {
            v[j] = (int8_t)lrintf(xb[j] * id);
            isum += v[j];
        }
        int p = blk / 2, side = blk % 2, lone = (blk == nb - 1) && (nb % 2);
        int8_t *h0 = xq + p * 64 + (lone ? 0 : side * 16), *h1 = xq + p * 64 + (lone ? 16 : 32 + side * 16);
        for (int j = 0; j < 16; j++) {
            h0[j] = bits == 4 ? v[2 * j] : v[j];
            h1[j] = bits == 4 ? v[2 * j + 1] : v[16 + j];
        }
        for (int j = 0; j < 4; j++) dexp[p * 8 + side * 4 + j] = d;
        if (lone)
            for (int j = 4; j < 8; j++) dexp[p * 8 + j] = 0.f;
        xsum[blk * 32 / gs] += d * (float)isum;
    }
}
#endif

/* Row m of a product's input in the form its weights' loops read. */
static void prepare_row(const kiln_act *a, int m, int int8) {
    if (a->type) { /* GGML blocks: 8-bit activations always, as llama.cpp takes them */
        ggml_quantize_row(a->K, a->x + (size_t)m * a->K, a->gq + m * a->gq_ld, a->gd + m * a->gd_ld, a->gsum + m * a->gsum_ld);
        return;
    }
#ifdef KILN_INT8
    if (int8) {
        quantize_row(a->K, a->bits, a->gs, a->x + (size_t)m * a->K, a->xq + m * a->xq_ld,
                     a->dexp + m * a->dexp_ld, a->xsum + m * a->g_ld);
        return;
    }
#endif
    (void)int8;
    if (a->bits == 4) permute_even_odd(1, a->K, a->x + (size_t)m * a->K, a->xp + (size_t)m * a->K);
    else memcpy(a->xp + (size_t)m * a->K, a->x + (size_t)m * a->K, sizeof(float) * a->K);
}

static void prepare_act(kiln_act *a, int int8) {
    for (int m = 0; m < a->M; m++) prepare_row(a, m, int8);
}



/* ---- integer dot products: one output column for a tile of up to 8 rows ---------------------- */

#if defined(KILN_INT8_AVX)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define SIGNED_Q8 0
#elif defined(__AVXVNNI__)
#define DOT(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define SIGNED_Q8 0
#else
/* AVX2: u8 x s8 pairs to int16 (4-bit weights: |15 * 127 * 2| fits), pairs of those to int32. */
#define DOT(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
/* 8-bit weights would saturate int16: they are taken as q - 128 (signed) and multiplied as
 * |q - 128| (at most 128, unsigned) by x * sign(q - 128); the 128 * sum(xi) this leaves out is
 * added back per group (xsum). */
#define SIGNED_Q8 1
#endif

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void qdot_tile(const int M, const kiln_qw *w, int o, const kiln_act *a, int m0, float *y, long ldy) {
    const int K = w->k, gs = w->gs, bits = w->bits, nb = K / 32, np = nb / 2, G = K / gs;
    const size_t row_bytes = (size_t)K * bits / 8;
    const uint8_t *q = w->q + o * row_bytes;
    const uint16_t *s = w->s + (size_t)o * G, *bq = w->b + (size_t)o * G;
    const int8_t *xq = a->xq + m0 * a->xq_ld;
    const float *dexp = a->dexp + m0 * a->dexp_ld;
    __m256 acc[KILN_QMM_MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(15);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int p = 0; p <= np; p++) {
        int lone = p == np;
        if (lone && !(nb % 2)) break;
        __m256i first, second;
        if (bits == 4) {
            __m256i v = lone ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(q + p * 32)))
                             : _mm256_loadu_si256((const __m256i *)(q + p * 32));
            first = _mm256_and_si256(v, low);
            second = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        } else {
            const uint8_t *qp = q + p * 64;
            __m128i a0 = _mm_loadu_si128((const __m128i *)qp), a1 = _mm_loadu_si128((const __m128i *)(qp + 16));
            if (SIGNED_Q8) {
                a0 = _mm_xor_si128(a0, _mm256_castsi256_si128(flip));
                a1 = _mm_xor_si128(a1, _mm256_castsi256_si128(flip));
            }
            if (lone) {
                first = _mm256_zextsi128_si256(a0);
                second = _mm256_zextsi128_si256(a1);
            } else {
                __m128i b0 = _mm_loadu_si128((const __m128i *)(qp + 32)), b1 = _mm_loadu_si128((const __m128i *)(qp + 48));
                if (SIGNED_Q8) {
                    b0 = _mm_xor_si128(b0, _mm256_castsi256_si128(flip));
                    b1 = _mm_xor_si128(b1, _mm256_castsi256_si128(flip));
                }
                first = _mm256_set_m128i(b0, a0);
                second = _mm256_set_m128i(b1, a1);
            }
        }
        __m256 sv;
        if (gs == 32 && !lone) sv = _mm256_set_m128(_mm_set1_ps(half_to_float(s[2 * p + 1])), _mm_set1_ps(half_to_float(s[2 * p])));
        else sv = _mm256_set1_ps(half_to_float(s[p * 64 / gs]));
        for (int m = 0; m < M; m++) {
            const int8_t *xm = xq + m * a->xq_ld + p * 64;
            __m256i xf, xs;
            if (lone) {
                xf = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)xm));
                xs = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(xm + 16)));
            } else {
                xf = _mm256_loadu_si256((const __m256i *)xm);
                xs = _mm256_loadu_si256((const __m256i *)(xm + 32));
            }
            __m256i i = _mm256_setzero_si256();
            if (bits == 8 && SIGNED_Q8) {
#if SIGNED_Q8
                i = _mm256_add_epi32(i, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(first), _mm256_sign_epi8(xf, first)), _mm256_set1_epi16(1)));
                i = _mm256_add_epi32(i, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(second), _mm256_sign_epi8(xs, second)), _mm256_set1_epi16(1)));
#endif
            } else {
                i = DOT(i, first, xf);
                i = DOT(i, second, xs);
            }
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(sv, _mm256_loadu_ps(dexp + m * a->dexp_ld + p * 8)), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) {
        const float *xsum = a->xsum + (m0 + m) * a->g_ld;
        float extra = 0.f;
        int g = 0;
        for (; g + 8 <= G; g += 8) {
            __m256 bf = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bq + g)));
            if (bits == 8 && SIGNED_Q8) bf = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + g))), _mm256_set1_ps(128.f), bf);
            acc[m] = _mm256_fmadd_ps(bf, _mm256_loadu_ps(xsum + g), acc[m]);
        }
        for (; g < G; g++) {
            float bias = half_to_float(bq[g]) + (bits == 8 && SIGNED_Q8 ? 128.f * half_to_float(s[g]) : 0.f);
            extra += bias * xsum[g];
        }
        y[m * ldy] = hsum8(acc[m]) + extra;
    }
}
#elif defined(KILN_INT8_NEON)
static inline __attribute__((always_inline)) void qdot_tile(const int M, const kiln_qw *w, int o, const kiln_act *a, int m0, float *y, long ldy) {
    const int K = w->k, gs = w->gs, bits = w->bits, nb = K / 32, G = K / gs;
    const size_t row_bytes = (size_t)K * bits / 8;
    const uint8_t *q = w->q + o * row_bytes;
    const uint16_t *s = w->s + (size_t)o * G, *bq = w->b + (size_t)o * G;
    float32x4_t acc[KILN_QMM_MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = vdupq_n_f32(0.f);
    const uint8x16_t low = vdupq_n_u8(15), flip = vdupq_n_u8(0x80);
    for (int blk = 0; blk < nb; blk++) {
        int p = blk / 2, side = blk % 2, lone = (blk == nb - 1) && (nb % 2);
        int8x16_t first, second;
        if (bits == 4) {
            uint8x16_t v = vld1q_u8(q + blk * 16);
            first = vreinterpretq_s8_u8(vandq_u8(v, low));
            second = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
        } else { /* dotprod multiplies signed bytes: q - 128, and 128 * sum(x) added per group */
            first = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(q + blk * 32), flip));
            second = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(q + blk * 32 + 16), flip));
        }
        float sc = half_to_float(s[blk * 32 / gs]);
        int off0 = p * 64 + (lone ? 0 : side * 16), off1 = p * 64 + (lone ? 16 : 32 + side * 16);
        for (int m = 0; m < M; m++) {
            const int8_t *xm = a->xq + (m0 + m) * a->xq_ld;
            int32x4_t i = vdotq_s32(vdotq_s32(vdupq_n_s32(0), first, vld1q_s8(xm + off0)), second, vld1q_s8(xm + off1));
            float d = a->dexp[(m0 + m) * a->dexp_ld + p * 8 + side * 4];
            acc[m] = vfmaq_n_f32(acc[m], vcvtq_f32_s32(i), sc * d);
        }
    }
    for (int m = 0; m < M; m++) {
        const float *xsum = a->xsum + (m0 + m) * a->g_ld;
        float extra = vaddvq_f32(acc[m]);
        for (int g = 0; g < G; g++) extra += (half_to_float(bq[g]) + (bits == 8 ? 128.f * half_to_float(s[g]) : 0.f)) * xsum[g];
        y[m * ldy] = extra;
    }
}
#endif

/* The columns one share of a product's work covers: a panel's 16 (panels.c), else one. */
static inline int unit_columns(const kiln_qw *w) { return w->type & KILN_X16 ? X16_ROWS : 1; }

/* Column o of w for rows m0 .. m0 + M - 1 of a, into y[m * ldy] (y already offset by o); where
 * w is in panels, o is a panel's first column and the share is its 16. */
static void product_column(const kiln_qw *w, int o, const kiln_act *a, int int8, float *y, long ldy) {
    for (int m0 = 0; m0 < a->M; m0 += KILN_QMM_MAX_ROWS) {
        int M = a->M - m0 < KILN_QMM_MAX_ROWS ? a->M - m0 : KILN_QMM_MAX_ROWS;
        float *ym = y + m0 * ldy;
#ifdef KILN_X16_LOOPS
        if (w->type & KILN_X16) {
            x16_panel(w, o / X16_ROWS, a, m0, M, ym - o, ldy);
            continue;
        }
#endif
        if (w->type) {
#define KILN_TILE(n) case n: ggml_tile(n, w, o, a, m0, ym, ldy); break;
            switch (M) { KILN_TILE(1) KILN_TILE(2) KILN_TILE(3) KILN_TILE(4) KILN_TILE(5) KILN_TILE(6) KILN_TILE(7) KILN_TILE(8) }
#undef KILN_TILE
            continue;
        }
#ifdef KILN_INT8
        if (int8) {
#define KILN_TILE(n) case n: qdot_tile(n, w, o, a, m0, ym, ldy); break;
            switch (M) { KILN_TILE(1) KILN_TILE(2) KILN_TILE(3) KILN_TILE(4) KILN_TILE(5) KILN_TILE(6) KILN_TILE(7) KILN_TILE(8) }
#undef KILN_TILE
            continue;
        }
#endif
        (void)int8;
        size_t row_bytes = (size_t)w->k * w->bits / 8, G = (size_t)(w->k / w->gs);
        const float *xp = a->xp + (size_t)m0 * w->k;
        if (w->bits == 4) q4_row(M, w->k, w->gs, w->q + o * row_bytes, w->s + o * G, w->b + o * G, xp, ym, (int)ldy);
        else q8_row(M, w->k, w->gs, w->q + o * row_bytes, w->s + o * G, w->b + o * G, xp, ym, (int)ldy);
    }
}

/* Up to three products of the same input, their columns split over the team as one range
 * (q, k and v; gate and up): one barrier instead of three. */
typedef struct {
    const kiln_qw *w;
    float *y;
    long ldy;
} kiln_job;

/* Share c of the jobs' columns: the c-th panel (or column) counting through them in order. */
static inline void product_unit(const kiln_job *jobs, const kiln_act *a, int int8, int c) {
    int j = 0, u = c;
    while (u >= jobs[j].w->n / unit_columns(jobs[j].w)) {
        u -= jobs[j].w->n / unit_columns(jobs[j].w);
        j++;
    }
    const int o = u * unit_columns(jobs[j].w);
    product_column(jobs[j].w, o, a, int8, jobs[j].y + o, jobs[j].ldy);
}

static void products(const kiln_job *jobs, int n_jobs, const kiln_act *a, int int8) {
#ifdef KILN_GEMM
    if (a->type && gemm_takes(a->M)) { /* a prefill chunk against GGUF blocks: gemm.c */
        int tiles = 0;
        for (int j = 0; j < n_jobs; j++) tiles += (jobs[j].w->n + GEMM_COLS - 1) / GEMM_COLS;
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < tiles; t++) {
            int j = 0, tt = t;
            while (tt >= (jobs[j].w->n + GEMM_COLS - 1) / GEMM_COLS) tt -= (jobs[j++].w->n + GEMM_COLS - 1) / GEMM_COLS;
            if (gemm_column_tile(jobs[j].w, tt, a, jobs[j].y, jobs[j].ldy) != 0) /* no scratch: the column loops */
                for (int o = tt * GEMM_COLS; o < jobs[j].w->n && o < (tt + 1) * GEMM_COLS; o++)
                    product_column(jobs[j].w, o, a, int8, jobs[j].y + o, jobs[j].ldy);
        }
        return;
    }
#endif
    int total = 0;
    for (int j = 0; j < n_jobs; j++) total += jobs[j].w->n / unit_columns(jobs[j].w);
    if (a->M > KILN_QMM_MAX_ROWS) {
        /* A prefill chunk on the panel loops (no GEMM: AVX2, AVX-VNNI): a panel is M / 8 tiles
         * of compute, and the jobs' types cost differently (a Q4_K_M file's Q6_K v beside its
         * Q4_K q and k), so shares are taken one panel at a time, not cut in equal halves. */
#pragma omp for schedule(dynamic, 1)
        for (int c = 0; c < total; c++) product_unit(jobs, a, int8, c);
    } else {
        /* Decoding: each thread streams one contiguous range, with no shared counter. */
#pragma omp for schedule(static)
        for (int c = 0; c < total; c++) product_unit(jobs, a, int8, c);
    }
}

/* ---- the pass ------------------------------------------------------------------------------ */

typedef struct {
    float *h, *x, *qkv, *att, *tmp, *gu, *xp, *scores, *cosv, *sinv, *xsum, *dexp;
    int8_t *xq;
    int32_t *gsum;
    long kmax, xq_ld, dexp_ld, g_ld, gsum_ld, qkv_ld, S;
} kiln_scratch;

static long round_up(long n, long to) { return (n + to - 1) / to * to; }

/* The team size of the calling thread's next pass: attention's scores are one row per thread. */
static int pass_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static int thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

#include "attention.c"

/* Each thread's attention scratch: a row of S scores, or attention_chunk's tiles. */
static long score_floats(const kiln_model *m, int S) {
    long chunk = attention_chunk_floats(m);
    return round_up(S > chunk ? S : chunk, 16);
}

/* Scratch floats a pass of M tokens over caches of at most S positions needs. */
long kiln_forward_work(const kiln_model *m, int M, int S) {
    long kmax = m->hidden > m->inter ? m->hidden : m->inter;
    long qd = (long)m->heads * m->head_dim, kd = (long)m->kv_heads * m->head_dim;
    if (qd > kmax) kmax = qd;
    long per_row = m->hidden * 3 + kmax * 2 + (qd + 2 * kd) + qd + 2 * m->inter + m->head_dim
                 + (kmax + 64) / 4 + (kmax / 64 + 1) * 8 + 16 + 2 * (kmax / 32 + 1) + (kmax / 16 + 16) + 64;
    return (long)M * per_row + (long)pass_threads() * (score_floats(m, S) + 16) + 1024;
}

static void carve(const kiln_model *m, int M, int S, float *work, kiln_scratch *w) {
    long kmax = m->hidden > m->inter ? m->hidden : m->inter;
    long qd = (long)m->heads * m->head_dim, kd = (long)m->kv_heads * m->head_dim;
    if (qd > kmax) kmax = qd;
    float *p = work;
#define TAKE(name, count) do { w->name = p; p += round_up((long)(count), 16); } while (0)
    TAKE(h, (long)M * m->hidden);
    TAKE(x, (long)M * kmax);
    TAKE(tmp, (long)M * m->hidden);
    TAKE(qkv, (long)M * (qd + 2 * kd));
    TAKE(att, (long)M * qd);
    TAKE(gu, (long)M * 2 * m->inter);
    TAKE(xp, (long)M * kmax);
    TAKE(cosv, (long)M * m->head_dim / 2);
    TAKE(sinv, (long)M * m->head_dim / 2);
    w->xq_ld = round_up(kmax, 64);
    w->xq = (int8_t *)p;
    p += round_up((long)M * (kmax + 64) / 4, 16);
    w->dexp_ld = (kmax / 64 + 1) * 8 + 16; /* also the GGML form's scales, k / 32 + 16 per row */
    TAKE(dexp, (long)M * w->dexp_ld);
    w->g_ld = kmax / 32 + 1;
    TAKE(xsum, (long)M * w->g_ld);
    w->gsum_ld = kmax / 16 + 16;
    w->gsum = (int32_t *)p;
    p += round_up((long)M * w->gsum_ld, 16);
    TAKE(scores, (long)pass_threads() * score_floats(m, S));
#undef TAKE
    w->kmax = kmax;
    w->qkv_ld = qd + 2 * kd;
    w->S = score_floats(m, S); /* each thread's scores, this far apart */
}

static kiln_act act_for(const kiln_scratch *w, const kiln_qw *q, const float *x, int M) {
    kiln_act a;
    a.M = M;
    a.K = q->k;
    a.bits = q->bits;
    a.gs = q->gs;
    a.x = x;
    a.xp = w->xp;
    a.type = q->type;
    a.gq = w->xq; /* the GGML form shares the 8-bit buffers: a product takes one form */
    a.gd = w->dexp;
    a.gsum = w->gsum;
    /* Rows as close as this product's width allows, a cache line apart: with the widest
     * layer's stride (8,192 bytes on a 1B model) the rows of a tile all fell into the same L1
     * sets and evicted one another (8 rows cost ~35% more per row than 1). */
    a.gq_ld = q->k + 64;
    a.gd_ld = q->k / 32 + 16;
    a.gsum_ld = q->k / 16 + 16;
#ifdef KILN_INT8
    a.xq = w->xq;
    a.dexp = w->dexp;
    a.xsum = w->xsum;
    a.xq_ld = w->xq_ld;
    a.dexp_ld = w->dexp_ld;
    a.g_ld = w->g_ld;
#endif
    return a;
}

/* x (M, n) lives in rows of stride ld: rotate each head's pairs ((2i, 2i+1) "traditional",
 * else (i, i + d/2)) by the token's angles. */
static void rope(float *x, int heads, int d, const float *cosv, const float *sinv, int traditional) {
    int half = d / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + h * d;
        for (int i = 0; i < half; i++) {
            float a, b;
            if (traditional) { a = v[2 * i]; b = v[2 * i + 1]; }
            else { a = v[i]; b = v[i + half]; }
            float ra = a * cosv[i] - b * sinv[i], rb = a * sinv[i] + b * cosv[i];
            if (traditional) { v[2 * i] = ra; v[2 * i + 1] = rb; }
            else { v[i] = ra; v[i + half] = rb; }
        }
    }
}

/* Token t of row b sits at cache position idx + t and sees keys start[b] .. idx + t. */
static void attention(const kiln_model *m, const kiln_cache *c, const kiln_scratch *w, int B, int T, int idx, const int32_t *start) {
    if (T >= KILN_CHUNK_ATTENTION) { /* a prefill chunk: attention.c */
        attention_chunk(m, c, w->qkv, w->qkv_ld, w->att, B, T, idx, start, w->scores, w->S);
        return;
    }
    int H = m->heads, D = m->head_dim, group = m->heads / m->kv_heads;
    long qd = (long)H * D;
#pragma omp for schedule(static)
    for (int task = 0; task < B * T * H; task++) {
        int tok = task / H, h = task % H, b = tok / T, t = tok % T, g = h / group;
        const float *qv = w->qkv + tok * w->qkv_ld + h * D;
        const long pb = kv_position_bytes(c->kind, D);
        const char *kb = kv_at(c->keys, c->k_row, c->k_head, b, g, 0, pb), *vb = kv_at(c->values, c->v_row, c->v_head, b, g, 0, pb);
        float *p = w->scores + (size_t)thread_index() * w->S, *o = w->att + tok * qd + h * D;
        int first = start[b], last = idx + t;
        float top = -INFINITY;
        for (int j = first; j <= last; j++) {
            const char *kj = kb + (size_t)j * pb;
            float dot = 0.f;
            if (c->kind == KILN_KV_INT8) dot = kv_dot_int8(qv, kj, D);
            else {
                const float *kf = (const float *)kj;
#pragma omp simd reduction(+ : dot)
                for (int i = 0; i < D; i++) dot += qv[i] * kf[i];
            }
            p[j] = dot * m->scale;
            top = p[j] > top ? p[j] : top;
        }
        float total = softmax_exp(p + first, last - first + 1, top), inv = 1.0f / total;
        for (int i = 0; i < D; i++) o[i] = 0.f;
        for (int j = first; j <= last; j++) {
            const char *vj = vb + (size_t)j * pb;
            float pw = p[j] * inv;
            if (c->kind == KILN_KV_INT8) kv_add_int8(o, pw, vj, D);
            else {
                const float *vf = (const float *)vj;
#pragma omp simd
                for (int i = 0; i < D; i++) o[i] += pw * vf[i];
            }
        }
    }
}

/* The pass for B rows of T new tokens each (tokens (B, T), row-major). positions[b]: RoPE
 * position of row b's first new token; start[b]: its first real cache position (left
 * padding before it); idx: the cache position the new tokens go to (the same for every row,
 * as in mlx-lm's BatchKVCache); every cache has room for idx + T positions. head_rows: 0 no
 * logits, 1 for the last token of each row (logits (B, vocab)), 2 for every token ((B * T,
 * vocab)). int8: which products take 8-bit activations (where compiled in), a bit mask:
 * 1 q/k/v, 2 o, 4 gate/up, 8 down, 16 the head; the others take float32. work: kiln_forward_work floats,
 * asked for on the calling thread with this pass's team size (a row of scores per thread).
 * Returns 0, or -1 for arguments outside what the loops handle. */
int kiln_forward(const kiln_model *m, const kiln_cache *caches, int B, int T, const int32_t *tokens,
                 const int32_t *positions, const int32_t *start, int idx, int head_rows, int int8,
                 float *logits, float *work) {
    int M = B * T, D = m->head_dim, half = D / 2, S = idx + T;
    if (M < 1 || T < 1 || D % 2 || m->heads % m->kv_heads) return -1;
    for (int l = 0; l < m->n_layers; l++)
        if (caches[l].kind != KILN_KV_FLOAT32 && (caches[l].kind != KILN_KV_INT8 || D % KILN_KV_BLOCK)) return -1;
#ifndef KILN_INT8
    int8 = 0;
#endif
    for (int b = 0; b < B; b++)
        if (start[b] < 0 || start[b] > idx) return -1;
    for (int tok = 0; tok < M; tok++)
        if (tokens[tok] < 0 || tokens[tok] >= m->vocab) return -1;
    kiln_scratch w;
    carve(m, M, S, work, &w);
    long qd = (long)m->heads * D, kd = (long)m->kv_heads * D;
    for (int tok = 0; tok < M; tok++) {
        if (m->embedding) memcpy(w.h + (size_t)tok * m->hidden, m->embedding + (size_t)tokens[tok] * m->hidden, sizeof(float) * m->hidden);
        else kiln_ggml_dequant(m->embed_q.type, 1, m->hidden, m->embed_q.q, tokens + tok, w.h + (size_t)tok * m->hidden);
        double pos = (double)positions[tok / T] + tok % T;
        for (int i = 0; i < half; i++) {
            double angle = pos * m->inv_freq[i];
            w.cosv[tok * half + i] = (float)cos(angle);
            w.sinv[tok * half + i] = (float)sin(angle);
        }
    }
    int n_out = head_rows == 2 ? M : head_rows == 1 ? B : 0;
#pragma omp parallel
    {
#if defined(__SSE__)
        /* Denormal floats flushed to zero inside the pass (each thread's own setting, restored
         * below): on a random-weight 1B-shaped Q4_K_M model a one-row step took ~850 ms of CPU
         * with them (microcode assists) and ~175 ms without. Values under 2^-126 change no
         * logit the build check can see. */
        const unsigned int kiln_csr = _mm_getcsr();
        _mm_setcsr(kiln_csr | 0x8040); /* FTZ | DAZ */
#endif
        for (int l = 0; l < m->n_layers; l++) {
            const kiln_layer *L = m->layers + l;
            const kiln_cache *c = caches + l;
            kiln_act a = act_for(&w, &L->q, w.x, M);
#pragma omp for schedule(static)
            for (int tok = 0; tok < M; tok++) {
                rms_norm(w.h + tok * m->hidden, L->attn_norm, m->eps, m->hidden, w.x + tok * m->hidden);
                prepare_row(&a, tok, int8 & 1);
            }
            kiln_job qkv[3] = {{&L->q, w.qkv, w.qkv_ld}, {&L->k, w.qkv + qd, w.qkv_ld}, {&L->v, w.qkv + qd + kd, w.qkv_ld}};
            products(qkv, 3, &a, int8 & 1);
#pragma omp for schedule(static)
            for (int tok = 0; tok < M; tok++) {
                float *qv = w.qkv + tok * w.qkv_ld, *kv = qv + qd, *vv = kv + kd;
                if (L->q.bias) {
                    for (long i = 0; i < qd; i++) qv[i] += L->q.bias[i];
                    for (long i = 0; i < kd; i++) kv[i] += L->k.bias[i];
                    for (long i = 0; i < kd; i++) vv[i] += L->v.bias[i];
                }
                if (L->q_norm) {
                    for (int h = 0; h < m->heads; h++) rms_norm(qv + h * D, L->q_norm, m->eps, D, qv + h * D);
                    for (int h = 0; h < m->kv_heads; h++) rms_norm(kv + h * D, L->k_norm, m->eps, D, kv + h * D);
                }
                rope(qv, m->heads, D, w.cosv + tok * half, w.sinv + tok * half, m->rope_traditional);
                rope(kv, m->kv_heads, D, w.cosv + tok * half, w.sinv + tok * half, m->rope_traditional);
                int b = tok / T, pos = idx + tok % T;
                const long pb = kv_position_bytes(c->kind, D);
                for (int g = 0; g < m->kv_heads; g++) {
                    kv_store(kv_at(c->keys, c->k_row, c->k_head, b, g, pos, pb), kv + g * D, D, c->kind);
                    kv_store(kv_at(c->values, c->v_row, c->v_head, b, g, pos, pb), vv + g * D, D, c->kind);
                }
            }
            attention(m, c, &w, B, T, idx, start);
            a = act_for(&w, &L->o, w.att, M);
#pragma omp for schedule(static)
            for (int tok = 0; tok < M; tok++) prepare_row(&a, tok, int8 & 2);
            kiln_job o[1] = {{&L->o, w.tmp, m->hidden}};
            products(o, 1, &a, int8 & 2);
            a = act_for(&w, &L->gate, w.x, M);
#pragma omp for schedule(static)
            for (int tok = 0; tok < M; tok++) {
                float *h = w.h + (size_t)tok * m->hidden;
                for (int i = 0; i < m->hidden; i++) h[i] += w.tmp[(size_t)tok * m->hidden + i];
                rms_norm(h, L->mlp_norm, m->eps, m->hidden, w.x + tok * m->hidden);
                prepare_row(&a, tok, int8 & 4);
            }
            kiln_job gu[2] = {{&L->gate, w.gu, 2 * m->inter}, {&L->up, w.gu + m->inter, 2 * m->inter}};
            products(gu, 2, &a, int8 & 4);
            a = act_for(&w, &L->down, w.x, M);
#pragma omp for schedule(static)
            for (int tok = 0; tok < M; tok++) {
                swiglu(w.gu + (size_t)tok * 2 * m->inter, w.gu + (size_t)tok * 2 * m->inter + m->inter, m->inter);
                memcpy(w.x + (size_t)tok * m->inter, w.gu + (size_t)tok * 2 * m->inter, sizeof(float) * m->inter);
                prepare_row(&a, tok, int8 & 8);
            }
            kiln_job down[1] = {{&L->down, w.tmp, m->hidden}};
            products(down, 1, &a, int8 & 8);
#pragma omp for schedule(static)
            for (long i = 0; i < (long)M * m->hidden; i++) w.h[i] += w.tmp[i];
        }
        if (n_out) {
            kiln_act a = act_for(&w, &m->head, w.x, n_out);
#pragma omp single
            {
                for (int r = 0; r < n_out; r++) {
                    int tok = head_rows == 2 ? r : r * T + T - 1;
                    rms_norm(w.h + tok * m->hidden, m->final_norm, m->eps, m->hidden, w.x + r * m->hidden);
                }
                prepare_act(&a, int8 & 16);
            }
            kiln_job head[1] = {{&m->head, logits, m->vocab}};
            products(head, 1, &a, int8 & 16);
        }
#if defined(__SSE__)
        _mm_setcsr(kiln_csr);
#endif
    }
    return 0;
}

/* The team size of the calling thread's later passes (libgomp keeps it per thread; a thread
 * starts with OMP_NUM_THREADS, which libgomp reads once, at load). */
void kiln_set_threads(int n) {
#ifdef _OPENMP
    if (n > 0) omp_set_num_threads(n);
#else
    (void)n;
#endif
}

/* The team size the calling thread's next pass would use. */
int kiln_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* 0 where this CPU runs this variant's instructions, after running its product loops once. */
int kiln_selftest(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
#if defined(__AVX512VNNI__)
    if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512bw")) return 1;
#endif
#if defined(__AVXVNNI__)
    if (!__builtin_cpu_supports("avxvnni")) return 1;
#endif
#if defined(__AVX2__)
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 1;
#endif
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD) && defined(__linux__)
    if (!(getauxval(AT_HWCAP) & HWCAP_ASIMDDP)) return 1;
#endif
    /* One 96-wide column of each kind, int8 and float, against the plain sum. */
    enum { K = 96 };
    uint8_t q4[K / 2], q8[K];
    uint16_t s[K / 32], b[K / 32];
    float x[K], y[2], ref4 = 0.f, ref8 = 0.f;
    for (int i = 0; i < K / 32; i++) { s[i] = 0x3c00; b[i] = 0; } /* 1.0, 0.0 */
    for (int i = 0; i < K; i++) {
        x[i] = i % 32 ? (float)((i * 37) % 23 - 11) : 127.f; /* 127 in every block: d = 1 */
        q8[i] = (uint8_t)((i * 11) % 256);
        int nib = (i * 5) % 16;
        if (i % 2) q4[i / 2] |= (uint8_t)(nib << 4);
        else q4[i / 2] = (uint8_t)nib;
        ref4 += nib * x[i];
        ref8 += q8[i] * x[i];
    }
    float xp[K], dexp[16], xsum[4];
    int8_t xq[128];
    kiln_act a = {.M = 1, .K = K, .gs = 32, .x = x, .xp = xp};
#ifdef KILN_INT8
    a.xq = xq; a.dexp = dexp; a.xsum = xsum; a.xq_ld = 128; a.dexp_ld = 16; a.g_ld = 4;
#else
    (void)xq; (void)dexp; (void)xsum;
#endif
    for (int int8 = 0; int8 <= kiln_has_int8(); int8++) {
        kiln_qw w4 = {q4, s, b, NULL, 4, 32, 1, K}, w8 = {q8, s, b, NULL, 8, 32, 1, K};
        a.bits = 4;
        prepare_act(&a, int8);
        product_column(&w4, 0, &a, int8, y, 1);
        a.bits = 8;
        prepare_act(&a, int8);
        product_column(&w8, 0, &a, int8, y + 1, 1);
        /* x is integral and within 8 bits' range: int8 activations are exact here too. */
        if (fabsf(y[0] - ref4) > 1e-3f * fabsf(ref4) + 1e-3f || fabsf(y[1] - ref8) > 1e-3f * fabsf(ref8) + 1e-3f) return 2;
    }
    if (ggml_selftest()) return 3; /* the GGUF block products (ggml.c) */
    if (x16_selftest()) return 4; /* the same in panels (panels.c) */
    return 0;
}
