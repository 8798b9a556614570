/* lkv_linear_packed: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows M (a decode batch),
 * over a copy of W packed in 8-output panels (ops.packed_weight): W is streamed once and every
 * row reuses each loaded vector (BLAS's small-M path reads W at half the rate on this machine). */
#include "common.h"
#include "lkv_abi.h"

/* Packed weights, Wp [N/8][K][8] (Wp[j][k][i] = W[8j + i][k]): eight outputs per vector, the x
 * value broadcast, no horizontal sums. A tile is P <= 3 panels (24 outputs) x 4 rows of x: twelve
 * independent FMA chains, enough to cover the FMA latency (eight, as 2 panels x 4 rows, were not).
 * The K rows go in chunks of KCHUNK: every group of 4 rows runs over a chunk while it is in L1,
 * and the first group prefetches ahead, so more than 4 rows do not re-read W from memory or L2.
 * (scripts/bench_kernels.py: 8 rows read W at ~14.5 GB/s with this, ~12 GB/s without.) */
#define KCHUNK 32
#define PREFETCH 64            /* K rows ahead: 2 KiB per panel */

#define FMA(a, t, w) a = _mm256_fmadd_ps(t, w, a)

/* One tile over k in [k0, k1): accumulators start from the bias (k0 == 0) or from y. Rows past
 * `mc` repeat row 0's pointer (computed, not stored). */
static inline __attribute__((always_inline)) void tile(const float *const *xr, int mc, int64_t K, int64_t k0,
                                                       int64_t k1, const float *p, int P, const float *bias,
                                                       float *y, int64_t N, int prefetch) {
    const float *p1 = p + 8 * K, *p2 = p + 16 * K;
    __m256 acc[3][4];
    for (int j = 0; j < P; j++)
        for (int i = 0; i < 4; i++)
            acc[j][i] = k0 > 0 && i < mc ? _mm256_loadu_ps(y + i * N + 8 * j)
                        : bias ? _mm256_loadu_ps(bias + 8 * j) : _mm256_setzero_ps();
    /* named registers: an indexed array in the loop was spilled to the stack by gcc */
    __m256 a0 = acc[0][0], a1 = acc[0][1], a2 = acc[0][2], a3 = acc[0][3];
    __m256 b0 = P > 1 ? acc[1][0] : a0, b1 = P > 1 ? acc[1][1] : a0, b2 = P > 1 ? acc[1][2] : a0,
           b3 = P > 1 ? acc[1][3] : a0;
    __m256 c0 = P > 2 ? acc[2][0] : a0, c1 = P > 2 ? acc[2][1] : a0, c2 = P > 2 ? acc[2][2] : a0,
           c3 = P > 2 ? acc[2][3] : a0;
    const float *x0 = xr[0], *x1 = xr[1], *x2 = xr[2], *x3 = xr[3];
    for (int64_t k = k0; k < k1; k++) {
        if (prefetch && !(k & 1)) {        /* a 64-byte line holds two K rows of a panel */
            _mm_prefetch((const char *)(p + (k + PREFETCH) * 8), _MM_HINT_T0);
            if (P > 1) _mm_prefetch((const char *)(p1 + (k + PREFETCH) * 8), _MM_HINT_T0);
            if (P > 2) _mm_prefetch((const char *)(p2 + (k + PREFETCH) * 8), _MM_HINT_T0);
        }
        const __m256 u = _mm256_loadu_ps(p + k * 8);
        const __m256 v = P > 1 ? _mm256_loadu_ps(p1 + k * 8) : u, w = P > 2 ? _mm256_loadu_ps(p2 + k * 8) : u;
        __m256 t = _mm256_broadcast_ss(x0 + k);
        FMA(a0, t, u); if (P > 1) FMA(b0, t, v); if (P > 2) FMA(c0, t, w);
        t = _mm256_broadcast_ss(x1 + k);
        FMA(a1, t, u); if (P > 1) FMA(b1, t, v); if (P > 2) FMA(c1, t, w);
        t = _mm256_broadcast_ss(x2 + k);
        FMA(a2, t, u); if (P > 1) FMA(b2, t, v); if (P > 2) FMA(c2, t, w);
        t = _mm256_broadcast_ss(x3 + k);
        FMA(a3, t, u); if (P > 1) FMA(b3, t, v); if (P > 2) FMA(c3, t, w);
    }
    const __m256 out[3][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}, {c0, c1, c2, c3}};
    for (int i = 0; i < mc; i++)
        for (int j = 0; j < P; j++) _mm256_storeu_ps(y + i * N + 8 * j, out[j][i]);
}

/* Outputs [n0, n1) (multiples of 8): tiles of 3 panels, then a 1- or 2-panel tail. */
static void linear_packed_cols(const float *x, int64_t M, int64_t K, const float *Wp, const float *bias,
                               float *y, int64_t N, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += 24) {
        const int P = n1 - n >= 24 ? 3 : (int)((n1 - n) / 8);
        const float *p = Wp + n * K, *bn = bias ? bias + n : NULL;
        for (int64_t k0 = 0; k0 < K; k0 += KCHUNK) {
            const int64_t k1 = k0 + KCHUNK < K ? k0 + KCHUNK : K;
            for (int64_t m = 0; m < M; m += 4) {
                const int mc = M - m < 4 ? (int)(M - m) : 4;
                const float *xr[4];
                for (int i = 0; i < 4; i++) xr[i] = x + (m + (i < mc ? i : 0)) * K;
                float *ym = y + m * N + n;
                if (P == 3) tile(xr, mc, K, k0, k1, p, 3, bn, ym, N, m == 0);
                else if (P == 2) tile(xr, mc, K, k0, k1, p, 2, bn, ym, N, m == 0);
                else tile(xr, mc, K, k0, k1, p, 1, bn, ym, N, m == 0);
            }
        }
    }
}

void lkv_linear_packed(const float *x, int64_t M, int64_t K, const float *Wp, int64_t N, const float *bias,
                       float *y, int nthreads) {
    const int64_t tiles = (N + 23) / 24;
    if (nthreads <= 1) {
        linear_packed_cols(x, M, K, Wp, bias, y, N, 0, N);
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < nthreads; t++) {
        const int64_t t0 = tiles * t / nthreads, t1 = tiles * (t + 1) / nthreads;
        const int64_t n0 = 24 * t0, n1 = 24 * t1 < N ? 24 * t1 : N;
        if (n0 < n1) linear_packed_cols(x, M, K, Wp, bias, y, N, n0, n1);
    }
}
