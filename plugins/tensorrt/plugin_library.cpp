// Entry points TensorRT looks up when it loads this library (IPluginRegistry::loadLibrary, the
// lean runtime's load_library): getCreators and setLoggerFinder. Plus one C test hook.
#include "kv_block_gather/kv_block_gather_plugin.h"
#include "lookahead_attention/lookahead_attention_plugin.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace lookahead_kv::trt
{
namespace
{

std::mutex gLoggerMutex;
nvinfer1::ILoggerFinder* gLoggerFinder = nullptr;

} // namespace

void logError(std::string const& message) noexcept
{
    std::lock_guard<std::mutex> lock(gLoggerMutex);
    nvinfer1::ILogger* logger = gLoggerFinder != nullptr ? gLoggerFinder->findLogger() : nullptr;
    if (logger != nullptr)
    {
        logger->log(nvinfer1::ILogger::Severity::kERROR, message.c_str());
    }
}

} // namespace lookahead_kv::trt

extern "C" LOOKAHEAD_KV_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    std::lock_guard<std::mutex> lock(lookahead_kv::trt::gLoggerMutex);
    lookahead_kv::trt::gLoggerFinder = finder;
}

extern "C" LOOKAHEAD_KV_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static lookahead_kv::trt::LookaheadAttentionCreator sAttention;
    static lookahead_kv::trt::KVBlockGatherCreator sGather;
    static nvinfer1::IPluginCreatorInterface* const sCreators[] = {&sAttention, &sGather};
    nbCreators = 2;
    return sCreators;
}

// Test hook (Python cannot call getFieldsToSerialize on a C++ plugin): creates plugin `name`
// from `fields` ("key=value;..."; ints for int fields, a float for `scale`), serialises it, re-creates
// it in the runtime phase from the serialised fields as an engine load does, serialises again,
// and writes that second field set to out in the same format. Returns 0, or -1 on any failure.
extern "C" LOOKAHEAD_KV_API int32_t lookaheadTrtRoundTripFields(char const* name, char const* fields, char* out,
    int32_t outSize)
{
    using namespace nvinfer1;
    int32_t nbCreators = 0;
    IPluginCreatorV3One* creator = nullptr;
    IPluginCreatorInterface* const* creators = getCreators(nbCreators);
    for (int32_t i = 0; i < nbCreators; ++i)
    {
        auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
        if (std::string(c->getPluginName()) == name)
        {
            creator = c;
        }
    }
    if (creator == nullptr || fields == nullptr || out == nullptr || outSize <= 0)
    {
        return -1;
    }

    // Parse "key=value;..." into typed fields: `scale` is float32, everything else int32.
    std::vector<std::string> keys;
    std::vector<int32_t> ints;
    std::vector<float> floats;
    std::string const text(fields);
    for (size_t pos = 0; pos < text.size();)
    {
        size_t const end = std::min(text.find(';', pos), text.size());
        std::string const item = text.substr(pos, end - pos);
        size_t const eq = item.find('=');
        if (eq != std::string::npos)
        {
            keys.push_back(item.substr(0, eq));
            std::string const value = item.substr(eq + 1);
            ints.push_back(keys.back() == "scale" ? 0 : std::atoi(value.c_str()));
            floats.push_back(keys.back() == "scale" ? std::strtof(value.c_str(), nullptr) : 0.0f);
        }
        pos = end + 1;
    }
    std::vector<PluginField> parsed;
    for (size_t i = 0; i < keys.size(); ++i)
    {
        bool const isFloat = keys[i] == "scale";
        parsed.emplace_back(keys[i].c_str(), isFloat ? static_cast<void const*>(&floats[i]) : &ints[i],
            isFloat ? PluginFieldType::kFLOAT32 : PluginFieldType::kINT32, 1);
    }
    PluginFieldCollection const fc{static_cast<int32_t>(parsed.size()), parsed.data()};

    std::unique_ptr<IPluginV3> built(creator->createPlugin(name, &fc, TensorRTPhase::kBUILD));
    if (!built)
    {
        return -1;
    }
    auto* builtRuntime
        = static_cast<IPluginV3OneRuntime*>(built->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    std::unique_ptr<IPluginV3> loaded(
        creator->createPlugin(name, builtRuntime->getFieldsToSerialize(), TensorRTPhase::kRUNTIME));
    if (!loaded)
    {
        return -1;
    }
    std::unique_ptr<IPluginV3> copy(loaded->clone());
    auto* runtime = static_cast<IPluginV3OneRuntime*>(copy->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    PluginFieldCollection const* serialized = runtime->getFieldsToSerialize();

    std::string result;
    for (int32_t i = 0; i < serialized->nbFields; ++i)
    {
        PluginField const& f = serialized->fields[i];
        char value[64];
        if (f.type == PluginFieldType::kFLOAT32)
        {
            std::snprintf(value, sizeof(value), "%.9g", *static_cast<float const*>(f.data));
        }
        else
        {
            std::snprintf(value, sizeof(value), "%d", *static_cast<int32_t const*>(f.data));
        }
        result += std::string(i ? ";" : "") + f.name + "=" + value;
    }
    if (result.size() + 1 > size_t(outSize))
    {
        return -1;
    }
    std::snprintf(out, size_t(outSize), "%s", result.c_str());
    return 0;
}
