/* Quest block selection for one decode query, one layer and one level: score every candidate block, lift the
 * prompt's hinted blocks above the rest, keep the `budget` best per KV head (ascending). The torch path
 * (kvcache/read/selection.py, hints.py) is the reference; this is the same rule in one call instead of ~20 ops.
 *
 * Score of block b for KV head h: the largest over the G query heads g of h and the block's boxes x of
 *     sum_c q[g][c] * centre[b][x][c] + |q[g][c]| * radius[b][x][c]     (digest row = per box centre[D], radius[D])
 * Order: hinted blocks first (among them the lower position), then higher scores, then (ties) the lower block
 * position; the torch path breaks ties the same way (a stable descending sort, hinted blocks lifted to +inf). Scores summed in another order than torch's may differ in the
 * last bits, so two blocks whose bounds are that close may rank differently on the two paths.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#define FM_SELECT_MAX_DIM 256
#define FM_SELECT_MAX_GROUP 32
#define FM_SELECT_MAX_BOXES 16
#define FM_SELECT_MAX_BLOCKS 0x7fffffffLL /* block positions fit the key's low 31 bits */

typedef float fm_sv8 __attribute__((vector_size(32)));
typedef _Float16 fm_select_half;

/* n fp16 values (n a multiple of 8) widened to float: vcvtph2ps with F16C (GCC converts _Float16 value by value). */
static inline void widen_f16(const fm_select_half *src, int64_t n, float *dst) {
#ifdef __F16C__
    for (int64_t e = 0; e < n; e += 8)
        _mm256_storeu_ps(dst + e, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + e))));
#else
    for (int64_t e = 0; e < n; e++) dst[e] = (float)src[e];
#endif
}

static inline fm_sv8 load_sv8(const float *p) {
    fm_sv8 r;
    memcpy(&r, p, sizeof r);
    return r;
}

/* One unique, totally ordered key per block: hinted bit, the score's bits mapped to an unsigned order, then the
 * position inverted (a lower position ranks higher among equal scores). */
static inline uint64_t rank_key(float score, int hinted, int64_t b) {
    uint32_t u;
    memcpy(&u, &score, sizeof u);
    if ((u & 0x7fffffffu) == 0) u = 0; /* -0 ranks as +0, as the comparison torch sorts by does */
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((uint64_t)(hinted != 0) << 63) | ((uint64_t)u << 31) | (uint64_t)(FM_SELECT_MAX_BLOCKS - b);
}

/* Rearranges a[0..n) so that a[k] is the k-th largest and every a[i] for i < k is larger (keys are unique). */
static void select_kth_largest(uint64_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        /* median of three as the pivot, moved to a[hi] */
        if (a[mid] < a[lo]) { uint64_t t = a[mid]; a[mid] = a[lo]; a[lo] = t; }
        if (a[hi] < a[lo]) { uint64_t t = a[hi]; a[hi] = a[lo]; a[lo] = t; }
        if (a[mid] < a[hi]) { uint64_t t = a[mid]; a[mid] = a[hi]; a[hi] = t; }
        const uint64_t pivot = a[hi];
        int64_t store = lo;
        for (int64_t i = lo; i < hi; i++) {
            if (a[i] > pivot) {
                uint64_t t = a[i]; a[i] = a[store]; a[store] = t;
                store++;
            }
        }
        { uint64_t t = a[hi]; a[hi] = a[store]; a[store] = t; }
        if (store == k) return;
        if (store < k) lo = store + 1;
        else hi = store - 1;
    }
}

/* q [H * G][D] float32 (one token); digest rows of boxes * 2 * D values (float32, or fp16 when digest_f16) at
 * digest + h * head_stride + b * block_stride (strides in elements);
 * indices [n] ascending logical block indices and hints [H][num_hints] logical indices (hints may be NULL: none;
 * a hint not among the indices changes nothing); chosen [H][budget] int64 block positions, ascending; scores
 * [H][n] float32, the raw (unlifted) scores, or NULL. D a multiple of 8. Returns 0, or -1 outside the kernel's
 * limits (the caller then runs the torch path). */
int fm_quest_select(const float *q, int64_t H, int64_t G, int64_t D, const void *digest, int digest_f16,
                    int64_t boxes, int64_t head_stride, int64_t block_stride, int64_t n, const int64_t *indices,
                    const int64_t *hints, int64_t num_hints, int64_t budget, int64_t *chosen, float *scores) {
    if (D > FM_SELECT_MAX_DIM || D % 8 || G > FM_SELECT_MAX_GROUP || G < 1 || n < 1 || n > FM_SELECT_MAX_BLOCKS ||
        budget < 1 || budget > n || boxes < 1 || boxes > FM_SELECT_MAX_BOXES)
        return -1;
    uint64_t *keys = malloc(sizeof(uint64_t) * (size_t)n * 2);
    if (keys == NULL) return -1;
    uint64_t *order = keys + n;
    float qx[FM_SELECT_MAX_GROUP][2 * FM_SELECT_MAX_DIM];
    float widened[FM_SELECT_MAX_BOXES * 2 * FM_SELECT_MAX_DIM];
    for (int64_t h = 0; h < H; h++) {
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + (h * G + g) * D;
            for (int64_t c = 0; c < D; c++) {
                qx[g][c] = qg[c];
                qx[g][D + c] = qg[c] < 0 ? -qg[c] : qg[c];
            }
        }
        for (int64_t b = 0; b < n; b++) {
            const float *block_row;
            if (digest_f16) { /* widen the block's row once; the dots below read float32 */
                const fm_select_half *src = (const fm_select_half *)digest + h * head_stride + b * block_stride;
                widen_f16(src, boxes * 2 * D, widened);
                block_row = widened;
            } else {
                block_row = (const float *)digest + h * head_stride + b * block_stride;
            }
            float best = 0;
            for (int64_t x = 0; x < boxes; x++) {
                const float *row = block_row + x * 2 * D;
                for (int64_t g = 0; g < G; g++) {
                    /* two vector accumulators: the multiply-adds of a row are not serialised on one register */
                    fm_sv8 a0 = {0}, a1 = {0};
                    for (int64_t c = 0; c < 2 * D; c += 16) {
                        a0 += load_sv8(row + c) * load_sv8(qx[g] + c);
                        a1 += load_sv8(row + c + 8) * load_sv8(qx[g] + c + 8);
                    }
                    a0 += a1;
                    const float s = ((a0[0] + a0[4]) + (a0[1] + a0[5])) + ((a0[2] + a0[6]) + (a0[3] + a0[7]));
                    best = ((x == 0 && g == 0) || s > best) ? s : best;
                }
            }
            if (scores != NULL) scores[h * n + b] = best;
            keys[b] = rank_key(best, 0, b);
        }
        for (int64_t j = 0; hints != NULL && j < num_hints; j++) {
            const int64_t want = hints[h * num_hints + j];
            int64_t lo = 0, hi = n; /* first position whose index >= want */
            while (lo < hi) {
                const int64_t mid = lo + (hi - lo) / 2;
                if (indices[mid] < want) lo = mid + 1;
                else hi = mid;
            }
            /* hinted blocks rank among themselves by position only, as the torch path's +inf scores tie */
            if (lo < n && indices[lo] == want) keys[lo] = ((uint64_t)1 << 63) | (keys[lo] & FM_SELECT_MAX_BLOCKS);
        }
        int64_t *out = chosen + h * budget;
        if (budget == n) {
            for (int64_t b = 0; b < n; b++) out[b] = b;
            continue;
        }
        memcpy(order, keys, sizeof(uint64_t) * (size_t)n);
        select_kth_largest(order, n, budget - 1);
        const uint64_t threshold = order[budget - 1];
        int64_t m = 0;
        for (int64_t b = 0; b < n; b++)
            if (keys[b] >= threshold) out[m++] = b;
    }
    free(keys);
    return 0;
}
