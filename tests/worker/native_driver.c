/* A stand-alone check of one build of the native kernels (worker/native/decode.c), for the
 * builds this machine cannot load into Python: the Arm ones (cross-compiled, run under
 * qemu-aarch64) and x86 ones for instructions this CPU lacks (under qemu-x86_64 where its TCG
 * has them). tests/worker/test_native_variants_emulated.py compiles it with a variant's exact
 * flags and runs it.
 *
 * Why plain C: an emulated Arm process cannot import numpy or mlx, so the references are
 * written out here, in double precision and without the kernels' tricks (no permutation, no
 * integer sums, an independent float16 decoder): each product kind (float32 activations
 * against 4- and 8-bit weights through kiln_qmm; 8-bit activations through the integer dot
 * products, even and odd counts of 32-blocks, group sizes 32-128, 1-11 rows) and a whole
 * forward pass (two small synthetic models: GQA, left padding, T > 1, biases, q/k norms, both
 * RoPE kinds) in both activation modes.
 *
 * Usage: native_driver VARIANT [--cpuid-unchecked]. Prints one line per check ("ok ..." or
 * "FAIL ..."); exits 0 when all pass, 1 when one fails, 77 when this CPU lacks the build's
 * instructions (its kiln_selftest says so: the worker would pass this build over), 2 on a wrong
 * build (the flags did not select VARIANT's code path). --cpuid-unchecked runs the checks even
 * where CPUID says no: for a build whose instructions were swapped for ones this CPU has (the
 * test assembles the avxvnni build with AVX-512 VNNI's encoding of the same vpdpbusd).
 */
#include "decode.c"

#include <stdio.h>

static int failures = 0;

/* The larger of a and b. Not fmax: gcc 12's aarch64 vectorizer crashes on fmax reductions
 * (internal compiler error in vect_transform_reduction). */
static double larger(double a, double b) { return b > a ? b : a; }

static void check(int ok, const char *what, const char *detail) {
    printf("%s %s: %s\n", ok ? "ok" : "FAIL", what, detail);
    failures += !ok;
}

/* ---- deterministic inputs ------------------------------------------------------------------ */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint32_t next_u32(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}

static float uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next_u32() >> 8) / 16777216.f; }

static float gaussian(void) { /* sum of four uniforms: roughly normal, bounded */
    return (uniform(-1.f, 1.f) + uniform(-1.f, 1.f) + uniform(-1.f, 1.f) + uniform(-1.f, 1.f)) * 0.866f;
}

/* float -> float16 bits, round to nearest, for normal values (all the inputs here are). */
static uint16_t to_half(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t sign = (u >> 16) & 0x8000;
    int exp = (int)((u >> 23) & 0xff) - 127 + 15;
    uint32_t man = u & 0x7fffff;
    if (f == 0.f) return (uint16_t)sign;
    uint32_t h = sign | ((uint32_t)exp << 10) | (man >> 13);
    if (man & 0x1000) h++; /* round half up: carries into the exponent correctly */
    return (uint16_t)h;
}

/* float16 bits -> double, written independently of qmatmul.c's half_to_float. */
static double from_half(uint16_t h) {
    int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    double v = exp ? ldexp(1024 + man, exp - 25) : ldexp(man, -24);
    return (h & 0x8000) ? -v : v;
}

/* ---- packed weights ------------------------------------------------------------------------ */

typedef struct {
    kiln_qw w;
    uint8_t *q;
    uint16_t *s, *b;
    float *bias;
} packed;

/* Random affine weights of mlx's layout: every quantized value occurs (0..15, 0..255), scales
 * of both signs when `signed_scales`, biases around -scale * midpoint. */
static packed make_weights(int n, int k, int bits, int gs, int with_bias, float scale, int signed_scales) {
    packed p;
    int G = k / gs;
    size_t row_bytes = (size_t)k * bits / 8;
    p.q = malloc((size_t)n * row_bytes);
    p.s = malloc(sizeof(uint16_t) * n * G);
    p.b = malloc(sizeof(uint16_t) * n * G);
    p.bias = with_bias ? malloc(sizeof(float) * n) : NULL;
    for (size_t i = 0; i < (size_t)n * row_bytes; i++) p.q[i] = (uint8_t)next_u32();
    float mid = bits == 4 ? 7.5f : 127.5f;
    for (int i = 0; i < n * G; i++) {
        float s = uniform(0.5f, 1.5f) * scale / (bits == 4 ? 1.f : 16.f);
        if (signed_scales && (next_u32() & 1)) s = -s;
        p.s[i] = to_half(s);
        p.b[i] = to_half(-s * mid * uniform(0.8f, 1.2f));
    }
    if (p.bias)
        for (int i = 0; i < n; i++) p.bias[i] = uniform(-0.2f, 0.2f);
    kiln_qw w = {p.q, p.s, p.b, p.bias, bits, gs, n, k};
    p.w = w;
    return p;
}

static void free_weights(packed *p) {
    free(p->q);
    free(p->s);
    free(p->b);
    free(p->bias);
}

/* Element (o, j) of the dequantized matrix: scale * q + bias, from the packed bytes. */
static double weight(const kiln_qw *w, int o, int j) {
    const uint8_t *row = w->q + (size_t)o * w->k * w->bits / 8;
    int qv = w->bits == 8 ? row[j] : (row[j / 2] >> (4 * (j % 2))) & 15;
    int g = j / w->gs, G = w->k / w->gs;
    return (double)(float)from_half(w->s[(size_t)o * G + g]) * qv + (double)(float)from_half(w->b[(size_t)o * G + g]);
}

/* ---- reference products -------------------------------------------------------------------- */

/* x rounded as the 8-bit path rounds it: per block of 32, to multiples of max|x| / 127. The
 * same float operations as decode.c's quantize_row, so the rounded values agree exactly. */
static void round_like_int8(const float *x, int k, float *out) {
    for (int c = 0; c < k; c += 32) {
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fabsf(x[c + j]) > amax ? fabsf(x[c + j]) : amax;
        float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        for (int j = 0; j < 32; j++) out[c + j] = d * (float)(int8_t)lrintf(x[c + j] * id);
    }
}

/* y[o] = sum_j w(o, j) x[j] (+ bias), in double; mag[o] = sum_j |w(o, j) x[j]|, the scale of
 * float32 rounding in any order of summation. */
static void ref_product(const kiln_qw *w, const float *x, double *y, double *mag) {
    for (int o = 0; o < w->n; o++) {
        double acc = 0., m = 0.;
        for (int j = 0; j < w->k; j++) {
            double t = weight(w, o, j) * x[j];
            acc += t;
            m += fabs(t);
        }
        y[o] = acc + (w->bias ? w->bias[o] : 0.);
        if (mag) mag[o] = m;
    }
}

static void fill_activations(float *x, int n) {
    for (int i = 0; i < n; i++) x[i] = gaussian();
    if (n >= 64) {
        x[5] = 40.f; /* an outlier: its block's scale is set by it */
        for (int j = 32; j < 64; j++) x[j] = 0.f; /* an all-zero block: scale 0 */
    }
}

/* kiln_qmm (float32 activations, the path inside mlx's graph) against the reference. */
static void check_qmm(int bits, int gs, int M, int N, int K) {
    packed p = make_weights(N, K, bits, gs, 0, 0.02f, 1);
    float *x = malloc(sizeof(float) * M * K), *y = malloc(sizeof(float) * M * N), *work = malloc(sizeof(float) * M * K);
    double *ref = malloc(sizeof(double) * N), *mag = malloc(sizeof(double) * N);
    fill_activations(x, M * K);
    int status = kiln_qmm(bits, M, N, K, gs, p.q, p.s, p.b, x, y, work);
    double worst = 0.;
    for (int m = 0; m < M && status == 0; m++) {
        ref_product(&p.w, x + (size_t)m * K, ref, mag);
        for (int o = 0; o < N; o++) {
            double err = fabs(y[(size_t)m * N + o] - ref[o]) / (mag[o] + 1e-6);
            worst = err > worst ? err : worst;
        }
    }
    char what[96], detail[96];
    snprintf(what, sizeof what, "qmm float32 bits=%d gs=%d rows=%d %dx%d", bits, gs, M, N, K);
    snprintf(detail, sizeof detail, "status %d, worst error %.3g of sum |w x|", status, worst);
    check(status == 0 && worst < 1e-5, what, detail);
    free_weights(&p);
    free(x); free(y); free(work); free(ref); free(mag);
}

/* One product through the forward pass's own path (prepare_act + product_column), 8-bit
 * activations where the build has them, else float32: against the weights times the rounded
 * (resp. exact) activations. */
static void check_product(int bits, int gs, int M, int N, int K, int int8) {
    packed p = make_weights(N, K, bits, gs, 0, 0.02f, 1);
    long xq_ld = round_up(K, 64), dexp_ld = (K / 64 + 1) * 8, g_ld = K / 32 + 1;
    float *x = malloc(sizeof(float) * M * K), *xr = malloc(sizeof(float) * K), *xp = malloc(sizeof(float) * M * K);
    float *dexp = malloc(sizeof(float) * M * dexp_ld), *xsum = malloc(sizeof(float) * M * g_ld);
    int8_t *xq = malloc((size_t)M * xq_ld);
    float *y = malloc(sizeof(float) * M * N);
    double *ref = malloc(sizeof(double) * N), *mag = malloc(sizeof(double) * N);
    fill_activations(x, M * K);
    kiln_act a = {.M = M, .K = K, .bits = bits, .gs = gs, .x = x, .xp = xp};
#ifdef KILN_INT8
    a.xq = xq; a.dexp = dexp; a.xsum = xsum; a.xq_ld = xq_ld; a.dexp_ld = dexp_ld; a.g_ld = g_ld;
#endif
    prepare_act(&a, int8);
    for (int o = 0; o < N; o++) product_column(&p.w, o, &a, int8, y + o, N);
    double worst = 0.;
    for (int m = 0; m < M; m++) {
        if (int8) round_like_int8(x + (size_t)m * K, K, xr);
        else memcpy(xr, x + (size_t)m * K, sizeof(float) * K);
        ref_product(&p.w, xr, ref, mag);
        for (int o = 0; o < N; o++) {
            double err = fabs(y[(size_t)m * N + o] - ref[o]) / (mag[o] + 1e-6);
            worst = err > worst ? err : worst;
        }
    }
    char what[96], detail[64];
    snprintf(what, sizeof what, "product %s bits=%d gs=%d rows=%d %dx%d (%d blocks)", int8 ? "int8" : "float32", bits, gs, M, N, K, K / 32);
    snprintf(detail, sizeof detail, "worst error %.3g of sum |w x|", worst);
    check(worst < 1e-5, what, detail);
    free_weights(&p);
    free(x); free(xr); free(xp); free(dexp); free(xsum); free(xq); free(y); free(ref); free(mag);
}

/* ---- a whole forward pass ------------------------------------------------------------------ */

typedef struct {
    kiln_model m;
    kiln_layer *layers;
    packed *weights; /* 7 per layer, then the head */
    float *floats;   /* embedding, norms */
    double *inv_freq;
} toy_model;

static float *take(float **pool, int n) {
    float *p = *pool;
    *pool += n;
    return p;
}

static toy_model make_model(int n_layers, int hidden, int inter, int heads, int kv_heads, int head_dim, int vocab,
                            int bits, int head_bits, int gs, int qwen) {
    toy_model t;
    kiln_model *m = &t.m;
    m->n_layers = n_layers; m->hidden = hidden; m->inter = inter; m->heads = heads; m->kv_heads = kv_heads;
    m->head_dim = head_dim; m->vocab = vocab; m->rope_traditional = qwen; m->eps = 1e-5f;
    m->scale = 1.0f / sqrtf((float)head_dim);
    t.inv_freq = malloc(sizeof(double) * head_dim / 2);
    for (int i = 0; i < head_dim / 2; i++) t.inv_freq[i] = pow(10000., -2. * i / head_dim);
    m->inv_freq = t.inv_freq;
    size_t n_floats = (size_t)vocab * hidden + hidden + (size_t)n_layers * (2 * hidden + 2 * head_dim);
    t.floats = malloc(sizeof(float) * n_floats);
    float *pool = t.floats;
    float *emb = take(&pool, vocab * hidden);
    for (int i = 0; i < vocab * hidden; i++) emb[i] = gaussian();
    m->embedding = emb;
    float *fn = take(&pool, hidden);
    for (int i = 0; i < hidden; i++) fn[i] = uniform(0.5f, 1.5f);
    m->final_norm = fn;
    t.layers = calloc(n_layers, sizeof(kiln_layer));
    t.weights = malloc(sizeof(packed) * (7 * n_layers + 1));
    int qd = heads * head_dim, kd = kv_heads * head_dim;
    for (int l = 0; l < n_layers; l++) {
        kiln_layer *L = t.layers + l;
        float *an = take(&pool, hidden), *mn = take(&pool, hidden), *qn = take(&pool, head_dim), *kn = take(&pool, head_dim);
        for (int i = 0; i < hidden; i++) { an[i] = uniform(0.5f, 1.5f); mn[i] = uniform(0.5f, 1.5f); }
        for (int i = 0; i < head_dim; i++) { qn[i] = uniform(0.5f, 1.5f); kn[i] = uniform(0.5f, 1.5f); }
        L->attn_norm = an;
        L->mlp_norm = mn;
        L->q_norm = qwen ? qn : NULL;
        L->k_norm = qwen ? kn : NULL;
        packed *w = t.weights + 7 * l;
        w[0] = make_weights(qd, hidden, bits, gs, qwen, 0.03f, 0);
        w[1] = make_weights(kd, hidden, bits, gs, qwen, 0.03f, 0);
        w[2] = make_weights(kd, hidden, bits, gs, qwen, 0.03f, 0);
        w[3] = make_weights(hidden, qd, bits, gs, 0, 0.03f, 0);
        w[4] = make_weights(inter, hidden, bits, gs, 0, 0.03f, 0);
        w[5] = make_weights(inter, hidden, bits, gs, 0, 0.03f, 0);
        w[6] = make_weights(hidden, inter, bits, gs, 0, 0.03f, 0);
        L->q = w[0].w; L->k = w[1].w; L->v = w[2].w; L->o = w[3].w; L->gate = w[4].w; L->up = w[5].w; L->down = w[6].w;
    }
    t.weights[7 * n_layers] = make_weights(vocab, hidden, head_bits, gs, 0, 0.03f, 0);
    m->head = t.weights[7 * n_layers].w;
    m->layers = t.layers;
    return t;
}

static void free_model(toy_model *t) {
    for (int i = 0; i < 7 * t->m.n_layers + 1; i++) free_weights(t->weights + i);
    free(t->weights); free(t->layers); free(t->floats); free(t->inv_freq);
}

static void ref_rms_norm(const double *x, const float *w, float eps, int n, double *out) {
    double ss = 0.;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    double r = 1. / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* y = W x for a double input: rounded like the 8-bit path first when int8, as floats either way
 * (what the kernels receive). */
static void ref_linear(const kiln_qw *w, const double *x, int int8, double *y) {
    float *xf = malloc(sizeof(float) * w->k), *xr = malloc(sizeof(float) * w->k);
    for (int i = 0; i < w->k; i++) xf[i] = (float)x[i];
    if (int8) round_like_int8(xf, w->k, xr);
    ref_product(w, int8 ? xr : xf, y, NULL);
    free(xf); free(xr);
}

static void ref_rope(double *v, int d, double pos, const double *inv_freq, int traditional) {
    int half = d / 2;
    for (int i = 0; i < half; i++) {
        int ia = traditional ? 2 * i : i, ib = traditional ? 2 * i + 1 : i + half;
        double c = cos(pos * inv_freq[i]), s = sin(pos * inv_freq[i]), a = v[ia], b = v[ib];
        v[ia] = a * c - b * s;
        v[ib] = a * s + b * c;
    }
}

/* The decoder as its definition reads, one token at a time, in double: keys (L, B, kvh, S, D). */
static void ref_forward(const kiln_model *m, double *keys, double *values, int B, int T, int S, const int32_t *tokens,
                        const int32_t *positions, const int32_t *start, int idx, int int8, double *logits) {
    int H = m->heads, KV = m->kv_heads, D = m->head_dim, qd = H * D, kd = KV * D, M = B * T;
    double *h = malloc(sizeof(double) * M * m->hidden), *x = malloc(sizeof(double) * m->inter * 2 + m->hidden + qd);
    double *q = malloc(sizeof(double) * M * qd), *kv = malloc(sizeof(double) * 2 * kd), *att = malloc(sizeof(double) * qd);
    double *g = malloc(sizeof(double) * m->inter), *u = malloc(sizeof(double) * m->inter), *t2 = malloc(sizeof(double) * m->hidden);
    double *p = malloc(sizeof(double) * S);
    for (int tok = 0; tok < M; tok++)
        for (int i = 0; i < m->hidden; i++) h[(size_t)tok * m->hidden + i] = m->embedding[(size_t)tokens[tok] * m->hidden + i];
    for (int l = 0; l < m->n_layers; l++) {
        const kiln_layer *L = m->layers + l;
        double *lk = keys + (size_t)l * B * KV * S * D, *lv = values + (size_t)l * B * KV * S * D;
        for (int tok = 0; tok < M; tok++) { /* q for every token, then k/v into the cache */
            int b = tok / T, pos = idx + tok % T;
            double rpos = positions[b] + tok % T;
            ref_rms_norm(h + (size_t)tok * m->hidden, L->attn_norm, m->eps, m->hidden, x);
            double *qt = q + (size_t)tok * qd;
            ref_linear(&L->q, x, int8 & 1, qt);
            ref_linear(&L->k, x, int8 & 1, kv);
            ref_linear(&L->v, x, int8 & 1, kv + kd);
            for (int hh = 0; hh < H; hh++) {
                if (L->q_norm) ref_rms_norm(qt + hh * D, L->q_norm, m->eps, D, qt + hh * D);
                ref_rope(qt + hh * D, D, rpos, m->inv_freq, m->rope_traditional);
            }
            for (int gg = 0; gg < KV; gg++) {
                if (L->k_norm) ref_rms_norm(kv + gg * D, L->k_norm, m->eps, D, kv + gg * D);
                ref_rope(kv + gg * D, D, rpos, m->inv_freq, m->rope_traditional);
                memcpy(lk + (((size_t)b * KV + gg) * S + pos) * D, kv + gg * D, sizeof(double) * D);
                memcpy(lv + (((size_t)b * KV + gg) * S + pos) * D, kv + kd + gg * D, sizeof(double) * D);
            }
        }
        double *hn = malloc(sizeof(double) * M * m->hidden);
        memcpy(hn, h, sizeof(double) * M * m->hidden);
        for (int tok = 0; tok < M; tok++) {
            int b = tok / T, last = idx + tok % T;
            for (int hh = 0; hh < H; hh++) {
                int gg = hh / (H / KV);
                const double *qv = q + (size_t)tok * qd + hh * D;
                const double *kb = lk + ((size_t)b * KV + gg) * S * D, *vb = lv + ((size_t)b * KV + gg) * S * D;
                double top = -INFINITY, total = 0.;
                for (int j = start[b]; j <= last; j++) {
                    double dot = 0.;
                    for (int i = 0; i < D; i++) dot += qv[i] * kb[(size_t)j * D + i];
                    p[j] = dot * m->scale;
                    top = p[j] > top ? p[j] : top;
                }
                for (int j = start[b]; j <= last; j++) total += (p[j] = exp(p[j] - top));
                for (int i = 0; i < D; i++) {
                    double o = 0.;
                    for (int j = start[b]; j <= last; j++) o += p[j] / total * vb[(size_t)j * D + i];
                    att[hh * D + i] = o;
                }
            }
            double *ht = hn + (size_t)tok * m->hidden;
            ref_linear(&L->o, att, int8 & 2, t2);
            for (int i = 0; i < m->hidden; i++) ht[i] += t2[i];
            ref_rms_norm(ht, L->mlp_norm, m->eps, m->hidden, x);
            ref_linear(&L->gate, x, int8 & 4, g);
            ref_linear(&L->up, x, int8 & 4, u);
            for (int i = 0; i < m->inter; i++) g[i] = g[i] / (1. + exp(-g[i])) * u[i];
            ref_linear(&L->down, g, int8 & 8, t2);
            for (int i = 0; i < m->hidden; i++) ht[i] += t2[i];
        }
        memcpy(h, hn, sizeof(double) * M * m->hidden);
        free(hn);
    }
    for (int tok = 0; tok < M; tok++) {
        ref_rms_norm(h + (size_t)tok * m->hidden, m->final_norm, m->eps, m->hidden, x);
        ref_linear(&m->head, x, int8 & 16, logits + (size_t)tok * m->vocab);
    }
    free(h); free(x); free(q); free(kv); free(att); free(g); free(u); free(t2); free(p);
}

/* B rows of T new tokens after `idx` cached positions (row b's real past starts at start[b]):
 * every token's logits and the new keys/values against the reference. */
static void check_forward(const char *name, toy_model *t, int int8) {
    const kiln_model *m = &t->m;
    enum { B = 3, T = 3, IDX = 5 };
    const int S = IDX + T, cap = 12, KV = m->kv_heads, D = m->head_dim, L = m->n_layers;
    int32_t tokens[B * T], positions[B] = {IDX, IDX - 2, IDX - 5}, start[B] = {0, 2, 5};
    for (int i = 0; i < B * T; i++) tokens[i] = (int32_t)(next_u32() % m->vocab);
    size_t per_layer = (size_t)B * KV * cap * D;
    float *keys = malloc(sizeof(float) * L * per_layer), *values = malloc(sizeof(float) * L * per_layer);
    double *rk = calloc((size_t)L * B * KV * S * D, sizeof(double)), *rv = calloc((size_t)L * B * KV * S * D, sizeof(double));
    kiln_cache *caches = malloc(sizeof(kiln_cache) * L);
    for (int l = 0; l < L; l++) {
        /* float32 positions (KILN_KV_FLOAT32); the struct's strides are in bytes */
        caches[l] = (kiln_cache){(char *)(keys + l * per_layer), (char *)(values + l * per_layer), 4L * KV * cap * D, 4L * cap * D, 4L * KV * cap * D, 4L * cap * D, KILN_KV_FLOAT32};
        for (int b = 0; b < B; b++)
            for (int g = 0; g < KV; g++)
                for (int j = 0; j < IDX; j++)
                    for (int i = 0; i < D; i++) {
                        float kk = j < start[b] ? 1e3f : gaussian(), vv = j < start[b] ? 1e3f : gaussian(); /* padding: must be skipped */
                        keys[l * per_layer + ((size_t)b * KV + g) * cap * D + j * D + i] = kk;
                        values[l * per_layer + ((size_t)b * KV + g) * cap * D + j * D + i] = vv;
                        rk[((((size_t)l * B + b) * KV + g) * S + j) * D + i] = kk;
                        rv[((((size_t)l * B + b) * KV + g) * S + j) * D + i] = vv;
                    }
    }
    float *logits = malloc(sizeof(float) * B * T * m->vocab);
    double *ref = malloc(sizeof(double) * B * T * m->vocab);
    float *work = malloc(sizeof(float) * kiln_forward_work(m, B * T, S));
    int status = kiln_forward(m, caches, B, T, tokens, positions, start, IDX, 2, int8, logits, work);
    ref_forward(m, rk, rv, B, T, S, tokens, positions, start, IDX, int8, ref);
    double top = 0., worst = 0., worst_kv = 0.;
    for (int i = 0; i < B * T * m->vocab; i++) top = fabs(ref[i]) > top ? fabs(ref[i]) : top;
    for (int i = 0; i < B * T * m->vocab; i++) worst = larger(worst, fabs(logits[i] - ref[i]) / top);
    for (int l = 0; l < L; l++)
        for (int b = 0; b < B; b++)
            for (int g = 0; g < KV; g++)
                for (int j = IDX; j < S; j++)
                    for (int i = 0; i < D; i++) {
                        size_t r = ((((size_t)l * B + b) * KV + g) * S + j) * D + i;
                        worst_kv = larger(worst_kv, fabs(keys[l * per_layer + ((size_t)b * KV + g) * cap * D + j * D + i] - rk[r]));
                        worst_kv = larger(worst_kv, fabs(values[l * per_layer + ((size_t)b * KV + g) * cap * D + j * D + i] - rv[r]));
                    }
    /* float32 activations: float32 arithmetic against double. 8-bit: the same rounding in both,
     * but a value within float32 noise of a rounding boundary may round the other way (one step
     * of its block's scale), hence the wider bound. */
    double bound = int8 ? 2e-3 : 1e-4, bound_kv = int8 ? 2e-2 : 1e-4;
    char what[96], detail[96];
    snprintf(what, sizeof what, "forward %s %s (logits max %.2f)", name, int8 ? "int8" : "float32", top);
    snprintf(detail, sizeof detail, "status %d, logits off by %.3g of their max, keys/values by %.3g", status, worst, worst_kv);
    check(status == 0 && worst < bound && worst_kv < bound_kv, what, detail);
    free(keys); free(values); free(rk); free(rv); free(caches); free(logits); free(ref); free(work);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    int unchecked = argc == 3 && strcmp(argv[2], "--cpuid-unchecked") == 0;
    if (argc != 2 && !unchecked) {
        fprintf(stderr, "usage: %s VARIANT [--cpuid-unchecked]\n", argv[0]);
        return 2;
    }
    if (strcmp(kiln_variant(), argv[1]) != 0) {
        printf("FAIL built %s, not %s: the flags did not select its code path\n", kiln_variant(), argv[1]);
        return 2;
    }
    int self = kiln_selftest();
    if (self == 1 && !unchecked) {
        printf("skip this CPU lacks the %s build's instructions (kiln_selftest: CPUID/HWCAP)\n", argv[1]);
        return 77;
    }
    if (self == 1) printf("note: CPUID lacks the %s build's instructions; checking its products anyway\n", argv[1]);
    else check(self == 0, "kiln_selftest", self == 0 ? "each product kind gives the plain sum" : "a product is off the plain sum");
    int int8 = kiln_has_int8();
    printf("variant %s, %s activations, %d threads\n", kiln_variant(), int8 ? "8-bit" : "float32",
#ifdef _OPENMP
           omp_get_max_threads()
#else
           1
#endif
    );
    static const int rows[] = {1, 2, 5, 8};
    for (int bits = 4; bits <= 8; bits += 4)
        for (int gs = 32; gs <= 128; gs *= 2)
            for (int r = 0; r < 4; r++) check_qmm(bits, gs, rows[r], 37, 384);
    for (int mode = 0; mode <= int8; mode++)
        for (int bits = 4; bits <= 8; bits += 4) {
            for (int gs = 32; gs <= 128; gs *= 2) check_product(bits, gs, 3, 19, 384, mode); /* 12 blocks */
            check_product(bits, 32, 1, 19, 416, mode);                                      /* 13: a lone block */
            check_product(bits, 32, 11, 7, 96, mode);                                       /* 3 blocks, 8 + 3 rows */
            check_product(bits, 64, 8, 5, 64, mode);                                        /* one pair */
        }
    /* llama-like: 4-bit layers, 8-bit head, group 32, GQA 4:2, inter of 3 blocks (a lone one);
     * qwen3-like: 8-bit layers, 4-bit head, group 64, q/k/v biases, per-head norms, traditional RoPE. */
    toy_model llama_like = make_model(2, 64, 96, 4, 2, 16, 77, 4, 8, 32, 0);
    toy_model qwen_like = make_model(2, 128, 192, 4, 1, 32, 61, 8, 4, 64, 1);
    for (int mode = 0; mode <= int8; mode++) {
        check_forward("llama-like", &llama_like, mode ? 31 : 0);
        check_forward("qwen-like", &qwen_like, mode ? 31 : 0);
    }
    free_model(&llama_like);
    free_model(&qwen_like);
    printf("%d failed\n", failures);
    return failures ? 1 : 0;
}
