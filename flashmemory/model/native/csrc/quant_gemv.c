/* Weights kept in their GGUF block formats: decode GEMV (a few rows of x) straight from the blocks, and
 * dequantization of chosen rows into float32 (embedding lookups, prefill tiles for torch's GEMM).
 *
 * Block layouts are the GGUF file format (type ids as in the file), per row of `cols` weights:
 *   Q4_0 (2)  32 weights, 18 bytes: fp16 d, 16 bytes of nibbles           w = d * (q - 8)
 *   Q4_1 (3)  32 weights, 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles   w = d * q + m
 *   Q5_0 (6)  32 weights, 22 bytes: fp16 d, 4 bytes fifth bits, nibbles   w = d * (q - 16)
 *   Q5_1 (7)  32 weights, 24 bytes: fp16 d, fp16 m, fifth bits, nibbles   w = d * q + m
 *   Q8_0 (8)  32 weights, 34 bytes: fp16 d, 32 x int8                     w = d * q
 *   Q2_K (10) 256 weights, 84 bytes: 16 bytes of 4-bit scale | 4-bit min per 16 weights, 64 bytes of 2-bit codes,
 *             fp16 d, fp16 dmin; weight 32 j + l of each 128-half is bits 2j of byte l of its 32   w = d * sc * q - dmin * mn
 *   Q3_K (11) 256 weights, 110 bytes: 32 bytes of third bits (hmask), 64 bytes of 2-bit codes as Q2_K's, 12 bytes
 *             of 16 6-bit scales, fp16 d; weight 32 j + l of half h has its third bit at bit 4h + j of hmask[l]
 *             w = d * (sc - 32) * ((q | third << 2) - 4)
 *   Q4_K (12) 256 weights, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins for 8 sub-blocks of 32,
 *             128 bytes of nibbles (64 weights per 32 bytes: low halves first)  w = d * sc * q - dmin * mn
 *   Q5_K (13) 256 weights, 176 bytes: fp16 d, fp16 dmin, Q4_K's 12 bytes of scales/mins, 32 bytes of fifth bits,
 *             128 bytes of nibbles as Q4_K's; weight l of sub-block j has its fifth bit in bit j of byte l
 *             w = d * sc * (q | fifth << 4) - dmin * mn
 *   Q6_K (14) 256 weights, 210 bytes: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, fp16 d
 *             w = d * sc * (q - 32)
 *   IQ4_NL (20) 32 weights, 18 bytes: fp16 d, 16 bytes of nibbles         w = d * IQ4[q]
 *   IQ4_XS (23) 256 weights, 136 bytes: fp16 d, 16 bits of high scale bits, 4 bytes of low scale nibbles,
 *             128 bytes of nibbles (16 per sub-block of 32)             w = d * (ls - 32) * IQ4[q]
 *             (ls of sub-block j: nibble j of the low bytes | bits 2j, 2j+1 of the high word << 4)
 *   F16 (1) / BF16 (30) unquantized, 2 bytes a weight, read in blocks of 32 (64 bytes)
 *   IQ4[16] is the non-linear code book below (llama.cpp's kvalues_iq4nl).
 * Nibbles of the 32-weight formats (IQ4_XS's sub-blocks too): byte j holds weight j (low half) and weight j + 16 (high half).
 *
 * The dequantized weights are exactly the float32 values the torch reference (gguf_dequant.py, gguf.quants)
 * produces; the GEMV only reorders the sums (float summation error against a float32 GEMV).
 * The one-row dot products of Q4_0 / Q4_1 / Q5_0 / Q8_0 use AVX2 + FMA + F16C intrinsics where the compiler targets
 * them, portable C elsewhere; the other paths are GCC vector extensions (AVX2 under -march=native, scalar
 * code elsewhere).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_formats.h"
#include "row_chunks.h"

#define FM_MAX_X 8 /* rows of x per GEMV call */
#define FM_QK_MAX 256

typedef float fm_v8 __attribute__((vector_size(32)));

static inline fm_v8 load8(const float *p) {
    fm_v8 r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline float hsum8(fm_v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* ---- dequantization of one block (the reference arithmetic, written so the compiler vectorizes it) ---- */

static void deq_q4_0(const uint8_t *b, float *y) {
    const float d = half_to_float(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b[2 + j] & 0x0F) - 8);
        y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
    }
}

static void deq_f16(const uint8_t *b, float *y) {
    for (int j = 0; j < 32; j++) y[j] = half_to_float(b + 2 * j);
}

static void deq_bf16(const uint8_t *b, float *y) {
    for (int j = 0; j < 32; j++) y[j] = bf16_to_float(b + 2 * j);
}

static void deq_q4_1(const uint8_t *b, float *y) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(b[4 + j] & 0x0F) + m;
        y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
    }
}

static void deq_q5_0(const uint8_t *b, float *y) {
    const float d = half_to_float(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; j++) {
        const int lo = (b[6 + j] & 0x0F) | (((qh >> j) & 1) << 4);
        const int hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = d * (float)(lo - 16);
        y[j + 16] = d * (float)(hi - 16);
    }
}

static void deq_q5_1(const uint8_t *b, float *y) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int j = 0; j < 16; j++) {
        const int lo = (b[8 + j] & 0x0F) | (((qh >> j) & 1) << 4);
        const int hi = (b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = d * (float)lo + m;
        y[j + 16] = d * (float)hi + m;
    }
}

static void deq_q8_0(const uint8_t *b, float *y) {
    const float d = half_to_float(b);
    for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[2 + j];
}

/* Q4_K, and Q5_K when qh (its fifth bits) is given: codes in q, 64 weights (two sub-blocks) per 32 bytes */
static inline void deq_k4(const uint8_t *b, const uint8_t *qh, const uint8_t *q, float *y) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    for (int pair = 0; pair < 4; pair++) {
        int sc0, m0, sc1, m1;
        q4k_scale_min(2 * pair, b + 4, &sc0, &m0);
        q4k_scale_min(2 * pair + 1, b + 4, &sc1, &m1);
        const float d0 = d * (float)sc0, min0 = dmin * (float)m0, d1 = d * (float)sc1, min1 = dmin * (float)m1;
        for (int l = 0; l < 32; l++) {
            const int hi0 = qh ? ((qh[l] >> (2 * pair)) & 1) << 4 : 0;
            const int hi1 = qh ? ((qh[l] >> (2 * pair + 1)) & 1) << 4 : 0;
            y[l] = d0 * (float)((q[l] & 0x0F) | hi0) - min0;
            y[l + 32] = d1 * (float)((q[l] >> 4) | hi1) - min1;
        }
        y += 64;
        q += 32;
    }
}

static void deq_q4_k(const uint8_t *b, float *y) { deq_k4(b, NULL, b + 16, y); }

static void deq_q5_k(const uint8_t *b, float *y) { deq_k4(b, b + 16, b + 48, y); }

static void deq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half_to_float(b + 208);
    for (int half = 0; half < 2; half++) {
        for (int run = 0; run < 2; run++) { /* 16 weights of each quarter share one scale */
            const float s1 = d * (float)sc[run], s2 = d * (float)sc[run + 2], s3 = d * (float)sc[run + 4],
                        s4 = d * (float)sc[run + 6];
            for (int l = 16 * run; l < 16 * run + 16; l++) {
                const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = s1 * (float)q1;
                y[l + 32] = s2 * (float)q2;
                y[l + 64] = s3 * (float)q3;
                y[l + 96] = s4 * (float)q4;
            }
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

static void deq_q2_k(const uint8_t *b, float *y) {
    const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
    for (int h = 0; h < 2; h++) {
        const uint8_t *q = b + 16 + 32 * h;
        for (int j = 0; j < 4; j++) {
            for (int half = 0; half < 2; half++) {
                const uint8_t sc = b[8 * h + 2 * j + half];
                const float dl = d * (float)(sc & 0x0F), ml = dmin * (float)(sc >> 4);
                for (int l = 0; l < 16; l++) *y++ = dl * (float)((q[16 * half + l] >> (2 * j)) & 3) - ml;
            }
        }
    }
}

static void deq_q3_k(const uint8_t *b, float *y) {
    int8_t sc[16];
    q3k_scales(b + 96, sc);
    const float d = half_to_float(b + 108);
    const uint8_t *hm = b;
    for (int h = 0; h < 2; h++) {
        const uint8_t *q = b + 32 + 32 * h;
        for (int j = 0; j < 4; j++) {
            for (int half = 0; half < 2; half++) {
                const float dl = d * (float)(sc[8 * h + 2 * j + half] - 32);
                for (int l = 16 * half; l < 16 * half + 16; l++) {
                    const int code = ((q[l] >> (2 * j)) & 3) | (((hm[l] >> (4 * h + j)) & 1) << 2);
                    *y++ = dl * (float)(code - 4);
                }
            }
        }
    }
}

static void deq_iq4_nl(const uint8_t *b, float *y) {
    const float d = half_to_float(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)IQ4[b[2 + j] & 0x0F];
        y[j + 16] = d * (float)IQ4[b[2 + j] >> 4];
    }
}

static void deq_iq4_xs(const uint8_t *b, float *y) {
    const float d = half_to_float(b);
    for (int j = 0; j < 8; j++, y += 32) {
        const float dl = d * (float)iq4xs_scale(b, j);
        const uint8_t *q = b + 8 + 16 * j;
        for (int l = 0; l < 16; l++) {
            y[l] = dl * (float)IQ4[q[l] & 0x0F];
            y[l + 16] = dl * (float)IQ4[q[l] >> 4];
        }
    }
}

typedef void (*deq_fn)(const uint8_t *, float *);

static int format_of(int type, deq_fn *fn, int *qk, int *block_bytes) {
    switch (type) {
    case FM_Q4_0: *fn = deq_q4_0; break;
    case FM_Q4_1: *fn = deq_q4_1; break;
    case FM_Q5_0: *fn = deq_q5_0; break;
    case FM_Q5_1: *fn = deq_q5_1; break;
    case FM_Q8_0: *fn = deq_q8_0; break;
    case FM_Q2_K: *fn = deq_q2_k; break;
    case FM_Q3_K: *fn = deq_q3_k; break;
    case FM_Q4_K: *fn = deq_q4_k; break;
    case FM_Q5_K: *fn = deq_q5_k; break;
    case FM_Q6_K: *fn = deq_q6_k; break;
    case FM_IQ4_NL: *fn = deq_iq4_nl; break;
    case FM_IQ4_XS: *fn = deq_iq4_xs; break;
    case FM_F16: *fn = deq_f16; break;
    case FM_BF16: *fn = deq_bf16; break;
    default: return -1;
    }
    *qk = fm_block_weights(type), *block_bytes = fm_block_bytes(type);
    return 0;
}

/* ---- one-row dot products without a float copy of the block (the decode hot path) ----
 * Each block's integer codes are widened to float lanes and multiplied with x; the block scale is applied to
 * the block's partial sum (d * sum(q * x) rather than sum((d * q) * x): a reordering of the same sum). */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

static inline __m256 widen_u8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); } /* low 8 bytes */
static inline __m256 widen_s8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
static inline __m128i high8(__m128i v) { return _mm_unpackhi_epi64(v, v); }
static inline float half_at(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* sum over the block of q * x for 32 codes given as two 16-byte halves (weights 0..15, 16..31) */
static inline __m256 block_dot(__m256 c0, __m256 c1, __m256 c2, __m256 c3, const float *x) {
    __m256 s = _mm256_mul_ps(c0, _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(c1, _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(c2, _mm256_loadu_ps(x + 16), s);
    return _mm256_fmadd_ps(c3, _mm256_loadu_ps(x + 24), s);
}

/* Each dot keeps two accumulators (even and odd blocks): one chain of multiply-adds per block would bound the
 * loop by the FMA latency rather than its throughput. */
static inline __m256 q4_1_block(const uint8_t *w, const float *x) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128((const __m128i *)(w + 4));
    const __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
    return block_dot(widen_u8(lo), widen_u8(high8(lo)), widen_u8(hi), widen_u8(high8(hi)), x);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* AVX-512: a block's 16 low and 16 high nibbles each widened to 16 float lanes at once */
typedef __m512 q4_1_sums;
static inline q4_1_sums q4_1_dot_block(const uint8_t *w, const float *x) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128((const __m128i *)(w + 4));
    const __m128i hi4 = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low4)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi4));
    return _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(x)));
}
static inline q4_1_sums q4_1_zero(void) { return _mm512_setzero_ps(); }
static inline q4_1_sums q4_1_scaled(float d, q4_1_sums v, q4_1_sums acc) {
    return _mm512_fmadd_ps(_mm512_set1_ps(d), v, acc);
}
static inline float q4_1_total(q4_1_sums a, q4_1_sums b) {
    return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}
#else
typedef __m256 q4_1_sums;
static inline q4_1_sums q4_1_dot_block(const uint8_t *w, const float *x) {
    return q4_1_block(w, x);
}
static inline q4_1_sums q4_1_zero(void) { return _mm256_setzero_ps(); }
static inline q4_1_sums q4_1_scaled(float d, q4_1_sums v, q4_1_sums acc) {
    return _mm256_fmadd_ps(_mm256_set1_ps(d), v, acc);
}
static inline float q4_1_total(q4_1_sums a, q4_1_sums b) { return hsum256(_mm256_add_ps(a, b)); }
#endif

/* One loop for either width: the block's lanes, its scale, its min times x's block sum (xsum). */
static float dot_q4_1(const uint8_t *w, int64_t nb, const float *x, const float *xsum) {
    q4_1_sums acc0 = q4_1_zero(), acc1 = q4_1_zero();
    float bias0 = 0.0f, bias1 = 0.0f;
    int64_t i = 0;
    for (; i + 1 < nb; i += 2, w += 40, x += 64) {
        acc0 = q4_1_scaled(half_at(w), q4_1_dot_block(w, x), acc0);
        acc1 = q4_1_scaled(half_at(w + 20), q4_1_dot_block(w + 20, x + 32), acc1);
        bias0 += half_at(w + 2) * xsum[i];
        bias1 += half_at(w + 22) * xsum[i + 1];
    }
    if (i < nb) {
        acc0 = q4_1_scaled(half_at(w), q4_1_dot_block(w, x), acc0);
        bias0 += half_at(w + 2) * xsum[i];
    }
    return q4_1_total(acc0, acc1) + (bias0 + bias1);
}

/* Blocks that are an fp16 scale then codes: sum of scale * (codes . x) over nb blocks, two blocks a round in two
 * accumulators. `block` is a compile-time constant at every call, so it is inlined. */
static inline float dot_scaled_blocks(const uint8_t *w, int64_t nb, const float *x, int64_t block_bytes,
                                      __m256 (*block)(const uint8_t *, const float *)) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 1 < nb; i += 2, w += 2 * block_bytes, x += 64) {
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half_at(w)), block(w, x), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(half_at(w + block_bytes)), block(w + block_bytes, x + 32), acc1);
    }
    if (i < nb) acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half_at(w)), block(w, x), acc0);
    return hsum256(_mm256_add_ps(acc0, acc1));
}

static inline __m256 q4_0_block(const uint8_t *w, const float *x) {
    const __m128i low4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i q = _mm_loadu_si128((const __m128i *)(w + 2));
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, low4), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low4), eight);
    return block_dot(widen_s8(lo), widen_s8(high8(lo)), widen_s8(hi), widen_s8(high8(hi)), x);
}

static float dot_q4_0(const uint8_t *w, int64_t nb, const float *x) {
    return dot_scaled_blocks(w, nb, x, 18, q4_0_block);
}

static inline __m256 q8_0_block(const uint8_t *w, const float *x) {
    const __m128i a = _mm_loadu_si128((const __m128i *)(w + 2)), b = _mm_loadu_si128((const __m128i *)(w + 18));
    return block_dot(widen_s8(a), widen_s8(high8(a)), widen_s8(b), widen_s8(high8(b)), x);
}

static float dot_q8_0(const uint8_t *w, int64_t nb, const float *x) {
    return dot_scaled_blocks(w, nb, x, 34, q8_0_block);
}
/* Q5_0: the fifth bits (bit j of the 32-bit word: weight j) spread to bytes by a shuffle and a bit test. */
static inline __m256 q5_0_block(const uint8_t *w, const float *x) {
    const __m128i low4 = _mm_set1_epi8(0x0F), sixteen = _mm_set1_epi8(16);
    const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    uint32_t qh;
    memcpy(&qh, w + 2, 4);
    const __m128i h = _mm_set1_epi32((int)qh);
    const __m128i set_lo = _mm_cmpeq_epi8(_mm_and_si128(_mm_shuffle_epi8(h, _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1,
                                          1, 1, 1, 1, 1, 1)), bit), bit);
    const __m128i set_hi = _mm_cmpeq_epi8(_mm_and_si128(_mm_shuffle_epi8(h, _mm_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3)), bit), bit);
    const __m128i q = _mm_loadu_si128((const __m128i *)(w + 6));
    /* code - 16 = nibble - 16 where the fifth bit is clear, nibble where it is set */
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, low4), _mm_andnot_si128(set_lo, sixteen));
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low4), _mm_andnot_si128(set_hi, sixteen));
    return block_dot(widen_s8(lo), widen_s8(high8(lo)), widen_s8(hi), widen_s8(high8(hi)), x);
}

static float dot_q5_0(const uint8_t *w, int64_t nb, const float *x) {
    return dot_scaled_blocks(w, nb, x, 22, q5_0_block);
}

/* F16 / BF16: 32 weights widened to float per block, four accumulators (memory-bound) */
static inline __m256 widen_bf16(const uint8_t *p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
static inline __m256 widen_f16(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#define FM_DOT_FLOAT16(name, widen)                                                              \
    static float name(const uint8_t *w, int64_t nb, const float *x) {                            \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                               \
        for (int64_t i = 0; i < nb; i++, w += 64, x += 32) {                                     \
            a0 = _mm256_fmadd_ps(widen(w), _mm256_loadu_ps(x), a0);                              \
            a1 = _mm256_fmadd_ps(widen(w + 16), _mm256_loadu_ps(x + 8), a1);                     \
            a2 = _mm256_fmadd_ps(widen(w + 32), _mm256_loadu_ps(x + 16), a2);                    \
            a3 = _mm256_fmadd_ps(widen(w + 48), _mm256_loadu_ps(x + 24), a3);                    \
        }                                                                                        \
        return hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));             \
    }
FM_DOT_FLOAT16(dot_f16, widen_f16)
FM_DOT_FLOAT16(dot_bf16, widen_bf16)
#else
/* Portable: the same sums, one weight at a time. */
static float dot_q4_1(const uint8_t *w, int64_t nb, const float *x, const float *xsum) {
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++, w += 20, x += 32) {
        float s = 0.0f;
        for (int j = 0; j < 16; j++) s += (float)(w[4 + j] & 0x0F) * x[j] + (float)(w[4 + j] >> 4) * x[j + 16];
        acc += half_to_float(w) * s + half_to_float(w + 2) * xsum[i];
    }
    return acc;
}

static float dot_q4_0(const uint8_t *w, int64_t nb, const float *x) {
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++, w += 18, x += 32) {
        float s = 0.0f;
        for (int j = 0; j < 16; j++)
            s += (float)((w[2 + j] & 0x0F) - 8) * x[j] + (float)((w[2 + j] >> 4) - 8) * x[j + 16];
        acc += half_to_float(w) * s;
    }
    return acc;
}

static float dot_q8_0(const uint8_t *w, int64_t nb, const float *x) {
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++, w += 34, x += 32) {
        float s = 0.0f;
        for (int j = 0; j < 32; j++) s += (float)(int8_t)w[2 + j] * x[j];
        acc += half_to_float(w) * s;
    }
    return acc;
}
static float dot_q5_0(const uint8_t *w, int64_t nb, const float *x) {
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++, w += 22, x += 32) {
        uint32_t qh;
        memcpy(&qh, w + 2, 4);
        float s = 0.0f;
        for (int j = 0; j < 16; j++) {  /* as int: qh is unsigned, and code - 16 may be negative */
            const int lo = (w[6 + j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            const int hi = (w[6 + j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            s += (float)(lo - 16) * x[j];
            s += (float)(hi - 16) * x[j + 16];
        }
        acc += half_to_float(w) * s;
    }
    return acc;
}

static float dot_f16(const uint8_t *w, int64_t nb, const float *x) {
    float acc = 0.0f;
    for (int64_t c = 0; c < nb * 32; c++) acc += half_to_float(w + 2 * c) * x[c];
    return acc;
}

static float dot_bf16(const uint8_t *w, int64_t nb, const float *x) {
    float acc = 0.0f;
    for (int64_t c = 0; c < nb * 32; c++) acc += bf16_to_float(w + 2 * c) * x[c];
    return acc;
}
#endif

/* Any format: dequantize the block into L1, then dot (used for several rows of x and the other formats). */
static void dot_generic(deq_fn deq, int qk, int block_bytes, const uint8_t *w, int64_t nb, const float *x,
                        int64_t num_x, int64_t x_stride, float *out) {
    float buf[FM_QK_MAX] __attribute__((aligned(32)));
    fm_v8 acc[FM_MAX_X];
    for (int64_t r = 0; r < num_x; r++) acc[r] = (fm_v8){0};
    for (int64_t i = 0; i < nb; i++, w += block_bytes) {
        deq(w, buf);
        for (int64_t r = 0; r < num_x; r++) {
            const float *xr = x + r * x_stride + i * qk;
            fm_v8 s = {0};
            for (int c = 0; c < qk; c += 8) s += load8(buf + c) * load8(xr + c);
            acc[r] += s;
        }
    }
    for (int64_t r = 0; r < num_x; r++) out[r] = hsum8(acc[r]);
}

/* y[r][row] = sum_c W[row][c] * x[r][c] for r < num_x (<= FM_MAX_X); W is [rows][row_bytes] blocks.
 * Returns 0, or -1 for an unknown format, -2 for a shape the kernel does not take. */
int fm_qgemv(int type, const uint8_t *w, int64_t rows, int64_t cols, int64_t row_bytes, const float *x,
             int64_t num_x, int64_t x_stride, float *y, int64_t y_stride, int num_threads) {
    deq_fn deq;
    int qk, block_bytes;
    if (format_of(type, &deq, &qk, &block_bytes) != 0) return -1;
    if (num_x < 1 || num_x > FM_MAX_X || cols % qk != 0 || row_bytes != cols / qk * block_bytes) return -2;
    const int64_t nb = cols / qk;
    /* The formats with a one-row kernel use it for every row of x, each weight row still read from
     * memory once (it stays in L1 across x's rows): row r of y is then the same float32 bits
     * whatever num_x is, so a speculative verification of several tokens computes what their
     * decode steps compute one at a time. */
    const int one_row = type == FM_Q4_1 || type == FM_Q4_0 || type == FM_Q8_0 || type == FM_Q5_0
                        || fm_is_float_format(type);
    float *xsum = NULL;
    if (type == FM_Q4_1) {
        xsum = malloc(sizeof(float) * nb * num_x);
        if (xsum == NULL) return -3;
        for (int64_t r = 0; r < num_x; r++) {
            for (int64_t i = 0; i < nb; i++) {
                float s = 0.0f;
                for (int c = 0; c < 32; c++) s += x[r * x_stride + i * 32 + c];
                xsum[r * nb + i] = s;
            }
        }
    }
    /* Dynamic chunks of contiguous rows (row_chunks.h) */
    const int64_t chunk = fm_row_chunk(rows, num_threads);
#pragma omp parallel for schedule(dynamic, chunk) num_threads(num_threads) if (rows * cols >= 65536)
    for (int64_t row = 0; row < rows; row++) {
        const uint8_t *wr = w + row * row_bytes;
        if (one_row) {
            for (int64_t r = 0; r < num_x; r++) {
                const float *xr = x + r * x_stride;
                float *yr = y + r * y_stride + row;
                if (type == FM_Q4_1) *yr = dot_q4_1(wr, nb, xr, xsum + r * nb);
                else if (type == FM_Q4_0) *yr = dot_q4_0(wr, nb, xr);
                else if (type == FM_Q8_0) *yr = dot_q8_0(wr, nb, xr);
                else if (type == FM_F16) *yr = dot_f16(wr, nb, xr);
                else if (type == FM_BF16) *yr = dot_bf16(wr, nb, xr);
                else *yr = dot_q5_0(wr, nb, xr);
            }
        } else {
            float out[FM_MAX_X];
            dot_generic(deq, qk, block_bytes, wr, nb, x, num_x, x_stride, out);
            for (int64_t r = 0; r < num_x; r++) y[r * y_stride + row] = out[r];
        }
    }
    free(xsum);
    return 0;
}

/* out[i][:] = dequantized row row_ids[i] (or row first_row + i when row_ids is NULL), float32 [num_rows][cols]. */
int fm_dequant_rows(int type, const uint8_t *w, int64_t cols, int64_t row_bytes, const int64_t *row_ids,
                    int64_t first_row, int64_t num_rows, float *out, int num_threads) {
    deq_fn deq;
    int qk, block_bytes;
    if (format_of(type, &deq, &qk, &block_bytes) != 0) return -1;
    if (cols % qk != 0 || row_bytes != cols / qk * block_bytes) return -2;
    const int64_t nb = cols / qk;
    const int64_t chunk = fm_row_chunk(num_rows, num_threads);
#pragma omp parallel for schedule(dynamic, chunk) num_threads(num_threads) \
    if (num_rows * cols >= 65536)
    for (int64_t i = 0; i < num_rows; i++) {
        const uint8_t *wr = w + (row_ids ? row_ids[i] : first_row + i) * row_bytes;
        for (int64_t b = 0; b < nb; b++) deq(wr + b * block_bytes, out + i * cols + b * qk);
    }
    return 0;
}
