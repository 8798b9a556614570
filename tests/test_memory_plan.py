"""The memory plan (issue 19): its numbers are what real engines allocate, tensor for tensor, and
it refuses the settings that used to be OOM-killed or die in allocation tracebacks, at once."""
from __future__ import annotations

import math
import time

import pytest
import torch

from plugins import cpu
from runtime.config import LookaheadConfig, ModelConfig
from runtime.engine import Engine
from runtime.spec import settings_for
from runtime.engine_dir import expected_shapes
from runtime.errors import ConfigError
from runtime.memory_plan import DTYPE_BYTES, available_host_bytes, check_memory, plan_memory
from runtime.model import LlamaModel
from runtime.sampling import SamplingParams
from tiny_engine import TINY, make_tiny_engine

# SmolLM2-135M, the default engine's shape
SMOLLM2 = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                      tie_word_embeddings=True)
GiB = 1 << 30


@pytest.fixture(scope="module")
def eng_dir(tmp_path_factory):
    # 3 layers: resident keeps a buffer per layer, pingpong 2, so the two modes' tiers differ
    return make_tiny_engine(tmp_path_factory.mktemp("mp") / "e", num_layers=3)


def storages(obj, out: dict, seen: set, skip: tuple) -> dict:
    """Every tensor storage reachable from `obj` through runtime objects and containers, by
    address (views share their base's storage, so each buffer counts once)."""
    if id(obj) in seen or obj is None or any(obj is s for s in skip):
        return out
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for x in obj:
            storages(x, out, seen, skip)
    elif isinstance(obj, dict):
        for x in obj.values():
            storages(x, out, seen, skip)
    elif type(obj).__module__.startswith("runtime") and hasattr(obj, "__dict__"):
        for x in vars(obj).values():
            storages(x, out, seen, skip)
    return out


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


CASES = [dict(mode="dense"), dict(mode="lookahead", residency="resident"),
         dict(mode="lookahead", residency="pingpong", recent_window=40, num_sink_blocks=2)]


@pytest.mark.parametrize("overrides", CASES, ids=["dense", "resident", "pingpong"])
@pytest.mark.parametrize("num_host_blocks", [None, 37])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_plan_matches_what_the_engine_allocates(eng_dir, overrides, num_host_blocks, kv_dtype):
    engine = Engine.from_dir(eng_dir, num_host_blocks=num_host_blocks, max_model_len=200, max_batch_size=3,
                             block_size=8, kv_dtype=kv_dtype, **settings_for(overrides["mode"], dict(top_k=5, **overrides)))
    try:
        plan = plan_memory(engine.manifest.model, engine.config, num_host_blocks, DTYPE_BYTES[engine.manifest.dtype])
        assert engine.pool.k.element_size() == DTYPE_BYTES[kv_dtype]       # the KV storage dtype, not the weights'
        model = engine.model
        assert plan.weights == nbytes(*model.parameters()) > 0
        assert plan.rope == nbytes(model.rope.cos, model.rope.sin) > 0
        assert plan.host_kv_pool == nbytes(engine.pool.k, engine.pool.v) > 0
        assert plan.num_host_blocks == engine.allocator.num_blocks
        held = storages(engine, {}, set(), (engine.model, engine.tokenizer, engine.manifest))
        engine_own = plan.host_kv_pool + plan.device_tier + plan.summaries + plan.cached_summaries + plan.bookkeeping
        assert sum(held.values()) == engine_own           # every tensor the engine holds, nothing missed
        assert plan.exact_total == engine_own + plan.weights + plan.rope + plan.packed_weights
        if overrides["mode"] == "dense":
            assert plan.device_tier == plan.summaries == plan.bookkeeping == plan.per_seq_device == 0
            return
        attn = engine.runner.attn
        assert plan.device_tier == nbytes(attn.dev_k, attn.dev_v) > 0
        assert plan.summaries == nbytes(attn.kmin, attn.kmax) > 0             # fp32 whatever the kv_dtype
        assert plan.cached_summaries == nbytes(attn.store.kmin, attn.store.kmax) > 0   # prefix caching is on
        assert attn.dev_k.dtype == engine.pool.k.dtype                       # the tier follows the pool
        assert plan.per_seq_device_tier == attn.working_set_bytes_per_lane()
        assert plan.per_seq_device == attn.device_bytes_per_lane()          # what the budget bounds
        assert plan.per_seq_device == attn.working_set_bytes_per_lane() + attn.summary_bytes(engine.max_model_len)
        assert plan.bookkeeping > 0
    finally:
        engine.close()


@pytest.mark.skipif(not cpu.available(), reason="plugins.cpu did not build: no packed weights to measure")
def test_packed_weights_match_the_kernels_copies(eng_dir):
    engine = Engine.from_dir(eng_dir, max_model_len=64, max_batch_size=1)
    try:
        engine.generate(["hi"], SamplingParams(max_tokens=3))      # decode steps pack the weights
        packed = [p._lkv_packed[1] for p in engine.model.parameters() if hasattr(p, "_lkv_packed")]
        plan = plan_memory(engine.manifest.model, engine.config, None, 4)
        assert packed and plan.packed_weights == nbytes(*packed)
        assert plan_memory(engine.manifest.model, engine.config, None, 2).packed_weights == 0   # bf16: none
    finally:
        engine.close()


@pytest.mark.parametrize("changes", [dict(), dict(tie_word_embeddings=True), dict(attention_bias=True),
                                     dict(vocab_size=250, num_layers=5), dict(architecture="qwen3", head_dim=32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_match_the_model_and_the_layout(changes, dtype):
    cfg = ModelConfig(**{**TINY, **changes})
    b = torch.finfo(dtype).bits // 8
    plan = plan_memory(cfg, LookaheadConfig(), None, b)
    assert plan.weights == b * sum(math.prod(s) for s in expected_shapes(cfg).values())
    meta = LlamaModel(cfg, dtype=dtype, empty=True)            # meta parameters: no allocation
    assert plan.weights == sum(p.numel() for p in meta.parameters()) * b


def test_weights_false_counts_only_the_engine():
    plan = plan_memory(SMOLLM2, LookaheadConfig(), None, 4, weights=False)
    assert plan.weights == plan.packed_weights == plan.rope == 0 and plan.host_kv_pool > 0


def test_the_defaults_fit_and_match_the_readme():
    cfg = LookaheadConfig(mode="lookahead")
    plan = plan_memory(SMOLLM2, cfg, None, 4)
    check_memory(plan, cfg, available_bytes=16 * GiB)
    assert round(plan.per_seq_device_tier / 2 ** 20, 1) == 94.2             # README: 94 MiB resident
    pp = plan_memory(SMOLLM2, cfg.replace(residency="pingpong"), None, 4)
    assert round(pp.per_seq_device_tier / 2 ** 20, 1) == 6.3                # and 6.3 MiB pingpong
    half = plan_memory(SMOLLM2, cfg.replace(kv_dtype="float16"), None, 4)   # fp16 KV: half of each
    assert (2 * half.per_seq_device_tier, 2 * half.device_tier, 2 * half.host_kv_pool) == \
        (plan.per_seq_device_tier, plan.device_tier, plan.host_kv_pool)
    assert 2 * half.summaries == plan.summaries and half.weights == plan.weights   # summaries in the KV dtype
    gpu = plan_memory(SMOLLM2, cfg.replace(kv_dtype="float16"), None, 4, device_type="cuda")
    assert gpu.summaries == plan.summaries                                  # fp32 on a GPU


@pytest.mark.parametrize("overrides,field", [
    (dict(mode="lookahead", top_k=5000), "top_k"),            # was OOM-killed at 24 GB
    (dict(mode="lookahead", top_k=100000), "top_k"),
    (dict(max_batch_size=200), "max_batch_size"),              # dense too
    (dict(mode="lookahead", max_batch_size=200), "max_batch_size"),
    (dict(mode="lookahead", recent_window=10_000_000), "recent_window"),
    (dict(mode="lookahead", block_size=4096), "block_size"),
    (dict(mode="lookahead", num_sink_blocks=60000), "num_sink_blocks"),
])
def test_bad_settings_are_refused_naming_the_field(overrides, field):
    cfg = LookaheadConfig().replace(**overrides)
    t0 = time.perf_counter()
    plan = plan_memory(SMOLLM2, cfg, None, 4)
    with pytest.raises(ConfigError) as e:
        check_memory(plan, cfg, available_bytes=16 * GiB)
    assert time.perf_counter() - t0 < 1.0                     # arithmetic only, nothing allocated
    err = e.value
    assert err.field == field and str(err).startswith(f"{field}: ") and "\n" not in str(err)
    fit = int(err.fix.split("<= ")[1].split(",")[0])
    # the advice is exact: the named value fits, one step above it does not
    limit = int(16 * GiB * 0.9)
    assert plan_memory(SMOLLM2, cfg.replace(**{field: fit}), None, 4).total <= limit
    above = fit * 2 if field == "block_size" else fit + 1
    assert plan_memory(SMOLLM2, cfg.replace(**{field: above}), None, 4).total > limit


def test_block_size_beyond_its_bound_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="^block_size"):
        LookaheadConfig(block_size=1048576)


def test_a_small_machine_names_the_batch_size():
    cfg = LookaheadConfig()
    with pytest.raises(ConfigError, match=r"^max_batch_size: 8 makes .* \(use max_batch_size <= \d, or free memory\)"):
        check_memory(plan_memory(SMOLLM2, cfg, None, 4), cfg, available_bytes=3 * GiB)


def test_fixed_host_blocks_are_named():
    cfg = LookaheadConfig()
    with pytest.raises(ConfigError, match="^num_host_blocks"):
        check_memory(plan_memory(SMOLLM2, cfg, 10 ** 6, 4), cfg, available_bytes=16 * GiB)


def test_weights_alone_too_big_is_refused():
    cfg = LookaheadConfig()
    with pytest.raises(ConfigError, match="^memory: the model"):
        check_memory(plan_memory(SMOLLM2, cfg, None, 4), cfg, available_bytes=GiB // 2)


@pytest.mark.parametrize("budget,kind", [(100_000, "top_k=5 needs"), (3_000, "cannot hold the sink")])
def test_device_budget_is_checked_before_allocating(eng_dir, budget, kind):
    """Engine.from_dir refuses a budget with the plan's message (lookahead/budget.py), summaries counted."""
    overrides = dict(mode="lookahead", max_model_len=200, max_batch_size=3, top_k=5, block_size=8,
                     device_budget_bytes=budget)
    with pytest.raises(ConfigError) as after:
        Engine.from_dir(eng_dir, **overrides)
    cfg = LookaheadConfig().replace(**overrides)
    with pytest.raises(ConfigError) as before:
        check_memory(plan_memory(ModelConfig(**{**TINY, "num_layers": 3}), cfg, None, 4), cfg,
                     available_bytes=16 * GiB)
    assert str(before.value) == str(after.value)
    assert str(before.value).startswith("device_budget_bytes: ") and kind in str(before.value)


def test_available_host_bytes_reads_meminfo_and_cgroups(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    assert available_host_bytes(meminfo, cg) == 8000000 * 1024
    (cg / "memory.max").write_text("max\n")
    assert available_host_bytes(meminfo, cg) == 8000000 * 1024                 # unlimited cgroup
    (cg / "memory.max").write_text(str(2 * GiB))
    (cg / "memory.current").write_text(str(GiB))
    (cg / "memory.stat").write_text(f"anon 1\ninactive_file {GiB // 4}\n")
    assert available_host_bytes(meminfo, cg) == GiB + GiB // 4                  # the cgroup is tighter
    assert 0 < available_host_bytes() < 1 << 50                                 # this machine


@pytest.mark.parametrize("mode", ["dense", "lookahead"])
def test_on_a_gpu_only_the_host_share_is_held_against_host_memory(mode):
    """A plan for device_type cuda counts the lookahead host pool (and the allocator) as host
    memory (and the cached blocks' summaries), not what Engine puts on the GPU: weights, the dense
    pool, the device tier, the lanes' summaries."""
    cfg = LookaheadConfig(mode=mode)
    cpu_plan = plan_memory(SMOLLM2, cfg, None, 4)
    gpu_plan = plan_memory(SMOLLM2, cfg, None, 4, device_type="cuda")
    assert cpu_plan.host_total == cpu_plan.total
    assert gpu_plan.packed_weights == 0                  # plugins.cpu packs weights on CPU only
    # the lookahead host pool, and with prefix caching the summaries of its cached blocks beside it
    expected = {"allocator"} | ({"host_kv_pool", "cached_summaries"} if mode == "lookahead" else set())
    assert {k for k, v in gpu_plan.host_components().items() if v} == expected
    assert gpu_plan.host_total == sum(getattr(gpu_plan, k) for k in expected) < cpu_plan.total
    check_memory(gpu_plan, cfg, available_bytes=int(gpu_plan.host_total / 0.9) + 1)
    with pytest.raises(ConfigError):
        check_memory(cpu_plan, cfg, available_bytes=int(gpu_plan.host_total / 0.9) + 1)
