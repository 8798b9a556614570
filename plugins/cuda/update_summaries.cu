// update_summaries: fold appended keys into per-block min/max summaries, in token order.
//
// Each block's summary is owned by exactly one thread block, so a column is read, folded and
// written by a single thread in token order and the result equals the sequential definition for
// any order of block ids. One thread block is launched per token; only the token that starts the
// earliest run of a block's ids does the work. Runs are contiguous in practice (prefill writes a
// block's tokens back to back, decode writes one token per sequence); a block that reappears
// later in the call is folded by the same owner, through a slower scan.
#include "common.cuh"

#include <algorithm>

namespace lookahead_kv::cuda
{
namespace
{

template <typename T>
struct Fold
{
    float lo = 0.0f;
    float hi = 0.0f;
    bool started = false; // false: the old summary still stands

    __device__ void apply(T key, bool reset, T const* old_min, T const* old_max)
    {
        float const x = to_float(key);
        if (reset)
        {
            lo = hi = x;
        }
        else
        {
            if (!started)
            {
                lo = to_float(*old_min);
                hi = to_float(*old_max);
            }
            lo = fminf(lo, x);
            hi = fmaxf(hi, x);
        }
        started = true;
    }
};

template <typename T>
__global__ void update_summaries_kernel(T* __restrict__ kmin, T* __restrict__ kmax, T const* __restrict__ keys,
    int64_t const* __restrict__ block_ids, int64_t const* __restrict__ block_offsets, int64_t num_tokens,
    int64_t num_blocks, int64_t num_cols)
{
    int64_t const start = blockIdx.x;
    int64_t const block = block_ids[start];
    if ((start > 0 && block_ids[start - 1] == block) || block < 0 || block >= num_blocks)
    {
        return; // not a run start, or an id with no summary
    }
    for (int64_t base = 0; base < start; base += blockDim.x)
    {
        int64_t const t = base + threadIdx.x;
        if (__syncthreads_or(t < start && block_ids[t] == block))
        {
            return; // an earlier run of this block owns it
        }
    }
    int64_t end = start + 1;
    while (end < num_tokens && block_ids[end] == block)
    {
        ++end;
    }

    for (int64_t col_base = 0; col_base < num_cols; col_base += blockDim.x)
    {
        int64_t const col = col_base + threadIdx.x;
        bool const active = col < num_cols;
        T* const dst_min = kmin + block * num_cols + col;
        T* const dst_max = kmax + block * num_cols + col;
        Fold<T> fold;
        if (active)
        {
            for (int64_t t = start; t < end; ++t)
            {
                fold.apply(keys[t * num_cols + col], block_offsets[t] == 0, dst_min, dst_max);
            }
        }
        // Tokens of this block after its first run, if any: rare, so one vote per chunk.
        for (int64_t base = end; base < num_tokens; base += blockDim.x)
        {
            int64_t const t = base + threadIdx.x;
            if (!__syncthreads_or(t < num_tokens && block_ids[t] == block))
            {
                continue;
            }
            int64_t const stop = min(base + int64_t(blockDim.x), num_tokens);
            for (int64_t u = base; active && u < stop; ++u)
            {
                if (block_ids[u] == block)
                {
                    fold.apply(keys[u * num_cols + col], block_offsets[u] == 0, dst_min, dst_max);
                }
            }
        }
        if (active)
        {
            *dst_min = from_float<T>(fold.lo);
            *dst_max = from_float<T>(fold.hi);
        }
    }
}

} // namespace
} // namespace lookahead_kv::cuda

extern "C" cudaError_t lookahead_kv_update_summaries(void* kmin, void* kmax, void const* keys,
    int64_t const* block_ids, int64_t const* block_offsets, int64_t num_tokens, int64_t num_blocks,
    int64_t num_kv_heads, int64_t head_dim, int32_t dtype, cudaStream_t stream)
{
    using namespace lookahead_kv::cuda;
    if (num_tokens < 0 || num_blocks < 0 || num_kv_heads < 0 || head_dim < 0)
    {
        return cudaErrorInvalidValue;
    }
    int64_t const num_cols = num_kv_heads * head_dim;
    if (num_tokens == 0 || num_cols == 0)
    {
        return cudaSuccess;
    }
    if (num_tokens > kMaxGridX)
    {
        return cudaErrorInvalidConfiguration;
    }
    // One thread per column where possible, so the rare later-run scan happens once per column.
    int const threads = int(std::min<int64_t>(512, std::max<int64_t>(64, ceil_div(num_cols, 32) * 32)));
    return dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        update_summaries_kernel<T><<<unsigned(num_tokens), threads, 0, stream>>>(static_cast<T*>(kmin),
            static_cast<T*>(kmax), static_cast<T const*>(keys), block_ids, block_offsets, num_tokens, num_blocks,
            num_cols);
        return cudaGetLastError();
    });
}
