/* y = x · Wᵀ in fp32 for a weight kept as a GGUF Q8_0 table: W[n, k] = scale[n, k / 32] · q[n, k].
 *
 * Built at first use with the other kernels of this folder (gyrfalcon/kernels/native) by the
 * machine's C compiler and loaded through ctypes; it needs no torch headers. Called by
 * gyrfalcon/kernels/quant/q8.py, which lays the table out in panels (below) once at load.
 *
 * Why a kernel of our own: the output head reads the whole table every decode step, and torch has
 * no CPU kernel that reads 8-bit (or bf16) weights into fp32 logits, so the head read 113 MB of
 * fp32 a step on the default model. This one reads the 28 MB of int8 and a scale per 32.
 *
 * Layout: panels of 16 output columns, each [K][16] int8 (column n of panel p is W's row
 * 16 p + n), and each panel's scales [K / 32][16] fp32. A vector holds consecutive columns, so
 * the product is broadcast input times a vector of weights, with no sum across lanes at the end:
 * the earlier layout (a row of W along the lanes) spent its time in those sums and in two passes
 * over k, half of AVX2's FMA rate at sixteen rows (8.2 ms a step on the default model's head, 2
 * threads, against 5.2 now; at one row 1.5 against 1.3).
 *
 * Each output y[m, n] is summed by one thread in one chain, k ascending, one fused multiply-add per
 * k with the exactly dequantised weight (an int8 times an fp16 scale fits in fp32's mantissa),
 * whatever the number of rows beside it, the tile it falls in, the thread count or the vector
 * width: a row's logits have the same bits alone and in any batch, on AVX2 and AVX-512 alike. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define BLOCK 32 /* weights per scale */
#define P 16     /* columns per panel */

#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
typedef int8_t vbytes __attribute__((vector_size(16)));
typedef int32_t vints __attribute__((vector_size(64)));
#define LANES 16
#define R 12 /* input rows per tile: 12 accumulators, of 32 registers */
#else
typedef float vec __attribute__((vector_size(32)));
typedef int8_t vbytes __attribute__((vector_size(8)));
typedef int32_t vints __attribute__((vector_size(32)));
#define LANES 8
#define R 6 /* input rows per tile: 12 accumulators and 2 weight vectors in AVX2's 16 registers */
#endif
#define V (P / LANES) /* vectors per panel row */
#define NP (8 / V)        /* panels one row's pass takes at a time: eight chains in flight */

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* x in every lane (vector extensions' `(vec){0} + x` adds a zero first) */
static inline vec splat(const float *x) {
#if defined(__AVX512F__)
    __m512 v = _mm512_set1_ps(*x);
#elif defined(__AVX2__)
    __m256 v = _mm256_broadcast_ss(x);
#else
    vec v;
    for (int i = 0; i < LANES; i++) v[i] = *x;
#endif
    vec out;
    memcpy(&out, &v, sizeof out);
    return out;
}

/* LANES int8 weights as floats */
static inline vec load_q(const int8_t *q) {
#if defined(__AVX512F__)
    __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
#elif defined(__AVX2__)
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
#else
    vbytes v;
    memcpy(&v, q, sizeof v);
    return __builtin_convertvector(__builtin_convertvector(v, vints), vec);
#endif
#if defined(__AVX2__)
    vec out;
    memcpy(&out, &v, sizeof out);
    return out;
#endif
}

/* one block of a panel, 32 k by 16 columns, dequantised into w[32][16] */
static inline void dequantize(const int8_t *q, const float *scale, float *w) {
    vec s[V];
    for (int v = 0; v < V; v++) s[v] = load(scale + v * LANES);
    for (int k = 0; k < BLOCK; k++)
        for (int v = 0; v < V; v++) store(w + k * P + v * LANES, load_q(q + k * P + v * LANES) * s[v]);
}

/* out[i, 0..16) for the r rows of x (stride K; row stride of out: ld), over one block of k,
 * continuing the sums already in out unless this is the first block */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *out, long K, long ld,
                                                        const int r, const int first) {
    vec acc[R][V];
    for (int i = 0; i < r; i++)
        for (int v = 0; v < V; v++) acc[i][v] = first ? (vec){0} : load(out + i * ld + v * LANES);
    for (int k = 0; k < BLOCK; k++) {
        vec wv[V];
        for (int v = 0; v < V; v++) wv[v] = load(w + k * P + v * LANES);
        for (int i = 0; i < r; i++) {
            vec xb = splat(x + i * K + k);
            for (int v = 0; v < V; v++) acc[i][v] += wv[v] * xb; /* one fused multiply-add (-ffp-contract=fast) */
        }
    }
    for (int i = 0; i < r; i++)
        for (int v = 0; v < V; v++) store(out + i * ld + v * LANES, acc[i][v]);
}

static void all_rows(const float *x, const float *w, float *out, long M, long K, long ld, int first) {
    for (long m = 0; m < M; m += R) {
        const float *xm = x + m * K;
        float *o = out + m * ld;
        switch (M - m < R ? M - m : R) {
        case 1: tile(xm, w, o, K, ld, 1, first); break;
        case 2: tile(xm, w, o, K, ld, 2, first); break;
        case 3: tile(xm, w, o, K, ld, 3, first); break;
        case 4: tile(xm, w, o, K, ld, 4, first); break;
        case 5: tile(xm, w, o, K, ld, 5, first); break;
        case 6: tile(xm, w, o, K, ld, 6, first); break;
#if R > 6
        case 7: tile(xm, w, o, K, ld, 7, first); break;
        case 8: tile(xm, w, o, K, ld, 8, first); break;
        case 9: tile(xm, w, o, K, ld, 9, first); break;
        case 10: tile(xm, w, o, K, ld, 10, first); break;
        case 11: tile(xm, w, o, K, ld, 11, first); break;
#endif
        default: tile(xm, w, o, K, ld, R, first); break;
        }
    }
}

/* one row of x against panels [p0, p1): NP panels at a time, each weight dequantised in registers
 * and multiplied as the tiles do (the same chains, so the same bits). Why: a tile of one row keeps
 * only V chains of fused multiply-adds in flight, and waited on their latency and on the buffer's
 * store and load; one row read the table at half the memory's speed. */
static void one_row(const float *x, const int8_t *q, const float *scale, float *out, long N, long K, long p0, long p1) {
    long blocks = K / BLOCK;
    for (long p = p0; p < p1; p += NP) {
        int np = p1 - p < NP ? (int)(p1 - p) : NP;
        vec acc[NP][V];
        for (int j = 0; j < NP; j++)
            for (int v = 0; v < V; v++) acc[j][v] = (vec){0};
        for (long b = 0; b < blocks; b++) {
            vec s[NP][V];
            for (int j = 0; j < np; j++) {
                for (int v = 0; v < V; v++) s[j][v] = load(scale + (p + j) * blocks * P + b * P + v * LANES);
                for (int ahead = 0; ahead < BLOCK * P; ahead += 64)
                    __builtin_prefetch(q + (p + j) * K * P + (b + 2) * BLOCK * P + ahead);
            }
            for (long k = b * BLOCK; k < (b + 1) * BLOCK; k++) {
                vec xb = splat(x + k);
                for (int j = 0; j < np; j++)
                    for (int v = 0; v < V; v++) {
                        vec w = load_q(q + (p + j) * K * P + k * P + v * LANES) * s[j][v];
                        acc[j][v] += w * xb; /* one fused multiply-add (-ffp-contract=fast) */
                    }
            }
        }
        for (int j = 0; j < np; j++) {
            float o[P];
            for (int v = 0; v < V; v++) store(o + v * LANES, acc[j][v]);
            long columns = N - (p + j) * P < P ? N - (p + j) * P : P;
            memcpy(out + (p + j) * P, o, sizeof(float) * columns);
        }
    }
}

/* out[M, N] = x[M, K] · Wᵀ, W in panels (q: ceil(N / 16) panels of [K][16] int8, scale: of
 * [K / 32][16] fp32; a last partial panel's missing columns are padding); K % 32 == 0; returns 0,
 * or -1 if a thread's buffer for that last panel could not be allocated */
int q8_linear(const float *x, const int8_t *q, const float *scale, float *out, long M, long N, long K, int threads) {
    long blocks = K / BLOCK, panels = (N + P - 1) / P;
    int failed = 0;
    if (M == 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long g = 0; g < (panels + NP - 1) / NP; g++)
            one_row(x, q, scale, out, N, K, g * NP, (g + 1) * NP < panels ? (g + 1) * NP : panels);
        return 0;
    }
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float w[BLOCK * P] __attribute__((aligned(64)));
        float *partial = NULL; /* the last panel's outputs, all 16 columns, when N is not whole panels */
#pragma omp for schedule(static)
        for (long p = 0; p < panels; p++) {
            const int8_t *qp = q + p * K * P;
            const float *sp = scale + p * blocks * P;
            long columns = N - p * P < P ? N - p * P : P;
            float *o = out + p * P;
            long ld = N;
            if (columns < P) {
                if (partial == NULL && (partial = malloc(sizeof(float) * P * (M > 0 ? M : 1))) == NULL) {
                    failed = 1;
                    continue;
                }
                o = partial, ld = P;
            }
            for (long b = 0; b < blocks; b++) {
                /* a panel four ahead asked of the memory now: the table is read once a step */
                for (int ahead = 0; ahead < BLOCK * P; ahead += 64) __builtin_prefetch(qp + 4 * K * P + b * BLOCK * P + ahead);
                dequantize(qp + b * BLOCK * P, sp + b * P, w);
                all_rows(x + b * BLOCK, w, o, M, K, ld, b == 0);
            }
            if (columns < P)
                for (long m = 0; m < M; m++) memcpy(out + m * N + p * P, partial + m * P, sizeof(float) * columns);
        }
        free(partial);
    }
    return failed ? -1 : 0;
}

/* dst[j][i] = src[i][j] for a 16 x 16 block of bytes (src rows `stride` apart; dst rows 16 apart),
 * in four rounds of interleaving: bytes, pairs, fours, eights (SSE2, any x86-64; elsewhere a loop) */
static void transpose_16x16(const int8_t *src, long stride, int8_t *dst) {
#if !defined(__SSE2__)
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) dst[16 * j + i] = src[i * stride + j];
#else
    __m128i a[16], b[16];
    for (int i = 0; i < 16; i++) a[i] = _mm_loadu_si128((const __m128i *)(src + i * stride));
    for (int p = 0; p < 8; p++) { /* b[2p + h]: rows 2p, 2p + 1 of columns 8h .. 8h + 7 */
        b[2 * p] = _mm_unpacklo_epi8(a[2 * p], a[2 * p + 1]);
        b[2 * p + 1] = _mm_unpackhi_epi8(a[2 * p], a[2 * p + 1]);
    }
    for (int q = 0; q < 4; q++) /* a[4q + 2h + g]: rows 4q .. 4q + 3 of columns 8h + 4g .. + 3 */
        for (int h = 0; h < 2; h++) {
            a[4 * q + 2 * h] = _mm_unpacklo_epi16(b[4 * q + h], b[4 * q + 2 + h]);
            a[4 * q + 2 * h + 1] = _mm_unpackhi_epi16(b[4 * q + h], b[4 * q + 2 + h]);
        }
    for (int m = 0; m < 2; m++) /* b[8m + 4h + 2g + e]: rows 8m .. 8m + 7 of columns 8h + 4g + 2e, + 1 */
        for (int hg = 0; hg < 4; hg++) {
            b[8 * m + 2 * hg] = _mm_unpacklo_epi32(a[8 * m + hg], a[8 * m + 4 + hg]);
            b[8 * m + 2 * hg + 1] = _mm_unpackhi_epi32(a[8 * m + hg], a[8 * m + 4 + hg]);
        }
    for (int j = 0; j < 8; j++) { /* column 2j, then 2j + 1: all 16 rows */
        _mm_storeu_si128((__m128i *)(dst + 32 * j), _mm_unpacklo_epi64(b[j], b[8 + j]));
        _mm_storeu_si128((__m128i *)(dst + 32 * j + 16), _mm_unpackhi_epi64(b[j], b[8 + j]));
    }
#endif
}

/* q8_linear's panels (q[p][k][c] = table[16p + c][k], the last panel's missing rows zero) from a
 * file's table[n][k]; returns 0, or -2 for a k that is not whole blocks of 16 */
int q8_pack_panels(const int8_t *table, int8_t *q, long n, long k, int threads) {
    if (k % 16) return -2;
    long whole = n / P;
    (void)threads;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= (1L << 18))
#endif
    for (long p = 0; p < whole; p++)
        for (long kk = 0; kk < k; kk += 16) transpose_16x16(table + P * p * k + kk, k, q + (p * k + kk) * P);
    if (n % P) {
        int8_t *last = q + whole * k * P;
        memset(last, 0, (size_t)(k * P));
        for (long c = 0; c < n % P; c++)
            for (long kk = 0; kk < k; kk++) last[kk * P + c] = table[(P * whole + c) * k + kk];
    }
    return 0;
}
