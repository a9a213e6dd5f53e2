/* The heat predictor's forward pass (flashmemory/kvcache/heat_predictor.py): a 3-layer MLP over feature rows.
 *
 *   out[r] = w3 . relu(W2^T relu(W1^T x[r] + b1) + b2) + b3
 *
 * x [F][rows] float32, feature-major (each feature's column contiguous); w1 [F][H], w2 [H][H] (input-major, as numpy keeps them), b1, b2, w3 [H]. The
 * caller folds the feature normalisation into w1 and b1. F <= FM_MLP_MAX_FEATURES, H a multiple of 8 and at most
 * FM_MLP_MAX_HIDDEN.
 *
 * fm_heat_rank runs it only on the rows that can matter (see heat_predictor.py: the eligibility filter).
 * Eight rows ride in the lanes of one vector, and eight hidden units are computed at once, so every multiply-add
 * has independent neighbours and the weights are scalars broadcast from L1.
 * Nothing is allocated: the torch path allocates a [rows, H] activation per layer, which on a busy machine costs
 * more than the arithmetic.
 */
#include <stdint.h>
#include <string.h>

#define FM_MLP_MAX_HIDDEN 64
#define FM_MLP_MAX_FEATURES 64

typedef float fm_mlp_v8 __attribute__((vector_size(32)));
typedef int32_t fm_mlp_i8 __attribute__((vector_size(32)));

static inline fm_mlp_v8 relu8(fm_mlp_v8 v) {
    const fm_mlp_v8 zero = {0};
    return (fm_mlp_v8)((fm_mlp_i8)v & (v > zero));
}

/* Eight hidden units u..u+7 of one dense layer (+ relu) for the eight rows in `in` [n][8 lanes]: eight independent
 * multiply-add chains, enough to keep both FMA units busy across the 4-cycle latency. */
static inline void dense8(const fm_mlp_v8 *in, int64_t n, const float *w, int64_t H, int64_t u, const float *b,
                          fm_mlp_v8 out[8]) {
    fm_mlp_v8 a[8];
    for (int j = 0; j < 8; j++) a[j] = in[0] * 0 + b[u + j];
    for (int64_t i = 0; i < n; i++) {
        const float *wi = w + i * H + u;
        for (int j = 0; j < 8; j++) a[j] += in[i] * wi[j];
    }
    for (int j = 0; j < 8; j++) out[j] = relu8(a[j]);
}

/* The MLP for up to 8 rows, given by their indices `idx` (m of them), into out[idx[k]]. */
static void mlp8(const float *x, int64_t rows, int64_t F, const int64_t *idx, int64_t m, const float *w1,
                 const float *b1, const float *w2, const float *b2, const float *w3, float b3, int64_t H,
                 float *out) {
    fm_mlp_v8 xt[FM_MLP_MAX_FEATURES], h1[FM_MLP_MAX_HIDDEN];
    const int run = m == 8 && idx[7] - idx[0] == 7;
    for (int64_t i = 0; i < F; i++) {
        if (run) {
            memcpy(&xt[i], x + i * rows + idx[0], sizeof xt[i]);
        } else {
            for (int64_t k = 0; k < 8; k++) xt[i][k] = x[i * rows + idx[k < m ? k : 0]];
        }
    }
    for (int64_t u = 0; u < H; u += 8) dense8(xt, F, w1, H, u, b1, h1 + u);
    fm_mlp_v8 s = xt[0] * 0 + b3;
    for (int64_t u = 0; u < H; u += 8) {
        fm_mlp_v8 h2[8];
        dense8(h1, H, w2, H, u, b2, h2);
        for (int j = 0; j < 8; j++) s += h2[j] * w3[u + j];
    }
    for (int64_t k = 0; k < m; k++) out[idx[k]] = s[k];
}

/* Ranking scores of `rows` feature-major rows. With margin_col >= 0, only eligible rows (feature margin_col >
 * margin_min or feature ema_col > ema_min) run through the MLP; the others get
 * below - x[recency_col] + 1e-3 * x[frequency_col] (the recency/LRU order, far below every eligible row). */
int fm_heat_rank(const float *x, int64_t rows, int64_t F, const float *w1, const float *b1, const float *w2,
                 const float *b2, const float *w3, float b3, int64_t H, int64_t margin_col, float margin_min,
                 int64_t ema_col, float ema_min, int64_t recency_col, int64_t frequency_col, float below,
                 float *out) {
    if (H % 8 != 0 || H > FM_MLP_MAX_HIDDEN || H <= 0 || F <= 0 || F > FM_MLP_MAX_FEATURES) return 1;
    if (margin_col >= F || ema_col >= F || recency_col >= F || frequency_col >= F) return 1;
    int64_t idx[8];
    int64_t m = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (margin_col >= 0 && !(x[margin_col * rows + r] > margin_min) && !(x[ema_col * rows + r] > ema_min)) {
            out[r] = below - x[recency_col * rows + r] + 1e-3f * x[frequency_col * rows + r];
            continue;
        }
        idx[m++] = r;
        if (m == 8) {
            mlp8(x, rows, F, idx, 8, w1, b1, w2, b2, w3, b3, H, out);
            m = 0;
        }
    }
    if (m) mlp8(x, rows, F, idx, m, w1, b1, w2, b2, w3, b3, H, out);
    return 0;
}
