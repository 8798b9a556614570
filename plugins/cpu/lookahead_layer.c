/* One decode layer of the lookahead backend in one call (plugins/cpu/lookahead_layer.py, issue 18).
 *
 * What runtime/lookahead/attention.py `_decode_torch` runs under the resident policy, for lanes
 * 0..n-1 (`active`: those that decode this step; R rows each: the real row, and with look-ahead
 * the draft row), where the torch path makes ~40-60 torch ops around five to seven kernel calls:
 *   1. score every row against layer l's block summaries, top-K (lkv_block_topk, one read);
 *   2. the real row's true set and which of it is held (the metrics' inputs);
 *   3. admit the misses of the lanes the miss policy fetches into the layer's selected slots
 *      (lkv_plan: capped eviction, cap K) and copy them host pool -> device tier
 *      with the transfer engine's copy kernel (`copy`, bound once), timed (the step's stall);
 *   4. the key mask (the tier's sink/window rows, each occupied selected slot whole) and the
 *      attention of every row over the buffer plus the step's own rows (lkv_attention);
 *   4b. R = 2 with `draft_fixed`: step 4 attends the real rows alone (the torch path computes both
 *      rows there and replaces the draft rows: a row's sums do not depend on the call's other
 *      rows), and the draft row its own top-K from the host pool (lkv_attention_heads_table),
 *      beside its sink and window blocks;
 *   5. R = 2: the draft row's top-K is the layer's prediction for the next step: recorded, and
 *      admitted (lkv_plan, cap `predict_cap`); the caller queues its copies in the background.
 * The same kernels in the same order, with the same arguments: the Python path's bytes, bit for
 * bit (tests/test_fused_lookahead.py). */
#include <time.h>

#include "common.h"
#include "lkv_abi.h"

/* LkvLayerTensors (bound once), LkvLayerCall (one call) and LkvCopyFn (the transfer engine's copy
 * kernel, handed to the layer when it is bound: the layer plans the urgent copy and calls it; it
 * moves no bytes of its own) are lkv_abi.h's. */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* Returns LKV_OK; LKV_ERR_NOMEM scratch memory ran out (in a kernel); LKV_ERR_ARG the call's sizes
 * are outside the bound ones, or a kernel refused its arguments; LKV_ERR_RANGE an index (a lane or
 * block to plan, a copy's) was out of range (nothing copied). */
int lkv_lookahead_layer(const LkvLayerTensors *m, LkvLayerCall *c) {
    const int64_t n = c->n, R = c->rows, KVH = m->kv_heads, H = m->heads, D = m->head_dim, K = m->top_k,
                  MB = m->max_blocks, bs = m->block_size, S = m->sel_start, NS = m->slots, nb = c->nb, ks = c->k_sel;
    if (n < 1 || n > m->lanes || R < 1 || R > 2 || c->layer < 0 || c->layer >= m->layers || c->buf < 0
        || c->buf >= m->layers || nb < 1 || nb > MB || ks < 1 || ks > nb || ks > K || c->used_none < 0
        || c->used_adm > K || c->used_none > c->used_adm || (R == 2 && (c->predict_cap < 0 || c->predict_cap > K)) || m->copy == NULL)
        return LKV_ERR_ARG;
    const int64_t rows = n * KVH;
    /* 1. top-K of every row, in one read of the summaries (BlockSummaries.score) */
    const int64_t sum_at = c->layer * m->lanes * MB * KVH * D * m->elem_bytes;      /* bytes */
    int rc = lkv_block_topk(c->q, (const char *)m->kmin + sum_at, (const char *)m->kmax + sum_at, MB * KVH * D, c->cand,
                            c->cand_sb, c->cand_sr, n, R, H, KVH, nb, D, ks, (int)m->group_max, m->scores, m->idx,
                            (int)c->nthreads, (int)m->kv_dtype);
    if (rc != LKV_OK) return rc;
    /* 2. the real row's top-K padded to K with -1 (the metrics' true set), which of it is held,
     * and what the miss policy fetches (its lanes' true set), with its priorities */
    const int64_t tab = c->buf * m->lanes * KVH;         /* this buffer's first (lane, head) row */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t b = r / KVH, h = r % KVH, sel = (b * R * KVH + h);    /* [b, 0, h] */
        const int64_t *inv = m->slot_of + (tab + r) * (MB + 1);
        int64_t *t = c->true_idx + r * K, *w = m->want + r * K;
        uint8_t *held = c->resident + r * K;
        float *p = m->prio + r * K;
        const float *sc = m->scores + sel * nb;
        const int fetch = c->fetch[b] != 0 && c->active[b] != 0;
        for (int64_t j = 0; j < K; j++) {
            const int64_t id = j < ks ? m->idx[sel * ks + j] : -1;
            t[j] = id;
            held[j] = id >= 0 && inv[id] >= 0;
            w[j] = fetch ? id : -1;
            p[j] = sc[id >= 0 && fetch ? id : 0];
        }
    }
    int64_t *out_lane = c->urgent_adm, *out_head = c->urgent_adm + rows * K, *out_slot = c->urgent_adm + 2 * rows * K,
            *out_block = c->urgent_adm + 3 * rows * K;
    const int64_t unit = bs * D * m->elem_bytes / 4;   /* a (block, head) unit in the 4-byte words residency.c copies */
    const int64_t layer_at = c->layer * KVH * m->pool_blocks * bs * D * m->elem_bytes;
    const int64_t buf_at = c->buf * m->lanes * KVH * NS * bs * D * m->elem_bytes;
    /* 3. admit the fetched misses (cap K), then copy them */
    const int64_t na = lkv_plan(m->block + tab * K, m->last_used + tab * K, m->slot_of + tab * (MB + 1), m->lane_ids,
                                m->lanes, n, KVH, K, MB, m->want, m->prio, K, K, c->step, out_lane, out_head,
                                out_slot, out_block);
    if (na < 0) return (int)na;
    c->admitted = na;
    c->copy_s = 0.0;
    if (na > 0) {
        int64_t *sb = m->lists, *ds = m->lists + rows * K;
        for (int64_t i = 0; i < na; i++) {
            sb[i] = m->lane_blocks[out_lane[i] * MB + out_block[i]];
            ds[i] = out_slot[i] + S;
        }
        const double t0 = now_s();
        /* strides in words: pool [NB, KVH] units of one layer, tier [lanes, KVH, slots] units */
        rc = m->copy((const float *)((const char *)m->pool_k + layer_at),
                             (const float *)((const char *)m->pool_v + layer_at), unit, m->pool_blocks * unit,
                             (float *)((char *)m->tier_k + buf_at), (float *)((char *)m->tier_v + buf_at),
                             KVH * NS * unit, NS * unit, unit, sb, out_head, out_lane, out_head, ds, na, unit,
                             m->pool_blocks, KVH, m->lanes, NS);
        c->copy_s = now_s() - t0;
        if (rc != LKV_OK) return LKV_ERR_RANGE;
    }
    /* 4. mask and attention of every row over sink + window + the first `used` selected slots */
    const int64_t used = na > 0 ? c->used_adm : c->used_none, nkeys = (S + used) * bs;
    c->used = used;
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *tm = m->tier_mask + r * NS * bs, *mk = m->mask + r * nkeys;
        const int64_t *held = m->block + (tab + r) * K;
        for (int64_t s = 0; s < used; s++) memset(tm + (S + s) * bs, held[s] >= 0, bs);
        memcpy(mk, tm, nkeys);
    }
    const int own = R == 2 && c->draft_fixed != NULL;      /* 4b below attends the draft rows */
    if (!own) {
        rc = lkv_attention(c->q, (const char *)m->tier_k + buf_at, (const char *)m->tier_v + buf_at, KVH * NS * bs * D,
                           NS * bs * D, m->mask, c->kx, c->xksb, c->xksh, c->xkse, c->vx, c->xvsb, c->xvsh, c->xvse,
                           c->extra_mask, c->out, n, R, H, KVH, nkeys, R, D, c->scale, (int)c->nthreads,
                           (int)m->kv_dtype);
    } else {                                                /* the real rows alone, as [n, 1, H, D] */
        for (int64_t b = 0; b < n; b++) {
            memcpy(m->dq + b * H * D, c->q + b * R * H * D, sizeof(float) * H * D);
            memcpy(m->dxmask + b * R, c->extra_mask + b * R * R, (size_t)R);
        }
        rc = lkv_attention(m->dq, (const char *)m->tier_k + buf_at, (const char *)m->tier_v + buf_at, KVH * NS * bs * D,
                           NS * bs * D, m->mask, c->kx, c->xksb, c->xksh, c->xkse, c->vx, c->xvsb, c->xvsh, c->xvse,
                           m->dxmask, m->dout, n, 1, H, KVH, nkeys, R, D, c->scale, (int)c->nthreads,
                           (int)m->kv_dtype);
        for (int64_t b = 0; b < n && rc == LKV_OK; b++)
            memcpy(c->out + b * R * H * D, m->dout + b * H * D, sizeof(float) * H * D);
    }
    if (rc != LKV_OK) return rc;
    /* 4b. R = 2 with draft_fixed: the draft row attends its own top-K instead (the idx row [b, 1],
     * after its lane's sink and window blocks), read from the host pool, plus the step's own rows
     * as its extra-mask row says: what the next step's real row attends when the draft token and
     * the prediction are right (step 4 attended the real rows alone). */
    if (own) {
        const int64_t T = S + ks, plane = m->pool_blocks * bs * D;
        for (int64_t b = 0; b < n; b++) {
            const int64_t st = c->draft_stored[b];
            for (int64_t h = 0; h < KVH; h++) {
                int64_t *tb = m->dtab + (b * KVH + h) * T;
                uint8_t *mk = m->dmask + (b * KVH + h) * T * bs;
                const int64_t *own = m->idx + (b * R * KVH + KVH + h) * ks;      /* [b, 1, h] */
                for (int64_t j = 0; j < T; j++) {
                    const int64_t lb = j < S ? c->draft_fixed[b * S + j] : own[j - S];
                    const int64_t pb = lb >= 0 && lb < MB ? m->lane_blocks[b * MB + lb] : -1;
                    const int ok = pb >= 0 && pb < m->pool_blocks;
                    tb[j] = ok ? pb : 0;
                    for (int64_t o = 0; o < bs; o++) mk[j * bs + o] = ok && lb * bs + o < st;
                }
            }
            memcpy(m->dq + b * H * D, c->q + (b * R + 1) * H * D, sizeof(float) * H * D);
            memcpy(m->dxmask + b * R, c->extra_mask + (b * R + 1) * R, (size_t)R);
        }
        rc = lkv_attention_heads_table(m->dq, (const char *)m->pool_k + layer_at, (const char *)m->pool_v + layer_at,
                                       m->dtab, T, bs, plane, m->dmask, c->kx, c->xksb, c->xksh, c->xkse, c->vx,
                                       c->xvsb, c->xvsh, c->xvse, m->dxmask, m->dout, n, 1, H, KVH, R, D, c->scale,
                                       (int)c->nthreads, (int)m->kv_dtype);
        if (rc != LKV_OK) return rc;
        for (int64_t b = 0; b < n; b++)
            memcpy(c->out + (b * R + 1) * H * D, m->dout + b * H * D, sizeof(float) * H * D);
    }
    c->predicted = 0;
    if (R == 1) return LKV_OK;
    /* 5. the draft row's top-K is layer l's prediction for the next step (ResidencyManager.predict):
     * recorded, and admitted (cap predict_cap) by the resident policy; the copies are the
     * caller's to queue (a background transfer) */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t b = r / KVH, h = r % KVH, sel = (b * R * KVH + KVH + h);    /* [b, 1, h] */
        int64_t *pr = m->pred + ((c->layer * m->lanes + b) * KVH + h) * K, *w = m->want + r * K;
        float *p = m->prio + r * K;
        const float *sc = m->scores + sel * nb;
        const int on = c->active[b] != 0;      /* an inactive lane keeps its prediction */
        for (int64_t j = 0; j < K; j++) {
            const int64_t id = on && j < ks ? m->idx[sel * ks + j] : -1;
            w[j] = id;
            if (on) pr[j] = id;
            p[j] = sc[id >= 0 ? id : 0];
        }
        if (on) m->has_pred[c->layer * m->lanes + b] = 1;
    }
    const int64_t cap = c->predict_cap;
    int64_t *pa = c->pred_adm;
    const int64_t np = lkv_plan(m->block + tab * K, m->last_used + tab * K, m->slot_of + tab * (MB + 1), m->lane_ids,
                                m->lanes, n, KVH, K, MB, m->want, m->prio, K, cap, c->step, pa, pa + rows * K,
                                pa + 2 * rows * K, pa + 3 * rows * K);
    if (np < 0) return (int)np;
    c->predicted = np;
    return LKV_OK;
}
