/* Attention of one query row per sequence over its KV blocks, read in place: for each row b and
 * head h, out[b, h] = softmax(q[b, h] · K[j] · scale) · V[j] over the columns j of the row's
 * context (positions lo .. position[b], lo > position - window on a sliding-window layer), column
 * j read from slot blocks[b, j / block_size] * block_size + j % block_size of the layer's caches
 * ([slots, kv_heads, dim], fp32, bf16 or fp16: `format`, vectors.h's CACHE_*); head h reads kv head
 * h / (heads / kv_heads).
 *
 * Why a kernel of our own: the decode rows' attention copied every row's blocks into a dense
 * tensor each layer and called SDPA (about 36 µs a layer at batch 1 on the default model, most of
 * it the call), and a compiled step must round like the eager one: both call this.
 *
 * Each score is computed alone (VW lanes over dim, then the lanes pairwise) and each head's
 * softmax (max, sum) and weighted values over j ascending by one thread, whatever the rows beside
 * it or the thread count: a row gets the same bits alone and in any batch. The work is cut into
 * score tasks of SPAN columns of one kv head, then one task per head, so both threads share one
 * row's kv heads at a long context; columns are located block by block and read ahead (a division
 * per column and a prefetcher that loses the stride at each block took a 1,704-token context's
 * 30 layers from 6.9 to 9.2 ms a step on two AVX2 cores). VW is the
 * machine's vector width (16 floats with AVX-512, 8 with AVX2: AVX2's 16 registers held a 16-lane
 * loop's accumulators only on the stack, 5 to 8 times slower). A bf16 or fp16 cache's values are
 * widened exactly (a bf16 is the top half of an fp32; fp16 through F16C). exp is a polynomial
 * (Cephes' expf, about 1 ulp) in vector form. Returns -1 where a buffer cannot be had. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"

#define MAX_GROUP 16                /* query heads per kv head */
#define MAX_DIM 256                 /* head width */
#define MAX_CHUNKS (MAX_DIM / VW)

/* columns read ahead: a cache's rows lie a block's table entry apart every block_size columns,
 * where the hardware's prefetcher loses the stride (a 1,704-token context read 30 layers' caches
 * at 4 to 9 GB/s without it) */
#define PREFETCH 8

static inline void fetch(const char *p, long bytes) {
    for (long i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
}




/* Where each column j of lo .. hi-1 lies in the caches (bytes from their start), found block by
 * block into at[j - lo]: a division per column and pass cost more than the arithmetic at a long
 * context. */
static void column_offsets(long *at, const int64_t *table, long lo, long from, long to, long kv, long kv_heads,
                           long row_bytes, long block_size) {
    for (long j = from; j < to;) {
        long block = j / block_size, end = (block + 1) * block_size < to ? (block + 1) * block_size : to;
        long base = table[block] * block_size - block * block_size;
        for (; j < end; j++) at[j - lo] = ((base + j) * kv_heads + kv) * row_bytes;
    }
}

/* The scores of columns from .. to-1 (indices into at and s) for the `group` heads at q: s[g * stride + j].
 * Four columns at a time: each score is one chain of fused multiply-adds, whose latency left the
 * units idle one column at a time (3 to 4x slower at a long context); a score's bits are the same
 * in either loop. at[] holds PREFETCH readable entries past `to`. */
static inline __attribute__((always_inline)) void score_columns(const float *q, const char *keys, const long *at,
                                                               long from, long to, long group, long dim, long stride,
                                                               float scale, float *s, int format, const long chunks) {
    long width = format == CACHE_FP32 ? 4 : 2, j = from;
    for (; j + 4 <= to; j += 4) {
        const char *k[4];
        for (int i = 0; i < 4; i++) {
            k[i] = keys + at[j + i];
            fetch(keys + at[j + i + PREFETCH], dim * width);
        }
        for (long g = 0; g < group; g++) {
            const float *qg = q + g * dim;
            vf acc[4] = {{0}, {0}, {0}, {0}};
            for (long c = 0; c < chunks; c++) {
                vf qc = load(qg + c * VW);
                for (int i = 0; i < 4; i++) acc[i] += qc * load_kv(k[i] + c * VW * width, format);
            }
            for (int i = 0; i < 4; i++) s[g * stride + j + i] = lanes_sum(acc[i]) * scale;
        }
    }
    for (; j < to; j++) {
        const char *k = keys + at[j];
        vf kc[MAX_CHUNKS];
        for (long c = 0; c < chunks; c++) kc[c] = load_kv(k + c * VW * width, format);
        for (long g = 0; g < group; g++) {
            const float *qg = q + g * dim;
            vf acc = {0};
            for (long c = 0; c < chunks; c++) acc += load(qg + c * VW) * kc[c];
            s[g * stride + j] = lanes_sum(acc) * scale;
        }
    }
}

/* One head's output from its n scores s (VW entries of room past them): softmax in place, then the
 * values weighted over the columns in ascending order. `fetch_values`: read the values ahead (the
 * first of a kv head's query heads; the others find them cached). */
static inline __attribute__((always_inline)) void weigh_values(float *s, long n, const char *values, const long *at,
                                                              long dim, float *out, int format, int fetch_values,
                                                              const long chunks) {
    long width = format == CACHE_FP32 ? 4 : 2;
    float max = s[0];
    for (long j = 1; j < n; j++) max = s[j] > max ? s[j] : max;
    for (long j = n; j < n + VW; j++) s[j] = max - 1000.0f;  /* padding: exp gives 0 */
    vf total = {0};
    for (long j = 0; j < n; j += VW) {
        vf e = vexp(load(s + j) - max);
        memcpy(s + j, &e, sizeof e);
        total += e;
    }
    float inverse = 1.0f / lanes_sum(total);
    vf acc[MAX_CHUNKS];
    for (long c = 0; c < chunks; c++) acc[c] = (vf){0};
    for (long j = 0; j < n; j++) {
        const char *v = values + at[j];
        if (fetch_values) fetch(values + at[j + PREFETCH], dim * width);
        float weight = s[j];
        for (long c = 0; c < chunks; c++) acc[c] += weight * load_kv(v + c * VW * width, format);
    }
    for (long c = 0; c < chunks; c++) {
        vf o = acc[c] * inverse;
        memcpy(out + c * VW, &o, sizeof o);
    }
}

/* `chunks` = dim / VW as a constant where the caller can make it one (the accumulators then stay in
 * registers) */
#define BY_CHUNKS(call)                                                                                               \
    switch (dim / VW) {                                                                                               \
    case 64 / VW: { const long chunks = 64 / VW; call; break; }                                                      \
    case 128 / VW: { const long chunks = 128 / VW; call; break; }                                                    \
    default: { const long chunks = dim / VW; call; }                                                                  \
    }

/* columns per score task of the split form */
#define SPAN 128

int one_query_attention(const float *q, const void *keys, const void *values, const int64_t *blocks,
                        const int64_t *positions, float *out, long rows, long heads, long kv_heads, long dim,
                        long table_width, long block_size, long window, float scale, int format, int threads) {
    long group = heads / kv_heads, row_bytes = dim * (format == CACHE_FP32 ? 4 : 2), columns = 0, tasks = 0;
    if (format < CACHE_FP32 || format > CACHE_FP16 || dim % 16 || dim > MAX_DIM || group > MAX_GROUP || heads % kv_heads) return -2;
    long *lo = malloc(sizeof(long) * 4 * rows), *n = lo + rows, *first = n + rows, *spans = first + rows;
    if (!lo) return -1;
    for (long b = 0; b < rows; b++) {
        long hi = positions[b] + 1;
        lo[b] = window > 0 && hi > window ? hi - window : 0;
        n[b] = hi - lo[b];
        first[b] = columns;  /* where the row's columns start in the scratch */
        columns += n[b] + VW + PREFETCH;
        spans[b] = (n[b] + SPAN - 1) / SPAN;
        tasks += spans[b] * kv_heads;
    }
    /* every head's scores, then every kv head's column offsets */
    float *scores = malloc(sizeof(float) * columns * heads + sizeof(long) * columns * kv_heads);
    if (!scores) {
        free(lo);
        return -1;
    }
    long *offsets = (long *)(scores + columns * heads);
    const char *k = keys, *v = values;
    /* Each score is computed alone and each head's softmax and weighted sum in one fixed order, by
     * one thread: the bits are the same whichever thread does which part, alone or in any batch. The
     * work is split into score tasks (a kv head's SPAN columns) and then one task per head, so that
     * both threads work on one row's three kv heads at a long context (a task per kv head left one
     * thread idle a third of the time). */
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) if (columns * kv_heads * dim >= 65536)
#endif
    {
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
        for (long task = 0; task < tasks; task++) {
            long b = 0, t = task;
            while (t >= spans[b] * kv_heads) t -= spans[b++] * kv_heads;
            long kv = t / spans[b], from = (t % spans[b]) * SPAN, to = from + SPAN < n[b] ? from + SPAN : n[b];
            long *at = offsets + kv * columns + first[b];
            /* the offsets a score task reads ahead are its next span's: found here too */
            long ahead = to + PREFETCH < n[b] ? to + PREFETCH : n[b];
            column_offsets(at, blocks + b * table_width, lo[b], lo[b] + from, lo[b] + ahead, kv, kv_heads, row_bytes,
                           block_size);
            for (long i = ahead; i < to + PREFETCH; i++) at[i] = at[n[b] - 1];
            const float *qb = q + (b * heads + kv * group) * dim;
            float *s = scores + (kv * group) * columns + first[b];
            BY_CHUNKS(score_columns(qb, k, at, from, to, group, dim, columns, scale, s, format, chunks))
        }
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
        for (long task = 0; task < rows * heads; task++) {
            long b = task / heads, h = task % heads, kv = h / group;
            long *at = offsets + kv * columns + first[b];
            float *s = scores + h * columns + first[b];
            BY_CHUNKS(weigh_values(s, n[b], v, at, dim, out + (b * heads + h) * dim, format, h % group == 0, chunks))
        }
    }
    (void)threads;
    free(scores);
    free(lo);
    return 0;
}
