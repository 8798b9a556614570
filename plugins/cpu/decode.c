/* lkv_decode: a dense decode step of the whole model in one C call (plugins/cpu/fused.py), the
 * CPU analogue of a captured CUDA graph: the step's ~200 kernel calls and ~3,000 torch ops of the
 * Python path (runtime/model.py's DecoderLayer over runtime/attention_dense.DenseStep) become one.
 *
 * It covers the common step: B <= 16 items of one token each, every sequence's blocks one run in
 * the pool (fp32, fp16 or bf16), fp32 activations, each projection fp32 (packed, ops.packed_weight)
 * or weight-only int8. Per layer, the stages of the Python path in its order:
 *
 *   rmsnorm -> wqkv (+ bias) -> [RMSNorm of each q and k head] -> RoPE of q and k (project_qkv)
 *   -> K/V rows rounded into the pool's dtype and
 *   stored at their slots -> paged attention over each sequence's run -> wo, + residual ->
 *   rmsnorm -> w13 -> SiLU(gate) * up -> w2, + residual
 *
 * then the final rmsnorm. The big stages call the same exported kernels the Python path calls
 * (lkv_rmsnorm, lkv_linear_packed / lkv_linear_int8, lkv_attention_paged) with the same
 * arguments and thread count, and the small ones (embedding, RoPE, the K/V rounding, residual
 * adds) round each operation the way torch's elementwise ops do (one rounding per op, no FMA
 * contraction: see the attribute below), so each of them is bit-identical to the Python path.
 * SiLU is too where fused.py hands over torch's own vector exp (silu_mul); otherwise it uses
 * common.h's exp, within a few ulp. A step can also stop before each layer's SiLU and resume
 * after it (the stage ranges below): fused.py's silu="torch" runs torch's SiLU in between.
 *
 * The kernels it calls open their own OpenMP regions (nthreads > 1), as they do on the Python
 * path; the small stages run on the calling thread (a few thousand elements a layer).
 *
 * Stages of a step are numbered: 0 = embedding (and the step's key mask), then for layer l:
 * 1 + 3l = attention half up to w13 (output `gu`), 2 + 3l = SiLU * mul (`gu` -> `act`),
 * 3 + 3l = w2 + residual; 1 + 3L = the final norm (-> `out`). lkv_decode runs [s0, s1). */
#include "common.h"
#include "lkv_abi.h"

/* elementwise helpers that must round like torch's separate ops: no a*b+c contraction */
#define NOFMA __attribute__((optimize("fp-contract=off")))

/* The structs (LkvLinear, LkvLayer, LkvModel, LkvStep, LkvWork), return codes and limits are
 * lkv_abi.h's. Every stage returns a code and the step stops at the first that is not LKV_OK. */

/* The Python path's `linear` for this weight (M <= LKV_MAX_ROWS rows): W8A8 (ops.decode_linear,
 * prefill.linear_w8a8: the same kernel and arguments, through m->w8a8, the AVX-512 library's
 * lkv_gemm_w8a8_scratch) where the weight is bound packed (fused.py binds it so only where the
 * kernel takes it), else weight-only int8 or fp32. The quantized rows go to the work struct's
 * scratch (sized by fused.py for the largest projection): LKV_ERR_SCRATCH where it is short,
 * LKV_ERR_ISA without the function, else the GEMM's own code. */
static int linear(const LkvModel *m, const LkvWork *w, const LkvLinear *L, const float *x, int64_t M, float *y,
                  int nthreads) {
    if (L->wq8) {
        if (m->w8a8 == NULL) return LKV_ERR_ISA;
        if (L->group8 <= 0 || L->k % L->group8 || L->k % 4) return LKV_ERR_ARG;
        if (w->xq == NULL || w->sx == NULL || M * (L->k / 4) > w->xq_len || M * (L->k / L->group8) > w->sx_len)
            return LKV_ERR_SCRATCH;
        return m->w8a8(x, L->k, M, L->k, L->group8, L->wq8, L->wsc8, L->wsum8, L->n, L->bias, y, L->n, nthreads,
                       w->xq, w->sx);
    }
    if (L->int8) lkv_linear_int8(x, M, L->k, (const int8_t *)L->w, L->n, L->scale, L->group, L->bias, y, nthreads);
    else lkv_linear_packed(x, M, L->k, (const float *)L->w, L->n, L->bias, y, nthreads);
    return LKV_OK;
}

/* Everything the step reads is in bounds and consistent with a dense decode step (each row's new
 * token at the end of its sequence's run): LKV_OK, or LKV_DECLINED and nothing written. */
static int check_step(const LkvModel *m, const LkvStep *st) {
    const int64_t B = st->B, bs = m->block_size;
    int64_t N = 0;
    if (B < 1 || B > LKV_MAX_ROWS) return LKV_DECLINED;
    for (int64_t b = 0; b < B; b++) {
        const int64_t p = st->positions[b], n = st->lens[b];
        const int64_t nblk = (n + bs - 1) / bs;
        if (st->tokens[b] < 0 || st->tokens[b] >= m->vocab || p < 0 || p >= m->max_pos || n != p + 1)
            return LKV_DECLINED;
        if (st->tables) {
            const int64_t *t = st->tables + b * st->table_stride;
            if (nblk > st->table_stride) return LKV_DECLINED;
            for (int64_t j = 0; j < nblk; j++)
                if (t[j] < 0 || t[j] >= m->num_blocks) return LKV_DECLINED;
            if (st->slot_blocks[b] != t[p / bs] || st->slot_offsets[b] != p % bs) return LKV_DECLINED;
        } else {
            const int64_t r = st->run_starts[b];
            if (r < 0 || r + nblk > m->num_blocks) return LKV_DECLINED;
            if (st->slot_blocks[b] != r + p / bs || st->slot_offsets[b] != p % bs) return LKV_DECLINED;
        }
        N = n > N ? n : N;
    }
    return N == st->N ? LKV_OK : LKV_DECLINED;
}

static void embed(const LkvModel *m, const LkvStep *st, float *x) {
    const int64_t E = m->hidden;
    for (int64_t b = 0; b < st->B; b++) {
        const int64_t t = st->tokens[b];
        if (m->embed_scale) {       /* Int8Embedding: qweight[t].float() * scale[t, j / G], one rounding */
            const int64_t G = m->embed_group > 0 ? m->embed_group : E, ng = E / G;
            const int8_t *q = (const int8_t *)m->embed + t * E;
            const float *s = m->embed_scale + t * ng;
            for (int64_t j = 0; j < E; j++) x[b * E + j] = (float)q[j] * s[j / G];
        } else {
            memcpy(x + b * E, (const float *)m->embed + t * E, sizeof(float) * E);
        }
    }
}

/* RoPE (rope.py: x * cos + rotate_half(x) * sin, each product rounded, then the sum) of `nh`
 * heads of D at src, into dst; cos/sin the position's rows */
static NOFMA void rope_heads(const float *src, float *dst, int64_t nh, int64_t D, const float *c, const float *s) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < nh; h++) {
        const float *x = src + h * D;
        float *y = dst + h * D;
        for (int64_t d = 0; d < half; d++) {
            const float a = x[d] * c[d], r = -x[d + half] * s[d];
            y[d] = a + r;
        }
        for (int64_t d = half; d < D; d++) {
            const float a = x[d] * c[d], r = x[d - half] * s[d];
            y[d] = a + r;
        }
    }
}

/* The attention's inputs of layer l for the step's B rows, the one place this file applies them
 * (runtime/model.py DecoderLayer.qkv is the Python path's): rmsnorm(x) -> wqkv (+ bias) into
 * w->qkv [B, q + 2kv]; where the layer has q_norm / k_norm (qwen3), each q and k head of a row
 * RMS-normalised in place there (lkv_rmsnorm over the heads as rows of D: what ops.rms_norm calls
 * on the Python path); then RoPE at the row's position: q [B, H, D] into q, k [B, KVH, D] into k.
 * v stays in w->qkv (each row's last KVH * D). Returns wqkv's code (`linear`). */
static int project_qkv(const LkvModel *m, const LkvStep *st, const LkvWork *w, int64_t l, float *q, float *k,
                       int nthreads) {
    const LkvLayer *L = m->layers + l;
    const int64_t B = st->B, E = m->hidden, H = m->heads, KVH = m->kv_heads, D = m->head_dim;
    const int64_t nq = H * D, nkv = KVH * D, nqkv = nq + 2 * nkv;
    lkv_rmsnorm(w->x, E, L->attn_norm, m->eps, w->h, E, B, E);
    const int rc = linear(m, w, &L->wqkv, w->h, B, w->qkv, nthreads);
    if (rc != LKV_OK) return rc;
    for (int64_t b = 0; b < B; b++) {
        float *row = w->qkv + b * nqkv;
        const float *c = m->cos + st->positions[b] * D, *s = m->sin + st->positions[b] * D;
        if (L->q_norm) {
            lkv_rmsnorm(row, D, L->q_norm, m->eps, row, D, H, D);
            lkv_rmsnorm(row + nq, D, L->k_norm, m->eps, row + nq, D, KVH, D);
        }
        rope_heads(row, q + b * nq, H, D, c, s);
        rope_heads(row + nq, k + b * nkv, KVH, D, c, s);
    }
    return LKV_OK;
}

/* one row of D fp32 values into the pool's storage type, rounded to nearest even (torch's .to) */
static void store_row(const float *src, void *dst, int64_t D, int64_t kv_dtype) {
    if (kv_dtype == LKV_KV_F32) {
        memcpy(dst, src, sizeof(float) * D);
    } else if (kv_dtype == LKV_KV_F16) {
        for (int64_t d = 0; d < D; d += 8)
            _mm_storeu_si128((__m128i *)((uint16_t *)dst + d),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
    } else {
        uint16_t *o = (uint16_t *)dst;
        for (int64_t d = 0; d < D; d++) {
            uint32_t u;
            memcpy(&u, src + d, 4);
            o[d] = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
    }
}

static NOFMA void add_rows(float *x, const float *t, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = x[i] + t[i];
}

typedef __m256 (*exp8_fn)(__m256);

/* act = silu(gate) * up, gate/up the halves of each gu row.
 *
 * With exp8 (torch's own vector exp, which fused.py finds in libtorch and checks against F.silu
 * at bind time): torch's silu, x / (1 + exp(-x)), over each row's first I - I % chunk elements
 * (its vector loop, `chunk` = two of its vectors), the rest with libm's expf (its scalar loop), then
 * the product: bit-identical to `F.silu(gate) * up`.
 * Without: silu(g) = g / (1 + e^-g), written as g * e / (1 + e), e = e^g, for g < 0 (common.h's
 * exp_neg takes x <= 0): within a few ulp of torch's. */
static void silu_mul(const float *gu, float *act, int64_t B, int64_t I, const void *exp8, int64_t chunk) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    if (exp8 && chunk > 0 && chunk % 8 == 0) {
        const exp8_fn ex = (exp8_fn)exp8;
        const int64_t nv = I - I % chunk;
        for (int64_t b = 0; b < B; b++) {
            const float *g = gu + b * 2 * I, *u = g + I;
            float *a = act + b * I;
            for (int64_t i = 0; i < nv; i += 8) {
                const __m256 x = _mm256_loadu_ps(g + i);
                const __m256 y = _mm256_div_ps(x, _mm256_add_ps(one, ex(_mm256_xor_ps(x, sign))));
                _mm256_storeu_ps(a + i, _mm256_mul_ps(y, _mm256_loadu_ps(u + i)));
            }
            for (int64_t i = nv; i < I; i++) {
                const float y = g[i] / (1.0f + expf(-g[i]));
                a[i] = y * u[i];
            }
        }
        return;
    }
    for (int64_t b = 0; b < B; b++) {
        const float *g = gu + b * 2 * I, *u = g + I;
        float *a = act + b * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 e = exp_neg(_mm256_or_ps(x, sign));                        /* e^-|x| */
            const __m256 neg = _mm256_cmp_ps(x, zero, _CMP_LT_OQ);
            const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), neg);
            const __m256 y = _mm256_div_ps(num, _mm256_add_ps(one, e));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(y, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) {
            const float x = g[i], e = expf(-fabsf(x));
            a[i] = (x < 0.0f ? x * e : x) / (1.0f + e) * u[i];
        }
    }
}

/* The first block of sequence b's first nb blocks when they are one run of the pool, else -1. */
static int64_t run_start(const LkvStep *st, int64_t b, int64_t nb) {
    if (!st->tables) return st->run_starts[b];
    const int64_t *t = st->tables + b * st->table_stride;
    for (int64_t j = 1; j < nb; j++)
        if (t[j] != t[0] + j) return -1;
    return t[0];
}

/* Sparse mode: layer l's key mask of every row, as runtime/sparse.py BlockSelection.mask builds
 * it: the sink blocks' and the window's keys, and the keys of the top_k candidate blocks (the
 * full blocks between them) that the row's query scores highest against the summaries, by the
 * same block_topk call per sequence (one row, the run's blocks in logical order). Candidate
 * blocks are full and before the window: the step's own rows never change the selection. */
static int select_keys(const LkvModel *m, const LkvStep *st, const LkvWork *w, int64_t l, int nthreads) {
    const int64_t KVH = m->kv_heads, D = m->head_dim, H = m->heads, bs = m->block_size, N = st->N;
    const int64_t layer_at = l * m->num_blocks * KVH * D, NBm = (N + bs - 1) / bs;
    int failed = LKV_OK;        /* the first failure's code (any one, where several fail) */
    /* the sequences over the threads, each block_topk call on one (a call's threads split its
     * sequences, so one sequence's result does not depend on the count: the Python path's) */
#pragma omp parallel for schedule(static) num_threads(nthreads > 1 ? nthreads : 1) \
    if (nthreads > 1 && st->B > 1) reduction(min : failed)
    for (int64_t b = 0; b < st->B; b++) {
        float *scores = w->sel_scores + b * KVH * NBm;
        int64_t *sidx = w->sel_idx + b * KVH * m->sel_top_k;
        uint8_t *valid = w->sel_valid + b * NBm;
        const int64_t n = st->lens[b], nb = (n + bs - 1) / bs, last = (n - 1) / bs;
        const int64_t w0 = last - m->sel_window + 1 > m->sel_sink ? last - m->sel_window + 1 : m->sel_sink;
        const int64_t sink_keys = m->sel_sink * bs < n ? m->sel_sink * bs : n;
        uint8_t *rows = w->mask + b * KVH * N;
        memset(rows, 0, KVH * N);
        for (int64_t h = 0; h < KVH; h++) {
            memset(rows + h * N, 1, sink_keys);
            if (w0 * bs < n) memset(rows + h * N + w0 * bs, 1, n - w0 * bs);
        }
        if (w0 <= m->sel_sink) continue;          /* no candidates */
        memset(valid, 0, nb);
        memset(valid + m->sel_sink, 1, w0 - m->sel_sink);
        const int64_t k = m->sel_top_k < nb ? m->sel_top_k : nb, unit = KVH * D;
        /* the sequence's summaries in logical order: in place for a run of blocks, else gathered
         * (the same values, so the same selection) */
        const float *kmin, *kmax;
        float *gathered = NULL;
        const int64_t run = run_start(st, b, nb);
        if (run >= 0) {
            kmin = m->sel_kmin + layer_at + run * unit;
            kmax = m->sel_kmax + layer_at + run * unit;
        } else {
            gathered = malloc(sizeof(float) * 2 * nb * unit);
            if (!gathered) { failed = LKV_ERR_NOMEM; continue; }
            const int64_t *t = st->tables + b * st->table_stride;
            for (int64_t j = 0; j < nb; j++) {
                memcpy(gathered + j * unit, m->sel_kmin + layer_at + t[j] * unit, sizeof(float) * unit);
                memcpy(gathered + (nb + j) * unit, m->sel_kmax + layer_at + t[j] * unit, sizeof(float) * unit);
            }
            kmin = gathered, kmax = gathered + nb * unit;
        }
        const int rc = lkv_block_topk(w->q + b * H * D, kmin, kmax, nb * unit, valid, nb, nb, 1, 1, H,
                                      KVH, nb, D, k, (int)m->sel_group_max, scores, sidx, 1, LKV_KV_F32);
        free(gathered);
        if (rc != LKV_OK) {
            failed = rc < failed ? rc : failed;
            continue;
        }
        for (int64_t h = 0; h < KVH; h++)
            for (int64_t j = 0; j < k; j++) {
                const int64_t id = sidx[h * k + j];
                if (id >= 0) memset(rows + h * N + id * bs, 1, bs);
            }
    }
    return failed;
}

/* layer l up to w13: x (residual) updated by attention, gu = w13(rmsnorm(x)) */
static int attention_half(const LkvModel *m, const LkvStep *st, const LkvWork *w, int64_t l, int nthreads) {
    const LkvLayer *L = m->layers + l;
    const int64_t B = st->B, E = m->hidden, H = m->heads, KVH = m->kv_heads, D = m->head_dim;
    const int64_t nq = H * D, nkv = KVH * D, nqkv = nq + 2 * nkv, bs = m->block_size;
    const int64_t es = m->kv_dtype == LKV_KV_F32 ? 4 : 2, hs = m->num_blocks * bs * D;   /* head stride */
    float *krot = w->o;               /* the rotated keys [B, KVH, D]: o is free until attention */
    int rc = project_qkv(m, st, w, l, w->q, krot, nthreads);
    if (rc != LKV_OK) return rc;
    for (int64_t b = 0; b < B; b++) {
        const float *row = w->qkv + b * nqkv;
        const int64_t slot = st->slot_blocks[b] * bs * D + st->slot_offsets[b] * D;
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t at = (h * hs + slot) * es;
            store_row(krot + b * nkv + h * D, (char *)L->k + at, D, m->kv_dtype);
            store_row(row + nq + nkv + h * D, (char *)L->v + at, D, m->kv_dtype);
        }
    }
    if (m->sel_kmin) {
        rc = select_keys(m, st, w, l, nthreads);
        if (rc != LKV_OK) return rc;
    }
    rc = st->tables
        ? lkv_attention_paged_table(w->q, L->k, L->v, st->tables, st->table_stride, bs, hs, w->mask, w->o, B, H, KVH,
                                    st->N, D, m->scale, nthreads, (int)m->kv_dtype)
        : lkv_attention_paged(w->q, L->k, L->v, w->boff, hs, w->mask, w->o, B, H, KVH, st->N, D, m->scale,
                              nthreads, (int)m->kv_dtype);
    if (rc != LKV_OK) return rc;
    rc = linear(m, w, &L->wo, w->o, B, w->t, nthreads);
    if (rc != LKV_OK) return rc;
    add_rows(w->x, w->t, B * E);
    lkv_rmsnorm(w->x, E, L->mlp_norm, m->eps, w->h, E, B, E);
    return linear(m, w, &L->w13, w->h, B, w->gu, nthreads);
}

/* Stages [s0, s1) of the step (numbered above). Returns LKV_OK; LKV_DECLINED (before anything is
 * written: the step is not one this path takes, the caller runs the Python path); LKV_ERR_ARG
 * (kv_dtype); else the first failing stage's code (attention's or top-K's scratch, a W8A8
 * projection's ISA, scratch or arguments), the step left unfinished. */
int lkv_decode(const LkvModel *m, const LkvStep *st, const LkvWork *w, int64_t s0, int64_t s1, int nthreads) {
    const int64_t L = m->num_layers, B = st->B, KVH = m->kv_heads, N = st->N;
    if (m->kv_dtype < LKV_KV_F32 || m->kv_dtype > LKV_KV_BF16) return LKV_ERR_ARG;
    if (m->head_dim % 32 || m->kv_heads * m->head_dim > LKV_MAX_KV_ROW || m->heads % m->kv_heads) return LKV_DECLINED;
    if (s0 == 0) {
        const int rc = check_step(m, st);
        if (rc != LKV_OK) return rc;
    }
    for (int64_t s = s0; s < s1 && s <= 3 * L + 1; s++) {
        if (s == 0) {
            embed(m, st, w->x);
            for (int64_t b = 0; b < B; b++) {     /* ops.paged_mask: each sequence's first lens[b] keys */
                w->boff[b] = st->tables ? 0 : st->run_starts[b] * m->block_size * m->head_dim;
                for (int64_t h = 0; h < KVH; h++) {
                    uint8_t *row = w->mask + (b * KVH + h) * N;
                    memset(row, 1, st->lens[b]);
                    memset(row + st->lens[b], 0, N - st->lens[b]);
                }
            }
        } else if (s == 3 * L + 1) {
            lkv_rmsnorm(w->x, m->hidden, m->norm, m->eps, w->out, m->hidden, B, m->hidden);
        } else {
            const int64_t l = (s - 1) / 3, part = (s - 1) % 3;
            if (part == 0) {
                const int rc = attention_half(m, st, w, l, nthreads);
                if (rc != LKV_OK) return rc;
            } else if (part == 1) {
                silu_mul(w->gu, w->act, B, m->inter, m->exp8, m->silu_chunk);
            } else {
                const int rc = linear(m, w, &m->layers[l].w2, w->act, B, w->t, nthreads);
                if (rc != LKV_OK) return rc;
                add_rows(w->x, w->t, B * m->hidden);
            }
        }
    }
    return LKV_OK;
}

/* silu_mul alone, for fused.py's bind-time check against torch's F.silu(gate) * up */
void lkv_silu_mul(const float *gu, float *act, int64_t B, int64_t I, const void *exp8, int64_t chunk) {
    silu_mul(gu, act, B, I, exp8, chunk);
}

/* ---- the same layers around an attention backend outside C (fused.py's run_layers) ----------
 *
 * A lookahead decode step (runtime/lookahead: a real and a draft row per sequence, sparse
 * attention over the device tier) keeps its attention in Python, where the residency manager,
 * the transfer engine and the metrics live; everything else of each layer runs here, in the
 * Python path's order and rounding (the stages above, split at attention):
 *
 *   lkv_ext_begin: embedding of the B rows -> x;
 *   per layer l:   lkv_ext_qkv  project_qkv (rmsnorm -> wqkv (+ bias) -> [q / k head RMSNorm] ->
 *                               RoPE of q and k) -> q [B, H, D],
 *                               k [B, KVH, D] (rotated), v [B, KVH, D], fp32, into the caller's;
 *                  (the backend's attention of q, k, v -> o [B, H, D])
 *                  lkv_ext_rest wo(o), + residual -> rmsnorm -> w13 -> SiLU(gate) * up -> w2, + residual;
 *   lkv_ext_end:   the final rmsnorm -> out.
 * Nothing here reads or writes the KV pool: storing the rows is the backend's. lkv_ext_begin
 * returns LKV_OK or LKV_DECLINED (nothing run); lkv_ext_qkv and lkv_ext_rest LKV_OK or their
 * first projection's failing code (`linear`). */
int lkv_ext_begin(const LkvModel *m, const LkvStep *st, const LkvWork *w) {
    if (st->B < 1 || st->B > LKV_MAX_ROWS) return LKV_DECLINED;
    for (int64_t b = 0; b < st->B; b++)
        if (st->tokens[b] < 0 || st->tokens[b] >= m->vocab || st->positions[b] < 0 || st->positions[b] >= m->max_pos)
            return LKV_DECLINED;
    embed(m, st, w->x);
    return LKV_OK;
}

int lkv_ext_qkv(const LkvModel *m, const LkvStep *st, const LkvWork *w, int64_t l, float *q, float *k, float *v,
                int nthreads) {
    const int64_t nq = m->heads * m->head_dim, nkv = m->kv_heads * m->head_dim, nqkv = nq + 2 * nkv;
    const int rc = project_qkv(m, st, w, l, q, k, nthreads);
    if (rc != LKV_OK) return rc;
    for (int64_t b = 0; b < st->B; b++) memcpy(v + b * nkv, w->qkv + b * nqkv + nq + nkv, sizeof(float) * nkv);
    return LKV_OK;
}

int lkv_ext_rest(const LkvModel *m, const LkvStep *st, const LkvWork *w, int64_t l, const float *o, int nthreads) {
    const LkvLayer *L = m->layers + l;
    const int64_t B = st->B, E = m->hidden;
    int rc = linear(m, w, &L->wo, o, B, w->t, nthreads);
    if (rc != LKV_OK) return rc;
    add_rows(w->x, w->t, B * E);
    lkv_rmsnorm(w->x, E, L->mlp_norm, m->eps, w->h, E, B, E);
    rc = linear(m, w, &L->w13, w->h, B, w->gu, nthreads);
    if (rc != LKV_OK) return rc;
    silu_mul(w->gu, w->act, B, m->inter, m->exp8, m->silu_chunk);
    rc = linear(m, w, &L->w2, w->act, B, w->t, nthreads);
    if (rc != LKV_OK) return rc;
    add_rows(w->x, w->t, B * E);
    return LKV_OK;
}

void lkv_ext_end(const LkvModel *m, const LkvStep *st, const LkvWork *w) {
    lkv_rmsnorm(w->x, m->hidden, m->norm, m->eps, w->out, m->hidden, st->B, m->hidden);
}
