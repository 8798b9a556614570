// C ABI of the lookahead CUDA kernels: one set of launchers for the torch extension
// (torch_bindings.cpp), ctypes / cuda-python callers, and the TensorRT plugins.
//
// Every launcher takes raw pointers, int64 sizes, an element-type code and a stream; it only
// enqueues work (no allocation, no synchronisation) and returns the launch status. Tensors are
// dense and row-major in the shapes written next to each argument; plugins/CONTRACTS.md has the
// semantics and plugins/reference.py the plain-torch reference of each op.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

// Exported even from libraries built with -fvisibility=hidden (the TensorRT plugin library).
#if defined(_WIN32)
#define LOOKAHEAD_KV_API
#else
#define LOOKAHEAD_KV_API __attribute__((visibility("default")))
#endif

// Element type of the floating-point tensors a launcher reads and writes (`dtype` arguments).
enum LookaheadDType : int32_t
{
    kLookaheadFloat32 = 0,
    kLookaheadFloat16 = 1,
    kLookaheadBFloat16 = 2,
};

// The most selected slots per (lane, KV head) lookahead_kv_plan_slots plans (its top_k).
enum : int64_t
{
    kLookaheadPlanMaxSlots = 1024,
};

extern "C" {

// out[h, i] = src[block_ids[h, i], h]: a byte copy of one (block, head) row per id.
//   src        [num_blocks, num_kv_heads, row_bytes]   device memory, or pinned host memory through
//                                                      its device-accessible (UVA) pointer
//   block_ids  [num_kv_heads, num_ids] int64           device
//   out        [num_kv_heads, num_ids, row_bytes]      device
// row_bytes = block_size * head_dim * element size. 16-byte accesses when src, out and row_bytes
// allow, narrower otherwise. An id outside [0, num_blocks) (e.g. -1, an unused entry of a
// fixed-capacity list) yields a zero row and reads nothing, never a fault.
LOOKAHEAD_KV_API cudaError_t lookahead_kv_block_gather(void const* src, int64_t const* block_ids, void* out,
    int64_t num_blocks, int64_t num_kv_heads, int64_t num_ids, int64_t row_bytes, cudaStream_t stream);

// Quest upper-bound scores per (sequence, KV head, block) and the top-k blocks of each row.
//   q          [batch, num_heads, head_dim]                     dtype
//   kmin, kmax [batch, num_blocks, num_kv_heads, head_dim]      dtype
//   valid      [batch, num_blocks] bool (one byte each)
//   indices    [batch, num_kv_heads, k] int64   ascending; -1 past the valid count
//   scores     [batch, num_kv_heads, num_blocks] float32, -inf on invalid blocks
// A KV head's score is the sum (group_max 0) or the max (group_max 1) of its query heads' scores.
// Ties in score go to the lower block id. 1 <= k; num_blocks < 2^31.
LOOKAHEAD_KV_API cudaError_t lookahead_kv_block_topk(void const* q, void const* kmin, void const* kmax,
    uint8_t const* valid, int64_t* indices, float* scores, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
    int64_t num_blocks, int64_t head_dim, int64_t k, int32_t group_max, int32_t dtype, cudaStream_t stream);

// The same with the summaries' batch stride (elements between kmin[b] and kmin[b + 1], at least
// num_blocks * num_kv_heads * head_dim when batch > 1): a view of the first blocks of a larger
// per-sequence table is read in place. Past the batch dim the summaries are dense.
LOOKAHEAD_KV_API cudaError_t lookahead_kv_block_topk_strided(void const* q, void const* kmin, void const* kmax,
    uint8_t const* valid, int64_t* indices, float* scores, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
    int64_t num_blocks, int64_t head_dim, int64_t summary_batch_stride, int64_t k, int32_t group_max, int32_t dtype,
    cudaStream_t stream);

// The same for `rows_per_sequence` query rows per sequence (a decode step's real and draft rows,
// scored in one launch): q, valid, indices and scores have batch = sequences * rows_per_sequence
// rows, row i reading the summaries of sequence i / rows_per_sequence.
LOOKAHEAD_KV_API cudaError_t lookahead_kv_block_topk_rows(void const* q, void const* kmin, void const* kmax,
    uint8_t const* valid, int64_t* indices, float* scores, int64_t batch, int64_t rows_per_sequence,
    int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks, int64_t head_dim, int64_t summary_batch_stride,
    int64_t k, int32_t group_max, int32_t dtype, cudaStream_t stream);

// Fold keys into per-block min/max summaries, in place, as if applied token by token: offset 0
// resets the block's summary to the key, any other offset takes the min/max.
//   kmin, kmax     [num_blocks, num_kv_heads, head_dim]   dtype
//   keys           [num_tokens, num_kv_heads, head_dim]   dtype
//   block_ids      [num_tokens] int64   (ids outside [0, num_blocks) are skipped)
//   block_offsets  [num_tokens] int64
LOOKAHEAD_KV_API cudaError_t lookahead_kv_update_summaries(void* kmin, void* kmax, void const* keys,
    int64_t const* block_ids, int64_t const* block_offsets, int64_t num_tokens, int64_t num_blocks,
    int64_t num_kv_heads, int64_t head_dim, int32_t dtype, cudaStream_t stream);

// Bytes of scratch for lookahead_kv_attention: an upper bound that never decreases as any size
// grows, so a workspace sized for the largest shapes (TensorRT's getWorkspaceSize) serves all
// smaller ones. A smaller workspace is accepted too: the keys are then split over fewer blocks.
LOOKAHEAD_KV_API size_t lookahead_kv_attention_workspace_size(int64_t batch, int64_t num_rows, int64_t num_heads,
    int64_t num_kv_heads, int64_t num_keys, int64_t num_extra, int64_t head_dim);

// Dual-row sparse attention with GQA: row r, query head h (KV head g = h / (num_heads /
// num_kv_heads)) attends to k[b, g, n] where kv_mask[b, g, n] and to k_extra[b, g, e] where
// extra_mask[b, r, e]; softmax(scale * q.k) in fp32. A row that sees no key writes zeros.
//   q                 [batch, num_rows, num_heads, head_dim]        dtype
//   k, v              [batch, num_kv_heads, num_keys, head_dim]     dtype, 16-byte aligned
//   kv_mask           [batch, num_kv_heads, num_keys] bool
//   k_extra, v_extra  [batch, num_kv_heads, num_extra, head_dim]    dtype, 16-byte aligned
//   extra_mask        [batch, num_rows, num_extra] bool
//   out               [batch, num_rows, num_heads, head_dim]        dtype
// head_dim is 64, 128 or 256. workspace: device scratch of workspace_bytes (may be null / 0).
LOOKAHEAD_KV_API cudaError_t lookahead_kv_attention(void const* q, void const* k, void const* v,
    uint8_t const* kv_mask, void const* k_extra, void const* v_extra, uint8_t const* extra_mask, void* out,
    int64_t batch, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t num_keys, int64_t num_extra,
    int64_t head_dim, float scale, int32_t dtype, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// The residency's slot plan for `rows` lanes, in place (plugins/CONTRACTS.md, plan_slots): each
// (lane, KV head) admits up to `cap` of its missing wanted blocks, best score first, into the
// slots holding no wanted block, least recently selected first; wanted held slots are stamped
// `step`. The admissions are a fixed-capacity list of kc = min(cap, num_want) ranks per (lane,
// head), in (row, head, rank) order: the rank's victim slot, its block (0 when untaken) and
// whether it is an admission.
//   block, last_used  [num_lanes, num_kv_heads, top_k] int64        device, updated
//   slot_of           [num_lanes, num_kv_heads, slot_cols] int64    device, updated; column
//                     slot_cols - 1 is "no block" and stays -1
//   lanes             [rows] int64   distinct lanes in [0, num_lanes)
//   want              [rows, num_kv_heads, num_want] int64   blocks in [-1, min(slot_cols - 1, num_scores))
//   scores            [rows, num_kv_heads, num_scores] float32   a wanted block's priority: its score
//   slots, blocks     [rows * num_kv_heads * kc] int64
//   valid             [rows * num_kv_heads * kc] bool (one byte each)
// 1 <= top_k <= kLookaheadPlanMaxSlots, num_want <= top_k, cap >= 0. One thread per (lane, head).
LOOKAHEAD_KV_API cudaError_t lookahead_kv_plan_slots(int64_t* block, int64_t* last_used, int64_t* slot_of,
    int64_t const* lanes, int64_t const* want, float const* scores, int64_t* slots, int64_t* blocks,
    uint8_t* valid, int64_t rows, int64_t num_kv_heads, int64_t top_k, int64_t num_want, int64_t num_scores,
    int64_t slot_cols, int64_t cap, int64_t step, cudaStream_t stream);

// One copy job, K and V in one launch: dst[lanes[i], dst_heads[i], slots[i]] = src[blocks[i],
// src_heads[i]] for each entry i with valid[i] (valid null: every entry), as byte copies of
// row_bytes (block_size * head_dim * element size) each.
//   src_k, src_v   rows at src + block * src_block_stride + head * src_head_stride (bytes): device
//                  memory, or pinned host memory through its device-accessible (UVA) pointer
//   dst_k, dst_v   rows at dst + lane * dst_lane_stride + head * dst_head_stride
//                  + slot * dst_slot_stride (bytes), device memory; K and V share every stride
//   blocks, src_heads, lanes, dst_heads, slots   [n] int64, device; valid [n] bool or null
// The destinations of the entries are distinct. A block outside [0, num_blocks) (a skipped
// entry's -1) copies nothing; the other indices must be in range.
LOOKAHEAD_KV_API cudaError_t lookahead_kv_copy_blocks(void const* src_k, void const* src_v, void* dst_k,
    void* dst_v, int64_t const* blocks, int64_t const* src_heads, int64_t const* lanes, int64_t const* dst_heads,
    int64_t const* slots, uint8_t const* valid, int64_t n, int64_t num_blocks, int64_t src_block_stride,
    int64_t src_head_stride, int64_t dst_lane_stride, int64_t dst_head_stride, int64_t dst_slot_stride,
    int64_t row_bytes, cudaStream_t stream);

// The same copy on the host over host memory, by the code each kernel thread runs (tests only).
LOOKAHEAD_KV_API cudaError_t lookahead_kv_copy_blocks_host(void const* src_k, void const* src_v, void* dst_k,
    void* dst_v, int64_t const* blocks, int64_t const* src_heads, int64_t const* lanes, int64_t const* dst_heads,
    int64_t const* slots, uint8_t const* valid, int64_t n, int64_t num_blocks, int64_t src_block_stride,
    int64_t src_head_stride, int64_t dst_lane_stride, int64_t dst_head_stride, int64_t dst_slot_stride,
    int64_t row_bytes);

// The same plan run on the host, over host memory, by the code each kernel thread runs: the tests
// of a machine without a GPU check the kernel's rule through it. Never on a hot path.
LOOKAHEAD_KV_API cudaError_t lookahead_kv_plan_slots_host(int64_t* block, int64_t* last_used, int64_t* slot_of,
    int64_t const* lanes, int64_t const* want, float const* scores, int64_t* slots, int64_t* blocks,
    uint8_t* valid, int64_t rows, int64_t num_kv_heads, int64_t top_k, int64_t num_want, int64_t num_scores,
    int64_t slot_cols, int64_t cap, int64_t step);

} // extern "C"
