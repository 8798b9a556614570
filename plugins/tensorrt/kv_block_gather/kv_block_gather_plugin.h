// KVBlockGather: TensorRT IPluginV3 over lookahead_kv_block_gather. Contract: README.md here.
#pragma once

#include "plugin_common.h"

#include <vector>

namespace lookahead_kv::trt
{

class KVBlockGatherPlugin final : public nvinfer1::IPluginV3,
                                  public nvinfer1::IPluginV3OneCore,
                                  public nvinfer1::IPluginV3OneBuild,
                                  public nvinfer1::IPluginV3OneRuntime
{
public:
    static constexpr char kName[] = "KVBlockGather";

    KVBlockGatherPlugin(int32_t numKvHeads, int32_t blockSize, int32_t headDim);
    KVBlockGatherPlugin(KVBlockGatherPlugin const& other);
    KVBlockGatherPlugin& operator=(KVBlockGatherPlugin const&) = delete;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override { return kName; }
    char const* getPluginVersion() const noexcept override { return kPluginVersion; }
    char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override { return 1; }
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    bool checkShapes(nvinfer1::Dims const& src, nvinfer1::Dims const& blockIds) const noexcept;

    int32_t mNumKvHeads;
    int32_t mBlockSize;
    int32_t mHeadDim;
    std::vector<nvinfer1::PluginField> mFields; // point into the members above
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

class KVBlockGatherCreator final : public nvinfer1::IPluginCreatorV3One
{
public:
    KVBlockGatherCreator();

    char const* getPluginName() const noexcept override { return KVBlockGatherPlugin::kName; }
    char const* getPluginVersion() const noexcept override { return kPluginVersion; }
    char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override { return &mFieldNames; }
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldNames{};
};

} // namespace lookahead_kv::trt
