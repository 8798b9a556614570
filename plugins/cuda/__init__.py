"""CUDA kernels of the lookahead ops (sm_90), their torch-extension loader and GPU numerics checks.

    lookahead_kernels.h   the C ABI: extern "C" launchers shared with ctypes and the TensorRT plugins
    *.cu                  kernels in namespace lookahead_kv::cuda
    torch_bindings.cpp    thin torch wrappers over the launchers
    loader.py             register_cuda_kernels(): build the extension, register it for torch.ops
    numerics.py           kernel-vs-reference checks (tests/test_cuda_kernels.py, bench/gpu_kernels.py)

Nothing here touches CUDA at import time.
"""
