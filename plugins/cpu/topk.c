/* lkv_block_topk: block_topk (plugins/topk.py): the Quest bound of every (row, KV head, block) in
 * one read of the summaries, and each row's top-K block ids (score desc, lower id first on ties),
 * ascending, padded with -1. */
#include "common.h"
#include "lkv_abi.h"

#define LKV_PREFETCH_BLOCKS 16      /* software prefetch distance in blocks (~24 KiB of kmin + kmax at KVH*D = 192) */

/* Pins a loaded vector to a register: otherwise gcc folds the load into every FMA that uses it
 * and the loop turns load-bound. */
#define LKV_PIN(v) __asm__("" : "+x"(v))

/* eight summary elements as fp32 (common.h): the summaries are kept in the KV storage dtype,
 * whose min/max are values of that dtype, so widening them is exact */
#define sum8 lkv_load8

/* The Quest bounds (wmax = relu(q), wmin = min(q, 0)) of NR <= 2 weight rows (row j's wmax at
 * w + 2*j*D, its wmin after it) against four blocks (block i's rows at hi/lo + i*s elements of
 * storage type T). The rows' weights stay in registers and each summary vector is loaded once for
 * both: 12 loads per 16 FMAs (one row against eight blocks took 18), so the loop is FMA-bound.
 * out[j] = row j's four bounds; per lane and in the reduction the sums run in the order of that
 * one-row form, so the scores are unchanged. */
static inline __attribute__((always_inline)) void bound4(const float *w, int NR, const void *hi,
                                                         const void *lo, int64_t s, int64_t D, __m128 *out, int T) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    for (int64_t d = 0; d < D; d += 8) {
        __m256 wx0 = _mm256_loadu_ps(w + d), wn0 = _mm256_loadu_ps(w + D + d), wx1 = wx0, wn1 = wn0, x, y;
        LKV_PIN(wx0); LKV_PIN(wn0);
        if (NR > 1) { wx1 = _mm256_loadu_ps(w + 2 * D + d); wn1 = _mm256_loadu_ps(w + 3 * D + d); LKV_PIN(wx1); LKV_PIN(wn1); }
#define LKV_BLOCK(i) x = sum8(hi, i * s + d, T); LKV_PIN(x); \
                     a0##i = _mm256_fmadd_ps(wx0, x, a0##i); if (NR > 1) a1##i = _mm256_fmadd_ps(wx1, x, a1##i); \
                     y = sum8(lo, i * s + d, T); LKV_PIN(y); \
                     a0##i = _mm256_fmadd_ps(wn0, y, a0##i); if (NR > 1) a1##i = _mm256_fmadd_ps(wn1, y, a1##i)
        LKV_BLOCK(0); LKV_BLOCK(1); LKV_BLOCK(2); LKV_BLOCK(3);
#undef LKV_BLOCK
    }
#define LKV_SUM(j) do { const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a##j##0, a##j##1), _mm256_hadd_ps(a##j##2, a##j##3)); \
                        out[j] = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)); } while (0)
    LKV_SUM(0);
    if (NR > 1) LKV_SUM(1);
#undef LKV_SUM
}

/* bound4 over NW weight rows in pairs, with the head size a constant where it is the usual 64
 * (the chunk loop unrolls, the weight offsets become immediates), for summaries of type T. */
static inline __attribute__((always_inline)) void bound4_rows_t(const float *w, int64_t NW, const void *hi,
                                                                const void *lo, int64_t s, int64_t D, __m128 *out,
                                                                int T) {
    for (int64_t j = 0; j < NW; j += 2) {
        const float *wj = w + 2 * j * D;
        if (D == 64) {
            if (j + 1 < NW) bound4(wj, 2, hi, lo, s, 64, out + j, T);
            else bound4(wj, 1, hi, lo, s, 64, out + j, T);
        } else {
            if (j + 1 < NW) bound4(wj, 2, hi, lo, s, D, out + j, T);
            else bound4(wj, 1, hi, lo, s, D, out + j, T);
        }
    }
}

#define BOUND_ARGS const float *w, int64_t NW, const void *hi, const void *lo, int64_t s, int64_t D, __m128 *out
static void bound4_rows_f32(BOUND_ARGS) { bound4_rows_t(w, NW, hi, lo, s, D, out, LKV_KV_F32); }
static void bound4_rows_f16(BOUND_ARGS) { bound4_rows_t(w, NW, hi, lo, s, D, out, LKV_KV_F16); }
static void bound4_rows_bf16(BOUND_ARGS) { bound4_rows_t(w, NW, hi, lo, s, D, out, LKV_KV_BF16); }

/* Rank key of plugins/topk.py's _rank_keys without the id: float order as int32 order (the id
 * part, lower id first, is the selection's tie rule). Eight at a time. */
static inline __m256i rank_key8(__m256 s) {
    const __m256i bits = _mm256_castps_si256(_mm256_add_ps(s, _mm256_setzero_ps()));  /* -0.0 -> +0.0 */
    return _mm256_xor_si256(bits, _mm256_and_si256(_mm256_srai_epi32(bits, 31), _mm256_set1_epi32(0x7FFFFFFF)));
}

static inline int32_t rank_key(float s) {
    int32_t bits;
    s += 0.0f;
    memcpy(&bits, &s, 4);
    return bits < 0 ? bits ^ 0x7FFFFFFF : bits;
}

/* How many of keys[0, n8) (n8 % 8 == 0) are > c. */
static inline int64_t count_above(const int32_t *keys, int64_t n8, int32_t c) {
    const __m256i cv = _mm256_set1_epi32(c);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    int64_t n = 0;
    for (; n + 16 <= n8; n += 16) {
        a0 = _mm256_sub_epi32(a0, _mm256_cmpgt_epi32(_mm256_loadu_si256((const __m256i *)(keys + n)), cv));
        a1 = _mm256_sub_epi32(a1, _mm256_cmpgt_epi32(_mm256_loadu_si256((const __m256i *)(keys + n + 8)), cv));
    }
    if (n < n8) a0 = _mm256_sub_epi32(a0, _mm256_cmpgt_epi32(_mm256_loadu_si256((const __m256i *)(keys + n)), cv));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(_mm256_add_epi32(a0, a1)),
                              _mm256_extracti128_si256(_mm256_add_epi32(a0, a1), 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* The k-th largest of keys[0, n8) (1 <= k <= the real keys; padding is INT32_MIN): the largest t
 * with #(keys >= t) >= k, built bit by bit from the top in offset binary, with branch-free vector
 * counts (no data-dependent swaps as in a quickselect). Returns t and *need = how many keys equal
 * to t the top k take; stops early at a t whose #(keys >= t) is exactly k (then no key equals
 * the returned t - 1 that is needed: *need = 0). */
static int32_t kth_key(const int32_t *keys, int64_t n8, int64_t k, int64_t *need) {
    uint32_t u = 0;                                     /* offset binary: u ^ 0x80000000 is the int32 */
    for (int bit = 31; bit >= 0; bit--) {
        const uint32_t cand = u | (1u << bit);          /* never 0, so the int32 c > INT32_MIN */
        const int32_t c = (int32_t)(cand ^ 0x80000000u);
        const int64_t n_ge = count_above(keys, n8, c - 1);      /* #(keys >= c) */
        if (n_ge >= k) {
            u = cand;
            if (n_ge == k) { *need = 0; return c - 1; }
        }
    }
    const int32_t t = (int32_t)(u ^ 0x80000000u);
    *need = k - count_above(keys, n8, t);
    return t;
}

/* q [B, R, H, D] contiguous; kmin/kmax rows of D elements of sum_dtype (LKV_KV_F32, LKV_KV_F16,
 * LKV_KV_BF16; widened exactly) at k + b*ksb + n*KVH*D + h*D elements; valid bytes at valid +
 * b*vsb + r*vsr + n; group_max: 1 = "max", 0 = "sum". Writes scores [B, R, KVH, NB] (-inf where
 * not valid) and idx [B, R, KVH, k]. Returns LKV_OK, LKV_ERR_NOMEM when scratch memory ran out,
 * LKV_ERR_ARG unless 1 <= k <= NB and sum_dtype is a storage code. */
int lkv_block_topk(const float *q, const void *kmin, const void *kmax, int64_t ksb, const uint8_t *valid,
                   int64_t vsb, int64_t vsr, int64_t B, int64_t R, int64_t H, int64_t KVH, int64_t NB,
                   int64_t D, int64_t k, int group_max, float *scores, int64_t *idx, int nthreads, int sum_dtype) {
    const int64_t G = H / KVH, GW = group_max ? G : 1;     /* weight rows per (row, KV head) */
    const int64_t NW = R * GW, NB8 = (NB + 7) & ~(int64_t)7;
    if (NB <= 0 || k <= 0 || k > NB) return LKV_ERR_ARG;           /* the wrapper's checks exclude these */
    if (sum_dtype < LKV_KV_F32 || sum_dtype > LKV_KV_BF16) return LKV_ERR_ARG;
    const int64_t es = sum_dtype == LKV_KV_F32 ? 4 : 2;              /* bytes a summary element */
    void (*bound4_rows)(BOUND_ARGS) = sum_dtype == LKV_KV_F16 ? bound4_rows_f16
                                    : sum_dtype == LKV_KV_BF16 ? bound4_rows_bf16 : bound4_rows_f32;
    int failed = 0;
#pragma omp parallel num_threads(nthreads > 1 ? nthreads : 1) if (nthreads > 1) reduction(| : failed)
    {
        float *w = malloc(sizeof(float) * (2 * R * KVH * GW * D + 8));
        __m128 *sc = malloc(sizeof(__m128) * (NW + 2));
        char *tail = malloc(sizeof(float) * 8 * D);
        int32_t *keys = malloc(sizeof(int32_t) * (NB8 + 8)), *sel = malloc(sizeof(int32_t) * (NB8 + 8));
        if (!w || !sc || !tail || !keys || !sel) failed = 1;
        else {
            /* idx8[m]: the set bits of m as eight 4-bit lane numbers, low first (a compress by permute) */
            uint32_t idx8[256];
            for (int m = 0; m < 256; m++) {
                uint32_t v = 0;
                for (int i = 0, j = 0; i < 8; i++) if (m >> i & 1) v |= (uint32_t)i << (4 * j++);
                idx8[m] = v;
            }
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) {
                /* weights: wmax/wmin per (h, r, g') row, summed over the group for "sum"; a KV head's
                 * R * G' rows are adjacent, so bound4_rows walks them with one pointer */
                for (int64_t r = 0; r < R; r++)
                    for (int64_t h = 0; h < KVH; h++)
                        for (int64_t g = 0; g < GW; g++) {
                            float *wx = w + ((h * R + r) * GW + g) * 2 * D, *wn = wx + D;
                            for (int64_t d = 0; d < D; d++) { wx[d] = 0.0f; wn[d] = 0.0f; }
                            for (int64_t gg = group_max ? g : 0; gg < (group_max ? g + 1 : G); gg++) {
                                const float *qr = q + ((b * R + r) * H + h * G + gg) * D;
                                for (int64_t d = 0; d < D; d++) {
                                    wx[d] += qr[d] > 0.0f ? qr[d] : 0.0f;
                                    wn[d] += qr[d] < 0.0f ? qr[d] : 0.0f;
                                }
                            }
                        }
                const char *kxb = (const char *)kmax + b * ksb * es, *knb = (const char *)kmin + b * ksb * es;
                for (int64_t n0 = 0; n0 < NB; n0 += 4) {
                    /* the summaries are mostly not in cache, and a head's rows stride past what the
                     * hardware prefetchers follow: fetch whole blocks (all heads) ahead */
                    if (n0 + LKV_PREFETCH_BLOCKS + 4 <= NB)
                        for (int64_t o = (n0 + LKV_PREFETCH_BLOCKS) * KVH * D * es;
                             o < (n0 + LKV_PREFETCH_BLOCKS + 4) * KVH * D * es; o += 64) {
                            _mm_prefetch(kxb + o, _MM_HINT_T0);
                            _mm_prefetch(knb + o, _MM_HINT_T0);
                        }
                    for (int64_t h = 0; h < KVH; h++) {
                        const void *hi = kxb + (n0 * KVH + h) * D * es, *lo = knb + (n0 * KVH + h) * D * es;
                        int64_t s = KVH * D;
                        if (n0 + 4 > NB) {                  /* the last blocks, repeated to fill four */
                            for (int i = 0; i < 4; i++) {
                                const int64_t n = n0 + i < NB ? n0 + i : NB - 1;
                                memcpy(tail + i * D * es, kxb + (n * KVH + h) * D * es, es * D);
                                memcpy(tail + (4 + i) * D * es, knb + (n * KVH + h) * D * es, es * D);
                            }
                            hi = tail, lo = tail + 4 * D * es, s = D;
                        }
                        bound4_rows(w + h * NW * 2 * D, NW, hi, lo, s, D, sc);
                        for (int64_t r = 0; r < R; r++) {
                            __m128 best = sc[r * GW];
                            for (int64_t g = 1; g < GW; g++) best = _mm_max_ps(best, sc[r * GW + g]);
                            float *srow = scores + ((b * R + r) * KVH + h) * NB + n0;
                            if (n0 + 4 <= NB) _mm_storeu_ps(srow, best);
                            else {
                                float tmp[4];
                                _mm_storeu_ps(tmp, best);
                                for (int i = 0; n0 + i < NB; i++) srow[i] = tmp[i];
                            }
                        }
                    }
                }
                for (int64_t r = 0; r < R; r++) {
                    const uint8_t *vr = valid + b * vsb + r * vsr;
                    for (int64_t h = 0; h < KVH; h++) {
                        float *srow = scores + ((b * R + r) * KVH + h) * NB;
                        int64_t *out = idx + ((b * R + r) * KVH + h) * k;
                        /* -inf where not valid (after scoring: an empty block may be NaN), then keys */
                        int64_t n = 0;
                        for (; n + 8 <= NB; n += 8) {
                            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(vr + n)));
                            const __m256 off = _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, _mm256_setzero_si256()));
                            const __m256 s = _mm256_blendv_ps(_mm256_loadu_ps(srow + n), _mm256_set1_ps(-INFINITY), off);
                            _mm256_storeu_ps(srow + n, s);
                            _mm256_storeu_si256((__m256i *)(keys + n), rank_key8(s));
                        }
                        for (; n < NB; n++) {
                            if (!vr[n]) srow[n] = -INFINITY;
                            keys[n] = rank_key(srow[n]);
                        }
                        for (; n < NB8; n++) keys[n] = INT32_MIN;   /* below every threshold tried */
                        int64_t need;
                        const int32_t t = kth_key(keys, NB8, k, &need);
                        /* the top k: keys above t, and the first `need` equal to t (lower id first);
                         * ascending ids, a picked invalid block is padding */
                        int64_t nk = 0;
                        n = 0;
                        if (need == 0) {
                            const __m256i tv = _mm256_set1_epi32(t), iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                            for (; n + 8 <= NB; n += 8) {
                                const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(vr + n)));
                                const __m256i on = _mm256_andnot_si256(_mm256_cmpeq_epi32(v, _mm256_setzero_si256()),
                                    _mm256_cmpgt_epi32(_mm256_loadu_si256((const __m256i *)(keys + n)), tv));
                                const int m = _mm256_movemask_ps(_mm256_castsi256_ps(on));
                                const __m256i lanes = _mm256_srlv_epi32(_mm256_set1_epi32((int)idx8[m]),
                                                                        _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
                                const __m256i ids = _mm256_add_epi32(_mm256_set1_epi32((int)n), iota);
                                _mm256_storeu_si256((__m256i *)(sel + nk), _mm256_permutevar8x32_epi32(ids, lanes));
                                nk += __builtin_popcount((unsigned)m);
                            }
                        }
                        for (; n < NB; n++) {
                            const int gt = keys[n] > t, eq = keys[n] == t, take = gt | (eq & (need > 0));
                            need -= eq & take;
                            sel[nk] = (int32_t)n;
                            nk += take & (vr[n] != 0);
                        }
                        for (int64_t i = 0; i < nk; i++) out[i] = sel[i];
                        for (int64_t i = nk; i < k; i++) out[i] = -1;
                    }
                }
            }
        }
        free(w);
        free(sc);
        free(tail);
        free(keys);
        free(sel);
    }
    return failed ? LKV_ERR_NOMEM : LKV_OK;
}
