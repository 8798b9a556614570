"""The GPU check's own arithmetic and bookkeeping, on CPU: what pinning a host pool takes in the
memory plan, the decode bench's honest numbers (copy-alone from wall time, the hidden share
clamped, step rates beside tokens/s) and its pinned pools, and the output layout
scripts/gpu_check.sh leaves under $OUT (what comes back from the GPU machine)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runtime.config import LookaheadConfig, ModelConfig
from runtime.errors import ConfigError
from runtime.memory_plan import check_memory, pinned_bytes, plan_memory

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

# Llama-3.1-8B's geometry, where the first H200 run's pingpong row was refused
LLAMA8B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
                      rope_theta=5e5, tie_word_embeddings=False)


def test_pinned_bytes_is_the_next_power_of_two():
    assert [pinned_bytes(n) for n in (0, 1, 5, 8, 9, (20 << 30) + 1)] == [0, 1, 8, 8, 16, 32 << 30]


def test_memory_plan_counts_what_pinning_the_host_pool_takes():
    """On a GPU, Engine's lookahead host pool is pinned by torch's allocator, which rounds K and V
    each up to a power of two: 40 GiB of KV pins 64. A registered pool (cudaHostRegister) takes its
    bytes. Dense pools (on the device) and CPU engines are not pinned."""
    cfg = LookaheadConfig(mode="lookahead", max_batch_size=10, max_model_len=32768 + 64, kv_dtype="bfloat16")
    cpu = plan_memory(LLAMA8B, cfg, None, 2, weights=False)
    gpu = plan_memory(LLAMA8B, cfg, None, 2, weights=False, device_type="cuda")
    reg = plan_memory(LLAMA8B, cfg, None, 2, weights=False, device_type="cuda", pinning="registered")
    half = cpu.host_kv_pool // 2
    assert reg.host_kv_pool == cpu.host_kv_pool and 20 << 30 < half < 32 << 30
    assert gpu.host_kv_pool == 2 * (32 << 30) > cpu.host_kv_pool
    # a host that holds the tensors but not what pinning takes: refused before any allocation
    room = int(reg.host_total / 0.9) + (1 << 20)
    check_memory(reg, available_bytes=room)
    with pytest.raises(ConfigError) as e:
        check_memory(gpu, available_bytes=room)
    assert "host_kv_pool" in str(e.value)
    dense = LookaheadConfig(mode="dense", max_batch_size=2, max_model_len=4096)
    assert plan_memory(LLAMA8B, dense, None, 2, device_type="cuda").host_kv_pool == \
        plan_memory(LLAMA8B, dense, None, 2).host_kv_pool
    with pytest.raises(ConfigError, match="pinning"):
        plan_memory(LLAMA8B, cfg, None, 2, device_type="cuda", pinning="mlock")
