/* lkv_update_summaries: update_summaries (plugins/summaries.py): fold T appended keys into their
 * blocks' coordinate-wise min/max summaries, in place, token by token in order. A key at offset 0
 * restarts its block (both summaries become the key), any other folds in (min into kmin, max into
 * kmax). Applying the tokens one by one is the contract itself, so repeats and restarts in the
 * middle of a call need no sort or scatter: a decode step's few rows cost one short loop instead
 * of the dozen torch ops of the reference.
 *
 * Keys may be stored as fp32, fp16 or bf16 (key_dtype: lkv_abi.h's LKV_KV_* codes),
 * widened to fp32 as they are read (F16C's vcvtph2ps; bf16 by a shift), which is exact.
 *
 * NaN: as torch.minimum / torch.maximum, a fold with a NaN on either side gives a NaN (the
 * all-ones pattern of torch's vectorized path, here in every lane and in the tail); a restart
 * copies the key's bits. Equal operands (+0 / -0) give the key, as vminps / vmaxps do in torch's
 * vectorized path. The result does not depend on the thread count. */
#include "common.h"
#include "lkv_abi.h"

#define LKV_PAR_MIN (1 << 18) /* T * KVH * D below which one thread runs (~100 us of work; a decode step's rows) */
#define LKV_PAR_COLS 16     /* thread column ranges are multiples of this (one 64-byte line) */

/* eight keys from element i of a key row of storage type T, as fp32 */
static inline __attribute__((always_inline)) __m256 key8(const void *row, int64_t i, int T) {
    if (T == LKV_KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    if (T == LKV_KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i))), 16));
    return _mm256_loadu_ps((const float *)row + i);
}

/* one key, element i, as fp32 (in the low lane) */
static inline __attribute__((always_inline)) __m128 key1(const void *row, int64_t i, int T) {
    if (T == LKV_KV_F16) return _mm_cvtph_ps(_mm_cvtsi32_si128(((const uint16_t *)row)[i]));
    if (T == LKV_KV_BF16) return _mm_castsi128_ps(_mm_cvtsi32_si128((int)((uint32_t)((const uint16_t *)row)[i] << 16)));
    return _mm_load_ss((const float *)row + i);
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

/* Columns [c0, c1) of every token's [KVH * D] row (W elements), tokens in order. */
static inline __attribute__((always_inline)) void fold_cols(float *kmin, float *kmax, const void *keys,
                                                            const int64_t *ids, const int64_t *offs, int64_t T,
                                                            int64_t W, int64_t c0, int64_t c1, int KT) {
    const int64_t es = KT == LKV_KV_F32 ? 4 : 2;
    for (int64_t t = 0; t < T; t++) {
        float *lo = kmin + ids[t] * W, *hi = kmax + ids[t] * W;
        const void *key = (const char *)keys + t * W * es;
        int64_t c = c0;
        if (offs[t] == 0) {
            for (; c + 8 <= c1; c += 8) {
                const __m256 k = key8(key, c, KT);
                _mm256_storeu_ps(lo + c, k);
                _mm256_storeu_ps(hi + c, k);
            }
            for (; c < c1; c++) {
                const __m128 k = key1(key, c, KT);
                _mm_store_ss(lo + c, k);
                _mm_store_ss(hi + c, k);
            }
        } else {
            for (; c + 8 <= c1; c += 8) {
                const __m256 k = key8(key, c, KT);
                _mm256_storeu_ps(lo + c, min8(_mm256_loadu_ps(lo + c), k));
                _mm256_storeu_ps(hi + c, max8(_mm256_loadu_ps(hi + c), k));
            }
            for (; c < c1; c++) {
                const __m128 k = key1(key, c, KT);
                _mm_store_ss(lo + c, min1(_mm_load_ss(lo + c), k));
                _mm_store_ss(hi + c, max1(_mm_load_ss(hi + c), k));
            }
        }
    }
}

#define FOLD_ARGS float *kmin, float *kmax, const void *keys, const int64_t *ids, const int64_t *offs, int64_t T, \
                  int64_t W, int64_t c0, int64_t c1
typedef void (*fold_fn)(FOLD_ARGS);
static void fold_f32(FOLD_ARGS) { fold_cols(kmin, kmax, keys, ids, offs, T, W, c0, c1, LKV_KV_F32); }
static void fold_f16(FOLD_ARGS) { fold_cols(kmin, kmax, keys, ids, offs, T, W, c0, c1, LKV_KV_F16); }
static void fold_bf16(FOLD_ARGS) { fold_cols(kmin, kmax, keys, ids, offs, T, W, c0, c1, LKV_KV_BF16); }

/* kmin, kmax [num_blocks, KVH, D] fp32, keys [T, KVH, D] of key_dtype, block_ids and block_offsets
 * [T] int64, all contiguous. Returns LKV_OK; LKV_ERR_RANGE (nothing changed) when a block id is
 * not in [0, num_blocks); LKV_ERR_ARG for an unknown key_dtype. Threads (nthreads > 1, enough work) split the
 * KVH * D columns, each running every token in order over its own columns. */
int lkv_update_summaries(float *kmin, float *kmax, const void *keys, const int64_t *block_ids,
                         const int64_t *block_offsets, int64_t T, int64_t KVH, int64_t D, int64_t num_blocks,
                         int key_dtype, int nthreads) {
    if (key_dtype < LKV_KV_F32 || key_dtype > LKV_KV_BF16) return LKV_ERR_ARG;
    for (int64_t t = 0; t < T; t++)
        if (block_ids[t] < 0 || block_ids[t] >= num_blocks) return LKV_ERR_RANGE;
    const fold_fn fold = key_dtype == LKV_KV_F16 ? fold_f16 : key_dtype == LKV_KV_BF16 ? fold_bf16 : fold_f32;
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
