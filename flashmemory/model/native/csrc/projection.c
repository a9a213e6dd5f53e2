/* A projection's decode GEMV over its stored parts (see projection.h). */
#include <stddef.h>
#include <stdint.h>

#include "projection.h"

/* the functions of quant_gemv.c and q8_gemv.c (one library) */
int fm_qgemv(int type, const uint8_t *w, int64_t rows, int64_t cols, int64_t row_bytes,
             const float *x, int64_t num_x, int64_t x_stride, float *y, int64_t y_stride,
             int num_threads);
int fm_qgemv_x8(int type, const uint8_t *w, int64_t rows, int64_t cols, int64_t row_bytes,
                const void *xq, int64_t num_x, float *y, int64_t y_stride, int num_threads);
void fm_quantize_x8(const float *x, int64_t num_x, int64_t x_stride, int64_t cols, void *xq,
                    int layouts);

int fm_project(const fm_proj *p, const float *x, int64_t num_x, int64_t x_stride, void *xq,
               float *y, int threads) {
    if (p->x8_layouts)
        fm_quantize_x8(x, num_x, x_stride, p->parts[0].cols, xq, (int)p->x8_layouts);
    for (int64_t i = 0; i < p->num_parts; i++) {
        const fm_part *q = p->parts + i;
        const int rc = q->int8
            ? fm_qgemv_x8((int)q->type, q->blocks, q->rows, q->cols, q->row_bytes, xq, num_x,
                          y + q->start, p->out_features, threads)
            : fm_qgemv((int)q->type, q->blocks, q->rows, q->cols, q->row_bytes, x, num_x, x_stride,
                       y + q->start, p->out_features, threads);
        if (rc != 0) return rc;
    }
    if (p->bias != NULL)
        for (int64_t r = 0; r < num_x; r++)
            for (int64_t c = 0; c < p->out_features; c++) y[r * p->out_features + c] += p->bias[c];
    return 0;
}
