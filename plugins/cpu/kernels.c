/* CPU kernels for the decode step's two memory-bound reads (AVX2 + FMA, fp32).
 *
 * lkv_linear     y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows M: W is streamed once,
 *                every row reuses each loaded chunk of W (BLAS's small-M path reads it at a
 *                third of the bandwidth on this machine). lkv_linear_packed: the same over a
 *                copy of W packed in 8-output panels, faster still.
 * lkv_block_topk block_topk (plugins/topk.py): the Quest bound of every (row, KV head, block) in
 *                one read of the summaries, and each row's top-K block ids (score desc, lower id
 *                first on ties), ascending, padded with -1.
 * lkv_attention  lookahead_attention's math (plugins/attention.py): per (sequence, KV head) the
 *                R*G query rows of the GQA group score the visible gathered keys and the
 *                visible extra keys, softmax in fp32, and sum the values. Masked keys are never
 *                read.
 *
 * Built by plugins/cpu/loader.py on first use with the machine's compiler; called through
 * ctypes with raw pointers, which the Python side checks (dtype, contiguity, strides).
 * nthreads > 1 splits the outer loop with OpenMP.
 */
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

/* ---- linear ------------------------------------------------------------------------------ */
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

/* ---- attention --------------------------------------------------------------------------- */
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

/* q . k for eight key rows at once: eight independent FMA chains, then one transposing reduction. */
static inline __m256 dot8(const float *q, const float *const *kr, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[0] + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[1] + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[2] + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[3] + d), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[4] + d), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[5] + d), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[6] + d), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[7] + d), a7);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static float dot1(const float *a, const float *b, int64_t D) {
    __m256 s = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s);
    return hsum(s);
}

/* One (sequence, KV head). qs [RG, D] (scaled), keys/values at kb/vb with row stride D, visible
 * key ids vis[nv]; extras xk/xv [E] rows at strides xks/xvs, xvis[r * E + e]; out rows at orow[rg].
 * Scratch: s [RG, nv8], acc [RG + 1, D]. D is a multiple of 32. */
static void attend_one(const float *qs, int RG, int G, const float *kb, const float *vb, const int32_t *vis,
                       int64_t nv, const float *xk, int64_t xks, const float *xv, int64_t xvs, const uint8_t *xvis, int64_t E,
                       int64_t D, float *const *orow, float *s, int64_t nv8, float *acc) {
    const float *kr[8];
    for (int64_t t = 0; t < nv; t += 8) {
        for (int i = 0; i < 8; i++) kr[i] = kb + (int64_t)vis[t + i < nv ? t + i : nv - 1] * D;
        for (int rg = 0; rg < RG; rg++) _mm256_storeu_ps(s + rg * nv8 + t, dot8(qs + rg * D, kr, D));
    }
    float xp[64 * 8], inv[64];                           /* extra keys' weights, 1 / denominators */
    for (int rg = 0; rg < RG; rg++) {
        const int r = rg / G;
        float *sr = s + rg * nv8, *xe = xp + rg * 8;
        float m = -INFINITY;
        for (int64_t j = 0; j < nv; j++) m = sr[j] > m ? sr[j] : m;
        for (int64_t e = 0; e < E; e++) {
            xe[e] = xvis[r * E + e] ? dot1(qs + rg * D, xk + e * xks, D) : -INFINITY;
            m = xe[e] > m ? xe[e] : m;
        }
        if (m == -INFINITY) m = 0.0f;            /* sees no key: l = 0, zeros (the op's contract) */
        const __m256 mv = _mm256_set1_ps(m);
        __m256 lv = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= nv; j += 8) {
            const __m256 p = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sr + j), mv));
            _mm256_storeu_ps(sr + j, p);
            lv = _mm256_add_ps(lv, p);
        }
        float l = hsum(lv);
        for (; j < nv; j++) { sr[j] = expf(sr[j] - m); l += sr[j]; }
        for (int64_t e = 0; e < E; e++) { xe[e] = xvis[r * E + e] ? expf(xe[e] - m) : 0.0f; l += xe[e]; }
        inv[rg] = l > 0.0f ? 1.0f / l : 0.0f;    /* l >= 1 when a key is visible (its max is 1) */
    }
    /* P @ V, key tiles outer so that V is read once (a tile stays in L1 across the rows); the
     * rows' running sums live in `acc` [RG, D], three rows x 32 columns in registers at a time */
    for (int64_t i = 0; i < RG * D; i++) acc[i] = 0.0f;
    const float zeros[8] = {0};
    for (int64_t t = 0; t < nv; t += 8) {
        const int tn = nv - t < 8 ? (int)(nv - t) : 8;
        const float *vr[8];
        for (int i = 0; i < tn; i++) vr[i] = vb + (int64_t)vis[t + i] * D;
        for (int rg = 0; rg < RG; rg += 3) {
            /* rows past RG read zero weights and add into a spare row of acc */
            const float *p0 = s + rg * nv8 + t;
            const float *p1 = rg + 1 < RG ? s + (rg + 1) * nv8 + t : zeros;
            const float *p2 = rg + 2 < RG ? s + (rg + 2) * nv8 + t : zeros;
            float *o0 = acc + rg * D, *o1 = rg + 1 < RG ? o0 + D : acc + RG * D;
            float *o2 = rg + 2 < RG ? o0 + 2 * D : acc + RG * D;
            for (int64_t d = 0; d < D; d += 32) {
                __m256 x0 = _mm256_loadu_ps(o0 + d), x1 = _mm256_loadu_ps(o0 + d + 8);
                __m256 x2 = _mm256_loadu_ps(o0 + d + 16), x3 = _mm256_loadu_ps(o0 + d + 24);
                __m256 y0 = _mm256_loadu_ps(o1 + d), y1 = _mm256_loadu_ps(o1 + d + 8);
                __m256 y2 = _mm256_loadu_ps(o1 + d + 16), y3 = _mm256_loadu_ps(o1 + d + 24);
                __m256 z0 = _mm256_loadu_ps(o2 + d), z1 = _mm256_loadu_ps(o2 + d + 8);
                __m256 z2 = _mm256_loadu_ps(o2 + d + 16), z3 = _mm256_loadu_ps(o2 + d + 24);
                for (int i = 0; i < tn; i++) {
                    const __m256 a = _mm256_broadcast_ss(p0 + i), b = _mm256_broadcast_ss(p1 + i);
                    const __m256 c = _mm256_broadcast_ss(p2 + i);
                    const float *v = vr[i] + d;
                    __m256 w = _mm256_loadu_ps(v);
                    x0 = _mm256_fmadd_ps(a, w, x0); y0 = _mm256_fmadd_ps(b, w, y0); z0 = _mm256_fmadd_ps(c, w, z0);
                    w = _mm256_loadu_ps(v + 8);
                    x1 = _mm256_fmadd_ps(a, w, x1); y1 = _mm256_fmadd_ps(b, w, y1); z1 = _mm256_fmadd_ps(c, w, z1);
                    w = _mm256_loadu_ps(v + 16);
                    x2 = _mm256_fmadd_ps(a, w, x2); y2 = _mm256_fmadd_ps(b, w, y2); z2 = _mm256_fmadd_ps(c, w, z2);
                    w = _mm256_loadu_ps(v + 24);
                    x3 = _mm256_fmadd_ps(a, w, x3); y3 = _mm256_fmadd_ps(b, w, y3); z3 = _mm256_fmadd_ps(c, w, z3);
                }
                _mm256_storeu_ps(o0 + d, x0); _mm256_storeu_ps(o0 + d + 8, x1);
                _mm256_storeu_ps(o0 + d + 16, x2); _mm256_storeu_ps(o0 + d + 24, x3);
                _mm256_storeu_ps(o1 + d, y0); _mm256_storeu_ps(o1 + d + 8, y1);
                _mm256_storeu_ps(o1 + d + 16, y2); _mm256_storeu_ps(o1 + d + 24, y3);
                _mm256_storeu_ps(o2 + d, z0); _mm256_storeu_ps(o2 + d + 8, z1);
                _mm256_storeu_ps(o2 + d + 16, z2); _mm256_storeu_ps(o2 + d + 24, z3);
            }
        }
    }
    for (int rg = 0; rg < RG; rg++) {
        const int r = rg / G;
        float *o = orow[rg], *a = acc + rg * D;
        for (int64_t e = 0; e < E; e++)
            if (xvis[r * E + e])
                for (int64_t d = 0; d < D; d++) a[d] += xp[rg * 8 + e] * xv[e * xvs + d];
        for (int64_t d = 0; d < D; d++) o[d] = a[d] * inv[rg];
    }
}

/* q, out [B, R, H, D] contiguous; k, v rows of D floats at k + b*ksb + h*ksh + n*D (same strides
 * for v); kv_mask [B, KVH, N] bytes; k_extra rows at kx + b*xksb + h*xksh + e*xkse (v_extra
 * likewise with its own strides);
 * extra_mask [B, R, E] bytes (E <= 8). Returns 0, or -1 when scratch memory ran out. */
int lkv_attention(const float *q, const float *k, const float *v, int64_t ksb, int64_t ksh,
                  const uint8_t *kv_mask, const float *kx, int64_t xksb, int64_t xksh, int64_t xkse,
                  const float *vx, int64_t xvsb, int64_t xvsh, int64_t xvse, const uint8_t *extra_mask, float *out, int64_t B, int64_t R, int64_t H,
                  int64_t KVH, int64_t N, int64_t E, int64_t D, float scale, int nthreads) {
    const int G = (int)(H / KVH), RG = (int)(R * G);
    const int64_t nv8 = (N + 7) & ~(int64_t)7;
    int failed = 0;
#pragma omp parallel num_threads(nthreads > 1 ? nthreads : 1) if (nthreads > 1) reduction(| : failed)
    {
        float *s = malloc(sizeof(float) * (RG * nv8 + (2 * RG + 1) * D + 8));
        int32_t *vis = malloc(sizeof(int32_t) * (N + 1));
        if (!s || !vis) failed = 1;
        else {
            float *qs = s + RG * nv8;
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * KVH; bh++) {
                const int64_t b = bh / KVH, h = bh % KVH;
                const uint8_t *mk = kv_mask + bh * N;
                int64_t nv = 0;
                for (int64_t n = 0; n < N; n++) if (mk[n]) vis[nv++] = (int32_t)n;
                float *orow[64];
                for (int rg = 0; rg < RG; rg++) {
                    const int r = rg / G, g = rg % G;
                    const float *qr = q + ((b * R + r) * H + h * G + g) * D;
                    for (int64_t d = 0; d < D; d++) qs[rg * D + d] = qr[d] * scale;
                    orow[rg] = out + ((b * R + r) * H + h * G + g) * D;
                }
                attend_one(qs, RG, G, k + b * ksb + h * ksh, v + b * ksb + h * ksh, vis, nv,
                           kx + b * xksb + h * xksh, xkse, vx + b * xvsb + h * xvsh, xvse, extra_mask + b * R * E, E, D,
                           orow, s, nv8, qs + RG * D);
            }
        }
        free(s);
        free(vis);
    }
    return failed ? -1 : 0;
}

/* ---- block top-K --------------------------------------------------------------------------- */
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
