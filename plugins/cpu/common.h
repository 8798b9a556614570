/* Shared by the CPU kernels (the .c files of plugins/cpu): AVX2 + FMA, fp32. Each kernel is built by
 * plugins/cpu/loader.py on first use with the machine's compiler and called through ctypes with
 * raw pointers, which the Python side checks (dtype, contiguity, strides); nthreads > 1 splits a
 * kernel's outer loop with OpenMP. */
#ifndef LKV_COMMON_H
#define LKV_COMMON_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
