"""Capability-gated skips for the kernel and plugin tests, in one place.

Each ``requires_*`` is a pytest mark whose reason says exactly what is missing and why, so a
skipped GPU or TensorRT test on a CPU machine reads as a statement, not a mystery.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

from plugins import tensorrt as trt_plugins

ROOT = Path(__file__).resolve().parents[1]


def nvcc() -> str | None:
    """nvcc on PATH, else the toolkit's default location."""
    found = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return found if os.access(found, os.X_OK) else None


def tensorrt_runtime_missing() -> str | None:
    """Why no TensorRT Python runtime imports, or None when one does."""
    if any(importlib.util.find_spec(m) for m in trt_plugins.TENSORRT_MODULES):
        return None
    return ("no TensorRT Python runtime installed "
            "(pip install tensorrt-lean-cu13-libs tensorrt-lean-cu13-bindings)")


def trt_plugin_library_missing() -> str | None:
    """Why the TensorRT plugin library is not there to load, or None when it is."""
    if trt_plugins.library_path().is_file():
        return None
    root = os.environ.get("TENSORRT_ROOT")
    how = ("cmake -S plugins/tensorrt -B build/tensorrt -DTENSORRT_ROOT=$TENSORRT_ROOT "
           "&& cmake --build build/tensorrt")
    if not root:
        why = ("TENSORRT_ROOT is unset: the plugins compile only against a TensorRT install with headers, "
               "which no package on PyPI ships (docs/INSTALL.md, TensorRT)")
    elif not (Path(root) / "include" / "NvInfer.h").is_file():
        why = f"TENSORRT_ROOT={root} has no include/NvInfer.h (TensorRT headers are needed to build the plugins)"
    else:
        why = f"TensorRT headers found but the library is not built ({how})"
    return f"{trt_plugins.library_path()} missing: {why}"


def cuda_missing() -> str | None:
    """Why no CUDA device can run a kernel here, or None when one can: the torch build, then the
    device's visibility."""
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU build (torch.version.cuda is None): the CUDA kernels run "
                "on the GPU machine (scripts/gpu_check.sh)")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
                f"(torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES={visible!r})")
    return None


requires_nvcc = pytest.mark.skipif(nvcc() is None, reason="nvcc not found on PATH or at /usr/local/cuda/bin/nvcc "
                                                          "(CUDA toolkit not installed)")
requires_cuda = pytest.mark.skipif(cuda_missing() is not None, reason=cuda_missing() or "")
requires_tensorrt = pytest.mark.skipif(tensorrt_runtime_missing() is not None,
                                       reason=tensorrt_runtime_missing() or "")
requires_trt_plugins = pytest.mark.skipif(
    tensorrt_runtime_missing() is not None or trt_plugin_library_missing() is not None,
    reason=tensorrt_runtime_missing() or trt_plugin_library_missing() or "")
