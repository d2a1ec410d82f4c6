/* Attention of one query row per sequence over its KV blocks, read in place: for each row b and
 * head h, out[b, h] = softmax(q[b, h] · K[j] · scale) · V[j] over the columns j of the row's
 * context (positions lo .. position[b], lo > position - window on a sliding-window layer), column
 * j read from slot blocks[b, j / block_size] * block_size + j % block_size of the layer's caches
 * ([slots, kv_heads, dim], fp32 or bf16); head h reads kv head h / (heads / kv_heads).
 *
 * Why a kernel of our own: the decode rows' attention copied every row's blocks into a dense
 * tensor each layer and called SDPA (about 36 µs a layer at batch 1 on the default model, most of
 * it the call), and a compiled step must round like the eager one: both call this.
 *
 * Each output is computed by one thread in one fixed order (scores in VW lanes over dim then the
 * lanes pairwise, the softmax's max, sum and weighted values over j ascending), whatever the rows
 * beside it or the thread count: a row gets the same bits alone and in any batch. VW is the
 * machine's vector width (16 floats with AVX-512, 8 with AVX2: AVX2's 16 registers held a 16-lane
 * loop's accumulators only on the stack, 5 to 8 times slower). A bf16 cache's values are widened
 * exactly (a bf16 is the top half of an fp32). exp is a polynomial (Cephes' expf, about 1 ulp) in
 * vector form. Returns -1 where a buffer cannot be had. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vectors.h"

typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));

#define MAX_GROUP 16                /* query heads per kv head */
#define MAX_DIM 256                 /* head width */
#define MAX_CHUNKS (MAX_DIM / VW)

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }

/* VW cache values, fp32 or bf16 (widened exactly) */
static inline vf load_kv(const void *p, int bf16) {
    if (!bf16) return load((const float *)p);
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline float lanes_sum(vf v) {
#if VW == 16
    typedef float v8 __attribute__((vector_size(32)));
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    vf a = v;
#endif
    typedef float v4 __attribute__((vector_size(16)));
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline vf vexp(vf x) {
    const vf zero = {0}, lo = zero - 87.3f;
    vi below = x < lo, xi, loi;
    memcpy(&xi, &x, sizeof x);
    memcpy(&loi, &lo, sizeof lo);
    xi = (below & loi) | (~below & xi);  /* max(x, -87.3): exp is 0 to fp32 below it */
    memcpy(&x, &xi, sizeof x);
    vf y = x * 1.44269504088896341f + 0.5f;
    vf n = __builtin_convertvector(__builtin_convertvector(y, vi), vf);
    n += __builtin_convertvector(n > y, vf);  /* floor: truncation rounded up a negative y */
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* the outputs of the `group` heads of kv head `kv` of row b; `chunks` = dim / VW, a constant where
 * the caller can make it one (the accumulators then stay in registers) */
static inline __attribute__((always_inline)) int attend(const float *q, const char *keys, const char *values,
                                                        const int64_t *table, long lo, long hi, long kv, long kv_heads,
                                                        long dim, long block_size, long group, float scale, float *out,
                                                        int bf16, const long chunks) {
    long n = hi - lo, width = bf16 ? 2 : 4;
    float *scores = malloc(sizeof(float) * group * (n + VW));
    if (!scores) return -1;
    long j = lo;
    /* four columns at a time: each score is one chain of fused multiply-adds, whose latency left the
     * units idle one column at a time (3 to 4x slower at a long context); a score's bits are the same */
    for (; j + 4 <= hi; j += 4) {
        const char *k[4];
        for (int i = 0; i < 4; i++) {
            long slot = table[(j + i) / block_size] * block_size + (j + i) % block_size;
            k[i] = keys + (slot * kv_heads + kv) * dim * width;
        }
        for (long g = 0; g < group; g++) {
            const float *qg = q + g * dim;
            vf acc[4] = {{0}, {0}, {0}, {0}};
            for (long c = 0; c < chunks; c++) {
                vf qc = load(qg + c * VW);
                for (int i = 0; i < 4; i++) acc[i] += qc * load_kv(k[i] + c * VW * width, bf16);
            }
            for (int i = 0; i < 4; i++) scores[g * (n + VW) + (j + i - lo)] = lanes_sum(acc[i]) * scale;
        }
    }
    for (; j < hi; j++) {
        long slot = table[j / block_size] * block_size + j % block_size;
        const char *k = keys + (slot * kv_heads + kv) * dim * width;
        vf kc[MAX_CHUNKS];
        for (long c = 0; c < chunks; c++) kc[c] = load_kv(k + c * VW * width, bf16);
        for (long g = 0; g < group; g++) {
            const float *qg = q + g * dim;
            vf acc = {0};
            for (long c = 0; c < chunks; c++) acc += load(qg + c * VW) * kc[c];
            scores[g * (n + VW) + (j - lo)] = lanes_sum(acc) * scale;
        }
    }
    for (long g = 0; g < group; g++) {
        float *s = scores + g * (n + VW);
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
        for (long j = lo; j < hi; j++) {
            long slot = table[j / block_size] * block_size + j % block_size;
            const char *v = values + (slot * kv_heads + kv) * dim * width;
            float weight = s[j - lo];
            for (long c = 0; c < chunks; c++) acc[c] += weight * load_kv(v + c * VW * width, bf16);
        }
        for (long c = 0; c < chunks; c++) {
            vf o = acc[c] * inverse;
            memcpy(out + g * dim + c * VW, &o, sizeof o);
        }
    }
    free(scores);
    return 0;
}

static int attend_any(const float *q, const char *keys, const char *values, const int64_t *table, long lo, long hi,
                      long kv, long kv_heads, long dim, long block_size, long group, float scale, float *out, int bf16) {
#define ATTEND(c) attend(q, keys, values, table, lo, hi, kv, kv_heads, dim, block_size, group, scale, out, bf16, c)
    switch (dim / VW) {
    case 64 / VW: return ATTEND(64 / VW);
    case 128 / VW: return ATTEND(128 / VW);
    default: return ATTEND(dim / VW);
    }
#undef ATTEND
}

int one_query_attention(const float *q, const void *keys, const void *values, const int64_t *blocks,
                        const int64_t *positions, float *out, long rows, long heads, long kv_heads, long dim,
                        long table_width, long block_size, long window, float scale, int bf16, int threads) {
    long group = heads / kv_heads, tasks = rows * kv_heads, work = 0;
    int failed = 0;
    if (dim % 16 || dim > MAX_DIM || group > MAX_GROUP || heads % kv_heads) return -2;
    for (long b = 0; b < rows; b++) work += positions[b] + 1;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (work * kv_heads * dim >= 65536)
#endif
    for (long task = 0; task < tasks; task++) {
        long b = task / kv_heads, kv = task % kv_heads;
        long hi = positions[b] + 1, lo = window > 0 && hi > window ? hi - window : 0;
        const float *qb = q + (b * heads + kv * group) * dim;
        float *ob = out + (b * heads + kv * group) * dim;
        if (attend_any(qb, keys, values, blocks + b * table_width, lo, hi, kv, kv_heads, dim, block_size, group, scale,
                       ob, bf16))
            failed = 1;
    }
    (void)threads;
    return failed ? -1 : 0;
}
