/* The "mse" range of KV quantization (kvcache/quant.py): for every group of values, the [min, max] range shrunk
 * about its midpoint by the factor (of the caller's list) whose quantization has the least squared error. The
 * torch loop in quant.py is the reference and the fallback; this is the same rule in one pass per group instead
 * of ~10 tensor ops per factor over the whole block.
 *
 * x is float [outer][group][inner]: each (o, j) is one group of `group` values at stride `inner` (keys: a channel
 * over kgroup tokens, inner = head_dim; values: vgroup channels of one token, inner = 1). Scale and zero are
 * written as fp16 [outer][inner], rounded as torch's .to(float16) rounds (to nearest even), and the error of a
 * factor is measured against those rounded values, as decoding will see them.
 */
#include <math.h>
#include <stdint.h>

typedef _Float16 fm_half;

#define FM_RANGE_MAX_FACTORS 16

static inline void range_of(float lo, float hi, float factor, int levels, fm_half *scale, fm_half *zero) {
    if (factor == 1.0f) { /* min/max exactly */
        *scale = (fm_half)((hi - lo) / (float)levels);
        *zero = (fm_half)lo;
        return;
    }
    const float half = (hi - lo) * (0.5f * factor);
    *scale = (fm_half)(half * (2.0f / (float)levels));
    *zero = (fm_half)((hi + lo) * 0.5f - half);
}

int fm_quant_range(const float *x, int64_t outer, int64_t group, int64_t inner, int bits, const float *factors,
                   int num_factors, fm_half *scale_out, fm_half *zero_out) {
    if (num_factors < 1 || num_factors > FM_RANGE_MAX_FACTORS || (bits != 2 && bits != 4) || group < 1)
        return -1;
    const int levels = (1 << bits) - 1;
    for (int64_t o = 0; o < outer; o++) {
        for (int64_t j = 0; j < inner; j++) {
            const float *g = x + o * group * inner + j;
            float lo = g[0], hi = g[0];
            for (int64_t i = 1; i < group; i++) {
                const float v = g[i * inner];
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
            fm_half best_s, best_z;
            float best_err = INFINITY;
            for (int f = 0; f < num_factors; f++) {
                fm_half hs, hz;
                range_of(lo, hi, factors[f], levels, &hs, &hz);
                const float s = (float)hs > 1e-8f ? (float)hs : 1e-8f, z = (float)hz;
                float err = 0.0f;
                for (int64_t i = 0; i < group; i++) {
                    const float v = g[i * inner];
                    float c = rintf((v - z) / s);
                    c = c < 0.0f ? 0.0f : (c > (float)levels ? (float)levels : c);
                    const float d = c * s + z - v;
                    err += d * d;
                }
                if (f == 0 || err < best_err) {
                    best_err = err;
                    best_s = hs;
                    best_z = hz;
                }
            }
            scale_out[o * inner + j] = best_s;
            zero_out[o * inner + j] = best_z;
        }
    }
    return 0;
}
