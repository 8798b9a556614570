// block_topk: Quest upper-bound block scores, then the top-k blocks of each (sequence, KV head).
//
// Two kernels. score_kernel spreads the blocks over many thread blocks (it reads all summaries,
// the bulk of the bytes). select_kernel gives each (sequence, KV head) row one thread block: a
// 4 x 8-bit radix select finds the k-th largest score, then one ordered pass writes the chosen
// ids. Writing them in block order makes the output ascending with no sort, and taking the tied
// threshold scores in block order is exactly "ties go to the lower id".
#include "common.cuh"

namespace lookahead_kv::cuda
{
namespace
{

constexpr int kScoreWarps = 4;
constexpr int kBlocksPerScoreCta = 32;
constexpr int kSelectThreads = 256;
constexpr int kSelectWarps = kSelectThreads / 32;

// One warp per block: lanes stride over head_dim, the group's queries wait in shared memory.
// group_max 0: the group's head scores are summed (in one warp sum); 1: each head's score is
// warp-summed on its own and the group takes the largest.
template <typename T>
__global__ void __launch_bounds__(kScoreWarps * 32) score_kernel(T const* __restrict__ q,
    T const* __restrict__ kmin, T const* __restrict__ kmax, uint8_t const* __restrict__ valid,
    float* __restrict__ scores, int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks, int64_t head_dim,
    int64_t summary_batch_stride, int64_t rows_per_sequence, int64_t chunks_per_row, int32_t group_max)
{
    extern __shared__ float q_group[]; // [group, head_dim]
    int64_t const row = blockIdx.x / chunks_per_row; // b * num_kv_heads + g
    int64_t const chunk = blockIdx.x % chunks_per_row;
    int64_t const b = row / num_kv_heads;
    int64_t const g = row % num_kv_heads;
    int64_t const group = num_heads / num_kv_heads;

    T const* q_row = q + (b * num_heads + g * group) * head_dim; // the group's heads are adjacent
    for (int64_t i = threadIdx.x; i < group * head_dim; i += blockDim.x)
    {
        q_group[i] = to_float(q_row[i]);
    }
    __syncthreads();

    int const warp = threadIdx.x / 32;
    int const lane = threadIdx.x % 32;
    int64_t const last = min(num_blocks, (chunk + 1) * kBlocksPerScoreCta);
    for (int64_t n = chunk * kBlocksPerScoreCta + warp; n < last; n += kScoreWarps)
    {
        if (!valid[b * num_blocks + n])
        {
            if (lane == 0)
            {
                scores[row * num_blocks + n] = -INFINITY;
            }
            continue;
        }
        int64_t const base = (b / rows_per_sequence) * summary_batch_stride + (n * num_kv_heads + g) * head_dim;
        float s = 0.0f;
        if (group_max)
        {
            s = -INFINITY;
            for (int64_t h = 0; h < group; ++h)
            {
                float sh = 0.0f;
                for (int64_t d = lane; d < head_dim; d += 32)
                {
                    float const qd = q_group[h * head_dim + d];
                    sh += fmaxf(qd * to_float(kmin[base + d]), qd * to_float(kmax[base + d]));
                }
                s = fmaxf(s, warp_sum(sh)); // every lane holds the full sum after warp_sum
            }
        }
        else
        {
            for (int64_t d = lane; d < head_dim; d += 32)
            {
                float const lo = to_float(kmin[base + d]);
                float const hi = to_float(kmax[base + d]);
                for (int64_t h = 0; h < group; ++h)
                {
                    float const qd = q_group[h * head_dim + d];
                    s += fmaxf(qd * lo, qd * hi);
                }
            }
            s = warp_sum(s);
        }
        if (lane == 0)
        {
            scores[row * num_blocks + n] = s;
        }
    }
}

// Monotone map of a float onto uint32: a > b  <=>  order_key(a) > order_key(b).
__device__ __forceinline__ uint32_t order_key(float x)
{
    uint32_t const bits = __float_as_uint(x);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Exclusive prefix sum over the thread block; *total gets the sum of all. Ends synchronised.
__device__ uint64_t block_exclusive_sum(uint64_t x, uint64_t* total)
{
    __shared__ uint64_t warp_totals[kSelectWarps];
    int const warp = threadIdx.x / 32;
    int const lane = threadIdx.x % 32;
    uint64_t inclusive = x;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2)
    {
        uint64_t const y = __shfl_up_sync(kFullMask, inclusive, offset);
        if (lane >= offset)
        {
            inclusive += y;
        }
    }
    if (lane == 31)
    {
        warp_totals[warp] = inclusive;
    }
    __syncthreads();
    uint64_t before = 0;
    uint64_t sum = 0;
#pragma unroll
    for (int w = 0; w < kSelectWarps; ++w)
    {
        before += w < warp ? warp_totals[w] : 0;
        sum += warp_totals[w];
    }
    __syncthreads(); // warp_totals is reused by the next call
    *total = sum;
    return before + inclusive - x;
}

// Warp 0 finds the radix digit that holds the `remaining`-th largest key among hist[256] and
// publishes it with the count still needed inside that digit. Lane l owns bins [8l, 8l + 8).
__device__ void find_digit(uint32_t const* hist, uint32_t remaining, uint32_t* digit_out, uint32_t* remaining_out)
{
    int const lane = threadIdx.x % 32;
    uint32_t own = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i)
    {
        own += hist[lane * 8 + i];
    }
    uint32_t at_or_above = own; // keys in this lane's bins and every higher lane's
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2)
    {
        uint32_t const y = __shfl_down_sync(kFullMask, at_or_above, offset);
        if (lane + offset < 32)
        {
            at_or_above += y;
        }
    }
    uint32_t above = at_or_above - own;
    if (above < remaining && remaining <= at_or_above)
    {
        for (int bin = lane * 8 + 7; bin >= lane * 8; --bin)
        {
            if (above + hist[bin] >= remaining)
            {
                *digit_out = uint32_t(bin);
                *remaining_out = remaining - above;
                break;
            }
            above += hist[bin];
        }
    }
}

__global__ void __launch_bounds__(kSelectThreads) select_kernel(float const* __restrict__ scores,
    uint8_t const* __restrict__ valid, int64_t* __restrict__ indices, int64_t num_kv_heads, int64_t num_blocks,
    int64_t k)
{
    __shared__ uint32_t hist[256];
    __shared__ uint32_t digit;
    __shared__ uint32_t remaining_shared;

    int64_t const row = blockIdx.x;
    float const* row_scores = scores + row * num_blocks;
    uint8_t const* row_valid = valid + (row / num_kv_heads) * num_blocks;
    int64_t* out = indices + row * k;

    uint32_t num_valid = 0;
    for (int64_t base = 0; base < num_blocks; base += kSelectThreads)
    {
        int64_t const n = base + threadIdx.x;
        num_valid += __syncthreads_count(n < num_blocks && row_valid[n]);
    }
    uint32_t const take = uint32_t(min(int64_t(num_valid), k));
    bool const take_all = take == num_valid;

    // Radix select, most significant digit first: after the passes, `threshold` is the key of
    // the take-th largest valid score and `need` how many keys equal to it belong in the top.
    uint32_t threshold = 0;
    uint32_t need = 0;
    if (!take_all)
    {
        uint32_t prefix_mask = 0;
        uint32_t remaining = take;
        for (int shift = 24; shift >= 0; shift -= 8)
        {
            for (int i = threadIdx.x; i < 256; i += kSelectThreads)
            {
                hist[i] = 0;
            }
            __syncthreads();
            for (int64_t n = threadIdx.x; n < num_blocks; n += kSelectThreads)
            {
                uint32_t const key = order_key(row_scores[n]);
                if (row_valid[n] && (key & prefix_mask) == threshold)
                {
                    atomicAdd(&hist[(key >> shift) & 0xffu], 1u);
                }
            }
            __syncthreads();
            if (threadIdx.x < 32)
            {
                find_digit(hist, remaining, &digit, &remaining_shared);
            }
            __syncthreads();
            threshold |= digit << shift;
            prefix_mask |= 0xffu << shift;
            remaining = remaining_shared;
        }
        need = remaining;
    }

    // Ordered compaction: block n is chosen when its key beats the threshold, or ties it within
    // the first `need` ties; its slot counts the chosen blocks before it. Both counts come from
    // one scan of (ties << 32 | wins).
    uint32_t wins_before = 0;
    uint32_t ties_before = 0;
    for (int64_t base = 0; base < num_blocks; base += kSelectThreads)
    {
        int64_t const n = base + threadIdx.x;
        bool win = false;
        bool tie = false;
        if (n < num_blocks && row_valid[n])
        {
            uint32_t const key = order_key(row_scores[n]);
            win = take_all || key > threshold;
            tie = !take_all && key == threshold;
        }
        uint64_t total = 0;
        uint64_t const before = block_exclusive_sum((uint64_t(tie) << 32) | uint64_t(win), &total);
        uint32_t const my_wins = wins_before + uint32_t(before & 0xffffffffu);
        uint32_t const my_ties = ties_before + uint32_t(before >> 32);
        if (win || (tie && my_ties < need))
        {
            out[my_wins + min(my_ties, need)] = n;
        }
        wins_before += uint32_t(total & 0xffffffffu);
        ties_before += uint32_t(total >> 32);
    }
    for (int64_t i = take + threadIdx.x; i < k; i += kSelectThreads)
    {
        out[i] = -1;
    }
}

} // namespace
} // namespace lookahead_kv::cuda

extern "C" cudaError_t lookahead_kv_block_topk_rows(void const* q, void const* kmin, void const* kmax,
    uint8_t const* valid, int64_t* indices, float* scores, int64_t batch, int64_t rows_per_sequence,
    int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks, int64_t head_dim, int64_t summary_batch_stride,
    int64_t k, int32_t group_max, int32_t dtype, cudaStream_t stream)
{
    using namespace lookahead_kv::cuda;
    if (batch < 0 || rows_per_sequence < 1 || batch % rows_per_sequence != 0 || num_heads <= 0 || num_kv_heads <= 0
        || num_heads % num_kv_heads != 0 || num_blocks < 0 || num_blocks >= (int64_t(1) << 31) || head_dim <= 0
        || k <= 0
        || (batch / rows_per_sequence > 1 && summary_batch_stride < num_blocks * num_kv_heads * head_dim))
    {
        return cudaErrorInvalidValue;
    }
    int64_t const rows = batch * num_kv_heads;
    if (rows == 0)
    {
        return cudaSuccess;
    }
    size_t const q_bytes = size_t(num_heads / num_kv_heads) * size_t(head_dim) * sizeof(float);
    int64_t const chunks_per_row = ceil_div(num_blocks, kBlocksPerScoreCta);
    if (rows * chunks_per_row > kMaxGridX || rows > kMaxGridX || q_bytes > 48 * 1024)
    {
        return cudaErrorInvalidConfiguration;
    }
    if (num_blocks > 0)
    {
        cudaError_t const err = dispatch_dtype(dtype, [&](auto tag) {
            using T = typename decltype(tag)::type;
            score_kernel<T><<<unsigned(rows * chunks_per_row), kScoreWarps * 32, q_bytes, stream>>>(
                static_cast<T const*>(q), static_cast<T const*>(kmin), static_cast<T const*>(kmax), valid, scores,
                num_heads, num_kv_heads, num_blocks, head_dim, summary_batch_stride, rows_per_sequence, chunks_per_row,
                group_max);
            return cudaGetLastError();
        });
        if (err != cudaSuccess)
        {
            return err;
        }
    }
    select_kernel<<<unsigned(rows), kSelectThreads, 0, stream>>>(scores, valid, indices, num_kv_heads, num_blocks, k);
    return cudaGetLastError();
}

extern "C" cudaError_t lookahead_kv_block_topk_strided(void const* q, void const* kmin, void const* kmax,
    uint8_t const* valid, int64_t* indices, float* scores, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
    int64_t num_blocks, int64_t head_dim, int64_t summary_batch_stride, int64_t k, int32_t group_max, int32_t dtype,
    cudaStream_t stream)
{
    return lookahead_kv_block_topk_rows(q, kmin, kmax, valid, indices, scores, batch, 1, num_heads, num_kv_heads,
        num_blocks, head_dim, summary_batch_stride, k, group_max, dtype, stream);
}

extern "C" cudaError_t lookahead_kv_block_topk(void const* q, void const* kmin, void const* kmax,
    uint8_t const* valid, int64_t* indices, float* scores, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
    int64_t num_blocks, int64_t head_dim, int64_t k, int32_t group_max, int32_t dtype, cudaStream_t stream)
{
    return lookahead_kv_block_topk_strided(q, kmin, kmax, valid, indices, scores, batch, num_heads, num_kv_heads,
        num_blocks, head_dim, num_blocks * num_kv_heads * head_dim, k, group_max, dtype, stream);
}
