/* Per-step selection statistics and heat-predictor features (flashmemory/kvcache/access_stats.py), for the usual
 * case: every layer, candidates one run of logical blocks [first, first + n).
 *
 * State arrays are [L][H][cap] (ring: [L][H][cap][FM_NUM_INTERVALS]); chosen [L][H][b] positions into the run;
 * scores [L][H][n]; query_mean [L][H]; features out [FM_NUM_FEATURES][L][H][n]. The arithmetic is the torch
 * implementation's, in the same order, so the two agree to float rounding (tests compare them); the torch code
 * stays the reference and serves every other case.
 */
#include <math.h>
#include <stdint.h>

#define FM_NUM_INTERVALS 10
#define FM_NUM_FEATURES 14
#define FM_NEVER_SELECTED_STEPS 64
#define FM_EMA_DECAY 0.7f
#define FM_CHUNK 256

int fm_access_update(int64_t L, int64_t H, int64_t cap, int64_t first, int64_t n, int64_t step,
                     const int64_t *chosen, int64_t b, int64_t *last_step, float *count, float *observed,
                     float *ema, int64_t *ring, int64_t *ring_head, int64_t *num_intervals, int64_t *interval_sum,
                     int64_t *interval_sumsq) {
    if (first < 0 || first + n > cap) return 1;
    for (int64_t i = 0; i < L * H * b; i++) { /* checked before anything is written */
        if (chosen[i] < 0 || chosen[i] >= n) return 1;
    }
    for (int64_t lh = 0; lh < L * H; lh++) {
        const int64_t base = lh * cap + first;
        const int64_t *pick = chosen + lh * b;
        for (int64_t j = 0; j < n; j++) {
            observed[base + j] += 1.0f;
            ema[base + j] *= FM_EMA_DECAY;
        }
        for (int64_t k = 0; k < b; k++) {
            const int64_t cell = base + pick[k];
            const int64_t last = last_step[cell];
            if (last >= 0) { /* selected before and now: a new access interval */
                const int64_t interval = step - last, have = num_intervals[cell];
                const int64_t slot = cell * FM_NUM_INTERVALS + ring_head[cell];
                const int64_t dropped = have == FM_NUM_INTERVALS ? ring[slot] : 0;
                ring[slot] = interval;
                ring_head[cell] = (ring_head[cell] + 1) % FM_NUM_INTERVALS;
                num_intervals[cell] = have + 1 < FM_NUM_INTERVALS ? have + 1 : FM_NUM_INTERVALS;
                interval_sum[cell] += interval - dropped;
                interval_sumsq[cell] += interval * interval - dropped * dropped;
            }
            last_step[cell] = step;
            count[cell] += 1.0f;
            ema[cell] += 1.0f - FM_EMA_DECAY;
        }
    }
    return 0;
}

static inline float clamp5(float x) { return x < -5.0f ? -5.0f : (x > 5.0f ? 5.0f : x); }

int fm_access_features(int64_t L, int64_t H, int64_t cap, int64_t first, int64_t n, int64_t step,
                       const int64_t *chosen, int64_t b, const float *scores, const float *query_mean,
                       int64_t num_blocks, int64_t level, const int64_t *last_step, const float *count,
                       const float *observed, const float *ema, const int64_t *num_intervals,
                       const int64_t *interval_sum, const int64_t *interval_sumsq, float *out) {
    if (first < 0 || first + n > cap || n <= 0 || b <= 0) return 1;
    const int64_t plane = L * H * n; /* one feature's values */
    const float blocks = (float)(num_blocks > 1 ? num_blocks : 1);
    const float budget_fraction = (float)((double)b / (double)n);
    for (int64_t lh = 0; lh < L * H; lh++) {
        const int64_t base = lh * cap + first;
        const float *s = scores + lh * n;
        float sum = 0.0f, sumsq = 0.0f, kth = INFINITY;
        for (int64_t j = 0; j < n; j++) {
            sum += s[j];
            sumsq += s[j] * s[j];
        }
        for (int64_t k = 0; k < b; k++) {
            const int64_t j = chosen[lh * b + k];
            if (j < 0 || j >= n) return 1;
            kth = s[j] < kth ? s[j] : kth;
        }
        const float mean = sum / (float)n;
        const float var = sumsq / (float)n - mean * mean;
        const float std = sqrtf(var > 0.0f ? var : 0.0f) + 1e-6f;
        float qm = query_mean[lh] * 10.0f;
        qm = clamp5(qm);
        float *o = out + lh * n;
        /* In chunks: integer state to floats first (scalar), then each feature in a simple loop the compiler
         * vectorises (logf from glibc's vector math library under -ffast-math). */
        for (int64_t j0 = 0; j0 < n; j0 += FM_CHUNK) {
            const int64_t m = n - j0 < FM_CHUNK ? n - j0 : FM_CHUNK;
            float since[FM_CHUNK], never[FM_CHUNK], now[FM_CHUNK], k[FM_CHUNK], mi[FM_CHUNK], vi[FM_CHUNK];
            /* mean and variance of the intervals from their exact int64 sums, in double: E[x^2] - E[x]^2 cancels */
            const int64_t cell0 = base + j0;
            for (int64_t j = 0; j < m; j++) {
                const int64_t last = last_step[cell0 + j];
                since[j] = (float)(last < 0 ? FM_NEVER_SELECTED_STEPS : step - last);
                never[j] = last < 0 ? 1.0f : 0.0f;
                now[j] = last == step ? 1.0f : 0.0f;
                const int64_t have = num_intervals[cell0 + j];
                const double denom = (double)(have > 1 ? have : 1);
                const double mean_interval = (double)interval_sum[cell0 + j] / denom;
                const double v = (double)interval_sumsq[cell0 + j] / denom - mean_interval * mean_interval;
                k[j] = (float)have;
                mi[j] = (float)mean_interval;
                vi[j] = (float)(v > 0.0 ? v : 0.0);
            }
            float *f = o + j0;
            const float *sj = s + j0, *seen_count = count + cell0, *seen_obs = observed + cell0, *e = ema + cell0;
            const float pos0 = (float)(first + j0);
            const int mm = (int)m; /* int32 counter: its conversion to float vectorises */
#pragma omp simd
            for (int j = 0; j < mm; j++) {
                const float seen = seen_obs[j] > 1.0f ? seen_obs[j] : 1.0f;
                f[0 * plane + j] = logf(1.0f + since[j]) / 5.0f;
                f[1 * plane + j] = never[j];
                f[2 * plane + j] = now[j];
                f[3 * plane + j] = seen_count[j] / seen;
                f[4 * plane + j] = e[j];
                f[5 * plane + j] = clamp5((sj[j] - mean) / std);
                f[6 * plane + j] = clamp5((sj[j] - kth) / std);
                f[7 * plane + j] = (pos0 + (float)j) / blocks;
                f[8 * plane + j] = level == 2 ? 1.0f : 0.0f;
                f[9 * plane + j] = logf(1.0f + mi[j]) / 5.0f;
                f[10 * plane + j] = logf(1.0f + vi[j]) / 10.0f;
                f[11 * plane + j] = k[j] / (float)FM_NUM_INTERVALS;
                f[12 * plane + j] = qm;
                f[13 * plane + j] = budget_fraction;
            }
        }
    }
    return 0;
}
