#include "lookahead_attention_plugin.h"

#include "lookahead_kernels.h"

#include <cmath>
#include <new>

namespace lookahead_kv::trt
{
namespace
{
// Tensor positions, inputs then the output. Shapes: B batch, R rows, H heads, KVH KV heads,
// N gathered keys, E extra keys, D head_dim.
constexpr int32_t kQ = 0;         // [B, R, H, D]      float / half / bf16
constexpr int32_t kK = 1;         // [B, KVH, N, D]    type of q
constexpr int32_t kV = 2;         // [B, KVH, N, D]    type of q
constexpr int32_t kKvMask = 3;    // [B, KVH, N]       bool
constexpr int32_t kKExtra = 4;    // [B, KVH, E, D]    type of q
constexpr int32_t kVExtra = 5;    // [B, KVH, E, D]    type of q
constexpr int32_t kExtraMask = 6; // [B, R, E]         bool
constexpr int32_t kOut = 7;       // [B, R, H, D]      type of q
constexpr int32_t kNbInputs = 7;
} // namespace

// --- core ------------------------------------------------------------------------------------

LookaheadAttentionPlugin::LookaheadAttentionPlugin(int32_t numHeads, int32_t numKvHeads, int32_t headDim, float scale)
    : mNumHeads(numHeads)
    , mNumKvHeads(numKvHeads)
    , mHeadDim(headDim)
    , mScale(scale)
{
    mFields = {
        nvinfer1::PluginField("num_heads", &mNumHeads, nvinfer1::PluginFieldType::kINT32, 1),
        nvinfer1::PluginField("num_kv_heads", &mNumKvHeads, nvinfer1::PluginFieldType::kINT32, 1),
        nvinfer1::PluginField("head_dim", &mHeadDim, nvinfer1::PluginFieldType::kINT32, 1),
        nvinfer1::PluginField("scale", &mScale, nvinfer1::PluginFieldType::kFLOAT32, 1),
    };
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

// The serialised fields point into the object: a copy must point into itself, not the source.
LookaheadAttentionPlugin::LookaheadAttentionPlugin(LookaheadAttentionPlugin const& other)
    : LookaheadAttentionPlugin(other.mNumHeads, other.mNumKvHeads, other.mHeadDim, other.mScale)
{
}

nvinfer1::IPluginCapability* LookaheadAttentionPlugin::getCapabilityInterface(
    nvinfer1::PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

nvinfer1::IPluginV3* LookaheadAttentionPlugin::clone() noexcept
{
    return new (std::nothrow) LookaheadAttentionPlugin(*this);
}

bool LookaheadAttentionPlugin::checkShapes(nvinfer1::Dims const* in) const noexcept
{
    nvinfer1::Dims const& q = in[kQ];
    nvinfer1::Dims const& k = in[kK];
    nvinfer1::Dims const& kx = in[kKExtra];
    bool const ok = q.nbDims == 4 && k.nbDims == 4 && in[kV].nbDims == 4 && in[kKvMask].nbDims == 3
        && kx.nbDims == 4 && in[kVExtra].nbDims == 4 && in[kExtraMask].nbDims == 3 && matches(q.d[2], mNumHeads)
        && matches(q.d[3], mHeadDim) && matches(k.d[1], mNumKvHeads) && matches(k.d[3], mHeadDim)
        && matches(kx.d[1], mNumKvHeads) && matches(kx.d[3], mHeadDim);
    if (!ok)
    {
        logError("LookaheadAttention: expected q [B, R, num_heads=" + std::to_string(mNumHeads) + ", head_dim="
            + std::to_string(mHeadDim) + "], k/v [B, num_kv_heads=" + std::to_string(mNumKvHeads)
            + ", N, head_dim], kv_mask [B, KVH, N], k/v_extra [B, KVH, E, head_dim], extra_mask [B, R, E]");
    }
    return ok;
}

// The kernels' bound for these shapes; it never shrinks as a dimension grows, so the size for
// the profile's max shapes (build time) covers every shape enqueue sees.
size_t LookaheadAttentionPlugin::workspaceFor(nvinfer1::Dims const* in) const noexcept
{
    return lookahead_kv_attention_workspace_size(
        in[kQ].d[0], in[kQ].d[1], mNumHeads, mNumKvHeads, in[kK].d[2], in[kKExtra].d[2], mHeadDim);
}

// --- build -----------------------------------------------------------------------------------

int32_t LookaheadAttentionPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != 1)
    {
        return -1;
    }
    nvinfer1::Dims dims[kNbInputs];
    for (int32_t i = 0; i < kNbInputs; ++i)
    {
        dims[i] = in[i].desc.dims;
    }
    return checkShapes(dims) ? 0 : -1;
}

bool LookaheadAttentionPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != 1 || pos < 0 || pos > kOut
        || inOut[pos].desc.format != nvinfer1::TensorFormat::kLINEAR)
    {
        return false;
    }
    nvinfer1::DataType const type = inOut[pos].desc.type;
    switch (pos)
    {
    case kQ: return isFloatType(type);
    case kKvMask:
    case kExtraMask: return type == nvinfer1::DataType::kBOOL;
    default: return type == inOut[kQ].desc.type;
    }
}

int32_t LookaheadAttentionPlugin::getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
    nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != 1)
    {
        return -1;
    }
    outputTypes[0] = inputTypes[kQ];
    return 0;
}

int32_t LookaheadAttentionPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != 1 || inputs[kQ].nbDims != 4)
    {
        logError("LookaheadAttention: expects 7 inputs, q of shape [B, R, H, D]");
        return -1;
    }
    outputs[0] = inputs[kQ];
    return 0;
}

size_t LookaheadAttentionPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    if (nbInputs != kNbInputs)
    {
        return 0;
    }
    nvinfer1::Dims dims[kNbInputs];
    for (int32_t i = 0; i < kNbInputs; ++i)
    {
        dims[i] = inputs[i].max;
    }
    return workspaceFor(dims);
}

// --- runtime ---------------------------------------------------------------------------------

int32_t LookaheadAttentionPlugin::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != 1)
    {
        return -1;
    }
    nvinfer1::Dims dims[kNbInputs];
    for (int32_t i = 0; i < kNbInputs; ++i)
    {
        dims[i] = in[i].dims;
    }
    return checkShapes(dims) ? 0 : -1;
}

int32_t LookaheadAttentionPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs, void* const* outputs, void* workspace,
    cudaStream_t stream) noexcept
{
    nvinfer1::Dims dims[kNbInputs];
    for (int32_t i = 0; i < kNbInputs; ++i)
    {
        dims[i] = inputDesc[i].dims;
    }
    nvinfer1::Dims const& q = dims[kQ];
    cudaError_t const err = lookahead_kv_attention(inputs[kQ], inputs[kK], inputs[kV],
        static_cast<uint8_t const*>(inputs[kKvMask]), inputs[kKExtra], inputs[kVExtra],
        static_cast<uint8_t const*>(inputs[kExtraMask]), outputs[0], q.d[0], q.d[1], mNumHeads, mNumKvHeads,
        dims[kK].d[2], dims[kKExtra].d[2], mHeadDim, mScale, kernelDType(inputDesc[kQ].type), workspace,
        workspaceFor(dims), stream);
    if (err != cudaSuccess)
    {
        logError(std::string("LookaheadAttention: launch failed: ") + cudaGetErrorString(err));
        return -1;
    }
    return 0;
}

nvinfer1::IPluginV3* LookaheadAttentionPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept
{
    return clone(); // stateless: one copy per execution context
}

nvinfer1::PluginFieldCollection const* LookaheadAttentionPlugin::getFieldsToSerialize() noexcept
{
    return &mFieldCollection;
}

// --- creator ---------------------------------------------------------------------------------

LookaheadAttentionCreator::LookaheadAttentionCreator()
{
    mFields = {
        nvinfer1::PluginField("num_heads", nullptr, nvinfer1::PluginFieldType::kINT32, 1),
        nvinfer1::PluginField("num_kv_heads", nullptr, nvinfer1::PluginFieldType::kINT32, 1),
        nvinfer1::PluginField("head_dim", nullptr, nvinfer1::PluginFieldType::kINT32, 1),
        nvinfer1::PluginField("scale", nullptr, nvinfer1::PluginFieldType::kFLOAT32, 1),
    };
    mFieldNames.nbFields = static_cast<int32_t>(mFields.size());
    mFieldNames.fields = mFields.data();
}

nvinfer1::IPluginV3* LookaheadAttentionCreator::createPlugin(
    char const* /*name*/, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase /*phase*/) noexcept
{
    char const* plugin = LookaheadAttentionPlugin::kName;
    int32_t numHeads = 0;
    int32_t numKvHeads = 0;
    int32_t headDim = 0;
    float scale = 0.0f;
    if (!readInt(fc, "num_heads", plugin, &numHeads) || !readInt(fc, "num_kv_heads", plugin, &numKvHeads)
        || !readInt(fc, "head_dim", plugin, &headDim) || !readFloat(fc, "scale", plugin, &scale))
    {
        return nullptr;
    }
    if (numKvHeads <= 0 || numHeads <= 0 || numHeads % numKvHeads != 0)
    {
        logError("LookaheadAttention: num_kv_heads must be > 0 and divide num_heads");
        return nullptr;
    }
    if (headDim != 64 && headDim != 128 && headDim != 256)
    {
        logError("LookaheadAttention: head_dim must be 64, 128 or 256 (the kernel's instantiations)");
        return nullptr;
    }
    if (!(std::isfinite(scale) && scale > 0.0f))
    {
        logError("LookaheadAttention: scale must be a finite float > 0");
        return nullptr;
    }
    return new (std::nothrow) LookaheadAttentionPlugin(numHeads, numKvHeads, headDim, scale);
}

} // namespace lookahead_kv::trt
