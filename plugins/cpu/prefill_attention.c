/* lkv_prefill_attention: chunked causal prefill attention (runtime/attention_dense.py's
 * prefill_attention is its reference) read straight from one layer of the paged KV pool.
 *
 * n new query rows, row i at position L - n + i, attend to the sequence's keys 0 .. L - n + i,
 * which lie in the pool's blocks btab[0 .. ceil(L / bs)) ([KVH, NB, bs, D] per layer, K/V stored
 * as fp32, fp16 or bf16). No gather copy of the cache and no mask are made: per call, each KV
 * head's keys and values are converted once into bf16 tiles laid out for dot products
 * (packing), shared by the threads, then every (KV head, run of positions) unit runs a
 * flash-attention loop: the G query heads of the GQA group and TP consecutive positions form its
 * rows, so each K/V tile is read once for all of them; an online softmax (running max and
 * denominator per row) in fp32.
 *
 * Numerics (plugins/CONTRACTS.md, "Prefill attention"): q * scale * log2(e), K, V and the softmax
 * weights are rounded to bf16 (round to nearest even); products are exact in fp32 and every sum is
 * fp32. The AVX512_BF16 path sums with vdpbf16ps; the AVX2 path (any x86-64 with AVX2 + FMA, or
 * no tiles given) computes the same rounded values with fp32 FMAs. Key tiles sit at fixed positions
 * (multiples of KT), and a row's sums never depend on the other rows of its tile, so a row's
 * output does not depend on how the prompt was chunked (bit for bit, per ISA path).
 *
 * This file (the driver, packing and the AVX2 tile) is the base library's; the AVX512_BF16 tiles
 * are prefill_attention_bf16.c's, in the AVX-512 library (plugins/cpu/loader.py), and reach the
 * driver as a table of function addresses (`tiles`), so that a compiler without those targets
 * loses only them.
 */
#include "common.h"
#include "lkv_abi.h"
#include "prefill_attention.h"

#define ROWS 24        /* target rows per unit (TP positions x G heads): a K/V tile is reused by them */
#define LOG2E 1.4426950408889634f

/* ---- packing: fp32 / fp16 / bf16 storage -> bf16 pairs ------------------------------------------ */

static inline float kv_get(const void *p, int64_t i, int T) {
    if (T == LKV_KV_F16) return _cvtsh_ss(((const uint16_t *)p)[i]);
    if (T == LKV_KV_BF16) {
        uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return ((const float *)p)[i];
}

/* eight elements of storage T from element i, widened to fp32 */
static inline __m256 ld8(const void *row, int64_t i, int T) {
    if (T == LKV_KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    if (T == LKV_KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i))), 16));
    return _mm256_loadu_ps((const float *)row + i);
}

/* Key j's row (D elements of storage T) into the QK tile layout: kp[g][p][16] 32-bit pairs
 * (K[j][2p], K[j][2p + 1]), g = j / 16, so one 64-byte vector holds 16 keys' pair p. */
static inline void pack_key(const void *row, int64_t D, int T, uint32_t *kp_group, int lane) {
    for (int64_t d = 0; d < D; d += 16) {
        uint32_t pr[8];
        _mm256_storeu_si256((__m256i *)pr, bf16_pairs(ld8(row, d, T), ld8(row, d + 8, T)));
        for (int i = 0; i < 8; i++) kp_group[(d / 2 + i) * 16 + lane] = pr[i];
    }
}

/* Value rows j (even) and j + 1 (or zeros) into the PV layout vp[d] = (V[j][d], V[j+1][d]) */
static inline void pack_values(const void *r0, const void *r1, int64_t D, int T, uint32_t *vp) {
    for (int64_t d = 0; d < D; d += 8) {
        const __m256i a = bf16x8(ld8(r0, d, T));
        const __m256i b = r1 ? bf16x8(ld8(r1, d, T)) : _mm256_setzero_si256();
        _mm256_storeu_si256((__m256i *)(vp + d), _mm256_or_si256(a, _mm256_slli_epi32(b, 16)));
    }
}

/* Pack keys/values [k0, k1) (k0, k1 multiples of 16; keys >= L are zero) of one KV head. kh, vh:
 * the head's pool [NB, bs, D]; kp [Lp / 16][D / 2][16], vp [Lp / 2][D] uint32. */
static void pack_range(const void *kh, const void *vh, const int64_t *btab, int64_t bs, int64_t L, int64_t D, int T,
                       int64_t k0, int64_t k1, uint32_t *kp, uint32_t *vp) {
    const int64_t es = T == LKV_KV_F32 ? 4 : 2, D2 = D / 2;
    for (int64_t j = k0; j < k1; j++) {
        uint32_t *grp = kp + (j / 16) * D2 * 16;
        if (j < L) {
            const int64_t off = (btab[j / bs] * bs + j % bs) * D;
            pack_key((const char *)kh + off * es, D, T, grp, (int)(j % 16));
        } else {
            for (int64_t p = 0; p < D2; p++) grp[p * 16 + j % 16] = 0;
        }
    }
    for (int64_t j = k0; j < k1; j += 2) {
        const void *r0 = NULL, *r1 = NULL;
        if (j < L) r0 = (const char *)vh + ((btab[j / bs] * bs + j % bs) * D) * es;
        if (j + 1 < L) r1 = (const char *)vh + ((btab[(j + 1) / bs] * bs + (j + 1) % bs) * D) * es;
        if (r0) pack_values(r0, r1, D, T, vp + (j / 2) * D);
        else memset(vp + (j / 2) * D, 0, D * sizeof(uint32_t));
    }
}

/* Widen a bf16 in the low (hi = 0) or high half of 32-bit lanes to fp32 */
static inline __m256 bf_lo(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
static inline __m256 bf_hi(__m256i x) { return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000))); }

static inline float bf16_float(uint32_t b) {
    uint32_t u = b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}


/* ---- AVX2 tile: the same rounded values, fp32 FMAs ----------------------------------------------- */

/* One row (MR = 1 here: the fallback keeps it short) against one tile; same math as tile512. */
static void tile_avx2(const uint32_t *q32, const int64_t *pos, const uint32_t *kp, const uint32_t *vp, int64_t t0,
                      int64_t D, float *o, float *m, float *l) {
    const int64_t D2 = D / 2;
    const int vis = visible(pos[0], t0);
    if (!vis) return;
    float s[KT] __attribute__((aligned(32)));
    for (int c = 0; c < KT / 8; c++) {         /* 8 keys a vector: group c / 2, lanes (c % 2) * 8 .. */
        __m256 a = _mm256_setzero_ps();
        const uint32_t *g = kp + (c / 2) * D2 * 16 + (c % 2) * 8;
        for (int64_t p = 0; p < D2; p++) {
            const __m256i kv = _mm256_loadu_si256((const __m256i *)(g + p * 16));
            const float q0 = bf16_float(q32[p] & 0xffffu), q1 = bf16_float(q32[p] >> 16);
            a = _mm256_fmadd_ps(_mm256_set1_ps(q0), bf_lo(kv), a);
            a = _mm256_fmadd_ps(_mm256_set1_ps(q1), bf_hi(kv), a);
        }
        _mm256_store_ps(s + 8 * c, a);
    }
    float tm = -INFINITY;
    for (int j = 0; j < vis; j++) tm = s[j] > tm ? s[j] : tm;
    const float mn = tm > m[0] ? tm : m[0], corr = exp2_1(m[0] - mn);
    float sum = 0.0f;
    uint32_t pw[KT];
    for (int j = 0; j < KT; j++) {
        const float p = j < vis ? exp2_1(s[j] - mn) : 0.0f;
        sum += p;
        pw[j] = bf16_bits(p);
    }
    l[0] = l[0] * corr + sum;
    m[0] = mn;
    for (int64_t d = 0; d < D; d += 8) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(o + d), _mm256_set1_ps(corr));
        for (int jp = 0; jp < (vis + 1) / 2; jp++) {
            const __m256i vv = _mm256_loadu_si256((const __m256i *)(vp + jp * D + d));
            a = _mm256_fmadd_ps(_mm256_set1_ps(bf16_float(pw[2 * jp])), bf_lo(vv), a);
            a = _mm256_fmadd_ps(_mm256_set1_ps(bf16_float(pw[2 * jp + 1])), bf_hi(vv), a);
        }
        _mm256_storeu_ps(o + d, a);
    }
}

/* ---- one unit: a KV head's G query heads at TP consecutive positions ----------------------------- */

static void run_unit(const float *q, int64_t qs, int64_t h, int64_t G, int64_t i0, int64_t TP, int64_t L, int64_t n,
                     int64_t D, float qscale, const uint32_t *kp, const uint32_t *vp, float *out, int64_t os,
                     const LkvPrefillTile *tiles, uint32_t *q32, float *o, float *m, float *l, int64_t *pos) {
    const int64_t D2 = D / 2, R = TP * G;
    for (int64_t ip = 0; ip < TP; ip++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = ip * G + g;
            const float *qr = q + (i0 + ip) * qs + (h * G + g) * D;
            for (int64_t p = 0; p < D2; p++)
                q32[r * D2 + p] = bf16_bits(qr[2 * p] * qscale) | bf16_bits(qr[2 * p + 1] * qscale) << 16;
            pos[r] = L - n + i0 + ip;
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
    memset(o, 0, (size_t)(R * D) * sizeof(float));
    const int64_t kend = pos[R - 1] + 1;
    for (int64_t t0 = 0; t0 < kend; t0 += KT) {
        const uint32_t *kt = kp + (t0 / 16) * D2 * 16, *vt = vp + (t0 / 2) * D;
        if (tiles) {
            for (int64_t r0 = 0; r0 < R; r0 += MR) {
                const int nr = R - r0 < MR ? (int)(R - r0) : MR;
                if (pos[r0 + nr - 1] < t0) continue;          /* every row of the tile is before it */
                tiles[nr](q32 + r0 * D2, pos + r0, kt, vt, t0, D, o + r0 * D, m + r0, l + r0);
            }
        } else {
            for (int64_t r = 0; r < R; r++)
                tile_avx2(q32 + r * D2, pos + r, kt, vt, t0, D, o + r * D, m + r, l + r);
        }
    }
    for (int64_t ip = 0; ip < TP; ip++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = ip * G + g;
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            float *dst = out + (i0 + ip) * os + (h * G + g) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
        }
}

/* q [n, H, D] fp32 at row stride qs; k, v: one layer of the pool, KV head h at k + h * hs elements
 * ([NB, bs, D]), of storage kv_dtype; btab: the sequence's blocks (ceil(L / bs) of them); out
 * [n, H, D] fp32 at row stride os. tiles: lkv_prefill_bf16_tiles() (the AVX512_BF16 path: the
 * AVX-512 library's, which gives it only where the CPU has the units), or NULL (the AVX2 path).
 * D even, a multiple of 16, <= 512. Returns LKV_OK, LKV_ERR_NOMEM, LKV_ERR_ARG. */
int lkv_prefill_attention(const float *q, int64_t qs, const void *k, const void *v, int64_t hs, const int64_t *btab,
                          int64_t bs, int64_t L, int64_t n, int64_t H, int64_t KVH, int64_t D, float scale,
                          float *out, int64_t os, int nthreads, int kv_dtype, const LkvPrefillTile *tiles) {
    if (n <= 0 || L < n || KVH <= 0 || H % KVH || D <= 0 || D % 16 || D > 512 || bs <= 0
        || kv_dtype < LKV_KV_F32 || kv_dtype > LKV_KV_BF16)
        return LKV_ERR_ARG;
    const int64_t G = H / KVH, D2 = D / 2, Lp = (L + KT - 1) / KT * KT, es = kv_dtype == LKV_KV_F32 ? 4 : 2;
    const int64_t TP = G >= ROWS ? 1 : ROWS / G, units_h = (n + TP - 1) / TP, units = units_h * KVH;
    uint32_t *kp = malloc((size_t)(KVH * Lp * D2) * sizeof(uint32_t));
    uint32_t *vp = malloc((size_t)(KVH * Lp / 2 * D) * sizeof(uint32_t));
    int failed = kp == NULL || vp == NULL;
    const float qscale = scale * LOG2E;
    if (!failed) {
#pragma omp parallel num_threads(nthreads > 1 ? nthreads : 1) if (nthreads > 1) reduction(| : failed)
        {
            /* packing: (head, 64-key range) pieces */
            const int64_t pieces = Lp / KT;
#pragma omp for schedule(static)
            for (int64_t u = 0; u < KVH * pieces; u++) {
                const int64_t h = u / pieces, k0 = (u % pieces) * KT;
                const char *kh = (const char *)k + h * hs * es, *vh = (const char *)v + h * hs * es;
                pack_range(kh, vh, btab, bs, L, D, kv_dtype, k0, k0 + KT, kp + h * Lp * D2, vp + h * Lp / 2 * D);
            }
            const int64_t R = TP * G;
            uint32_t *q32 = malloc((size_t)(R * D2) * sizeof(uint32_t));
            float *o = malloc((size_t)(R * D + 2 * R) * sizeof(float));
            int64_t *pos = malloc((size_t)R * sizeof(int64_t));
            if (q32 == NULL || o == NULL || pos == NULL) failed = 1;
            /* the latest positions (the most keys) first: the dynamic schedule then ends evenly */
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < units; w++) {
                if (q32 == NULL || o == NULL || pos == NULL) continue;
                const int64_t u = units - 1 - w, h = u % KVH, i0 = (u / KVH) * TP;
                const int64_t tp = n - i0 < TP ? n - i0 : TP;
                run_unit(q, qs, h, G, i0, tp, L, n, D, qscale, kp + h * Lp * D2, vp + h * Lp / 2 * D, out, os,
                         tiles, q32, o, o + R * D, o + R * D + R, pos);
            }
            free(q32);
            free(o);
            free(pos);
        }
    }
    free(kp);
    free(vp);
    return failed ? LKV_ERR_NOMEM : LKV_OK;
}
