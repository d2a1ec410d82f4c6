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

#endif
