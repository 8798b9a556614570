/* lkv_linear_packed: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows M (a decode batch),
 * over a copy of W packed in 8-output panels (ops.packed_weight): W is streamed once and every
 * row reuses each loaded vector (BLAS's small-M path reads W at half the rate on this machine). */
#include "common.h"

/* Packed weights, Wp [N/8][K][8] (Wp[j][k][i] = W[8j + i][k]): eight outputs per vector, the x
 * value broadcast, no horizontal sums; two panels (16 outputs) x four rows of x per pass (a
 * row-major version with horizontal sums read W ~1.4x slower at 4-8 rows). N % 16 == 0. */
static void linear_packed_cols(const float *x, int64_t M, int64_t K, const float *Wp, const float *bias,
                               float *y, int64_t N, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += 16) {
        const float *p0 = Wp + n * K, *p1 = p0 + 8 * K;
        const __m256 c0 = bias ? _mm256_loadu_ps(bias + n) : _mm256_setzero_ps();
        const __m256 c1 = bias ? _mm256_loadu_ps(bias + n + 8) : _mm256_setzero_ps();
        for (int64_t m = 0; m < M; m += 4) {
            const int mc = M - m < 4 ? (int)(M - m) : 4;
            const float *xr[4];
            for (int i = 0; i < 4; i++) xr[i] = x + (m + (i < mc ? i : 0)) * K;
            __m256 a0 = c0, a1 = c0, a2 = c0, a3 = c0, b0 = c1, b1 = c1, b2 = c1, b3 = c1;
            for (int64_t k = 0; k < K; k++) {
                const __m256 u = _mm256_loadu_ps(p0 + k * 8), v = _mm256_loadu_ps(p1 + k * 8);
                __m256 t = _mm256_broadcast_ss(xr[0] + k);
                a0 = _mm256_fmadd_ps(t, u, a0); b0 = _mm256_fmadd_ps(t, v, b0);
                t = _mm256_broadcast_ss(xr[1] + k);
                a1 = _mm256_fmadd_ps(t, u, a1); b1 = _mm256_fmadd_ps(t, v, b1);
                t = _mm256_broadcast_ss(xr[2] + k);
                a2 = _mm256_fmadd_ps(t, u, a2); b2 = _mm256_fmadd_ps(t, v, b2);
                t = _mm256_broadcast_ss(xr[3] + k);
                a3 = _mm256_fmadd_ps(t, u, a3); b3 = _mm256_fmadd_ps(t, v, b3);
            }
            const __m256 lo[4] = {a0, a1, a2, a3}, hi[4] = {b0, b1, b2, b3};
            for (int i = 0; i < mc; i++) {
                _mm256_storeu_ps(y + (m + i) * N + n, lo[i]);
                _mm256_storeu_ps(y + (m + i) * N + n + 8, hi[i]);
            }
        }
    }
}

void lkv_linear_packed(const float *x, int64_t M, int64_t K, const float *Wp, int64_t N, const float *bias,
                       float *y, int nthreads) {
    const int64_t panels = N / 16;
    if (nthreads <= 1) {
        linear_packed_cols(x, M, K, Wp, bias, y, N, 0, N);
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < nthreads; t++) {
        const int64_t p0 = panels * t / nthreads, p1 = panels * (t + 1) / nthreads;
        if (p0 < p1) linear_packed_cols(x, M, K, Wp, bias, y, N, 16 * p0, 16 * p1);
    }
}
