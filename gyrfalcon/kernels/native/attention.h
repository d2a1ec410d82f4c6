/* What the two attention kernels (one_query_attention.c, prefill_attention.c) compute alike: a
 * vector's load and store, a cache's values widened to fp32, the sum of a vector's lanes in one
 * fixed order, and exp in vectors (Cephes' expf, about 1 ulp; 0 below -87.3). */
#ifndef GYRFALCON_ATTENTION_H
#define GYRFALCON_ATTENTION_H

#include <stdint.h>
#include <string.h>

#include "vectors.h"

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));

/* VW cache values in `format` (widened exactly) */
static inline vf load_kv(const void *p, int format) {
    if (format == CACHE_FP32) return load((const float *)p);
    if (format == CACHE_FP16) return widen_fp16(p);
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* the lanes pairwise: the same order whichever row or thread sums them */
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

#endif
