// Thin torch wrappers over the C launchers: check devices, layouts and dtypes, call on the current
// stream, raise on a launch error. Outputs are passed in (the `_out` style), so the Python
// loader allocates them and tests can poison them first. Shapes are checked by the op wrappers
// in plugins/*.py; here only what the kernels would otherwise misread: every float input of a
// call must have the one dtype the kernel is instantiated for (q's, or the summaries'), since a
// launcher takes a single element-type code (the loader widens 16-bit KV storage first).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "lookahead_kernels.h"

namespace
{

int32_t dtype_code(at::Tensor const& t)
{
    switch (t.scalar_type())
    {
    case at::kFloat: return kLookaheadFloat32;
    case at::kHalf: return kLookaheadFloat16;
    case at::kBFloat16: return kLookaheadBFloat16;
    default: break;
    }
    TORCH_CHECK(false, "lookahead kernels take float32, float16 or bfloat16, got ", t.scalar_type());
    return -1;
}

void check_launch(cudaError_t err, char const* op)
{
    TORCH_CHECK(err == cudaSuccess, "lookahead::", op, " CUDA launch failed: ", cudaGetErrorString(err));
}

void check_device(at::Tensor const& t, char const* name, at::Device device)
{
    TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_dtype(at::Tensor const& t, char const* name, at::Tensor const& like, char const* like_name)
{
    TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have ", like_name, "'s dtype ",
        like.scalar_type(), ", got ", t.scalar_type(), " (the kernel reads one dtype per call)");
}

// The summaries of block_topk, [B, NB, KVH, D]: read in place with their batch stride (a view of
// the first lanes and blocks of a larger table), each (block, head) row dense.
void check_summary_rows(at::Tensor const& t, char const* name)
{
    TORCH_CHECK(t.dim() == 4, name, " must be [B, NB, KVH, D]");
    int64_t const nb = t.size(1), kvh = t.size(2), d = t.size(3);
    TORCH_CHECK(t.stride(3) == 1 && (kvh == 1 || t.stride(2) == d) && (nb == 1 || t.stride(1) == kvh * d),
        name, " must be dense past its batch dim (strides [*, KVH*D, D, 1]), got strides ", t.strides());
}

uint8_t const* mask_ptr(at::Tensor const& t)
{
    TORCH_CHECK(t.scalar_type() == at::kBool, "masks must be bool, got ", t.scalar_type());
    return reinterpret_cast<uint8_t const*>(t.data_ptr<bool>());
}

// A pointer the GPU can dereference for src: itself on the device, or the device-mapped alias
// of a pinned host allocation (the same address under UVA; looked up so interior views work).
void const* device_readable(at::Tensor const& src)
{
    if (src.is_cuda())
    {
        return src.data_ptr();
    }
    TORCH_CHECK(src.is_cpu() && src.is_pinned(), "a host src must be pinned (Tensor.pin_memory())");
    cudaPointerAttributes attr{};
    check_launch(cudaPointerGetAttributes(&attr, src.data_ptr()), "block_gather (cudaPointerGetAttributes)");
    TORCH_CHECK(attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr,
        "block_gather: src is pinned but not mapped into the device's address space");
    return attr.devicePointer;
}

void block_gather_out(at::Tensor const& src, at::Tensor const& block_ids, at::Tensor& out)
{
    at::Device const device = out.device();
    c10::cuda::CUDAGuard guard(device);
    check_device(block_ids, "block_ids", device);
    TORCH_CHECK(src.is_contiguous(), "src must be contiguous");
    TORCH_CHECK(out.is_contiguous() && out.scalar_type() == src.scalar_type(), "out must be contiguous, dtype of src");
    TORCH_CHECK(block_ids.scalar_type() == at::kLong, "block_ids must be int64");
    int64_t const row_bytes = src.size(2) * src.size(3) * src.element_size();
    check_launch(lookahead_kv_block_gather(device_readable(src), block_ids.data_ptr<int64_t>(), out.data_ptr(),
                     src.size(0), src.size(1), block_ids.size(1), row_bytes, c10::cuda::getCurrentCUDAStream()),
        "block_gather");
}

void block_topk_out(at::Tensor const& q, at::Tensor const& kmin, at::Tensor const& kmax, at::Tensor const& valid,
    int64_t k, bool group_max, at::Tensor& indices, at::Tensor& scores)
{
    at::Device const device = q.device();
    c10::cuda::CUDAGuard guard(device);
    for (auto [t, name] : {std::pair{q, "q"}, {valid, "valid"}, {indices, "indices"}, {scores, "scores"}})
    {
        check_device(t, name, device);
    }
    for (auto [t, name] : {std::pair{kmin, "kmin"}, {kmax, "kmax"}})
    {
        TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
        check_summary_rows(t, name);
        check_dtype(t, name, q, "q");
    }
    TORCH_CHECK(kmin.strides() == kmax.strides(), "kmin and kmax must share strides, got ", kmin.strides(), " and ",
        kmax.strides());
    TORCH_CHECK(indices.scalar_type() == at::kLong && scores.scalar_type() == at::kFloat,
        "indices must be int64 and scores float32");
    // q's rows are R per sequence of the summaries (R = 2: a decode step's real and draft rows)
    int64_t const sequences = kmin.size(0);
    int64_t const rows = sequences > 0 ? q.size(0) / sequences : 1;
    TORCH_CHECK(q.size(0) == sequences * rows, "q's rows (", q.size(0), ") must be a multiple of the summaries' ",
        "sequences (", sequences, ")");
    check_launch(lookahead_kv_block_topk_rows(q.data_ptr(), kmin.data_ptr(), kmax.data_ptr(), mask_ptr(valid),
                     indices.data_ptr<int64_t>(), scores.data_ptr<float>(), q.size(0), rows, q.size(1), kmin.size(2),
                     kmin.size(1), q.size(2), kmin.stride(0), k, group_max ? 1 : 0, dtype_code(q),
                     c10::cuda::getCurrentCUDAStream()),
        "block_topk");
}

void update_summaries(at::Tensor& kmin, at::Tensor& kmax, at::Tensor const& keys, at::Tensor const& block_ids,
    at::Tensor const& block_offsets)
{
    at::Device const device = kmin.device();
    c10::cuda::CUDAGuard guard(device);
    for (auto [t, name] : {std::pair{kmin, "kmin"}, {kmax, "kmax"}, {keys, "keys"}, {block_ids, "block_ids"},
             {block_offsets, "block_offsets"}})
    {
        check_device(t, name, device);
    }
    check_dtype(kmax, "kmax", kmin, "kmin");
    check_dtype(keys, "keys", kmin, "kmin");
    TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_offsets.scalar_type() == at::kLong,
        "block_ids and block_offsets must be int64");
    check_launch(lookahead_kv_update_summaries(kmin.data_ptr(), kmax.data_ptr(), keys.data_ptr(),
                     block_ids.data_ptr<int64_t>(), block_offsets.data_ptr<int64_t>(), keys.size(0), kmin.size(0),
                     kmin.size(1), kmin.size(2), dtype_code(kmin), c10::cuda::getCurrentCUDAStream()),
        "update_summaries");
}

void lookahead_attention_out(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor const& kv_mask,
    at::Tensor const& k_extra, at::Tensor const& v_extra, at::Tensor const& extra_mask, double scale, at::Tensor& out)
{
    at::Device const device = q.device();
    c10::cuda::CUDAGuard guard(device);
    for (auto [t, name] : {std::pair{q, "q"}, {k, "k"}, {v, "v"}, {kv_mask, "kv_mask"}, {k_extra, "k_extra"},
             {v_extra, "v_extra"}, {extra_mask, "extra_mask"}, {out, "out"}})
    {
        check_device(t, name, device);
    }
    for (auto [t, name] : {std::pair{k, "k"}, {v, "v"}, {k_extra, "k_extra"}, {v_extra, "v_extra"}, {out, "out"}})
    {
        check_dtype(t, name, q, "q");
    }
    int64_t const batch = q.size(0), num_rows = q.size(1), num_heads = q.size(2), head_dim = q.size(3);
    int64_t const num_kv_heads = k.size(1), num_keys = k.size(2), num_extra = k_extra.size(2);
    size_t const ws_bytes = lookahead_kv_attention_workspace_size(
        batch, num_rows, num_heads, num_kv_heads, num_keys, num_extra, head_dim);
    // From the caching allocator: a step's workspace is a free-list hit, not a cudaMalloc.
    at::Tensor workspace = at::empty({int64_t(ws_bytes)}, q.options().dtype(at::kByte));
    check_launch(lookahead_kv_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), mask_ptr(kv_mask),
                     k_extra.data_ptr(), v_extra.data_ptr(), mask_ptr(extra_mask), out.data_ptr(), batch, num_rows,
                     num_heads, num_kv_heads, num_keys, num_extra, head_dim, float(scale), dtype_code(q),
                     ws_bytes ? workspace.data_ptr() : nullptr, ws_bytes, c10::cuda::getCurrentCUDAStream()),
        "lookahead_attention");
}

void plan_slots_out(at::Tensor& block, at::Tensor& last_used, at::Tensor& slot_of, at::Tensor const& lanes,
    at::Tensor const& want, at::Tensor const& scores, int64_t cap, int64_t step, at::Tensor& slots,
    at::Tensor& blocks, at::Tensor& valid)
{
    at::Device const device = block.device();
    c10::cuda::CUDAGuard guard(device);
    for (auto [t, name] : {std::pair{block, "block"}, {last_used, "last_used"}, {slot_of, "slot_of"},
             {lanes, "lanes"}, {want, "want"}, {slots, "slots"}, {blocks, "blocks"}})
    {
        check_device(t, name, device);
        TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
    }
    check_device(scores, "scores", device);
    TORCH_CHECK(scores.scalar_type() == at::kFloat, "scores must be float32, got ", scores.scalar_type());
    check_device(valid, "valid", device);
    TORCH_CHECK(valid.scalar_type() == at::kBool, "valid must be bool, got ", valid.scalar_type());
    check_launch(lookahead_kv_plan_slots(block.data_ptr<int64_t>(), last_used.data_ptr<int64_t>(),
                     slot_of.data_ptr<int64_t>(), lanes.data_ptr<int64_t>(), want.data_ptr<int64_t>(),
                     scores.data_ptr<float>(), slots.data_ptr<int64_t>(), blocks.data_ptr<int64_t>(),
                     reinterpret_cast<uint8_t*>(valid.data_ptr<bool>()), want.size(0), block.size(1), block.size(2),
                     want.size(2), scores.size(2), slot_of.size(2), cap, step, c10::cuda::getCurrentCUDAStream()),
        "plan_slots");
}

void copy_blocks(at::Tensor const& src_k, at::Tensor const& src_v, at::Tensor& dst_k, at::Tensor& dst_v,
    at::Tensor const& blocks, at::Tensor const& src_heads, at::Tensor const& lanes, at::Tensor const& dst_heads,
    at::Tensor const& slots, std::optional<at::Tensor> const& valid)
{
    at::Device const device = dst_k.device();
    c10::cuda::CUDAGuard guard(device);
    TORCH_CHECK(dst_k.is_cuda() && dst_v.device() == device, "copy_blocks: dst_k and dst_v must be on one GPU");
    for (auto [t, name] : {std::pair{blocks, "blocks"}, {src_heads, "src_heads"}, {lanes, "lanes"},
             {dst_heads, "dst_heads"}, {slots, "slots"}})
    {
        check_device(t, name, device);
        TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
        TORCH_CHECK(t.dim() == 1 && t.size(0) == blocks.size(0), name, " must be [n] like blocks");
    }
    if (valid)
    {
        check_device(*valid, "valid", device);
        TORCH_CHECK(valid->dim() == 1 && valid->size(0) == blocks.size(0), "valid must be [n] like blocks");
    }
    TORCH_CHECK(src_k.dim() == 4 && dst_k.dim() == 5, "copy_blocks: src [NB, KVH, bs, D], dst [L, KVH, S, bs, D]");
    TORCH_CHECK(src_k.strides() == src_v.strides() && src_k.sizes() == src_v.sizes(),
        "src_k and src_v must share shape and strides");
    TORCH_CHECK(dst_k.strides() == dst_v.strides() && dst_k.sizes() == dst_v.sizes(),
        "dst_k and dst_v must share shape and strides");
    for (auto [t, name] : {std::pair{src_v, "src_v"}, {dst_k, "dst_k"}, {dst_v, "dst_v"}})
    {
        check_dtype(t, name, src_k, "src_k");
    }
    int64_t const bs = src_k.size(2), d = src_k.size(3), es = src_k.element_size();
    TORCH_CHECK(src_k.stride(3) == 1 && (bs == 1 || src_k.stride(2) == d), "src rows [bs, D] must be dense");
    TORCH_CHECK(dst_k.stride(4) == 1 && (bs == 1 || dst_k.stride(3) == d) && dst_k.size(3) == bs && dst_k.size(4) == d,
        "dst rows [bs, D] must be dense and match src's");
    check_launch(lookahead_kv_copy_blocks(device_readable(src_k), device_readable(src_v), dst_k.data_ptr(),
                     dst_v.data_ptr(), blocks.data_ptr<int64_t>(), src_heads.data_ptr<int64_t>(),
                     lanes.data_ptr<int64_t>(), dst_heads.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
                     valid ? mask_ptr(*valid) : nullptr, blocks.size(0), src_k.size(0), src_k.stride(0) * es,
                     src_k.stride(1) * es, dst_k.stride(0) * es, dst_k.stride(1) * es, dst_k.stride(2) * es,
                     bs * d * es, c10::cuda::getCurrentCUDAStream()),
        "copy_blocks");
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.doc() = "lookahead CUDA kernels (plugins/cuda); call through torch.ops.lookahead, not directly";
    m.def("block_gather_out", &block_gather_out, "out[h, i] = src[block_ids[h, i], h]; src on device or pinned host");
    m.def("block_topk_out", &block_topk_out,
        "Quest block scores and the top-k per (query row, KV head); q may hold R rows per sequence");
    m.def("update_summaries", &update_summaries, "fold keys into block min/max summaries, in place");
    m.def("lookahead_attention_out", &lookahead_attention_out, "dual-row sparse GQA attention");
    m.def("copy_blocks", &copy_blocks, "a copy job's units, K and V, into device slots; src on device or pinned host");
    m.def("plan_slots_out", &plan_slots_out, "the residency's slot plan, in place; a fixed-capacity admission list");
    m.def("attention_workspace_size", &lookahead_kv_attention_workspace_size, "bytes of scratch the launcher wants");
}
