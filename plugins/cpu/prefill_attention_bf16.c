/* The AVX512_BF16 register tiles of prefill attention (prefill_attention.c is the driver): the AVX-512
 * library's part of it. The base library's lkv_prefill_attention takes this table (handed over by
 * Python from lkv_prefill_bf16_tiles) and calls a tile per (rows, key tile); without it, its AVX2
 * tile. Numerics: prefill_attention.c's header. */
#include "common.h"
#include "lkv_abi.h"
#include "prefill_attention.h"

LKV_AVX512_BF16 static inline __m512 exp2_512(__m512 x) {       /* x <= 0 or -inf; ~1e-7 relative */
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);                  /* [-0.5, 0.5] */
    __m512 y = _mm512_set1_ps(1.5403530e-4f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504109e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022651e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* o[r][dc .. dc + 16 NC) = o * corr[r] + sum over key pairs of the bf16 weights pw[r] x the value pairs */
LKV_AVX512_BF16 static inline __attribute__((always_inline)) void pv512(
        const uint16_t (*pw)[KT], int NR, const float *corr, const uint32_t *vp, int npairs, int64_t dc, int64_t D,
        float *o, int NC) {
    __m512 acc[MR][4];
    for (int r = 0; r < NR; r++) {
        const __m512 cv = _mm512_set1_ps(corr[r]);
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + dc + 16 * c), cv);
    }
    for (int jp = 0; jp < npairs; jp++) {
        __m512bh v[4];
        for (int c = 0; c < NC; c++) v[c] = (__m512bh)_mm512_loadu_si512(vp + jp * D + dc + 16 * c);
        for (int r = 0; r < NR; r++) {
            uint32_t pp;
            memcpy(&pp, pw[r] + 2 * jp, 4);
            const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp);
            for (int c = 0; c < NC; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, v[c]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(o + r * D + dc + 16 * c, acc[r][c]);
}

/* One register tile: NR (<= MR) rows, each D/2 bf16 pairs at q32 + r * D2, against the KT keys of
 * the tile at t0 (kp: its 4 groups, vp: its KT / 2 value pairs), updating o [NR][D], m, l. */
LKV_AVX512_BF16 static inline __attribute__((always_inline)) void tile512(
        const uint32_t *q32, int NR, const int64_t *pos, const uint32_t *kp, const uint32_t *vp, int64_t t0,
        int64_t D, float *o, float *m, float *l) {
    const int64_t D2 = D / 2;
    __m512 s[MR][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < 4; c++) s[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D2; p++) {
        __m512bh k[4];
        for (int c = 0; c < 4; c++) k[c] = (__m512bh)_mm512_loadu_si512(kp + (c * D2 + p) * 16);
        for (int r = 0; r < NR; r++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q32[r * D2 + p]);
            for (int c = 0; c < 4; c++) s[r][c] = _mm512_dpbf16_ps(s[r][c], qb, k[c]);
        }
    }
    /* online softmax; the weights rounded to bf16 into pw [NR][KT] */
    uint16_t pw[MR][KT] __attribute__((aligned(64)));
    float corr[MR];
    int kmax = 0;
    for (int r = 0; r < NR; r++) {
        const int vis = visible(pos[r], t0);
        kmax = vis > kmax ? vis : kmax;
        __mmask16 mk[4];
        for (int c = 0; c < 4; c++) {
            const int cnt = vis - 16 * c;
            mk[c] = cnt >= 16 ? (__mmask16)0xffff : cnt <= 0 ? (__mmask16)0 : (__mmask16)((1u << cnt) - 1);
            s[r][c] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mk[c], s[r][c]);
        }
        const float tm = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]),
                                                            _mm512_max_ps(s[r][2], s[r][3])));
        const float mn = tm > m[r] ? tm : m[r];
        corr[r] = vis ? exp2_1(m[r] - mn) : 1.0f;           /* m = -inf at the first tile: 0 */
        const __m512 mv = _mm512_set1_ps(mn);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < 4; c += 2) {
            const __m512 p0 = _mm512_maskz_mov_ps(mk[c], exp2_512(_mm512_sub_ps(s[r][c], mv)));
            const __m512 p1 = _mm512_maskz_mov_ps(mk[c + 1], exp2_512(_mm512_sub_ps(s[r][c + 1], mv)));
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            _mm512_store_si512((__m512i *)(pw[r] + 16 * c), (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        if (vis) {
            l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(sum);
            m[r] = mn;
        }
    }
    /* o = o * corr + P V over the visible key pairs, 64 columns at a time */
    const int npairs = (kmax + 1) / 2;
    for (int64_t dc = 0; dc < D; dc += 64) {
        if (D - dc >= 64) pv512(pw, NR, corr, vp, npairs, dc, D, o, 4);
        else pv512(pw, NR, corr, vp, npairs, dc, D, o, (int)((D - dc) / 16));
    }
}

#define TILE512(NRC) LKV_AVX512_BF16 static void tile512_##NRC(const uint32_t *q32, const int64_t *pos, \
    const uint32_t *kp, const uint32_t *vp, int64_t t0, int64_t D, float *o, float *m, float *l) { \
    tile512(q32, NRC, pos, kp, vp, t0, D, o, m, l); }
TILE512(1) TILE512(2) TILE512(3) TILE512(4) TILE512(5) TILE512(6)
#undef TILE512
static const LkvPrefillTile TILES512[LKV_PREFILL_TILES] = {NULL, tile512_1, tile512_2, tile512_3, tile512_4,
                                                            tile512_5, tile512_6};

/* The AVX512_BF16 tiles (entry nr: nr rows, 1 <= nr <= MR) for lkv_prefill_attention, or NULL where
 * the CPU lacks AVX512_BF16 (gemm.c's check, asked of the CPU once): nothing here runs then. */
const LkvPrefillTile *lkv_prefill_bf16_tiles(void) { return lkv_gemm_supported() & 1 ? TILES512 : NULL; }
