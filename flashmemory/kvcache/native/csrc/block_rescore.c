/* The second pass of a two-pass read (selection_rescore_factor): for one decode query, one layer and one level,
 * the attention mass each candidate block's FP16 keys take, the keys read in place from the pool's records (no
 * gathered copy). The torch path (kvcache/read/selection.py rescore_blocks) is the reference.
 *
 * For KV head h, candidate j and query head g of h's group:
 *     lse[g][j]   = logsumexp over the block's tokens t of scale * (q[g] . k[j][t])
 *     score[h][j] = max over g of (lse[g][j] - logsumexp over j' of lse[g][j'])
 * The record of (h, slot) starts at base + h * head_stride + slot * record_bytes; its keys are block_tokens
 * rows of head_dim fp16 at key_offset. (-FLT_MAX, not -inf, starts each max: -ffast-math assumes finite values.)
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#define FM_RESCORE_MAX_DIM 256
#define FM_RESCORE_MAX_GROUP 32
#define FM_RESCORE_MAX_TOKENS 64

typedef float fm_rv8 __attribute__((vector_size(32)));

static inline fm_rv8 keys8(const uint16_t *k) {
    fm_rv8 r;
#ifdef __F16C__
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)k));
    memcpy(&r, &v, sizeof r);
#else
    for (int e = 0; e < 8; e++) {
        _Float16 h;
        memcpy(&h, k + e, 2);
        r[e] = (float)h;
    }
#endif
    return r;
}

static inline float sum8(fm_rv8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* lse[g] for one block: its tokens' logits against the group's queries, each row of keys converted once. */
static void block_lse(const float *q, int64_t group, int64_t head_dim, const uint16_t *keys, int64_t tokens,
                      float scale, float *lse) {
    float logits[FM_RESCORE_MAX_GROUP][FM_RESCORE_MAX_TOKENS];
    for (int64_t t = 0; t < tokens; t++) {
        fm_rv8 acc[FM_RESCORE_MAX_GROUP];
        for (int64_t g = 0; g < group; g++) acc[g] = (fm_rv8){0};
        for (int64_t e = 0; e < head_dim; e += 8) {
            const fm_rv8 k = keys8(keys + t * head_dim + e);
            for (int64_t g = 0; g < group; g++) {
                fm_rv8 qv;
                memcpy(&qv, q + g * head_dim + e, sizeof qv);
                acc[g] += k * qv;
            }
        }
        for (int64_t g = 0; g < group; g++) logits[g][t] = scale * sum8(acc[g]);
    }
    for (int64_t g = 0; g < group; g++) {
        float m = -FLT_MAX, s = 0.0f;
        for (int64_t t = 0; t < tokens; t++) m = fmaxf(m, logits[g][t]);
        for (int64_t t = 0; t < tokens; t++) s += expf(logits[g][t] - m);
        lse[g] = m + logf(s);
    }
}

/* scores [heads][c]; q [heads * group][head_dim] float32; slots [heads][c]. Returns 0, or -2 for a shape the
 * kernel does not take (head_dim not a multiple of 8 or over FM_RESCORE_MAX_DIM, and the like), -3 without memory. */
int fm_rescore_blocks(const float *q, int64_t heads, int64_t group, int64_t head_dim, const uint8_t *base,
                      int64_t head_stride, int64_t record_bytes, int64_t key_offset, const int64_t *slots, int64_t c,
                      int64_t block_tokens, float scale, float *scores, int num_threads) {
    if (head_dim % 8 || head_dim > FM_RESCORE_MAX_DIM || group < 1 || group > FM_RESCORE_MAX_GROUP || c < 1
        || block_tokens < 1 || block_tokens > FM_RESCORE_MAX_TOKENS)
        return -2;
    float *lse = malloc(sizeof(float) * heads * group * c); /* [heads][c][group] */
    if (lse == NULL) return -3;
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads) if (heads * c * block_tokens >= 4096)
    for (int64_t hj = 0; hj < heads * c; hj++) {
        const int64_t h = hj / c;
        const uint8_t *record = base + h * head_stride + slots[hj] * record_bytes + key_offset;
        block_lse(q + h * group * head_dim, group, head_dim, (const uint16_t *)record, block_tokens, scale,
                  lse + hj * group);
    }
    for (int64_t h = 0; h < heads; h++) {
        float *out = scores + h * c;
        for (int64_t j = 0; j < c; j++) out[j] = -FLT_MAX;
        for (int64_t g = 0; g < group; g++) {
            float m = -FLT_MAX, s = 0.0f;
            for (int64_t j = 0; j < c; j++) m = fmaxf(m, lse[(h * c + j) * group + g]);
            for (int64_t j = 0; j < c; j++) s += expf(lse[(h * c + j) * group + g] - m);
            const float total = m + logf(s);
            for (int64_t j = 0; j < c; j++) out[j] = fmaxf(out[j], lse[(h * c + j) * group + g] - total);
        }
    }
    free(lse);
    return 0;
}
