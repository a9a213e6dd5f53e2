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
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include "decode_attention.h"

typedef float fm_v8 __attribute__((vector_size(32)));
typedef int32_t fm_v8i __attribute__((vector_size(32)));
typedef uint8_t fm_v8b __attribute__((vector_size(8)));
typedef fm_half fm_v8h __attribute__((vector_size(16)));

static inline fm_v8 load8(const float *p) {
    fm_v8 r;
    memcpy(&r, p, sizeof r);
    return r;
}

/* 8 fp16 values as floats: one vcvtph2ps with F16C (GCC's generic conversion goes value by value). */
static inline fm_v8 load8h(const fm_half *p) {
#ifdef __F16C__
    return (fm_v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    fm_v8h r;
    memcpy(&r, p, sizeof r);
    return __builtin_convertvector(r, fm_v8);
#endif
}

/* Bytes p[0..8) widened to 8 ints: one vpmovzxbd with AVX2 (GCC's generic conversion goes byte by byte). */
static inline fm_v8i load8bytes(const uint8_t *p) {
#ifdef __AVX2__
    return (fm_v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    fm_v8b b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, fm_v8i);
#endif
}

/* 8 codes of one bit plane as floats: bytes p[0..8) shifted right by `shift`, masked to `mask`. */
static inline fm_v8 load8codes(const uint8_t *p, int shift, int mask) {
    return __builtin_convertvector((load8bytes(p) >> shift) & mask, fm_v8);
}

static inline float hsum8(fm_v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* The horizontal sums of 8 vectors as one vector (r[i] = sum of v[i]): three rounds of pairwise adds. */
static inline fm_v8 hsum8x8(const fm_v8 *v) {
    const fm_v8i even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
    const fm_v8i low = {0, 1, 2, 3, 8, 9, 10, 11}, high = {4, 5, 6, 7, 12, 13, 14, 15};
    fm_v8 t[4], u[2];
    for (int i = 0; i < 4; i++) t[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], even) +
                                       __builtin_shuffle(v[2 * i], v[2 * i + 1], odd);
    for (int i = 0; i < 2; i++) u[i] = __builtin_shuffle(t[2 * i], t[2 * i + 1], even) +
                                       __builtin_shuffle(t[2 * i], t[2 * i + 1], odd);
    return __builtin_shuffle(u[0], u[1], low) + __builtin_shuffle(u[0], u[1], high);
}

/* Scores p[g][t] = the horizontal sum of dots[g][t] (the partial dot products of one key row) for t < T, 8 rows
 * at a time; rows from T up to the next multiple of 8 are left for softmax_tile to fill. */
static inline __attribute__((always_inline)) void sum_dots(fm_v8 dots[][FM_MAX_TOKENS], int64_t G, int64_t T,
                                                            float p[][FM_MAX_TOKENS]) {
    for (int64_t g = 0; g < G; g++) {
        for (int64_t t = T; t & 7; t++) dots[g][t] = (fm_v8){0};
        for (int64_t t = 0; t < T; t += 8) {
            const fm_v8 r = hsum8x8(&dots[g][t]);
            memcpy(&p[g][t], &r, sizeof r);
        }
    }
}

/* exp(x) for x <= 0 (scores minus their running max), 8 at a time: x = n ln2 + f with |f| <= ln2 / 2 and
 * e^f by its degree-6 Taylor polynomial (relative error below 5e-7 against exp over [-87, 0]; expf's is 6e-8);
 * exactly 0 below -87, where 2^n would leave the normal range (expf is below 2e-38 there). */
static inline fm_v8 exp8(fm_v8 x) {
    const fm_v8 lo = (fm_v8){0} - 87.0f;
    const fm_v8i keep = x >= lo;
    x = (fm_v8)(((fm_v8i)x & keep) | ((fm_v8i)lo & ~keep)); /* max(x, lo), NaN-free under -ffast-math */
    const fm_v8i n = __builtin_convertvector(x * 1.44269504f - 0.5f, fm_v8i); /* round(x / ln2), x <= 0 */
    const fm_v8 f = x - __builtin_convertvector(n, fm_v8) * 0.693147182f;
    fm_v8 e = f * (1.0f / 720) + 1.0f / 120;
    e = e * f + 1.0f / 24;
    e = e * f + 1.0f / 6;
    e = e * f + 0.5f;
    e = e * f + 1.0f;
    e = e * f + 1.0f;
    const fm_v8i pow2n = (n + 127) << 23; /* n >= -126: a normal float */
    return (fm_v8)((fm_v8i)(e * (fm_v8)pow2n) & keep);
}

/* Online-softmax step for the scores p[g][0..T) of the G query heads of one KV head: p <- exp(p - m') in place
 * (zero past T up to the next multiple of 8), l and m of each head's state updated; alpha[g] = exp(m - m') is
 * what the head's accumulator must be scaled by before this tile's values are added. */
static inline __attribute__((always_inline)) void softmax_tile(float p[][FM_MAX_TOKENS], int64_t G, int64_t D,
                                                                int64_t T, float *state, float *alpha) {
    const int64_t padded = (T + 7) & ~(int64_t)7;
    for (int64_t g = 0; g < G; g++) {
        float *pm = state + g * (D + 2) + D, *pl = pm + 1;
        float mx = *pm;
        for (int64_t t = 0; t < T; t++) mx = p[g][t] > mx ? p[g][t] : mx;
        for (int64_t t = T; t < padded; t++) p[g][t] = mx - 100.0f; /* exp8 gives 0 */
        fm_v8 sum = {0};
        for (int64_t t = 0; t < padded; t += 8) {
            const fm_v8 e = exp8(load8(&p[g][t]) - mx);
            memcpy(&p[g][t], &e, sizeof e);
            sum += e;
        }
        alpha[g] = exp8((fm_v8){0} + (*pm - mx))[0]; /* 0 on the first tile (m starts at -FLT_MAX) */
        *pl = *pl * alpha[g] + hsum8(sum);
        *pm = mx;
    }
}

/* Fold T float or fp16 keys/values (row t of k at k + t * stride, D a multiple of 8, channels contiguous) into
 * the state of the G query heads of one KV head; fp16 rows are converted as they are read. Scores: two key rows
 * at a time against every query head, 2 * G independent vector accumulators, so the multiply-adds are not
 * serialised on one register. */
static inline __attribute__((always_inline)) void attend_tile_g(const float *q, int64_t G, int64_t D,
                                                                 const void *k, const void *v, int64_t stride,
                                                                 int half, int64_t T, float *state) {
#define FM_ROW8(base, t, c) (half ? load8h((const fm_half *)(base) + (t) * stride + (c)) \
                                  : load8((const float *)(base) + (t) * stride + (c)))
    float p[FM_MAX_GROUP][FM_MAX_TOKENS];
    fm_v8 dots[FM_MAX_GROUP][FM_MAX_TOKENS];
    for (int64_t t = 0; t < T; t += 2) {
        const int64_t t1 = t + 1 < T ? t + 1 : t;
        fm_v8 a0[FM_MAX_GROUP], a1[FM_MAX_GROUP];
        for (int64_t g = 0; g < G; g++) a0[g] = a1[g] = (fm_v8){0};
        for (int64_t c = 0; c < D; c += 8) {
            const fm_v8 x0 = FM_ROW8(k, t, c), x1 = FM_ROW8(k, t1, c);
            for (int64_t g = 0; g < G; g++) {
                const fm_v8 qg = load8(q + g * D + c);
                a0[g] += qg * x0;
                a1[g] += qg * x1;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            dots[g][t] = a0[g];
            dots[g][t1] = a1[g]; /* the same as a0 when t1 == t */
        }
    }
    sum_dots(dots, G, T, p);
    float w[FM_MAX_GROUP];
    softmax_tile(p, G, D, T, state, w);
    /* Output: per 8 channels, every query head's accumulator stays in a register across the tile's rows. */
    for (int64_t c = 0; c < D; c += 8) {
        fm_v8 o[FM_MAX_GROUP];
        fm_v8 e[FM_MAX_GROUP]; /* odd rows: 2 * G multiply-add chains instead of G */
        for (int64_t g = 0; g < G; g++) {
            o[g] = load8(state + g * (D + 2) + c) * w[g];
            e[g] = (fm_v8){0};
        }
        int64_t t = 0;
        for (; t + 1 < T; t += 2) {
            const fm_v8 x0 = FM_ROW8(v, t, c), x1 = FM_ROW8(v, t + 1, c);
            for (int64_t g = 0; g < G; g++) {
                o[g] += p[g][t] * x0;
                e[g] += p[g][t + 1] * x1;
            }
        }
        if (t < T) {
            const fm_v8 x0 = FM_ROW8(v, t, c);
            for (int64_t g = 0; g < G; g++) o[g] += p[g][t] * x0;
        }
        for (int64_t g = 0; g < G; g++) {
            const fm_v8 sum = o[g] + e[g];
            memcpy(state + g * (D + 2) + c, &sum, sizeof sum);
        }
    }
#undef FM_ROW8
}

/* attend_tile_g with the group size a constant for the usual groups: the per-head accumulators then live in
 * registers instead of a stack array indexed at run time (SmolLM2: G = 3). */
#define FM_DISPATCH_G(fn, G, ...)                                                                                  \
    switch (G) {                                                                                                   \
    case 1: fn(1, __VA_ARGS__); break;                                                                             \
    case 2: fn(2, __VA_ARGS__); break;                                                                             \
    case 3: fn(3, __VA_ARGS__); break;                                                                             \
    case 4: fn(4, __VA_ARGS__); break;                                                                             \
    case 5: fn(5, __VA_ARGS__); break;                                                                             \
    case 6: fn(6, __VA_ARGS__); break;                                                                             \
    case 7: fn(7, __VA_ARGS__); break;                                                                             \
    case 8: fn(8, __VA_ARGS__); break;                                                                             \
    default: fn(G, __VA_ARGS__); break;                                                                            \
    }

#define FM_TILE_F32(G_, q, D, k, v, stride, T, state) attend_tile_g(q, G_, D, k, v, stride, 0, T, state)
#define FM_TILE_F16(G_, q, D, k, v, stride, T, state) attend_tile_g(q, G_, D, k, v, stride, 1, T, state)

static void attend_tile(const float *q, int64_t G, int64_t D, const float *k, const float *v, int64_t stride,
                        int64_t T, float *state) {
    FM_DISPATCH_G(FM_TILE_F32, G, q, D, k, v, stride, T, state)
}

static void attend_tile_f16(const float *q, int64_t G, int64_t D, const fm_half *k, const fm_half *v,
                            int64_t stride, int64_t T, float *state) {
    FM_DISPATCH_G(FM_TILE_F16, G, q, D, k, v, stride, T, state)
}

/* Fold one INT4 / INT2 block (codes [2][T][W], planar; scales and zero points as in the file comment) into the
 * state of the G query heads of one KV head without dequantizing it: with the key scale s and zero z of a
 * channel shared by kgroup rows, q.k = sum_c (q_c s_c) code_c + sum_c q_c z_c, so the query is scaled once per
 * key group and dotted with the codes; with the value scale and zero shared by vgroup channels of a row,
 * sum_t p_t (code_t s_t + z_t) = sum_t (p_t s_t) code_t + sum_t p_t z_t, so the scale folds into the softmax
 * weight. Needs W and vgroup multiples of 8 and kgroup dividing T (fused_ok). */
static inline __attribute__((always_inline)) void attend_quant_g(const float *q, int64_t G, int64_t D, int bits,
                                                                  const uint8_t *codes, const fm_half *ks,
                                                                  const fm_half *kz, const fm_half *vs,
                                                                  const fm_half *vz, int64_t T, int64_t kgroup,
                                                                  int64_t vgroup, float *state) {
    const int64_t W = D * bits / 8, groups = D / vgroup;
    const int mask = (1 << bits) - 1;
    float p[FM_MAX_GROUP][FM_MAX_TOKENS], qs[FM_MAX_GROUP * FM_MAX_DIM];
    fm_v8 dots[FM_MAX_GROUP][FM_MAX_TOKENS];
    for (int64_t t0 = 0; t0 < T; t0 += kgroup) {
        const fm_half *s = ks + (t0 / kgroup) * D, *z = kz + (t0 / kgroup) * D;
        fm_v8 bias8[FM_MAX_GROUP];
        for (int64_t g = 0; g < G; g++) bias8[g] = (fm_v8){0};
        for (int64_t c = 0; c < D; c += 8) {
            const fm_v8 s8 = load8h(s + c), z8 = load8h(z + c);
            for (int64_t g = 0; g < G; g++) {
                const fm_v8 qg = load8(q + g * D + c);
                const fm_v8 qgs = qg * s8;
                memcpy(qs + g * D + c, &qgs, sizeof qgs);
                bias8[g] += qg * z8;
            }
        }
        fm_v8 bias[FM_MAX_GROUP]; /* q.z in lane 0: the row sums include it */
        for (int64_t g = 0; g < G; g++) bias[g] = (fm_v8){hsum8(bias8[g])};
        for (int64_t t = t0; t < t0 + kgroup; t += 2) {
            const int64_t t1 = t + 1 < t0 + kgroup ? t + 1 : t;
            const uint8_t *r0 = codes + t * W, *r1 = codes + t1 * W;
            fm_v8 a0[FM_MAX_GROUP], a1[FM_MAX_GROUP];
            for (int64_t g = 0; g < G; g++) a0[g] = a1[g] = bias[g];
            for (int64_t j = 0; j < W; j += 8) {
                const fm_v8i b0 = load8bytes(r0 + j), b1 = load8bytes(r1 + j); /* every plane's codes */
                for (int plane = 0; plane < 8 / bits; plane++) {
                    const fm_v8 x0 = __builtin_convertvector((b0 >> (bits * plane)) & mask, fm_v8);
                    const fm_v8 x1 = __builtin_convertvector((b1 >> (bits * plane)) & mask, fm_v8);
                    for (int64_t g = 0; g < G; g++) {
                        const fm_v8 qg = load8(qs + g * D + plane * W + j);
                        a0[g] += qg * x0;
                        a1[g] += qg * x1;
                    }
                }
            }
            for (int64_t g = 0; g < G; g++) {
                dots[g][t] = a0[g];
                dots[g][t1] = a1[g];
            }
        }
    }
    sum_dots(dots, G, T, p);
    float alpha[FM_MAX_GROUP];
    softmax_tile(p, G, D, T, state, alpha);
    /* Value scales and zero points [T][groups] fp16 -> float, transposed to [groups][T] */
    float sv[FM_MAX_DIM / 8][FM_MAX_TOKENS], zv[FM_MAX_DIM / 8][FM_MAX_TOKENS];
    for (int64_t t = 0; t < T; t++) {
        for (int64_t vg = 0; vg < groups; vg++) {
            sv[vg][t] = (float)vs[t * groups + vg];
            zv[vg][t] = (float)vz[t * groups + vg];
        }
    }
    const int64_t padded = (T + 7) & ~(int64_t)7; /* p is 0 past T */
    const uint8_t *vcodes = codes + T * W;
    for (int64_t vg = 0; vg < groups; vg++) {
        float wt[FM_MAX_GROUP][FM_MAX_TOKENS], zsum[FM_MAX_GROUP];
        for (int64_t g = 0; g < G; g++) {
            fm_v8 zs = {0};
            for (int64_t t = 0; t < padded; t += 8) {
                const fm_v8 pg = load8(&p[g][t]), w = pg * load8(&sv[vg][t]);
                memcpy(&wt[g][t], &w, sizeof w);
                zs += pg * load8(&zv[vg][t]);
            }
            zsum[g] = hsum8(zs);
        }
        for (int64_t c = vg * vgroup; c < (vg + 1) * vgroup; c += 8) {
            const int shift = bits * (int)(c / W);
            const uint8_t *col = vcodes + c % W;
            /* even and odd rows in separate accumulators: 2 * G multiply-add chains instead of G */
            fm_v8 o[FM_MAX_GROUP], e[FM_MAX_GROUP];
            for (int64_t g = 0; g < G; g++) {
                o[g] = load8(state + g * (D + 2) + c) * alpha[g] + zsum[g];
                e[g] = (fm_v8){0};
            }
            int64_t t = 0;
            for (; t + 1 < T; t += 2) {
                const fm_v8 x0 = load8codes(col + t * W, shift, mask), x1 = load8codes(col + (t + 1) * W, shift, mask);
                for (int64_t g = 0; g < G; g++) {
                    o[g] += wt[g][t] * x0;
                    e[g] += wt[g][t + 1] * x1;
                }
            }
            if (t < T) {
                const fm_v8 x0 = load8codes(col + t * W, shift, mask);
                for (int64_t g = 0; g < G; g++) o[g] += wt[g][t] * x0;
            }
            for (int64_t g = 0; g < G; g++) {
                const fm_v8 sum = o[g] + e[g];
                memcpy(state + g * (D + 2) + c, &sum, sizeof sum);
            }
        }
    }
}

#define FM_QUANT_4(G_, q, D, ...) attend_quant_g(q, G_, D, 4, __VA_ARGS__)
#define FM_QUANT_2(G_, q, D, ...) attend_quant_g(q, G_, D, 2, __VA_ARGS__)

static void attend_quant(const float *q, int64_t G, int64_t D, int bits, const uint8_t *codes, const fm_half *ks,
                         const fm_half *kz, const fm_half *vs, const fm_half *vz, int64_t T, int64_t kgroup,
                         int64_t vgroup, float *state) {
    if (bits == 4) {
        FM_DISPATCH_G(FM_QUANT_4, G, q, D, codes, ks, kz, vs, vz, T, kgroup, vgroup, state)
    } else {
        FM_DISPATCH_G(FM_QUANT_2, G, q, D, codes, ks, kz, vs, vz, T, kgroup, vgroup, state)
    }
}

/* Whether attend_quant takes blocks of this format (otherwise they are dequantized into floats first). */
static int fused_ok(int bits, int64_t bs, int64_t D, int64_t kgroup, int64_t vgroup) {
    return (D * bits / 8) % 8 == 0 && kgroup > 0 && bs % kgroup == 0 && vgroup > 0 && vgroup % 8 == 0 &&
           D % vgroup == 0;
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

/* The record of block i of KV head h (see fm_fold_records). */
static inline const uint8_t *record_at(const uint8_t *storage, int64_t num_slots, int64_t record_bytes,
                                       const int64_t *slots, int64_t slot_stride, const int64_t *table, int64_t h,
                                       int64_t i) {
    const int64_t pos = slots[h * slot_stride + i];
    return storage + (h * num_slots + (table != NULL ? table[pos] : pos)) * record_bytes;
}

/* Fold blocks i0..i1 of each KV head into `state`: block i of head h is slot slots[h * slot_stride + i], or
 * table[slots[h * slot_stride + i]] when a table is given. */
void fm_fold_records(const float *q, int64_t H, int64_t G, int64_t D, const uint8_t *storage,
                     int64_t num_slots, int64_t record_bytes, const int64_t *slots,
                     int64_t slot_stride, const int64_t *table, int64_t i0, int64_t i1, int bits,
                     int64_t bs, int64_t kgroup, int64_t vgroup, int64_t codes_off,
                     int64_t ks_off, int64_t kz_off, int64_t vs_off, int64_t vz_off,
                     float *state) {
    float k[FM_MAX_TOKENS * FM_MAX_DIM], v[FM_MAX_TOKENS * FM_MAX_DIM]; /* formats fused_ok refuses */
    const int fused = bits != 16 && fused_ok(bits, bs, D, kgroup, vgroup);
    for (int64_t h = 0; h < H; h++) {
        for (int64_t i = i0; i < i1; i++) {
            const uint8_t *rec = record_at(storage, num_slots, record_bytes, slots, slot_stride, table, h, i);
            if (i + 1 < i1) { /* the next record's lines are on their way while this one is folded */
                const uint8_t *next = record_at(storage, num_slots, record_bytes, slots, slot_stride, table, h, i + 1);
                for (int64_t b = 0; b < record_bytes; b += 64) __builtin_prefetch(next + b);
            }
            const float *qh = q + h * G * D;
            float *sh = state + h * G * (D + 2);
            if (bits == 16) {
                const fm_half *kv = (const fm_half *)(rec + codes_off);
                attend_tile_f16(qh, G, D, kv, kv + bs * D, D, bs, sh);
            } else if (fused) {
                attend_quant(qh, G, D, bits, rec + codes_off, (const fm_half *)(rec + ks_off),
                             (const fm_half *)(rec + kz_off), (const fm_half *)(rec + vs_off),
                             (const fm_half *)(rec + vz_off), bs, kgroup, vgroup, sh);
            } else {
                const int64_t W = D * bits / 8;
                dequantize_keys(rec + codes_off, (const fm_half *)(rec + ks_off), (const fm_half *)(rec + kz_off),
                                bits, bs, D, kgroup, k);
                dequantize_values(rec + codes_off + bs * W, (const fm_half *)(rec + vs_off),
                                  (const fm_half *)(rec + vz_off), bits, bs, D, vgroup, v);
                attend_tile(qh, G, D, k, v, D, bs, sh);
            }
        }
    }
}

/* state <- the online-softmax merge of state and other (both [H * G][D + 2]): rescale both to the larger max. */
void fm_merge_states(float *state, const float *other, int64_t rows, int64_t D) {
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
        fm_fold_records(q, H, G, D, storage, num_slots, record_bytes, slots, slot_stride, table, 0,
                        n, bits, bs, kgroup, vgroup, codes_off, ks_off, kz_off, vs_off, vz_off,
                        state);
        free(partial);
        return 0;
    }
    const int64_t size = H * G * (D + 2);
    for (int64_t e = 0; e < (threads - 1) * size; e++)
        partial[e] = (e % (D + 2) == D) ? -FLT_MAX : 0.0f; /* acc = 0, m = -FLT_MAX, l = 0 */
    /* Chunks of FM_MIN_BLOCKS_PER_THREAD blocks dealt round-robin (static): thread t folds chunks t, t + threads,
     * ... in order into its own state, and the states merge in thread order, so a step's result is the same bits
     * on every run with the same thread count. (Dynamic scheduling balanced a thread that lost its core on a shared
     * machine, but made the float sums' order, and so the logits' last bits, vary from run to run.) */
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
#pragma omp for schedule(static, 1)
        for (int64_t c = 0; c < num_chunks; c++) {
            const int64_t i0 = c * FM_MIN_BLOCKS_PER_THREAD;
            const int64_t i1 = i0 + FM_MIN_BLOCKS_PER_THREAD < n ? i0 + FM_MIN_BLOCKS_PER_THREAD : n;
            fm_fold_records(q, H, G, D, storage, num_slots, record_bytes, slots, slot_stride,
                            table, i0, i1, bits, bs, kgroup, vgroup, codes_off, ks_off, kz_off,
                            vs_off, vz_off, mine);
        }
    }
    for (int t = 1; t < used; t++) fm_merge_states(state, partial + (t - 1) * size, H * G, D);
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
            attend_tile(q + h * G * D, G, D, k + (h * m + t0) * D, v + (h * m + t0) * D, D, T,
                        state + h * G * (D + 2));
        }
    }
    return 0;
}

/* Fold dense fp16 keys and values into the state: row t of head h at k + h * head_stride + t * row_stride (the
 * same for v; channels contiguous), e.g. a strided view of the still-filling block, read without a float copy. */
int fm_attend_dense_f16(const float *q, int64_t H, int64_t G, int64_t D, const fm_half *k, const fm_half *v,
                        int64_t m, int64_t head_stride, int64_t row_stride, float *state) {
    if (D > FM_MAX_DIM || D % 8 || G > FM_MAX_GROUP) return -1;
    for (int64_t h = 0; h < H; h++) {
        for (int64_t t0 = 0; t0 < m; t0 += FM_MAX_TOKENS) {
            const int64_t T = m - t0 < FM_MAX_TOKENS ? m - t0 : FM_MAX_TOKENS;
            const int64_t at = h * head_stride + t0 * row_stride;
            attend_tile_f16(q + h * G * D, G, D, k + at, v + at, row_stride, T, state + h * G * (D + 2));
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
