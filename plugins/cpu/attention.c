/* lkv_attention: lookahead_attention's math (plugins/attention.py). Per (sequence, KV head) the
 * R*G query rows of the GQA group score the visible gathered keys and the visible extra keys,
 * softmax in fp32, and sum the values; masked keys are never read. Also dense decode attention
 * (runtime/attention_dense.py: one row, every key visible, no extras). */
#include "common.h"

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
