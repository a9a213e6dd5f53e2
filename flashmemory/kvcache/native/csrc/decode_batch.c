/* Decode attention of every sequence of a step at one layer in one call: the work of all
 * sequences, KV heads and block chunks is dealt to the OpenMP threads together, where
 * decode_attention.c's entry points split one key set of one sequence at a time (and fold the
 * dense keys on one thread).
 *
 * Each sequence attends to its sources in order: dense keys / values (float32 or fp16 rows) and
 * block records of a pool (as fm_attend_records reads them). A sequence's result is the same bits
 * as the calls
 *     fm_decode_begin, per source fm_attend_dense / _dense_f16 / _records, fm_decode_end
 * with the same thread count, whatever the other sequences of the batch: a records source is
 * still cut into lanes (lane j folds chunks j, j + lanes, ... of FM_MIN_BLOCKS_PER_THREAD blocks),
 * lane 0 into the sequence's running state and the others into their own, merged in lane order
 * before the next source. So the work runs in phases: phase 0 folds every lane j > 0 of every
 * source and, per (sequence, KV head), the sources up to the first records source's lane 0;
 * phase p merges the lanes of the p-th records source and folds on to the next one's lane 0.
 * Which thread takes an item never changes a result: every item writes its own state, in a fixed
 * order.
 */
#include <float.h>
#include <stdlib.h>
#include <string.h>

#include "decode_attention.h"

enum { FM_SOURCE_DENSE = 0, FM_SOURCE_DENSE_F16 = 1, FM_SOURCE_RECORDS = 2 };

/* One key set of one sequence (every field int64: the caller packs a flat array; addresses as
 * integers). dense (float32): k, v [H][m][D] contiguous. dense fp16: row t of head h at
 * k + h * head_stride + t * row_stride (elements; the same for v). records: block i of head h is
 * the record of slot slots[h * slot_stride + i] (or table[that] when table is not 0) in storage
 * [H][num_slots][record_bytes], parts at the byte offsets given (see fm_attend_records). */
typedef struct {
    int64_t kind;
    int64_t k, v, m, head_stride, row_stride;
    int64_t storage, num_slots, record_bytes, slots, slot_stride, table, n;
    int64_t bits, bs, kgroup, vgroup, codes_off, ks_off, kz_off, vs_off, vz_off;
} fm_source;

typedef struct {
    int64_t H, G, D;
    const fm_source *sources;
    const int64_t *seq_start;  /* sources of sequence b: seq_start[b] .. seq_start[b + 1] */
    const float *q;            /* [B][H * G][D], scaled */
    float *states;             /* [B][H][G][D + 2]: each sequence's running state */
    float *partial;            /* lane states of the records sources, [lanes - 1][H][G][D + 2] */
    const int64_t *lanes;      /* per source: 1 for dense ones */
    const int64_t *partial_at; /* per source: its first lane state's index in `partial` */
    int64_t lane_work;         /* phase 0's lane items (one per lane state and KV head) */
} fm_batch;

static int64_t lanes_of(const fm_source *s, int64_t num_threads) {
    if (s->kind != FM_SOURCE_RECORDS) return 1;
    /* as fm_attend_records: no lane with fewer than FM_MIN_BLOCKS_PER_THREAD blocks */
    int64_t lanes = num_threads;
    if (lanes > s->n / FM_MIN_BLOCKS_PER_THREAD) lanes = s->n / FM_MIN_BLOCKS_PER_THREAD;
    return lanes > 1 ? lanes : 1;
}

static void init_state(float *state, int64_t rows, int64_t D) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = state + r * (D + 2);
        memset(row, 0, sizeof(float) * (size_t)D);
        row[D] = -FLT_MAX; /* finite: the kernel is built with -ffast-math */
        row[D + 1] = 0.0f;
    }
}

/* Fold lane `lane` of `lanes` of a records source, KV head h, into state_h ([G][D + 2]). */
static void fold_lane(const fm_batch *bt, const float *qh, const fm_source *s, int64_t h,
                      int64_t lane, int64_t lanes, float *state_h) {
    const uint8_t *storage =
        (const uint8_t *)(intptr_t)s->storage + h * s->num_slots * s->record_bytes;
    const int64_t *slots = (const int64_t *)(intptr_t)s->slots + h * s->slot_stride;
    const int64_t *table = (const int64_t *)(intptr_t)s->table;
    const int64_t step = lanes == 1 ? s->n : FM_MIN_BLOCKS_PER_THREAD;
    for (int64_t i0 = lane * step; i0 < s->n; i0 += lanes * step) {
        const int64_t i1 = i0 + step < s->n ? i0 + step : s->n;
        fm_fold_records(qh, 1, bt->G, bt->D, storage, s->num_slots, s->record_bytes, slots,
                        s->slot_stride, table, i0, i1, (int)s->bits, s->bs, s->kgroup, s->vgroup,
                        s->codes_off, s->ks_off, s->kz_off, s->vs_off, s->vz_off, state_h);
    }
}

static void fold_dense(const fm_batch *bt, const float *qh, const fm_source *s, int64_t h,
                       float *state_h) {
    if (s->kind == FM_SOURCE_DENSE_F16) {
        const fm_half *k = (const fm_half *)(intptr_t)s->k + h * s->head_stride;
        const fm_half *v = (const fm_half *)(intptr_t)s->v + h * s->head_stride;
        fm_attend_dense_f16(qh, 1, bt->G, bt->D, k, v, s->m, s->head_stride, s->row_stride,
                            state_h);
    } else {
        const float *k = (const float *)(intptr_t)s->k + h * s->m * bt->D;
        const float *v = (const float *)(intptr_t)s->v + h * s->m * bt->D;
        fm_attend_dense(qh, 1, bt->G, bt->D, k, v, s->m, state_h);
    }
}

/* Segment `phase` of sequence b's chain for KV head h: merge the lanes of its records source
 * number phase - 1 (phase > 0), then fold on up to and including the next records source's
 * lane 0. */
static void run_segment(const fm_batch *bt, int64_t b, int64_t h, int64_t phase) {
    const int64_t G = bt->G, D = bt->D, size = bt->H * G * (D + 2);
    const float *qh = bt->q + (b * bt->H + h) * G * D;
    float *state_h = bt->states + b * size + h * G * (D + 2);
    int64_t i = bt->seq_start[b];
    const int64_t end = bt->seq_start[b + 1];
    for (int64_t seen = 0; seen < phase; i++) { /* to just after records source phase - 1 */
        if (i == end) return; /* fewer records sources: nothing in this phase */
        seen += bt->sources[i].kind == FM_SOURCE_RECORDS;
    }
    if (phase > 0) {
        const int64_t r = i - 1;
        for (int64_t j = 1; j < bt->lanes[r]; j++) {
            const float *lane = bt->partial + (bt->partial_at[r] + j - 1) * size + h * G * (D + 2);
            fm_merge_states(state_h, lane, G, D);
        }
    }
    for (; i < end; i++) {
        const fm_source *s = &bt->sources[i];
        if (s->kind != FM_SOURCE_RECORDS) {
            fold_dense(bt, qh, s, h, state_h);
        } else {
            fold_lane(bt, qh, s, h, 0, bt->lanes[i], state_h);
            return;
        }
    }
}

/* Item `it` of phase 0: a lane state (fresh, then its chunks of one KV head), or, after the
 * lane_work of them, segment 0 of a (sequence, KV head) chain. */
static void phase_zero(const fm_batch *bt, const int64_t *lane_items, int64_t it) {
    const int64_t H = bt->H, G = bt->G, D = bt->D;
    if (it >= bt->lane_work) {
        run_segment(bt, (it - bt->lane_work) / H, (it - bt->lane_work) % H, 0);
        return;
    }
    const int64_t k = it / H, h = it % H, i = lane_items[2 * k], j = lane_items[2 * k + 1];
    int64_t b = 0;
    while (bt->seq_start[b + 1] <= i) b++;
    float *state_h = bt->partial + (bt->partial_at[i] + j - 1) * H * G * (D + 2) + h * G * (D + 2);
    init_state(state_h, G, D);
    fold_lane(bt, bt->q + (b * H + h) * G * D, &bt->sources[i], h, j, bt->lanes[i], state_h);
}

static int source_ok(const fm_source *s) {
    if (s->kind == FM_SOURCE_DENSE || s->kind == FM_SOURCE_DENSE_F16) return s->m >= 0;
    return s->kind == FM_SOURCE_RECORDS && s->bs <= FM_MAX_TOKENS && s->n >= 0 &&
           (s->bits == 2 || s->bits == 4 || s->bits == 16);
}

/* Attention of B decode queries q [B][H * G][D] (float32, unscaled; `scale` = 1/sqrt(D) as the
 * caller rounds it) over each one's sources (sequence b: sources[seq_start[b] ..
 * seq_start[b + 1])) into out [B][H * G][D]. Returns 0; -1 when a shape is outside the
 * kernel's limits; -2 when scratch memory cannot be allocated. */
int fm_attend_batch(const float *q, float scale, int64_t B, int64_t H, int64_t G, int64_t D,
                    const fm_source *sources, const int64_t *seq_start, int num_threads,
                    float *out) {
    if (D > FM_MAX_DIM || D % 8 || G > FM_MAX_GROUP || G < 1 || B < 0) return -1;
    const int64_t num_sources = seq_start[B], size = H * G * (D + 2);
    int64_t max_records = 0, num_lane_states = 0;
    int dense_last = 0; /* a dense source after a records source (in any sequence) */
    for (int64_t b = 0; b < B; b++) {
        int64_t records = 0;
        for (int64_t i = seq_start[b]; i < seq_start[b + 1]; i++) {
            if (!source_ok(&sources[i])) return -1;
            records += sources[i].kind == FM_SOURCE_RECORDS;
            dense_last |= records > 0 && sources[i].kind != FM_SOURCE_RECORDS;
        }
        max_records = records > max_records ? records : max_records;
    }
    /* Phases run by the threads: 0 .. parallel_phases - 1. When the last phase only merges lanes
     * (the usual step: no dense source after the last records source), this thread runs it after
     * the others are done: a barrier fewer (a wake-up each, with OMP_WAIT_POLICY=PASSIVE). */
    const int64_t parallel_phases = dense_last || max_records == 0 ? max_records + 1 : max_records;
    int64_t *lanes = malloc(sizeof(int64_t) * (size_t)(2 * num_sources + 1));
    float *qs = malloc(sizeof(float) * (size_t)(B * H * G * D + 1));
    float *states = malloc(sizeof(float) * (size_t)(B * size + 1));
    if (lanes == NULL || qs == NULL || states == NULL) {
        free(lanes), free(qs), free(states);
        return -2;
    }
    int64_t *partial_at = lanes + num_sources;
    for (int64_t i = 0; i < num_sources; i++) {
        lanes[i] = lanes_of(&sources[i], num_threads);
        partial_at[i] = num_lane_states;
        num_lane_states += lanes[i] - 1;
    }
    float *partial = NULL;
    int64_t *lane_items = NULL; /* (source, lane) of every lane state */
    if (num_lane_states) {
        partial = malloc(sizeof(float) * (size_t)(num_lane_states * size));
        lane_items = malloc(sizeof(int64_t) * (size_t)(2 * num_lane_states));
        if (partial == NULL || lane_items == NULL) {
            free(lanes), free(qs), free(states), free(partial), free(lane_items);
            return -2;
        }
    }
    for (int64_t i = 0, k = 0; i < num_sources; i++) {
        for (int64_t j = 1; j < lanes[i]; j++, k++) {
            lane_items[2 * k] = i;
            lane_items[2 * k + 1] = j;
        }
    }
    const int64_t lane_work = num_lane_states * H;
    for (int64_t e = 0; e < B * H * G * D; e++) qs[e] = q[e] * scale;
    init_state(states, B * H * G, D);
    const fm_batch bt = {H, G, D, sources, seq_start, qs, states, partial, lanes, partial_at,
                         lane_work};
    const int64_t chains = B * H;
    int threads = num_threads;
    if (threads > chains + lane_work) threads = (int)(chains + lane_work);
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        /* the end of the region is a barrier: the last phase inside it needs none of its own */
        if (parallel_phases > 1) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < lane_work + chains; it++) phase_zero(&bt, lane_items, it);
        } else {
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t it = 0; it < lane_work + chains; it++) phase_zero(&bt, lane_items, it);
        }
        for (int64_t phase = 1; phase < parallel_phases - 1; phase++) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < chains; it++) run_segment(&bt, it / H, it % H, phase);
        }
        if (parallel_phases > 1) {
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t it = 0; it < chains; it++)
                run_segment(&bt, it / H, it % H, parallel_phases - 1);
        }
    }
    for (int64_t phase = parallel_phases; phase <= max_records; phase++) {
        for (int64_t it = 0; it < chains; it++) run_segment(&bt, it / H, it % H, phase);
    }
    for (int64_t r = 0; r < B * H * G; r++) { /* out = acc / l, as fm_decode_end */
        const float *row = states + r * (D + 2);
        const float inv = 1.0f / row[D + 1];
        for (int64_t c = 0; c < D; c++) out[r * D + c] = row[c] * inv;
    }
    free(lanes), free(qs), free(states), free(partial), free(lane_items);
    return 0;
}
