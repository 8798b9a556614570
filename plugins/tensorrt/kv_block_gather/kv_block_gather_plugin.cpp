#include "kv_block_gather_plugin.h"

#include "lookahead_kernels.h"

#include <new>

namespace lookahead_kv::trt
{
namespace
{
constexpr int32_t kSrc = 0;      // [num_blocks, num_kv_heads, block_size, head_dim]  float / half / bf16
constexpr int32_t kBlockIds = 1; // [num_kv_heads, n] int64
constexpr int32_t kOut = 2;      // [num_kv_heads, n, block_size, head_dim]            type of src
constexpr int32_t kNbInputs = 2;
} // namespace

// --- core ------------------------------------------------------------------------------------

KVBlockGatherPlugin::KVBlockGatherPlugin(int32_t numKvHeads, int32_t blockSize, int32_t headDim)
    : mNumKvHeads(numKvHeads)
    , mBlockSize(blockSize)
    , mHeadDim(headDim)
{
    mFields = {
        nvinfer1::PluginField("num_kv_heads", &mNumKvHeads, nvinfer1::PluginFieldType::kINT32, 1),
        nvinfer1::PluginField("block_size", &mBlockSize, nvinfer1::PluginFieldType::kINT32, 1),
        nvinfer1::PluginField("head_dim", &mHeadDim, nvinfer1::PluginFieldType::kINT32, 1),
    };
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

// The serialised fields point into the object: a copy must point into itself, not the source.
KVBlockGatherPlugin::KVBlockGatherPlugin(KVBlockGatherPlugin const& other)
    : KVBlockGatherPlugin(other.mNumKvHeads, other.mBlockSize, other.mHeadDim)
{
}

nvinfer1::IPluginCapability* KVBlockGatherPlugin::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

nvinfer1::IPluginV3* KVBlockGatherPlugin::clone() noexcept
{
    return new (std::nothrow) KVBlockGatherPlugin(*this);
}

bool KVBlockGatherPlugin::checkShapes(nvinfer1::Dims const& src, nvinfer1::Dims const& blockIds) const noexcept
{
    if (src.nbDims != 4 || blockIds.nbDims != 2 || !matches(src.d[1], mNumKvHeads) || !matches(src.d[2], mBlockSize)
        || !matches(src.d[3], mHeadDim) || !matches(blockIds.d[0], mNumKvHeads))
    {
        logError("KVBlockGather: expected src [num_blocks, num_kv_heads=" + std::to_string(mNumKvHeads)
            + ", block_size=" + std::to_string(mBlockSize) + ", head_dim=" + std::to_string(mHeadDim)
            + "] and block_ids [num_kv_heads, n]");
        return false;
    }
    return true;
}

// --- build -----------------------------------------------------------------------------------

int32_t KVBlockGatherPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != 1)
    {
        return -1;
    }
    return checkShapes(in[kSrc].desc.dims, in[kBlockIds].desc.dims) ? 0 : -1;
}

bool KVBlockGatherPlugin::supportsFormatCombination(
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
    case kSrc: return isFloatType(type);
    case kBlockIds: return type == nvinfer1::DataType::kINT64;
    default: return type == inOut[kSrc].desc.type;
    }
}

int32_t KVBlockGatherPlugin::getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
    nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != 1)
    {
        return -1;
    }
    outputTypes[0] = inputTypes[kSrc];
    return 0;
}

int32_t KVBlockGatherPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != 1 || inputs[kSrc].nbDims != 4 || inputs[kBlockIds].nbDims != 2)
    {
        logError("KVBlockGather: expects src [num_blocks, KVH, block_size, head_dim] and block_ids [KVH, n]");
        return -1;
    }
    outputs[0].nbDims = 4;
    outputs[0].d[0] = inputs[kBlockIds].d[0];
    outputs[0].d[1] = inputs[kBlockIds].d[1];
    outputs[0].d[2] = inputs[kSrc].d[2];
    outputs[0].d[3] = inputs[kSrc].d[3];
    return 0;
}

// --- runtime ---------------------------------------------------------------------------------

int32_t KVBlockGatherPlugin::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != 1)
    {
        return -1;
    }
    return checkShapes(in[kSrc].dims, in[kBlockIds].dims) ? 0 : -1;
}

int32_t KVBlockGatherPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs, void* const* outputs,
    void* /*workspace*/, cudaStream_t stream) noexcept
{
    nvinfer1::Dims const& src = inputDesc[kSrc].dims;
    int64_t const rowBytes = int64_t(mBlockSize) * mHeadDim * elementSize(inputDesc[kSrc].type);
    cudaError_t const err = lookahead_kv_block_gather(inputs[kSrc], static_cast<int64_t const*>(inputs[kBlockIds]),
        outputs[0], src.d[0], mNumKvHeads, inputDesc[kBlockIds].dims.d[1], rowBytes, stream);
    if (err != cudaSuccess)
    {
        logError(std::string("KVBlockGather: launch failed: ") + cudaGetErrorString(err));
        return -1;
    }
    return 0;
}

nvinfer1::IPluginV3* KVBlockGatherPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept
{
    return clone(); // stateless: one copy per execution context
}

nvinfer1::PluginFieldCollection const* KVBlockGatherPlugin::getFieldsToSerialize() noexcept
{
    return &mFieldCollection;
}

// --- creator ---------------------------------------------------------------------------------

KVBlockGatherCreator::KVBlockGatherCreator()
{
    mFields = {
        nvinfer1::PluginField("num_kv_heads", nullptr, nvinfer1::PluginFieldType::kINT32, 1),
        nvinfer1::PluginField("block_size", nullptr, nvinfer1::PluginFieldType::kINT32, 1),
        nvinfer1::PluginField("head_dim", nullptr, nvinfer1::PluginFieldType::kINT32, 1),
    };
    mFieldNames.nbFields = static_cast<int32_t>(mFields.size());
    mFieldNames.fields = mFields.data();
}

nvinfer1::IPluginV3* KVBlockGatherCreator::createPlugin(
    char const* /*name*/, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase /*phase*/) noexcept
{
    int32_t numKvHeads = 0;
    int32_t blockSize = 0;
    int32_t headDim = 0;
    if (!readInt(fc, "num_kv_heads", KVBlockGatherPlugin::kName, &numKvHeads)
        || !readInt(fc, "block_size", KVBlockGatherPlugin::kName, &blockSize)
        || !readInt(fc, "head_dim", KVBlockGatherPlugin::kName, &headDim))
    {
        return nullptr;
    }
    if (numKvHeads <= 0 || blockSize <= 0 || headDim <= 0)
    {
        logError("KVBlockGather: num_kv_heads, block_size and head_dim must be > 0");
        return nullptr;
    }
    return new (std::nothrow) KVBlockGatherPlugin(numKvHeads, blockSize, headDim);
}

} // namespace lookahead_kv::trt
