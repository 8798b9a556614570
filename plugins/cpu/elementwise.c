/* The decoder layer's RMSNorm at decode sizes (a few rows): in torch several ops of dispatch and
 * allocation for a few KB of data (F.rms_norm ~45 us on 8 x 576); here one pass over the rows.
 * (A SiLU gate and the rotary embedding in C saved nothing: the ctypes call costs about what
 * torch's one or two ops do.) */
#include "common.h"
#include "lkv_abi.h"

/* y[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w, rows of N at strides xs, ys (N % 8 == 0) */
void lkv_rmsnorm(const float *x, int64_t xs, const float *w, float eps, float *y, int64_t ys, int64_t M, int64_t N) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * xs;
        float *yr = y + m * ys;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t n = 0; n < N; n += 8) {
            const __m256 v = _mm256_loadu_ps(xr + n);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)N + eps));
        for (int64_t n = 0; n < N; n += 8)
            _mm256_storeu_ps(yr + n, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + n), r), _mm256_loadu_ps(w + n)));
    }
}
