/* lkv_abi.h: the one boundary between the CPU kernels (the .c files of plugins/cpu) and Python (ctypes).
 *
 * Everything both sides must agree on is defined here once: the K/V storage codes, the return
 * codes, the limits the kernels check, the structs Python fills (mirrored by ctypes in
 * plugins/cpu/abi.py) and the prototype of every exported function. abi.c exports a descriptor
 * of all of it (lkv_abi_describe: sizes, field offsets, codes, limits), which the loader compares
 * with the ctypes mirror when it loads a library, before the first call.
 *
 * The kernels are built into two libraries (plugins/cpu/loader.py): the base one (AVX2 + FMA +
 * F16C: decode, attention, top-K, summaries, residency, linears, prefill attention's AVX2 path)
 * and the AVX-512 one (BF16 / VNNI: the prefill GEMMs, W8A8, prefill attention's bf16 tiles). The
 * base library never links against the other: where it runs one of its kernels (decode's W8A8
 * projections, prefill attention's tiles) Python hands it the functions' addresses (LkvModel.w8a8,
 * lkv_prefill_attention's `tiles`). */
#ifndef LKV_ABI_H
#define LKV_ABI_H
#include <stddef.h>
#include <stdint.h>

#define LKV_ABI_VERSION 2

/* ---- K/V storage codes (the kv_dtype / key_dtype arguments; abi.py KV_F32 ...) ----------------- */
enum { LKV_KV_F32 = 0, LKV_KV_F16 = 1, LKV_KV_BF16 = 2 };

/* ---- return codes (abi.py Status; abi.raise_for maps each to its exception) -------------------- */
enum {
    LKV_OK = 0,
    LKV_ERR_NOMEM = -1,      /* a scratch allocation failed */
    LKV_ERR_ARG = -2,        /* an argument was refused (a size, a code, a layout); nothing written */
    LKV_DECLINED = -3,       /* lkv_decode / lkv_ext_begin: not a step this path takes; nothing written */
    LKV_ERR_ISA = -4,        /* this CPU lacks the instructions the kernel needs */
    LKV_ERR_RANGE = -5,      /* an index (block id, lane, slot) out of range; nothing changed */
    LKV_ERR_SCRATCH = -6,    /* the caller's scratch is smaller than the call needs */
    LKV_ERR_LIMIT = -7,      /* a size above a limit below */
};

/* ---- limits (abi.py LIMITS) ------------------------------------------------------------------- */
#define LKV_MAX_ROWS 16          /* lkv_decode / lkv_ext_*: rows of a step */
#define LKV_MAX_KV_ROW 4096      /* lkv_decode: KVH * D of a row's keys */
#define LKV_MAX_EXTRA_KEYS 8     /* lkv_attention: extra keys E (their scores live on the stack) */
#define LKV_MAX_GROUP_ROWS 64    /* lkv_attention*: query rows per KV head, R * H / KVH (likewise) */
/* W8A8: the inputs one int32 accumulator sums (the group G; K with one scale per output channel).
 * vpdpbusd multiplies the biased activation q + 128 (<= 255) by the weight (>= -128): each term
 * is at most 255 * 128 in magnitude, so G terms fit in int32 while G <= INT32_MAX / (255 * 128).
 * (The unbiased bound K * 127 * 127 is looser; this one is what the kernel accumulates.) */
#define LKV_W8A8_MAX_GROUP (INT32_MAX / (255 * 128))

/* ---- the structs Python fills (abi.py: Linear, Layer, Model, Step, Work, LayerTensors, LayerCall) */

/* the W8A8 GEMM with the caller's scratch (lkv_gemm_w8a8_scratch, in the AVX-512 library) */
typedef int (*LkvW8A8Fn)(const float *x, int64_t xs, int64_t M, int64_t K, int64_t G, const int32_t *wq,
                         const float *wsc, const int32_t *wsum, int64_t N, const float *bias, float *y, int64_t ys,
                         int nthreads, uint32_t *xq, float *sx);

/* one projection of the fused decode step (decode.c) */
typedef struct {
    const void *w;         /* fp32: packed [N/8, K, 8] (ops.packed_weight); int8: [N, K] row-major */
    const float *scale;    /* int8: [N, K / group] (group == K: [N], per output channel); fp32: NULL */
    const float *bias;     /* [N] or NULL */
    int64_t n, k, int8;
    int64_t group;         /* int8: inputs per scale (lkv_linear_int8's `group`); fp32: 0 */
    /* int8 at decode precision int8: the weight packed for the W8A8 GEMM (prefill.packed_w8a8's
     * quads, scales, offset sums), the rows quantized per row and group (W8A8); else NULL */
    const int32_t *wq8;
    const float *wsc8;
    const int32_t *wsum8;
    int64_t group8;        /* W8A8: the rows' quantization group (prefill.int8_group_size) */
} LkvLinear;

typedef struct {
    const float *attn_norm, *mlp_norm;   /* [hidden] */
    LkvLinear wqkv, wo, w13, w2;
    void *k, *v;                         /* this layer's pool K/V: [KVH, num_blocks, block_size, D] */
    const float *q_norm, *k_norm;        /* qk_norm (qwen3): each q / k head's RMSNorm [D]; else NULL */
} LkvLayer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter, vocab;
    int64_t num_blocks, block_size, max_pos, kv_dtype;
    float eps, scale;                    /* RMSNorm eps, attention scale (as the Python path's floats) */
    const float *cos, *sin;              /* RoPE tables [max_pos, head_dim] */
    const void *embed;                   /* [vocab, hidden]: fp32, or int8 with embed_scale */
    const float *embed_scale;            /* [vocab, hidden / embed_group] */
    const float *norm;                   /* the final norm [hidden] */
    const LkvLayer *layers;              /* [num_layers] */
    const void *exp8;                    /* torch's vector exp for SiLU (see decode.c silu_mul), or NULL */
    int64_t silu_chunk;
    int64_t embed_group;                 /* int8 embed: hidden elements per scale (hidden: one a row) */
    /* sparse mode (runtime/sparse.py BlockSelection): each pool block's min/max key summaries
     * [L, num_blocks, KVH, D] fp32, or NULL (dense: every key visible); the selection's top_k,
     * sink blocks, window blocks (SlotLayout.num_window) and group score (1: max, 0: sum) */
    const float *sel_kmin, *sel_kmax;
    int64_t sel_top_k, sel_sink, sel_window, sel_group_max;
    LkvW8A8Fn w8a8;                      /* the W8A8 GEMM where a projection has wq8, else NULL */
} LkvModel;

typedef struct {
    int64_t B, N;                        /* items (rows), N = max(lens): the key mask's width */
    const int64_t *tokens, *positions;   /* [B] */
    const int64_t *slot_blocks, *slot_offsets;   /* [B] where each row's K/V go */
    const int64_t *run_starts, *lens;    /* [B] each sequence's first block, its keys (position + 1) */
    const int64_t *tables;               /* NULL (each sequence one run of blocks from run_starts[b]),
                                          * or [B, table_stride] block tables: key n of sequence b in
                                          * block tables[b * table_stride + n / block_size] */
    int64_t table_stride;
} LkvStep;

typedef struct {   /* fp32 scratch, rows of B: x [hidden] (the residual stream), h [hidden], */
    float *x, *h, *qkv, *q, *o, *t, *gu, *act, *out;   /* qkv [q+2kv], q/o [H*D], t [hidden], */
    uint8_t *mask;                                     /* gu [2I], act [I], out [hidden]; mask [B, KVH, N] */
    int64_t *boff;                                     /* [B] each sequence's first key (elements) */
    float *sel_scores;                                 /* sparse, per row b: [KVH, NBm] block scores, */
    int64_t *sel_idx;                                  /* [KVH, top_k] the selection, [NBm] its */
    uint8_t *sel_valid;                                /* candidates; NBm = blocks of N keys */
    /* W8A8: the quantized rows of one projection, xq [xq_len] words (M * K / 4 needed) and their
     * scales sx [sx_len] (M * K / G), allocated once by Python (fused.py); NULL / 0 without W8A8 */
    uint32_t *xq;
    float *sx;
    int64_t xq_len, sx_len;
} LkvWork;

/* prefill attention's register tile of nr query rows (entry nr of a table of LKV_PREFILL_TILES, the
 * first NULL) against one tile of 64 keys: the AVX-512 library's, called by the base library's
 * driver (prefill_attention.c, prefill_attention_bf16.c) */
#define LKV_PREFILL_TILES 7
typedef void (*LkvPrefillTile)(const uint32_t *q32, const int64_t *pos, const uint32_t *kp, const uint32_t *vp,
                               int64_t t0, int64_t D, float *o, float *m, float *l);

/* the transfer engine's copy kernel (lkv_copy_blocks's signature), handed to the lookahead layer */
typedef int (*LkvCopyFn)(const float *, const float *, int64_t, int64_t, float *, float *, int64_t, int64_t,
                         int64_t, const int64_t *, const int64_t *, const int64_t *, const int64_t *,
                         const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

/* a lookahead decode layer's bound tensors (lookahead_layer.c) */
typedef struct {
    const void *kmin, *kmax;           /* summaries [L, lanes * MB, KVH, D] of kv_dtype (the pool's) */
    const void *pool_k, *pool_v;       /* host pool [L, KVH, NB, bs, D] */
    void *tier_k, *tier_v;             /* device tier [buffers, lanes, KVH, slots, bs, D] */
    uint8_t *tier_mask;                /* [lanes, KVH, slots, bs] */
    int64_t *block, *last_used;        /* slot tables [buffers, lanes, KVH, K] */
    int64_t *slot_of;                  /* [buffers, lanes, KVH, MB + 1] */
    const int64_t *lane_blocks;        /* [lanes, MB]: logical -> host block */
    int64_t *pred;                     /* predictions [L, lanes, KVH, K] */
    uint8_t *has_pred;                 /* [L, lanes] */
    int64_t layers, lanes, kv_heads, heads, head_dim, block_size, max_blocks, top_k, sel_start, slots,
        pool_blocks, elem_bytes, kv_dtype, group_max;
    /* scratch, sized for every lane and two rows: scores [lanes, 2, KVH, MB], idx [lanes, 2, KVH,
     * K], want/prio [lanes, KVH, K], copy lists [2, lanes * KVH * K], mask [lanes, KVH, slots *
     * bs], lane ids 0..lanes-1; the draft row's own attention (LkvLayerCall.draft_fixed): its
     * block tables dtab [lanes, KVH, sel_start + K], key mask dmask [lanes, KVH, (sel_start + K) *
     * bs], query and output rows dq, dout [lanes, H, D], extra-key mask dxmask [lanes, 2] */
    float *scores, *prio;
    int64_t *idx, *want, *lists, *lane_ids;
    uint8_t *mask;
    int64_t *dtab;
    uint8_t *dmask, *dxmask;
    float *dq, *dout;
    LkvCopyFn copy;                    /* the transfer engine's copy kernel (urgent copies) */
} LkvLayerTensors;

/* one call of a lookahead decode layer */
typedef struct {
    int64_t layer, buf, n, rows, nb, k_sel, step, used_none, used_adm, nthreads;
    const float *q;                    /* [n, R, H, D] contiguous (R = rows: real, draft) */
    const float *kx, *vx;              /* the step's own rows (fp32) as extra keys, strides below */
    int64_t xksb, xksh, xkse, xvsb, xvsh, xvse;
    const uint8_t *cand;               /* candidates [n, R, MB] at cand + b*cand_sb + r*cand_sr */
    int64_t cand_sb, cand_sr;
    const uint8_t *extra_mask;         /* [n, R, R] */
    const uint8_t *fetch;              /* [n]: lanes whose real-row misses are fetched (urgent) */
    const uint8_t *active;             /* [n]: lanes that decode this step (others: no prediction) */
    float scale;
    float *out;                        /* [n, R, H, D] */
    int64_t *true_idx;                 /* out [n, KVH, K]: the real row's top-K (-1 padded) */
    uint8_t *resident;                 /* out [n, KVH, K]: of those, held before any fetch */
    int64_t predict_cap;               /* R = 2: admit at most this many predicted blocks per head */
    int64_t *pred_adm;                 /* out [4, n * KVH * K]: the prediction's admissions */
    int64_t *urgent_adm;               /* out [4, n * KVH * K]: the urgent admissions (copied) */
    /* R = 2: NULL, the draft row attends what the real row does (the device tier); else the draft
     * row attends its own top-K read from the host pool, with these logical blocks of each lane
     * before them ([n, sel_start], -1 padded: its sink and window blocks) and the first
     * draft_stored[b] tokens of lane b visible (0: a lane that does not decode) */
    const int64_t *draft_fixed, *draft_stored;
    double copy_s;                     /* out: seconds in the urgent copy */
    int64_t admitted, used, predicted; /* out: urgent blocks copied, selected slots read, admissions */
} LkvLayerCall;

/* ---- the descriptor (abi.c; in both libraries) ------------------------------------------------ */

/* One fact: "struct:S" (value sizeof S), "field:S.f" (value offsetof, size sizeof the field),
 * "code:LKV_..." / "storage:LKV_KV_..." / "limit:LKV_..." (value), "version" (LKV_ABI_VERSION). */
typedef struct {
    const char *name;
    int64_t value, size;
} LkvAbiEntry;

/* The descriptor's entries (*entries, static) and their count. */
int64_t lkv_abi_describe(const LkvAbiEntry **entries);

/* ---- the base library (AVX2 + FMA + F16C) ------------------------------------------------------ */

/* linear.c, linear_int8.c, elementwise.c */
void lkv_linear_packed(const float *x, int64_t M, int64_t K, const float *Wp, int64_t N, const float *bias,
                       float *y, int nthreads);
void lkv_linear_int8(const float *x, int64_t M, int64_t K, const int8_t *W, int64_t N, const float *scale,
                     int64_t group, const float *bias, float *y, int nthreads);
void lkv_rmsnorm(const float *x, int64_t xs, const float *w, float eps, float *y, int64_t ys, int64_t M, int64_t N);

/* attention.c: LKV_OK, LKV_ERR_NOMEM, LKV_ERR_ARG (kv_dtype), LKV_ERR_LIMIT (E, R * H / KVH) */
int lkv_attention(const float *q, const void *k, const void *v, int64_t ksb, int64_t ksh,
                  const uint8_t *kv_mask, const float *kx, int64_t xksb, int64_t xksh, int64_t xkse,
                  const float *vx, int64_t xvsb, int64_t xvsh, int64_t xvse, const uint8_t *extra_mask, float *out,
                  int64_t B, int64_t R, int64_t H, int64_t KVH, int64_t N, int64_t E, int64_t D, float scale,
                  int nthreads, int kv_dtype);
int lkv_attention_paged(const float *q, const void *k, const void *v, const int64_t *boff, int64_t ksh,
                        const uint8_t *kv_mask, float *out, int64_t B, int64_t H, int64_t KVH, int64_t N,
                        int64_t D, float scale, int nthreads, int kv_dtype);
int lkv_attention_paged_table(const float *q, const void *k, const void *v, const int64_t *btab, int64_t bts,
                              int64_t bs, int64_t ksh, const uint8_t *kv_mask, float *out, int64_t B, int64_t H,
                              int64_t KVH, int64_t N, int64_t D, float scale, int nthreads, int kv_dtype);
int lkv_attention_heads_table(const float *q, const void *k, const void *v, const int64_t *btab, int64_t T,
                              int64_t bs, int64_t ksh, const uint8_t *kv_mask, const float *kx, int64_t xksb,
                              int64_t xksh, int64_t xkse, const float *vx, int64_t xvsb, int64_t xvsh, int64_t xvse,
                              const uint8_t *extra_mask, float *out, int64_t B, int64_t R, int64_t H, int64_t KVH,
                              int64_t E, int64_t D, float scale, int nthreads, int kv_dtype);

/* topk.c: LKV_OK, LKV_ERR_NOMEM, LKV_ERR_ARG (k outside [1, NB]) */
int lkv_block_topk(const float *q, const void *kmin, const void *kmax, int64_t ksb, const uint8_t *valid,
                   int64_t vsb, int64_t vsr, int64_t B, int64_t R, int64_t H, int64_t KVH, int64_t NB,
                   int64_t D, int64_t k, int group_max, float *scores, int64_t *idx, int nthreads, int sum_dtype);

/* residency.c: lkv_plan returns the admissions' count, or LKV_ERR_NOMEM / LKV_ERR_RANGE;
 * lkv_copy_blocks LKV_OK or LKV_ERR_RANGE */
int64_t lkv_plan(int64_t *held_t, int64_t *last_t, int64_t *inv_t, const int64_t *lanes, int64_t L, int64_t B,
                 int64_t KVH, int64_t K, int64_t MB, const int64_t *want, const float *prio, int64_t KW,
                 int64_t cap, int64_t step, int64_t *out_lane, int64_t *out_head, int64_t *out_slot,
                 int64_t *out_block);
int lkv_copy_blocks(const float *src_k, const float *src_v, int64_t s_blk, int64_t s_head, float *dst_k,
                    float *dst_v, int64_t d_lane, int64_t d_head, int64_t d_slot, const int64_t *sb,
                    const int64_t *sh, const int64_t *dl, const int64_t *dh, const int64_t *ds, int64_t n,
                    int64_t unit, int64_t NB, int64_t KVH, int64_t NL, int64_t NS);

/* summaries.c: LKV_OK, LKV_ERR_RANGE (a block id), LKV_ERR_ARG (key_dtype) */
int lkv_update_summaries(void *kmin, void *kmax, const void *keys, const int64_t *block_ids,
                         const int64_t *block_offsets, int64_t T, int64_t KVH, int64_t D, int64_t num_blocks,
                         int key_dtype, int sum_dtype, int nthreads);

/* decode.c: the fused decode step and the layers around an outside attention */
int lkv_decode(const LkvModel *m, const LkvStep *st, const LkvWork *w, int64_t s0, int64_t s1, int nthreads);
void lkv_silu_mul(const float *gu, float *act, int64_t B, int64_t I, const void *exp8, int64_t chunk);
int lkv_ext_begin(const LkvModel *m, const LkvStep *st, const LkvWork *w);
int lkv_ext_qkv(const LkvModel *m, const LkvStep *st, const LkvWork *w, int64_t l, float *q, float *k, float *v,
                int nthreads);
int lkv_ext_rest(const LkvModel *m, const LkvStep *st, const LkvWork *w, int64_t l, const float *o, int nthreads);
void lkv_ext_end(const LkvModel *m, const LkvStep *st, const LkvWork *w);

/* lookahead_layer.c */
int lkv_lookahead_layer(const LkvLayerTensors *m, LkvLayerCall *c);

/* prefill_attention.c: its AVX2 path, or the AVX512_BF16 one with the AVX-512 library's tiles
 * (lkv_prefill_bf16_tiles; NULL: AVX2). LKV_OK, LKV_ERR_NOMEM, LKV_ERR_ARG */
int lkv_prefill_attention(const float *q, int64_t qs, const void *k, const void *v, int64_t hs, const int64_t *btab,
                          int64_t bs, int64_t L, int64_t n, int64_t H, int64_t KVH, int64_t D, float scale,
                          float *out, int64_t os, int nthreads, int kv_dtype, const LkvPrefillTile *tiles);

/* ---- the AVX-512 library (BF16 / VNNI) --------------------------------------------------------- */

/* gemm.c. Each entry that runs AVX-512 code checks the CPU first (once, cached): LKV_ERR_ISA
 * where it lacks the instructions. lkv_gemm_supported: bit 1 AVX512_BF16, bit 2 AVX512_VNNI. */
int lkv_gemm_supported(void);
void lkv_pack_bf16(const float *w, int64_t ws, int64_t N, int64_t K, uint32_t *wp, int nthreads);
int lkv_gemm_bf16(const float *x, int64_t xs, int64_t M, int64_t K, const uint32_t *wp, int64_t N, const float *bias,
                  float *y, int64_t ys, int nthreads);
void lkv_pack_w8a8(const int8_t *w, const float *scale, int64_t N, int64_t K, int64_t G, int32_t *wq, float *wsc,
                   int32_t *wsum, int nthreads);
int lkv_quantize_rows(const float *x, int64_t xs, int64_t M, int64_t K, int64_t G, uint32_t *xq, float *sx,
                      int nthreads);
int lkv_gemm_w8a8_scratch(const float *x, int64_t xs, int64_t M, int64_t K, int64_t G, const int32_t *wq,
                          const float *wsc, const int32_t *wsum, int64_t N, const float *bias, float *y, int64_t ys,
                          int nthreads, uint32_t *xq, float *sx);
int lkv_gemm_w8a8(const float *x, int64_t xs, int64_t M, int64_t K, int64_t G, const int32_t *wq, const float *wsc,
                  const int32_t *wsum, int64_t N, const float *bias, float *y, int64_t ys, int nthreads);

/* prefill_attention_bf16.c: the AVX512_BF16 tiles lkv_prefill_attention takes, or NULL where the
 * CPU lacks the units */
const LkvPrefillTile *lkv_prefill_bf16_tiles(void);

#endif
