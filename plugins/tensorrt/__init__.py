"""TensorRT IPluginV3 plugins of the lookahead ops: ``lookahead::LookaheadAttention`` and
``lookahead::KVBlockGather``, version "1", over the same CUDA launchers as ``plugins.cuda``.

The library is built with CMake where a TensorRT install provides headers (see README.md);
``load_plugin_library()`` registers it with TensorRT's plugin registry once per process. It
works with the full TensorRT bindings or the lean runtime (``tensorrt_lean``), CPU included.
"""
from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path
from types import ModuleType

PLUGIN_NAMESPACE = "lookahead"
PLUGIN_VERSION = "1"
PLUGIN_NAMES = ("LookaheadAttention", "KVBlockGather")
LIBRARY_ENV = "LOOKAHEAD_TRT_PLUGIN_LIB"
DEFAULT_LIBRARY = Path(__file__).resolve().parents[2] / "build" / "tensorrt" / "liblookahead_trt_plugins.so"
# The lean runtime's module is `tensorrt_lean` up to TensorRT 10 and `tensorrt_lean_bindings` in 11.
TENSORRT_MODULES = ("tensorrt_lean", "tensorrt_lean_bindings", "tensorrt")


class PluginLibraryError(RuntimeError):
    """The plugin library or a TensorRT runtime to load it into is missing; the message says which."""


def library_path() -> Path:
    """``$LOOKAHEAD_TRT_PLUGIN_LIB``, else ``build/tensorrt/liblookahead_trt_plugins.so``."""
    return Path(os.environ.get(LIBRARY_ENV) or DEFAULT_LIBRARY)


def tensorrt_module() -> ModuleType:
    """The first importable TensorRT Python runtime of TENSORRT_MODULES."""
    for name in TENSORRT_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise PluginLibraryError("no TensorRT Python runtime: pip install tensorrt-lean-cu13-libs "
                             "tensorrt-lean-cu13-bindings (or the full tensorrt)")


@functools.cache
def load_plugin_library(path: str | None = None) -> object:
    """Register the plugin library with TensorRT's plugin registry (once); returns its handle."""
    lib = Path(path) if path else library_path()
    if not lib.is_file():
        raise PluginLibraryError(
            f"{lib} is not built: cmake -S plugins/tensorrt -B build/tensorrt -DTENSORRT_ROOT=<TensorRT install> "
            f"&& cmake --build build/tensorrt (or point ${LIBRARY_ENV} at a built library)")
    handle = tensorrt_module().get_plugin_registry().load_library(str(lib))
    if handle is None:
        raise PluginLibraryError(f"TensorRT refused {lib}: its plugins are already registered, or it does not "
                                 "export getCreators / setLoggerFinder")
    return handle
