/* out[r] = mean over k of x[r, k]², the mean of squares an RMSNorm takes, in fp32.
 *
 * Why a kernel of our own: a compiled decode step and the eager one must round alike (a request's
 * steps take either, see gyrfalcon/engine/model/captured.py), and inductor sums a reduction in
 * another order than ATen, so the norm ran as an opaque operator over ATen's kernels: two
 * operators and an operator dispatch, about 24 µs a call and 61 calls a step on the default
 * model. This is one call of about 9.
 *
 * Each row is summed in one fixed order (16 lanes, k ascending, then the lanes pairwise) by one
 * thread, whatever the rows beside it or the thread count: a row's mean has the same bits alone
 * and in any batch, eager and compiled. */

#define LANES 16

void mean_square(const float *x, float *out, long rows, long width, int threads) {
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) if (rows * width >= 65536)
#endif
    for (long r = 0; r < rows; r++) {
        const float *row = x + r * width;
        float acc[LANES] = {0};
        long k = 0;
        for (; k + LANES <= width; k += LANES)
            for (int j = 0; j < LANES; j++)
                acc[j] += row[k + j] * row[k + j];
        for (int j = 0; k < width; k++, j++)
            acc[j] += row[k] * row[k];
        for (int half = LANES / 2; half > 0; half /= 2)
            for (int j = 0; j < half; j++)
                acc[j] += acc[j + half];
        out[r] = acc[0] / (float)width;
    }
    (void)threads;
}
