/* lkv_update_summaries: update_summaries (plugins/summaries.py): fold T appended keys into their
 * blocks' coordinate-wise min/max summaries, in place, token by token in order. A key at offset 0
 * restarts its block (both summaries become the key), any other folds in (min into kmin, max into
 * kmax). Applying the tokens one by one is the contract itself, so repeats and restarts in the
 * middle of a call need no sort or scatter: a decode step's few rows cost one short loop instead
 * of the dozen torch ops of the reference.
 *
 * Keys may be stored as fp32, fp16 or bf16 (key_dtype: lkv_abi.h's LKV_KV_* codes),
 * widened to fp32 as they are read (F16C's vcvtph2ps; bf16 by a shift), which is exact. The
 * summaries are fp32 or of the keys' own dtype (sum_dtype): a min or max of keys is one of them,
 * so narrowing it back to that dtype is exact too (a NaN stays a NaN).
 *
 * NaN: as torch.minimum / torch.maximum, a fold with a NaN on either side gives a NaN (the
 * all-ones pattern of torch's vectorized path, here in every lane and in the tail); a restart
 * copies the key's bits. Equal operands (+0 / -0) give the key, as vminps / vmaxps do in torch's
 * vectorized path. The result does not depend on the thread count. */
#include "common.h"
#include "lkv_abi.h"

#define LKV_PAR_MIN (1 << 18) /* T * KVH * D below which one thread runs (~100 us of work; a decode step's rows) */
#define LKV_PAR_COLS 16     /* thread column ranges are multiples of this (one 64-byte line) */

/* eight keys (or summaries) from element i of a row of storage type T, as fp32 (common.h) */
#define key8 lkv_load8

/* one key, element i, as fp32 (in the low lane) */
static inline __attribute__((always_inline)) __m128 key1(const void *row, int64_t i, int T) {
    if (T == LKV_KV_F16) return _mm_cvtph_ps(_mm_cvtsi32_si128(((const uint16_t *)row)[i]));
    if (T == LKV_KV_BF16) return _mm_castsi128_ps(_mm_cvtsi32_si128((int)((uint32_t)((const uint16_t *)row)[i] << 16)));
    return _mm_load_ss((const float *)row + i);
}

/* v (fp32 values of storage type T) into eight / one elements of a row of type T at element i;
 * exact for values of that type (round-to-nearest fp16; bf16's high half) */
static inline __attribute__((always_inline)) void put8(void *row, int64_t i, __m256 v, int T) {
    if (T == LKV_KV_F16) {
        _mm_storeu_si128((__m128i *)((uint16_t *)row + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    } else if (T == LKV_KV_BF16) {
        const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
        _mm_storeu_si128((__m128i *)((uint16_t *)row + i),
                         _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
    } else {
        _mm256_storeu_ps((float *)row + i, v);
    }
}
static inline __attribute__((always_inline)) void put1(void *row, int64_t i, __m128 v, int T) {
    if (T == LKV_KV_F16) {
        ((uint16_t *)row)[i] = (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT), 0);
    } else if (T == LKV_KV_BF16) {
        ((uint16_t *)row)[i] = (uint16_t)((uint32_t)_mm_cvtsi128_si32(_mm_castps_si128(v)) >> 16);
    } else {
        _mm_store_ss((float *)row + i, v);
    }
}

/* torch.minimum / maximum(cur, key): vminps / vmaxps, OR'd with all ones where either is NaN */
static inline __m256 min8(__m256 c, __m256 k) {
    return _mm256_or_ps(_mm256_min_ps(c, k), _mm256_cmp_ps(c, k, _CMP_UNORD_Q));
}
static inline __m256 max8(__m256 c, __m256 k) {
    return _mm256_or_ps(_mm256_max_ps(c, k), _mm256_cmp_ps(c, k, _CMP_UNORD_Q));
}
static inline __m128 min1(__m128 c, __m128 k) { return _mm_or_ps(_mm_min_ss(c, k), _mm_cmpunord_ss(c, k)); }
static inline __m128 max1(__m128 c, __m128 k) { return _mm_or_ps(_mm_max_ss(c, k), _mm_cmpunord_ss(c, k)); }

/* Columns [c0, c1) of every token's [KVH * D] row (W elements), tokens in order: keys of type KT
 * into summaries of type ST (fp32, or KT). */
static inline __attribute__((always_inline)) void fold_cols(void *kmin, void *kmax, const void *keys,
                                                            const int64_t *ids, const int64_t *offs, int64_t T,
                                                            int64_t W, int64_t c0, int64_t c1, int KT, int ST) {
    const int64_t es = KT == LKV_KV_F32 ? 4 : 2, ss = ST == LKV_KV_F32 ? 4 : 2;
    for (int64_t t = 0; t < T; t++) {
        char *lo = (char *)kmin + ids[t] * W * ss, *hi = (char *)kmax + ids[t] * W * ss;
        const void *key = (const char *)keys + t * W * es;
        int64_t c = c0;
        if (offs[t] == 0) {
            for (; c + 8 <= c1; c += 8) {
                const __m256 k = key8(key, c, KT);
                put8(lo, c, k, ST);
                put8(hi, c, k, ST);
            }
            for (; c < c1; c++) {
                const __m128 k = key1(key, c, KT);
                put1(lo, c, k, ST);
                put1(hi, c, k, ST);
            }
        } else {
            for (; c + 8 <= c1; c += 8) {
                const __m256 k = key8(key, c, KT);
                put8(lo, c, min8(key8(lo, c, ST), k), ST);
                put8(hi, c, max8(key8(hi, c, ST), k), ST);
            }
            for (; c < c1; c++) {
                const __m128 k = key1(key, c, KT);
                put1(lo, c, min1(key1(lo, c, ST), k), ST);
                put1(hi, c, max1(key1(hi, c, ST), k), ST);
            }
        }
    }
}

#define FOLD_ARGS void *kmin, void *kmax, const void *keys, const int64_t *ids, const int64_t *offs, int64_t T, \
                  int64_t W, int64_t c0, int64_t c1
typedef void (*fold_fn)(FOLD_ARGS);
static void fold_f32(FOLD_ARGS) { fold_cols(kmin, kmax, keys, ids, offs, T, W, c0, c1, LKV_KV_F32, LKV_KV_F32); }
static void fold_f16(FOLD_ARGS) { fold_cols(kmin, kmax, keys, ids, offs, T, W, c0, c1, LKV_KV_F16, LKV_KV_F32); }
static void fold_bf16(FOLD_ARGS) { fold_cols(kmin, kmax, keys, ids, offs, T, W, c0, c1, LKV_KV_BF16, LKV_KV_F32); }
static void fold_f16_f16(FOLD_ARGS) { fold_cols(kmin, kmax, keys, ids, offs, T, W, c0, c1, LKV_KV_F16, LKV_KV_F16); }
static void fold_bf16_bf16(FOLD_ARGS) {
    fold_cols(kmin, kmax, keys, ids, offs, T, W, c0, c1, LKV_KV_BF16, LKV_KV_BF16);
}

/* kmin, kmax [num_blocks, KVH, D] of sum_dtype (LKV_KV_F32, or key_dtype), keys [T, KVH, D] of
 * key_dtype, block_ids and block_offsets [T] int64, all contiguous. Returns LKV_OK; LKV_ERR_RANGE
 * (nothing changed) when a block id is not in [0, num_blocks); LKV_ERR_ARG for an unknown
 * key_dtype, or a sum_dtype that is neither fp32 nor key_dtype (narrowing would round). Threads
 * (nthreads > 1, enough work) split the KVH * D columns, each running every token in order over
 * its own columns. */
int lkv_update_summaries(void *kmin, void *kmax, const void *keys, const int64_t *block_ids,
                         const int64_t *block_offsets, int64_t T, int64_t KVH, int64_t D, int64_t num_blocks,
                         int key_dtype, int sum_dtype, int nthreads) {
    if (key_dtype < LKV_KV_F32 || key_dtype > LKV_KV_BF16) return LKV_ERR_ARG;
    if (sum_dtype != LKV_KV_F32 && sum_dtype != key_dtype) return LKV_ERR_ARG;
    for (int64_t t = 0; t < T; t++)
        if (block_ids[t] < 0 || block_ids[t] >= num_blocks) return LKV_ERR_RANGE;
    const fold_fn fold = sum_dtype == LKV_KV_F32
        ? (key_dtype == LKV_KV_F16 ? fold_f16 : key_dtype == LKV_KV_BF16 ? fold_bf16 : fold_f32)
        : (key_dtype == LKV_KV_F16 ? fold_f16_f16 : fold_bf16_bf16);
    const int64_t W = KVH * D;
    const int nt = nthreads > 1 && T * W >= LKV_PAR_MIN ? nthreads : 1;
    if (nt == 1) {
        fold(kmin, kmax, keys, block_ids, block_offsets, T, W, 0, W);
        return LKV_OK;
    }
    const int64_t per = (W + nt - 1) / nt, chunk = (per + LKV_PAR_COLS - 1) / LKV_PAR_COLS * LKV_PAR_COLS;
    const int64_t nchunks = (W + chunk - 1) / chunk;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t i = 0; i < nchunks; i++) {
        const int64_t c1 = (i + 1) * chunk < W ? (i + 1) * chunk : W;
        fold(kmin, kmax, keys, block_ids, block_offsets, T, W, i * chunk, c1);
    }
    return LKV_OK;
}
