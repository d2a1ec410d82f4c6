/* Attention of one query row per sequence over its KV blocks, read in place: for each row b and
 * head h, out[b, h] = softmax(q[b, h] · K[j] · scale) · V[j] over the columns j of the row's
 * context (positions lo .. position[b], lo > position - window on a sliding-window layer), column
 * j read from slot blocks[b, j / block_size] * block_size + j % block_size of the layer's caches
 * (fp32, [slots, kv_heads, dim]); head h reads kv head h / (heads / kv_heads).
 *
 * Why a kernel of our own: the decode rows' attention copied every row's blocks into a dense
 * tensor each layer and called SDPA (about 36 µs a layer at batch 1 on the default model, most of
 * it the call), and a compiled step must round like the eager one: both call this.
 *
 * Each output is computed by one thread in one fixed order (scores 16 lanes over dim then the
 * lanes pairwise, the softmax's max, sum and weighted values over j ascending), whatever the rows
 * beside it or the thread count: a row gets the same bits alone and in any batch. exp is a
 * polynomial (Cephes' expf, about 1 ulp) in vector form. Returns -1 where a buffer cannot be had. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#define LANES 16
#define MAX_GROUP 16    /* query heads per kv head */
#define MAX_CHUNKS 16   /* dim / LANES */

static inline v16f load(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }

static inline float lanes_sum(v16f acc) {
    float lanes[LANES];
    memcpy(lanes, &acc, sizeof lanes);
    for (int half = LANES / 2; half > 0; half /= 2)
        for (int j = 0; j < half; j++)
            lanes[j] += lanes[j + half];
    return lanes[0];
}

static inline v16f vexp(v16f x) {
    const v16f zero = {0}, lo = zero - 87.3f;
    v16i below = x < lo, xi, loi;
    memcpy(&xi, &x, sizeof x);
    memcpy(&loi, &lo, sizeof lo);
    xi = (below & loi) | (~below & xi);  /* max(x, -87.3): exp is 0 to fp32 below it */
    memcpy(&x, &xi, sizeof x);
    v16f y = x * 1.44269504088896341f + 0.5f;
    v16f n = __builtin_convertvector(__builtin_convertvector(y, v16i), v16f);
    n += __builtin_convertvector(n > y, v16f);  /* floor: truncation rounded up a negative y */
    v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16f p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16f scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* the outputs of the `group` heads of kv head `kv` of row b */
static int attend(const float *q, const float *keys, const float *values, const int64_t *table, long lo,
                  long hi, long kv, long kv_heads, long dim, long block_size, long group, float scale, float *out) {
    long n = hi - lo, chunks = dim / LANES;
    float *scores = malloc(sizeof(float) * group * (n + LANES));
    if (!scores) return -1;
    for (long j = lo; j < hi; j++) {
        long slot = table[j / block_size] * block_size + j % block_size;
        const float *k = keys + (slot * kv_heads + kv) * dim;
        for (long g = 0; g < group; g++) {
            const float *qg = q + g * dim;
            v16f acc = {0};
            for (long c = 0; c < chunks; c++) acc += load(qg + c * LANES) * load(k + c * LANES);
            scores[g * (n + LANES) + (j - lo)] = lanes_sum(acc) * scale;
        }
    }
    for (long g = 0; g < group; g++) {
        float *s = scores + g * (n + LANES);
        float max = s[0];
        for (long j = 1; j < n; j++) max = s[j] > max ? s[j] : max;
        for (long j = n; j < n + LANES; j++) s[j] = max - 1000.0f;  /* padding: exp gives 0 */
        v16f total = {0};
        for (long j = 0; j < n; j += LANES) {
            v16f e = vexp(load(s + j) - max);
            memcpy(s + j, &e, sizeof e);
            total += e;
        }
        float inverse = 1.0f / lanes_sum(total);
        v16f acc[MAX_CHUNKS];
        memset(acc, 0, sizeof acc);
        for (long j = lo; j < hi; j++) {
            long slot = table[j / block_size] * block_size + j % block_size;
            const float *v = values + (slot * kv_heads + kv) * dim;
            float weight = s[j - lo];
            for (long c = 0; c < chunks; c++) acc[c] += weight * load(v + c * LANES);
        }
        for (long c = 0; c < chunks; c++) {
            v16f o = acc[c] * inverse;
            memcpy(out + g * dim + c * LANES, &o, sizeof o);
        }
    }
    free(scores);
    return 0;
}

int one_query_attention(const float *q, const float *keys, const float *values, const int64_t *blocks,
                        const int64_t *positions, float *out, long rows, long heads, long kv_heads, long dim,
                        long table_width, long block_size, long window, float scale, int threads) {
    long group = heads / kv_heads, tasks = rows * kv_heads, work = 0;
    int failed = 0;
    if (dim % LANES || dim / LANES > MAX_CHUNKS || group > MAX_GROUP || heads % kv_heads) return -2;
    for (long b = 0; b < rows; b++) work += positions[b] + 1;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (work * kv_heads * dim >= 65536)
#endif
    for (long task = 0; task < tasks; task++) {
        long b = task / kv_heads, kv = task % kv_heads;
        long hi = positions[b] + 1, lo = window > 0 && hi > window ? hi - window : 0;
        const float *qb = q + (b * heads + kv * group) * dim;
        float *ob = out + (b * heads + kv * group) * dim;
        if (attend(qb, keys, values, blocks + b * table_width, lo, hi, kv, kv_heads, dim, block_size, group, scale, ob))
            failed = 1;
    }
    (void)threads;
    return failed ? -1 : 0;
}
