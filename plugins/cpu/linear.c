/* lkv_linear: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows M (a decode batch): W is
 * streamed once and every row reuses each loaded chunk (BLAS's small-M path reads it at a third
 * of the bandwidth on this machine). lkv_linear_packed: the same over a copy of W packed in
 * 8-output panels (ops.packed_weight), faster still. */
#include "common.h"

/* Output columns [n0, n1): two rows of W at a time against four rows of x (eight accumulators). */
static void linear_cols(const float *x, int64_t M, int64_t K, const float *W, const float *bias,
                        float *y, int64_t N, int64_t n0, int64_t n1) {
    const int64_t K8 = K & ~(int64_t)7;
    for (int64_t n = n0; n < n1; n += 2) {
        const int two = n + 1 < n1;
        const float *w0 = W + n * K, *w1 = two ? w0 + K : w0;
        for (int64_t m = 0; m < M; m += 4) {
            const int mc = M - m < 4 ? (int)(M - m) : 4;
            const float *xr[4];
            for (int i = 0; i < 4; i++) xr[i] = x + (m + (i < mc ? i : 0)) * K;
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
            __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
            for (int64_t k = 0; k < K8; k += 8) {
                _mm_prefetch((const char *)(w0 + k + 128), _MM_HINT_T0);   /* 512 B ahead: +5-10% */
                _mm_prefetch((const char *)(w1 + k + 128), _MM_HINT_T0);
                const __m256 u = _mm256_loadu_ps(w0 + k), v = _mm256_loadu_ps(w1 + k);
                __m256 t = _mm256_loadu_ps(xr[0] + k);
                a00 = _mm256_fmadd_ps(t, u, a00); a10 = _mm256_fmadd_ps(t, v, a10);
                t = _mm256_loadu_ps(xr[1] + k);
                a01 = _mm256_fmadd_ps(t, u, a01); a11 = _mm256_fmadd_ps(t, v, a11);
                t = _mm256_loadu_ps(xr[2] + k);
                a02 = _mm256_fmadd_ps(t, u, a02); a12 = _mm256_fmadd_ps(t, v, a12);
                t = _mm256_loadu_ps(xr[3] + k);
                a03 = _mm256_fmadd_ps(t, u, a03); a13 = _mm256_fmadd_ps(t, v, a13);
            }
            float r0[4] = {hsum(a00), hsum(a01), hsum(a02), hsum(a03)};
            float r1[4] = {hsum(a10), hsum(a11), hsum(a12), hsum(a13)};
            for (int64_t k = K8; k < K; k++)
                for (int i = 0; i < 4; i++) { r0[i] += xr[i][k] * w0[k]; r1[i] += xr[i][k] * w1[k]; }
            for (int i = 0; i < mc; i++) {
                y[(m + i) * N + n] = r0[i] + (bias ? bias[n] : 0.0f);
                if (two) y[(m + i) * N + n + 1] = r1[i] + (bias ? bias[n + 1] : 0.0f);
            }
        }
    }
}

void lkv_linear(const float *x, int64_t M, int64_t K, const float *W, int64_t N, const float *bias,
                float *y, int nthreads) {
    const int64_t pairs = (N + 1) / 2;
    if (nthreads <= 1) {
        linear_cols(x, M, K, W, bias, y, N, 0, N);
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < nthreads; t++) {
        const int64_t p0 = pairs * t / nthreads, p1 = pairs * (t + 1) / nthreads;
        const int64_t n1 = 2 * p1 < N ? 2 * p1 : N;
        if (2 * p0 < n1) linear_cols(x, M, K, W, bias, y, N, 2 * p0, n1);
    }
}

/* Packed weights, Wp [N/8][K][8] (Wp[j][k][i] = W[8j + i][k]): eight outputs per vector, the x
 * value broadcast, no horizontal sums; two panels (16 outputs) x four rows of x per pass. Reads
 * the weights ~1.5x faster than the row-major kernel above at 4-8 rows. N % 16 == 0. */
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
