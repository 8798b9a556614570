// block_gather: out[h, i] = src[block_ids[h, i], h], straight from pinned host memory (or HBM).
//
// Zero-copy over PCIe is bound by how many reads are in flight, not by arithmetic: each thread
// issues kUnroll independent 16-byte loads before its first store, and consecutive threads touch
// consecutive 16 bytes of a row, so every warp request is one coalesced 512-byte read.
#include "common.cuh"

namespace lookahead_kv::cuda
{
namespace
{

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// One flat index space over all output vectors: row = h * num_ids + i, then vectors of a row.
template <typename Vec>
__global__ void __launch_bounds__(kThreads) block_gather_kernel(Vec const* __restrict__ src,
    int64_t const* __restrict__ block_ids, Vec* __restrict__ out, int64_t num_blocks, int64_t num_kv_heads,
    int64_t num_ids, int64_t vecs_per_row, int64_t total)
{
    int64_t const first = int64_t(blockIdx.x) * (kThreads * kUnroll) + threadIdx.x;
    Vec vals[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
    {
        int64_t const idx = first + int64_t(u) * kThreads;
        vals[u] = Vec{};
        if (idx < total)
        {
            int64_t const row = idx / vecs_per_row;
            int64_t const col = idx - row * vecs_per_row;
            int64_t const block = block_ids[row];
            if (block >= 0 && block < num_blocks)
            {
                int64_t const head = row / num_ids;
                vals[u] = src[(block * num_kv_heads + head) * vecs_per_row + col];
            }
        }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
    {
        int64_t const idx = first + int64_t(u) * kThreads;
        if (idx < total)
        {
            out[idx] = vals[u];
        }
    }
}

template <typename Vec>
cudaError_t launch_gather(void const* src, int64_t const* block_ids, void* out, int64_t num_blocks,
    int64_t num_kv_heads, int64_t num_ids, int64_t row_bytes, cudaStream_t stream)
{
    int64_t const vecs_per_row = row_bytes / int64_t(sizeof(Vec));
    int64_t const total = num_kv_heads * num_ids * vecs_per_row;
    int64_t const grid = ceil_div(total, kThreads * kUnroll);
    if (grid > kMaxGridX)
    {
        return cudaErrorInvalidConfiguration;
    }
    block_gather_kernel<Vec><<<unsigned(grid), kThreads, 0, stream>>>(static_cast<Vec const*>(src), block_ids,
        static_cast<Vec*>(out), num_blocks, num_kv_heads, num_ids, vecs_per_row, total);
    return cudaGetLastError();
}

} // namespace
} // namespace lookahead_kv::cuda

extern "C" cudaError_t lookahead_kv_block_gather(void const* src, int64_t const* block_ids, void* out,
    int64_t num_blocks, int64_t num_kv_heads, int64_t num_ids, int64_t row_bytes, cudaStream_t stream)
{
    using namespace lookahead_kv::cuda;
    if (num_blocks < 0 || num_kv_heads < 0 || num_ids < 0 || row_bytes <= 0)
    {
        return cudaErrorInvalidValue;
    }
    if (num_kv_heads == 0 || num_ids == 0)
    {
        return cudaSuccess;
    }
    if (src == nullptr || block_ids == nullptr || out == nullptr)
    {
        return cudaErrorInvalidValue;
    }
    // The widest access that every row start in src and out is aligned to.
    uintptr_t const bits = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(out) | uintptr_t(row_bytes);
    if (bits % 16 == 0)
    {
        return launch_gather<uint4>(src, block_ids, out, num_blocks, num_kv_heads, num_ids, row_bytes, stream);
    }
    if (bits % 8 == 0)
    {
        return launch_gather<uint2>(src, block_ids, out, num_blocks, num_kv_heads, num_ids, row_bytes, stream);
    }
    if (bits % 4 == 0)
    {
        return launch_gather<uint32_t>(src, block_ids, out, num_blocks, num_kv_heads, num_ids, row_bytes, stream);
    }
    if (bits % 2 == 0)
    {
        return launch_gather<uint16_t>(src, block_ids, out, num_blocks, num_kv_heads, num_ids, row_bytes, stream);
    }
    return launch_gather<uint8_t>(src, block_ids, out, num_blocks, num_kv_heads, num_ids, row_bytes, stream);
}
