/* y = x · Wᵀ in fp32 for a weight kept in a GGUF's Q4_1 blocks: W[n, k] = d[n, b] · q[n, k] + m[n, b],
 * b = k / 32, q in 0..15, d and m fp16.
 *
 * Built at first use with the other kernels of this folder (gyrfalcon/kernels/native) by the
 * machine's C compiler and loaded through ctypes. Called by gyrfalcon/kernels/quant/q4.py, which
 * packs the weights into this file's layout.
 *
 * Why a kernel of our own: torch's int4 CPU kernel is fast only with bf16 inputs, and on AVX2 it is
 * slower than an fp32 GEMM from about 16 rows on; its bf16 inputs also move the default model's
 * log-probabilities by 0.033 nats. This one reads the GGUF's 4-bit weights and multiplies fp32 inputs.
 *
 * What each output is: y[i, n] is one chain of fused multiply-adds over k ascending from 0,
 * acc = fma(x[i, k], W[n, k], acc), with W[n, k] dequantised exactly (d · q is exact in fp32, so
 * fma(q, d, m) rounds once, as the conversion's d · q + m does): the fp32 reference weights' product,
 * summed in one fixed order whatever the rows beside it, the tile, the thread count or the vector
 * width (an AVX2 and an AVX-512 build give the same bits). Lanes run along n (16 output columns a
 * panel), so no reduction across lanes is ever needed.
 *
 * Layout, per panel p of 16 output columns (N % 16 == 0, K % 32 == 0):
 *   nibbles: [K / 2][16] bytes, byte j of pair t = q[16p + j][2t] | q[16p + j][2t + 1] << 4;
 *   scales:  [K / 32][2][16] fp16, d then m of the panel's 16 columns for block b.
 *
 * Two ways through a panel: few rows dequantise each pair of k in registers; many rows (at least
 * BUFFERED) dequantise the panel once into an fp32 buffer and run a register-blocked product over
 * it. Both compute the same chains, so the same bits. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define PANEL 16   /* output columns a panel */
#define BLOCK 32   /* weights per scale */
#define BUFFERED 6 /* rows from which a panel is dequantised into a buffer first */
#define CHUNK 128  /* rows of x a pass over the panels reads (they stay in the core's L2) */
#ifndef PREFETCH
#define PREFETCH 2 /* blocks ahead the few-row tiles ask the memory for */
#endif

#if defined(__AVX512F__)
#define MR 8 /* rows a register tile, over two panels */
#define PN 2
#elif defined(__AVX2__)
#define MR 6 /* rows a register tile, over one panel */
#define PN 1
#endif

#if defined(__AVX2__) && defined(__F16C__) || defined(__AVX512F__)

#if defined(__AVX512F__)
/* one k of a panel: 16 columns in one vector */
typedef __m512 vec;
#define VECS 1 /* vectors a panel */
#define set0 _mm512_setzero_ps
#define load _mm512_loadu_ps
#define store _mm512_storeu_ps
#define bcast _mm512_set1_ps
#define fmadd _mm512_fmadd_ps

/* the two k of pair t (columns 0..15), exactly */
static inline void pair(const uint8_t *nib, const vec *d, const vec *m, vec *even, vec *odd) {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)nib));
    __m512i low = _mm512_set1_epi32(0x0F);
    even[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), d[0], m[0]);
    odd[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d[0], m[0]);
}

static inline void scales(const uint16_t *s, vec *d, vec *m) {
    d[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
    m[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + PANEL)));
}
#else
typedef __m256 vec;
#define VECS 2
#define set0 _mm256_setzero_ps
#define load _mm256_loadu_ps
#define store _mm256_storeu_ps
#define bcast _mm256_set1_ps
#define fmadd _mm256_fmadd_ps

static inline void pair(const uint8_t *nib, const vec *d, const vec *m, vec *even, vec *odd) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)nib);
    __m256i low = _mm256_set1_epi32(0x0F);
    __m256i q0 = _mm256_cvtepu8_epi32(bytes), q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    even[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q0, low)), d[0], m[0]);
    even[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q1, low)), d[1], m[1]);
    odd[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), d[0], m[0]);
    odd[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), d[1], m[1]);
}

static inline void scales(const uint16_t *s, vec *d, vec *m) {
    d[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));
    d[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 8)));
    m[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + PANEL)));
    m[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + PANEL + 8)));
}
#endif

/* r (< BUFFERED) rows of x against np consecutive panels, dequantising in registers */
static inline __attribute__((always_inline)) void few_rows(const float *x, const uint8_t *nib, const uint16_t *sc,
                                                            float *out, long N, long K, const int r, const int np) {
    vec acc[BUFFERED][4][VECS];
    for (int i = 0; i < r; i++)
        for (int p = 0; p < np; p++)
            for (int v = 0; v < VECS; v++) acc[i][p][v] = set0();
    for (long b = 0; b < K / BLOCK; b++) {
        vec d[4][VECS], m[4][VECS];
        for (int p = 0; p < np; p++) scales(sc + (p * (K / BLOCK) + b) * 2 * PANEL, d[p], m[p]);
        for (int p = 0; p < np; p++) {
            for (int ahead = 0; ahead < BLOCK / 2 * PANEL; ahead += 64)
                __builtin_prefetch(nib + (p * K / 2 + (b + PREFETCH) * BLOCK / 2) * PANEL + ahead);
            __builtin_prefetch(sc + (p * (K / BLOCK) + b + PREFETCH) * 2 * PANEL);
        }
        for (long t = b * BLOCK / 2; t < (b + 1) * BLOCK / 2; t++) {
            vec even[4][VECS], odd[4][VECS];
            for (int p = 0; p < np; p++) pair(nib + (p * K / 2 + t) * PANEL, d[p], m[p], even[p], odd[p]);
            for (int i = 0; i < r; i++) {
                vec x0 = bcast(x[i * K + 2 * t]), x1 = bcast(x[i * K + 2 * t + 1]);
                for (int p = 0; p < np; p++)
                    for (int v = 0; v < VECS; v++) acc[i][p][v] = fmadd(x0, even[p][v], acc[i][p][v]);
                for (int p = 0; p < np; p++)
                    for (int v = 0; v < VECS; v++) acc[i][p][v] = fmadd(x1, odd[p][v], acc[i][p][v]);
            }
        }
    }
    for (int i = 0; i < r; i++)
        for (int p = 0; p < np; p++)
            for (int v = 0; v < VECS; v++) store(out + i * N + p * PANEL + v * (PANEL / VECS), acc[i][p][v]);
}

/* the panel's weights dequantised: w[k * 16 + j] = W[16p + j, k] */
static void dequantize_panel(const uint8_t *nib, const uint16_t *sc, long K, float *w) {
    for (long b = 0; b < K / BLOCK; b++) {
        vec d[VECS], m[VECS];
        scales(sc + b * 2 * PANEL, d, m);
        for (long t = b * BLOCK / 2; t < (b + 1) * BLOCK / 2; t++) {
            vec even[VECS], odd[VECS];
            pair(nib + t * PANEL, d, m, even, odd);
            for (int v = 0; v < VECS; v++) {
                store(w + 2 * t * PANEL + v * (PANEL / VECS), even[v]);
                store(w + (2 * t + 1) * PANEL + v * (PANEL / VECS), odd[v]);
            }
        }
    }
}

/* r (<= MR) rows of x against np (<= PN) dequantised panels w (each K * 16 floats) */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *out, long N, long K,
                                                        const int r, const int np) {
    vec acc[MR][PN][VECS];
    for (int i = 0; i < r; i++)
        for (int p = 0; p < np; p++)
            for (int v = 0; v < VECS; v++) acc[i][p][v] = set0();
    for (long k = 0; k < K; k++) {
        vec wv[PN][VECS];
        for (int p = 0; p < np; p++)
            for (int v = 0; v < VECS; v++) wv[p][v] = load(w + (p * K + k) * PANEL + v * (PANEL / VECS));
        for (int i = 0; i < r; i++) {
            vec xb = bcast(x[i * K + k]);
            for (int p = 0; p < np; p++)
                for (int v = 0; v < VECS; v++) acc[i][p][v] = fmadd(xb, wv[p][v], acc[i][p][v]);
        }
    }
    for (int i = 0; i < r; i++)
        for (int p = 0; p < np; p++)
            for (int v = 0; v < VECS; v++) store(out + i * N + p * PANEL + v * (PANEL / VECS), acc[i][p][v]);
}

/* rows [0, M) of x against np dequantised panels */
static inline __attribute__((always_inline)) void tiles(const float *x, const float *w, float *out, long M, long N,
                                                         long K, const int np) {
    long i = 0;
    for (; i + MR <= M; i += MR) tile(x + i * K, w, out + i * N, N, K, MR, np);
    switch (M - i) {
#if MR > 6
    case 7: tile(x + i * K, w, out + i * N, N, K, 7, np); break;
    case 6: tile(x + i * K, w, out + i * N, N, K, 6, np); break;
#endif
    case 5: tile(x + i * K, w, out + i * N, N, K, 5, np); break;
    case 4: tile(x + i * K, w, out + i * N, N, K, 4, np); break;
    case 3: tile(x + i * K, w, out + i * N, N, K, 3, np); break;
    case 2: tile(x + i * K, w, out + i * N, N, K, 2, np); break;
    case 1: tile(x + i * K, w, out + i * N, N, K, 1, np); break;
    default: break;
    }
}

/* M < BUFFERED rows against panels [p0, p1): as many panels a tile as keep eight or more chains of
 * fused multiply-adds in flight (fewer left the product waiting on their latency: two rows took
 * twice one row's time) */
static void few(const float *x, const uint8_t *nibbles, const uint16_t *sc, float *out, long M, long N, long K,
                long p0, long p1) {
#define FEW(r, np) few_rows(x, nibbles + p * (K / 2) * PANEL, sc + p * (K / BLOCK) * 2 * PANEL, out + p * PANEL, N, K, r, np)
#define WIDE(r, np) if (p + (np) <= p1) { FEW(r, np); p += (np); continue; }
    for (long p = p0; p < p1;) {
        switch (M) {
        case 1: WIDE(1, 4 / VECS); FEW(1, 1); break;
        case 2: WIDE(2, 4 / VECS); FEW(2, 1); break;
        case 3: WIDE(3, 2 / VECS + (VECS == 1)); FEW(3, 1); break;
        case 4: WIDE(4, 2 / VECS + (VECS == 1)); FEW(4, 1); break;
        default: WIDE(5, 2 / VECS + (VECS == 1)); FEW(5, 1); break;
        }
        p += 1;
    }
#undef WIDE
#undef FEW
}
#endif

/* out[M, N] = x[M, K] · Wᵀ; returns 0, -1 if a thread's buffer could not be allocated, -2 if this
 * build has no kernel (neither AVX2 with F16C nor AVX-512), -3 for a shape it does not take */
int q4_linear(const float *x, const uint8_t *nibbles, const uint16_t *sc, float *out, long M, long N, long K,
              int threads) {
#if defined(__AVX2__) && defined(__F16C__) || defined(__AVX512F__)
    if (N % PANEL || K % BLOCK) return -3;
    long panels = N / PANEL;
    int failed = 0;
    if (M < BUFFERED) {
        /* few rows: split the panels between the threads, in groups the register tiles take whole */
        long step = 4 / VECS;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) if (M * N * K >= 65536)
#endif
        for (long g = 0; g < (panels + step - 1) / step; g++) {
            long p0 = g * step, p1 = p0 + step < panels ? p0 + step : panels;
            few(x, nibbles, sc, out, M, N, K, p0, p1);
        }
        (void)threads;
        return 0;
    }
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) reduction(| : failed)
#endif
    {
        float *w = aligned_alloc(64, sizeof(float) * PN * PANEL * K);
        failed = w == NULL;
        for (long i0 = 0; i0 < M; i0 += CHUNK) {
            long rows = M - i0 < CHUNK ? M - i0 : CHUNK;
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
            for (long p = 0; p < panels; p += PN) {
                if (w == NULL) continue;
                int np = panels - p < PN ? (int)(panels - p) : PN;
                for (int j = 0; j < np; j++)
                    dequantize_panel(nibbles + (p + j) * (K / 2) * PANEL, sc + (p + j) * (K / BLOCK) * 2 * PANEL, K,
                                     w + j * K * PANEL);
                if (np == PN)
                    tiles(x + i0 * K, w, out + i0 * N + p * PANEL, rows, N, K, PN);
                else
                    tiles(x + i0 * K, w, out + i0 * N + p * PANEL, rows, N, K, 1);
            }
        }
        free(w);
    }
    (void)threads;
    return failed ? -1 : 0;
#else
    (void)x, (void)nibbles, (void)sc, (void)out, (void)M, (void)N, (void)K, (void)threads;
    return -2;
#endif
}
