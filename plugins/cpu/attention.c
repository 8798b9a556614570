/* lkv_attention: lookahead_attention's math (plugins/attention.py). Per (sequence, KV head) the
 * R*G query rows of the GQA group score the visible gathered keys and the visible extra keys,
 * softmax in fp32, and sum the values; masked keys are never read. Also dense decode attention
 * (runtime/attention_dense.py: one row, every key visible, no extras). */
#include "common.h"

/* Scores of NR (<= 3, a constant once inlined) query rows against four key rows: twelve
 * independent FMA chains over D with the query chunks in registers and each key chunk loaded
 * once (16 ymm registers in all), then a hadd reduction per row giving its four scores. */
static inline __attribute__((always_inline)) void qk_block(const float *q, int NR, const float *const *kr,
                                                           int64_t D, float *s, int64_t ss) {
    __m256 a[3][4];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 qv[3];
        for (int r = 0; r < NR; r++) qv[r] = _mm256_loadu_ps(q + r * D + d);
        for (int j = 0; j < 4; j++) {
            const __m256 kv = _mm256_loadu_ps(kr[j] + d);
            for (int r = 0; r < NR; r++) a[r][j] = _mm256_fmadd_ps(qv[r], kv, a[r][j]);
        }
    }
    for (int r = 0; r < NR; r++) {
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
        _mm_storeu_ps(s + r * ss, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
}

/* acc rows o[r] (r < NR <= 3) += sum_i p[r * ps + i] * v_i over tn value rows, 32 columns from d:
 * twelve accumulators in registers across the tile, three broadcasts and four loads per key. The
 * same columns of the next tile's rows vb + nvis[i] * D (i < tnn) are prefetched along the way. */
static inline __attribute__((always_inline)) void pv_block(const float *p, int64_t ps, int NR, const float *const *vr,
                                                           int tn, int64_t d, float *o, int64_t D,
                                                           const float *vb, const int32_t *nvis, int tnn) {
    __m256 x[3][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < 4; c++) x[r][c] = _mm256_loadu_ps(o + r * D + d + 8 * c);
    for (int i = 0; i < tn; i++) {
        __m256 w[3];
        for (int r = 0; r < NR; r++) w[r] = _mm256_broadcast_ss(p + r * ps + i);
        const float *v = vr[i] + d;
        if (i < tnn) {                           /* one row a key, spread out: a burst would stall */
            const char *pf = (const char *)(vb + (int64_t)nvis[i] * D + d);
            _mm_prefetch(pf, _MM_HINT_T0); _mm_prefetch(pf + 64, _MM_HINT_T0);
        }
        for (int c = 0; c < 4; c++) {
            const __m256 vv = _mm256_loadu_ps(v + 8 * c);
            for (int r = 0; r < NR; r++) x[r][c] = _mm256_fmadd_ps(w[r], vv, x[r][c]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(o + r * D + d + 8 * c, x[r][c]);
}

static float dot1(const float *a, const float *b, int64_t D) {
    __m256 s = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s);
    return hsum(s);
}

/* Software prefetch distances. The hardware prefetchers stop at 4 KiB pages (16 rows at D = 64)
 * and the FMA work keeps demand loads from running ahead, so from DRAM the reads would not overlap
 * the arithmetic without them. */
#define QK_PF 16     /* keys ahead in Q K^T */
#define PV_TILE 32   /* keys per P @ V tile, which stays in L1 while the next one is prefetched */

/* One (sequence, KV head). qs [RG, D] (scaled), keys/values at kb/vb with row stride D, visible
 * key ids vis[nv]; extras xk/xv [E] rows at strides xks/xvs, xvis[r * E + e]; out rows at orow[rg].
 * Scratch: s [RG, nv8], acc [RG, D]. D is a multiple of 32. */
static void attend_one(const float *qs, int RG, int G, const float *kb, const float *vb, const int32_t *vis,
                       int64_t nv, const float *xk, int64_t xks, const float *xv, int64_t xvs, const uint8_t *xvis, int64_t E,
                       int64_t D, float *const *orow, float *s, int64_t nv8, float *acc) {
    /* Q K^T, four keys at a time (past nv the last key repeats: its score is a real one, so the
     * padded row max is unchanged, and the padding is dropped below); the four key rows are read
     * from memory once and from L1 by the other row groups, the rows QK_PF keys on prefetched */
    for (int64_t t = 0; t < nv; t += 4) {
        const float *kr[4];
        for (int i = 0; i < 4; i++) kr[i] = kb + (int64_t)vis[t + i < nv ? t + i : nv - 1] * D;
        if (t + QK_PF + 4 <= nv)
            for (int i = 0; i < 4; i++) {
                const char *pf = (const char *)(kb + (int64_t)vis[t + QK_PF + i] * D);
                for (int64_t c = 0; c < D * 4; c += 64) _mm_prefetch(pf + c, _MM_HINT_T0);
            }
        int rg = 0;
        for (; rg + 3 <= RG; rg += 3) qk_block(qs + rg * D, 3, kr, D, s + rg * nv8 + t, nv8);
        if (RG - rg == 2) qk_block(qs + rg * D, 2, kr, D, s + rg * nv8 + t, nv8);
        else if (RG - rg == 1) qk_block(qs + rg * D, 1, kr, D, s + rg * nv8 + t, nv8);
    }
    const int64_t nv4 = (nv + 3) & ~(int64_t)3;
    float xp[64 * 8], inv[64];                           /* extra keys' weights, 1 / denominators */
    for (int rg = 0; rg < RG; rg++) {
        const int r = rg / G;
        float *sr = s + rg * nv8, *xe = xp + rg * 8;
        __m128 m4 = _mm_set1_ps(-INFINITY);
        for (int64_t j = 0; j < nv4; j += 4) m4 = _mm_max_ps(m4, _mm_loadu_ps(sr + j));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
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
    /* P @ V over key tiles that stay in L1 while every row group and column block passes over
     * them, so that V is read from memory once; the running sums live in `acc` [RG, D] */
    for (int64_t i = 0; i < RG * D; i++) acc[i] = 0.0f;
    for (int64_t t = 0; t < nv; t += PV_TILE) {
        const int tn = nv - t < PV_TILE ? (int)(nv - t) : PV_TILE;
        const float *vr[PV_TILE];
        for (int i = 0; i < tn; i++) vr[i] = vb + (int64_t)vis[t + i] * D;
        /* the next tile's rows, prefetched by the first row group's passes */
        const int64_t left = nv - t - PV_TILE;
        const int tnn = left < 0 ? 0 : left < PV_TILE ? (int)left : PV_TILE;
        const int32_t *nvis = vis + t + PV_TILE;
        int rg = 0;
        for (; rg + 3 <= RG; rg += 3)
            for (int64_t d = 0; d < D; d += 32)
                pv_block(s + rg * nv8 + t, nv8, 3, vr, tn, d, acc + rg * D, D, vb, nvis, rg == 0 ? tnn : 0);
        for (int64_t d = 0; d < D; d += 32) {
            if (RG - rg == 2) pv_block(s + rg * nv8 + t, nv8, 2, vr, tn, d, acc + rg * D, D, vb, nvis, rg == 0 ? tnn : 0);
            else if (RG - rg == 1) pv_block(s + rg * nv8 + t, nv8, 1, vr, tn, d, acc + rg * D, D, vb, nvis, rg == 0 ? tnn : 0);
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

/* The visible key ids of one mask row; 32 bytes at a time, a run of all-visible bytes (the usual
 * case) written as consecutive ids without a per-key branch. Returns their number. */
static int64_t visible_ids(const uint8_t *mk, int64_t N, int32_t *vis) {
    int64_t nv = 0, n = 0;
    const __m256i step = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (; n + 32 <= N; n += 32) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(mk + n));
        if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(b, _mm256_setzero_si256())) == 0) {
            for (int i = 0; i < 32; i += 8)
                _mm256_storeu_si256((__m256i *)(vis + nv + i), _mm256_add_epi32(step, _mm256_set1_epi32((int32_t)(n + i))));
            nv += 32;
        } else {
            for (int i = 0; i < 32; i++) { vis[nv] = (int32_t)(n + i); nv += mk[n + i] != 0; }
        }
    }
    for (; n < N; n++) { vis[nv] = (int32_t)n; nv += mk[n] != 0; }
    return nv;
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
        float *s = malloc(sizeof(float) * (RG * nv8 + 2 * RG * D + 8));
        int32_t *vis = malloc(sizeof(int32_t) * (N + 1));
        if (!s || !vis) failed = 1;
        else {
            float *qs = s + RG * nv8;
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * KVH; bh++) {
                const int64_t b = bh / KVH, h = bh % KVH;
                const uint8_t *mk = kv_mask + bh * N;
                const int64_t nv = visible_ids(mk, N, vis);
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
