/* lkv_abi_describe: what lkv_abi.h defines, as this compiler laid it out (both libraries). The
 * loader (plugins/cpu/abi.py verify) compares it with the ctypes mirror before any kernel runs. */
#include "lkv_abi.h"

#define STRUCT(S) {"struct:" #S, (int64_t)sizeof(S), (int64_t)_Alignof(S)}
#define FIELD(S, f) {"field:" #S "." #f, (int64_t)offsetof(S, f), (int64_t)sizeof(((S *)0)->f)}
#define VALUE(kind, X) {kind ":" #X, (int64_t)(X), 0}

static const LkvAbiEntry ENTRIES[] = {
    {"version", LKV_ABI_VERSION, 0},

    VALUE("storage", LKV_KV_F32), VALUE("storage", LKV_KV_F16), VALUE("storage", LKV_KV_BF16),

    VALUE("code", LKV_OK), VALUE("code", LKV_ERR_NOMEM), VALUE("code", LKV_ERR_ARG), VALUE("code", LKV_DECLINED),
    VALUE("code", LKV_ERR_ISA), VALUE("code", LKV_ERR_RANGE), VALUE("code", LKV_ERR_SCRATCH),
    VALUE("code", LKV_ERR_LIMIT),

    VALUE("limit", LKV_MAX_ROWS), VALUE("limit", LKV_MAX_KV_ROW), VALUE("limit", LKV_MAX_EXTRA_KEYS),
    VALUE("limit", LKV_MAX_GROUP_ROWS), VALUE("limit", LKV_W8A8_MAX_GROUP),
    VALUE("limit", LKV_PREFILL_TILES),

    STRUCT(LkvLinear),
    FIELD(LkvLinear, w), FIELD(LkvLinear, scale), FIELD(LkvLinear, bias), FIELD(LkvLinear, n), FIELD(LkvLinear, k),
    FIELD(LkvLinear, int8), FIELD(LkvLinear, group), FIELD(LkvLinear, wq8), FIELD(LkvLinear, wsc8),
    FIELD(LkvLinear, wsum8), FIELD(LkvLinear, group8),

    STRUCT(LkvLayer),
    FIELD(LkvLayer, attn_norm), FIELD(LkvLayer, mlp_norm), FIELD(LkvLayer, wqkv), FIELD(LkvLayer, wo),
    FIELD(LkvLayer, w13), FIELD(LkvLayer, w2), FIELD(LkvLayer, k), FIELD(LkvLayer, v), FIELD(LkvLayer, q_norm),
    FIELD(LkvLayer, k_norm),

    STRUCT(LkvModel),
    FIELD(LkvModel, num_layers), FIELD(LkvModel, hidden), FIELD(LkvModel, heads), FIELD(LkvModel, kv_heads),
    FIELD(LkvModel, head_dim), FIELD(LkvModel, inter), FIELD(LkvModel, vocab), FIELD(LkvModel, num_blocks),
    FIELD(LkvModel, block_size), FIELD(LkvModel, max_pos), FIELD(LkvModel, kv_dtype), FIELD(LkvModel, eps),
    FIELD(LkvModel, scale), FIELD(LkvModel, cos), FIELD(LkvModel, sin), FIELD(LkvModel, embed),
    FIELD(LkvModel, embed_scale), FIELD(LkvModel, norm), FIELD(LkvModel, layers), FIELD(LkvModel, exp8),
    FIELD(LkvModel, silu_chunk), FIELD(LkvModel, embed_group), FIELD(LkvModel, sel_kmin), FIELD(LkvModel, sel_kmax),
    FIELD(LkvModel, sel_top_k), FIELD(LkvModel, sel_sink), FIELD(LkvModel, sel_window),
    FIELD(LkvModel, sel_group_max), FIELD(LkvModel, w8a8),

    STRUCT(LkvStep),
    FIELD(LkvStep, B), FIELD(LkvStep, N), FIELD(LkvStep, tokens), FIELD(LkvStep, positions),
    FIELD(LkvStep, slot_blocks), FIELD(LkvStep, slot_offsets), FIELD(LkvStep, run_starts), FIELD(LkvStep, lens),
    FIELD(LkvStep, tables), FIELD(LkvStep, table_stride),

    STRUCT(LkvWork),
    FIELD(LkvWork, x), FIELD(LkvWork, h), FIELD(LkvWork, qkv), FIELD(LkvWork, q), FIELD(LkvWork, o),
    FIELD(LkvWork, t), FIELD(LkvWork, gu), FIELD(LkvWork, act), FIELD(LkvWork, out), FIELD(LkvWork, mask),
    FIELD(LkvWork, boff), FIELD(LkvWork, sel_scores), FIELD(LkvWork, sel_idx), FIELD(LkvWork, sel_valid),
    FIELD(LkvWork, xq), FIELD(LkvWork, sx), FIELD(LkvWork, xq_len), FIELD(LkvWork, sx_len),

    STRUCT(LkvLayerTensors),
    FIELD(LkvLayerTensors, kmin), FIELD(LkvLayerTensors, kmax), FIELD(LkvLayerTensors, pool_k),
    FIELD(LkvLayerTensors, pool_v), FIELD(LkvLayerTensors, tier_k), FIELD(LkvLayerTensors, tier_v),
    FIELD(LkvLayerTensors, tier_mask), FIELD(LkvLayerTensors, block), FIELD(LkvLayerTensors, last_used),
    FIELD(LkvLayerTensors, slot_of), FIELD(LkvLayerTensors, lane_blocks), FIELD(LkvLayerTensors, pred),
    FIELD(LkvLayerTensors, has_pred), FIELD(LkvLayerTensors, layers), FIELD(LkvLayerTensors, lanes),
    FIELD(LkvLayerTensors, kv_heads), FIELD(LkvLayerTensors, heads), FIELD(LkvLayerTensors, head_dim),
    FIELD(LkvLayerTensors, block_size), FIELD(LkvLayerTensors, max_blocks), FIELD(LkvLayerTensors, top_k),
    FIELD(LkvLayerTensors, sel_start), FIELD(LkvLayerTensors, slots), FIELD(LkvLayerTensors, pool_blocks),
    FIELD(LkvLayerTensors, elem_bytes), FIELD(LkvLayerTensors, kv_dtype), FIELD(LkvLayerTensors, group_max),
    FIELD(LkvLayerTensors, scores), FIELD(LkvLayerTensors, prio), FIELD(LkvLayerTensors, idx),
    FIELD(LkvLayerTensors, want), FIELD(LkvLayerTensors, lists), FIELD(LkvLayerTensors, lane_ids),
    FIELD(LkvLayerTensors, mask), FIELD(LkvLayerTensors, dtab), FIELD(LkvLayerTensors, dmask),
    FIELD(LkvLayerTensors, dxmask), FIELD(LkvLayerTensors, dq), FIELD(LkvLayerTensors, dout),
    FIELD(LkvLayerTensors, copy),

    STRUCT(LkvLayerCall),
    FIELD(LkvLayerCall, layer), FIELD(LkvLayerCall, buf), FIELD(LkvLayerCall, n), FIELD(LkvLayerCall, rows),
    FIELD(LkvLayerCall, nb), FIELD(LkvLayerCall, k_sel), FIELD(LkvLayerCall, step), FIELD(LkvLayerCall, used_none),
    FIELD(LkvLayerCall, used_adm), FIELD(LkvLayerCall, nthreads), FIELD(LkvLayerCall, q), FIELD(LkvLayerCall, kx),
    FIELD(LkvLayerCall, vx), FIELD(LkvLayerCall, xksb), FIELD(LkvLayerCall, xksh), FIELD(LkvLayerCall, xkse),
    FIELD(LkvLayerCall, xvsb), FIELD(LkvLayerCall, xvsh), FIELD(LkvLayerCall, xvse), FIELD(LkvLayerCall, cand),
    FIELD(LkvLayerCall, cand_sb), FIELD(LkvLayerCall, cand_sr), FIELD(LkvLayerCall, extra_mask),
    FIELD(LkvLayerCall, fetch), FIELD(LkvLayerCall, active), FIELD(LkvLayerCall, scale), FIELD(LkvLayerCall, out),
    FIELD(LkvLayerCall, true_idx), FIELD(LkvLayerCall, resident), FIELD(LkvLayerCall, predict_cap),
    FIELD(LkvLayerCall, pred_adm), FIELD(LkvLayerCall, urgent_adm), FIELD(LkvLayerCall, draft_fixed),
    FIELD(LkvLayerCall, draft_stored), FIELD(LkvLayerCall, copy_s),
    FIELD(LkvLayerCall, admitted), FIELD(LkvLayerCall, used), FIELD(LkvLayerCall, predicted),
};

int64_t lkv_abi_describe(const LkvAbiEntry **entries) {
    *entries = ENTRIES;
    return (int64_t)(sizeof(ENTRIES) / sizeof(ENTRIES[0]));
}
