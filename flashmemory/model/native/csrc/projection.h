/* A projection's decode GEMV over its stored parts (projection.c), shared by QuantizedLinear's
 * decode path (model/linear.py) and the fused decode layer (decode_layer.c). */
#ifndef FM_PROJECTION_H
#define FM_PROJECTION_H
#include <stdint.h>

/* One stored part of a projection's rows ([q; k; v] or [gate; up] may be one part or several). */
typedef struct {
    int64_t int8;       /* 1: x rounded to 8 bits for this part (decode_activations by format) */
    int64_t type;       /* GGUF type id */
    const uint8_t *blocks;
    int64_t rows, cols, row_bytes;
    int64_t start;      /* its first output column */
} fm_part;

typedef struct {
    const fm_part *parts;
    int64_t num_parts;
    int64_t out_features;
    const float *bias;  /* NULL or [out_features] */
    int64_t x8_layouts; /* fm_quantize_x8's layouts: those of 8-bit x its parts read (0: none) */
} fm_proj;

/* y [num_x][out_features] = x W^T (+ b): x rounded to 8 bits once into xq (fm_x8_bytes) in each
 * layout a part reads, each part's GEMV, then the bias. Returns 0 or the first GEMV's refusal
 * code. */
int fm_project(const fm_proj *p, const float *x, int64_t num_x, int64_t x_stride, void *xq,
               float *y, int threads);
#endif
