// copy_blocks: one copy job of the residency manager in one launch, K and V alike:
// dst[lanes[i], dst_heads[i], slots[i]] = src[blocks[i], src_heads[i]] for every listed entry i.
//
// The source is the host pool, read straight from pinned memory through its device-mapped
// address (or device memory), with any block and head strides; the destination is a device-tier
// buffer. Each (block, head) unit is one contiguous row of row_bytes. A fixed-capacity list
// (`valid`) skips entries without a host read: a skipped entry reads and writes nothing. As in
// block_gather, consecutive threads move consecutive 16-byte vectors of a row (coalesced), and
// blockIdx.y picks K (0) or V (1). `copy_one` is the code a thread runs; the host entry runs the
// same code over host memory for the tests of a machine without a GPU.
#include "common.cuh"

namespace lookahead_kv::cuda
{
namespace
{

constexpr int kThreads = 256;

struct CopyArgs
{
    char const* src[2];
    char* dst[2];
    int64_t const* blocks;
    int64_t const* src_heads;
    int64_t const* lanes;
    int64_t const* dst_heads;
    int64_t const* slots;
    uint8_t const* valid;
    int64_t n, num_blocks, src_block_stride, src_head_stride, dst_lane_stride, dst_head_stride, dst_slot_stride;
    int64_t row_bytes;
};

// Vector `idx` of the flat (entry, vector) space of tensor `which` (0: K, 1: V).
template <typename Vec>
__host__ __device__ __forceinline__ void copy_one(CopyArgs const& a, int which, int64_t idx)
{
    int64_t const vecs = a.row_bytes / int64_t(sizeof(Vec));
    int64_t const i = idx / vecs;
    int64_t const col = idx - i * vecs;
    if (a.valid != nullptr && !a.valid[i])
    {
        return;
    }
    int64_t const block = a.blocks[i];
    if (block < 0 || block >= a.num_blocks)
    {
        return;
    }
    Vec const* from = reinterpret_cast<Vec const*>(
        a.src[which] + block * a.src_block_stride + a.src_heads[i] * a.src_head_stride);
    Vec* to = reinterpret_cast<Vec*>(a.dst[which] + a.lanes[i] * a.dst_lane_stride
        + a.dst_heads[i] * a.dst_head_stride + a.slots[i] * a.dst_slot_stride);
    to[col] = from[col];
}

template <typename Vec>
__global__ void __launch_bounds__(kThreads) copy_blocks_kernel(__grid_constant__ CopyArgs const a, int64_t total)
{
    int64_t const idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
    if (idx < total)
    {
        copy_one<Vec>(a, int(blockIdx.y), idx);
    }
}

// The widest vector every row start and the row size are aligned to: 16, 8, 4, 2 or 1 bytes.
int vector_bytes(CopyArgs const& a)
{
    uintptr_t bits = uintptr_t(a.row_bytes) | uintptr_t(a.src_block_stride) | uintptr_t(a.src_head_stride)
        | uintptr_t(a.dst_lane_stride) | uintptr_t(a.dst_head_stride) | uintptr_t(a.dst_slot_stride);
    for (int t = 0; t < 2; ++t)
    {
        bits |= reinterpret_cast<uintptr_t>(a.src[t]) | reinterpret_cast<uintptr_t>(a.dst[t]);
    }
    for (int w = 16; w > 1; w /= 2)
    {
        if (bits % w == 0)
        {
            return w;
        }
    }
    return 1;
}

template <typename Vec>
cudaError_t launch(CopyArgs const& a, cudaStream_t stream)
{
    int64_t const total = a.n * (a.row_bytes / int64_t(sizeof(Vec)));
    int64_t const grid = ceil_div(total, kThreads);
    if (grid > kMaxGridX)
    {
        return cudaErrorInvalidConfiguration;
    }
    copy_blocks_kernel<Vec><<<dim3(unsigned(grid), 2), kThreads, 0, stream>>>(a, total);
    return cudaGetLastError();
}

template <typename Vec>
void run_on_host(CopyArgs const& a)
{
    int64_t const total = a.n * (a.row_bytes / int64_t(sizeof(Vec)));
    for (int which = 0; which < 2; ++which)
    {
        for (int64_t idx = 0; idx < total; ++idx)
        {
            copy_one<Vec>(a, which, idx);
        }
    }
}

cudaError_t copy_args(CopyArgs& a, void const* src_k, void const* src_v, void* dst_k, void* dst_v,
    int64_t const* blocks, int64_t const* src_heads, int64_t const* lanes, int64_t const* dst_heads,
    int64_t const* slots, uint8_t const* valid, int64_t n, int64_t num_blocks, int64_t src_block_stride,
    int64_t src_head_stride, int64_t dst_lane_stride, int64_t dst_head_stride, int64_t dst_slot_stride,
    int64_t row_bytes)
{
    if (n < 0 || num_blocks < 0 || row_bytes <= 0)
    {
        return cudaErrorInvalidValue;
    }
    a = CopyArgs{{static_cast<char const*>(src_k), static_cast<char const*>(src_v)},
        {static_cast<char*>(dst_k), static_cast<char*>(dst_v)}, blocks, src_heads, lanes, dst_heads, slots, valid, n,
        num_blocks, src_block_stride, src_head_stride, dst_lane_stride, dst_head_stride, dst_slot_stride, row_bytes};
    if (n > 0
        && (src_k == nullptr || src_v == nullptr || dst_k == nullptr || dst_v == nullptr || blocks == nullptr
            || src_heads == nullptr || lanes == nullptr || dst_heads == nullptr || slots == nullptr))
    {
        return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

// Checks and fills the arguments, then runs the copy: launched on `stream`, or (on_host) over host
// memory by the same per-thread code.
cudaError_t copy_blocks(bool on_host, void const* src_k, void const* src_v, void* dst_k, void* dst_v,
    int64_t const* blocks, int64_t const* src_heads, int64_t const* lanes, int64_t const* dst_heads,
    int64_t const* slots, uint8_t const* valid, int64_t n, int64_t num_blocks, int64_t src_block_stride,
    int64_t src_head_stride, int64_t dst_lane_stride, int64_t dst_head_stride, int64_t dst_slot_stride,
    int64_t row_bytes, cudaStream_t stream)
{
    CopyArgs a;
    cudaError_t const err = copy_args(a, src_k, src_v, dst_k, dst_v, blocks, src_heads, lanes, dst_heads, slots, valid,
        n, num_blocks, src_block_stride, src_head_stride, dst_lane_stride, dst_head_stride, dst_slot_stride,
        row_bytes);
    if (err != cudaSuccess || n == 0)
    {
        return err;
    }
    auto run = [&](auto tag) {
        using Vec = typename decltype(tag)::type;
        if (!on_host)
        {
            return launch<Vec>(a, stream);
        }
        run_on_host<Vec>(a);
        return cudaSuccess;
    };
    switch (vector_bytes(a))
    {
    case 16: return run(TypeTag<uint4>{});
    case 8: return run(TypeTag<uint2>{});
    case 4: return run(TypeTag<uint32_t>{});
    case 2: return run(TypeTag<uint16_t>{});
    default: return run(TypeTag<uint8_t>{});
    }
}

} // namespace
} // namespace lookahead_kv::cuda

extern "C" cudaError_t lookahead_kv_copy_blocks(void const* src_k, void const* src_v, void* dst_k, void* dst_v,
    int64_t const* blocks, int64_t const* src_heads, int64_t const* lanes, int64_t const* dst_heads,
    int64_t const* slots, uint8_t const* valid, int64_t n, int64_t num_blocks, int64_t src_block_stride,
    int64_t src_head_stride, int64_t dst_lane_stride, int64_t dst_head_stride, int64_t dst_slot_stride,
    int64_t row_bytes, cudaStream_t stream)
{
    return lookahead_kv::cuda::copy_blocks(false, src_k, src_v, dst_k, dst_v, blocks, src_heads, lanes, dst_heads,
        slots, valid, n, num_blocks, src_block_stride, src_head_stride, dst_lane_stride, dst_head_stride,
        dst_slot_stride, row_bytes, stream);
}

extern "C" cudaError_t lookahead_kv_copy_blocks_host(void const* src_k, void const* src_v, void* dst_k, void* dst_v,
    int64_t const* blocks, int64_t const* src_heads, int64_t const* lanes, int64_t const* dst_heads,
    int64_t const* slots, uint8_t const* valid, int64_t n, int64_t num_blocks, int64_t src_block_stride,
    int64_t src_head_stride, int64_t dst_lane_stride, int64_t dst_head_stride, int64_t dst_slot_stride,
    int64_t row_bytes)
{
    return lookahead_kv::cuda::copy_blocks(true, src_k, src_v, dst_k, dst_v, blocks, src_heads, lanes, dst_heads,
        slots, valid, n, num_blocks, src_block_stride, src_head_stride, dst_lane_stride, dst_head_stride,
        dst_slot_stride, row_bytes, nullptr);
}
