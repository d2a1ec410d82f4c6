/* out[r] = mean over k of x[r, k]², the mean of squares an RMSNorm takes, in fp32.
 *
 * Why a kernel of our own: a compiled decode step and the eager one must round alike (a request's
 * steps take either, see gyrfalcon/engine/model/captured.py), and a reduction sums in an order of
 * its kernel's choosing (ATen's, inductor's). This one sums each row in one fixed order, by one
 * thread, whatever the rows beside it or the thread count, so a row's mean has the same bits alone
 * and in any batch:
 *   - the squares, each rounded (no fused multiply-add), in chunks of 16 lanes, the last chunk
 *     padded with zeros, and zero chunks up to a power of two;
 *   - the chunks summed pairwise, halving: chunk i += chunk i + n/2;
 *   - the 16 lanes of the last chunk summed the same way; the sum divided by the width.
 * The eager step calls it (about 5 µs a call, against two ATen operators); a compiled step computes
 * the same sums with the same elementwise operations, which inductor fuses into the norm
 * (gyrfalcon/engine/model/decoder.py, _mean_square_in_lanes), instead of an opaque call of about
 * 7 µs, 61 a step on the default model. */

#include <stdlib.h>

#define LANES 16
#define STACK_CHUNKS 512 /* widths up to 8,192 sum on the stack */

#if defined(__clang__)
#define NO_FMA
#else
#define NO_FMA __attribute__((optimize("fp-contract=off")))
#endif

/* one row's mean, summed in chunks[n * LANES]: n is the width in chunks, padded to a power of two */
NO_FMA static float row_mean_square(const float *row, long width, long n, float *chunks) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    for (long k = 0; k < n * LANES; k++) chunks[k] = k < width ? row[k] * row[k] : 0.f;
    for (; n > 1; n /= 2)
        for (long k = 0; k < n / 2 * LANES; k++) chunks[k] += chunks[k + n / 2 * LANES];
    for (int half = LANES / 2; half > 0; half /= 2)
        for (int j = 0; j < half; j++) chunks[j] += chunks[j + half];
    return chunks[0] / (float)width;
}

/* returns 0, or -1 where a row too wide for the stack could not get its buffer */
int mean_square(const float *x, float *out, long rows, long width, int threads) {
    long chunks = 1;
    while (chunks * LANES < width) chunks *= 2;
    int failed = 0;
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) if (rows * width >= 65536) reduction(| : failed)
#endif
    {
        float stack[STACK_CHUNKS * LANES];
        float *buffer = chunks <= STACK_CHUNKS ? stack : malloc(sizeof(float) * chunks * LANES);
        failed = buffer == NULL;
#if defined(_OPENMP)
#pragma omp for
#endif
        for (long r = 0; r < rows; r++)
            if (buffer != NULL) out[r] = row_mean_square(x + r * width, width, chunks, buffer);
        if (buffer != stack) free(buffer);
    }
    (void)threads;
    return failed ? -1 : 0;
}
