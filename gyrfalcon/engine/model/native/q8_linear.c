/* y = x · Wᵀ in fp32 for a weight kept as a GGUF Q8_0 table: W[n, k] = scale[n, k / 32] · q[n, k].
 *
 * Built at first use with the other kernels of this folder (gyrfalcon/engine/model/native) by the
 * machine's C compiler and loaded through ctypes; it needs no torch headers. Called by
 * gyrfalcon/engine/model/quant/q8.py.
 *
 * Why a kernel of our own: the output head reads the whole table every decode step, and torch has
 * no CPU kernel that reads 8-bit (or bf16) weights into fp32 logits, so the head read 113 MB of
 * fp32 a step on the default model. This one reads the 28 MB of int8 and a scale per 32.
 *
 * Each output y[m, n] is summed by one thread, over k in one fixed order (16 lanes, k ascending,
 * then the lanes pairwise), whatever the number of rows beside it, the tile it falls in or the
 * thread count: a row's logits have the same bits alone and in any batch. Each weight is
 * dequantised exactly (an int8 times an fp16 scale fits in fp32's mantissa). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef int8_t v16b __attribute__((vector_size(16)));

#define BLOCK 32 /* weights per scale */
#define PREFETCH 8 /* tiles ahead whose weights are asked of the memory */
#define T 4      /* weight rows per tile */
#define R 4      /* input rows per tile */

/* sixteen int8 weights as floats */
static inline v16f load_q(const int8_t *p) {
#if defined(__AVX512F__)
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
    v16f v;
    memcpy(&v, &lo, 32);
    memcpy((char *)&v + 32, &hi, 32);
    return v;
#else
    v16b q;
    memcpy(&q, p, 16);
    return __builtin_convertvector(__builtin_convertvector(q, v16i), v16f);
#endif
}

static inline v16f load_f(const float *p) {
    v16f v;
    memcpy(&v, p, 64);
    return v;
}

static inline float lanes_sum(v16f v) {
    v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2 has 16 vector registers: the 16 lanes of each sum are two __m256 (lanes 0-7, 8-15), summed in
 * two passes over k, one half each, so that a tile of 4 input rows x 3 weight rows keeps its twelve
 * accumulators in registers (the generic tile spilled them: 5x slower; a 2 x 2 tile ran at half the
 * rate at sixteen rows); the lanes are summed in lanes_sum's order, so each output keeps its bits
 * whatever the tile. */
#undef T
#undef R
#define T 3
#define R 4
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *out, long N, long K,
                                                        const int r, const int t) {
    __m256 halves[2][R][T];
    for (int h = 0; h < 2; h++) {
        __m256 acc[R][T];
        for (int i = 0; i < r; i++)
            for (int j = 0; j < t; j++) acc[i][j] = _mm256_setzero_ps();
        for (long k = 8 * h; k < K; k += 16) {
            __m256 wv[T];
            for (int j = 0; j < t; j++) wv[j] = _mm256_loadu_ps(w + j * K + k);
            for (int i = 0; i < r; i++) {
                __m256 xv = _mm256_loadu_ps(x + i * K + k);
                for (int j = 0; j < t; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);
            }
        }
        for (int i = 0; i < r; i++)
            for (int j = 0; j < t; j++) halves[h][i][j] = acc[i][j];
    }
    for (int i = 0; i < r; i++)
        for (int j = 0; j < t; j++) {
            v16f v;
            memcpy(&v, &halves[0][i][j], 32);
            memcpy((char *)&v + 32, &halves[1][i][j], 32);
            out[i * N + j] = lanes_sum(v);
        }
}
#else
/* out[i * N + j] for the first r rows of x and t rows of w (both K long, dequantised w) */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *out, long N, long K,
                                                        const int r, const int t) {
    v16f acc[R][T];
    for (int i = 0; i < r; i++)
        for (int j = 0; j < t; j++) acc[i][j] = (v16f){0};
    for (long k = 0; k < K; k += 16) {
        v16f wv[T];
        for (int j = 0; j < t; j++) wv[j] = load_f(w + j * K + k);
        for (int i = 0; i < r; i++) {
            v16f xv = load_f(x + i * K + k);
            for (int j = 0; j < t; j++) acc[i][j] += wv[j] * xv;
        }
    }
    for (int i = 0; i < r; i++)
        for (int j = 0; j < t; j++) out[i * N + j] = lanes_sum(acc[i][j]);
}
#endif

/* the 32 weights of one block, exactly (an int8 times an fp16 scale fits fp32's mantissa) */
static inline void dequantize(const int8_t *q, float scale, float *w) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    __m256 s = _mm256_set1_ps(scale);
    for (int i = 0; i < BLOCK; i += 8)
        _mm256_storeu_ps(w + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i)))), s));
#else
    v16f s = (v16f){0} + scale;
    v16f w0 = load_q(q) * s, w1 = load_q(q + 16) * s;
    memcpy(w, &w0, 64);
    memcpy(w + 16, &w1, 64);
#endif
}

/* every row of x against the t dequantised weight rows w (output columns n ..) */
static inline __attribute__((always_inline)) void all_rows(const float *x, const float *w, float *out, long M, long N,
                                                            long K, long n, const int t) {
    for (long m = 0; m < M; m += R) {
        const float *xm = x + m * K;
        float *o = out + m * N + n;
        switch (M - m < R ? M - m : R) {
        case 1: tile(xm, w, o, N, K, 1, t); break;
        case 2: tile(xm, w, o, N, K, 2, t); break;
        case 3: tile(xm, w, o, N, K, 3, t); break;
        default: tile(xm, w, o, N, K, R, t); break;
        }
    }
}

/* out[M, N] = x[M, K] · Wᵀ; K % 32 == 0; returns 0, or -1 if a thread's buffer could not be allocated */
int q8_linear(const float *x, const int8_t *q, const float *scale, float *out, long M, long N, long K, int threads) {
    long blocks = K / BLOCK;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *w = aligned_alloc(64, sizeof(float) * T * K);
        failed = w == NULL;
#pragma omp for schedule(static)
        for (long n0 = 0; n0 < N; n0 += T) {
            if (w == NULL) continue;
            long t = N - n0 < T ? N - n0 : T;
            /* the rows a few tiles ahead, asked of the memory now (the head took 3.0 ms a step on AVX2, 2.3 so) */
            for (long ahead = 0; ahead < T * K; ahead += 64)
                __builtin_prefetch(q + (n0 + PREFETCH * T) * K + ahead);
            for (long j = 0; j < t; j++)
                for (long b = 0; b < blocks; b++)
                    dequantize(q + (n0 + j) * K + b * BLOCK, scale[(n0 + j) * blocks + b], w + j * K + b * BLOCK);
            if (t == T)
                all_rows(x, w, out, M, N, K, n0, T);
            else
                for (long j = 0; j < t; j++) all_rows(x, w + j * K, out, M, N, K, n0 + j, 1);
        }
        free(w);
    }
    return failed ? -1 : 0;
}
