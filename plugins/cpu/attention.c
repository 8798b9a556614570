/* lkv_attention: lookahead_attention's math (plugins/attention.py). Per (sequence, KV head) the
 * R*G query rows of the GQA group score the visible gathered keys and the visible extra keys,
 * softmax in fp32, and sum the values; masked keys are never read. Also dense decode attention
 * (runtime/attention_dense.py: one row, every key visible, no extras).
 *
 * The gathered K/V may be stored as fp32, fp16 or bf16 (kv_dtype, KV_*): 16-bit rows are widened
 * to fp32 as they are loaded (F16C's vcvtph2ps; bf16 by a shift), so a key costs half the bytes
 * and the math is the fp32 math on the widened values. Queries, extra keys and the output are
 * fp32. Each storage type is its own instantiation of the same inlined code (T a constant). */
#include "common.h"
#include "lkv_abi.h"

/* eight K/V elements from element i of a row of storage type T, as fp32 (common.h) */
#define ld_kv lkv_load8

/* element i of K/V storage of type T */
static inline __attribute__((always_inline)) const void *kv_at(const void *base, int64_t i, int T) {
    return (const char *)base + i * (T == LKV_KV_F32 ? 4 : 2);
}

/* Scores of NR (<= 3, a constant once inlined) query rows against four key rows: twelve
 * independent FMA chains over D with the query chunks in registers and each key chunk loaded
 * once (16 ymm registers in all), then a hadd reduction per row giving its four scores. */
static inline __attribute__((always_inline)) void qk_block(const float *q, int NR, const void *const *kr,
                                                           int64_t D, float *s, int64_t ss, int T) {
    __m256 a[3][4];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 qv[3];
        for (int r = 0; r < NR; r++) qv[r] = _mm256_loadu_ps(q + r * D + d);
        for (int j = 0; j < 4; j++) {
            const __m256 kv = ld_kv(kr[j], d, T);
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
static inline __attribute__((always_inline)) void pv_block(const float *p, int64_t ps, int NR, const void *const *vr,
                                                           int tn, int64_t d, float *o, int64_t D,
                                                           const void *vb, const int32_t *nvis, int tnn, int T) {
    __m256 x[3][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < 4; c++) x[r][c] = _mm256_loadu_ps(o + r * D + d + 8 * c);
    for (int i = 0; i < tn; i++) {
        __m256 w[3];
        for (int r = 0; r < NR; r++) w[r] = _mm256_broadcast_ss(p + r * ps + i);
        if (i < tnn) {                           /* one row a key, spread out: a burst would stall */
            const char *pf = (const char *)kv_at(vb, (int64_t)nvis[i] * D + d, T);
            _mm_prefetch(pf, _MM_HINT_T0);
            if (T == LKV_KV_F32) _mm_prefetch(pf + 64, _MM_HINT_T0);    /* 32 columns: 128 or 64 bytes */
        }
        for (int c = 0; c < 4; c++) {
            const __m256 vv = ld_kv(vr[i], d + 8 * c, T);
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
#define QK_PF 64     /* keys ahead in Q K^T: 4 blocks of 16, for a sparse mask's scattered blocks (16
                      * was one block ahead, shorter than a DRAM miss; at 8K x 4, 2 threads, every
                      * layer's K/V from memory: dense 19.8-23.0 -> 17.7 ms a step, top-K masked
                      * 10.9-11.2 -> 9.5: experiments/attention_sparsity.py) */
#define PV_TILE 32   /* keys per P @ V tile, which stays in L1 while the next one is prefetched */

/* One (sequence, KV head), or one key range of it. qs [RG, D] (scaled), keys/values at kb/vb with
 * row stride D, visible key ids vis[nv]; extras xk/xv [E] rows at strides xks/xvs, xvis[r * E + e];
 * out rows at orow[rg]. With ml, row rg's softmax max and denominator go to ml[rg * mls] and
 * ml[rg * mls + 1] (to merge key ranges: attention_impl). Scratch: s [RG, nv8], acc [RG, D]. D is a
 * multiple of 32. */
static inline __attribute__((always_inline)) void attend_one(
        const float *qs, int RG, int G, const void *kb, const void *vb, const int32_t *vis, int64_t nv, const float *xk,
        int64_t xks, const float *xv, int64_t xvs, const uint8_t *xvis, int64_t E, int64_t D, float *const *orow,
        float *s, int64_t nv8, float *acc, float *ml, int64_t mls, int T) {
    /* Q K^T, four keys at a time (past nv the last key repeats: its score is a real one, so the
     * padded row max is unchanged, and the padding is dropped below); the four key rows are read
     * from memory once and from L1 by the other row groups, the rows QK_PF keys on prefetched */
    for (int64_t t = 0; t < nv; t += 4) {
        const void *kr[4];
        for (int i = 0; i < 4; i++) kr[i] = kv_at(kb, (int64_t)vis[t + i < nv ? t + i : nv - 1] * D, T);
        if (t + QK_PF + 4 <= nv)
            for (int i = 0; i < 4; i++) {
                const char *pf = (const char *)kv_at(kb, (int64_t)vis[t + QK_PF + i] * D, T);
                for (int64_t c = 0; c < D * (T == LKV_KV_F32 ? 4 : 2); c += 64) _mm_prefetch(pf + c, _MM_HINT_T0);
            }
        int rg = 0;
        for (; rg + 3 <= RG; rg += 3) qk_block(qs + rg * D, 3, kr, D, s + rg * nv8 + t, nv8, T);
        if (RG - rg == 2) qk_block(qs + rg * D, 2, kr, D, s + rg * nv8 + t, nv8, T);
        else if (RG - rg == 1) qk_block(qs + rg * D, 1, kr, D, s + rg * nv8 + t, nv8, T);
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
        if (ml) { ml[rg * mls] = m; ml[rg * mls + 1] = l; }
    }
    /* P @ V over key tiles that stay in L1 while every row group and column block passes over
     * them, so that V is read from memory once; the running sums live in `acc` [RG, D] */
    for (int64_t i = 0; i < RG * D; i++) acc[i] = 0.0f;
    for (int64_t t = 0; t < nv; t += PV_TILE) {
        const int tn = nv - t < PV_TILE ? (int)(nv - t) : PV_TILE;
        const void *vr[PV_TILE];
        for (int i = 0; i < tn; i++) vr[i] = kv_at(vb, (int64_t)vis[t + i] * D, T);
        /* the next tile's rows, prefetched by the first row group's passes */
        const int64_t left = nv - t - PV_TILE;
        const int tnn = left < 0 ? 0 : left < PV_TILE ? (int)left : PV_TILE;
        const int32_t *nvis = vis + t + PV_TILE;
        int rg = 0;
        for (; rg + 3 <= RG; rg += 3)
            for (int64_t d = 0; d < D; d += 32)
                pv_block(s + rg * nv8 + t, nv8, 3, vr, tn, d, acc + rg * D, D, vb, nvis, rg == 0 ? tnn : 0, T);
        for (int64_t d = 0; d < D; d += 32) {
            if (RG - rg == 2) pv_block(s + rg * nv8 + t, nv8, 2, vr, tn, d, acc + rg * D, D, vb, nvis, rg == 0 ? tnn : 0, T);
            else if (RG - rg == 1) pv_block(s + rg * nv8 + t, nv8, 1, vr, tn, d, acc + rg * D, D, vb, nvis, rg == 0 ? tnn : 0, T);
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

/* attend_one per K/V storage type: one copy of the loops each, the loads and prefetches their own */
#define ATTEND_ARGS const float *qs, int RG, int G, const void *kb, const void *vb, const int32_t *vis, int64_t nv, \
    const float *xk, int64_t xks, const float *xv, int64_t xvs, const uint8_t *xvis, int64_t E, int64_t D,          \
    float *const *orow, float *s, int64_t nv8, float *acc, float *ml, int64_t mls
#define ATTEND_CALL(T) attend_one(qs, RG, G, kb, vb, vis, nv, xk, xks, xv, xvs, xvis, E, D, orow, s, nv8, acc, ml, mls, T)
static void attend_f32(ATTEND_ARGS) { ATTEND_CALL(LKV_KV_F32); }
static void attend_f16(ATTEND_ARGS) { ATTEND_CALL(LKV_KV_F16); }
static void attend_bf16(ATTEND_ARGS) { ATTEND_CALL(LKV_KV_BF16); }
#undef ATTEND_ARGS
#undef ATTEND_CALL

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

/* Key ranges per (sequence, KV head) when there are fewer such units than 2 x threads (batch 1:
 * three units on two threads would run 2:1): the smallest split >= 2 x threads / units that makes
 * the range count a multiple of the threads, each range >= MIN_SPLIT keys, at most MAX_SPLIT. */
#define MIN_SPLIT 256
#define MAX_SPLIT 16
static int64_t key_splits(int64_t units, int64_t N, int nthreads) {
    if (nthreads <= 1 || units >= 2 * nthreads || N < 2 * MIN_SPLIT) return 1;
    const int64_t cap = N / MIN_SPLIT < MAX_SPLIT ? N / MIN_SPLIT : MAX_SPLIT;
    int64_t c = (2 * nthreads + units - 1) / units;
    while (c < cap && (units * c) % nthreads) c++;
    return c < cap ? c : cap;
}

/* Sequence b's visible key ids vis[nv] (key n0 + vis[i] of its logical order) as rows of its head's
 * plane of a paged pool: key n lies in block btab[n / bs] at offset n % bs. The order is kept, so
 * the attention is the same sum as over a run of blocks. */
static void page_ids(int32_t *vis, int64_t nv, int64_t n0, const int64_t *btab, int64_t bs) {
    const int sh = __builtin_ctzll((unsigned long long)bs);      /* block sizes are powers of two */
    const int64_t low = bs - 1;
    for (int64_t i = 0; i < nv; i++) {
        const int64_t n = n0 + vis[i];
        vis[i] = (int32_t)((btab[n >> sh] << sh) | (n & low));
    }
}

/* The shared body of the entries: sequence b's K/V rows start at k + base(b), base(b) = boff[b]
 * when boff is given, else b * ksb; with btab (a block table per sequence, row stride bts, and per
 * KV head, stride bth: 0 where the heads share it), its key n of head h is row
 * btab[b * bts + h * bth + n / bs] * bs + n % bs of the head's plane at k + h * ksh instead. With C > 1 key ranges, each (unit, range) is attended on its
 * own (the extra keys go with range 0) into part [units * C, RG, 2 + D] = (max, denominator,
 * normalised row), and the ranges are merged: out = sum_c l_c e^(m_c - M) o_c / sum_c l_c e^(m_c - M). */
static int attention_impl(const float *q, const void *k, const void *v, int kv_dtype, const int64_t *boff, int64_t ksb,
                          const int64_t *btab, int64_t bts, int64_t bth, int64_t bs, int64_t ksh, const uint8_t *kv_mask, const float *kx, int64_t xksb, int64_t xksh,
                          int64_t xkse, const float *vx, int64_t xvsb, int64_t xvsh, int64_t xvse,
                          const uint8_t *extra_mask, float *out, int64_t B, int64_t R, int64_t H, int64_t KVH,
                          int64_t N, int64_t E, int64_t D, float scale, int nthreads) {
    const int G = (int)(H / KVH), RG = (int)(R * G);
    const int64_t C = key_splits(B * KVH, N, nthreads);
    const int64_t CL = C > 1 ? (((N + C - 1) / C + 31) & ~(int64_t)31) : N;   /* keys per range */
    const int64_t nv8 = (CL + 7) & ~(int64_t)7, mls = 2 + D;
    float *part = C > 1 ? malloc(sizeof(float) * B * KVH * C * RG * mls) : NULL;
    if (C > 1 && !part) return LKV_ERR_NOMEM;
    int failed = 0;
#pragma omp parallel num_threads(nthreads > 1 ? nthreads : 1) if (nthreads > 1) reduction(| : failed)
    {
        float *s = malloc(sizeof(float) * (RG * nv8 + 2 * RG * D + 8));
        int32_t *vis = malloc(sizeof(int32_t) * (CL + 1));
        if (!s || !vis) failed = 1;
        else {
            float *qs = s + RG * nv8;
#pragma omp for schedule(static)
            for (int64_t u = 0; u < B * KVH * C; u++) {
                const int64_t bh = u / C, c = u % C, b = bh / KVH, h = bh % KVH;
                const int64_t n0 = c * CL, n1 = n0 + CL < N ? n0 + CL : N;
                const int64_t nv = n1 > n0 ? visible_ids(kv_mask + bh * N + n0, n1 - n0, vis) : 0;
                if (btab) page_ids(vis, nv, n0, btab + b * bts + h * bth, bs);
                float *orow[64], *ml = C > 1 ? part + u * RG * mls : NULL;
                for (int rg = 0; rg < RG; rg++) {
                    const int r = rg / G, g = rg % G;
                    const float *qr = q + ((b * R + r) * H + h * G + g) * D;
                    for (int64_t d = 0; d < D; d++) qs[rg * D + d] = qr[d] * scale;
                    orow[rg] = ml ? ml + rg * mls + 2 : out + ((b * R + r) * H + h * G + g) * D;
                }
                const int64_t kofs = btab ? h * ksh : (boff ? boff[b] : b * ksb) + h * ksh + n0 * D;
                void (*attend)(const float *, int, int, const void *, const void *, const int32_t *, int64_t,
                               const float *, int64_t, const float *, int64_t, const uint8_t *, int64_t, int64_t,
                               float *const *, float *, int64_t, float *, float *, int64_t) =
                    kv_dtype == LKV_KV_F16 ? attend_f16 : kv_dtype == LKV_KV_BF16 ? attend_bf16 : attend_f32;
                attend(qs, RG, G, kv_at(k, kofs, kv_dtype), kv_at(v, kofs, kv_dtype), vis, nv,
                       kx + b * xksb + h * xksh, xkse, vx + b * xvsb + h * xvsh, xvse, extra_mask + b * R * E,
                       c == 0 ? E : 0, D, orow, s, nv8, qs + RG * D, ml, mls);
            }
            if (C > 1) {
#pragma omp for schedule(static)
                for (int64_t bh = 0; bh < B * KVH; bh++) {
                    const int64_t b = bh / KVH, h = bh % KVH;
                    for (int rg = 0; rg < RG; rg++) {
                        const int r = rg / G, g = rg % G;
                        float *o = out + ((b * R + r) * H + h * G + g) * D, m = -INFINITY, wsum = 0.0f;
                        for (int64_t c = 0; c < C; c++) {
                            const float *p = part + ((bh * C + c) * RG + rg) * mls;
                            if (p[1] > 0.0f && p[0] > m) m = p[0];
                        }
                        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
                        for (int64_t c = 0; c < C; c++) {
                            const float *p = part + ((bh * C + c) * RG + rg) * mls;
                            if (p[1] <= 0.0f) continue;                 /* the range saw no key */
                            const float w = p[1] * expf(p[0] - m);
                            wsum += w;
                            for (int64_t d = 0; d < D; d++) o[d] += w * p[2 + d];
                        }
                        const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
                        for (int64_t d = 0; d < D; d++) o[d] *= inv;
                    }
                }
            }
        }
        free(s);
        free(vis);
    }
    free(part);
    return failed ? LKV_ERR_NOMEM : LKV_OK;
}

/* The entries' argument checks: LKV_ERR_ARG for a kv_dtype not among LKV_KV_* or a head count
 * that is not a multiple of KVH, LKV_ERR_LIMIT past the scratch that lives on the stack (extra
 * keys, query rows per KV head). */
static int check_args(int kv_dtype, int64_t R, int64_t H, int64_t KVH, int64_t E) {
    if (kv_dtype < LKV_KV_F32 || kv_dtype > LKV_KV_BF16 || KVH <= 0 || H % KVH) return LKV_ERR_ARG;
    if (E > LKV_MAX_EXTRA_KEYS || R * (H / KVH) > LKV_MAX_GROUP_ROWS) return LKV_ERR_LIMIT;
    return LKV_OK;
}

/* q, out [B, R, H, D] contiguous fp32; k, v rows of D elements of type kv_dtype (LKV_KV_F32, LKV_KV_F16,
 * LKV_KV_BF16) at k + b*ksb + h*ksh + n*D (same strides for v, in elements); kv_mask [B, KVH, N]
 * bytes; k_extra rows (fp32) at kx + b*xksb + h*xksh + e*xkse (v_extra likewise with its own
 * strides); extra_mask [B, R, E] bytes (E <= LKV_MAX_EXTRA_KEYS). Returns LKV_OK, LKV_ERR_NOMEM
 * when scratch memory ran out, or check_args' code. */
int lkv_attention(const float *q, const void *k, const void *v, int64_t ksb, int64_t ksh,
                  const uint8_t *kv_mask, const float *kx, int64_t xksb, int64_t xksh, int64_t xkse,
                  const float *vx, int64_t xvsb, int64_t xvsh, int64_t xvse, const uint8_t *extra_mask, float *out, int64_t B, int64_t R, int64_t H,
                  int64_t KVH, int64_t N, int64_t E, int64_t D, float scale, int nthreads, int kv_dtype) {
    const int rc = check_args(kv_dtype, R, H, KVH, E);
    if (rc != LKV_OK) return rc;
    return attention_impl(q, k, v, kv_dtype, NULL, ksb, NULL, 0, 0, 1, ksh, kv_mask, kx, xksb, xksh, xkse, vx, xvsb, xvsh, xvse,
                          extra_mask, out, B, R, H, KVH, N, E, D, scale, nthreads);
}

/* Dense decode attention of B sequences in one call (runtime/attention_dense.py): q, out [B, H, D]
 * contiguous fp32, one row each; sequence b's keys (kv_dtype, as lkv_attention) at k + boff[b] +
 * h*ksh + n*D elements (v alike), visible where kv_mask [B, KVH, N] says (its first lens[b]
 * keys); no extra keys. Returns as lkv_attention. */
int lkv_attention_paged(const float *q, const void *k, const void *v, const int64_t *boff, int64_t ksh,
                        const uint8_t *kv_mask, float *out, int64_t B, int64_t H, int64_t KVH, int64_t N,
                        int64_t D, float scale, int nthreads, int kv_dtype) {
    static const uint8_t no_extra[1] = {0};
    static const float no_key[1] = {0.0f};
    const int rc = check_args(kv_dtype, 1, H, KVH, 0);
    if (rc != LKV_OK) return rc;
    return attention_impl(q, k, v, kv_dtype, boff, 0, NULL, 0, 0, 1, ksh, kv_mask, no_key, 0, 0, 0, no_key, 0, 0, 0, no_extra, out,
                          B, 1, H, KVH, N, 0, D, scale, nthreads);
}

/* lkv_attention_paged over a paged pool: sequence b's key n in block btab[b * bts + n / bs] (at
 * offset n % bs) of its head's plane k + h * ksh, rows of D; btab covers its first
 * ceil(N_b / bs) blocks, N_b its visible keys' extent. The same sums as a run of those blocks. */
int lkv_attention_paged_table(const float *q, const void *k, const void *v, const int64_t *btab, int64_t bts,
                              int64_t bs, int64_t ksh, const uint8_t *kv_mask, float *out, int64_t B, int64_t H,
                              int64_t KVH, int64_t N, int64_t D, float scale, int nthreads, int kv_dtype) {
    static const uint8_t no_extra[1] = {0};
    static const float no_key[1] = {0.0f};
    const int rc = check_args(kv_dtype, 1, H, KVH, 0);
    if (rc != LKV_OK) return rc;
    return attention_impl(q, k, v, kv_dtype, NULL, 0, btab, bts, 0, bs, ksh, kv_mask, no_key, 0, 0, 0, no_key, 0, 0, 0,
                          no_extra, out, B, 1, H, KVH, N, 0, D, scale, nthreads);
}

/* lkv_attention over a paged pool with a block table per (sequence, KV head): q, out [B, R, H, D]
 * as lkv_attention; key n of sequence b and KV head h is row btab[(b * KVH + h) * T + n / bs] * bs
 * + n % bs of the head's plane k + h * ksh (rows of D; the pool's blocks are bs rows, a power of
 * two), N = T * bs keys, visible where kv_mask [B, KVH, N] says; extra keys as lkv_attention. The
 * same sums as lkv_attention over those blocks gathered into a run (the lookahead layer's draft
 * row over its own top-K, lookahead_layer.c). Returns as lkv_attention. */
int lkv_attention_heads_table(const float *q, const void *k, const void *v, const int64_t *btab, int64_t T,
                              int64_t bs, int64_t ksh, const uint8_t *kv_mask, const float *kx, int64_t xksb,
                              int64_t xksh, int64_t xkse, const float *vx, int64_t xvsb, int64_t xvsh, int64_t xvse,
                              const uint8_t *extra_mask, float *out, int64_t B, int64_t R, int64_t H, int64_t KVH,
                              int64_t E, int64_t D, float scale, int nthreads, int kv_dtype) {
    const int rc = check_args(kv_dtype, R, H, KVH, E);
    if (rc != LKV_OK) return rc;
    if (bs < 1 || (bs & (bs - 1)) || T < 1) return LKV_ERR_ARG;
    return attention_impl(q, k, v, kv_dtype, NULL, 0, btab, KVH * T, T, bs, ksh, kv_mask, kx, xksb, xksh, xkse, vx,
                          xvsb, xvsh, xvse, extra_mask, out, B, R, H, KVH, T * bs, E, D, scale, nthreads);
}
