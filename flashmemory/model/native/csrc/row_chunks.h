/* How the GEMVs (quant_gemv.c, q8_gemv.c) split a weight's rows over their threads. */
#ifndef FM_ROW_CHUNKS_H
#define FM_ROW_CHUNKS_H
#include <stdint.h>

/* Rows per dynamic chunk: four chunks per thread, each a contiguous run of rows, so that a thread
 * streams its own ranges of the weights from memory (interleaved chunks of 16 rows measured
 * 1.4-1.5x slower out of cache at two threads: Q4_K 8960 x 1536 over 310 MB), and a thread that
 * loses its core on a shared machine still leaves its last chunks to the others. */
static inline int64_t fm_row_chunk(int64_t rows, int threads) {
    const int64_t chunk = rows / (4 * (int64_t)(threads > 0 ? threads : 1));
    return chunk < 16 ? 16 : chunk;
}
#endif
