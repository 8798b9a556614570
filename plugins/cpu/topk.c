/* lkv_block_topk: block_topk (plugins/topk.py): the Quest bound of every (row, KV head, block) in
 * one read of the summaries, and each row's top-K block ids (score desc, lower id first on ties),
 * ascending, padded with -1. */
#include "common.h"

/* The Quest bound of one weight row (wmax = relu(q), wmin = min(q, 0)) against eight blocks. */
static inline __m256 bound8(const float *wmax, const float *wmin, const float *const *hi,
                            const float *const *lo, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(wmax + d), y = _mm256_loadu_ps(wmin + d);
#define LKV_B(i) a##i = _mm256_fmadd_ps(y, _mm256_loadu_ps(lo[i] + d), _mm256_fmadd_ps(x, _mm256_loadu_ps(hi[i] + d), a##i))
        LKV_B(0); LKV_B(1); LKV_B(2); LKV_B(3); LKV_B(4); LKV_B(5); LKV_B(6); LKV_B(7);
#undef LKV_B
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Rank key of plugins/topk.py's _rank_keys: float order as int order, then the lower id. */
static inline int64_t rank_key(float s, int64_t n, int64_t NB) {
    int32_t bits;
    s += 0.0f;                                         /* -0.0 -> +0.0 */
    memcpy(&bits, &s, 4);
    const int64_t ordered = bits < 0 ? (int64_t)(bits ^ 0x7FFFFFFF) : (int64_t)bits;
    return (int64_t)((uint64_t)ordered << 32) | (NB - 1 - n);
}

/* Move the k largest of a[0, n) to a[0, k) (any order): Hoare quickselect. */
static void select_top(int64_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t pivot = a[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) { const int64_t t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

/* q [B, R, H, D] contiguous; kmin/kmax rows of D floats at k + b*ksb + n*KVH*D + h*D; valid
 * bytes at valid + b*vsb + r*vsr + n; group_max: 1 = "max", 0 = "sum". Writes scores
 * [B, R, KVH, NB] (-inf where not valid) and idx [B, R, KVH, k]. Returns 0, -1 when scratch
 * memory ran out, -2 unless 1 <= k <= NB. */
int lkv_block_topk(const float *q, const float *kmin, const float *kmax, int64_t ksb, const uint8_t *valid,
                   int64_t vsb, int64_t vsr, int64_t B, int64_t R, int64_t H, int64_t KVH, int64_t NB,
                   int64_t D, int64_t k, int group_max, float *scores, int64_t *idx, int nthreads) {
    const int64_t G = H / KVH, GW = group_max ? G : 1;     /* weight rows per (row, KV head) */
    if (NB <= 0 || k <= 0 || k > NB) return -2;            /* the wrapper's checks exclude these */
    int failed = 0;
#pragma omp parallel num_threads(nthreads > 1 ? nthreads : 1) if (nthreads > 1) reduction(| : failed)
    {
        float *w = malloc(sizeof(float) * (2 * R * KVH * GW * D + 8));
        int64_t *keys = malloc(sizeof(int64_t) * (NB + 1));
        uint8_t *picked = malloc(NB + 1);
        if (!w || !keys || !picked) failed = 1;
        else {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) {
                /* weights: wmax/wmin per (r, h, g') row, summed over the group for "sum" */
                for (int64_t r = 0; r < R; r++)
                    for (int64_t h = 0; h < KVH; h++)
                        for (int64_t g = 0; g < GW; g++) {
                            float *wx = w + (((r * KVH + h) * GW + g) * 2) * D, *wn = wx + D;
                            for (int64_t d = 0; d < D; d++) { wx[d] = 0.0f; wn[d] = 0.0f; }
                            for (int64_t gg = group_max ? g : 0; gg < (group_max ? g + 1 : G); gg++) {
                                const float *qr = q + ((b * R + r) * H + h * G + gg) * D;
                                for (int64_t d = 0; d < D; d++) {
                                    wx[d] += qr[d] > 0.0f ? qr[d] : 0.0f;
                                    wn[d] += qr[d] < 0.0f ? qr[d] : 0.0f;
                                }
                            }
                        }
                for (int64_t n0 = 0; n0 < NB; n0 += 8) {
                    for (int64_t h = 0; h < KVH; h++) {
                        const float *hi[8], *lo[8];
                        for (int i = 0; i < 8; i++) {
                            const int64_t n = n0 + i < NB ? n0 + i : NB - 1;
                            hi[i] = kmax + b * ksb + (n * KVH + h) * D;
                            lo[i] = kmin + b * ksb + (n * KVH + h) * D;
                        }
                        for (int64_t r = 0; r < R; r++) {
                            __m256 best = _mm256_set1_ps(-INFINITY);
                            for (int64_t g = 0; g < GW; g++) {
                                const float *wx = w + (((r * KVH + h) * GW + g) * 2) * D;
                                const __m256 sc = bound8(wx, wx + D, hi, lo, D);
                                best = g == 0 ? sc : _mm256_max_ps(best, sc);
                            }
                            float tmp[8];
                            _mm256_storeu_ps(tmp, best);
                            float *srow = scores + ((b * R + r) * KVH + h) * NB;
                            for (int i = 0; i < 8 && n0 + i < NB; i++) srow[n0 + i] = tmp[i];
                        }
                    }
                }
                for (int64_t r = 0; r < R; r++) {
                    const uint8_t *vr = valid + b * vsb + r * vsr;
                    for (int64_t h = 0; h < KVH; h++) {
                        float *srow = scores + ((b * R + r) * KVH + h) * NB;
                        int64_t *out = idx + ((b * R + r) * KVH + h) * k;
                        for (int64_t n = 0; n < NB; n++) {
                            if (!vr[n]) srow[n] = -INFINITY;   /* after scoring: an empty block may be NaN */
                            keys[n] = rank_key(srow[n], n, NB);
                            picked[n] = 0;
                        }
                        select_top(keys, NB, k);
                        for (int64_t i = 0; i < k; i++) picked[NB - 1 - (keys[i] & 0xFFFFFFFF)] = 1;
                        int64_t nk = 0;                     /* ascending ids; a picked invalid block is padding */
                        for (int64_t n = 0; n < NB; n++) if (picked[n] && vr[n]) out[nk++] = n;
                        for (int64_t i = nk; i < k; i++) out[i] = -1;
                    }
                }
            }
        }
        free(w);
        free(keys);
        free(picked);
    }
    return failed ? -1 : 0;
}
