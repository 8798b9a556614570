// Device helpers shared by the lookahead kernels: element conversion, warp reductions, dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "lookahead_kernels.h"

namespace lookahead_kv::cuda
{

constexpr unsigned kFullMask = 0xffffffffu;

// Explicit conversions only: torch extensions build with __CUDA_NO_HALF_CONVERSIONS__ and friends.
__device__ __forceinline__ float to_float(float x)
{
    return x;
}
__device__ __forceinline__ float to_float(__half x)
{
    return __half2float(x);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x)
{
    return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x)
{
    return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x)
{
    return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x)
{
    return __float2bfloat16_rn(x);
}

// The 16 / sizeof(T) elements of one 16-byte vector, as floats.
template <typename T>
__device__ __forceinline__ void unpack16(uint4 raw, float* out)
{
    T const* elems = reinterpret_cast<T const*>(&raw);
#pragma unroll
    for (int i = 0; i < int(16 / sizeof(T)); ++i)
    {
        out[i] = to_float(elems[i]);
    }
}

__device__ __forceinline__ float warp_max(float x)
{
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
    {
        x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
    }
    return x;
}

__device__ __forceinline__ float warp_sum(float x)
{
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
    {
        x += __shfl_xor_sync(kFullMask, x, offset);
    }
    return x;
}

template <typename T>
struct TypeTag
{
    using type = T;
};

// Calls fn(TypeTag<T>{}) for the element type named by a LookaheadDType code.
template <typename Fn>
cudaError_t dispatch_dtype(int32_t dtype, Fn&& fn)
{
    switch (dtype)
    {
    case kLookaheadFloat32: return fn(TypeTag<float>{});
    case kLookaheadFloat16: return fn(TypeTag<__half>{});
    case kLookaheadBFloat16: return fn(TypeTag<__nv_bfloat16>{});
    default: return cudaErrorInvalidValue;
    }
}

inline int64_t ceil_div(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

// Grids are one-dimensional and flattened: gridDim.x allows 2^31 - 1 blocks.
constexpr int64_t kMaxGridX = 2147483647;

} // namespace lookahead_kv::cuda
