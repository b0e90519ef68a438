/* Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and IQ4_XS matrices re-laid in panels of 16 rows, for decoding.
 *
 * Why: ggml.c's loops take one weight row at a time. At one activation row (a decode step)
 * every super-block's unpacking (nibbles, 6-bit scales, float16) is paid for that one row, and
 * every 64 products cost a float conversion, a permute (the lanes hold two groups, each with its
 * own scale) and a multiply-add: the 1B Q4_K_M decode step ran the product loops at ~30 G
 * weights/s on one core, and at 8 rows a step went no faster per row. In a panel the 16 rows'
 * weights lie side by side, 4 consecutive weights of each row in one int32 lane: one vpdpbusd
 * multiplies 4 weights of each of the 16 rows by the same 4 activations (broadcast), a group's
 * 32 weights sum in integers over 8 of them, and then each lane takes its own row's scale (16
 * lanes, 16 rows) in one conversion and one multiply-add; the scales of 16 rows are one 16-byte
 * load. The 1B Q4_K_M file's products at one row, one thread: Q4_K 2.3-2.9x, Q6_K 1.1-1.3x.
 *
 * Layout, per 16 rows and per unit (a super-block of 256 weights, or a block of 32; g: group of
 * 32 weights in the unit, r: row in the panel), the float16 d of the 16 rows first:
 *   Q4_K (2304 bytes = 16 x 144): d[16], dmin[16] | lo[8 g][16 r] (the 6-bit scale's low 4 bits
 *     at bits 0-3, the min's at 4-7), hi[4][16 r] (their top 2 bits: group 2 k's scale at bits
 *     0-1, its min at 2-3, group 2 k + 1's at 4-5 and 6-7) | per g: nibbles, 4 x 64 bytes
 *   Q5_K (2816 bytes = 16 x 176): Q4_K's, but per g: nibbles, 4 x 64 bytes, then fifth bits, 64
 *   Q6_K (3360 bytes = 16 x 210): d[16] | sc[16 sub-blocks][16 r] (int8) | per g: nibbles,
 *     4 x 64 bytes, then high bits, 2 x 64 bytes
 *   Q4_0 (288 bytes = 16 x 18): d[16] | nibbles: 4 x 64 bytes
 *   Q4_1 (320 bytes = 16 x 20): d[16], m[16] | nibbles: 4 x 64 bytes
 *   Q5_0 (352 bytes = 16 x 22): d[16] | nibbles: 4 x 64 bytes, then fifth bits, 64
 *   Q5_1 (384 bytes = 16 x 24): d[16], m[16] | nibbles: 4 x 64 bytes, then fifth bits, 64
 *   Q8_0 (544 bytes = 16 x 34): d[16] | u = q + 128: 8 x 64 bytes, the t-th holding weights
 *     4 t .. 4 t + 3 of row r at bytes 4 r ..
 *   IQ4_NL (288 bytes = 16 x 18): Q4_0's, the nibbles indices into the 16 levels (x16_levels)
 *   IQ4_XS (2176 bytes = 16 x 136): d[16] | lo[4][16 r] (the file's scales_l bytes: group 2 k's
 *     low 4 scale bits at 0-3, 2 k + 1's at 4-7), hi[2][16 r] (the file's scales_h bytes: group
 *     4 k + i's top 2 bits at 2 i) | per g: nibbles, 4 x 64 bytes
 * In the t-th 64 bytes of a group's nibbles, byte 4 r + e holds weight 8 t + e of row r in its
 * low nibble and weight 8 t + 4 + e in its high one. Q6_K's two high bits of those weights are
 * in byte 4 r + e of the group's (t / 2)-th 64 bytes of high bits, at bits 4 (t % 2) + 0-1 (low
 * nibble's weight) and + 2-3 (high nibble's); the Q5 types' fifth bits in byte 4 r + e of the group's
 * 64 bytes of them, at bits 2 t (low nibble's weight) and 2 t + 1 (high nibble's). Every value
 * is the file's own (the K types' scales keep 12 bytes a row, packed another way): x16_group gives
 * ggml.c's form of any group, so the dequantization and mlx's exact reference product read the
 * file's numbers, bit for bit, and a panel is the GEMM's column tile (gemm.c) as it stands.
 *
 * ggml_blocks.py repacks a matrix when the build has these loops (kiln_has_panels: the AVX-512
 * VNNI build at 512 bits, the AVX-VNNI and plain AVX2 builds at 256) and its rows are a multiple
 * of 16; the file's pages are then let go. Included by decode.c after ggml.c.
 */

#define X16_ROWS 16

static inline int x16_base(int type) { return type & ~KILN_X16; }

/* Weights of one unit: a super-block, or a block. */
static inline int x16_unit(int type) { return (int)ggml_unit_weights(x16_base(type)); }

/* Bytes of one panel's unit: 16 rows' worth, the file's bytes re-laid. */
static inline long x16_unit_bytes(int type) { return X16_ROWS * ggml_unit_bytes(x16_base(type)); }

/* Offsets in a panel's unit (d[16] at 0 in all). */
enum { X4_DMIN = 32, X4_LO = 64, X4_HI = 192, X4_NIB = 256 }; /* Q5_K: Q4_K's */

/* Q4_K's and Q5_K's scale and min of group j, row r, from a panel's unit o. Why packed (lo, hi)
 * rather than a byte each: unpacked, a 16-row unit took 2,368 bytes, 2.8% more than the file's
 * 16 x 144, and one-stream decoding reads every byte once (a Zen 4 core streamed a 1B Q4_K_M
 * file's panels and llama-server its blocks at the same ~22 GB/s: 0.97x the tokens/s). */
static inline int x16_k_sc(const uint8_t *o, int j, int r) { return (o[X4_LO + 16 * j + r] & 15) | ((o[X4_HI + 16 * (j / 2) + r] >> (4 * (j % 2))) & 3) << 4; }
static inline int x16_k_mn(const uint8_t *o, int j, int r) { return (o[X4_LO + 16 * j + r] >> 4) | ((o[X4_HI + 16 * (j / 2) + r] >> (4 * (j % 2) + 2)) & 3) << 4; }

#if defined(__SSE2__)
/* x16_k_sc and x16_k_mn for 16 (or 8) rows at once: lo and hi their bytes of lo[j] and hi[j / 2]. */
static inline void x16_k_unpack(__m128i lo, __m128i hi, int j, __m128i *sc, __m128i *mn) {
    const __m128i low4 = _mm_set1_epi8(15), top2 = _mm_set1_epi8(0x30);
    hi = _mm_srli_epi16(hi, 4 * (j % 2)); /* 16-bit shifts: only bits 0-3 of each byte are kept */
    *sc = _mm_or_si128(_mm_and_si128(lo, low4), _mm_and_si128(_mm_slli_epi16(hi, 4), top2));
    *mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lo, 4), low4), _mm_and_si128(_mm_slli_epi16(hi, 2), top2));
}
#endif
enum { X6_SC = 32, X6_NIB = 288 };
enum { X0_NIB = 32, X8_Q = 32 };       /* Q4_0, Q5_0 (its fifth bits after the nibbles); Q8_0 */
enum { X1_M = 32, X1_NIB = 64 };       /* Q4_1, Q5_1: the block's m, then as Q4_0 and Q5_0 */
enum { XS_LO = 32, XS_HI = 96, XS_NIB = 128 }; /* IQ4_XS */

/* Whether the type's nibbles index IQ4's 16 non-linear levels (iq4_levels: u = level + 128). */
static inline int x16_iq4(int base) { return base == KILN_IQ4_NL || base == KILN_IQ4_XS; }

/* IQ4_XS's 6-bit scale (ls; the group's c is ls - 32) of group j, row r, from a panel's unit o. */
static inline int x16_xs_ls(const uint8_t *o, int j, int r) { return ((o[XS_LO + 16 * (j / 2) + r] >> (4 * (j % 2))) & 15) | ((o[XS_HI + 16 * (j / 4) + r] >> (2 * (j % 4))) & 3) << 4; }

#if defined(__SSE2__)
/* x16_xs_ls for 16 (or 8) rows at once: lo and hi their bytes of lo[j / 2] and hi[j / 4]. */
static inline __m128i x16_xs_unpack(__m128i lo, __m128i hi, int j) {
    lo = _mm_and_si128(_mm_srli_epi16(lo, 4 * (j % 2)), _mm_set1_epi8(15));
    hi = _mm_and_si128(_mm_srli_epi16(hi, 2 * (j % 4)), _mm_set1_epi8(3));
    return _mm_or_si128(lo, _mm_slli_epi16(hi, 4)); /* at most 3 << 4: no bit crosses a byte */
}
#endif

/* Whether the type's u has a fifth bit (kept after each group's nibbles). */
static inline int x16_five(int base) { return base == KILN_Q5_K || base == KILN_Q5_0 || base == KILN_Q5_1; }


/* Bytes of one group's weights in a panel's unit: its nibbles (4 x 64), then Q5_K's fifth bits
 * (64) or Q6_K's high bits (2 x 64). One group's bytes lie together: with Q6_K's high bits in a
 * region of their own, 2 KB after the nibbles, the loops streamed a matrix from memory at half
 * the row loops' speed on a Zen 4 (10 against 17 GB/s); interleaved, at 22. */
static inline long x16_group_bytes(int base) { return base == KILN_Q6_K ? 384 : x16_five(base) ? 320 : 256; }

/* Where row r's weights 8 t .. 8 t + 7 of group j start in a panel's unit o: their nibbles' 4
 * bytes and (Q6_K) their high bits' 4 bytes; Q8_0's weights 4 t .. 4 t + 3. */
static inline const uint8_t *x16_nib(int base, const uint8_t *o, int r, int j, int t) {
    const long start = base == KILN_Q4_K || base == KILN_Q5_K ? X4_NIB : base == KILN_Q6_K ? X6_NIB : base == KILN_Q4_1 || base == KILN_Q5_1 ? X1_NIB : base == KILN_IQ4_XS ? XS_NIB : X0_NIB;
    return o + start + x16_group_bytes(base) * j + 64 * t + 4 * r;
}
static inline const uint8_t *x16_h5(int base, const uint8_t *o, int r, int j) { return x16_nib(base, o, 0, j, 0) + 256 + 4 * r; }
static inline const uint8_t *x16_hi(const uint8_t *o, int r, int j, int t) { return o + X6_NIB + 384 * j + 256 + 64 * (t / 2) + 4 * r; }
static inline const uint8_t *x16_q8(const uint8_t *o, int r, int t) { return o + X8_Q + 64 * t + 4 * r; }

/* Group g of row r (of a matrix in panels, K wide) in ggml.c's form, but for IQ4 the nibbles
 * themselves in u (their levels' indices), as the file holds them. */
static inline void x16_group_raw(int type, const uint8_t *q, int K, long r, int g, kiln_group *G, uint8_t u[32]) {
    const int base = x16_base(type), rp = (int)(r % X16_ROWS), per = x16_unit(type) / 32, j = g % per;
    const uint8_t *o = q + ((size_t)(r / X16_ROWS) * (K / x16_unit(type)) + g / per) * x16_unit_bytes(type);
    *G = (kiln_group){0};
    G->f = f16_at(o + 2 * rp);
    G->c0 = G->c1 = 1;
    switch (base) {
    case KILN_Q4_K: case KILN_Q5_K:
        G->mt = f16_at(o + X4_DMIN + 2 * rp) * (float)x16_k_mn(o, j, rp);
        G->c0 = G->c1 = x16_k_sc(o, j, rp);
        break;
    case KILN_Q6_K:
        G->c0 = (int8_t)o[X6_SC + 16 * (2 * j) + rp];
        G->c1 = (int8_t)o[X6_SC + 16 * (2 * j + 1) + rp];
        G->z = 32;
        break;
    case KILN_Q4_0: G->z = 8; break;
    case KILN_Q5_0: G->z = 16; break;
    case KILN_IQ4_NL: G->z = 128; break;
    case KILN_IQ4_XS: G->z = 128; G->c0 = G->c1 = x16_xs_ls(o, j, rp) - 32; break;
    case KILN_Q4_1: case KILN_Q5_1: G->mt = -f16_at(o + X1_M + 2 * rp); break;
    default: /* Q8_0 */
        G->z = 128;
        for (int t = 0; t < 8; t++) memcpy(u + 4 * t, x16_q8(o, rp, t), 4);
        return;
    }
    for (int t = 0; t < 4; t++) {
        const uint8_t *n = x16_nib(base, o, rp, j, t), *h = base == KILN_Q6_K ? x16_hi(o, rp, j, t) : NULL;
        const uint8_t *h5 = x16_five(base) ? x16_h5(base, o, rp, j) : NULL;
        for (int e = 0; e < 4; e++) {
            u[8 * t + e] = n[e] & 15;
            u[8 * t + 4 + e] = n[e] >> 4;
            if (h5) {
                u[8 * t + e] |= (uint8_t)(((h5[e] >> (2 * t)) & 1) << 4);
                u[8 * t + 4 + e] |= (uint8_t)(((h5[e] >> (2 * t + 1)) & 1) << 4);
            }
            if (h) {
                u[8 * t + e] |= (uint8_t)(((h[e] >> (4 * (t % 2))) & 3) << 4);
                u[8 * t + 4 + e] |= (uint8_t)(((h[e] >> (4 * (t % 2) + 2)) & 3) << 4);
            }
        }
    }
}

/* Group g of row r (of a matrix in panels, K wide) in ggml.c's form: G and u, exactly what
 * group_of and group_u give for the file's row. */
static inline void x16_group(int type, const uint8_t *q, int K, long r, int g, kiln_group *G, uint8_t u[32]) {
    x16_group_raw(type, q, K, r, g, G, u);
    if (x16_iq4(x16_base(type)))
        for (int l = 0; l < 32; l++) u[l] = iq4_levels[u[l]];
}

static inline void ggml_dequant_at(int type, const uint8_t *q, int K, long r, int g, float *o) {
    if (!(type & KILN_X16)) {
        ggml_dequant_group(type, q + (size_t)r * kiln_ggml_row_bytes(type, K), g, o);
        return;
    }
    kiln_group G;
    uint8_t u[32];
    x16_group(type, q, K, r, g, &G, u);
    ggml_group_values(&G, u, o);
}

/* How far ahead of the decode loop its panel's bytes are asked into L2. Why: on a Xeon (Sapphire
 * Rapids) one core streamed panels from memory at ~11.7 GB/s on the hardware prefetchers alone
 * (they stop at each 4 KB page); asked 16 KB ahead, the 1B Q4_K_M decode step went from 66-71 to
 * 51-53 ms (interleaved runs; 8 and 32 KB did as well, 2 KB into L1 less). Addresses past the last
 * panel are only hints: a prefetch never faults. */
#define X16_PREFETCH 16384

/* Bytes of one panel (16 rows, K wide). */
static inline long x16_panel_bytes(int type, int K) { return K / x16_unit(type) * x16_unit_bytes(type); }

/* Rows 0 .. 15 of `src` (the file's rows of `type`, rb bytes each) into one panel. Inlined
 * with `type` a constant (kiln_ggml_pack_x16's switch): compiled for any type, group_at's
 * switch and the scale unpacking ran per group, and a start read the panels at ~1 GB/s. */
static inline __attribute__((always_inline)) void x16_pack_panel(int type, const uint8_t *src, long rb, int K, uint8_t *dst) {
    const long ub = x16_unit_bytes(type), fb = kiln_ggml_row_bytes(type, x16_unit(type)); /* a unit in the file */
    const int per = x16_unit(type) / 32;
    for (int r = 0; r < X16_ROWS; r++) {
        const uint8_t *row = src + (size_t)r * rb;
        for (int s = 0; s < K / x16_unit(type); s++) {
            uint8_t *o = dst + (size_t)s * ub;
            const uint8_t *b = row + (size_t)s * fb;
            __builtin_prefetch(b + 1024); /* each unit's first load stalled its shuffle: Q4_K 1.2 -> 3.8 GB/s */
            memcpy(o + 2 * r, b + (type == KILN_Q6_K ? 208 : 0), 2);
            if (type == KILN_Q4_K || type == KILN_Q5_K) { /* the same d, dmin and scale packing */
                memcpy(o + X4_DMIN + 2 * r, b + 2, 2);
                for (int k = 0; k < 4; k++) {
                    int hi = 0;
                    for (int j = 2 * k; j < 2 * k + 2; j++) {
                        int sc, mn;
                        k_scale_min(b + 4, j, &sc, &mn);
                        o[X4_LO + 16 * j + r] = (uint8_t)((sc & 15) | (mn & 15) << 4);
                        hi |= ((sc >> 4) | (mn >> 4) << 2) << (4 * (j % 2));
                    }
                    o[X4_HI + 16 * k + r] = (uint8_t)hi;
                }
            } else if (type == KILN_Q6_K) {
                for (int j = 0; j < 16; j++) o[X6_SC + 16 * j + r] = b[192 + j];
            } else if (type == KILN_Q4_1 || type == KILN_Q5_1) {
                memcpy(o + X1_M + 2 * r, b + 2, 2);
            } else if (type == KILN_IQ4_XS) { /* scales_h (2 bytes) at 2, scales_l (4) at 4 */
                for (int k = 0; k < 4; k++) o[XS_LO + 16 * k + r] = b[4 + k];
                for (int k = 0; k < 2; k++) o[XS_HI + 16 * k + r] = b[2 + k];
            }
            for (int j = 0; j < per; j++) {
                uint8_t u[32];
                if (x16_iq4(type)) { /* the nibbles, not their levels: weights l and l + 16 share a byte */
                    const kiln_group G = group_of(type, row, s * per + j);
                    for (int l = 0; l < 16; l++) {
                        u[l] = G.src[l] & 15;
                        u[l + 16] = G.src[l] >> 4;
                    }
                } else {
                    group_at(type, row, s * per + j, u);
                }
                if (type == KILN_Q8_0) {
                    for (int t = 0; t < 8; t++) memcpy((uint8_t *)x16_q8(o, r, t), u + 4 * t, 4);
                    continue;
                }
                uint64_t w[4]; /* per pair of t: the 8 lower-nibble weights, then the 8 upper */
#if defined(__AVX2__)
                const __m256i sel = _mm256_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15, 0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
                _mm256_storeu_si256((__m256i *)w, _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)u), sel));
#else
                uint8_t *wb = (uint8_t *)w;
                for (int t = 0; t < 4; t++)
                    for (int e = 0; e < 4; e++) {
                        wb[16 * (t / 2) + 4 * (t % 2) + e] = u[8 * t + e];
                        wb[16 * (t / 2) + 8 + 4 * (t % 2) + e] = u[8 * t + 4 + e];
                    }
#endif
                uint32_t h5 = 0; /* the Q5 types' fifth bits: byte e, bit 2 t (weight 8 t + e), 2 t + 1 (8 t + 4 + e) */
                for (int pair = 0; pair < 2; pair++) {
                    const uint64_t lo = w[2 * pair], hi = w[2 * pair + 1], m4 = 0x0f0f0f0f0f0f0f0fULL, m2 = 0x0303030303030303ULL;
                    if (x16_five(type)) {
                        const uint64_t x = lo >> 4 & 0x0101010101010101ULL, y = hi >> 4 & 0x0101010101010101ULL;
                        h5 |= ((uint32_t)x | (uint32_t)y << 1 | (uint32_t)(x >> 32) << 2 | (uint32_t)(y >> 32) << 3) << (4 * pair);
                    }
                    const uint64_t nib = (lo & m4) | (hi & m4) << 4;
                    memcpy((uint8_t *)x16_nib(type, o, r, j, 2 * pair), &nib, 4);
                    memcpy((uint8_t *)x16_nib(type, o, r, j, 2 * pair + 1), (const uint8_t *)&nib + 4, 4);
                    if (type == KILN_Q6_K) { /* t even in bits 0-3 of each byte, t odd in 4-7 */
                        const uint64_t two = ((lo >> 4) & m2) | ((hi >> 4) & m2) << 2;
                        const uint32_t h = (uint32_t)two | (uint32_t)(two >> 32) << 4;
                        memcpy((uint8_t *)x16_hi(o, r, j, 2 * pair), &h, 4);
                    }
                }
                if (x16_five(type)) memcpy((uint8_t *)x16_h5(type, o, r, j), &h5, 4);
            }
        }
    }
}

/* Row r of a matrix in panels back in the file's own blocks (the self-test's round trip). */
static void x16_row(int type, const uint8_t *q, int K, long r, uint8_t *out) {
    const int base = x16_base(type), per = x16_unit(type) / 32, rp = (int)(r % X16_ROWS);
    const long fb = kiln_ggml_row_bytes(base, x16_unit(type));
    memset(out, 0, (size_t)kiln_ggml_row_bytes(base, K));
    for (int g = 0; g < K / 32; g++) {
        kiln_group G;
        uint8_t u[32];
        x16_group_raw(type, q, K, r, g, &G, u);
        const int s = g / per, j = g % per;
        const uint8_t *o = q + ((size_t)(r / X16_ROWS) * (K / x16_unit(type)) + s) * x16_unit_bytes(type);
        uint8_t *b = out + (size_t)s * fb;
        memcpy(b + (base == KILN_Q6_K ? 208 : 0), o + 2 * rp, 2);
        if (base == KILN_Q4_K || base == KILN_Q5_K) {
            memcpy(b + 2, o + X4_DMIN + 2 * rp, 2);
            const int sc = G.c0, mn = x16_k_mn(o, j, rp);
            if (j < 4) { /* k_scale_min's packing, undone */
                b[4 + j] |= (uint8_t)sc;
                b[8 + j] |= (uint8_t)mn;
            } else {
                b[j] |= (uint8_t)((sc >> 4) << 6);
                b[4 + j] |= (uint8_t)((mn >> 4) << 6);
                b[8 + j] = (uint8_t)((sc & 15) | (mn & 15) << 4);
            }
            const int five = base == KILN_Q5_K; /* Q5_K: qh[32] at 16, the nibbles at 48; bit j of qh[l] */
            for (int l = 0; l < 32; l++) {
                b[(five ? 48 : 16) + 32 * (j / 2) + l] |= (uint8_t)((u[l] & 15) << (4 * (j % 2)));
                if (five) b[16 + l] |= (uint8_t)((u[l] >> 4) << j);
            }
        } else if (base == KILN_Q6_K) { /* group_of's Q6_K: half h, quarter i: ql at 64 h + 32 (i & 1), nibble i / 2; qh bits 2 i */
            b[192 + 2 * j] = (uint8_t)G.c0;
            b[192 + 2 * j + 1] = (uint8_t)G.c1;
            const int h = j / 4, i = j % 4;
            for (int l = 0; l < 32; l++) {
                b[64 * h + 32 * (i & 1) + l] |= (uint8_t)((u[l] & 15) << (4 * (i >> 1)));
                b[128 + 32 * h + l] |= (uint8_t)((u[l] >> 4) << (2 * i));
            }
        } else if (base == KILN_IQ4_XS) { /* d, scales_h at 2 (2 bits a group), scales_l at 4 (4 bits), nibbles l | l + 16 at 8 + 16 j */
            const int ls = G.c0 + 32;
            b[2 + j / 4] |= (uint8_t)((ls >> 4) << (2 * (j % 4)));
            b[4 + j / 2] |= (uint8_t)((ls & 15) << (4 * (j % 2)));
            for (int l = 0; l < 16; l++) b[8 + 16 * j + l] = (uint8_t)(u[l] | u[l + 16] << 4);
        } else if (base == KILN_Q4_0 || base == KILN_Q4_1 || base == KILN_Q5_0 || base == KILN_Q5_1 || base == KILN_IQ4_NL) {
            /* ggml.c's blocks: d, then (Q4_1, Q5_1) m, (Q5_0, Q5_1) qh with bit l weight l's fifth, nibbles l | l + 16 */
            const int one = base == KILN_Q4_1 || base == KILN_Q5_1, five = x16_five(base);
            if (one) memcpy(b + 2, o + X1_M + 2 * rp, 2);
            uint8_t *qh = b + 2 + 2 * one, *qs = qh + 4 * five;
            for (int l = 0; l < 16; l++) qs[l] = (uint8_t)((u[l] & 15) | (u[l + 16] & 15) << 4);
            if (five)
                for (int l = 0; l < 32; l++) qh[l / 8] |= (uint8_t)((u[l] >> 4) << (l % 8));
        } else {
            for (int l = 0; l < 32; l++) b[2 + l] = u[l] ^ 0x80;
        }
    }
}

/* dst (N / 16 panels) = src (N rows of the file's `type` blocks, K wide) as panels. Returns the
 * panel type, or -1 where the type has none or N is not a multiple of 16. */
int kiln_ggml_pack_x16(int type, int N, int K, const uint8_t *src, uint8_t *dst) {
    if (!ggml_has_panels(type) || N % X16_ROWS || N < 1)
        return -1;
    const long rb = kiln_ggml_row_bytes(type, K);
    if (rb < 0 || K % x16_unit(type)) return -1;
    const long pb = x16_panel_bytes(type, K); /* every byte of dst is written: no clearing pass first */
    /* One thread: the read is bound by page faults and memory (two threads took as long alone),
     * and during a start the other core has the gateway's start and the grammar compiler to run. */
#define KILN_PACK(t) case t: for (int p = 0; p < N / X16_ROWS; p++) x16_pack_panel(t, src + (size_t)p * X16_ROWS * rb, rb, K, dst + (size_t)p * pb); break;
    switch (type) { KILN_X16_TYPES(KILN_PACK) }
#undef KILN_PACK
    return type | KILN_X16;
}

/* kiln_ggml_pack_x16 for `count` matrices: out[i] = its result for types[i], N[i], K[i], src[i]
 * and dst[i]. Why one call: ctypes gives the GIL back after each call and waits for it (up to
 * Python's 5 ms switch interval where another thread holds it); the worker builds the grammar
 * compiler on a thread during the load, and a 1B file's 113 calls took 0.85-1.0 s instead of
 * 0.43 s. */
void kiln_ggml_pack_x16_many(int count, const int32_t *types, const int32_t *N, const int32_t *K, const uint8_t *const *src, uint8_t *const *dst, int32_t *out) {
    for (int i = 0; i < count; i++) out[i] = kiln_ggml_pack_x16(types[i], N[i], K[i], src[i], dst[i]);
}

/* 1 where this build multiplies panels with loops of their own (else nothing repacks). */
int kiln_has_panels(void) {
#ifdef KILN_X16_LOOPS
    return 1;
#else
    return 0;
#endif
}

#ifdef KILN_GGML_512
/* Bit k of each byte of v, at bit 4 (Q5_K's fifth bit of a weight, into its u). 16-bit shifts
 * leave each byte's bit k at its bit 4, and the mask keeps that bit alone. */
static inline __m512i x16_bit4(__m512i v, int k, __m512i bit4) {
    return _mm512_and_si512(k <= 4 ? _mm512_slli_epi16(v, (unsigned)(4 - k)) : _mm512_srli_epi16(v, (unsigned)(k - 4)), bit4);
}

/* One panel as gemm.c's decoded column tile (its 16 columns are the panel's 16 rows; gemm_pack's
 * layout): each 64 bytes of weights are one or two of the tile's quads as they stand, and the
 * scales are gemm_pack's, f * c and f * m, the same float products. */
static void x16_gemm_pack(int type, const uint8_t *panel, int K, uint8_t *u, float *s0, float *s1, float *mt) {
    const int base = x16_base(type), per = x16_unit(type) / 32;
    const long ub = x16_unit_bytes(type);
    const __m512i low4 = _mm512_set1_epi8(15), top2 = _mm512_set1_epi8(0x30), bit4 = _mm512_set1_epi8(0x10);
    const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)iq4_levels));
    for (int g = 0; g < K / 32; g++) {
        const uint8_t *o = panel + (size_t)(g / per) * ub;
        const int j = g % per;
        const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
        for (int t = 0; t < (base == KILN_Q8_0 ? 8 : 4); t++) {
            if (base == KILN_Q8_0) {
                _mm512_store_si512(u + ((size_t)g * 8 + t) * 64, _mm512_loadu_si512(x16_q8(o, 0, t)));
                continue;
            }
            const __m512i v = _mm512_loadu_si512(x16_nib(base, o, 0, j, t));
            __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            if (base == KILN_Q6_K) {
                const __m512i h = _mm512_srli_epi16(_mm512_loadu_si512(x16_hi(o, 0, j, t)), 4 * (t % 2));
                lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(h, 4), top2));
                hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi16(h, 2), top2));
            } else if (x16_five(base)) {
                const __m512i h5 = _mm512_loadu_si512(x16_h5(base, o, 0, j));
                lo = _mm512_or_si512(lo, x16_bit4(h5, 2 * t, bit4));
                hi = _mm512_or_si512(hi, x16_bit4(h5, 2 * t + 1, bit4));
            } else if (x16_iq4(base)) {
                lo = _mm512_shuffle_epi8(levels, lo);
                hi = _mm512_shuffle_epi8(levels, hi);
            }
            _mm512_store_si512(u + ((size_t)g * 8 + 2 * t) * 64, lo);
            _mm512_store_si512(u + ((size_t)g * 8 + 2 * t + 1) * 64, hi);
        }
        __m512 a = f, b = f, m = _mm512_setzero_ps(); /* Q4_0, Q5_0, Q8_0: f * 1 */
        if (base == KILN_Q4_K || base == KILN_Q5_K) {
            __m128i sc, mn;
            x16_k_unpack(_mm_loadu_si128((const __m128i *)(o + X4_LO + 16 * j)), _mm_loadu_si128((const __m128i *)(o + X4_HI + 16 * (j / 2))), j, &sc, &mn);
            a = b = _mm512_mul_ps(f, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
            const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + X4_DMIN)));
            m = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
        } else if (base == KILN_Q6_K) {
            a = _mm512_mul_ps(f, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(o + X6_SC + 32 * j)))));
            b = _mm512_mul_ps(f, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(o + X6_SC + 32 * j + 16)))));
        } else if (base == KILN_Q4_1 || base == KILN_Q5_1) { /* mt = -m */
            m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + X1_M))));
        } else if (base == KILN_IQ4_XS) { /* c = ls - 32 */
            const __m128i ls = x16_xs_unpack(_mm_loadu_si128((const __m128i *)(o + XS_LO + 16 * (j / 2))), _mm_loadu_si128((const __m128i *)(o + XS_HI + 16 * (j / 4))), j);
            a = b = _mm512_mul_ps(f, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(ls), _mm512_set1_epi32(32))));
        }
        _mm512_store_ps(s0 + g * 16, a);
        _mm512_store_ps(s1 + g * 16, b);
        _mm512_store_ps(mt + g * 16, m);
    }
}

/* Rows m0 .. m0 + M - 1 of a against the 16 rows of one panel: y[m * ldy + c], c < 16. */
static inline __attribute__((always_inline)) void x16_tile(const int M, const int type, const uint8_t *panel, const int K, const kiln_act *a, int m0, float *y, long ldy) {
    __m512 acc[KILN_QMM_MAX_ROWS], cor[KILN_QMM_MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = cor[m] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(15), top2 = _mm512_set1_epi8(0x30), bit4 = _mm512_set1_epi8(0x10);
    const int q4k = type == KILN_Q4_K || type == KILN_Q5_K, q6k = type == KILN_Q6_K, per = x16_unit(type) / 32; /* q4k: scales and mins */
    const int offset = ggml_has_offset(type), z = ggml_zero_point(type); /* offset: the sums of mt kept apart (cor) */
    const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)iq4_levels));
    const long ub = x16_unit_bytes(type);
    for (int s = 0; s < K / x16_unit(type); s++) {
        const uint8_t *o = panel + (size_t)s * ub;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
        const __m512 dmin = q4k ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + X4_DMIN))) : _mm512_setzero_ps();
        const __m512 mt1 = offset && !q4k ? _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + X1_M)))) : _mm512_setzero_ps(); /* Q4_1, Q5_1: -m */
        for (int j = 0; j < per; j++) {
            for (long c = 0, gb = ub / per; c < gb; c += 64) /* this group's share of a unit 16 KB on */
                _mm_prefetch((const char *)((uintptr_t)o + X16_PREFETCH + (uintptr_t)(j * gb + c)), _MM_HINT_T1);
            __m512i u[8]; /* u[i]: weights 4 i .. 4 i + 3 of each row */
            if (type == KILN_Q8_0) {
                for (int t = 0; t < 8; t++) u[t] = _mm512_loadu_si512(x16_q8(o, 0, t));
            } else {
                for (int t = 0; t < 4; t++) {
                    const __m512i v = _mm512_loadu_si512(x16_nib(type, o, 0, j, t));
                    u[2 * t] = _mm512_and_si512(v, low4);
                    u[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                }
            }
            if (x16_five(type)) {
                const __m512i h5 = _mm512_loadu_si512(x16_h5(type, o, 0, j));
                for (int i = 0; i < 8; i++) u[i] = _mm512_or_si512(u[i], x16_bit4(h5, i, bit4));
            }
            if (x16_iq4(type))
                for (int i = 0; i < 8; i++) u[i] = _mm512_shuffle_epi8(levels, u[i]);
            __m512 sc0 = d, sc1 = _mm512_setzero_ps(), mn = mt1;
            if (type == KILN_IQ4_XS) {
                const __m128i ls = x16_xs_unpack(_mm_loadu_si128((const __m128i *)(o + XS_LO + 16 * (j / 2))), _mm_loadu_si128((const __m128i *)(o + XS_HI + 16 * (j / 4))), j);
                sc0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(ls), _mm512_set1_epi32(32))));
            }
            if (q4k) {
                __m128i sc8, mn8;
                x16_k_unpack(_mm_loadu_si128((const __m128i *)(o + X4_LO + 16 * j)), _mm_loadu_si128((const __m128i *)(o + X4_HI + 16 * (j / 2))), j, &sc8, &mn8);
                sc0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc8)));
                mn = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn8)));
            } else if (q6k) {
                for (int h = 0; h < 2; h++) {
                    const __m512i hb = _mm512_loadu_si512(x16_hi(o, 0, j, 2 * h));
                    /* nibble vectors 4h .. 4h + 3 take bits 0-1, 2-3, 4-5, 6-7 as bits 4-5 */
                    u[4 * h] = _mm512_or_si512(u[4 * h], _mm512_and_si512(_mm512_slli_epi16(hb, 4), top2));
                    u[4 * h + 1] = _mm512_or_si512(u[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(hb, 2), top2));
                    u[4 * h + 2] = _mm512_or_si512(u[4 * h + 2], _mm512_and_si512(hb, top2));
                    u[4 * h + 3] = _mm512_or_si512(u[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(hb, 2), top2));
                }
                sc0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(o + X6_SC + 32 * j)))));
                sc1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(o + X6_SC + 32 * j + 16)))));
            }
            const int g = s * per + j;
            for (int m = 0; m < M; m++) {
                const long r = m0 + m;
                const int32_t *x = (const int32_t *)(a->gq + r * a->gq_ld + g * 32);
                const int32_t *is = a->gsum + r * a->gsum_ld + 2 * g;
                const __m512 dx = _mm512_set1_ps(a->gd[r * a->gd_ld + g]);
                __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], _mm512_set1_epi32(x[0]));
                i0 = _mm512_dpbusd_epi32(i0, u[1], _mm512_set1_epi32(x[1]));
                i0 = _mm512_dpbusd_epi32(i0, u[2], _mm512_set1_epi32(x[2]));
                i0 = _mm512_dpbusd_epi32(i0, u[3], _mm512_set1_epi32(x[3]));
                __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[4], _mm512_set1_epi32(x[4]));
                i1 = _mm512_dpbusd_epi32(i1, u[5], _mm512_set1_epi32(x[5]));
                i1 = _mm512_dpbusd_epi32(i1, u[6], _mm512_set1_epi32(x[6]));
                i1 = _mm512_dpbusd_epi32(i1, u[7], _mm512_set1_epi32(x[7]));
                if (offset) { /* d sc dx sum(u x) - mt dx sum(x), mt = dmin m (K types) or -m */
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), _mm512_mul_ps(sc0, dx), acc[m]);
                    cor[m] = _mm512_fmadd_ps(mn, _mm512_mul_ps(dx, _mm512_set1_ps((float)(is[0] + is[1]))), cor[m]);
                } else if (q6k) { /* per 16 weights: d sc dx (sum(u x) - 32 sum(x)) */
                    i0 = _mm512_sub_epi32(i0, _mm512_set1_epi32(32 * is[0]));
                    i1 = _mm512_sub_epi32(i1, _mm512_set1_epi32(32 * is[1]));
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(sc0, dx), acc[m]);
                    cor[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(sc1, dx), cor[m]); /* a second chain */
                } else { /* d dx (sum(u x) - z sum(x)) */
                    const __m512i i = _mm512_sub_epi32(_mm512_add_epi32(i0, i1), _mm512_set1_epi32(z * (is[0] + is[1])));
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(sc0, dx), acc[m]);
                }
            }
        }
    }
    for (int m = 0; m < M; m++) _mm512_storeu_ps(y + m * ldy, offset ? _mm512_sub_ps(acc[m], cor[m]) : _mm512_add_ps(acc[m], cor[m]));
}

#elif defined(KILN_X16_LOOPS)
/* Bit k of each byte of v, at bit 4 (x16_bit4 at 256 bits). */
static inline __m256i x16_bit4_256(__m256i v, int k, __m256i bit4) {
    return _mm256_and_si256(k <= 4 ? _mm256_slli_epi16(v, 4 - k) : _mm256_srli_epi16(v, k - 4), bit4);
}

/* The 4-weight dot products of a group's 8 vectors u (32 weights each of 8 rows: 4 a lane) with
 * the activations x (4 bytes a broadcast): i0 sums the group's first 16 weights, i1 its last 16.
 * AVX-VNNI: one vpdpbusd each. Plain AVX2 has none: vpmaddubsw multiplies unsigned by signed
 * bytes into pairs of int16 sums (saturating), vpmaddwd adds those pairs into int32. The 16-bit
 * sums are added before widening as far as they cannot saturate, with |xi| <= 127: a pair is at
 * most 2 x 31 x 127 = 7,874 for 4- and 5-bit weights (four add up to 31,496), 2 x 63 x 127 =
 * 16,002 for Q6_K's (two: 32,004). Q8_0's u = q + 128 would saturate a pair (2 x 255 x 127), so
 * on AVX2 its u holds q itself (x16_half) and the products are |q| by xi signed as q is (at most
 * 2 x 128 x 127 = 32,512), with no zero point to take off; so does IQ4's u = level + 128 (at
 * most 241), whose signed level is at most 127 in size. */
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#define X16_VNNI 1
#endif
static inline int x16_signed(int type) { return type == KILN_Q8_0 || x16_iq4(type); }
static inline __attribute__((always_inline)) void x16_dots(const int type, const __m256i u[8], const int32_t *x, __m256i *i0, __m256i *i1) {
#ifdef X16_VNNI
    (void)type;
    __m256i s0 = GGML_DOT(_mm256_setzero_si256(), u[0], _mm256_set1_epi32(x[0]));
    s0 = GGML_DOT(s0, u[1], _mm256_set1_epi32(x[1]));
    s0 = GGML_DOT(s0, u[2], _mm256_set1_epi32(x[2]));
    s0 = GGML_DOT(s0, u[3], _mm256_set1_epi32(x[3]));
    __m256i s1 = GGML_DOT(_mm256_setzero_si256(), u[4], _mm256_set1_epi32(x[4]));
    s1 = GGML_DOT(s1, u[5], _mm256_set1_epi32(x[5]));
    s1 = GGML_DOT(s1, u[6], _mm256_set1_epi32(x[6]));
    s1 = GGML_DOT(s1, u[7], _mm256_set1_epi32(x[7]));
    *i0 = s0;
    *i1 = s1;
#else
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p[8];
    for (int t = 0; t < 8; t++) {
        const __m256i bx = _mm256_set1_epi32(x[t]);
        p[t] = x16_signed(type) ? _mm256_maddubs_epi16(_mm256_sign_epi8(u[t], u[t]), _mm256_sign_epi8(bx, u[t])) : _mm256_maddubs_epi16(u[t], bx);
    }
    __m256i s[2];
    for (int h = 0; h < 2; h++) {
        const __m256i *q = p + 4 * h;
        if (x16_signed(type))
            s[h] = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(q[0], ones), _mm256_madd_epi16(q[1], ones)),
                                    _mm256_add_epi32(_mm256_madd_epi16(q[2], ones), _mm256_madd_epi16(q[3], ones)));
        else if (type == KILN_Q6_K)
            s[h] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(q[0], q[1]), ones), _mm256_madd_epi16(_mm256_add_epi16(q[2], q[3]), ones));
        else
            s[h] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(q[0], q[1]), _mm256_add_epi16(q[2], q[3])), ones);
    }
    *i0 = s[0];
    *i1 = s[1];
#endif
}

/* x16_tile at 256 bits, for half `half` of the panel's rows (0: rows 0-7, 1: rows 8-15): each 64
 * bytes of a panel's weights are two vectors, one per half. One half at a time over the whole
 * width, so that AVX2's 16 registers hold a half's 8 weight vectors and its sums; the second half
 * reads the panel from L2 (a 2048-wide Q4_K panel is 19 KB, an 8192-wide one 76 KB). */
static inline __attribute__((always_inline)) void x16_half(const int M, const int type, const uint8_t *panel, const int K, const kiln_act *a, int m0, float *y, long ldy, const int half) {
    __m256 acc[KILN_QMM_MAX_ROWS], cor[KILN_QMM_MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = cor[m] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(15), top2 = _mm256_set1_epi8(0x30), bit4 = _mm256_set1_epi8(0x10);
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)iq4_levels));
    const int q4k = type == KILN_Q4_K || type == KILN_Q5_K, q6k = type == KILN_Q6_K, per = x16_unit(type) / 32, offset = ggml_has_offset(type);
#ifdef X16_VNNI
    const int z = ggml_zero_point(type);
#else
    const int z = x16_signed(type) ? 0 : ggml_zero_point(type); /* Q8_0's and IQ4's u is q itself here (x16_dots) */
#endif
    const long ub = x16_unit_bytes(type);
    const int hb = 32 * half, hr = 8 * half; /* the half's bytes in each 64, and its first row */
    for (int s = 0; s < K / x16_unit(type); s++) {
        const uint8_t *o = panel + (size_t)s * ub;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 2 * hr)));
        const __m256 dmin = q4k ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + X4_DMIN + 2 * hr))) : _mm256_setzero_ps();
        const __m256 mt1 = offset && !q4k ? _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + X1_M + 2 * hr)))) : _mm256_setzero_ps(); /* Q4_1, Q5_1: -m */
        for (int j = 0; j < per; j++) {
            if (!half) /* the first half brings the panel from memory, asked for ahead as x16_tile does */
                for (long c = 0, gb = ub / per; c < gb; c += 64) _mm_prefetch((const char *)((uintptr_t)o + X16_PREFETCH + (uintptr_t)(j * gb + c)), _MM_HINT_T1);
            __m256i u[8];
            if (type == KILN_Q8_0) {
                for (int t = 0; t < 8; t++) u[t] = _mm256_loadu_si256((const __m256i *)(x16_q8(o, 0, t) + hb));
#ifndef X16_VNNI
                for (int t = 0; t < 8; t++) u[t] = _mm256_xor_si256(u[t], _mm256_set1_epi8((char)0x80)); /* q = u - 128 */
#endif
            } else {
                for (int t = 0; t < 4; t++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(x16_nib(type, o, 0, j, t) + hb));
                    u[2 * t] = _mm256_and_si256(v, low4);
                    u[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                }
            }
            if (x16_five(type)) {
                const __m256i h5 = _mm256_loadu_si256((const __m256i *)(x16_h5(type, o, 0, j) + hb));
                for (int i = 0; i < 8; i++) u[i] = _mm256_or_si256(u[i], x16_bit4_256(h5, i, bit4));
            }
            if (x16_iq4(type)) {
                for (int i = 0; i < 8; i++) u[i] = _mm256_shuffle_epi8(levels, u[i]);
#ifndef X16_VNNI
                for (int i = 0; i < 8; i++) u[i] = _mm256_xor_si256(u[i], _mm256_set1_epi8((char)0x80)); /* the level itself */
#endif
            }
            __m256 sc0 = d, sc1 = _mm256_setzero_ps(), mn = mt1;
            if (type == KILN_IQ4_XS) {
                const __m128i ls = x16_xs_unpack(_mm_loadl_epi64((const __m128i *)(o + XS_LO + 16 * (j / 2) + hr)), _mm_loadl_epi64((const __m128i *)(o + XS_HI + 16 * (j / 4) + hr)), j);
                sc0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(ls), _mm256_set1_epi32(32))));
            }
            if (q4k) {
                __m128i sc8, mn8;
                x16_k_unpack(_mm_loadl_epi64((const __m128i *)(o + X4_LO + 16 * j + hr)), _mm_loadl_epi64((const __m128i *)(o + X4_HI + 16 * (j / 2) + hr)), j, &sc8, &mn8);
                sc0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc8)));
                mn = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn8)));
            } else if (q6k) {
                for (int h = 0; h < 2; h++) {
                    const __m256i hbits = _mm256_loadu_si256((const __m256i *)(x16_hi(o, 0, j, 2 * h) + hb));
                    u[4 * h] = _mm256_or_si256(u[4 * h], _mm256_and_si256(_mm256_slli_epi16(hbits, 4), top2));
                    u[4 * h + 1] = _mm256_or_si256(u[4 * h + 1], _mm256_and_si256(_mm256_slli_epi16(hbits, 2), top2));
                    u[4 * h + 2] = _mm256_or_si256(u[4 * h + 2], _mm256_and_si256(hbits, top2));
                    u[4 * h + 3] = _mm256_or_si256(u[4 * h + 3], _mm256_and_si256(_mm256_srli_epi16(hbits, 2), top2));
                }
                sc0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(o + X6_SC + 32 * j + hr)))));
                sc1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(o + X6_SC + 32 * j + 16 + hr)))));
            }
            const int g = s * per + j;
            for (int m = 0; m < M; m++) {
                const long r = m0 + m;
                const int32_t *x = (const int32_t *)(a->gq + r * a->gq_ld + g * 32);
                const int32_t *is = a->gsum + r * a->gsum_ld + 2 * g;
                const __m256 dx = _mm256_set1_ps(a->gd[r * a->gd_ld + g]);
                __m256i i0, i1;
                x16_dots(type, u, x, &i0, &i1);
                if (offset) {
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), _mm256_mul_ps(sc0, dx), acc[m]);
                    cor[m] = _mm256_fmadd_ps(mn, _mm256_mul_ps(dx, _mm256_set1_ps((float)(is[0] + is[1]))), cor[m]);
                } else if (q6k) {
                    i0 = _mm256_sub_epi32(i0, _mm256_set1_epi32(32 * is[0]));
                    i1 = _mm256_sub_epi32(i1, _mm256_set1_epi32(32 * is[1]));
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(sc0, dx), acc[m]);
                    cor[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(sc1, dx), cor[m]);
                } else {
                    const __m256i i = _mm256_sub_epi32(_mm256_add_epi32(i0, i1), _mm256_set1_epi32(z * (is[0] + is[1])));
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(sc0, dx), acc[m]);
                }
            }
        }
    }
    for (int m = 0; m < M; m++) _mm256_storeu_ps(y + m * ldy + hr, offset ? _mm256_sub_ps(acc[m], cor[m]) : _mm256_add_ps(acc[m], cor[m]));
}

/* Up to 8 rows, 4 at a time: each row's sums take two registers (acc, cor) beside the 8 weight
 * vectors, so 8 rows spilled their sums to the stack at every group (AVX2 has 16 registers): a
 * 512-row prefill chunk's Q4_K products ran at 24 G multiply-adds/s on one AVX2 thread, 46 in
 * fours (AVX-VNNI: 31 and 58). The second four decode the group's weights again, from L1. */
static inline __attribute__((always_inline)) void x16_tile(const int M, const int type, const uint8_t *panel, const int K, const kiln_act *a, int m0, float *y, long ldy) {
    for (int half = 0; half < 2; half++) {
        if (M > 4) {
            x16_half(4, type, panel, K, a, m0, y, ldy, half);
            x16_half(M - 4, type, panel, K, a, m0 + 4, y + 4 * ldy, ldy, half);
        } else {
            x16_half(M, type, panel, K, a, m0, y, ldy, half);
        }
    }
}
#endif

#ifdef KILN_X16_LOOPS
/* Panel p of w against rows m0 .. m0 + M - 1 (M <= 8) of a: one copy per type and row count. */
static void x16_panel(const kiln_qw *w, int p, const kiln_act *a, int m0, int M, float *y, long ldy) {
    const uint8_t *panel = w->q + (size_t)p * x16_panel_bytes(w->type, w->k);
    float *yp = y + (size_t)p * X16_ROWS;
#define KILN_X16_ROWS(t) \
    switch (M) { \
    case 1: x16_tile(1, t, panel, w->k, a, m0, yp, ldy); break; \
    case 2: x16_tile(2, t, panel, w->k, a, m0, yp, ldy); break; \
    case 3: x16_tile(3, t, panel, w->k, a, m0, yp, ldy); break; \
    case 4: x16_tile(4, t, panel, w->k, a, m0, yp, ldy); break; \
    case 5: x16_tile(5, t, panel, w->k, a, m0, yp, ldy); break; \
    case 6: x16_tile(6, t, panel, w->k, a, m0, yp, ldy); break; \
    case 7: x16_tile(7, t, panel, w->k, a, m0, yp, ldy); break; \
    case 8: x16_tile(8, t, panel, w->k, a, m0, yp, ldy); break; \
    }
#define KILN_X16_TILE(t) case t: KILN_X16_ROWS(t) break;
    switch (x16_base(w->type)) { KILN_X16_TYPES(KILN_X16_TILE) }
#undef KILN_X16_TILE
#undef KILN_X16_ROWS
}
#endif

/* 0 where panels give back every row bit for bit and (with the loops) their products equal
 * ggml.c's row loops' on the same rows (for kiln_selftest). */
static int x16_selftest(void) {
    enum { K = 256, N = X16_ROWS };
    static uint8_t rows[N * 272], panel[N * 272], back[272];
#define KILN_X16_ITEM(t) t,
    static const int types[] = {KILN_X16_TYPES(KILN_X16_ITEM)};
#undef KILN_X16_ITEM
    for (int t = 0; t < (int)(sizeof types / sizeof *types); t++) {
        const int type = types[t];
        const long rb = kiln_ggml_row_bytes(type, K);
        for (long i = 0; i < N * rb; i++) rows[i] = (uint8_t)((i * 131 + 17 * t + (i >> 7)) % 251);
        const uint16_t scale = 0x2400; /* 1/64 for d (and dmin) */
        const long fb = kiln_ggml_row_bytes(type, x16_unit(type)); /* a block or super-block */
        for (int r = 0; r < N; r++)
            for (int b = 0; b < K / x16_unit(type); b++) {
                memcpy(rows + r * rb + b * fb + (type == KILN_Q6_K ? 208 : 0), &scale, 2);
                if (ggml_has_offset(type)) memcpy(rows + r * rb + b * fb + 2, &scale, 2); /* dmin, m */
            }
        memset(panel, 0xa5, sizeof panel); /* the pack must write every byte */
        const int packed = kiln_ggml_pack_x16(type, N, K, rows, panel);
        if (packed != (type | KILN_X16)) return 1;
        for (int r = 0; r < N; r++) {
            x16_row(packed, panel, K, r, back);
            if (memcmp(back, rows + r * rb, (size_t)rb)) return 1;
        }
#ifdef KILN_X16_LOOPS
        float x[K], y[N], ref[N];
        int8_t xq[K];
        float d[K / 32];
        int32_t is[K / 16];
        for (int i = 0; i < K; i++) x[i] = i % 32 ? (float)((i * 37) % 255 - 127) : 127.f;
        ggml_quantize_row(K, x, xq, d, is);
        kiln_act a = {.M = 1, .K = K, .type = type, .gq = xq, .gd = d, .gsum = is, .gq_ld = K, .gd_ld = K / 32, .gsum_ld = K / 16};
        kiln_qw w = {.q = rows, .n = N, .k = K, .type = type}, wp = {.q = panel, .n = N, .k = K, .type = packed};
        for (int o = 0; o < N; o++) ggml_tile(1, &w, o, &a, 0, ref + o, 1);
        x16_panel(&wp, 0, &a, 0, 1, y, 1);
        for (int o = 0; o < N; o++)
            if (fabsf(y[o] - ref[o]) > 1e-3f * (fabsf(ref[o]) + 1000.f)) return 1; /* float order only */
#endif
    }
    return 0;
}
