/* lkv_linear_int8: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows M (a decode batch), over
 * weight-only int8 weights W[n, k] = Wq[n, k] * scale[n, k / G] with fp32 scales
 * (plugins.reference.linear_int8_ref): one per output channel (G = K, scale [N]) or one per group of
 * G consecutive inputs (scale [N, K / G], G % 8 == 0). Wq is read in place, row-major as the engine
 * stores it (no packed copy): a tile of P consecutive weight rows is one contiguous run of P * K
 * bytes, read once from memory for every row of x, at a quarter of the fp32 bytes.
 *
 * Each (x row, weight row) pair has its own vector accumulator over K, eight int8 weights at a
 * time (sign-extended, converted, one FMA against eight x values). Per output channel, the sum of
 * its eight lanes is scaled by the channel's scale at the end (`tile`). Per group, each group's
 * accumulator is added, times the group's scale, into a running one whose lanes are summed at the
 * end (`tile_grouped`). A tile is NR x P accumulators: 1 x 8, 2 x 6, 3 x 4 or 4 x 3 (8 to 12
 * independent FMA chains). Every output's sum runs in the same order whatever M, the tile or the
 * thread count (lanes over k in steps of 8, group by group, the same reduction tree, then the
 * K % 8 tail in order), so a row's result does not depend on the rows batched with it. */
#include "common.h"
#include "lkv_abi.h"

/* eight int8 weights as floats */
static inline __m256 w8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* the lane sum of each of a[0..3] (the same tree for every output) */
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* acc[i][p] += x row i . weight row p over inputs [k0, k1) ((k1 - k0) % 8 == 0), eight at a time in
 * order: the one inner loop of both tiles (always inlined, so acc stays in registers) */
static inline __attribute__((always_inline)) void accumulate(__m256 acc[4][8], const float *const *xr, int NR,
                                                             const int8_t *w, int P, int64_t K, int64_t k0,
                                                             int64_t k1, const int8_t *pf) {
    for (int64_t k = k0; k < k1; k += 8) {
        if (pf) _mm_prefetch((const char *)(pf + k * P), _MM_HINT_T0);
        __m256 xv[4];
        for (int i = 0; i < NR; i++) xv[i] = _mm256_loadu_ps(xr[i] + k);
        for (int p = 0; p < P; p++) {
            const __m256 wv = w8(w + p * K + k);
            for (int i = 0; i < NR; i++) acc[i][p] = _mm256_fmadd_ps(xv[i], wv, acc[i][p]);
        }
    }
}

/* NR rows of x (row i at xr[i], i < nr real ones; the others repeat row 0: computed, not stored)
 * against P weight rows from w (row p at w + p * K), outputs y[i * ys + p]. NR and P are
 * constants once inlined: the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(const float *const *xr, int NR, int nr, const int8_t *w,
                                                       int P, int64_t K, const float *scale, const float *bias,
                                                       float *y, int64_t ys, const int8_t *pf) {
    __m256 acc[4][8];
    for (int i = 0; i < NR; i++)
        for (int p = 0; p < P; p++) acc[i][p] = _mm256_setzero_ps();
    const int64_t K8 = K & ~(int64_t)7;
    accumulate(acc, xr, NR, w, P, K, 0, K8, pf);
    const __m256 z = _mm256_setzero_ps();
    for (int i = 0; i < nr; i++) {
        float s[8];
        for (int p = 0; p < P; p += 4)
            _mm_storeu_ps(s + p, hsum4(acc[i][p], p + 1 < P ? acc[i][p + 1] : z, p + 2 < P ? acc[i][p + 2] : z,
                                       p + 3 < P ? acc[i][p + 3] : z));
        for (int p = 0; p < P; p++) {
            float t = s[p];
            for (int64_t k = K8; k < K; k++) t += xr[i][k] * (float)w[p * K + k];
            y[i * ys + p] = bias ? t * scale[p] + bias[p] : t * scale[p];
        }
    }
}

/* `tile` for a scale per G inputs (row p's scales at scale + p * (K / G); G % 8 == 0, so no K % 8
 * tail): per group, fresh accumulators over its G inputs as in `tile`, then tot += acc * the row's
 * scale of the group (one FMA per output and group: 1 in 8 more FMAs at G = 64, which bound the
 * loop at NR >= 2). Scaling the weights instead (each eight by their scale before the FMAs: the
 * dequantized weight exactly) costs a multiply per eight weights and tile: 1.6 to 1.9 times the
 * per-channel time on a Zen 5 core at the SmolLM2 shapes, against 1.03 to 1.15 this way. The
 * group's accumulators live in registers, `tot` in L1; its lanes are summed as in `tile`, and
 * nothing is scaled at the end. */
static inline __attribute__((always_inline)) void tile_grouped(const float *const *xr, int NR, int nr,
                                                               const int8_t *w, int P, int64_t K, const float *scale,
                                                               int64_t G, const float *bias, float *y, int64_t ys,
                                                               const int8_t *pf) {
    const int64_t ng = K / G;
    /* tot[i * 8 + p]. The empty asm makes the pointer opaque to gcc, here and after each group, so
     * that tot[] stays one array in L1: else gcc splits it into values that it spills and stores
     * twice a group, or keeps in registers the group's accumulators need (1.3 to 1.5 times slower) */
    __m256 buf[4 * 8], *tot = buf;
    __asm__("" : "+r"(tot));
    for (int i = 0; i < NR; i++)
        for (int p = 0; p < P; p++) tot[i * 8 + p] = _mm256_setzero_ps();
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, g++) {
        __m256 acc[4][8];
        for (int i = 0; i < NR; i++)
            for (int p = 0; p < P; p++) acc[i][p] = _mm256_setzero_ps();
        accumulate(acc, xr, NR, w, P, K, k0, k0 + G, pf);
        for (int p = 0; p < P; p++) {
            const __m256 sv = _mm256_broadcast_ss(scale + p * ng + g);
            for (int i = 0; i < NR; i++) tot[i * 8 + p] = _mm256_fmadd_ps(acc[i][p], sv, tot[i * 8 + p]);
        }
        __asm__("" : "+r"(tot));
    }
    const __m256 z = _mm256_setzero_ps();
    for (int i = 0; i < nr; i++) {
        const __m256 *t = tot + i * 8;
        float s[8];
        for (int p = 0; p < P; p += 4)
            _mm_storeu_ps(s + p, hsum4(t[p], p + 1 < P ? t[p + 1] : z, p + 2 < P ? t[p + 2] : z,
                                       p + 3 < P ? t[p + 3] : z));
        for (int p = 0; p < P; p++) y[i * ys + p] = bias ? s[p] + bias[p] : s[p];
    }
}

/* Software prefetch: the first group of x rows over a tile fetches the tile PF_TILES on, P bytes
 * a step (its P * K bytes over the K / 8 steps). The loop is compute-bound at a few rows, which
 * keeps the hardware prefetchers from running far enough ahead on their own. */
#define PF_TILES 2

/* Weight rows [n0, n1) in tiles of PT rows (a shorter one at the end) x groups of NT rows of x (a
 * smaller group at the end, with its own tile shape). A tile's PT * K weight bytes stay in L1
 * while every group passes over them. G: 0 (per output channel) or the inputs per scale. */
#define T(NR_, P_) case NR_ * 16 + P_:                                                         \
    if (G) tile_grouped(xr, NR_, nr, wn, P_, K, scale + n * (K / G), G, bn, yn, N, pf);         \
    else tile(xr, NR_, nr, wn, P_, K, scale + n, bn, yn, N, pf);                               \
    break
static void tiles(const float *x, int64_t M, int64_t K, const int8_t *W, const float *scale, int64_t G,
                  const float *bias, float *y, int64_t N, int64_t n0, int64_t n1, int NT, int PT) {
    for (int64_t n = n0; n < n1; n += PT) {
        const int P = n1 - n < PT ? (int)(n1 - n) : PT;
        const int8_t *wn = W + n * K;
        const float *bn = bias ? bias + n : NULL;
        for (int64_t m = 0; m < M; m += NT) {
            const int nr = M - m < NT ? (int)(M - m) : NT;
            const float *xr[4];
            for (int i = 0; i < 4; i++) xr[i] = x + (m + (i < nr ? i : 0)) * K;
            float *yn = y + m * N + n;
            const int8_t *pf = m == 0 ? wn + PF_TILES * P * K : NULL;
            switch (nr * 16 + P) {
                T(1, 1); T(1, 2); T(1, 3); T(1, 4); T(1, 5); T(1, 6); T(1, 7); T(1, 8);
                T(2, 1); T(2, 2); T(2, 3); T(2, 4); T(2, 5); T(2, 6);
                T(3, 1); T(3, 2); T(3, 3); T(3, 4);
                T(4, 1); T(4, 2); T(4, 3);
                default: break;      /* not reached: (NT, PT) below are among the cases */
            }
        }
    }
}
#undef T

/* x [M, K] fp32 contiguous, W [N, K] int8 contiguous, scale fp32 [N, K / group] contiguous (group:
 * inputs per scale; group == K: [N], one per output channel, else a multiple of 8 dividing K: the
 * caller checks), bias [N] fp32 or NULL, y [M, N] fp32. Any M (the Python side sends at most
 * MAX_INT8_ROWS; prefill dequantizes). Tiles: 1 x 8, 2 x 6, 3 x 4 and 4 x 3 (x rows x weight
 * rows), 8 to 12 accumulators. */
void lkv_linear_int8(const float *x, int64_t M, int64_t K, const int8_t *W, int64_t N, const float *scale,
                     int64_t group, const float *bias, float *y, int nthreads) {
    const int64_t G = group > 0 && group < K ? group : 0;     /* 0: per output channel */
    const int NT = M < 4 ? (int)M : 4, PT = NT == 1 ? 8 : NT == 2 ? 6 : NT == 3 ? 4 : 3;
    const int64_t ntiles = (N + PT - 1) / PT;
    const int nt = nthreads > 1 && ntiles > 1 ? (ntiles < nthreads ? (int)ntiles : nthreads) : 1;
    if (M <= 0) return;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        const int64_t t0 = ntiles * t / nt, t1 = ntiles * (t + 1) / nt;
        const int64_t n0 = PT * t0, n1 = PT * t1 < N ? PT * t1 : N;
        if (n0 < n1) tiles(x, M, K, W, scale, G, bias, y, N, n0, n1, NT, PT);
    }
}
