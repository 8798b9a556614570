/* Shared by the CPU kernels (the .c files of plugins/cpu): AVX2 + FMA (+ F16C for 16-bit K/V), fp32
 * math helpers. Each kernel is built by plugins/cpu/loader.py on first use with the machine's
 * compiler and called through ctypes with raw pointers, which the Python side checks (dtype,
 * contiguity, strides); nthreads > 1 splits a kernel's outer loop with OpenMP. What crosses the
 * C/Python boundary (codes, structs, prototypes) is lkv_abi.h's. */
#ifndef LKV_COMMON_H
#define LKV_COMMON_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lkv_abi.h"     /* the storage and return codes, the structs, every exported prototype */

/* eight elements from element i of a row of storage type T (LKV_KV_*: K/V, or block summaries kept
 * in the KV dtype), as fp32; widening is exact (F16C's vcvtph2ps; bf16 by a shift) */
static inline __attribute__((always_inline)) __m256 lkv_load8(const void *row, int64_t i, int T) {
    if (T == LKV_KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    if (T == LKV_KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i))), 16));
    return _mm256_loadu_ps((const float *)row + i);
}

/* The AVX-512 functions' targets (gemm.c, prefill_attention_bf16.c: the AVX-512 library only) */
#define LKV_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define LKV_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp for x <= 0 (Cephes' single-precision polynomial; ~1e-7 relative error). */
static inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* bf16 bits of x, round to nearest even (as torch's .to(torch.bfloat16)); a NaN stays a quiet NaN */
static inline uint32_t bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

/* bf16_bits of eight fp32 values, one per 32-bit lane */
static inline __m256i bf16x8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                                         _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, q, nan);
}

/* Sixteen consecutive values (a: the first eight, b: the next, widened to fp32) as eight bf16
 * pairs, element 2i in the low half of lane i and 2i + 1 in the high half: the layout the bf16
 * dot-product instruction multiplies. */
static inline __m256i bf16_pairs(__m256 a, __m256 b) {
    const __m256i idx = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i lo = _mm256_permutevar8x32_epi32(bf16x8(a), idx);    /* a0 a2 a4 a6 | a1 a3 a5 a7 */
    const __m256i hi = _mm256_permutevar8x32_epi32(bf16x8(b), idx);
    const __m256i ev = _mm256_permute2x128_si256(lo, hi, 0x20), od = _mm256_permute2x128_si256(lo, hi, 0x31);
    return _mm256_or_si256(ev, _mm256_slli_epi32(od, 16));
}

#endif
