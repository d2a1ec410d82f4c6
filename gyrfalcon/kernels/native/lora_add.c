/* A step's LoRA products: y[b] += (A_s · x[b]) · Bt_s for every row b whose adapter slot s =
 * slots[b] is not -1, where A_s is rows s·rank … (s+1)·rank of the stacked A [width, in] and Bt_s
 * the same rows of the stacked, transposed B [width, out] (scaled by the adapter's scaling:
 * gyrfalcon/engine/lora/registry.py). Called by gyrfalcon/engine/lora/step.py for the operators'
 * steps and by decode_layers.c for steps of decode rows, so both give a row the same bits.
 *
 * Why a kernel of our own: with two matmuls over a masked [rows, width] product (the torch
 * operators), a row's sums ran in an order of the BLAS's choosing for the batch's shape, and the
 * native layer loop could not take adapters. Here each row is computed by one thread in one fixed
 * order whatever the rows beside it or the thread count, so it gets the same bits alone and in any
 * batch: each of its rank products of A summed in vector lanes over `in`, the lanes then summed
 * pairwise, halving (then the tail past the last vector); each output the sum over the rank, in
 * order, of product times Bt, added to y once. */

#include <stdint.h>
#include <string.h>

#include "vectors.h"

/* the most columns of a slot (--max-lora-rank's largest value) */
#define MAX_RANK 512

/* the VW lanes of v summed pairwise, halving */
static inline float lanes_sum(vf v) {
    float lane[VW];
    memcpy(lane, &v, sizeof lane);
    for (int half = VW / 2; half > 0; half /= 2)
        for (int j = 0; j < half; j++) lane[j] += lane[j + half];
    return lane[0];
}

/* t[j] = A[j] · x for the rank rows of a (`in` values each), four rows at a time over x */
static void a_products(const float *a, const float *x, long in, long rank, float *t) {
    long vectors = in / VW * VW;
    long j = 0;
    for (; j + 4 <= rank; j += 4) {
        const float *a0 = a + j * in, *a1 = a0 + in, *a2 = a1 + in, *a3 = a2 + in;
        vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        for (long i = 0; i < vectors; i += VW) {
            vf v, w;
            memcpy(&v, x + i, sizeof v);
            memcpy(&w, a0 + i, sizeof w);
            s0 += w * v;
            memcpy(&w, a1 + i, sizeof w);
            s1 += w * v;
            memcpy(&w, a2 + i, sizeof w);
            s2 += w * v;
            memcpy(&w, a3 + i, sizeof w);
            s3 += w * v;
        }
        t[j] = lanes_sum(s0), t[j + 1] = lanes_sum(s1), t[j + 2] = lanes_sum(s2), t[j + 3] = lanes_sum(s3);
        for (long i = vectors; i < in; i++) {
            t[j] += a0[i] * x[i], t[j + 1] += a1[i] * x[i];
            t[j + 2] += a2[i] * x[i], t[j + 3] += a3[i] * x[i];
        }
    }
    for (; j < rank; j++) { /* the same sums, one row at a time */
        const float *a0 = a + j * in;
        vf s0 = {0};
        for (long i = 0; i < vectors; i += VW) {
            vf v, w;
            memcpy(&v, x + i, sizeof v);
            memcpy(&w, a0 + i, sizeof w);
            s0 += w * v;
        }
        t[j] = lanes_sum(s0);
        for (long i = vectors; i < in; i++) t[j] += a0[i] * x[i];
    }
}

/* y[o] += sum over j of t[j] · bt[j, o], each output's sum in order of j */
static void b_products(const float *bt, const float *t, long out, long rank, float *y) {
    long vectors = out / VW * VW;
    for (long o = 0; o < vectors; o += VW) {
        vf sum = {0};
        for (long j = 0; j < rank; j++) {
            vf w;
            memcpy(&w, bt + j * out + o, sizeof w);
            sum += t[j] * w;
        }
        vf old;
        memcpy(&old, y + o, sizeof old);
        old += sum;
        memcpy(y + o, &old, sizeof old);
    }
    for (long o = vectors; o < out; o++) {
        float sum = 0.0f;
        for (long j = 0; j < rank; j++) sum += t[j] * bt[j * out + o];
        y[o] += sum;
    }
}

/* x: rows of `in` values `x_stride` apart; y: rows of `out` values `y_stride` apart, updated in
 * place; width: the stacks' rows (slots · rank). Returns 0, or -2 for a rank above MAX_RANK. */
int lora_add(const float *x, long x_stride, const float *a, const float *bt, const int64_t *slots, float *y,
             long y_stride, long rows, long in, long out, long rank, long width, int threads) {
    if (rank > MAX_RANK) return -2;
    long held = 0;
    for (long r = 0; r < rows; r++) held += slots[r] >= 0;
    (void)threads, (void)width;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) if (held * rank * (in + out) >= 65536)
#endif
    for (long r = 0; r < rows; r++) {
        if (slots[r] < 0) continue;
        float t[MAX_RANK];
        a_products(a + slots[r] * rank * in, x + r * x_stride, in, rank, t);
        b_products(bt + slots[r] * rank * out, t, out, rank, y + r * y_stride);
    }
    return 0;
}
