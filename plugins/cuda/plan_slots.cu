// plan_slots: the residency's slot plan for every (lane, KV head) of a decode layer in one launch.
//
// The rule (plugins/plan.py, plugins.reference.plan_slot_rule): a wanted block already held has
// its slot stamped with `step`; the missing wanted blocks, best score first (ties to the earlier
// request), go into the slots holding no wanted block, least recently selected first (empty
// slots, last used -1, first; ties to the lower slot), at most `cap` of them. Rank r of a
// (lane, head) is listed whether taken or not (a fixed-capacity list made without a host read):
// its victim slot, its block (0 when untaken) and whether it is an admission.
//
// One thread per (lane, head) (`plan_one`; `lookahead_kv_plan_slots_host` runs the same code on
// the host, for the tests of a machine without a GPU): a plan is K <= kLookaheadPlanMaxSlots
// slots and a few dozen admissions, bookkeeping a single warp finishes in microseconds; what it
// saves is the ~40 launches of the same rule in torch ops. The thread's slot and request flags live in bit sets (local memory).
#include "common.cuh"

namespace lookahead_kv::cuda
{
namespace
{

constexpr int kThreads = 128;
constexpr int kWords = kLookaheadPlanMaxSlots / 32;

__host__ __device__ __forceinline__ bool has(uint32_t const* bits, int64_t i)
{
    return (bits[i >> 5] >> (i & 31)) & 1u;
}

__host__ __device__ __forceinline__ void put(uint32_t* bits, int64_t i)
{
    bits[i >> 5] |= 1u << (i & 31);
}

struct PlanArgs
{
    int64_t* block;
    int64_t* last_used;
    int64_t* slot_of;
    int64_t const* lanes;
    int64_t const* want;
    float const* scores;
    int64_t* out_slots;
    int64_t* out_blocks;
    uint8_t* out_valid;
    int64_t rows, num_kv_heads, top_k, num_want, num_scores, slot_cols, kc, cap, step;
};

// The plan of (row, head) t = row * num_kv_heads + head: what one thread of the kernel runs (and
// the host entry below, for the tests of a machine without a GPU).
__host__ __device__ __forceinline__ void plan_one(PlanArgs const& a, int64_t t)
{
    int64_t const row = t / a.num_kv_heads;
    int64_t const lane_head = a.lanes[row] * a.num_kv_heads + (t - row * a.num_kv_heads);
    int64_t* held = a.block + lane_head * a.top_k;
    int64_t* last = a.last_used + lane_head * a.top_k;
    int64_t* inv = a.slot_of + lane_head * a.slot_cols;
    int64_t const* req = a.want + t * a.num_want;
    float const* score = a.scores + t * a.num_scores;         // a request's priority: its block's score
    int64_t const no_block = a.slot_cols - 1;     // the inverse map's spare column

    uint32_t wanted[kWords] = {};    // slots holding a wanted block
    uint32_t missing[kWords] = {};   // requests not held
    uint32_t used[kWords] = {};      // slots already ranked
    int64_t num_missing = 0;
    for (int64_t j = 0; j < a.num_want; ++j)
    {
        int64_t const b = req[j];
        if (b < 0 || b >= no_block)
        {
            continue;
        }
        int64_t const s = inv[b];
        if (s >= 0)
        {
            put(wanted, s);
            last[s] = a.step;
        }
        else
        {
            put(missing, j);
            ++num_missing;
        }
    }
    int64_t const admit = num_missing < a.cap ? num_missing : a.cap;
    int64_t* os = a.out_slots + t * a.kc;
    int64_t* ob = a.out_blocks + t * a.kc;
    uint8_t* ov = a.out_valid + t * a.kc;
    for (int64_t r = 0; r < a.kc; ++r)
    {
        // victim r: the lowest (wanted ? max : last used) among the slots not yet ranked
        int64_t victim = -1;
        int64_t victim_key = 0;
        for (int64_t s = 0; s < a.top_k; ++s)
        {
            if (has(used, s))
            {
                continue;
            }
            int64_t const key = has(wanted, s) ? INT64_MAX : last[s];
            if (victim < 0 || key < victim_key)
            {
                victim = s;
                victim_key = key;
            }
        }
        put(used, victim);
        os[r] = victim;
        ov[r] = r < admit;
        ob[r] = 0;
        if (r >= admit)
        {
            continue;
        }
        // request r: the best score among the missing requests not yet taken
        int64_t pick = -1;
        for (int64_t j = 0; j < a.num_want; ++j)
        {
            if (has(missing, j) && (pick < 0 || score[req[j]] > score[req[pick]]))
            {
                pick = j;
            }
        }
        missing[pick >> 5] &= ~(1u << (pick & 31));
        int64_t const b = req[pick];
        int64_t const evicted = held[victim];
        if (evicted >= 0 && evicted < no_block)
        {
            inv[evicted] = -1;
        }
        inv[b] = victim;
        held[victim] = b;
        last[victim] = a.step;
        ob[r] = b;
    }
}

__global__ void __launch_bounds__(kThreads, 8) plan_slots_kernel(__grid_constant__ PlanArgs const a)
{
    int64_t const t = int64_t(blockIdx.x) * kThreads + threadIdx.x;
    if (t < a.rows * a.num_kv_heads)
    {
        plan_one(a, t);
    }
}

// The launchers' shared checks; fills `a` (kc included). cudaSuccess with a.rows * heads > 0 and
// a.num_want > 0: there is a plan to run.
cudaError_t plan_args(PlanArgs& a, int64_t* block, int64_t* last_used, int64_t* slot_of, int64_t const* lanes,
    int64_t const* want, float const* scores, int64_t* slots, int64_t* blocks, uint8_t* valid, int64_t rows,
    int64_t num_kv_heads, int64_t top_k, int64_t num_want, int64_t num_scores, int64_t slot_cols, int64_t cap,
    int64_t step)
{
    if (rows < 0 || num_kv_heads < 0 || top_k < 1 || top_k > kLookaheadPlanMaxSlots || num_want < 0
        || num_want > top_k || num_scores < 0 || slot_cols < 1 || cap < 0)
    {
        return cudaErrorInvalidValue;
    }
    int64_t const kc = cap < num_want ? cap : num_want;
    a = PlanArgs{block, last_used, slot_of, lanes, want, scores, slots, blocks, valid, rows, num_kv_heads, top_k,
        num_want, num_scores, slot_cols, kc, cap, step};
    if (rows * num_kv_heads == 0 || num_want == 0)
    {
        return cudaSuccess;
    }
    if (block == nullptr || last_used == nullptr || slot_of == nullptr || lanes == nullptr || want == nullptr
        || scores == nullptr || (kc > 0 && (slots == nullptr || blocks == nullptr || valid == nullptr)))
    {
        return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

} // namespace
} // namespace lookahead_kv::cuda

extern "C" cudaError_t lookahead_kv_plan_slots(int64_t* block, int64_t* last_used, int64_t* slot_of,
    int64_t const* lanes, int64_t const* want, float const* scores, int64_t* slots, int64_t* blocks,
    uint8_t* valid, int64_t rows, int64_t num_kv_heads, int64_t top_k, int64_t num_want, int64_t num_scores,
    int64_t slot_cols, int64_t cap, int64_t step, cudaStream_t stream)
{
    using namespace lookahead_kv::cuda;
    PlanArgs a;
    cudaError_t const err = plan_args(a, block, last_used, slot_of, lanes, want, scores, slots, blocks, valid,
        rows, num_kv_heads, top_k, num_want, num_scores, slot_cols, cap, step);
    if (err != cudaSuccess || rows * num_kv_heads == 0 || num_want == 0)
    {
        return err;
    }
    int64_t const grid = ceil_div(rows * num_kv_heads, kThreads);
    if (grid > kMaxGridX)
    {
        return cudaErrorInvalidConfiguration;
    }
    plan_slots_kernel<<<unsigned(grid), kThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

extern "C" cudaError_t lookahead_kv_plan_slots_host(int64_t* block, int64_t* last_used, int64_t* slot_of,
    int64_t const* lanes, int64_t const* want, float const* scores, int64_t* slots, int64_t* blocks,
    uint8_t* valid, int64_t rows, int64_t num_kv_heads, int64_t top_k, int64_t num_want, int64_t num_scores,
    int64_t slot_cols, int64_t cap, int64_t step)
{
    using namespace lookahead_kv::cuda;
    PlanArgs a;
    cudaError_t const err = plan_args(a, block, last_used, slot_of, lanes, want, scores, slots, blocks, valid,
        rows, num_kv_heads, top_k, num_want, num_scores, slot_cols, cap, step);
    if (err != cudaSuccess || num_want == 0)
    {
        return err;
    }
    for (int64_t t = 0; t < rows * num_kv_heads; ++t)
    {
        plan_one(a, t);
    }
    return cudaSuccess;
}
