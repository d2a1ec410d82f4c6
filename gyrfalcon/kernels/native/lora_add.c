/* A step's LoRA products: y[b] += (A_s · x[b]) · Bt_s for every row b whose adapter slot s =
 * slots[b] is not -1, where A_s is rows s·rank … (s+1)·rank of the stacked A [width, in] and Bt_s
 * the same rows of the stacked, transposed B [width, out] (scaled by the adapter's scaling:
 * gyrfalcon/engine/lora/registry.py). Called by gyrfalcon/engine/lora/step.py for the operators'
 * steps (eagerly, and in a compiled step as the operator gyrfalcon::lora_product) and by
 * decode_layers.c for steps of decode rows, so all give a row the same bits.
 *
 * Why a kernel of our own: with two matmuls over a masked [rows, width] product (the torch
 * operators), a row's sums ran in an order of the BLAS's choosing for the batch's shape, and the
 * native layer loop could not take adapters. Here each row is computed by one thread in one fixed
 * order whatever the rows beside it or the thread count, so it gets the same bits alone and in any
 * batch: each of its rank products of A summed in vector lanes over `in`, the lanes then summed
 * pairwise, halving (then the tail past the last vector); each output the sum over the rank, in
 * order, of product times Bt, added to y once. */

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/* the VW-lane dot products of a[0..3] (rows of `in` values) with x, summed pairwise: t[0..3] */
static void four_dots(const float *a, const float *x, long in, float *t) {
    long vectors = in / VW * VW;
    const float *a0 = a, *a1 = a0 + in, *a2 = a1 + in, *a3 = a2 + in;
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
    t[0] = lanes_sum(s0), t[1] = lanes_sum(s1), t[2] = lanes_sum(s2), t[3] = lanes_sum(s3);
    for (long i = vectors; i < in; i++) t[0] += a0[i] * x[i], t[1] += a1[i] * x[i], t[2] += a2[i] * x[i], t[3] += a3[i] * x[i];
}

/* four_dots' sum for one row of a */
static float one_dot(const float *a, const float *x, long in) {
    long vectors = in / VW * VW;
    vf s0 = {0};
    for (long i = 0; i < vectors; i += VW) {
        vf v, w;
        memcpy(&v, x + i, sizeof v);
        memcpy(&w, a + i, sizeof w);
        s0 += w * v;
    }
    float t = lanes_sum(s0);
    for (long i = vectors; i < in; i++) t += a[i] * x[i];
    return t;
}

/* OUT_BLOCK outputs of one row from o on (t: its rank products): y[o..] += sum over j, in order,
 * of t[j] · bt[j][o..]; four chains of sums, each step of a chain waiting for the one before */
#define OUT_BLOCK (4 * VW)
static void b_block(const float *bt, long out, long o, const float *t, float *y, long rank) {
    vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    for (long j = 0; j < rank; j++) {
        const float *row = bt + j * out + o;
        vf w0, w1, w2, w3;
        memcpy(&w0, row, sizeof w0);
        memcpy(&w1, row + VW, sizeof w1);
        memcpy(&w2, row + 2 * VW, sizeof w2);
        memcpy(&w3, row + 3 * VW, sizeof w3);
        s0 += t[j] * w0, s1 += t[j] * w1, s2 += t[j] * w2, s3 += t[j] * w3;
    }
    vf old[4], sums[4] = {s0, s1, s2, s3};
    memcpy(old, y + o, sizeof old);
    for (int k = 0; k < 4; k++) old[k] += sums[k];
    memcpy(y + o, old, sizeof old);
}

/* x: rows of `in` values `x_stride` apart; y: rows of `out` values `y_stride` apart, updated in
 * place; width: the stacks' rows (slots · rank). The rows are visited slot by slot, so that a
 * slot's A and Bt are read once for all its rows. Returns 0, -1 where a buffer could not be had,
 * or -2 for a rank above MAX_RANK. */
int lora_add(const float *x, long x_stride, const float *a, const float *bt, const int64_t *slots, float *y,
             long y_stride, long rows, long in, long out, long rank, long width, int threads) {
    if (rank > MAX_RANK) return -2;
    long count = width / rank, held = 0;
    /* order[rows], then first[count + 1] and next[count + 1] */
    long *order = malloc(sizeof(long) * (rows + 2 * (count + 1))), *first = order + rows, *next = first + count + 1;
    float *t = malloc(sizeof(float) * (rows * rank + 1));
    if (order == NULL || t == NULL) {
        free(order), free(t);
        return -1;
    }
    /* the rows of each slot, in order: order[first[s] .. first[s + 1]) */
    for (long s = 0; s <= count; s++) first[s] = 0;
    for (long r = 0; r < rows; r++)
        if (slots[r] >= 0 && slots[r] < count) first[slots[r] + 1]++, held++;
    for (long s = 0; s < count; s++) first[s + 1] += first[s];
    memcpy(next, first, sizeof(long) * (count + 1));
    for (long r = 0; r < rows; r++)
        if (slots[r] >= 0 && slots[r] < count) order[next[slots[r]]++] = r;
    (void)threads;
    long groups = (rank + 3) / 4; /* A's rows four at a time (the last group may be shorter) */
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) if (held * rank * (in + out) >= 65536)
#endif
    {
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (long task = 0; task < count * groups; task++) {
            long s = task / groups, j = task % groups * 4;
            const float *a_rows = a + (s * rank + j) * in;
            for (long i = first[s]; i < first[s + 1]; i++) {
                long r = order[i];
                if (j + 4 <= rank)
                    four_dots(a_rows, x + r * x_stride, in, t + r * rank + j);
                else
                    for (long k = j; k < rank; k++) t[r * rank + k] = one_dot(a_rows + (k - j) * in, x + r * x_stride, in);
            }
        }
        long blocks = out / OUT_BLOCK;
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (long block = 0; block < blocks; block++) /* a slot's block of Bt read from L1 for each of its rows */
            for (long s = 0; s < count; s++)
                for (long i = first[s]; i < first[s + 1]; i++)
                    b_block(bt + s * rank * out, out, block * OUT_BLOCK, t + order[i] * rank, y + order[i] * y_stride,
                            rank);
#if defined(_OPENMP)
#pragma omp single
#endif
        for (long o = blocks * OUT_BLOCK; o < out; o++) /* the outputs past the last block, one at a time */
            for (long r = 0; r < rows; r++)
                if (slots[r] >= 0 && slots[r] < count) {
                    const float *row_t = t + r * rank, *b = bt + slots[r] * rank * out;
                    float sum = 0.0f;
                    for (long j = 0; j < rank; j++) sum += row_t[j] * b[j * out + o];
                    y[r * y_stride + o] += sum;
                }
    }
    free(order), free(t);
    return 0;
}

/* bt [rank][out] = b [out][rank] transposed, each value times scaling (one product, rounded once,
 * as a value at a time gives it). Why tiles of 8 x 8 in AVX registers: a value at a time, each
 * stored bt's stride from the last, took three times as long (1.1 ms against 0.4 for the default
 * model's adapter of rank 16, the most of a load past the read of its file). */
#if defined(__AVX__)
#include <immintrin.h>
static inline void tile8(const float *src, long src_stride, float *dst, long dst_stride, __m256 scale) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * src_stride);
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * dst_stride, _mm256_mul_ps(_mm256_permute2f128_ps(u[i], u[4 + i], 0x20), scale));
        _mm256_storeu_ps(dst + (4 + i) * dst_stride, _mm256_mul_ps(_mm256_permute2f128_ps(u[i], u[4 + i], 0x31), scale));
    }
}
#endif

static void transpose_scaled(const float *b, float *bt, long out, long rank, float scaling) {
    long o0 = 0;
#if defined(__AVX__)
    __m256 scale = _mm256_set1_ps(scaling);
    if (rank % 8 == 0)
        for (; o0 + 8 <= out; o0 += 8)
            for (long r0 = 0; r0 < rank; r0 += 8) tile8(b + o0 * rank + r0, rank, bt + r0 * out + o0, out, scale);
#endif
    for (; o0 < out; o0++)
        for (long r = 0; r < rank; r++) bt[r * out + o0] = b[o0 * rank + r] * scaling;
}

/* One projection's slot rows (as: A's, max_rank of `in` values; bs: Bt's, max_rank of `out`):
 * A's rank rows from a [rank][in] (nothing to copy where a is as), Bt's from b [out][rank]
 * transposed and times scaling, the rows past rank zero; a or b NULL: all the rows zero (the
 * adapter has no factors there). Each value is one product, rounded once: the bits numpy's
 * `b.T * scaling` gives. */
static void pack_one(const float *a, const float *b, float *as, float *bs, long in, long out, long rank,
                     long max_rank, float scaling) {
    long kept = a != NULL && b != NULL ? rank : 0;
    if (kept && a != as) memcpy(as, a, sizeof(float) * (size_t)(kept * in));
    memset(as + kept * in, 0, sizeof(float) * (size_t)((max_rank - kept) * in));
    if (kept) transpose_scaled(b, bs, out, rank, scaling);
    memset(bs + kept * out, 0, sizeof(float) * (size_t)((max_rank - kept) * out));
}

/* One adapter's factors into its slot (rows first .. first + max_rank) of `count` projections'
 * stacks, the layout lora_add reads: projection j's from a[j] [rank][in[j]] and b[j]
 * [out[j]][rank] (pack_one; NULL where the adapter has none) into a_stack[j] and bt_stack[j].
 * Returns 0, or -EINVAL for a rank above max_rank. */
int lora_pack(long count, const float *const *a, const float *const *b, float *const *a_stack, float *const *bt_stack,
              const long *in, const long *out, long first, long rank, long max_rank, float scaling, int threads) {
    (void)threads;
    if (rank < 0 || rank > max_rank) return -EINVAL;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(dynamic, 8)
#endif
    for (long j = 0; j < count; j++)
        pack_one(a[j], b[j], a_stack[j] + first * in[j], bt_stack[j] + first * out[j], in[j], out[j], rank, max_rank,
                 scaling);
    return 0;
}

/* all `size` bytes of fd at `at` into `into`: 0, 1 where the file ends first, or -errno */
static int read_fully(int fd, void *into, size_t size, long at) {
    char *to = into;
    while (size > 0) {
        ssize_t got = pread(fd, to, size, (off_t)at);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return -errno;
        if (got == 0) return 1;
        to += got, at += got, size -= (size_t)got;
    }
    return 0;
}

/* What lora_read's threads share: its arguments, the next projection to take, and the first failure. */
struct read_job {
    int fd;
    long count;
    const long *a_at, *b_at;
    float *const *a_stack, *const *bt_stack;
    const long *in, *out;
    long first, rank, max_rank, most;
    float scaling;
    long next;
    int status;
};

/* one thread's part of lora_read: projections taken one at a time until none is left or a read failed */
static void *read_some(void *arg) {
    struct read_job *job = arg;
    float *buffer = malloc(sizeof(float) * (size_t)(job->most * job->rank + 1));
    int status = buffer == NULL ? -ENOMEM : 0;
    long j;
    while (status == 0 && __atomic_load_n(&job->status, __ATOMIC_RELAXED) == 0 &&
           (j = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < job->count) {
        long in = job->in[j], out = job->out[j];
        float *as = job->a_stack[j] + job->first * in, *bs = job->bt_stack[j] + job->first * out;
        int held = job->a_at[j] >= 0 && job->b_at[j] >= 0;
        if (held && (status = read_fully(job->fd, as, sizeof(float) * (size_t)(job->rank * in), job->a_at[j])) == 0)
            status = read_fully(job->fd, buffer, sizeof(float) * (size_t)(job->rank * out), job->b_at[j]);
        if (status == 0)
            pack_one(held ? as : NULL, held ? buffer : NULL, as, bs, in, out, job->rank, job->max_rank, job->scaling);
    }
    free(buffer);
    int none = 0;
    if (status != 0) __atomic_compare_exchange_n(&job->status, &none, status, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return NULL;
}

/* lora_pack's slot written straight from an fp32 safetensors file fd: projection j's A read from
 * byte a_at[j] into its slot rows as it lies, its B from b_at[j] into a buffer the size of one
 * projection's B and laid from there (-1: the adapter has no factors there). Why projection by
 * projection: each B is transposed while its bytes are still in the cache the read left them in;
 * read whole into the slot first, then transposed, a load cost 1.3 ms more for the default model.
 * On the calling thread and threads - 1 more, each taking the next projection, each with its own
 * buffer: plain threads, not an OpenMP team, which would leave libgomp counting threads that
 * throttle the step loop's own teams (gyrfalcon/kernels/native/__init__.py, threads()). Returns 0,
 * 1 where the file ends early, or -errno (-ENOMEM: no buffer, -EINVAL: a rank above max_rank). */
int lora_read(int fd, long count, const long *a_at, const long *b_at, float *const *a_stack, float *const *bt_stack,
              const long *in, const long *out, long first, long rank, long max_rank, float scaling, int threads) {
    if (rank < 0 || rank > max_rank) return -EINVAL;
    struct read_job job = {fd, count, a_at, b_at, a_stack, bt_stack, in, out, first, rank, max_rank, 0, scaling, 0, 0};
    for (long j = 0; j < count; j++)
        if (b_at[j] >= 0 && out[j] > job.most) job.most = out[j];
    enum { MOST_HELPERS = 15 };
    pthread_t helpers[MOST_HELPERS];
    int started = 0;
    while (started < threads - 1 && started < MOST_HELPERS &&
           pthread_create(&helpers[started], NULL, read_some, &job) == 0)
        started++;
    read_some(&job);
    for (int i = 0; i < started; i++) pthread_join(helpers[i], NULL);
    return job.status;
}
