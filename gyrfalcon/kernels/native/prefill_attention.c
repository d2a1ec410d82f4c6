/* Attention of a prefill segment's query rows over their sequence's KV blocks, read in place: the
 * rows are positions start .. of one sequence, in the groups the caller cuts them into (attention.py's
 * block_groups, at every multiple of block_size): `cuts` holds each group's first and stop positions,
 * two rows or more each (a group of one row is a decode row's, one_query_attention.c). Row r at position p and head h:
 * out[r, h] = softmax(q[r, h] · K[j] · scale) · V[j] over j = lo .. p (lo > p - window on a
 * sliding-window layer), column j read from slot table[j / block_size] * block_size + j % block_size
 * of the layer's caches ([slots, kv_heads, dim], `format`: vectors.h's CACHE_*).
 *
 * Why a kernel of our own: the groups went through SDPA one call each, with the keys and values
 * copied out of the cache and repeated to every query head first; a 1,704-token prompt spent about
 * 1.7 of its 3.6 s there on two AVX2 cores (about 60 GFLOP/s). Here a group's query rows and the
 * query heads of one kv head (16 x 3 on the default model) share every key and value they read: a
 * block of 16 columns is widened and transposed once, then multiplied as a small matrix product.
 *
 * Each score is one chain of fused multiply-adds over dim; each row's softmax runs over its own
 * columns only, and its weighted values sum over its own columns in ascending order: a row's bits
 * depend on its own query and context, not on the rows beside it, the thread count or which thread
 * computes it. Returns -1 where a buffer cannot be
 * had, -2 for a shape it does not take. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"

#define MAX_DIM 256
#define COLUMNS (2 * VW)      /* a block of columns (two vectors): widened and transposed once */
#define QUERIES 6             /* query vectors of a tile of scores: 12 accumulators, 2 keys, 1 query */
#define HEADS 3               /* query heads of a tile of weighted values ... */
#define DIMS 4                /* ... times this many vectors of dim: 12 accumulators, 4 values */

/* one row of the cache (dim values from element `at`) widened into out */
static inline void widen_row(const void *cache, long at, long dim, int format, float *out) {
    const char *row = (const char *)cache + at * (format == CACHE_FP32 ? 4 : 2);
    for (long d = 0; d < dim; d += VW) store(out + d, load_kv(row + d * (format == CACHE_FP32 ? 4 : 2), format));
}

/* scores s[i * stride + j] = q_i · K[j] · scale for the `queries` query vectors q[i] over the
 * columns of `blocks` blocks of kt (each [dim][COLUMNS], block b holding columns b * COLUMNS ..) */
static void scores(const float *const *q, long queries, const float *kt, long blocks, long dim, float scale, float *s,
                   long stride) {
    for (long b = 0; b < blocks; b++) {
        const float *kb = kt + b * dim * COLUMNS;
        float *sb = s + b * COLUMNS;
        long i = 0;
        for (; i + QUERIES <= queries; i += QUERIES) {
            vf acc[QUERIES][2];
            for (int a = 0; a < QUERIES; a++) acc[a][0] = acc[a][1] = (vf){0};
            for (long d = 0; d < dim; d++) {
                vf k0 = load(kb + d * COLUMNS), k1 = load(kb + d * COLUMNS + VW);
                for (int a = 0; a < QUERIES; a++) {
                    float x = q[i + a][d];
                    acc[a][0] += x * k0;
                    acc[a][1] += x * k1;
                }
            }
            for (int a = 0; a < QUERIES; a++) {
                store(sb + (i + a) * stride, acc[a][0] * scale);
                store(sb + (i + a) * stride + VW, acc[a][1] * scale);
            }
        }
        for (; i < queries; i++) {
            vf acc0 = {0}, acc1 = {0};
            for (long d = 0; d < dim; d++) {
                acc0 += q[i][d] * load(kb + d * COLUMNS);
                acc1 += q[i][d] * load(kb + d * COLUMNS + VW);
            }
            store(sb + i * stride, acc0 * scale);
            store(sb + i * stride + VW, acc1 * scale);
        }
    }
}

/* out[h] (h < heads) = Σ_j w[h][j] · vs[j] · inverse[h] over columns
 * from .. to-1 in ascending order, for `vectors` vectors of dim from d0 */
static inline void weigh(const float *const *w, const float *vs, long dim, long from, long to, long d0, int heads,
                         int vectors, const float *inverse, float *const *out) {
    if (heads == HEADS && vectors == DIMS) {
        vf acc[HEADS][DIMS];
        for (int h = 0; h < HEADS; h++)
            for (int v = 0; v < DIMS; v++) acc[h][v] = (vf){0};
        for (long j = from; j < to; j++) {
            vf x[DIMS];
            for (int v = 0; v < DIMS; v++) x[v] = load(vs + j * dim + d0 + v * VW);
            for (int h = 0; h < HEADS; h++) {
                float weight = w[h][j];
                for (int v = 0; v < DIMS; v++) acc[h][v] += weight * x[v];
            }
        }
        for (int h = 0; h < HEADS; h++)
            for (int v = 0; v < DIMS; v++) store(out[h] + d0 + v * VW, acc[h][v] * inverse[h]);
        return;
    }
    for (int h = 0; h < heads; h++)
        for (int v = 0; v < vectors; v++) {
            vf acc = {0};
            for (long j = from; j < to; j++) acc += w[h][j] * load(vs + j * dim + d0 + v * VW);
            store(out[h] + d0 + v * VW, acc * inverse[h]);
        }
}

/* Columns lo .. lo+n-1 of kv head kv (their blocks padded with the last column): the keys widened and
 * transposed a block at a time into kt ([blocks][dim][COLUMNS]), the values widened into vs ([n][dim]);
 * of the blocks from .. to-1 only. */
static void widen_columns(const void *keys, const void *values, const int64_t *table, long lo, long n, long from,
                          long to, long kv, long kv_heads, long dim, long block_size, int format, float *kt, float *vs) {
    float row[MAX_DIM];
    for (long c = from * COLUMNS; c < to * COLUMNS; c++) {
        long j = lo + (c < n ? c : n - 1);
        long at = ((table[j / block_size] * block_size + j % block_size) * kv_heads + kv) * dim;
        float *kb = kt + (c / COLUMNS) * dim * COLUMNS + c % COLUMNS;
        widen_row(keys, at, dim, format, row);
        for (long d = 0; d < dim; d++) kb[d * COLUMNS] = row[d];
        if (c < n) widen_row(values, at, dim, format, vs + c * dim);
    }
}

/* One group (rows at positions first .. stop-1) and one kv head: every score, each row's softmax,
 * then the weighted values. `work` holds group_floats(...) floats. Where `kt` is given, the kv
 * head's columns from 0 are widened there already (widen_columns), and its values in `vs`. */
static void group_task(const float *q, const void *keys, const void *values, const int64_t *table, long first,
                       long stop, long kv, long heads, long kv_heads, long dim, long block_size, long window,
                       float scale, int format, float *out, float *work, const float *kt, const float *vs) {
    long group = heads / kv_heads, rows = stop - first, queries = rows * group;
    long lo = window > 0 && first + 1 > window ? first + 1 - window : 0; /* the first row's first column */
    long n = stop - lo, blocks = (n + COLUMNS - 1) / COLUMNS, stride = blocks * COLUMNS + VW + 1;
    float *s = work;
    if (!kt) {
        float *own_kt = s + queries * stride, *own_vs = own_kt + blocks * dim * COLUMNS;
        widen_columns(keys, values, table, lo, n, 0, blocks, kv, kv_heads, dim, block_size, format, own_kt, own_vs);
        kt = own_kt;
        vs = own_vs;
    }
    const float *qv[16 * 16];
    for (long i = 0; i < queries; i++) qv[i] = q + ((i / group) * heads + kv * group + i % group) * dim;
    scores(qv, queries, kt, blocks, dim, scale, s, stride);
    /* each row's softmax over its own columns lo_r .. p, in place (the inverse of its sum kept at
     * the end of its scores' room) */
    for (long i = 0; i < queries; i++) {
        long p = first + i / group, lo_r = window > 0 && p + 1 > window ? p + 1 - window : 0;
        long count = p - lo_r + 1;
        float *own = s + i * stride + (lo_r - lo);
        float max = own[0]; /* a max is the same in any order: in vectors */
        long j = 0;
        if (count >= VW) {
            vf m = load(own);
            for (j = VW; j + VW <= count; j += VW) {
                vf x = load(own + j);
                vi greater = x > m, xi, mi;
                memcpy(&xi, &x, sizeof x);
                memcpy(&mi, &m, sizeof m);
                mi = (greater & xi) | (~greater & mi);
                memcpy(&m, &mi, sizeof m);
            }
            for (int l = 0; l < VW; l++) max = m[l] > max ? m[l] : max;
        }
        for (; j < count; j++) max = own[j] > max ? own[j] : max;
        for (j = count; j < count + VW; j++) own[j] = max - 1000.0f; /* padding: exp gives ~0 */
        vf total = {0};
        for (j = 0; j < count; j += VW) {
            vf e = vexp(load(own + j) - max);
            store(own + j, e);
            total += e;
        }
        s[i * stride + stride - 1] = 1.0f / lanes_sum(total);
    }
    /* weighted values: per query vector and dim, one sum over the row's columns in ascending order */
    long vectors = dim / VW;
    for (long r = 0; r < rows; r++) {
        long p = first + r, lo_r = window > 0 && p + 1 > window ? p + 1 - window : 0;
        for (long g0 = 0; g0 < group; g0 += HEADS) {
            int hq = group - g0 < HEADS ? (int)(group - g0) : HEADS;
            const float *w[HEADS];
            float inverse[HEADS], *o[HEADS];
            for (int h = 0; h < hq; h++) {
                long i = r * group + g0 + h;
                w[h] = s + i * stride;
                inverse[h] = s[i * stride + stride - 1];
                o[h] = out + (r * heads + kv * group + g0 + h) * dim;
            }
            for (long v0 = 0; v0 < vectors; v0 += DIMS) {
                int nv = vectors - v0 < DIMS ? (int)(vectors - v0) : DIMS;
                weigh(w, vs, dim, lo_r - lo, p + 1 - lo, v0 * VW, hq, nv, inverse, o);
            }
        }
    }
}

/* the floats group_task's work takes for a group reaching `columns` columns */
static size_t group_floats(long queries, long columns, long dim) {
    long blocks = (columns + COLUMNS - 1) / COLUMNS;
    return (size_t)queries * (blocks * COLUMNS + VW + 1) + (size_t)blocks * dim * COLUMNS + (size_t)columns * dim;
}

int prefill_attention(const float *q, const void *keys, const void *values, const int64_t *table, float *out,
                      const int64_t *cuts, long groups, long start, long heads, long kv_heads, long dim,
                      long block_size, long window, float scale, int format, int threads) {
    long group = heads / kv_heads, longest = 0;
    if (format < CACHE_FP32 || format > CACHE_FP16 || dim % VW || dim > MAX_DIM || heads % kv_heads || group > 16)
        return -2;
    for (long g = 0; g < groups; g++) {
        if (cuts[2 * g + 1] - cuts[2 * g] > 16 || cuts[2 * g] < start) return -2; /* qv holds 16 rows x 16 heads */
        if (cuts[2 * g + 1] > longest) longest = cuts[2 * g + 1];
    }
    if (groups == 0) return 0;
    size_t scratch = group_floats(16 * group, longest, dim);
    /* without a window every group reads its columns from 0: each kv head's are widened once, shared */
    long shared_blocks = (longest + COLUMNS - 1) / COLUMNS;
    size_t per_head = (size_t)shared_blocks * dim * COLUMNS + (size_t)longest * dim;
    float *shared = window > 0 ? NULL : malloc(sizeof(float) * per_head * kv_heads);
    int failed = 0;
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) if (groups * kv_heads > 1)
#endif
    {
        float *work = malloc(sizeof(float) * scratch);
        if (!work) {
#if defined(_OPENMP)
#pragma omp atomic write
#endif
            failed = 1;
        }
        if (shared) {
            long spans = (shared_blocks + 15) / 16;
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
            for (long task = 0; task < kv_heads * spans; task++) {
                long kv = task / spans, from = (task % spans) * 16, to = from + 16 < shared_blocks ? from + 16 : shared_blocks;
                float *kt = shared + kv * per_head;
                widen_columns(keys, values, table, 0, longest, from, to, kv, kv_heads, dim, block_size, format, kt,
                              kt + (size_t)shared_blocks * dim * COLUMNS);
            }
        }
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
        for (long task = 0; task < groups * kv_heads; task++) {
            if (!work) continue;
            long g = task / kv_heads, kv = task % kv_heads, first = cuts[2 * g], stop = cuts[2 * g + 1];
            const float *kt = shared ? shared + kv * per_head : NULL;
            group_task(q + (first - start) * heads * dim, keys, values, table, first, stop, kv, heads, kv_heads, dim,
                       block_size, window, scale, format, out + (first - start) * heads * dim, work, kt,
                       kt ? kt + (size_t)shared_blocks * dim * COLUMNS : NULL);
        }
        free(work);
    }
    free(shared);
    (void)threads;
    return failed ? -1 : 0;
}
