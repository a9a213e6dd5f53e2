/* Decode GEMV with 8-bit activations (what llama.cpp does on a CPU): each row of x is quantized
 * once per call, then each weight block's integer codes are dotted with x's codes in 8- and 16-bit
 * integer lanes (AVX2 vpmaddubsw, AVX-512 VNNI vpdpbusd), a float multiply-add per 32 weights.
 * fm_round_x8 rounds prefill rows the same way in place, so torch's GEMM over them computes what
 * this GEMV computes. Which formats take this path is the caller's choice (decode_activations;
 * model/native/quant_kernels.py int8_for).
 *
 * x is rounded per 32 values (a float scale d = max|x| / 127 and 32 int8 codes) and laid out two
 * ways (fm_x8_layout says which a format reads; one buffer holds both, fm_x8_bytes):
 *   blocks       per 32: d, the codes and their sums over each half (fm_x8): the 32-weight formats
 *   super-blocks per 256: the 8 scales, the 16 half sums times their scale, the 256 codes (fm_xk):
 *                the K-quants and IQ4_XS, whose sub-block products are scaled by the weights'
 *                integer scales in 32-bit lanes, x's scales and the offsets applied as vectors
 * One scale per 256 values (llama.cpp's Q8_K: the x scale applied once per super-block) ran these
 * kernels at about the same speed but moved Qwen2.5-Coder-1.5B's logits 6x as far from the float32
 * x's (mean KL 4.7e-3 against 7.9e-4, docs/decode_speed.md): the rounding stays per 32.
 *
 * Formats and their offsets (the weight block layouts are quant_gemv.c's):
 *   Q4_0 / Q5_0   w = d * (q - 8 | 16)   unsigned codes q
 *   Q4_1 / Q5_1   w = d * q + m
 *   Q8_0          w = d * q               signed codes (the sign trick: |q| . sign(x, q))
 *   Q4_K / Q5_K   w = d * sc * q - dmin * mn, a scale and a min per sub-block of 32
 *   Q6_K          w = d * sc * (q - 32), a scale per 16
 *   Q3_K          w = d * (sc - 32) * (q - 4), a scale per 16; Q2_K  w = d * sc * q - dmin * mn, per 16
 *   IQ4_NL/IQ4_XS w = d (* (ls - 32)) * IQ4[q]: the code book looked up into signed bytes (vpshufb)
 * Every offset (-8, m, -dmin * mn, -32) multiplies the sum of x's codes, not of x itself: the error is then
 * sum_c w[c] * (x'[c] - x[c]) for the rounded x', as small as 8-bit x allows (the float sum would leave
 * sum_c d * q[c] * (x'[c] - x[c]), 3-4x that for Q4_K's all-positive codes, as measured).
 * The result differs from the float32 dot by x's rounding to 8 bits (about 0.4 % of max|x| per 32
 * values): not bit-equal to the torch reference, as llama.cpp's is not; quant_gemv.c's float path
 * stays the reference.
 * Row r of y does not depend on how many rows of x one call takes (each row has its own accumulators), so a
 * speculative verification computes what the decode steps compute one at a time.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "block_formats.h"
#include "row_chunks.h"

#define FM_MAX_X 8


typedef struct {
    float d;          /* x ~ d * q */
    int16_t qsum[2];  /* sums of q over values 0..15 and 16..31 */
    int8_t q[32];
} fm_x8;              /* 40 bytes */

typedef struct {
    float d[8];         /* x ~ d[j] * q over values 32 j .. 32 j + 31 */
    float dsum[16];     /* d[k / 2] * the sum of q over values 16 k .. 16 k + 15 */
    int8_t q[256];
} fm_xk;                /* 352 bytes */

/* Bits of fm_quantize_x8's `layouts`, and the layout a format's 8-bit GEMV reads: blocks of 32 for
 * the 32-weight formats, super-blocks of 256 for the others. */
enum { FM_X8_BLOCKS = 1, FM_X8_SUPER = 2 };

int fm_x8_layout(int type) { return fm_block_weights(type) == 256 ? FM_X8_SUPER : FM_X8_BLOCKS; }

/* Bytes of num_x rows of cols values in both layouts: [num_x][cols / 32] fm_x8, then (cols a
 * multiple of 256) [num_x][cols / 256] fm_xk. */
int64_t fm_x8_bytes(int64_t num_x, int64_t cols) {
    const int64_t blocks = num_x * (cols / 32) * (int64_t)sizeof(fm_x8);
    return blocks + (cols % 256 == 0 ? num_x * (cols / 256) * (int64_t)sizeof(fm_xk) : 0);
}

static inline const fm_xk *xk_area(const void *xq, int64_t num_x, int64_t cols) {
    return (const fm_xk *)((const char *)xq + num_x * (cols / 32) * (int64_t)sizeof(fm_x8));
}

/* 1 where the dots below are AVX2 (faster than the float path), 0 for the portable C (slower than it). */
int fm_x8_vectorized(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* The instruction sets this build's kernels use (the compiler's target): 2 AVX-512 (with VNNI for
 * the integer dots where the CPU has it), 1 AVX2 + FMA, 0 portable C. */
int fm_kernel_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* One block of 32 values rounded: the scale d and the codes (the one rule of every entry point). */
static inline float round_block(const float *v, int8_t *q) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[j]));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < 32; j++) {
        const int c = (int)nearbyintf(v[j] * id);
        q[j] = (int8_t)(c > 127 ? 127 : c < -127 ? -127 : c);
    }
    return amax / 127.0f;
}

static inline int code_sum16(const int8_t *q) {
    int s = 0;
    for (int j = 0; j < 16; j++) s += q[j];
    return s;
}

/* xq (fm_x8_bytes) for r < num_x, in the layouts `layouts` names (FM_X8_SUPER only where cols is a
 * multiple of 256). */
void fm_quantize_x8(const float *x, int64_t num_x, int64_t x_stride, int64_t cols, void *xq,
                    int layouts) {
    const int64_t nb = cols / 32;
    if (layouts & FM_X8_BLOCKS) {
        for (int64_t r = 0; r < num_x; r++) {
            for (int64_t b = 0; b < nb; b++) {
                fm_x8 *o = (fm_x8 *)xq + r * nb + b;
                o->d = round_block(x + r * x_stride + b * 32, o->q);
                o->qsum[0] = (int16_t)code_sum16(o->q), o->qsum[1] = (int16_t)code_sum16(o->q + 16);
            }
        }
    }
    if ((layouts & FM_X8_SUPER) && cols % 256 == 0) {
        fm_xk *area = (fm_xk *)xk_area(xq, num_x, cols);
        for (int64_t r = 0; r < num_x; r++) {
            for (int64_t b = 0; b < nb; b++) {
                fm_xk *o = area + r * (nb / 8) + b / 8;
                const int j = (int)(b % 8);
                o->d[j] = round_block(x + r * x_stride + b * 32, o->q + 32 * j);
                o->dsum[2 * j] = o->d[j] * (float)code_sum16(o->q + 32 * j);
                o->dsum[2 * j + 1] = o->d[j] * (float)code_sum16(o->q + 32 * j + 16);
            }
        }
    }
}

/* x [num_rows][cols] replaced in place by what the 8-bit GEMV sees of it (d * code per value): the prefill
 * path's GEMM over these rows then computes what the GEMV computes, to float summation order, so a
 * token's numbers do not depend on whether it came in a chunk of a few rows or of many. */
void fm_round_x8(float *x, int64_t num_rows, int64_t x_stride, int64_t cols, int num_threads) {
    const int64_t nb = cols / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows * cols >= 65536)
    for (int64_t r = 0; r < num_rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            float *v = x + r * x_stride + b * 32;
            int8_t q[32];
            const float d = round_block(v, q);
            for (int j = 0; j < 32; j++) v[j] = d * (float)q[j];
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

typedef __m256i codes32; /* 32 unsigned (or, for Q8_0, signed) weight codes, in weight order */

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 8 int32 lanes of sum(code * xq) over 4 weights each (lanes 0-3: weights 0..15, 4-7: 16..31),
 * as float: unsigned codes times signed x. With AVX-512 VNNI one vpdpbusd; with AVX2 vpmaddubsw
 * (pairs to int16: at most 2 * 128 * 127, no format saturates) then vpmaddwd: the same sums. */
static inline __m256i products_u8(__m256i c, __m256i xv) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, xv);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(c, xv), _mm256_set1_epi16(1));
#endif
}

static inline __m256 dot_u8(codes32 c, const int8_t *xq) {
    return _mm256_cvtepi32_ps(products_u8(c, _mm256_loadu_si256((const __m256i *)xq)));
}

/* signed codes: |code| . (x with code's sign) */
static inline __m256 dot_s8(codes32 c, const int8_t *xq) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
    return _mm256_cvtepi32_ps(products_u8(_mm256_sign_epi8(c, c), _mm256_sign_epi8(xv, c)));
}

/* 16 nibble bytes (weight j low, j + 16 high) as 32 codes in weight order */
static inline codes32 nibbles32(const uint8_t *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q), m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* 16 nibble bytes as 32 signed IQ4 code-book values in weight order */
static inline codes32 iq4_values(const uint8_t *q) {
    const __m256i book = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4));
    return _mm256_shuffle_epi8(book, nibbles32(q));
}

/* Q5: the fifth bit of weight j is bit j of qh, moved to bit 4 of byte j */
static inline codes32 fifth_bits(const uint8_t *qh_bytes) {
    uint32_t qh;
    memcpy(&qh, qh_bytes, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

/* The 32-weight formats, one block against num_x rows of x: `type` is a constant at each call (inlined), so
 * the format's branches fold away. Blocks alternate between two accumulators per row (`slot`, a
 * constant at each call, so that with num_x a constant too the accumulators live in registers): one
 * chain of multiply-adds would bound the loop by their latency. */
static inline __attribute__((always_inline)) void block32_x8(
    const int type, const uint8_t *w, int64_t b, const fm_x8 *x, int64_t x_blocks, const int num_x,
    __m256 *acc, float *bias, const int slot) {
    const float d = half_to_float(w);
    float m = 0.0f;
    codes32 c;
    if (type == FM_Q4_0) c = nibbles32(w + 2);
    else if (type == FM_Q4_1) c = nibbles32(w + 4), m = half_to_float(w + 2);
    else if (type == FM_Q5_0) c = _mm256_or_si256(nibbles32(w + 6), fifth_bits(w + 2));
    else if (type == FM_Q5_1) c = _mm256_or_si256(nibbles32(w + 8), fifth_bits(w + 4)), m = half_to_float(w + 2);
    else if (type == FM_IQ4_NL) c = iq4_values(w + 2);
    else c = _mm256_loadu_si256((const __m256i *)(w + 2));
    const float off = type == FM_Q4_0 ? -8.0f * d : type == FM_Q5_0 ? -16.0f * d : m;
    for (int r = 0; r < num_x; r++) {
        const fm_x8 *xb = x + r * x_blocks + b;
        const int sign = type == FM_Q8_0 || type == FM_IQ4_NL;
        const __m256 s = sign ? dot_s8(c, xb->q) : dot_u8(c, xb->q);
        acc[2 * r + slot] = _mm256_fmadd_ps(s, _mm256_set1_ps(d * xb->d), acc[2 * r + slot]);
        if (!sign) bias[2 * r + slot] += off * xb->d * (float)(xb->qsum[0] + xb->qsum[1]);
    }
}

static inline __attribute__((always_inline)) void row32_x8(
    const int type, const int bytes, const uint8_t *w, int64_t nb, const fm_x8 *x, int64_t x_blocks,
    const int num_x, __m256 *acc, float *bias) {
    int64_t b = 0;
    for (; b + 1 < nb; b += 2, w += 2 * bytes) {
        block32_x8(type, w, b, x, x_blocks, num_x, acc, bias, 0);
        block32_x8(type, w + bytes, b + 1, x, x_blocks, num_x, acc, bias, 1);
    }
    if (b < nb) block32_x8(type, w, b, x, x_blocks, num_x, acc, bias, 0);
}

/* One weight row against num_x rows of quantized x; nb counts the format's blocks. Inlined into a
 * one-row and an any-rows copy (row_x8 below): with num_x a constant the accumulator arrays are
 * registers, not memory the loop waits on. */
static inline __attribute__((always_inline)) void row_x8_rows(
    int type, const uint8_t *w, int64_t nb, const fm_x8 *x, int64_t x_blocks, const int num_x,
    float *out) {
    __m256 acc[2 * FM_MAX_X];
    float bias[2 * FM_MAX_X];
    for (int r = 0; r < num_x; r++) {
        acc[2 * r] = acc[2 * r + 1] = _mm256_setzero_ps();
        bias[2 * r] = bias[2 * r + 1] = 0.0f;
    }
    switch (type) {
    case FM_Q4_0: row32_x8(FM_Q4_0, 18, w, nb, x, x_blocks, num_x, acc, bias); break;
    case FM_Q4_1: row32_x8(FM_Q4_1, 20, w, nb, x, x_blocks, num_x, acc, bias); break;
    case FM_Q5_0: row32_x8(FM_Q5_0, 22, w, nb, x, x_blocks, num_x, acc, bias); break;
    case FM_Q5_1: row32_x8(FM_Q5_1, 24, w, nb, x, x_blocks, num_x, acc, bias); break;
    case FM_Q8_0: row32_x8(FM_Q8_0, 34, w, nb, x, x_blocks, num_x, acc, bias); break;
    case FM_IQ4_NL: row32_x8(FM_IQ4_NL, 18, w, nb, x, x_blocks, num_x, acc, bias); break;
    }
    for (int r = 0; r < num_x; r++)
        out[r] = hsum_ps(_mm256_add_ps(acc[2 * r], acc[2 * r + 1]))
               + (bias[2 * r] + bias[2 * r + 1]);
}

static void row_x8(int type, const uint8_t *w, int64_t nb, const fm_x8 *x, int64_t x_blocks,
                   int num_x, float *out) {
    if (num_x == 1) row_x8_rows(type, w, nb, x, x_blocks, 1, out);
    else row_x8_rows(type, w, nb, x, x_blocks, num_x, out);
}

/* ---- the 256-weight formats against x laid out by super-block (fm_xk) ---- */

/* 16 int16 lanes: sums of pairs of unsigned codes times x's codes (at most 2 * 63 * 127: no format
 * saturates); the signed code book through the sign trick (at most 2 * 127 * 127). */
static inline __m256i pairs_u8(codes32 c, const int8_t *xq) {
    return _mm256_maddubs_epi16(c, _mm256_loadu_si256((const __m256i *)xq));
}

static inline __m256i pairs_s8(codes32 c, const int8_t *xq) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
    return _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(xv, c));
}

/* pairs * scales summed to 8 int32 lanes (scales: int16 per lane), as float */
static inline __m256 scaled(__m256i pairs, __m256i scales) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, scales));
}

/* int16 scales for group g of 32 weights from the 16 per-16 scales (all16: int16 lanes): scale 2g
 * for its first 16 weights, 2g + 1 for the last */
static inline __m256i scales16(__m256i all16, int g) {
    const __m256i pair = _mm256_permutevar8x32_epi32(all16, _mm256_set1_epi32(g));
    const __m256i words = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                           2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    return _mm256_shuffle_epi8(pair, words);
}

/* One super-block's codes and integer scales, unpacked once for every row of x: 8 groups of 32
 * codes, each group's scales (int16 lanes), the per-16 offset factors (`off`: int16 lanes, against
 * x's dsum; as float times dmin in off_lo / off_hi) and the float factors of the integer products
 * (d) and of the offsets (dmin). */
typedef struct {
    codes32 c[8];
    __m256i sc[8];
    __m256i off;
    __m256 off_lo, off_hi;
    float d, dmin;
    int sign;  /* signed codes (IQ4_XS): the sign trick */
} k_block;

static inline __attribute__((always_inline)) void unpack_k(const int type, const uint8_t *w,
                                                           k_block *k) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    k->sign = 0;
    if (type == FM_Q4_K || type == FM_Q5_K) {
        const int five = type == FM_Q5_K;
        k->d = half_to_float(w), k->dmin = -half_to_float(w + 2);
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(w + 16))
                                : _mm256_setzero_si256();
        for (int pair = 0; pair < 4; pair++) {
            const uint8_t *qs = w + (five ? 48 : 16) + 32 * pair;
            const __m256i q = _mm256_loadu_si256((const __m256i *)qs);
            codes32 lo = _mm256_and_si256(q, m4);
            codes32 hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if (five) { /* bits 2 pair (low halves), 2 pair + 1 (high) of each qh byte, to bit 4 */
                const __m128i s0 = _mm_cvtsi32_si128(2 * pair);
                const __m128i s1 = _mm_cvtsi32_si128(2 * pair + 1);
                const __m256i h0 = _mm256_and_si256(_mm256_srl_epi16(qh, s0), one);
                const __m256i h1 = _mm256_and_si256(_mm256_srl_epi16(qh, s1), one);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(h0, 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(h1, 4));
            }
            k->c[2 * pair] = lo, k->c[2 * pair + 1] = hi;
        }
        /* the 12 packed bytes to 8 scale bytes (u[0..1]) and 8 min bytes (u[2..3]) at once, what
         * q4k_scale_min computes one by one */
        uint32_t u[4];
        memcpy(u, w + 4, 12);
        const uint32_t low6 = 0x3F3F3F3F, low4 = 0x0F0F0F0F, low2 = 0x03030303;
        u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
        const uint32_t mins_low = u[1] & low6;
        u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
        u[2] = mins_low;
        u[0] &= low6;
        const __m256i sc16 = _mm256_broadcastsi128_si256(
            _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)u[1], (int)u[0])));
        for (int j = 0; j < 8; j++)  /* int16 lane j in every lane */
            k->sc[j] = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * j)));
        const __m128i mins = _mm_set_epi32(0, 0, (int)u[3], (int)u[2]);
        k->off = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins)); /* per 32: per 16 twice */
    } else if (type == FM_Q6_K) {
        k->d = half_to_float(w + 208), k->dmin = -32.0f * k->d;
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h;
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            codes32 *c = k->c + 4 * h;
            for (int j = 0; j < 4; j++) { /* low nibbles of l0, l1, then high; 2 bits of qh each */
                const __m256i l = j % 2 ? l1 : l0;
                const __m256i low = _mm256_and_si256(j < 2 ? l : _mm256_srli_epi16(l, 4), m4);
                const __m128i shift = _mm_cvtsi32_si128(2 * j);
                const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, shift), m2);
                c[j] = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
            }
        }
        k->off = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
        for (int g = 0; g < 8; g++) k->sc[g] = scales16(k->off, g);
    } else if (type == FM_Q2_K || type == FM_Q3_K) {
        /* 2-bit codes (Q3_K: a third bit from hmask, minus 4), a scale per 16 (Q2_K: and a min) */
        const int three = type == FM_Q3_K;
        int8_t sc3[16];
        if (three) q3k_scales(w + 96, sc3);
        k->d = half_to_float(w + (three ? 108 : 80));
        k->dmin = three ? -4.0f * k->d : -half_to_float(w + 82);
        const __m256i hm = three ? _mm256_loadu_si256((const __m256i *)w) : _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(w + (three ? 32 : 16) + 32 * h));
            for (int j = 0; j < 4; j++) {
                codes32 c = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * j)), m2);
                if (three) {
                    const __m128i s = _mm_cvtsi32_si128(4 * h + j);
                    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(hm, s), one);
                    c = _mm256_or_si256(c, _mm256_slli_epi16(bit, 2));
                }
                k->c[4 * h + j] = c;
            }
        }
        const __m128i packed = _mm_loadu_si128((const __m128i *)(three ? (const uint8_t *)sc3 : w));
        const __m256i scales = three
            ? _mm256_sub_epi16(_mm256_cvtepi8_epi16(packed), _mm256_set1_epi16(32))
            : _mm256_cvtepu8_epi16(_mm_and_si128(packed, _mm_set1_epi8(0x0F)));
        for (int g = 0; g < 8; g++) k->sc[g] = scales16(scales, g);
        const __m128i mins = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
        k->off = three ? scales : _mm256_cvtepu8_epi16(mins);
    } else { /* IQ4_XS: signed code-book values, a scale per 32, no offset */
        k->d = half_to_float(w), k->dmin = 0.0f, k->sign = 1;
        for (int j = 0; j < 8; j++) {
            k->c[j] = iq4_values(w + 8 + 16 * j);
            k->sc[j] = _mm256_set1_epi16((short)iq4xs_scale(w, j));
        }
        k->off = _mm256_setzero_si256();
    }
    const __m256 dmin = _mm256_set1_ps(k->dmin);
    const __m128i lo = _mm256_castsi256_si128(k->off), hi = _mm256_extracti128_si256(k->off, 1);
    k->off_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(lo)), dmin);
    k->off_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(hi)), dmin);
}

/* One weight row of a 256-weight format against num_x rows of x (inlined into a one-row and an
 * any-rows copy, as row_x8_rows): per group of 32 the integer products scaled by the weights'
 * integer scales, times x's scale (two chains of multiply-adds); per super-block the weights' d,
 * the offsets against x's scaled half sums. */
static inline __attribute__((always_inline)) void row_k8_rows(
    const int type, const uint8_t *w, int64_t nb, const fm_xk *x, const int num_x, float *out) {
    const int bytes = fm_block_bytes(type);
    __m256 acc[FM_MAX_X], bias[FM_MAX_X];
    for (int r = 0; r < num_x; r++) acc[r] = bias[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        k_block k;
        unpack_k(type, w, &k);
        for (int r = 0; r < num_x; r++) {
            const fm_xk *xb = x + r * nb + b;
            __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps();
            for (int j = 0; j < 8; j += 2) {
                const int8_t *q = xb->q + 32 * j;
                const int8_t *q1 = q + 32;
                const __m256i p0 = k.sign ? pairs_s8(k.c[j], q) : pairs_u8(k.c[j], q);
                const __m256i p1 = k.sign ? pairs_s8(k.c[j + 1], q1) : pairs_u8(k.c[j + 1], q1);
                const __m256 d0 = _mm256_broadcast_ss(xb->d + j);
                const __m256 d1 = _mm256_broadcast_ss(xb->d + j + 1);
                t0 = _mm256_fmadd_ps(scaled(p0, k.sc[j]), d0, t0);
                t1 = _mm256_fmadd_ps(scaled(p1, k.sc[j + 1]), d1, t1);
            }
            acc[r] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), _mm256_set1_ps(k.d), acc[r]);
            if (!k.sign) {
                const __m256 lo = _mm256_mul_ps(k.off_lo, _mm256_loadu_ps(xb->dsum));
                const __m256 o = _mm256_fmadd_ps(k.off_hi, _mm256_loadu_ps(xb->dsum + 8), lo);
                bias[r] = _mm256_add_ps(bias[r], o);
            }
        }
    }
    for (int r = 0; r < num_x; r++) out[r] = hsum_ps(acc[r]) + hsum_ps(bias[r]);
}

static void row_k8(int type, const uint8_t *w, int64_t nb, const fm_xk *x, int num_x, float *out) {
#define FM_ROW_K8(T) \
    if (num_x == 1) row_k8_rows(T, w, nb, x, 1, out); else row_k8_rows(T, w, nb, x, num_x, out)
    switch (type) {
    case FM_Q2_K: FM_ROW_K8(FM_Q2_K); break;
    case FM_Q3_K: FM_ROW_K8(FM_Q3_K); break;
    case FM_Q4_K: FM_ROW_K8(FM_Q4_K); break;
    case FM_Q5_K: FM_ROW_K8(FM_Q5_K); break;
    case FM_Q6_K: FM_ROW_K8(FM_Q6_K); break;
    default: FM_ROW_K8(FM_IQ4_XS); break;
    }
#undef FM_ROW_K8
}
#else
/* Portable: the same integer sums, one weight at a time. Each block unpacks into codes and, per 16 weights,
 * the factor of sum(code * xq) * dx (scale) and of sum(xq) * dx (offset). */
static int unpack_codes(int type, const uint8_t *w, int *codes, float *scale, float *offset) {
    switch (type) {
    case FM_Q4_0: case FM_Q4_1: case FM_Q5_0: case FM_Q5_1: {
        const int five = type == FM_Q5_0 || type == FM_Q5_1, with_min = type == FM_Q4_1 || type == FM_Q5_1;
        const uint8_t *q = w + (with_min ? 4 : 2) + (five ? 4 : 0);
        uint32_t qh = 0;
        if (five) memcpy(&qh, w + (with_min ? 4 : 2), 4);
        for (int j = 0; j < 16; j++) {
            codes[j] = (q[j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            codes[j + 16] = (q[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
        }
        const float d = half_to_float(w);
        scale[0] = scale[1] = d;
        offset[0] = offset[1] = with_min ? half_to_float(w + 2) : (five ? -16.0f : -8.0f) * d;
        return 32;
    }
    case FM_Q8_0: case FM_IQ4_NL:
        for (int j = 0; j < 16 && type == FM_IQ4_NL; j++) codes[j] = IQ4[w[2 + j] & 0x0F], codes[j + 16] = IQ4[w[2 + j] >> 4];
        for (int j = 0; j < 32 && type == FM_Q8_0; j++) codes[j] = (int8_t)w[2 + j];
        scale[0] = scale[1] = half_to_float(w);
        offset[0] = offset[1] = 0.0f;
        return 32;
    case FM_IQ4_XS:
        for (int k = 0; k < 8; k++) {
            const uint8_t *q = w + 8 + 16 * k;
            for (int j = 0; j < 16; j++) codes[32 * k + j] = IQ4[q[j] & 0x0F], codes[32 * k + j + 16] = IQ4[q[j] >> 4];
            scale[2 * k] = scale[2 * k + 1] = half_to_float(w) * (float)iq4xs_scale(w, k);
            offset[2 * k] = offset[2 * k + 1] = 0.0f;
        }
        return 256;
    case FM_Q2_K: {
        const float d = half_to_float(w + 80), dmin = half_to_float(w + 82);
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) codes[128 * h + 32 * j + l] = (w[16 + 32 * h + l] >> (2 * j)) & 3;
        for (int k = 0; k < 16; k++) scale[k] = d * (float)(w[k] & 0x0F), offset[k] = -dmin * (float)(w[k] >> 4);
        return 256;
    }
    case FM_Q3_K: {
        int8_t sc[16];
        q3k_scales(w + 96, sc);
        const float d = half_to_float(w + 108);
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++)
                    codes[128 * h + 32 * j + l] = ((w[32 + 32 * h + l] >> (2 * j)) & 3) | (((w[l] >> (4 * h + j)) & 1) << 2);
        for (int k = 0; k < 16; k++) scale[k] = d * (float)(sc[k] - 32), offset[k] = -4.0f * scale[k];
        return 256;
    }
    case FM_Q4_K: case FM_Q5_K: {
        const float d = half_to_float(w), dmin = half_to_float(w + 2);
        const int five = type == FM_Q5_K;
        const uint8_t *q = w + (five ? 48 : 16), *qh = w + 16;
        for (int pair = 0; pair < 4; pair++) {
            for (int half = 0; half < 2; half++) {
                int sc, mn;
                q4k_scale_min(2 * pair + half, w + 4, &sc, &mn);
                for (int l = 0; l < 32; l++) {
                    int c = half ? q[32 * pair + l] >> 4 : q[32 * pair + l] & 0x0F;
                    if (five) c |= ((qh[l] >> (2 * pair + half)) & 1) << 4;
                    codes[64 * pair + 32 * half + l] = c;
                }
                const int k = 4 * pair + 2 * half;
                scale[k] = scale[k + 1] = d * (float)sc;
                offset[k] = offset[k + 1] = -dmin * (float)mn;
            }
        }
        return 256;
    }
    case FM_Q6_K: {
        const float d = half_to_float(w + 208);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            const int8_t *sc = (const int8_t *)(w + 192 + 8 * h);
            for (int l = 0; l < 32; l++) {
                codes[128 * h + l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
                codes[128 * h + 32 + l] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
                codes[128 * h + 64 + l] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                codes[128 * h + 96 + l] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
            for (int k = 0; k < 8; k++) scale[8 * h + k] = d * (float)sc[k], offset[8 * h + k] = -32.0f * scale[8 * h + k];
        }
        return 256;
    }
    }
    return 0;
}

static void row_x8(int type, const uint8_t *w, int64_t nb, const fm_x8 *x, int64_t x_blocks,
                   int num_x, float *out) {
    const int bytes = fm_block_bytes(type);
    for (int r = 0; r < num_x; r++) out[r] = 0.0f;
    int codes[256];
    float scale[16], offset[16];
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        unpack_codes(type, w, codes, scale, offset);
        for (int r = 0; r < num_x; r++) {
            const fm_x8 *xb = x + r * x_blocks + b;
            float acc = 0.0f;
            for (int k = 0; k < 2; k++) {
                int s = 0;
                for (int j = 0; j < 16; j++) s += codes[16 * k + j] * xb->q[16 * k + j];
                acc += xb->d * (scale[k] * (float)s + offset[k] * (float)xb->qsum[k]);
            }
            out[r] += acc;
        }
    }
}

/* x laid out by super-block: per 16 weights the code sums, scaled and offset in float */
static void row_k8(int type, const uint8_t *w, int64_t nb, const fm_xk *x, int num_x, float *out) {
    const int bytes = fm_block_bytes(type);
    for (int r = 0; r < num_x; r++) out[r] = 0.0f;
    int codes[256];
    float scale[16], offset[16];
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        unpack_codes(type, w, codes, scale, offset);
        for (int r = 0; r < num_x; r++) {
            const fm_xk *xb = x + r * nb + b;
            float acc = 0.0f;
            for (int k = 0; k < 16; k++) {
                int s = 0;
                for (int j = 0; j < 16; j++) s += codes[16 * k + j] * xb->q[16 * k + j];
                acc += scale[k] * (float)s * xb->d[k / 2] + offset[k] * xb->dsum[k];
            }
            out[r] += acc;
        }
    }
}
#endif

/* y[r][row] = sum_c W[row][c] * x[r][c] from x quantized by fm_quantize_x8 into xq (fm_x8_bytes for
 * num_x rows of cols; the layout fm_x8_layout names for `type` written). Returns 0, -1 for a
 * format without an 8-bit path, -2 for a shape the kernel does not take. */
int fm_qgemv_x8(int type, const uint8_t *w, int64_t rows, int64_t cols, int64_t row_bytes,
                const void *xq, int64_t num_x, float *y, int64_t y_stride, int num_threads) {
    const int block_bytes = fm_block_bytes(type);
    if (block_bytes == 0 || fm_is_float_format(type)) return -1;
    const int qk = fm_block_weights(type);
    if (num_x < 1 || num_x > FM_MAX_X || cols % qk != 0 || row_bytes != cols / qk * block_bytes) return -2;
    const int64_t nb = cols / qk;
    const fm_x8 *blocks = (const fm_x8 *)xq;
    const fm_xk *supers = xk_area(xq, num_x, cols);
    const int64_t chunk = fm_row_chunk(rows, num_threads); /* row_chunks.h */
#pragma omp parallel for schedule(dynamic, chunk) num_threads(num_threads) if (rows * cols >= 65536)
    for (int64_t row = 0; row < rows; row++) {
        float out[FM_MAX_X] = {0};
        if (qk == 256) row_k8(type, w + row * row_bytes, nb, supers, (int)num_x, out);
        else row_x8(type, w + row * row_bytes, nb, blocks, nb, (int)num_x, out);
        for (int64_t r = 0; r < num_x; r++) y[r * y_stride + row] = out[r];
    }
    return 0;
}
