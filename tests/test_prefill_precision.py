"""The engine's prefill precision (LookaheadConfig.prefill_precision, runtime/ops.py resolve_prefill):
what "auto" picks and what it refuses, that a prompt's rows take the prefill kernels while decode
rows compute exactly as before, that a prompt's result does not depend on how it is chunked, cached
or batched, the memory plan's count of the kernels' weight copies, and on the default model that
the bf16 path answers the builder's verification prompts exactly as fp32 does."""
from __future__ import annotations

import pytest
import torch

from builder.verify import PROMPTS
from plugins import cpu
from plugins.cpu import loader, prefill
from runtime.config import LookaheadConfig
from runtime.engine import Engine
from runtime.errors import ConfigError
from runtime.memory_plan import plan_memory
from runtime.ops import resolve_prefill, select_ops
from runtime.sampling import SamplingParams
from runtime.internals import Internals

from builder_fixtures import write_checkpoint
from tiny_engine import SMALL_LOOKAHEAD, make_tiny_engine, random_prompts

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"plugins.cpu: {loader.unavailable_reason()}")
BF16 = pytest.mark.skipif(not prefill.bf16_dot_products(), reason="this CPU has no AVX512_BF16 (auto stays float32)")
VNNI = pytest.mark.skipif(not prefill.int8_dot_products(), reason="this CPU has no AVX512_VNNI (auto keeps int8 off)")
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # head_dim 32 (the kernel takes multiples of 16), 3 query heads per KV head
    return make_tiny_engine(tmp_path_factory.mktemp("tiny_pf"), seed=5, num_heads=6, num_kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory):
    from builder import BuildConfig, build
    root = tmp_path_factory.mktemp("int8_pf")
    src = write_checkpoint(root / "ckpt", "llama", seed=21, intermediate_size=128)
    build(BuildConfig(model=str(src), output=str(root / "engine"), quantize="int8"), log=lambda line: None)
    return root / "engine"


def run(engine, prompts, sp=GREEDY):
    """Greedy tokens, and every step's logits per sequence (the first: the prompt's last row)."""
    seen: dict[int, list[torch.Tensor]] = {}
    orig = engine.runner.run

    def spy(work, **kw):
        out = orig(work, **kw)
        for sid, lg in out.items():
            seen.setdefault(sid, []).append(lg.float().clone())
        return out
    engine.runner.run = spy
    try:
        outs = engine.generate(prompts, sp)
    finally:
        del engine.runner.run
    run.cached = [c.cached_tokens for c in outs]
    return [c.token_ids for c in outs], [torch.stack(v) for _, v in sorted(seen.items())]


# ---- what auto picks, what is refused ------------------------------------------------------------
def test_auto_picks_the_fastest_units_this_cpu_has():
    want = "bfloat16" if prefill.bf16_dot_products() else "float32"
    assert resolve_prefill("auto", CPU, torch.float32, quantized=False) == want
    want8 = "int8" if prefill.int8_dot_products() else want
    assert resolve_prefill("auto", CPU, torch.float32, quantized=True) == want8
    # per-output-channel (or coarse) weight scales: W8A8 would quantize whole rows, auto stays bf16
    assert resolve_prefill("auto", CPU, torch.float32, quantized=True, int8_group=0) == want
    assert resolve_prefill("auto", CPU, torch.float32, quantized=True, int8_group=128) == want
    assert resolve_prefill("auto", CPU, torch.float32, False, impl="torch") == "float32"   # the reference table
    assert resolve_prefill("bfloat16", CPU, torch.float32, False, impl="torch") == "bfloat16"   # asked for


@pytest.mark.parametrize("precision,dtype,quantized,match", [
    ("int8", torch.float32, False, "int8 needs int8 weights"),
    ("bfloat16", torch.bfloat16, False, "16-bit engine prefills in its own dtype"),
    ("int8", torch.float16, True, "16-bit engine"),
    ("fp8", torch.float32, False, "is not a prefill precision")])
def test_a_precision_the_engine_cannot_take_is_a_config_error(precision, dtype, quantized, match):
    with pytest.raises(ConfigError, match=f"^prefill_precision: .*{match}"):
        resolve_prefill(precision, CPU, dtype, quantized)


def test_the_config_field_is_checked_and_reaches_the_engine(tiny_dir):
    with pytest.raises(ConfigError, match="^prefill_precision: 'half' is not a prefill precision"):
        LookaheadConfig(prefill_precision="half")
    with pytest.raises(ConfigError, match="^prefill_precision: int8 needs int8 weights"):
        Engine.from_dir(tiny_dir, prefill_precision="int8")
    eng = Engine.from_dir(tiny_dir, prefill_precision="float32")
    assert eng.config.prefill_precision == "float32" and eng.ops.prefill_linear is None
    twin = eng.sibling(prefill_precision="bfloat16")      # its own table over the same weights
    assert twin.config.prefill_precision == "bfloat16" and twin.ops.prefill_attention is not None
    assert twin.model.layers is eng.model.layers and eng.ops.prefill_attention is None
    assert twin._identity() != eng._identity()            # a prefix cache does not mix their blocks


# ---- prompt rows take the kernels, decode rows do not --------------------------------------------
@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_prompt_rows_take_the_prefill_kernels_and_decode_rows_do_not(tiny_dir, precision):
    calls: dict[str, int] = {}

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **k)
        return wrapped
    ops = select_ops(CPU, torch.float32, "c", prefill=precision).wrapped(count)
    eng = Engine.from_dir(tiny_dir, internals=Internals(ops=ops), block_size=4, prefill_chunk=16)
    eng.generate(random_prompts(20, seed=1), SamplingParams(max_tokens=1, ignore_eos=True))
    prompt_calls = dict(calls)
    calls.clear()
    eng.generate(random_prompts(20, seed=1), SamplingParams(max_tokens=4, ignore_eos=True))   # a cache hit + decode
    if precision == "float32":
        assert "prefill_linear" not in prompt_calls and "prefill_attention" not in prompt_calls
        return
    layers = eng.manifest.model.num_layers
    assert prompt_calls["prefill_attention"] == 2 * layers          # two chunks (16 + 4 rows)
    assert prompt_calls["prefill_linear"] == 2 * layers * 4         # qkv, o, gate-up, down per layer and chunk
    assert calls["prefill_attention"] == layers                      # the uncached last token: one chunk
    assert calls["linear"] > 0                                       # the decode steps: fp32's own projections


@BF16
@pytest.mark.parametrize("mode", ["dense", "lookahead"])
def test_a_prompt_does_not_depend_on_its_chunking(tiny_dir, mode):
    """Chunks of 7 rows and one chunk of all: the same first logits, bit for bit (every row's sums
    run in one order, whatever the chunk), and the same tokens."""
    kw = dict(SMALL_LOOKAHEAD, top_k=8) if mode == "lookahead" else dict(block_size=4)
    ps = random_prompts(61, 33, seed=2)
    a, al = run(Engine.from_dir(tiny_dir, prefill_precision="bfloat16", prefill_chunk=7, prefix_caching=False, **kw), ps)
    b, bl = run(Engine.from_dir(tiny_dir, prefill_precision="bfloat16", prefill_chunk=256, prefix_caching=False, **kw),
                ps)
    assert a == b
    for x, y in zip(al, bl):
        assert torch.equal(x[0], y[0])


@BF16
def test_a_cache_hit_answers_as_the_cold_prompt(tiny_dir):
    """A prompt whose first blocks are cached prefills only its tail (here one token): the same
    tokens and first logits as cold."""
    p = random_prompts(41, seed=3)[0]
    cold, cl = run(Engine.from_dir(tiny_dir, prefill_precision="bfloat16", block_size=4, prefix_caching=False), [p])
    eng = Engine.from_dir(tiny_dir, prefill_precision="bfloat16", block_size=4)
    run(eng, [p[:40]])
    hit, hl = run(eng, [p])
    assert run.cached == [40]
    assert hit == cold and torch.equal(hl[0][0], cl[0][0])


@BF16
def test_decode_rows_beside_a_prompt_compute_as_alone(tiny_dir):
    """A step that mixes decode rows and a prompt chunk: the decode rows take fp32's projections
    and attention, so a sequence's every logit equals its run alone at float32 prefill after its
    own (bf16) prompt; checked against the same sequence decoding next to no prompt."""
    a_prompt, b_prompt = random_prompts(9, 70, seed=4)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    alone_t, alone_l = run(Engine.from_dir(tiny_dir, prefill_precision="bfloat16", block_size=4, prefill_chunk=8,
                                           internals=Internals(fused=False)), [a_prompt], sp)
    eng = Engine.from_dir(tiny_dir, prefill_precision="bfloat16", block_size=4, prefill_chunk=8, internals=Internals(fused=False),
                          max_batch_size=2)
    toks, logits = run(eng, [a_prompt, b_prompt], sp)        # b's chunks run beside a's decode steps
    assert toks[0] == alone_t[0]
    torch.testing.assert_close(logits[0], alone_l[0], rtol=0, atol=1e-5)


@BF16
def test_the_torch_formulation_agrees_with_the_kernels(tiny_dir):
    """A torch table's bf16 prefill (machines without the kernels) rounds what the kernels round
    but for the kernel's bf16 probabilities: the two within a few % of the logits' spread, both
    as close to fp32's (a wrong scale or row would be off by the spread itself)."""
    ps = random_prompts(45, seed=6)
    c = run(Engine.from_dir(tiny_dir, internals=Internals(ops=select_ops(CPU, torch.float32, "c", prefill="bfloat16")), block_size=4), ps)
    t = run(Engine.from_dir(tiny_dir, internals=Internals(ops=select_ops(CPU, torch.float32, "torch", prefill="bfloat16")), block_size=4), ps)
    f = run(Engine.from_dir(tiny_dir, prefill_precision="float32", block_size=4), ps)
    spread = float(f[1][0][0].std())
    assert c[0] == t[0]
    for got in (c, t):
        assert float((got[1][0][0] - f[1][0][0]).abs().max()) < 0.05 * spread
    assert float((c[1][0][0] - t[1][0][0]).abs().max()) < 0.05 * spread


# ---- int8 engines: W8A8 prompts --------------------------------------------------------------------
@VNNI
def test_an_int8_engine_prefills_in_w8a8_close_to_its_weight_only_logits(int8_dir):
    eng = Engine.from_dir(int8_dir, block_size=4)
    assert eng.config.prefill_precision == "int8"
    ps = random_prompts(37, 20, seed=7, vocab=eng.manifest.model.vocab_size)
    w8a8 = run(eng, ps)
    ref = run(eng.sibling(prefill_precision="float32"), ps)
    for x, y in zip(w8a8[1], ref[1]):       # int8 activations per 64 inputs: ~2^-8 of each group's range
        assert float((x[0] - y[0]).abs().max()) < 0.1 * float(y[0].std())
    bf = run(eng.sibling(prefill_precision="bfloat16", allow_unverified_precision=True), ps)   # the build verified int8
    for x, y in zip(bf[1], ref[1]):
        assert float((x[0] - y[0]).abs().max()) < 0.05 * float(y[0].std())


# ---- the memory plan counts what the kernels keep ------------------------------------------------
@BF16
@pytest.mark.parametrize("which", ["bfloat16", "int8"])
def test_the_plan_counts_the_prefill_weight_copies_exactly(tiny_dir, int8_dir, which):
    if which == "int8" and not prefill.int8_dot_products():
        pytest.skip("this CPU has no AVX512_VNNI")
    eng = Engine.from_dir(int8_dir if which == "int8" else tiny_dir, prefill_precision=which, block_size=4)
    eng.generate(random_prompts(30, seed=8, vocab=eng.manifest.model.vocab_size), GREEDY)
    attr = "_lkv_w8a8" if which == "int8" else "_lkv_bf16"
    kept = 0
    for layer in eng.model.layers:
        for mod in (layer.wqkv, layer.wo, layer.w13, layer.w2):
            t = mod.qweight if hasattr(mod, "qweight") else mod.weight
            packed = getattr(t, attr)[1]
            kept += sum(x.numel() * x.element_size() for x in (packed if isinstance(packed, tuple) else (packed,)))
    q = eng.manifest.quantization
    plan = plan_memory(eng.manifest.model, eng.config, None, 4, prefill=which,
                       int8_group=q["group_size"] if q else None)
    assert kept > 0 and plan.prefill_weights == kept
    assert plan_memory(eng.manifest.model, eng.config, None, 4, prefill="float32").prefill_weights == 0


# ---- the default model: the builder's prompts answer as at fp32 ----------------------------------
@BF16
@pytest.mark.real_model
def test_bf16_prefill_answers_the_builders_prompts_as_fp32(default_engine):
    fp32 = default_engine.sibling(prefill_precision="float32")
    bf16 = default_engine.sibling(prefill_precision="bfloat16")
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [default_engine.tokenizer.encode(p) for p in PROMPTS]
    assert [c.token_ids for c in bf16.generate(prompts, sp)] == [c.token_ids for c in fp32.generate(prompts, sp)]


@BF16
def test_a_shared_prefill_cache_replays_only_the_same_precision(tiny_dir):
    """Siblings sharing a PrefillCache (an accuracy eval's modes) replay a prompt only from an
    engine of the same prefill precision: a float32 sibling computes its own prompt."""
    from runtime.prefill_cache import PrefillCache
    cache, p = PrefillCache(), random_prompts(33, seed=9)
    base = Engine.from_dir(tiny_dir, block_size=4, prefix_caching=False)
    bf = run(base.sibling(cache, prefill_precision="bfloat16"), p)
    bf_again = run(base.sibling(cache, prefill_precision="bfloat16"), p)
    fp = run(base.sibling(cache, prefill_precision="float32"), p)
    fp_alone = run(Engine.from_dir(tiny_dir, block_size=4, prefix_caching=False, prefill_precision="float32"), p)
    assert torch.equal(bf_again[1][0][0], bf[1][0][0])
    assert torch.equal(fp[1][0][0], fp_alone[1][0][0]) and not torch.equal(fp[1][0][0], bf[1][0][0])
