/* The small per-layer operations of a decode step fused into one pass each (a torch op apiece costs more in
 * dispatch than in arithmetic at one token): RMSNorm, rotate-half RoPE in place, SwiGLU. float32, rows of
 * `stride` floats. The arithmetic follows the torch reference in llama.py / rope.py (float summation error). */
#include <math.h>
#include <stdint.h>

/* out[t] = (x[t] * rsqrt(mean(x[t]^2) + eps)) * w */
void fm_rmsnorm(const float *x, int64_t x_stride, const float *w, int64_t T, int64_t dim, float eps, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * x_stride;
        float *ot = out + t * dim;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < dim; c++) sum += xt[c] * xt[c];
        const float r = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
        for (int64_t c = 0; c < dim; c++) ot[c] = (xt[c] * r) * w[c];
    }
}

/* x [T][H][D] (token rows x_stride floats apart, heads D apart) rotated in place by cos/sin [T][D]:
 * x[i] <- x[i] cos[i] - x[i + D/2] sin[i],  x[i + D/2] <- x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2] */
void fm_rope(float *x, int64_t x_stride, int64_t T, int64_t H, int64_t D, const float *cos_t, const float *sin_t) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + t * D, *s = sin_t + t * D;
        for (int64_t h = 0; h < H; h++) {
            float *v = x + t * x_stride + h * D;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out[t][j] = silu(gu[t][j]) * gu[t][I + j] for gate_up rows gu [T][2I] */
void fm_swiglu(const float *gu, int64_t T, int64_t I, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
#pragma omp simd
        for (int64_t j = 0; j < I; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}
