/* The lookahead runtime's per-layer bookkeeping and copies, which in torch were ~40 small ops per
 * call (runtime/lookahead/residency.py `SlotTable.plan`, runtime/transfer.py `CopyJob.execute`).
 *
 * lkv_plan         capped-eviction admission for a batch of (lane, KV head) rows, updating the
 *                  slot tables in place; the same rule, order and ties as SlotTable.plan's torch
 *                  formulation (which stays as its reference in the tests).
 * lkv_copy_blocks  dst[lane, head, slot] = src[block, head] for K and V, one (bs x D) unit each:
 *                  a memcpy per unit, no gathered temporary.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "lkv_abi.h"     /* the prototypes lookahead_layer.c calls these by */

typedef struct { int64_t key; int64_t idx; } keyed_t;
typedef struct { float key; int64_t idx; } fkeyed_t;

static int cmp_keyed(const void *x, const void *y) {
    const keyed_t *a = x, *b = y;
    if (a->key != b->key) return a->key < b->key ? -1 : 1;
    return (a->idx > b->idx) - (a->idx < b->idx);
}

/* priority descending (NaN last), then position ascending: argsort(-priority, stable) */
static int cmp_prio(const void *x, const void *y) {
    const fkeyed_t *a = x, *b = y;
    const int an = isnan(a->key), bn = isnan(b->key);
    if (an != bn) return an - bn;
    if (!an && a->key != b->key) return a->key > b->key ? -1 : 1;
    return (a->idx > b->idx) - (a->idx < b->idx);
}

/* Put the m first (by cmp) of a[0, n) in order at a[0, m): a full sort when m is a large part of
 * n, else insertion into a sorted prefix (a step admits a few blocks out of K slots). */
#define LKV_SMALLEST(name, type, cmp)                                                        \
    static void name(type *a, int64_t n, int64_t m) {                                         \
        if (m <= 0) return;                                                                   \
        if (4 * m >= n) { qsort(a, n, sizeof(type), cmp); return; }                           \
        for (int64_t i = 1; i < m; i++)                        /* sort the first m */        \
            for (int64_t j = i; j > 0 && cmp(&a[j], &a[j - 1]) < 0; j--) {                    \
                type t = a[j]; a[j] = a[j - 1]; a[j - 1] = t;                                 \
            }                                                                                 \
        for (int64_t i = m; i < n; i++) {                      /* keep them the m first */   \
            if (cmp(&a[i], &a[m - 1]) >= 0) continue;                                         \
            type t = a[m - 1]; a[m - 1] = a[i]; a[i] = t;                                     \
            for (int64_t j = m - 1; j > 0 && cmp(&a[j], &a[j - 1]) < 0; j--) {                \
                t = a[j]; a[j] = a[j - 1]; a[j - 1] = t;                                      \
            }                                                                                 \
        }                                                                                     \
    }
LKV_SMALLEST(smallest_keyed, keyed_t, cmp_keyed)
LKV_SMALLEST(smallest_prio, fkeyed_t, cmp_prio)

/* Tables of one buffer: held/last [lanes, KVH, K], inv [lanes, KVH, MB + 1] (contiguous).
 * want [B, KVH, KW] (-1 = none) and prio [B, KVH, KW] contiguous; lanes [B]. Admissions go to
 * out_* (capacity B * KVH * min(cap, KW)) in (row, rank) order; returns their count, LKV_ERR_NOMEM
 * when scratch memory ran out, LKV_ERR_RANGE (nothing changed) when a lane is not in [0, L) or a
 * wanted block not in [-1, MB). */
int64_t lkv_plan(int64_t *held_t, int64_t *last_t, int64_t *inv_t, const int64_t *lanes, int64_t L, int64_t B,
                 int64_t KVH, int64_t K, int64_t MB, const int64_t *want, const float *prio, int64_t KW,
                 int64_t cap, int64_t step, int64_t *out_lane, int64_t *out_head, int64_t *out_slot,
                 int64_t *out_block) {
    for (int64_t b = 0; b < B; b++) if (lanes[b] < 0 || lanes[b] >= L) return LKV_ERR_RANGE;
    for (int64_t i = 0; i < B * KVH * KW; i++) if (want[i] < -1 || want[i] >= MB) return LKV_ERR_RANGE;
    keyed_t *victims = malloc(sizeof(keyed_t) * K);
    fkeyed_t *order = malloc(sizeof(fkeyed_t) * (KW + 1));
    uint8_t *wanted = malloc(K + 1);
    int64_t n_out = 0;
    if (!victims || !order || !wanted) { free(victims); free(order); free(wanted); return LKV_ERR_NOMEM; }
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t row = lanes[b] * KVH + h;
            int64_t *held = held_t + row * K, *last = last_t + row * K, *inv = inv_t + row * (MB + 1);
            const int64_t *wr = want + (b * KVH + h) * KW;
            const float *pr = prio + (b * KVH + h) * KW;
            memset(wanted, 0, K);
            int64_t n_missing = 0;
            for (int64_t j = 0; j < KW; j++) {
                if (wr[j] < 0) continue;
                const int64_t slot = inv[wr[j]];
                if (slot >= 0) wanted[slot] = 1;
                else order[n_missing++] = (fkeyed_t){pr[j], j};
            }
            for (int64_t s = 0; s < K; s++) if (wanted[s]) last[s] = step;
            if (n_missing == 0) continue;
            const int64_t n_admit = n_missing < cap ? n_missing : cap;
            for (int64_t s = 0; s < K; s++) victims[s] = (keyed_t){wanted[s] ? INT64_MAX : last[s], s};
            smallest_keyed(victims, K, n_admit);
            smallest_prio(order, n_missing, n_admit);
            for (int64_t i = 0; i < n_admit; i++) {
                const int64_t slot = victims[i].idx, block = wr[order[i].idx], evicted = held[slot];
                if (evicted >= 0) inv[evicted] = -1;
                inv[block] = slot;
                held[slot] = block;
                last[slot] = step;
                out_lane[n_out] = lanes[b]; out_head[n_out] = h; out_slot[n_out] = slot; out_block[n_out] = block;
                n_out++;
            }
        }
    }
    free(victims); free(order); free(wanted);
    return n_out;
}

/* For i < n: dst[dl[i], dh[i], ds[i]] = src[sb[i], sh[i]] for K and V; a unit is `unit` floats
 * (bs x D, contiguous), src at sb*s_blk + sh*s_head, dst at dl*d_lane + dh*d_head + ds*d_slot
 * (strides in floats). Returns LKV_OK, or LKV_ERR_RANGE (nothing copied) when an index is outside
 * src [NB, KVH] / dst [NL, KVH, NS]. */
int lkv_copy_blocks(const float *src_k, const float *src_v, int64_t s_blk, int64_t s_head, float *dst_k,
                     float *dst_v, int64_t d_lane, int64_t d_head, int64_t d_slot, const int64_t *sb,
                     const int64_t *sh, const int64_t *dl, const int64_t *dh, const int64_t *ds, int64_t n,
                     int64_t unit, int64_t NB, int64_t KVH, int64_t NL, int64_t NS) {
    for (int64_t i = 0; i < n; i++)
        if (sb[i] < 0 || sb[i] >= NB || sh[i] < 0 || sh[i] >= KVH || dl[i] < 0 || dl[i] >= NL || dh[i] < 0
            || dh[i] >= KVH || ds[i] < 0 || ds[i] >= NS) return LKV_ERR_RANGE;
    /* split over the calling thread's OpenMP team (its torch thread count: the compute thread's
     * for an urgent copy, one for the CPU transfer engine's background worker); a few units stay
     * on the caller. The units of one list never overlap in dst, so any order gives the same bytes. */
#pragma omp parallel for schedule(static) if (n * unit >= (1 << 16))
    for (int64_t i = 0; i < n; i++) {
        const int64_t so = sb[i] * s_blk + sh[i] * s_head, dof = dl[i] * d_lane + dh[i] * d_head + ds[i] * d_slot;
        memcpy(dst_k + dof, src_k + so, unit * sizeof(float));
        memcpy(dst_v + dof, src_v + so, unit * sizeof(float));
    }
    return LKV_OK;
}
