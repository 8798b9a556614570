"""The GPU check's own arithmetic and bookkeeping, on CPU: what pinning a host pool takes in the
memory plan, the decode bench's honest numbers (copy-alone from wall time, the hidden share
clamped, step rates beside tokens/s) and its pinned pools, and the output layout
scripts/gpu_check.sh leaves under $OUT (what comes back from the GPU machine)."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import LookaheadConfig, ModelConfig
from runtime.errors import ConfigError
from runtime.memory_plan import check_memory, pinned_bytes, plan_memory

ROOT = Path(__file__).resolve().parents[1]

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


def test_gpu_bench_rows_time_at_temperature_0_and_report_honest_numbers(tmp_path, monkeypatch):
    """One shape of the GPU bench on CPU (in this process): the timed rounds run at temperature 0
    (the warm-up at 1 diverges the batch), copy-alone is the replay's wall time, the hidden share
    is the shared formula clamped to [0, 1], and each row carries its step rate, emitted share and
    the round's draft accept rate beside tokens/s, and the host memory around it."""
    from bench import gpu_decode as gdb
    from bench.gpu_results import ResultFile
    from runtime.transfer.overlap import hidden_share
    from tiny_engine import make_tiny_engine

    engine = make_tiny_engine(tmp_path / "tiny")
    temps: list[list[float]] = []
    real_round = gdb.timed_round

    def recording_round(eng, steps, clock):
        temps.append([s.params.temperature for s in eng.scheduler.running])
        return real_round(eng, steps, clock)

    monkeypatch.setattr(gdb, "timed_round", recording_round)
    args = gdb.parse_args(["--device", "cpu", "--engines", f"tiny={engine}", "--context", "256", "--steps", "2",
                           "--warmup", "2", "--modes", "dense,resident", "--top-k", "2", "--recent-window", "16",
                           "--bandwidth-gib", "0.0625", "--graph-replays", "1", "--no-equal-batch",
                           "--out", str(tmp_path / "out")])
    results = ResultFile(tmp_path / "out" / gdb.RESULTS, fresh=True)
    assert gdb.run_shape("tiny", engine, args, results) == 0
    assert temps and all(t and all(x == 0.0 for x in t) for t in temps), temps
    doc = results.load()
    assert doc["shapes"]["tiny"]["cpu_kernels"]                 # the C library, before any timing
    rows = {r["mode"]: r for r in doc["results"]}
    for r in rows.values():
        assert r["seq_steps_per_s"] == pytest.approx(r["batch"] * 1e3 / r["ms_per_step"])
        assert r["emitted_share"] == pytest.approx(r["tokens"] / (r["batch"] * r["steps"]))
        assert r["host_available_before_bytes"] > 0 and r["host_available_after_bytes"] > 0
    la = rows["lookahead/resident"]
    assert la["draft_accept_rate"] is not None and la["drafts_proposed"] > 0
    assert rows["dense"]["draft_accept_rate"] is None
    assert la["copy_alone_ms_per_step"] == pytest.approx(1e3 * la["copy_alone"]["wall_s"] / la["steps"])
    want = hidden_share(la["ms_per_step"], la["satisfied"]["ms_per_step"], la["copy_alone_ms_per_step"])
    assert la["hidden_share"] == pytest.approx(want) and 0.0 <= la["hidden_share"] <= 1.0
    raw = 1 - la["exposed_copy_ms_per_step"] / la["copy_alone_ms_per_step"]
    assert la["hidden_share_unclamped"] == pytest.approx(raw)


def test_gpu_bench_registers_the_lookahead_host_pool_instead_of_allocating_it_pinned(monkeypatch):
    """On a GPU the bench's engines page-lock a pageable host pool in place (pin_pool:
    cudaHostRegister), so a row pins what it holds and gives it back when it ends; torch's pinned
    allocator would round K and V up to powers of two and keep them cached for the next row."""
    from types import SimpleNamespace

    import torch

    from bench import gpu_decode as gdb
    import runtime.transfer.cuda as transfer_cuda
    from runtime.kv_pool import KVPool
    from tiny_engine import TINY

    registered = []
    monkeypatch.setattr(transfer_cuda, "pin_pool", lambda pool: registered.append(pool) or pool)
    allocated = []
    real_zeros = torch.zeros

    def zeros(*a, **kw):
        allocated.append(kw.get("pin_memory", False))
        return real_zeros(*a, **kw)

    monkeypatch.setattr(torch, "zeros", zeros)
    fake = SimpleNamespace(config=SimpleNamespace(mode="lookahead", block_size=4),
                           device=torch.device("cuda"), manifest=SimpleNamespace(model=ModelConfig(**TINY)))
    pool = gdb.RegisteredPoolEngine._make_pool(fake, 8, torch.float32)
    assert isinstance(pool, KVPool) and registered == [pool] and allocated == [False, False]
    assert pool.k.device.type == "cpu" and pool.k.shape[2] == 8


def test_gpu_results_summaries_name_the_prebuilt_load_and_the_hidden_shares():
    from bench.gpu_results import bench_summary, kernels_summary
    assert kernels_summary({"checks": [{"ok": True}], "build_s": 2, "prebuilt": True}) == \
        "numerics 1/1; extension load 2s"
    rows = [{"hidden_share": 0.25}, {"hidden_share": None}, {"hidden_share": 0.9}, {}]
    assert bench_summary({"results": rows}) == "4/4 rows timed; hidden share 25%-90%"


def test_gpu_bench_sizes_the_host_cap_by_what_a_registered_pool_pins():
    """The bench's per-sequence host share on a GPU is the pool's bytes (its pools are registered),
    not torch's power-of-two rounding of one sequence's pool, which would halve the host cap."""
    from bench import gpu_decode as gdb
    cfg = LookaheadConfig(max_model_len=32768 + 64, kv_dtype="bfloat16", top_k=128)
    cpu, gpu = gdb.sizing(LLAMA8B, cfg, 2, "cpu"), gdb.sizing(LLAMA8B, cfg, 2, "cuda")
    assert gpu.host == cpu.host and pinned_bytes(gpu.host // 2) != gpu.host // 2
