/* Decode-step attention straight from the KV pools' block records (INT4 / INT2 / FP16), no float copy of the KV.
 *
 * One query token: G query heads share each of H KV heads. Every function folds a set of keys and values into
 * a running online-softmax state per (KV head, query head): acc[D] (unnormalised output), m (running max of the
 * scores), l (sum of exp(score - m)). State layout: float [H][G][D + 2]. The caller starts it at acc = 0,
 * m = -FLT_MAX, l = 0 and finishes with out = acc / l, lse = m + log(l). q is pre-scaled by 1/sqrt(D).
 *
 * Record layout (see flashmemory/kvcache/pools.py and quant.py): a block of one (layer, KV head) is bytes
 *   bits 4/2 : codes [2][bs][W] (K then V, W = D * bits / 8, planar: byte j of a row holds channels j, j+W, ...,
 *              lowest bits first), k_scale [bs/kgroup][D] fp16, k_zero (same), v_scale [bs][D/vgroup] fp16, v_zero
 *   bits 16  : kv [2][bs][D] fp16
 * at the byte offsets the caller passes. Storage of one layer is [H][num_slots][record_bytes].
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define FM_MAX_TOKENS 64 /* tokens decoded at once (a block, or a tile of dense keys) */
#define FM_MAX_DIM 256
#define FM_MAX_GROUP 32 /* query heads per KV head */

typedef _Float16 fm_half;

typedef float fm_v8 __attribute__((vector_size(32)));

static inline fm_v8 load8(const float *p) {
    fm_v8 r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline float hsum8(fm_v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* Fold T keys/values k, v [T][D] (D a multiple of 8) into the state of the G query heads of one KV head.
 * Scores: two key rows at a time against every query head, 2 * G independent vector accumulators, so the
 * multiply-adds are not serialised on one register. */
static inline __attribute__((always_inline)) void attend_tile_g(const float *q, int64_t G, int64_t D,
                                                                 const float *k, const float *v, int64_t T,
                                                                 float *state) {
    float p[FM_MAX_GROUP][FM_MAX_TOKENS];
    for (int64_t t = 0; t < T; t += 2) {
        const int two = t + 1 < T;
        const float *k0 = k + t * D, *k1 = k + (t + two) * D;
        fm_v8 a0[FM_MAX_GROUP], a1[FM_MAX_GROUP];
        for (int64_t g = 0; g < G; g++) a0[g] = a1[g] = (fm_v8){0};
        for (int64_t c = 0; c < D; c += 8) {
            const fm_v8 x0 = load8(k0 + c), x1 = load8(k1 + c);
            for (int64_t g = 0; g < G; g++) {
                const fm_v8 qg = load8(q + g * D + c);
                a0[g] += qg * x0;
                a1[g] += qg * x1;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            p[g][t] = hsum8(a0[g]);
            if (two) p[g][t + 1] = hsum8(a1[g]);
        }
    }
    float w[FM_MAX_GROUP];
    for (int64_t g = 0; g < G; g++) {
        float *acc = state + g * (D + 2);
        float *pm = acc + D, *pl = acc + D + 1;
        float mx = *pm;
        for (int64_t t = 0; t < T; t++) mx = p[g][t] > mx ? p[g][t] : mx;
        const float alpha = expf(*pm - mx); /* 0 on the first tile (m starts at -FLT_MAX) */
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < T; t++) {
            p[g][t] = expf(p[g][t] - mx);
            sum += p[g][t];
        }
        *pl = *pl * alpha + sum;
        *pm = mx;
        w[g] = alpha;
    }
    /* Output: per 8 channels, every query head's accumulator stays in a register across the tile's rows. */
    for (int64_t c = 0; c < D; c += 8) {
        fm_v8 o[FM_MAX_GROUP];
        for (int64_t g = 0; g < G; g++) o[g] = load8(state + g * (D + 2) + c) * w[g];
        for (int64_t t = 0; t < T; t++) {
            const fm_v8 x = load8(v + t * D + c);
            for (int64_t g = 0; g < G; g++) o[g] += p[g][t] * x;
        }
        for (int64_t g = 0; g < G; g++) memcpy(state + g * (D + 2) + c, &o[g], sizeof o[g]);
    }
}

/* attend_tile_g with the group size a constant for the usual groups: the per-head accumulators then live in
 * registers instead of a stack array indexed at run time (SmolLM2: G = 3). */
static void attend_tile(const float *q, int64_t G, int64_t D, const float *k, const float *v, int64_t T,
                        float *state) {
    switch (G) {
    case 1: attend_tile_g(q, 1, D, k, v, T, state); break;
    case 2: attend_tile_g(q, 2, D, k, v, T, state); break;
    case 3: attend_tile_g(q, 3, D, k, v, T, state); break;
    case 4: attend_tile_g(q, 4, D, k, v, T, state); break;
    case 5: attend_tile_g(q, 5, D, k, v, T, state); break;
    case 6: attend_tile_g(q, 6, D, k, v, T, state); break;
    case 7: attend_tile_g(q, 7, D, k, v, T, state); break;
    case 8: attend_tile_g(q, 8, D, k, v, T, state); break;
    default: attend_tile_g(q, G, D, k, v, T, state); break;
    }
}

/* One row of planar codes [W] -> float [D] as code * scale[c] + zero[c] (scale, zero: float [D]). */
static inline void dequantize_row(const uint8_t *row, int bits, int64_t W, const float *scale, const float *zero,
                                  float *out) {
    const unsigned mask = (1u << bits) - 1u;
    for (int p = 0; p < 8 / bits; p++) {
        const int shift = bits * p;
        const float *s = scale + p * W, *z = zero + p * W;
        float *o = out + p * W;
#pragma omp simd
        for (int64_t j = 0; j < W; j++) o[j] = (float)((row[j] >> shift) & mask) * s[j] + z[j];
    }
}

/* Keys: codes [T][W], fp16 scale/zero [T/kgroup][D] (per channel, shared by kgroup rows). */
static void dequantize_keys(const uint8_t *codes, const fm_half *scale, const fm_half *zero, int bits, int64_t T,
                            int64_t D, int64_t kgroup, float *out) {
    const int64_t W = D * bits / 8;
    float s[FM_MAX_DIM], z[FM_MAX_DIM];
    for (int64_t t = 0; t < T; t++) {
        if (t % kgroup == 0) {
            const fm_half *hs = scale + (t / kgroup) * D, *hz = zero + (t / kgroup) * D;
#pragma omp simd
            for (int64_t c = 0; c < D; c++) {
                s[c] = (float)hs[c];
                z[c] = (float)hz[c];
            }
        }
        dequantize_row(codes + t * W, bits, W, s, z, out + t * D);
    }
}

/* Values: codes [T][W], fp16 scale/zero [T][D/vgroup] (per row, one per group of vgroup channels). */
static void dequantize_values(const uint8_t *codes, const fm_half *scale, const fm_half *zero, int bits, int64_t T,
                              int64_t D, int64_t vgroup, float *out) {
    const int64_t W = D * bits / 8, groups = D / vgroup;
    float s[FM_MAX_DIM], z[FM_MAX_DIM];
    for (int64_t t = 0; t < T; t++) {
        for (int64_t g = 0; g < groups; g++) {
            const float sg = (float)scale[t * groups + g], zg = (float)zero[t * groups + g];
            for (int64_t c = g * vgroup; c < (g + 1) * vgroup; c++) {
                s[c] = sg;
                z[c] = zg;
            }
        }
        dequantize_row(codes + t * W, bits, W, s, z, out + t * D);
    }
}

/* Fold blocks i0..i1 of each KV head into `state`: block i of head h is slot slots[h * slot_stride + i], or
 * table[slots[h * slot_stride + i]] when a table is given. */
static void fold_records(const float *q, int64_t H, int64_t G, int64_t D, const uint8_t *storage, int64_t num_slots,
                         int64_t record_bytes, const int64_t *slots, int64_t slot_stride, const int64_t *table,
                         int64_t i0, int64_t i1, int bits,
                         int64_t bs, int64_t kgroup, int64_t vgroup, int64_t codes_off, int64_t ks_off,
                         int64_t kz_off, int64_t vs_off, int64_t vz_off, float *state) {
    float k[FM_MAX_TOKENS * FM_MAX_DIM], v[FM_MAX_TOKENS * FM_MAX_DIM];
    for (int64_t h = 0; h < H; h++) {
        for (int64_t i = i0; i < i1; i++) {
            const int64_t pos = slots[h * slot_stride + i];
            const uint8_t *rec = storage + (h * num_slots + (table != NULL ? table[pos] : pos)) * record_bytes;
            if (bits == 16) {
                const fm_half *kv = (const fm_half *)(rec + codes_off);
#pragma omp simd
                for (int64_t e = 0; e < bs * D; e++) {
                    k[e] = (float)kv[e];
                    v[e] = (float)kv[bs * D + e];
                }
            } else {
                const int64_t W = D * bits / 8;
                dequantize_keys(rec + codes_off, (const fm_half *)(rec + ks_off), (const fm_half *)(rec + kz_off),
                                bits, bs, D, kgroup, k);
                dequantize_values(rec + codes_off + bs * W, (const fm_half *)(rec + vs_off),
                                  (const fm_half *)(rec + vz_off), bits, bs, D, vgroup, v);
            }
            attend_tile(q + h * G * D, G, D, k, v, bs, state + h * G * (D + 2));
        }
    }
}

/* state <- the online-softmax merge of state and other (both [H * G][D + 2]): rescale both to the larger max. */
static void merge_states(float *state, const float *other, int64_t rows, int64_t D) {
    for (int64_t r = 0; r < rows; r++) {
        float *a = state + r * (D + 2);
        const float *b = other + r * (D + 2);
        const float m = a[D] > b[D] ? a[D] : b[D];
        const float wa = expf(a[D] - m), wb = expf(b[D] - m);
        for (int64_t c = 0; c < D; c++) a[c] = a[c] * wa + b[c] * wb;
        a[D + 1] = a[D + 1] * wa + b[D + 1] * wb;
        a[D] = m;
    }
}

#define FM_MIN_BLOCKS_PER_THREAD 4 /* below this a second thread costs more than it saves */

/* Fold n blocks per KV head of one layer's pool storage into the state, the block range split over num_threads
 * OpenMP threads (each folds the chunks it takes, every head, into its own state; the states are merged by
 * log-sum-exp). Block i of head h is slot slots[h * slot_stride + i] (slot_stride 0: every head reads the same
 * blocks), or table[that] when table is not NULL (slots then hold positions into the table). Returns 0, or -1 when
 * the shapes exceed the kernel's limits (the caller then uses its fallback). */
int fm_attend_records(const float *q, int64_t H, int64_t G, int64_t D, const uint8_t *storage, int64_t num_slots,
                      int64_t record_bytes, const int64_t *slots, int64_t slot_stride, const int64_t *table,
                      int64_t n, int bits, int64_t bs, int64_t kgroup,
                      int64_t vgroup, int64_t codes_off, int64_t ks_off, int64_t kz_off, int64_t vs_off,
                      int64_t vz_off, float *state, int num_threads) {
    if (bs > FM_MAX_TOKENS || D > FM_MAX_DIM || D % 8 || G > FM_MAX_GROUP || (bits != 2 && bits != 4 && bits != 16))
        return -1;
    int threads = num_threads;
    if (threads > n / FM_MIN_BLOCKS_PER_THREAD) threads = (int)(n / FM_MIN_BLOCKS_PER_THREAD);
    float *partial = threads > 1 ? malloc(sizeof(float) * (size_t)((threads - 1) * H * G * (D + 2))) : NULL;
    if (partial == NULL) threads = 1;
    if (threads == 1) {
        fold_records(q, H, G, D, storage, num_slots, record_bytes, slots, slot_stride, table, 0, n, bits, bs, kgroup,
                     vgroup, codes_off, ks_off, kz_off, vs_off, vz_off, state);
        free(partial);
        return 0;
    }
    const int64_t size = H * G * (D + 2);
    for (int64_t e = 0; e < (threads - 1) * size; e++)
        partial[e] = (e % (D + 2) == D) ? -FLT_MAX : 0.0f; /* acc = 0, m = -FLT_MAX, l = 0 */
    /* Chunks of FM_MIN_BLOCKS_PER_THREAD blocks, taken dynamically (a thread that loses its core on a shared
     * machine leaves its chunks to the others); each thread folds what it takes into its own state. */
    const int64_t num_chunks = (n + FM_MIN_BLOCKS_PER_THREAD - 1) / FM_MIN_BLOCKS_PER_THREAD;
    int used = 1;
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
        if (t == 0) used = omp_get_num_threads();
#else
        const int t = 0;
#endif
        float *mine = t == 0 ? state : partial + (t - 1) * size;
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < num_chunks; c++) {
            const int64_t i0 = c * FM_MIN_BLOCKS_PER_THREAD;
            const int64_t i1 = i0 + FM_MIN_BLOCKS_PER_THREAD < n ? i0 + FM_MIN_BLOCKS_PER_THREAD : n;
            fold_records(q, H, G, D, storage, num_slots, record_bytes, slots, slot_stride, table, i0, i1, bits, bs,
                         kgroup, vgroup, codes_off, ks_off, kz_off, vs_off, vz_off, mine);
        }
    }
    for (int t = 1; t < used; t++) merge_states(state, partial + (t - 1) * size, H * G, D);
    free(partial);
    return 0;
}

/* Fold dense float keys and values k, v [H][m][D] (contiguous) into the state. */
int fm_attend_dense(const float *q, int64_t H, int64_t G, int64_t D, const float *k, const float *v, int64_t m,
                    float *state) {
    if (D > FM_MAX_DIM || D % 8 || G > FM_MAX_GROUP) return -1;
    for (int64_t h = 0; h < H; h++) {
        for (int64_t t0 = 0; t0 < m; t0 += FM_MAX_TOKENS) {
            const int64_t T = m - t0 < FM_MAX_TOKENS ? m - t0 : FM_MAX_TOKENS;
            attend_tile(q + h * G * D, G, D, k + (h * m + t0) * D, v + (h * m + t0) * D, T, state + h * G * (D + 2));
        }
    }
    return 0;
}

/* Fold dense fp16 keys and values into the state: row t of head h at k + h * head_stride + t * row_stride (the
 * same for v; channels contiguous), e.g. a strided view of the still-filling block, read without a float copy. */
int fm_attend_dense_f16(const float *q, int64_t H, int64_t G, int64_t D, const fm_half *k, const fm_half *v,
                        int64_t m, int64_t head_stride, int64_t row_stride, float *state) {
    if (D > FM_MAX_DIM || D % 8 || G > FM_MAX_GROUP) return -1;
    float kf[FM_MAX_TOKENS * FM_MAX_DIM], vf[FM_MAX_TOKENS * FM_MAX_DIM];
    for (int64_t h = 0; h < H; h++) {
        for (int64_t t0 = 0; t0 < m; t0 += FM_MAX_TOKENS) {
            const int64_t T = m - t0 < FM_MAX_TOKENS ? m - t0 : FM_MAX_TOKENS;
            for (int64_t t = 0; t < T; t++) {
                const fm_half *kr = k + h * head_stride + (t0 + t) * row_stride;
                const fm_half *vr = v + h * head_stride + (t0 + t) * row_stride;
#pragma omp simd
                for (int64_t c = 0; c < D; c++) {
                    kf[t * D + c] = (float)kr[c];
                    vf[t * D + c] = (float)vr[c];
                }
            }
            attend_tile(q + h * G * D, G, D, kf, vf, T, state + h * G * (D + 2));
        }
    }
    return 0;
}

/* Start a decode state: q_out = q * scale ([rows][D], rows = H * G) and state rows at acc = 0, m = -FLT_MAX, l = 0. */
void fm_decode_begin(const float *q, float scale, int64_t rows, int64_t D, float *q_out, float *state) {
    for (int64_t e = 0; e < rows * D; e++) q_out[e] = q[e] * scale;
    for (int64_t r = 0; r < rows; r++) {
        float *row = state + r * (D + 2);
        memset(row, 0, sizeof(float) * (size_t)D);
        row[D] = -FLT_MAX; /* finite: the kernel is built with -ffast-math */
        row[D + 1] = 0.0f;
    }
}

/* Finish: out[r][c] = acc / l for every state row ([rows][D + 2] -> [rows][D]). */
void fm_decode_end(const float *state, int64_t rows, int64_t D, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = state + r * (D + 2);
        const float inv = 1.0f / row[D + 1];
        for (int64_t c = 0; c < D; c++) out[r * D + c] = row[c] * inv;
    }
}
