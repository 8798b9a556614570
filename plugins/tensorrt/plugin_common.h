// Shared by the lookahead TensorRT plugins: namespace / version constants, logging, field I/O.
#pragma once

#include "lookahead_kernels.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace lookahead_kv::trt
{

// Every plugin of this library registers as "lookahead::<Name>" version "1".
inline constexpr char kPluginNamespace[] = "lookahead";
inline constexpr char kPluginVersion[] = "1";

// Logs through the logger TensorRT passed to setLoggerFinder; dropped before that call.
void logError(std::string const& message) noexcept;

// Reads the scalar field `name` of type `type` from fc into *out. Returns false (and logs why)
// when it is absent or has another type or length, so createPlugin fails with a named field.
template <typename T>
bool readField(nvinfer1::PluginFieldCollection const* fc, char const* name, nvinfer1::PluginFieldType type,
    char const* plugin, T* out) noexcept
{
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
    {
        nvinfer1::PluginField const& f = fc->fields[i];
        if (f.name == nullptr || std::strcmp(f.name, name) != 0)
        {
            continue;
        }
        if (f.type != type || f.length != 1 || f.data == nullptr)
        {
            logError(std::string(plugin) + ": field '" + name + "' must be one scalar of the documented type");
            return false;
        }
        std::memcpy(out, f.data, sizeof(T));
        return true;
    }
    logError(std::string(plugin) + ": missing field '" + name + "'");
    return false;
}

inline bool readInt(nvinfer1::PluginFieldCollection const* fc, char const* name, char const* plugin, int32_t* out)
{
    return readField(fc, name, nvinfer1::PluginFieldType::kINT32, plugin, out);
}

inline bool readFloat(nvinfer1::PluginFieldCollection const* fc, char const* name, char const* plugin, float* out)
{
    return readField(fc, name, nvinfer1::PluginFieldType::kFLOAT32, plugin, out);
}

// The kernels' element-type code for a TensorRT type, or -1 for one they do not take.
inline int32_t kernelDType(nvinfer1::DataType type) noexcept
{
    switch (type)
    {
    case nvinfer1::DataType::kFLOAT: return 0;
    case nvinfer1::DataType::kHALF: return 1;
    case nvinfer1::DataType::kBF16: return 2;
    default: return -1;
    }
}

inline int64_t elementSize(nvinfer1::DataType type) noexcept
{
    return type == nvinfer1::DataType::kFLOAT ? 4 : 2;
}

inline bool isFloatType(nvinfer1::DataType type) noexcept
{
    return kernelDType(type) >= 0;
}

// True when a build-time dimension is either unknown (-1) or equal to the attribute.
inline bool matches(int64_t dim, int32_t attribute) noexcept
{
    return dim == -1 || dim == attribute;
}

} // namespace lookahead_kv::trt
