/* One decoder layer of a decode step in two native calls, Python only for the KV cache between:
 *   fm_layer_pre:  RMSNorm -> the q/k/v projection (+ bias) -> RoPE on q and k, in place
 *   fm_layer_post: o projection -> residual -> RMSNorm -> gate/up -> SwiGLU -> down -> residual
 * Each step is the very function the per-op path of llama.py calls (fm_rmsnorm, fm_project,
 * fm_rope, fm_swiglu) in the same order on the same float32 rows, and the residual adds are the
 * single float additions torch makes, so both paths compute the same bits: the fusion removes
 * ~20 torch dispatches and Python calls per layer, not arithmetic. */
#include <stddef.h>
#include <stdint.h>

#include "projection.h"

/* the functions of step_ops.c (one library with projection.c) */
void fm_rmsnorm(const float *x, int64_t x_stride, const float *w, int64_t T, int64_t dim, float eps,
                float *out);
void fm_rope(float *x, int64_t x_stride, int64_t T, int64_t H, int64_t D, const float *cos_t,
             const float *sin_t);
void fm_swiglu(const float *gu, int64_t T, int64_t I, float *out);

/* x [T][dim] -> qkv [T][q + 2 kv] with q and k rotated by cos/sin [T][head_dim]; normed [T][dim]
 * and xq (fm_x8 blocks for T rows of dim) are scratch. Returns 0 or a GEMV's refusal code. */
int fm_layer_pre(const float *x, int64_t T, int64_t dim, const float *norm_w, float eps,
                 const fm_proj *qkv, int64_t heads, int64_t kv_heads, int64_t head_dim,
                 const float *cos_t, const float *sin_t, float *normed, void *xq, float *out,
                 int threads) {
    fm_rmsnorm(x, dim, norm_w, T, dim, eps, normed);
    const int rc = fm_project(qkv, normed, T, dim, xq, out, threads);
    if (rc != 0) return rc;
    fm_rope(out, qkv->out_features, T, heads, head_dim, cos_t, sin_t);
    fm_rope(out + heads * head_dim, qkv->out_features, T, kv_heads, head_dim, cos_t, sin_t);
    return 0;
}

/* x_out [T][dim] = h + mlp(norm(h)) for h = x + o(attn), attn [T][q] rows attn_stride apart.
 * Scratch: proj [T][dim], normed [T][dim], gate_up [T][2 inter], hidden [T][inter], xq (for the
 * widest input). */
int fm_layer_post(const float *x, const float *attn, int64_t attn_stride, int64_t T, int64_t dim,
                  const fm_proj *o, const float *norm_w, float eps, const fm_proj *gate_up,
                  const fm_proj *down, int64_t inter, float *proj, float *normed, float *gu,
                  float *hidden, void *xq, float *x_out, int threads) {
    int rc = fm_project(o, attn, T, attn_stride, xq, proj, threads);
    if (rc != 0) return rc;
    for (int64_t i = 0; i < T * dim; i++) x_out[i] = x[i] + proj[i];
    fm_rmsnorm(x_out, dim, norm_w, T, dim, eps, normed);
    if ((rc = fm_project(gate_up, normed, T, dim, xq, gu, threads)) != 0) return rc;
    fm_swiglu(gu, T, inter, hidden);
    if ((rc = fm_project(down, hidden, T, inter, xq, proj, threads)) != 0) return rc;
    for (int64_t i = 0; i < T * dim; i++) x_out[i] += proj[i];
    return 0;
}
