/* Every decoder layer of a decode step in one call: for each of `rows` single-token rows, the
 * Llama-shaped layer of gyrfalcon/engine/model/decoder.py (RMSNorm, fused q/k/v in int4, rotary
 * embedding from a cos/sin table, the new keys and values written to their cache slots, attention
 * over the row's blocks in place, o_proj and the residual, RMSNorm, fused gate/up in int4,
 * silu(gate) · up, down_proj and the residual), layer after layer, on the hidden states x in place;
 * each projection an adapter targets gains its rows' LoRA products (lora_add.c) where the operators
 * add them. Called by gyrfalcon/engine/model/layer_loop.py.
 *
 * Why: the eager step calls about 40 operators a layer (1,200 a step on the default model), whose
 * dispatch cost more than their arithmetic at small batches; a compiled step fused them, but took
 * minutes of compiling on a fresh machine and a few hundred MiB of compiler state. This runs the
 * same kernels as the eager step (q4_linear.c or q4q8_linear.c, mean_square.c,
 * one_query_attention.c) and does the elementwise work between them operation for operation as
 * ATen does — each product rounded before the sum it feeds (never fused), silu's exp as ATen's
 * (SLEEF's expf_u10 in vectors, the C library's past the last pair of vectors of a row) — so a
 * row gets the eager step's bits to the last one, which the runner checks before it serves with
 * this. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "vectors.h"

int q4_linear(const float *x, const uint8_t *nibbles, const uint16_t *sc, float *out, long M, long N, long K,
              int threads);
int q4q8_linear(const float *x, const uint8_t *nibbles, const uint16_t *sc, float *out, long M, long N, long K,
                int threads);
int q4q16_linear(const float *x, const uint8_t *nibbles, const uint16_t *sc, float *out, long M, long N, long K,
                 int threads);
int mean_square(const float *x, float *out, long rows, long width, int threads);
int one_query_attention(const float *q, const void *keys, const void *values, const int64_t *blocks,
                        const int64_t *positions, float *out, long rows, long heads, long kv_heads, long dim,
                        long table_width, long block_size, long window, float scale, int format, int threads);
int lora_add(const float *x, long x_stride, const float *a, const float *b, const int64_t *slots, float *y,
             long y_stride, long rows, long in, long out, long rank, long width, int threads);

/* one layer's fields, as layer_loop.py's LayerLoop._layers lays them out */
enum {
    QKV_NIBBLES, QKV_SCALES, QKV_BIAS, O_NIBBLES, O_SCALES, O_BIAS, GATE_UP_NIBBLES, GATE_UP_SCALES, GATE_UP_BIAS,
    DOWN_NIBBLES, DOWN_SCALES, DOWN_BIAS, INPUT_NORM, POST_NORM, KEYS, VALUES, WINDOW, FIELDS
};

/* one layer's LoRA stacks (A then B of each projection; 0: no adapter targets it), as
 * layer_loop.py's LayerLoop._adapters lays them out */
enum { LORA_Q, LORA_K, LORA_V, LORA_O, LORA_GATE, LORA_UP, LORA_DOWN, LORA_FIELDS = 2 * (LORA_DOWN + 1) };

/* the adapters' rows of a step: their slots (-1: none), each layer's stacks, their rank and width */
struct adapters {
    const int64_t *table, *slots;
    long rank, width;
};

/* y += the rows' products of projection `module` of the layer whose stacks are `stacks` (none: nothing) */
static int add_lora(const struct adapters *lora, const int64_t *stacks, int module, const float *x, long x_stride,
                    float *y, long y_stride, long rows, long in, long out, int threads) {
    if (lora->table == NULL || stacks[2 * module] == 0) return 0;
    return lora_add(x, x_stride, (const float *)(intptr_t)stacks[2 * module],
                    (const float *)(intptr_t)stacks[2 * module + 1], lora->slots, y, y_stride, rows, in, out,
                    lora->rank, lora->width, threads);
}

/* `p` kept as computed, rounded to fp32, before whatever sum it feeds: -ffp-contract=fast would fuse the two */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define ROUNDED(p) __asm__("" : "+x"(p))
#else
#define ROUNDED(p)                                                                                                     \
    do {                                                                                                               \
        volatile __typeof__(p) kept_ = (p);                                                                            \
        (p) = kept_;                                                                                                   \
    } while (0)
#endif

static inline float product(float a, float b) {
    float p = a * b;
    ROUNDED(p);
    return p;
}

/* product() for VW lanes */
static inline vf vproduct(vf a, vf b) {
    vf p = a * b;
    ROUNDED(p);
    return p;
}

/* a · b + c rounded once, in VW lanes */
static inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && VW == 8
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vf r;
    for (int lane = 0; lane < VW; lane++) r[lane] = fmaf(a[lane], b[lane], c[lane]);
    return r;
#endif
}

/* e^d in VW lanes as ATen's Vectorized<float>::exp (SLEEF's expf_u10 with fused multiply-adds),
 * operation for operation: the same bits, checked against torch.nn.functional.silu by
 * tests/unit/test_layer_loop.py. rint is the addition and subtraction of 1.5 · 2^23 (to nearest
 * even below 2^22; larger inputs are replaced at the end), 2^q is applied in two factors (each a
 * normal float) as SLEEF's ldexp2k. */
static inline vf vexp_u10(vf d) {
    const vf zero = {0}, magic = zero + 12582912.0f;
    vf qf = (vproduct(d, zero + 1.442695040888963407359924681001892137426645954152985934135449406931f) + magic) - magic;
    vf s = vfma(qf, zero - 0.693145751953125f, d);
    s = vfma(qf, zero - 1.428606765330187045e-06f, s);
    vf u = zero + 0.000198527617612853646278381f;
    u = vfma(u, s, zero + 0.00139304355252534151077271f);
    u = vfma(u, s, zero + 0.00833336077630519866943359f);
    u = vfma(u, s, zero + 0.0416664853692054748535156f);
    u = vfma(u, s, zero + 0.166666671633720397949219f);
    u = vfma(u, s, zero + 0.5f);
    u = 1.0f + vfma(vproduct(s, s), u, s);
    vi q = __builtin_convertvector(qf, vi), a = q >> 1, b = q - a;
    vi ua = (a + 127) << 23, ub = (b + 127) << 23;
    vf fa, fb;
    memcpy(&fa, &ua, sizeof fa);
    memcpy(&fb, &ub, sizeof fb);
    u = vproduct(vproduct(u, fa), fb);
    vi low = d < -104.0f, high = d > 100.0f;
    vi ui, inf = (vi){0} + 0x7f800000;
    memcpy(&ui, &u, sizeof ui);
    ui = (ui & ~low & ~high) | (inf & high);
    memcpy(&u, &ui, sizeof u);
    return u;
}

/* out[i] = silu(gate[i]) · up[i] for a row of n values (F.silu then the product, each rounded), as
 * ATen's loop over a row: pairs of vectors in SLEEF's exp, the values past the last pair in the C
 * library's expf (std::exp) */
void silu_mul(const float *gate, const float *up, float *out, long n) {
    long i = 0, paired = n - n % (2 * VW);
    for (; i < paired; i += VW) {
        vf g, v;
        memcpy(&g, gate + i, sizeof g);
        memcpy(&v, up + i, sizeof v);
        vf y = vproduct(g / (1.0f + vexp_u10(-g)), v);
        memcpy(out + i, &y, sizeof y);
    }
    for (; i < n; i++) {
        float g = gate[i];
        out[i] = product(g / (1.0f + expf(-g)), up[i]);
    }
}

/* an fp32 value as bf16, rounded to nearest even (torch's .to(torch.bfloat16)) */
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* n values into a cache of `format` (vectors.h's CACHE_*) from slot offset `at`, rounded to nearest
 * even as torch's .to(dtype) rounds them (the prefill's writes) */
static void store_kv(void *cache, size_t at, const float *x, long n, int format) {
    if (format == CACHE_FP32) {
        memcpy((float *)cache + at, x, sizeof(float) * n);
    } else if (format == CACHE_BF16) {
        for (long i = 0; i < n; i++) ((uint16_t *)cache)[at + i] = bf16_of(x[i]);
    } else {
        for (long i = 0; i < n; i++) ((_Float16 *)cache)[at + i] = (_Float16)x[i];
    }
}

/* out = weight · (x · 1/sqrt(mean(x²) + eps)) per row, as decoder.py's _rms_norm */
static int rms_norm(const float *x, const float *weight, float *out, float *squares, long rows, long width, float eps,
                    int threads) {
    if (mean_square(x, squares, rows, width, threads)) return -1;
    for (long r = 0; r < rows; r++) {
        float scale = 1.0f / sqrtf(squares[r] + eps);
        for (long i = 0; i < width; i++) out[r * width + i] = product(weight[i], product(x[r * width + i], scale));
    }
    return 0;
}

/* transformers' rotate_half rotary embedding of `heads` heads of width dim, in place:
 * x · cos + cat(-x[half:], x[:half]) · sin, each product rounded */
static void rotate(float *x, long heads, long dim, const float *cos, const float *sin) {
    long half = dim / 2;
    for (long h = 0; h < heads; h++) {
        float *v = x + h * dim, rotated[512];
        for (long i = 0; i < dim; i++) rotated[i] = i < half ? -v[i + half] : v[i - half];
        for (long i = 0; i < dim; i++) v[i] = product(v[i], cos[i]) + product(rotated[i], sin[i]);
    }
}

/* the product through the kernel of the input format `inputs`: 0 fp32, 1 int8, 2 two int8 parts */
static int linear(int inputs, const float *x, const int64_t *layer, int field, float *out, long M, long N, long K,
                  int threads) {
    const uint8_t *nibbles = (const uint8_t *)(intptr_t)layer[field];
    const uint16_t *scales = (const uint16_t *)(intptr_t)layer[field + 1];
    const float *bias = (const float *)(intptr_t)layer[field + 2];
    int status = inputs == 2   ? q4q16_linear(x, nibbles, scales, out, M, N, K, threads)
                 : inputs == 1 ? q4q8_linear(x, nibbles, scales, out, M, N, K, threads)
                               : q4_linear(x, nibbles, scales, out, M, N, K, threads);
    if (status || bias == NULL) return status;
    for (long m = 0; m < M; m++)
        for (long n = 0; n < N; n++) out[m * N + n] += bias[n];
    return 0;
}

/* x[rows, hidden] through every layer of `layers` (FIELDS pointers each), in place. Row b is the
 * token at positions[b], its keys and values written to slots[b], its context read through
 * blocks[b, :table_width]; cos/sin: [positions, dim] tables. lora_table ([count, LORA_FIELDS]
 * pointers; NULL: no adapter) and lora_slots, lora_rank, lora_width: lora_add.c's. Returns 0, -1
 * where a buffer could not be had, or a kernel's own failure. */
int decode_layers(const int64_t *layers, long count, float *x, long rows, long hidden, long heads, long kv_heads,
                  long dim, long intermediate, const int64_t *positions, const int64_t *slots, const int64_t *blocks,
                  long table_width, long block_size, const float *cos, const float *sin, float eps, float scale,
                  int format, int inputs, const int64_t *lora_table, const int64_t *lora_slots, long lora_rank,
                  long lora_width, int threads) {
    const struct adapters lora = {lora_table, lora_slots, lora_rank, lora_width};
    long q_width = heads * dim, kv_width = kv_heads * dim, qkv_width = q_width + 2 * kv_width;
    if (dim > 512 || dim % 2) return -3;
    size_t floats = (size_t)rows * (hidden * 3 + qkv_width + q_width * 2 + intermediate * 3 + 1);
    float *work = malloc(sizeof(float) * floats);
    if (work == NULL) return -1;
    float *normed = work, *qkv = normed + rows * hidden, *q = qkv + rows * qkv_width, *attended = q + rows * q_width;
    float *projected = attended + rows * q_width, *gate_up = projected + rows * hidden;
    float *act = gate_up + rows * 2 * intermediate, *squares = act + rows * intermediate;
    int status = 0;
    for (long l = 0; l < count && status == 0; l++) {
        const int64_t *layer = layers + l * FIELDS, *stacks = lora_table ? lora_table + l * LORA_FIELDS : NULL;
        char *keys = (char *)(intptr_t)layer[KEYS], *values = (char *)(intptr_t)layer[VALUES];
        status = rms_norm(x, (const float *)(intptr_t)layer[INPUT_NORM], normed, squares, rows, hidden, eps, threads);
        if (status == 0) status = linear(inputs, normed, layer, QKV_NIBBLES, qkv, rows, qkv_width, hidden, threads);
        if (status == 0)
            status = add_lora(&lora, stacks, LORA_Q, normed, hidden, qkv, qkv_width, rows, hidden, q_width, threads);
        if (status == 0)
            status = add_lora(&lora, stacks, LORA_K, normed, hidden, qkv + q_width, qkv_width, rows, hidden, kv_width,
                              threads);
        if (status == 0)
            status = add_lora(&lora, stacks, LORA_V, normed, hidden, qkv + q_width + kv_width, qkv_width, rows,
                              hidden, kv_width, threads);
        if (status) break;
        for (long b = 0; b < rows; b++) {
            float *row = qkv + b * qkv_width, *k = row + q_width, *v = k + kv_width;
            const float *c = cos + positions[b] * dim, *s = sin + positions[b] * dim;
            memcpy(q + b * q_width, row, sizeof(float) * q_width);
            rotate(q + b * q_width, heads, dim, c, s);
            rotate(k, kv_heads, dim, c, s);
            size_t at = (size_t)slots[b] * kv_width;
            store_kv(keys, at, k, kv_width, format);
            store_kv(values, at, v, kv_width, format);
        }
        status = one_query_attention(q, keys, values, blocks, positions, attended, rows, heads, kv_heads, dim,
                                     table_width, block_size, layer[WINDOW], scale, format, threads);
        if (status == 0) status = linear(inputs, attended, layer, O_NIBBLES, projected, rows, hidden, q_width, threads);
        if (status == 0)
            status = add_lora(&lora, stacks, LORA_O, attended, q_width, projected, hidden, rows, q_width, hidden,
                              threads);
        if (status) break;
        for (long i = 0; i < rows * hidden; i++) x[i] = x[i] + projected[i];
        status = rms_norm(x, (const float *)(intptr_t)layer[POST_NORM], normed, squares, rows, hidden, eps, threads);
        if (status == 0)
            status = linear(inputs, normed, layer, GATE_UP_NIBBLES, gate_up, rows, 2 * intermediate, hidden, threads);
        if (status == 0)
            status = add_lora(&lora, stacks, LORA_GATE, normed, hidden, gate_up, 2 * intermediate, rows, hidden,
                              intermediate, threads);
        if (status == 0)
            status = add_lora(&lora, stacks, LORA_UP, normed, hidden, gate_up + intermediate, 2 * intermediate, rows,
                              hidden, intermediate, threads);
        if (status) break;
        for (long b = 0; b < rows; b++)
            silu_mul(gate_up + b * 2 * intermediate, gate_up + b * 2 * intermediate + intermediate,
                     act + b * intermediate, intermediate);
        status = linear(inputs, act, layer, DOWN_NIBBLES, projected, rows, hidden, intermediate, threads);
        if (status == 0)
            status = add_lora(&lora, stacks, LORA_DOWN, act, intermediate, projected, hidden, rows, intermediate,
                              hidden, threads);
        if (status == 0)
            for (long i = 0; i < rows * hidden; i++) x[i] = x[i] + projected[i];
    }
    free(work);
    return status;
}
