"""TensorRT plugin library: loads into the lean runtime's registry (no GPU needed), creates each
plugin from fields, and round-trips the fields through serialisation. Skips, with the reason,
where the library is not built (it needs TensorRT headers: TENSORRT_ROOT)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from gpu_skips import requires_tensorrt, requires_trt_plugins
from plugins import tensorrt as trt_plugins

FIELDS = {
    "LookaheadAttention": {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "scale": 0.125},
    "KVBlockGather": {"num_kv_heads": 3, "block_size": 16, "head_dim": 64},
}
BAD_FIELDS = [
    ("LookaheadAttention", {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64}),                  # no scale
    ("LookaheadAttention", {"num_heads": 9, "num_kv_heads": 2, "head_dim": 64, "scale": 0.125}),  # 2 !| 9
    ("LookaheadAttention", {"num_heads": 9, "num_kv_heads": 3, "head_dim": 80, "scale": 0.125}),  # no kernel
    ("LookaheadAttention", {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "scale": 0}),      # int scale
    ("KVBlockGather", {"num_kv_heads": 3, "block_size": 0, "head_dim": 64}),
]


def _collection(trt, fields: dict):
    def field(name, value):
        if isinstance(value, float):
            return trt.PluginField(name, np.array([value], np.float32), trt.PluginFieldType.FLOAT32)
        return trt.PluginField(name, np.array([value], np.int32), trt.PluginFieldType.INT32)

    return trt.PluginFieldCollection([field(n, v) for n, v in fields.items()])


@pytest.fixture(scope="module")
def trt():
    trt_plugins.load_plugin_library()
    return trt_plugins.tensorrt_module()


def _creator(trt, name: str):
    creator = trt.get_plugin_registry().get_creator(name, trt_plugins.PLUGIN_VERSION, trt_plugins.PLUGIN_NAMESPACE)
    assert creator is not None, f"{trt_plugins.PLUGIN_NAMESPACE}::{name} v{trt_plugins.PLUGIN_VERSION} not registered"
    return creator


@requires_tensorrt
def test_tensorrt_runtime_imports():
    trt = trt_plugins.tensorrt_module()
    assert trt.get_plugin_registry() is not None
    assert hasattr(trt, "IPluginCreatorV3One") and hasattr(trt, "TensorRTPhase")


@requires_trt_plugins
@pytest.mark.parametrize("name", trt_plugins.PLUGIN_NAMES)
def test_creator_is_registered_with_its_fields(trt, name):
    creator = _creator(trt, name)
    assert (creator.name, creator.plugin_version, creator.plugin_namespace) == (name, "1", "lookahead")
    assert [f.name for f in creator.field_names] == list(FIELDS[name])


@requires_trt_plugins
@pytest.mark.parametrize("phase", ["BUILD", "RUNTIME"])
@pytest.mark.parametrize("name", trt_plugins.PLUGIN_NAMES)
def test_create_plugin_from_fields(trt, name, phase):
    plugin = _creator(trt, name).create_plugin(name, _collection(trt, FIELDS[name]), getattr(trt.TensorRTPhase, phase))
    assert plugin is not None
    core = plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
    assert (core.plugin_name, core.plugin_version, core.plugin_namespace) == (name, "1", "lookahead")
    for capability in (trt.PluginCapabilityType.BUILD, trt.PluginCapabilityType.RUNTIME):
        assert plugin.get_capability_interface(capability) is not None


@requires_trt_plugins
@pytest.mark.parametrize("name, fields", BAD_FIELDS)
def test_create_plugin_refuses_bad_fields(trt, name, fields):
    assert _creator(trt, name).create_plugin(name, _collection(trt, fields), trt.TensorRTPhase.BUILD) is None


@requires_trt_plugins
@pytest.mark.parametrize("name", trt_plugins.PLUGIN_NAMES)
def test_fields_round_trip_through_serialization(trt, name):
    """Build-phase plugin -> getFieldsToSerialize -> runtime-phase plugin -> clone -> fields, in C++
    (Python cannot call getFieldsToSerialize on a C++ plugin), through the library's test hook."""
    hook = ctypes.CDLL(str(trt_plugins.library_path())).lookaheadTrtRoundTripFields
    hook.restype = ctypes.c_int32
    hook.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32]
    out = ctypes.create_string_buffer(512)
    text = ";".join(f"{k}={v}" for k, v in FIELDS[name].items())
    assert hook(name.encode(), text.encode(), out, len(out)) == 0
    got = dict(item.split("=") for item in out.value.decode().split(";"))
    assert {k: type(v)(got[k]) for k, v in FIELDS[name].items()} == FIELDS[name]
    assert list(got) == list(FIELDS[name])
