/* What decode_attention.c shares with decode_batch.c: the kernel's limits, the fold of a range of
 * block records into an online-softmax state, the merge of two states and the dense folds (state
 * layout: see decode_attention.c). */
#ifndef FM_DECODE_ATTENTION_H
#define FM_DECODE_ATTENTION_H

#include <stdint.h>

#define FM_MAX_TOKENS 64 /* tokens decoded at once (a block, or a tile of dense keys) */
#define FM_MAX_DIM 256
#define FM_MAX_GROUP 32 /* query heads per KV head */
#define FM_MIN_BLOCKS_PER_THREAD 4 /* below this a second thread costs more than it saves */

typedef _Float16 fm_half;

void fm_fold_records(const float *q, int64_t H, int64_t G, int64_t D, const uint8_t *storage,
                     int64_t num_slots, int64_t record_bytes, const int64_t *slots,
                     int64_t slot_stride, const int64_t *table, int64_t i0, int64_t i1, int bits,
                     int64_t bs, int64_t kgroup, int64_t vgroup, int64_t codes_off,
                     int64_t ks_off, int64_t kz_off, int64_t vs_off, int64_t vz_off,
                     float *state);
void fm_merge_states(float *state, const float *other, int64_t rows, int64_t D);
int fm_attend_dense(const float *q, int64_t H, int64_t G, int64_t D, const float *k,
                    const float *v, int64_t m, float *state);
int fm_attend_dense_f16(const float *q, int64_t H, int64_t G, int64_t D, const fm_half *k,
                        const fm_half *v, int64_t m, int64_t head_stride, int64_t row_stride,
                        float *state);

#endif
