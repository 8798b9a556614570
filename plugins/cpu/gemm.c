/* Many-row GEMMs on the CPU's dot-product units, for prefill (plugins/cpu/prefill.py):
 *
 *   lkv_gemm_bf16   y[M, N] = x[M, K] W[N, K]^T + bias: x rounded to bf16 (round to nearest even)
 *                   as it is read, W stored in bf16 (packed once per weight), vdpbf16ps: products
 *                   exact, sums in fp32, the output fp32.
 *   lkv_gemm_w8a8   the same with int8 weights and one fp32 scale per output channel and group of G
 *                   inputs (the int8 engine's layout), x quantized per row and group of G inputs
 *                   (symmetric: s = max|x| / 127, q = round(x / s)), integer dot products
 *                   (vpdpbusd), each group's int32 sum scaled into the fp32 output.
 *
 * Both accumulate every output element in one fixed order (k ascending), whatever M, the tiling
 * or the threads: a row's result does not depend on the other rows of the call (a prompt's
 * chunking changes nothing). Weights are packed in panels of columns, zero-padded:
 *   bf16: [N / 64][ceil(K / 2)][64] 32-bit pairs (W[n][2p], W[n][2p + 1])
 *   int8: [N / 32][K / 4][32] 32-bit quads (W[n][4p .. 4p + 3]), with per panel and group the
 *         scales [N / 32][K / G][32] fp32 and the offset sums 128 * sum_k W[n][k] [N / 32][K / G][32]
 *         int32 (vpdpbusd multiplies unsigned activations: q + 128, whose excess is subtracted).
 * AVX-512 (F, BW, VL, DQ) with AVX512_BF16 / AVX512_VNNI; lkv_gemm_supported() says which. Built
 * into the AVX-512 library (plugins/cpu/loader.py), apart from the base one: every entry that runs
 * AVX-512 code checks the CPU first (once per process, cached) and returns LKV_ERR_ISA without it.
 */
#include "common.h"
#include "lkv_abi.h"

#define BF_PANEL 64
#define I8_PANEL 32
#define MR 6
#define MBLOCK 96          /* rows per unit of work: a weight panel stays in L2 across them */

/* The int32 sums of one group: G terms of at most 255 * 128 (lkv_abi.h LKV_W8A8_MAX_GROUP) */
_Static_assert((int64_t)LKV_W8A8_MAX_GROUP * 255 * 128 <= INT32_MAX, "W8A8 group sums must fit in int32");

/* 1: bf16 dot products, 2: int8 dot products (bit mask). Asked of the CPU once; the answer is
 * cached (a race between first callers stores the same value twice). */
int lkv_gemm_supported(void) {
    static int cached = -1;
    int bits = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (bits < 0) {
        __builtin_cpu_init();
        const int base = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                      && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
        bits = base ? (__builtin_cpu_supports("avx512bf16") ? 1 : 0) | (__builtin_cpu_supports("avx512vnni") ? 2 : 0)
                    : 0;
        __atomic_store_n(&cached, bits, __ATOMIC_RELAXED);
    }
    return bits;
}

/* The W8A8 entries' checks, before any AVX-512 code: LKV_ERR_ISA without AVX512_VNNI, LKV_ERR_ARG
 * unless G is a multiple of 4 dividing K, LKV_ERR_LIMIT past the int32 accumulation bound. */
static int w8a8_check(int64_t K, int64_t G) {
    if (!(lkv_gemm_supported() & 2)) return LKV_ERR_ISA;
    if (G <= 0 || G % 4 || K % G) return LKV_ERR_ARG;
    if (G > LKV_W8A8_MAX_GROUP) return LKV_ERR_LIMIT;
    return LKV_OK;
}

/* ---- bf16 -------------------------------------------------------------------------------------- */

/* W [N, K] fp32 (row stride ws) -> wp, (N + 63) / 64 * ceil(K / 2) * 64 uint32 */
void lkv_pack_bf16(const float *w, int64_t ws, int64_t N, int64_t K, uint32_t *wp, int nthreads) {
    const int64_t K2 = (K + 1) / 2, panels = (N + BF_PANEL - 1) / BF_PANEL;
#pragma omp parallel for num_threads(nthreads > 1 ? nthreads : 1) if (nthreads > 1) schedule(static)
    for (int64_t pn = 0; pn < panels; pn++)
        for (int64_t j = 0; j < BF_PANEL; j++) {
            const int64_t n = pn * BF_PANEL + j;
            uint32_t *dst = wp + pn * K2 * BF_PANEL + j;
            for (int64_t p = 0; p < K2; p++) {
                uint32_t v = 0;
                if (n < N) {
                    v = bf16_bits(w[n * ws + 2 * p]);
                    if (2 * p + 1 < K) v |= bf16_bits(w[n * ws + 2 * p + 1]) << 16;
                }
                dst[p * BF_PANEL] = v;
            }
        }
}

/* rows [m0, m0 + NR) of xb (K2 pairs a row) against one panel (K2 x 64) -> y columns [n0, n0 + nv) */
LKV_AVX512_BF16 static inline __attribute__((always_inline)) void bf16_tile(
        const uint32_t *xb, int64_t K2, int NR, const uint32_t *panel, const float *bias, int64_t n0, int nv,
        float *y, int64_t ys) {
    __m512 acc[MR][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K2; p++) {
        __m512bh w[4];
        for (int c = 0; c < 4; c++) w[c] = (__m512bh)_mm512_loadu_si512(panel + p * BF_PANEL + 16 * c);
        for (int r = 0; r < NR; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xb[r * K2 + p]);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, w[c]);
        }
    }
    for (int c = 0; c < 4; c++) {
        const int left = nv - 16 * c;
        if (left <= 0) break;
        const __mmask16 mk = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mk, bias + n0 + 16 * c) : _mm512_setzero_ps();
        for (int r = 0; r < NR; r++)
            _mm512_mask_storeu_ps(y + r * ys + n0 + 16 * c, mk, _mm512_add_ps(acc[r][c], b));
    }
}

#define BF16_TILE(NRC) LKV_AVX512_BF16 static void bf16_tile_##NRC(const uint32_t *xb, int64_t K2, \
    const uint32_t *panel, const float *bias, int64_t n0, int nv, float *y, int64_t ys) { \
    bf16_tile(xb, K2, NRC, panel, bias, n0, nv, y, ys); }
BF16_TILE(1) BF16_TILE(2) BF16_TILE(3) BF16_TILE(4) BF16_TILE(5) BF16_TILE(6)
#undef BF16_TILE
typedef void (*bf16_fn)(const uint32_t *, int64_t, const uint32_t *, const float *, int64_t, int, float *, int64_t);
static const bf16_fn BF16_TILES[MR + 1] = {NULL, bf16_tile_1, bf16_tile_2, bf16_tile_3, bf16_tile_4, bf16_tile_5,
                                           bf16_tile_6};

/* x [M, K] fp32 (row stride xs), wp packed by lkv_pack_bf16, bias [N] or NULL -> y [M, N] (row
 * stride ys). Returns LKV_OK, LKV_ERR_NOMEM, LKV_ERR_ISA (no AVX512_BF16). */
int lkv_gemm_bf16(const float *x, int64_t xs, int64_t M, int64_t K, const uint32_t *wp, int64_t N, const float *bias,
                  float *y, int64_t ys, int nthreads) {
    if (!(lkv_gemm_supported() & 1)) return LKV_ERR_ISA;
    const int64_t K2 = (K + 1) / 2, panels = (N + BF_PANEL - 1) / BF_PANEL, mblocks = (M + MBLOCK - 1) / MBLOCK;
    uint32_t *xb = malloc((size_t)(M * K2) * sizeof(uint32_t));
    if (xb == NULL) return LKV_ERR_NOMEM;
#pragma omp parallel num_threads(nthreads > 1 ? nthreads : 1) if (nthreads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            const float *xr = x + m * xs;
            uint32_t *dst = xb + m * K2;
            int64_t p = 0;
            for (; 2 * p + 16 <= K; p += 8)
                _mm256_storeu_si256((__m256i *)(dst + p),
                                    bf16_pairs(_mm256_loadu_ps(xr + 2 * p), _mm256_loadu_ps(xr + 2 * p + 8)));
            for (; p < K2; p++) dst[p] = bf16_bits(xr[2 * p]) | (2 * p + 1 < K ? bf16_bits(xr[2 * p + 1]) << 16 : 0);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < panels * mblocks; u++) {
            const int64_t pn = u / mblocks, m0 = (u % mblocks) * MBLOCK, m1 = m0 + MBLOCK < M ? m0 + MBLOCK : M;
            const int64_t n0 = pn * BF_PANEL;
            const int nv = N - n0 < BF_PANEL ? (int)(N - n0) : BF_PANEL;
            for (int64_t m = m0; m < m1; m += MR) {
                const int nr = m1 - m < MR ? (int)(m1 - m) : MR;
                BF16_TILES[nr](xb + m * K2, K2, wp + pn * K2 * BF_PANEL, bias, n0, nv, y + m * ys, ys);
            }
        }
    }
    free(xb);
    return LKV_OK;
}

/* ---- int8 x int8 (W8A8) -------------------------------------------------------------------------- */

/* qweight [N, K] int8, scale [N, K / G] fp32 -> wq [N / 32][K / 4][32] quads, wsc [N / 32][K / G][32]
 * fp32 and wsum [N / 32][K / G][32] int32 (128 x the group's weight sum); padded columns zero. */
void lkv_pack_w8a8(const int8_t *w, const float *scale, int64_t N, int64_t K, int64_t G, int32_t *wq, float *wsc,
                   int32_t *wsum, int nthreads) {
    const int64_t K4 = K / 4, NG = K / G, panels = (N + I8_PANEL - 1) / I8_PANEL;
#pragma omp parallel for num_threads(nthreads > 1 ? nthreads : 1) if (nthreads > 1) schedule(static)
    for (int64_t pn = 0; pn < panels; pn++)
        for (int64_t j = 0; j < I8_PANEL; j++) {
            const int64_t n = pn * I8_PANEL + j;
            for (int64_t p = 0; p < K4; p++) {
                uint32_t v = 0;
                if (n < N)
                    for (int b = 0; b < 4; b++) v |= (uint32_t)(uint8_t)w[n * K + 4 * p + b] << (8 * b);
                wq[(pn * K4 + p) * I8_PANEL + j] = (int32_t)v;
            }
            for (int64_t g = 0; g < NG; g++) {
                int32_t s = 0;
                if (n < N)
                    for (int64_t k = g * G; k < (g + 1) * G; k++) s += w[n * K + k];
                wsum[(pn * NG + g) * I8_PANEL + j] = 128 * s;
                wsc[(pn * NG + g) * I8_PANEL + j] = n < N ? scale[n * NG + g] : 0.0f;
            }
        }
}

/* Row x [K] -> quads of q + 128 (uint8) and one scale per group of G: s = max|x| / 127 (1 where the
 * group is all zeros), q = round-to-nearest-even(x / s), in [-127, 127]. */
LKV_AVX512_VNNI static void quantize_row(const float *xr, int64_t K, int64_t G, uint8_t *q, float *sx) {
    for (int64_t g = 0; g < K / G; g++) {
        const float *xg = xr + g * G;
        float amax = 0.0f;
        int64_t k = 0;
        if (G % 16 == 0) {
            __m512 m = _mm512_setzero_ps();
            for (; k < G; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xg + k)));
            amax = _mm512_reduce_max_ps(m);
        }
        for (; k < G; k++) amax = fmaxf(amax, fabsf(xg[k]));
        const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
        sx[g] = s;
        k = 0;
        if (G % 16 == 0) {
            const __m512 sv = _mm512_set1_ps(s);
            for (; k < G; k += 16) {
                __m512i v = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(xg + k), sv),
                                                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                v = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
                _mm_storeu_si128((__m128i *)(q + g * G + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(v, _mm512_set1_epi32(128))));
            }
        }
        for (; k < G; k++) {
            float v = nearbyintf(xg[k] / s);
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
            q[g * G + k] = (uint8_t)((int)v + 128);
        }
    }
}

static void quantize_rows(const float *x, int64_t xs, int64_t M, int64_t K, int64_t G, uint32_t *xq, float *sx,
                          int nthreads) {
#pragma omp parallel for num_threads(nthreads > 1 ? nthreads : 1) if (nthreads > 1) schedule(static)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * xs, K, G, (uint8_t *)(xq + m * (K / 4)), sx + m * (K / G));
}

/* x [M, K] -> quads of q + 128 (uint8) and one scale per row and group of G: s = max|x| / 127 (1
 * where the group is all zeros), q = round-to-nearest-even(x / s), in [-127, 127]. Returns LKV_OK,
 * or w8a8_check's code (nothing written). */
int lkv_quantize_rows(const float *x, int64_t xs, int64_t M, int64_t K, int64_t G, uint32_t *xq, float *sx,
                      int nthreads) {
    const int rc = w8a8_check(K, G);
    if (rc != LKV_OK) return rc;
    quantize_rows(x, xs, M, K, G, xq, sx, nthreads);
    return LKV_OK;
}

/* rows [0, NR) of the quantized x against one 32-column panel, every group: NR x 2 int32 sums a
 * group, folded into NR x 2 fp32 sums (int32 - offset, times the activation and weight scales) */
LKV_AVX512_VNNI static inline __attribute__((always_inline)) void w8a8_tile(
        const uint32_t *xq, const float *sx, int64_t K4, int64_t NG, int64_t G4, int NR, const int32_t *wq,
        const float *wsc, const int32_t *wsum, const float *bias, int64_t n0, int nv, float *y, int64_t ys) {
    __m512 f[MR][2];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < 2; c++) f[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        __m512i a[MR][2];
        for (int r = 0; r < NR; r++)
            for (int c = 0; c < 2; c++) a[r][c] = _mm512_setzero_si512();
        for (int64_t p = g * G4; p < (g + 1) * G4; p++) {
            const __m512i w0 = _mm512_loadu_si512(wq + p * I8_PANEL), w1 = _mm512_loadu_si512(wq + p * I8_PANEL + 16);
            for (int r = 0; r < NR; r++) {
                const __m512i xv = _mm512_set1_epi32((int)xq[r * K4 + p]);
                a[r][0] = _mm512_dpbusd_epi32(a[r][0], xv, w0);
                a[r][1] = _mm512_dpbusd_epi32(a[r][1], xv, w1);
            }
        }
        for (int c = 0; c < 2; c++) {
            const __m512i off = _mm512_loadu_si512(wsum + g * I8_PANEL + 16 * c);
            const __m512 ws = _mm512_loadu_ps(wsc + g * I8_PANEL + 16 * c);
            for (int r = 0; r < NR; r++) {
                const __m512 sc = _mm512_mul_ps(ws, _mm512_set1_ps(sx[r * NG + g]));
                f[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[r][c], off)), sc, f[r][c]);
            }
        }
    }
    for (int c = 0; c < 2; c++) {
        const int left = nv - 16 * c;
        if (left <= 0) break;
        const __mmask16 mk = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mk, bias + n0 + 16 * c) : _mm512_setzero_ps();
        for (int r = 0; r < NR; r++)
            _mm512_mask_storeu_ps(y + r * ys + n0 + 16 * c, mk, _mm512_add_ps(f[r][c], b));
    }
}

#define W8A8_TILE(NRC) LKV_AVX512_VNNI static void w8a8_tile_##NRC(const uint32_t *xq, const float *sx, int64_t K4, \
    int64_t NG, int64_t G4, const int32_t *wq, const float *wsc, const int32_t *wsum, const float *bias, int64_t n0, \
    int nv, float *y, int64_t ys) { w8a8_tile(xq, sx, K4, NG, G4, NRC, wq, wsc, wsum, bias, n0, nv, y, ys); }
W8A8_TILE(1) W8A8_TILE(2) W8A8_TILE(3) W8A8_TILE(4) W8A8_TILE(5) W8A8_TILE(6)
#undef W8A8_TILE
typedef void (*w8a8_fn)(const uint32_t *, const float *, int64_t, int64_t, int64_t, const int32_t *, const float *,
                        const int32_t *, const float *, int64_t, int, float *, int64_t);
static const w8a8_fn W8A8_TILES[MR + 1] = {NULL, w8a8_tile_1, w8a8_tile_2, w8a8_tile_3, w8a8_tile_4, w8a8_tile_5,
                                           w8a8_tile_6};

/* lkv_gemm_w8a8 with the caller's scratch for the quantized rows: xq [M * K / 4], sx [M * K / G]
 * (a decode step's few rows: decode.c passes its work struct's, which fused.py sizes). Returns
 * LKV_OK, or w8a8_check's code (nothing written). */
int lkv_gemm_w8a8_scratch(const float *x, int64_t xs, int64_t M, int64_t K, int64_t G, const int32_t *wq,
                          const float *wsc, const int32_t *wsum, int64_t N, const float *bias, float *y, int64_t ys,
                          int nthreads, uint32_t *xq, float *sx) {
    const int rc = w8a8_check(K, G);
    if (rc != LKV_OK) return rc;
    const int64_t K4 = K / 4, NG = K / G, G4 = G / 4, panels = (N + I8_PANEL - 1) / I8_PANEL;
    const int64_t mblocks = (M + MBLOCK - 1) / MBLOCK;
    quantize_rows(x, xs, M, K, G, xq, sx, nthreads);
#pragma omp parallel for num_threads(nthreads > 1 ? nthreads : 1) if (nthreads > 1) schedule(dynamic, 1)
    for (int64_t u = 0; u < panels * mblocks; u++) {
        const int64_t pn = u / mblocks, m0 = (u % mblocks) * MBLOCK, m1 = m0 + MBLOCK < M ? m0 + MBLOCK : M;
        const int64_t n0 = pn * I8_PANEL;
        const int nv = N - n0 < I8_PANEL ? (int)(N - n0) : I8_PANEL;
        for (int64_t m = m0; m < m1; m += MR) {
            const int nr = m1 - m < MR ? (int)(m1 - m) : MR;
            W8A8_TILES[nr](xq + m * K4, sx + m * NG, K4, NG, G4, wq + pn * K4 * I8_PANEL, wsc + pn * NG * I8_PANEL,
                           wsum + pn * NG * I8_PANEL, bias, n0, nv, y + m * ys, ys);
        }
    }
    return LKV_OK;
}

/* x [M, K] fp32 (row stride xs) quantized per row and group of G (lkv_quantize_rows), against the
 * weight packed by lkv_pack_w8a8, bias [N] or NULL -> y [M, N] (row stride ys). K % G == 0,
 * G % 4 == 0, G <= LKV_W8A8_MAX_GROUP. Returns LKV_OK, LKV_ERR_NOMEM, or w8a8_check's code. */
int lkv_gemm_w8a8(const float *x, int64_t xs, int64_t M, int64_t K, int64_t G, const int32_t *wq, const float *wsc,
                  const int32_t *wsum, int64_t N, const float *bias, float *y, int64_t ys, int nthreads) {
    const int ok = w8a8_check(K, G);
    if (ok != LKV_OK) return ok;
    uint32_t *xq = malloc((size_t)(M * (K / 4)) * sizeof(uint32_t));
    float *sx = malloc((size_t)(M * (K / G)) * sizeof(float));
    const int rc = xq == NULL || sx == NULL ? LKV_ERR_NOMEM
                   : lkv_gemm_w8a8_scratch(x, xs, M, K, G, wq, wsc, wsum, N, bias, y, ys, nthreads, xq, sx);
    free(xq);
    free(sx);
    return rc;
}
