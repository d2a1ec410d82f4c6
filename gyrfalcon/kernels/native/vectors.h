/* The machine's vector width for the kernels of this folder that work in it: 16 floats with AVX-512,
 * 8 with AVX2 (whose 16 registers held a 16-lane loop's accumulators only on the stack) and elsewhere. */
#ifndef GYRFALCON_VECTORS_H
#define GYRFALCON_VECTORS_H

#include <stdint.h>

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

/* The formats a KV cache's values are kept in (the `format` argument of the attention kernels) */
enum { CACHE_FP32 = 0, CACHE_BF16 = 1, CACHE_FP16 = 2 };

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* VW fp16 values widened to fp32 (exact): F16C's vcvtph2ps where the machine has it (GCC 12 widens
 * a _Float16 vector one value at a time) */
static inline vf widen_fp16(const void *p) {
    vf v;
#if VW == 16
    __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    __builtin_memcpy(&v, &w, sizeof v);
#elif defined(__F16C__)
    __m256 w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __builtin_memcpy(&v, &w, sizeof v);
#else
    typedef _Float16 vhalf __attribute__((vector_size(VW * 2)));
    vhalf h;
    __builtin_memcpy(&h, p, sizeof h);
    v = __builtin_convertvector(h, vf);
#endif
    return v;
}

#endif
