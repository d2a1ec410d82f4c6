/* y = x · Wᵀ for a weight kept in a GGUF's Q4_1 blocks (W[n, k] = d[n, b] · q[n, k] + m[n, b], b = k / 32,
 * q in 0..15, d and m fp16) and fp32 inputs rounded to integers per block of 32, in one of two grids:
 * - q4q8_linear, int8 as llama.cpp's Q8_1: x[k] ≈ e[b] · s[k], e[b] = max |x| over the block / 127,
 *   s[k] = round(x[k] / e[b]) in -127..127;
 * - q4q16_linear, 15 bits held in two int8 parts: with u = x[k] · 127 / max |x|, hi = round(u) and
 *   lo = round((u - hi) · 254), both in -127..127, x[k] ≈ e[b] · s[k], s[k] = 254 · hi + lo,
 *   e[b] = max |x| / (127 · 254): a grid 254 times finer, each part multiplied as the int8 one is.
 *
 * Built at first use with the other kernels of this folder (gyrfalcon/kernels/native) by the
 * machine's C compiler and loaded through ctypes. Called by gyrfalcon/kernels/quant/q4.py, which
 * packs the weights into this file's layout.
 *
 * Why: multiplying 4-bit weights by fp32 inputs costs about 22 instructions per 32 weights on AVX2
 * (each weight converted to a float), so one decode row was bound by arithmetic, not by memory. Here
 * 32 weights times a row take about 5 (vpmaddubsw + vpmaddwd, or one vpdpbusd with AVX-512 VNNI),
 * in integers, exactly; twice that with two parts, whose rounding moves the default model's
 * log-probabilities 254 times less than int8's (docs/kernels.md).
 *
 * What each output is, for row i and column n: per block b, the exact integer sum
 * t = Σ_{k in b} q[n, k] · s[i, k] (int32; with two parts 254 · Σ q · hi + Σ q · lo, at most
 * 32 · 15 · 32,385 < 2^24 in magnitude, so exact as a float too), then y = fma((float)t, d[n, b] · e[i, b], y) and
 * y = fma(m[n, b], f[i, b], y), with f[i, b] = e[i, b] · Σ_{k in b} s[i, k], blocks ascending from
 * y = 0. The same operations in the same order whatever the rows beside it, the tile, the thread
 * count or the instruction set (the integer sums are exact on every path): a row gets the same bits
 * alone and in any batch, on AVX2 and on AVX-512 alike.
 *
 * Layout, per panel p of 16 output columns (N % 16 == 0, K % 32 == 0):
 *   nibbles: [K / 8][64] bytes: for k0 = 8g, byte 4c + j holds q[16p + c][k0 + j] in its low nibble
 *            and q[16p + c][k0 + 4 + j] in its high one (c < 16, j < 4): a 256-bit half holds
 *            eight columns' four consecutive weights, as vpmaddubsw and vpdpbusd read them;
 *   scales:  [K / 32][2][16] fp16, d then m of the panel's 16 columns for block b. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define PANEL 16  /* output columns a panel */
#define BLOCK 32  /* weights per scale */
#define ROWS 4    /* rows a register tile */
#define CHUNK 64  /* rows a pass over the panels takes (their int8 rows stay in the core's L2) */

#if defined(__AVX2__) && defined(__F16C__)
/* 32 int32 lanes (four vectors, each in -127..127) as 32 int8, in order */
static inline void store_int8(int8_t *to, const __m256i *v) {
    __m256i words = _mm256_packs_epi32(v[0], v[1]), words2 = _mm256_packs_epi32(v[2], v[3]);
    __m256i bytes = _mm256_packs_epi16(words, words2); /* groups of four: each vector's 0-3, then their 4-7 */
    _mm256_storeu_si256((__m256i *)to, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* rounded to the nearest integer, ties to even, and clamped to -127..127 */
static inline __m256 rounded(__m256 u) {
    __m256 r = _mm256_round_ps(u, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
}

/* one row's inputs in int8 blocks: s[K] (with two parts, lo[K] too: s holds the high part), e[K / 32]
 * and f[K / 32] = e · Σ s over the block (254 · hi + lo with two parts): with u = x · 127 / max |x|,
 * hi = round(u) and lo = round((u - hi) · 254), to nearest even, each clamped to -127..127, as
 * gyrfalcon/kernels/quant/q4.py's int8_rounded and int16_rounded say. In vectors: a scalar loop took
 * about a tenth of a decode row's products' time. */
static void quantize_row(const float *x, long K, int8_t *s, int8_t *lo, float *e, float *f) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (long b = 0; b < K / BLOCK; b++) {
        const float *xb = x + b * BLOCK;
        __m256 xv[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, xv[j] = _mm256_loadu_ps(xb + 8 * j)));
        float lanes[8], amax = 0.0f;
        _mm256_storeu_ps(lanes, m);
        for (int j = 0; j < 8; j++) amax = fmaxf(amax, lanes[j]);
        float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256i hi[4], low[4], total = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256 u = _mm256_mul_ps(xv[j], _mm256_set1_ps(inverse));
            __asm__("" : "+x"(u)); /* rounded as a product: -ffp-contract=fast would fuse it into u - v below */
            __m256 v = rounded(u);
            hi[j] = _mm256_cvtps_epi32(v);
            if (lo == NULL) {
                total = _mm256_add_epi32(total, hi[j]);
                continue;
            }
            low[j] = _mm256_cvtps_epi32(rounded(_mm256_mul_ps(_mm256_sub_ps(u, v), _mm256_set1_ps(254.0f))));
            total = _mm256_add_epi32(total, _mm256_add_epi32(_mm256_mullo_epi32(hi[j], _mm256_set1_epi32(254)), low[j]));
        }
        store_int8(s + b * BLOCK, hi);
        if (lo != NULL) store_int8(lo + b * BLOCK, low);
        int32_t sums[8], sum = 0;
        _mm256_storeu_si256((__m256i *)sums, total);
        for (int j = 0; j < 8; j++) sum += sums[j];
        e[b] = lo == NULL ? amax / 127.0f : amax / (127.0f * 254.0f);
        f[b] = e[b] * (float)sum;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* a block's sums: int32 lanes, each four consecutive weights times four inputs added by vpdpbusd */
typedef __m256i sums;
#define SUMS_ZERO _mm256_setzero_si256()
static inline sums dot4(sums acc, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(acc, w, x); }
static inline __m256i sums_int32(sums acc) { return acc; }
/* 254 · hi + lo, in int32 lanes */
static inline __m256i sums_joined(sums hi, sums lo) {
    return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(hi, 8), _mm256_slli_epi32(hi, 1)), lo);
}
#else
/* a block's sums in int16 lanes, each pair of weights times inputs by vpmaddubsw: a lane adds eight
 * pairs, at most 8 · 2 · 15 · 127 = 30,480 in magnitude (no saturation, no overflow), then
 * vpmaddwd joins a column's two lanes into int32: the same integers as vpdpbusd's */
typedef __m256i sums;
#define SUMS_ZERO _mm256_setzero_si256()
static inline sums dot4(sums acc, __m256i w, __m256i x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)); }
static inline __m256i sums_int32(sums acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
/* 254 · hi + lo, in int32 lanes */
static inline __m256i sums_joined(sums hi, sums lo) {
    return _mm256_add_epi32(_mm256_madd_epi16(hi, _mm256_set1_epi16(254)), sums_int32(lo));
}
#endif

/* r rows (s, lo, e, f: their int8 blocks, lo NULL with one part) against one panel, into out (row stride N) */
static inline __attribute__((always_inline)) void tile(const int8_t *s, const int8_t *lo, const float *e,
                                                        const float *f, const uint8_t *nib, const uint16_t *sc,
                                                        float *out, long N, long K, const int r, const int parts) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    /* the outputs accumulate in out itself, a block at a time: in registers beside the block's
     * sums and weights they spilled (AVX2 has 16) */
    for (int i = 0; i < r; i++) {
        _mm256_storeu_ps(out + i * N, _mm256_setzero_ps());
        _mm256_storeu_ps(out + i * N + 8, _mm256_setzero_ps());
    }
    for (long b = 0; b < K / BLOCK; b++) {
        sums acc[ROWS][2], acl[ROWS][2]; /* the sums of the high (or only) part, of the low part */
        for (int i = 0; i < r; i++) acc[i][0] = acc[i][1] = acl[i][0] = acl[i][1] = SUMS_ZERO;
#pragma GCC unroll 1 /* unrolled, gcc summed all of a block's products as a tree, spilling them */
        for (int g = 0; g < BLOCK / 8; g++) {
            const uint8_t *w = nib + (b * (BLOCK / 8) + g) * 64;
            __m256i w0 = _mm256_loadu_si256((const __m256i *)w), w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
            __m256i a0 = _mm256_and_si256(w0, low), b0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), low);
            __m256i a1 = _mm256_and_si256(w1, low), b1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), low);
            long k0 = b * BLOCK + 8 * g;
            for (int i = 0; i < r; i++) {
                int32_t first, second;
                memcpy(&first, s + i * K + k0, 4);
                memcpy(&second, s + i * K + k0 + 4, 4);
                __m256i xa = _mm256_set1_epi32(first), xb = _mm256_set1_epi32(second);
                acc[i][0] = dot4(dot4(acc[i][0], a0, xa), b0, xb);
                acc[i][1] = dot4(dot4(acc[i][1], a1, xa), b1, xb);
                if (parts == 2) {
                    memcpy(&first, lo + i * K + k0, 4);
                    memcpy(&second, lo + i * K + k0 + 4, 4);
                    xa = _mm256_set1_epi32(first), xb = _mm256_set1_epi32(second);
                    acl[i][0] = dot4(dot4(acl[i][0], a0, xa), b0, xb);
                    acl[i][1] = dot4(dot4(acl[i][1], a1, xa), b1, xb);
                }
            }
        }
        const uint16_t *sb = sc + b * 2 * PANEL;
        __m256 d[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb)),
                       _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 8)))};
        __m256 m[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + PANEL))),
                       _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + PANEL + 8)))};
        for (int i = 0; i < r; i++) {
            __m256 ei = _mm256_set1_ps(e[i * (K / BLOCK) + b]), fi = _mm256_set1_ps(f[i * (K / BLOCK) + b]);
            for (int v = 0; v < 2; v++) {
                __m256 y = _mm256_loadu_ps(out + i * N + 8 * v);
                __m256i t = parts == 2 ? sums_joined(acc[i][v], acl[i][v]) : sums_int32(acc[i][v]);
                y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d[v], ei), y);
                _mm256_storeu_ps(out + i * N + 8 * v, _mm256_fmadd_ps(m[v], fi, y));
            }
        }
    }
}

/* rows [0, M) of the quantised inputs against one panel */
static void panel_rows(const int8_t *s, const int8_t *lo, const float *e, const float *f, const uint8_t *nib,
                       const uint16_t *sc, float *out, long M, long N, long K) {
#define TILE(r, parts)                                                                                                 \
    tile(s + i * K, lo == NULL ? NULL : lo + i * K, e + i * (K / BLOCK), f + i * (K / BLOCK), nib, sc, out + i * N, N, \
         K, r, parts)
#define TILES(parts)                                                                                                   \
    do {                                                                                                               \
        for (; i + ROWS <= M; i += ROWS) TILE(ROWS, parts);                                                            \
        switch (M - i) {                                                                                               \
        case 3: TILE(3, parts); break;                                                                                 \
        case 2: TILE(2, parts); break;                                                                                 \
        case 1: TILE(1, parts); break;                                                                                 \
        default: break;                                                                                                \
        }                                                                                                              \
    } while (0)
    long i = 0;
    if (lo == NULL)
        TILES(1);
    else
        TILES(2);
#undef TILES
#undef TILE
}
#endif

/* out[M, N] = x[M, K] · Wᵀ with the inputs in `parts` int8 parts (1 or 2); returns 0, -1 if a buffer
 * could not be allocated, -2 if this build has no kernel (it needs AVX2 with F16C), -3 for a shape it
 * does not take */
static int product(const float *x, const uint8_t *nibbles, const uint16_t *sc, float *out, long M, long N, long K,
                   int threads, int parts) {
#if defined(__AVX2__) && defined(__F16C__)
    if (N % PANEL || K % BLOCK) return -3;
    long panels = N / PANEL, blocks = K / BLOCK;
    int8_t *s = malloc((size_t)M * K * parts), *lo = parts == 2 ? s + M * K : NULL;
    float *ef = malloc(sizeof(float) * 2 * M * blocks);
    if (s == NULL || ef == NULL) {
        free(s);
        free(ef);
        return -1;
    }
    float *e = ef, *f = ef + M * blocks;
    int parallel = M * N * K >= 65536;
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) if (parallel)
#endif
    {
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (long i = 0; i < M; i++) quantize_row(x + i * K, K, s + i * K, lo == NULL ? NULL : lo + i * K, e + i * blocks, f + i * blocks);
        for (long i0 = 0; i0 < M; i0 += CHUNK) {
            long rows = M - i0 < CHUNK ? M - i0 : CHUNK;
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
            for (long p = 0; p < panels; p++)
                panel_rows(s + i0 * K, lo == NULL ? NULL : lo + i0 * K, e + i0 * blocks, f + i0 * blocks, nibbles + p * (K / 8) * 64,
                           sc + p * blocks * 2 * PANEL, out + i0 * N + p * PANEL, rows, N, K);
        }
    }
    (void)parallel;
    (void)threads;
    free(s);
    free(ef);
    return 0;
#else
    (void)x, (void)nibbles, (void)sc, (void)out, (void)M, (void)N, (void)K, (void)threads, (void)parts;
    return -2;
#endif
}

/* the product with int8 inputs (see the top of this file) */
int q4q8_linear(const float *x, const uint8_t *nibbles, const uint16_t *sc, float *out, long M, long N, long K,
                int threads) {
    return product(x, nibbles, sc, out, M, N, K, threads, 1);
}

/* the product with inputs in two int8 parts, a grid 254 times finer (see the top of this file) */
int q4q16_linear(const float *x, const uint8_t *nibbles, const uint16_t *sc, float *out, long M, long N, long K,
                 int threads) {
    return product(x, nibbles, sc, out, M, N, K, threads, 2);
}

/* This file's nibbles (the layout above) from a file's: disk[n][k / 2], byte t of a row holding its
 * weights 2t (low nibble) and 2t + 1. In one pass, each output word once: bytes 4c .. 4c + 3 of
 * group g of panel p hold q[16p + c][8g + j] | q[16p + c][8g + 4 + j] << 4, which is the row's four
 * bytes of that group read as one little-endian word, its nibbles q0 q1 .. q7 shuffled to
 * q0 q4 q1 q5 q2 q6 q3 q7 by two swaps (bytes 1 and 2, then the middle nibbles of each half).
 * Returns 0, or -2 for a shape the layout does not take. */
int q4_pack_nibbles(const uint8_t *disk, uint8_t *out, long n, long k, int threads) {
    if (n % 16 || k % 32) return -2;
    long groups = k / 8, row_bytes = k / 2;
    (void)threads;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= (1L << 22))
#endif
    for (long p = 0; p < n / 16; p++)
        for (long c = 0; c < 16; c++) {
            const uint8_t *from = disk + (16 * p + c) * row_bytes;
            uint8_t *to = out + p * groups * 64 + 4 * c;
            for (long g = 0; g < groups; g++) {
                uint32_t x, t;
                memcpy(&x, from + 4 * g, 4);
                t = (x ^ (x >> 8)) & 0x0000FF00u;
                x = x ^ t ^ (t << 8);
                t = (x ^ (x >> 4)) & 0x00F000F0u;
                x = x ^ t ^ (t << 4);
                memcpy(to + g * 64, &x, 4);
            }
        }
    return 0;
}

/* This file's scales (the layout above: per panel, per block, the 16 columns' scales then their
 * minimums, fp16 bits) from a file's scale[n][k / 32] and minimum[n][k / 32]. Returns 0, or -2 for
 * a shape the layout does not take. */
int q4_pack_scales(const uint16_t *scale, const uint16_t *minimum, uint16_t *out, long n, long k) {
    if (n % 16 || k % 32) return -2;
    long blocks = k / 32;
    for (long p = 0; p < n / 16; p++)
        for (long b = 0; b < blocks; b++) {
            uint16_t *to = out + (p * blocks + b) * 32;
            for (long c = 0; c < 16; c++) {
                to[c] = scale[(16 * p + c) * blocks + b];
                to[16 + c] = minimum[(16 * p + c) * blocks + b];
            }
        }
    return 0;
}
