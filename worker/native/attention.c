/* Attention for a prefill chunk: many new tokens per row, causal among themselves, over the
 * row's past in the cache.
 *
 * Why: the pass's attention (decode.c) takes one query row (token, head) at a time, and for each
 * key a dot product of head_dim floats ending in a horizontal sum; that suits a decode step's
 * few rows but made a 512-token chunk's attention cost about as much as its products. Here a
 * task is one row's KV head and a block of its tokens: every query head of the group (they share
 * the KV head) for up to 64 / group tokens. Keys are taken ATT_KEYS at a time, transposed once
 * into a (head_dim, ATT_KEYS) tile that all the task's queries multiply (ATT_KEYS scores per
 * vector multiply-add, no horizontal sums), and the softmax is the online kind (a running maximum and sum per query,
 * the output rescaled when the maximum grows), so no score row as long as the context is kept.
 * The result equals the one-row version's up to float rounding (checked by the tests' long
 * prompts against mlx).
 *
 * Portable vector code (GCC/Clang vector extensions): AVX-512, AVX2 or NEON as compiled, one
 * vector of keys wide (ATT_KEYS). At 16 keys everywhere, the AVX2 build held each 16-lane vector
 * in two registers and spilled them around every scalar step (the softmax's maximum and sum):
 * a 512-token chunk's attention on a 1B model took about as long as its products there.
 * Included by decode.c.
 */

#if defined(__AVX512F__)
#define ATT_KEYS 16
#else
#define ATT_KEYS 8
#endif
typedef float vkf __attribute__((vector_size(ATT_KEYS * 4)));
typedef int32_t vki __attribute__((vector_size(ATT_KEYS * 4)));
/* Floats of o that weigh_values holds in registers at once: 8 vectors. */
#define ATT_SLICE (8 * ATT_KEYS)

/* Tokens per row from which a pass's attention goes through attention_chunk. */
#define KILN_CHUNK_ATTENTION 16

static inline vkf loadk(const float *p) {
    vkf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* e^x, ATT_KEYS lanes: exp8's polynomial (decode.c's KILN_DEFINE_EXP). */
KILN_DEFINE_EXP(expk, vkf, vki)

static inline void storek(float *p, vkf v) { memcpy(p, &v, sizeof v); }

/* ATT_KEYS keys' dot products with q: four chains of multiply-adds (one would wait on each). */
static inline vkf scores(const float *q, const float *kt, int D) {
    vkf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int i = 0;
    for (; i + 4 <= D; i += 4) {
        s0 += q[i] * loadk(kt + i * ATT_KEYS);
        s1 += q[i + 1] * loadk(kt + (i + 1) * ATT_KEYS);
        s2 += q[i + 2] * loadk(kt + (i + 2) * ATT_KEYS);
        s3 += q[i + 3] * loadk(kt + (i + 3) * ATT_KEYS);
    }
    for (; i < D; i++) s0 += q[i] * loadk(kt + i * ATT_KEYS);
    return (s0 + s1) + (s2 + s3);
}

/* o = o * scale + sum_j p[j] v_j over `used` value rows, ATT_SLICE floats of o held in
 * registers at a time (D a multiple of ATT_KEYS, at most 256: a constant where inlined). */
static inline __attribute__((always_inline)) void weigh_values(float *o, float scale, const float *p, int used, const float *v, const int D) {
    for (int s0 = 0; s0 < D; s0 += ATT_SLICE) {
        vkf acc[ATT_SLICE / ATT_KEYS];
        const int n = (D - s0 < ATT_SLICE ? D - s0 : ATT_SLICE) / ATT_KEYS;
        for (int k = 0; k < n; k++) acc[k] = loadk(o + s0 + ATT_KEYS * k) * scale;
        for (int j = 0; j < used; j++) {
            const float pj = p[j], *vj = v + (size_t)j * D + s0;
            for (int k = 0; k < n; k++) acc[k] += pj * loadk(vj + ATT_KEYS * k);
        }
        for (int k = 0; k < n; k++) storek(o + s0 + ATT_KEYS * k, acc[k]);
    }
}

/* Tokens of one task: the query heads of a KV head times this make about 64 query rows. */
static int chunk_tokens(const kiln_model *m) {
    int group = m->heads / m->kv_heads;
    return group >= 64 ? 1 : 64 / group;
}

/* Scratch floats one thread of attention_chunk takes. */
static long attention_chunk_floats(const kiln_model *m) {
    long rows = (long)chunk_tokens(m) * (m->heads / m->kv_heads);
    return (long)m->head_dim * ATT_KEYS + rows * (m->head_dim + 2) + (long)m->head_dim * (ATT_KEYS + 1); /* + 8-bit caches' rows as floats */
}

/* Token t of row b (query at qkv row b * T + t) sits at cache position idx + t and sees keys
 * start[b] .. idx + t; its output goes to att. scratch: attention_chunk_floats floats for each
 * thread, `stride` apart. */
static void attention_chunk(const kiln_model *m, const kiln_cache *c, const float *qkv, long qkv_ld, float *att, int B, int T, int idx,
                            const int32_t *start, float *scratch, long stride) {
    const int H = m->heads, D = m->head_dim, KV = m->kv_heads, group = H / KV;
    const int QB = chunk_tokens(m), blocks = (T + QB - 1) / QB;
    const long qd = (long)H * D;
    vki lane;
    for (int j = 0; j < ATT_KEYS; j++) lane[j] = j;
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < B * KV * blocks; task++) {
        const int b = task / (KV * blocks), g = task / blocks % KV, t0 = task % blocks * QB;
        const int nt = T - t0 < QB ? T - t0 : QB, R = nt * group;
        float *kt = scratch + (size_t)thread_index() * stride;
        float *acc = kt + (size_t)D * ATT_KEYS, *top = acc + (size_t)R * D, *sum = top + R;
        for (int r = 0; r < R; r++) {
            top[r] = -INFINITY;
            sum[r] = 0.f;
        }
        memset(acc, 0, sizeof(float) * (size_t)R * D);
        /* An 8-bit cache's ATT_KEYS value rows and a key row, as floats: after the sums. */
        float *vt = sum + R, *krow = vt + (size_t)ATT_KEYS * D;
        const long pb = kv_position_bytes(c->kind, D);
        const int int8 = c->kind == KILN_KV_INT8;
        const char *keys = kv_at(c->keys, c->k_row, c->k_head, b, g, 0, pb), *values = kv_at(c->values, c->v_row, c->v_head, b, g, 0, pb);
        const int first = start[b], last = idx + t0 + nt - 1;
        for (int kb = first; kb <= last; kb += ATT_KEYS) {
            const int nk = last - kb + 1 < ATT_KEYS ? last - kb + 1 : ATT_KEYS;
            for (int j = 0; j < ATT_KEYS; j++) {
                const float *k = krow;
                if (j >= nk) memset(krow, 0, sizeof(float) * D);
                else if (int8) kv_load_int8(krow, keys + (size_t)(kb + j) * pb, D);
                else k = (const float *)(keys + (size_t)(kb + j) * pb);
                for (int i = 0; i < D; i++) kt[i * ATT_KEYS + j] = k[i];
            }
            if (int8)
                for (int j = 0; j < nk; j++) kv_load_int8(vt + (size_t)j * D, values + (size_t)(kb + j) * pb, D);
            for (int r = 0; r < R; r++) {
                const int t = t0 + r / group, h = g * group + r % group, mine = idx + t - kb + 1; /* keys this query sees here */
                if (mine <= 0) continue;
                const float *q = qkv + (size_t)(b * T + t) * qkv_ld + (size_t)h * D;
                vkf s = scores(q, kt, D) * m->scale;
                const vki seen = lane < (mine < ATT_KEYS ? mine : ATT_KEYS);
                s = (vkf)(((vki)s & seen) | ((vki)((vkf){0} - INFINITY) & ~seen));
                float best = top[r];
                for (int j = 0; j < ATT_KEYS; j++) best = s[j] > best ? s[j] : best;
                vkf p = (vkf)((vki)expk(s - best) & seen);
                const float scale = expf(top[r] - best); /* 0 at the first block (top -inf) */
                float total = 0.f;
                for (int j = 0; j < ATT_KEYS; j++) total += p[j];
                sum[r] = sum[r] * scale + total;
                top[r] = best;
                float *o = acc + (size_t)r * D, pv[ATT_KEYS];
                storek(pv, p);
                const int used = mine < nk ? mine : nk;
                const float *v = int8 ? vt : (const float *)(values + (size_t)kb * pb);
                if (D == 64) weigh_values(o, scale, pv, used, v, 64);
                else if (D == 128) weigh_values(o, scale, pv, used, v, 128);
                else if (D % ATT_KEYS == 0 && D <= 256) weigh_values(o, scale, pv, used, v, D);
                else {
                    for (int i = 0; i < D; i++) o[i] *= scale;
                    for (int j = 0; j < used; j++)
                        for (int i = 0; i < D; i++) o[i] += pv[j] * v[(size_t)j * D + i];
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const int t = t0 + r / group, h = g * group + r % group;
            float *out = att + (size_t)(b * T + t) * qd + (size_t)h * D, inv = 1.0f / sum[r];
            for (int i = 0; i < D; i++) out[i] = acc[(size_t)r * D + i] * inv;
        }
    }
}
