// lookahead_attention: sparse decode attention for the real and the draft row of each sequence.
//
// Thread block = (sequence b, KV head g, query chunk, key split). All query vectors that read KV
// head g -- the GQA group's heads times the R rows, up to kMaxQueries -- share every K/V tile
// loaded into shared memory, so the gathered KV is read from HBM once per KV head, not once per
// query head or row. Keys are split across thread blocks (flash-decoding) so that a batch of one
// still fills the GPU; combine_kernel merges the splits' partial softmaxes. All softmax
// arithmetic is fp32 in the log2 domain (q is pre-scaled by scale * log2(e)).
//
// Per tile of kTile keys, warp w owns queries w, w + 4, ...: lane j scores key j against them,
// the warp reduces max / sum with shuffles, then each lane accumulates P @ V for its slice of
// head_dim. Warps never exchange data, so a tile costs two __syncthreads (load, then reuse).
#include "common.cuh"

#include <algorithm>

namespace lookahead_kv::cuda
{
namespace
{

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 32; // keys per shared-memory tile: one per lane while scoring
constexpr int kRowsPerWarp = 4;
constexpr int kMaxQueries = kWarps * kRowsPerWarp; // query vectors per thread block
constexpr int kMinBlocksPerSm = 4; // caps registers at 128: no spills for any dtype / head_dim
constexpr int kCombineThreads = 64;
constexpr int64_t kTargetCtas = 264;     // about two waves on the 132 SMs of an H100 / H200
constexpr int64_t kMinKeysPerSplit = 128; // below this a split's fixed cost dominates
constexpr int64_t kMaxSplits = 64;

struct Params
{
    void const* q;
    void const* k;
    void const* v;
    uint8_t const* kv_mask;
    void const* k_extra;
    void const* v_extra;
    uint8_t const* extra_mask;
    void* out;
    float* part_out; // [num_splits, rows_total, head_dim], each split's softmax-normalised output
    float2* part_ml; // [num_splits, rows_total], each split's (max, sum) in the log2 domain
    int64_t num_rows;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t num_keys;
    int64_t num_extra;
    int64_t group;          // query heads per KV head
    int64_t queries;        // num_rows * group: query vectors per KV head
    int64_t query_chunks;   // ceil(queries / kMaxQueries)
    int64_t rows_total;     // batch * num_rows * num_heads
    int64_t num_splits;
    int64_t keys_per_split; // a multiple of kTile
    float scale_log2;
};

struct Plan
{
    int64_t group;
    int64_t queries;
    int64_t query_chunks;
    int64_t rows_total;
    int64_t total_keys;
    int64_t num_splits;
    int64_t keys_per_split;
};

void set_splits(Plan& plan, int64_t splits)
{
    splits = std::max<int64_t>(1, splits);
    plan.keys_per_split = std::max<int64_t>(kTile, ceil_div(ceil_div(plan.total_keys, splits), kTile) * kTile);
    plan.num_splits = std::max<int64_t>(1, ceil_div(plan.total_keys, plan.keys_per_split));
}

Plan make_plan(int64_t batch, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t num_keys,
    int64_t num_extra)
{
    Plan plan{};
    plan.group = num_heads / num_kv_heads;
    plan.queries = num_rows * plan.group;
    plan.query_chunks = ceil_div(plan.queries, kMaxQueries);
    plan.rows_total = batch * num_rows * num_heads;
    plan.total_keys = num_keys + num_extra;
    int64_t const ctas = std::max<int64_t>(1, batch * num_kv_heads * plan.query_chunks);
    int64_t const by_length = std::max<int64_t>(1, ceil_div(plan.total_keys, kMinKeysPerSplit));
    set_splits(plan, std::min({ceil_div(kTargetCtas, ctas), by_length, kMaxSplits}));
    return plan;
}

size_t partial_out_bytes(Plan const& plan, int64_t head_dim)
{
    return size_t(ceil_div(plan.num_splits * plan.rows_total * head_dim * int64_t(sizeof(float)), 16) * 16);
}

// Scratch the plan needs (<= lookahead_kv_attention_workspace_size of the same sizes).
size_t workspace_bytes(Plan const& plan, int64_t head_dim)
{
    if (plan.num_splits <= 1)
    {
        return 0; // one split writes the output directly
    }
    return partial_out_bytes(plan, head_dim) + size_t(plan.num_splits * plan.rows_total) * sizeof(float2);
}

// N elements of T at src (aligned to their total size), as floats.
template <typename T, int N>
__device__ __forceinline__ void load_elems(char const* src, float* out)
{
    constexpr int kBytes = N * int(sizeof(T));
    if constexpr (kBytes % 16 == 0)
    {
#pragma unroll
        for (int w = 0; w < kBytes / 16; ++w)
        {
            unpack16<T>(reinterpret_cast<uint4 const*>(src)[w], out + w * (16 / int(sizeof(T))));
        }
    }
    else if constexpr (kBytes == 8)
    {
        uint2 const raw = *reinterpret_cast<uint2 const*>(src);
        T const* elems = reinterpret_cast<T const*>(&raw);
#pragma unroll
        for (int i = 0; i < N; ++i)
        {
            out[i] = to_float(elems[i]);
        }
    }
    else
    {
        static_assert(kBytes == 4, "a lane's slice of a V row is 4, 8 or a multiple of 16 bytes");
        uint32_t const raw = *reinterpret_cast<uint32_t const*>(src);
        T const* elems = reinterpret_cast<T const*>(&raw);
#pragma unroll
        for (int i = 0; i < N; ++i)
        {
            out[i] = to_float(elems[i]);
        }
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) attention_kernel(Params p)
{
    constexpr int kVecElems = 16 / int(sizeof(T));
    constexpr int kChunks = D / kVecElems;              // 16-byte chunks per K/V row
    constexpr int kLaneElems = D / 32;                  // output columns per lane
    constexpr int kKStride = D * int(sizeof(T)) + 16;   // the pad puts the lanes' K rows on distinct banks
    constexpr int kVStride = D * int(sizeof(T));

    extern __shared__ uint4 smem[];
    char* const k_tile = reinterpret_cast<char*>(smem);
    char* const v_tile = k_tile + kTile * kKStride;
    float* const q_tile = reinterpret_cast<float*>(v_tile + kTile * kVStride); // [num_q, D]

    int64_t id = blockIdx.x;
    int64_t const split = id % p.num_splits;
    id /= p.num_splits;
    int64_t const q_first = (id % p.query_chunks) * kMaxQueries;
    int64_t const bg = id / p.query_chunks; // b * num_kv_heads + g
    int64_t const b = bg / p.num_kv_heads;
    int64_t const g = bg % p.num_kv_heads;
    int const num_q = int(min(int64_t(kMaxQueries), p.queries - q_first));
    int const warp = threadIdx.x / 32;
    int const lane = threadIdx.x % 32;

    // Local query m is query q_first + m of KV head g: row (q_first + m) / group, head
    // g * group + (q_first + m) % group.
    int64_t const group = p.group;
    int64_t const num_rows = p.num_rows;
    int64_t const num_heads = p.num_heads;
    auto row_of = [=](int m) { return (q_first + m) / group; };
    auto out_row = [=](int m) {
        return (b * num_rows + (q_first + m) / group) * num_heads + g * group + (q_first + m) % group;
    };

    T const* const q = static_cast<T const*>(p.q);
    for (int i = threadIdx.x; i < num_q * D; i += kThreads)
    {
        q_tile[i] = to_float(q[out_row(i / D) * D + i % D]) * p.scale_log2;
    }

    float acc[kRowsPerWarp][kLaneElems];
    float row_max[kRowsPerWarp];
    float row_sum[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
    {
        row_max[i] = -INFINITY;
        row_sum[i] = 0.0f;
#pragma unroll
        for (int e = 0; e < kLaneElems; ++e)
        {
            acc[i][e] = 0.0f;
        }
    }

    int64_t const num_keys = p.num_keys;
    int64_t const num_extra = p.num_extra;
    T const* const k_rows = static_cast<T const*>(p.k) + bg * num_keys * D;
    T const* const v_rows = static_cast<T const*>(p.v) + bg * num_keys * D;
    T const* const k_extra_rows = static_cast<T const*>(p.k_extra) + bg * num_extra * D;
    T const* const v_extra_rows = static_cast<T const*>(p.v_extra) + bg * num_extra * D;
    uint8_t const* const kv_mask = p.kv_mask + bg * num_keys;
    uint8_t const* const extra_mask = p.extra_mask + b * num_rows * num_extra; // [num_rows, num_extra]

    int64_t const key_begin = split * p.keys_per_split;
    int64_t const key_end = min(num_keys + num_extra, key_begin + p.keys_per_split);
    for (int64_t tile = key_begin; tile < key_end; tile += kTile)
    {
        __syncthreads(); // q_tile is written, or the previous tile is consumed
        // Keys no row sees stay zero in shared memory: padding never reaches P @ V, even as NaN.
        for (int i = threadIdx.x; i < kTile * kChunks; i += kThreads)
        {
            int const j = i / kChunks;
            int const c = i % kChunks;
            int64_t const pos = tile + j;
            uint4 k_vec = make_uint4(0, 0, 0, 0);
            uint4 v_vec = make_uint4(0, 0, 0, 0);
            if (pos < key_end)
            {
                bool seen = false;
                T const* k_src;
                T const* v_src;
                if (pos < num_keys)
                {
                    seen = kv_mask[pos];
                    k_src = k_rows + pos * D;
                    v_src = v_rows + pos * D;
                }
                else
                {
                    for (int64_t r = 0; r < num_rows && !seen; ++r)
                    {
                        seen = extra_mask[r * num_extra + pos - num_keys];
                    }
                    k_src = k_extra_rows + (pos - num_keys) * D;
                    v_src = v_extra_rows + (pos - num_keys) * D;
                }
                if (seen)
                {
                    k_vec = reinterpret_cast<uint4 const*>(k_src)[c];
                    v_vec = reinterpret_cast<uint4 const*>(v_src)[c];
                }
            }
            *reinterpret_cast<uint4*>(k_tile + j * kKStride + c * 16) = k_vec;
            *reinterpret_cast<uint4*>(v_tile + j * kVStride + c * 16) = v_vec;
        }
        __syncthreads();

        // Scores of key `tile + lane` against the warp's queries.
        float s[kRowsPerWarp];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i)
        {
            s[i] = 0.0f;
        }
        uint4 const* const k_row = reinterpret_cast<uint4 const*>(k_tile + lane * kKStride);
#pragma unroll 4
        for (int c = 0; c < kChunks; ++c)
        {
            float kf[kVecElems];
            unpack16<T>(k_row[c], kf);
#pragma unroll
            for (int i = 0; i < kRowsPerWarp; ++i)
            {
                int const m = warp + i * kWarps;
                if (m < num_q)
                {
                    float const* qv = q_tile + m * D + c * kVecElems;
#pragma unroll
                    for (int e = 0; e < kVecElems; ++e)
                    {
                        s[i] = fmaf(qv[e], kf[e], s[i]);
                    }
                }
            }
        }

        // Online softmax, one row at a time; every branch below is uniform across the warp.
        int64_t const pos = tile + lane;
        bool const in_range = pos < key_end;
        bool const kv_seen = in_range && pos < num_keys && kv_mask[pos];
        float prob[kRowsPerWarp];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i)
        {
            prob[i] = 0.0f;
            int const m = warp + i * kWarps;
            if (m >= num_q)
            {
                continue;
            }
            bool const seen = pos < num_keys
                ? kv_seen
                : in_range && extra_mask[row_of(m) * num_extra + pos - num_keys];
            float const score = seen ? s[i] : -INFINITY;
            float const new_max = fmaxf(row_max[i], warp_max(score));
            if (new_max == -INFINITY)
            {
                continue; // no visible key so far: the state stays empty
            }
            float const rescale = exp2f(row_max[i] - new_max); // 0 when row_max was -inf
            prob[i] = exp2f(score - new_max);                 // 0 for hidden keys
            row_sum[i] = row_sum[i] * rescale + warp_sum(prob[i]);
            row_max[i] = new_max;
#pragma unroll
            for (int e = 0; e < kLaneElems; ++e)
            {
                acc[i][e] *= rescale;
            }
        }

        // P @ V for this lane's columns [lane * kLaneElems, (lane + 1) * kLaneElems).
#pragma unroll 4
        for (int j = 0; j < kTile; ++j)
        {
            float vf[kLaneElems];
            load_elems<T, kLaneElems>(v_tile + j * kVStride + lane * kLaneElems * int(sizeof(T)), vf);
#pragma unroll
            for (int i = 0; i < kRowsPerWarp; ++i)
            {
                if (warp + i * kWarps < num_q)
                {
                    float const pj = __shfl_sync(kFullMask, prob[i], j);
#pragma unroll
                    for (int e = 0; e < kLaneElems; ++e)
                    {
                        acc[i][e] = fmaf(pj, vf[e], acc[i][e]);
                    }
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
    {
        int const m = warp + i * kWarps;
        if (m >= num_q)
        {
            continue;
        }
        int64_t const row = out_row(m);
        float const inv = row_sum[i] > 0.0f ? 1.0f / row_sum[i] : 0.0f; // no visible key: zeros
        int64_t const col = lane * kLaneElems;
        if (p.num_splits == 1)
        {
            T* const out = static_cast<T*>(p.out) + row * D + col;
#pragma unroll
            for (int e = 0; e < kLaneElems; ++e)
            {
                out[e] = from_float<T>(acc[i][e] * inv);
            }
        }
        else
        {
            float* const out = p.part_out + (split * p.rows_total + row) * D + col;
#pragma unroll
            for (int e = 0; e < kLaneElems; ++e)
            {
                out[e] = acc[i][e] * inv;
            }
            if (lane == 0)
            {
                p.part_ml[split * p.rows_total + row] = make_float2(row_max[i], row_sum[i]);
            }
        }
    }
}

// out[row] = sum_s w_s * o_s / sum_s w_s, with w_s = sum_s * 2^(max_s - max over splits).
template <typename T>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(float const* __restrict__ part_out,
    float2 const* __restrict__ part_ml, T* __restrict__ out, int64_t rows_total, int64_t num_splits, int64_t head_dim)
{
    int64_t const row = blockIdx.x;
    float top = -INFINITY;
    for (int64_t s = 0; s < num_splits; ++s)
    {
        top = fmaxf(top, part_ml[s * rows_total + row].x);
    }
    for (int64_t d = threadIdx.x; d < head_dim; d += kCombineThreads)
    {
        float num = 0.0f;
        float den = 0.0f;
        for (int64_t s = 0; s < num_splits; ++s)
        {
            float2 const ml = part_ml[s * rows_total + row];
            if (ml.y > 0.0f) // a split that saw no key has no weight (and max -inf)
            {
                float const w = ml.y * exp2f(ml.x - top);
                num = fmaf(w, part_out[(s * rows_total + row) * head_dim + d], num);
                den += w;
            }
        }
        out[row * head_dim + d] = from_float<T>(den > 0.0f ? num / den : 0.0f);
    }
}

template <typename T, int D>
cudaError_t launch_attention(Params const& params, Plan const& plan, int64_t batch, int64_t num_kv_heads,
    cudaStream_t stream)
{
    int64_t const grid = batch * num_kv_heads * plan.query_chunks * plan.num_splits;
    if (grid > kMaxGridX || plan.rows_total > kMaxGridX)
    {
        return cudaErrorInvalidConfiguration;
    }
    size_t const smem = size_t(kTile) * (2 * D * sizeof(T) + 16)
        + size_t(std::min<int64_t>(plan.queries, kMaxQueries)) * D * sizeof(float);
    if (smem > 48 * 1024)
    {
        cudaError_t const err
            = cudaFuncSetAttribute(attention_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
        if (err != cudaSuccess)
        {
            return err;
        }
    }
    attention_kernel<T, D><<<unsigned(grid), kThreads, smem, stream>>>(params);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess || plan.num_splits == 1)
    {
        return err;
    }
    combine_kernel<T><<<unsigned(plan.rows_total), kCombineThreads, 0, stream>>>(
        params.part_out, params.part_ml, static_cast<T*>(params.out), plan.rows_total, plan.num_splits, D);
    return cudaGetLastError();
}

bool aligned16(void const* ptr)
{
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

} // namespace
} // namespace lookahead_kv::cuda

extern "C" size_t lookahead_kv_attention_workspace_size(int64_t batch, int64_t num_rows, int64_t num_heads,
    int64_t num_kv_heads, int64_t num_keys, int64_t num_extra, int64_t head_dim)
{
    using namespace lookahead_kv::cuda;
    if (batch <= 0 || num_rows <= 0 || num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0
        || num_keys < 0 || num_extra < 0 || head_dim <= 0)
    {
        return 0;
    }
    // An upper bound that never decreases as any size grows, so a workspace sized for the largest
    // shapes (TensorRT's getWorkspaceSize) serves every smaller one. With ctas = batch * KVH *
    // query_chunks, splits <= 264 / ctas + 1 and rows_total / ctas <= kMaxQueries, hence
    // splits * rows_total <= kTargetCtas * kMaxQueries + rows_total.
    int64_t const rows_total = batch * num_rows * num_heads;
    int64_t const slots = kTargetCtas * kMaxQueries + rows_total;
    return size_t(slots * (head_dim * int64_t(sizeof(float)) + int64_t(sizeof(float2))) + 16);
}

extern "C" cudaError_t lookahead_kv_attention(void const* q, void const* k, void const* v, uint8_t const* kv_mask,
    void const* k_extra, void const* v_extra, uint8_t const* extra_mask, void* out, int64_t batch, int64_t num_rows,
    int64_t num_heads, int64_t num_kv_heads, int64_t num_keys, int64_t num_extra, int64_t head_dim, float scale,
    int32_t dtype, void* workspace, size_t workspace_bytes_given, cudaStream_t stream)
{
    using namespace lookahead_kv::cuda;
    if (batch < 0 || num_rows < 0 || num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0
        || num_keys < 0 || num_extra < 0 || !(head_dim == 64 || head_dim == 128 || head_dim == 256))
    {
        return cudaErrorInvalidValue;
    }
    if (batch == 0 || num_rows == 0)
    {
        return cudaSuccess;
    }
    if (!aligned16(k) || !aligned16(v) || (num_extra > 0 && (!aligned16(k_extra) || !aligned16(v_extra))))
    {
        return cudaErrorMisalignedAddress; // K/V tiles move in 16-byte vectors
    }

    Plan plan = make_plan(batch, num_rows, num_heads, num_kv_heads, num_keys, num_extra);
    if (workspace == nullptr || !aligned16(workspace))
    {
        workspace_bytes_given = 0;
    }
    if (workspace_bytes(plan, head_dim) > workspace_bytes_given)
    {
        // Fewer splits fit: each takes rows_total * (head_dim floats + one float2), plus padding.
        int64_t const per_split = plan.rows_total * (head_dim * int64_t(sizeof(float)) + int64_t(sizeof(float2))) + 16;
        set_splits(plan, std::min(plan.num_splits, int64_t(workspace_bytes_given) / per_split));
    }

    Params params{};
    params.q = q;
    params.k = k;
    params.v = v;
    params.kv_mask = kv_mask;
    params.k_extra = k_extra;
    params.v_extra = v_extra;
    params.extra_mask = extra_mask;
    params.out = out;
    params.part_out = static_cast<float*>(workspace);
    params.part_ml = plan.num_splits > 1
        ? reinterpret_cast<float2*>(static_cast<char*>(workspace) + partial_out_bytes(plan, head_dim))
        : nullptr;
    params.num_rows = num_rows;
    params.num_heads = num_heads;
    params.num_kv_heads = num_kv_heads;
    params.num_keys = num_keys;
    params.num_extra = num_extra;
    params.group = plan.group;
    params.queries = plan.queries;
    params.query_chunks = plan.query_chunks;
    params.rows_total = plan.rows_total;
    params.num_splits = plan.num_splits;
    params.keys_per_split = plan.keys_per_split;
    params.scale_log2 = scale * 1.4426950408889634f; // log2(e)

    return dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        switch (head_dim)
        {
        case 64: return launch_attention<T, 64>(params, plan, batch, num_kv_heads, stream);
        case 128: return launch_attention<T, 128>(params, plan, batch, num_kv_heads, stream);
        default: return launch_attention<T, 256>(params, plan, batch, num_kv_heads, stream);
        }
    });
}
