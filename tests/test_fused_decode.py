"""The fused dense decode step (plugins/cpu/decode.c via plugins/cpu/fused.py, issue 18 item 4):
one C call per step in place of the model's layers over DenseStep, which stay the reference.

What is checked, on fresh random tiny models (fp32, weight-only int8 with a qkv bias, and qwen3:
q/k norms with YaRN), at
batch 1 and 3, several contexts and block sizes, with fp32 / fp16 / bf16 KV:
- the default (one C call a step; SiLU with torch's own vector exp, where fused.silu_binding finds
  that it reproduces F.silu here) and torch's SiLU between C calls (`silu="torch"`): every logit,
  every greedy token and every byte of the KV pool equal the Python path's, bit for bit, at 1 and
  2 threads: each stage calls the same kernels in the same order, or rounds like torch's ops;
- SiLU with common.h's exp (`silu="own"`, what the default falls back to where torch's exp does
  not reproduce F.silu): logits within LOGIT_TOL of the Python path's, the same greedy tokens;
- the path ran: `runner.fused.steps` equals the steps it can take (every item one token, its
  blocks one run), and a step it cannot take (scattered blocks, a prefill chunk) runs the Python
  path; a model or ops it does not take leave `runner.fused` None with the reason;
- the comparison can fail: a decoder bound with a wrong attention scale, or to stale weights,
  gives other logits.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from builder.quantize import DEFAULT_GROUP_SIZE, quantize_weights
from plugins import cpu
from runtime.config import LookaheadConfig, ModelConfig
from runtime.engine import Engine
from runtime.engine_dir import TOKENIZER_DIR, WEIGHTS, write_manifest
from runtime.model import LlamaModel
from runtime.observe import Observer
from runtime.sampling import SamplingParams
from runtime.internals import Internals
from tiny_engine import QWEN3_YARN, TINY, byte_tokenizer, make_tiny_engine, random_prompts

pytestmark = [pytest.mark.skipif(not cpu.available(), reason="no CPU kernels"),
              pytest.mark.usefixtures("one_thread")]

# max |logit(silu="own") - logit(Python path)| on these models (|logits| <~ 5). The only
# difference is SiLU's exp (common.h's against torch's Sleef), a few ulp per activation, which a
# 16-bit cache can turn into one rounding step of a stored K/V value. Measured over this module's
# cases: fp32 KV 1.9e-6, fp16 1.7e-5, bf16 1.7e-6 (SmolLM2, |logits| <~ 38: 5.9e-5 and, fp16, 2.2e-3)
LOGIT_TOL = {"float32": 1e-5, "float16": 1e-4, "bfloat16": 3e-4}
SHAPE = dict(head_dim=32)          # D % 32 == 0: the Python path runs the paged C attention too
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def make_int8_engine(path: Path, seed: int = 0, group_size: int = DEFAULT_GROUP_SIZE, **overrides) -> Path:
    """A tiny random engine dir with weight-only int8 projections and embedding (builder.quantize),
    a scale per `group_size` inputs (0: per output channel)."""
    cfg = ModelConfig(**{**TINY, **SHAPE, **overrides})
    qstate, section = quantize_weights(dict(LlamaModel.random(cfg, seed=seed).state_dict()), cfg,
                                       group_size=group_size)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in qstate.items()}, str(path / WEIGHTS))
    (path / TOKENIZER_DIR).mkdir(exist_ok=True)
    byte_tokenizer().save(str(path / TOKENIZER_DIR / "tokenizer.json"))
    write_manifest(path, name="tiny-int8", model=cfg, dtype="float32", lookahead=LookaheadConfig(),
                   source={"kind": "random", "seed": seed}, versions={}, quantization=section)
    return path


def fp32_and_int8_dirs(root: Path, seed: int) -> dict[str, Path]:
    """A tiny random fp32 engine, an int8 one (with a qkv bias) and an fp32 qwen3 one (q/k norms,
    YaRN), head_dim 32: the C kernels' shapes."""
    return {"fp32": make_tiny_engine(root / "fp32", seed=seed, **SHAPE),
            "int8": make_int8_engine(root / "int8", seed=seed + 1, attention_bias=True),
            "qwen3": make_tiny_engine(root / "qwen3", seed=seed + 2, **QWEN3_YARN)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    # int8: a scale per 64 inputs (the default; wo has 192), int8g16: per 16, int8pc: per output channel
    return {"fp32": make_tiny_engine(root / "fp32", seed=21, **SHAPE),
            "int8": make_int8_engine(root / "int8", seed=22, attention_bias=True),
            "int8g16": make_int8_engine(root / "int8g16", seed=23, group_size=16, attention_bias=True),
            "int8pc": make_int8_engine(root / "int8pc", seed=24, group_size=0),
            "qwen3": make_tiny_engine(root / "qwen3", seed=25, **QWEN3_YARN)}




class Record(Observer):
    """Each step's emitted logits, and how many steps the fused path could take."""

    def __init__(self, engine):
        self.engine, self.logits, self.eligible, self.steps = engine, [], 0, 0

    def on_batch(self, batch):
        self.steps += 1
        # one token an item, its blocks anywhere (a run, or a block table: decode.c reads both); a
        # one-token prompt chunk takes the prefill kernels where the table has them
        prefill = self.engine.ops.prefill_attention is not None
        self.eligible += (all(it.num_tokens == 1 and not (it.prompt and prefill) for it in batch.items)
                          and not batch.store_only)

    def on_step_end(self, logits):
        self.logits.append({k: v.clone() for k, v in logits.items()})


def engine(d: Path, fused: str, **kw) -> Engine:
    """fused: "off" (`fused=False`), "auto" (the default), or the decoder rebound with
    silu "torch" (SiLU by torch between C calls) or "own" (common.h's exp)."""
    eng = Engine.from_dir(d, internals=Internals(fused=fused != "off"), **kw)
    if fused in ("torch", "own"):
        eng.runner.fused, _ = eng.model.fused_decoder(eng.pool.k, eng.pool.v, eng.runner.attn.scale, silu=fused)
    assert (eng.runner.fused is None) == (fused == "off"), eng.runner.fused_reason
    return eng


def flat(rec: Record) -> list[torch.Tensor]:
    """The recorded logits in step order, each step's by sequence order."""
    return [step[sid] for step in rec.logits for sid in sorted(step)]


def same(a: Record, b: Record) -> bool:
    return len(a.logits) == len(b.logits) and all(torch.equal(x, y) for x, y in zip(flat(a), flat(b)))


def run(eng: Engine, prompts, params=GREEDY):
    rec = eng.observe(Record(eng))
    try:
        out = eng.generate(prompts, params)
    finally:
        eng.observers.remove(rec)
    return [c.token_ids for c in out], rec


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("model", ["fp32", "int8", "int8g16", "int8pc", "qwen3"])
@pytest.mark.parametrize("batch,context,block_size", [(1, 1, 4), (1, 37, 4), (3, 64, 16), (3, 300, 4)])
def test_fused_step_equals_python_path(dirs, model, kv_dtype, batch, context, block_size):
    prompts = random_prompts(*([context] if batch == 1 else [context, max(1, context // 3), context - 5]),
                             seed=context)
    # the prompts' rows in fp32 too: this compares decode paths (prefill kernels: test_prefill_precision.py)
    kw = dict(kv_dtype=kv_dtype, block_size=block_size, max_batch_size=4, prefill_precision="float32")
    ref_eng = engine(dirs[model], "off", **kw)
    ref_tokens, ref = run(ref_eng, prompts)
    for mode in ("torch", "auto", "own"):
        eng = engine(dirs[model], mode, **kw)
        tokens, got = run(eng, prompts)
        assert eng.runner.fused.steps == got.eligible > 0, (mode, eng.runner.fused.steps, got.eligible)
        assert tokens == ref_tokens, mode
        assert len(got.logits) == len(ref.logits)
        for a, b in zip(got.logits, ref.logits):
            assert a.keys() == b.keys()
            for sid in a:
                if eng.runner.fused.exact:
                    assert torch.equal(a[sid], b[sid]), f"{mode}: {float((a[sid] - b[sid]).abs().max())}"
                else:
                    torch.testing.assert_close(a[sid], b[sid], rtol=0, atol=LOGIT_TOL[kv_dtype])
        if eng.runner.fused.exact:       # the K/V it stored, as stored
            assert torch.equal(eng.pool.k, ref_eng.pool.k) and torch.equal(eng.pool.v, ref_eng.pool.v)


@pytest.mark.parametrize("model", ["fp32", "int8", "int8g16", "qwen3"])
def test_bit_equal_at_two_threads(dirs, model):
    torch.set_num_threads(2)
    prompts = random_prompts(600, 41, seed=5)       # 600 keys: the attention kernel splits key ranges
    kw = dict(kv_dtype="float16", block_size=16, max_batch_size=2)
    ref_eng = engine(dirs[model], "off", **kw)
    ref_tokens, ref = run(ref_eng, prompts)
    for mode in ("torch", "auto"):
        eng = engine(dirs[model], mode, **kw)
        tokens, got = run(eng, prompts)
        assert tokens == ref_tokens and eng.runner.fused.steps == got.eligible > 0
        if eng.runner.fused.exact:
            assert same(got, ref)
            assert torch.equal(eng.pool.k, ref_eng.pool.k) and torch.equal(eng.pool.v, ref_eng.pool.v)


def test_steps_it_cannot_take_run_the_python_path(dirs):
    """A prefill chunk next to decode rows: those steps run the layers in Python, the others
    fused, scattered blocks (a fragmented free list) too; the tokens are the Python path's."""
    prompts = random_prompts(9, 30, 14, seed=3)
    kw = dict(block_size=4, max_batch_size=4, num_host_blocks=64, prefill_chunk=6)

    def fragmented(eng):
        eng.allocator.allocate(3)
        hole = eng.allocator.allocate(2)
        eng.allocator.allocate(1)
        eng.allocator.free(hole)                    # the next sequence's blocks are not one run
        return eng

    ref_tokens, _ = run(fragmented(engine(dirs["fp32"], "off", **kw)), prompts)
    eng = fragmented(engine(dirs["fp32"], "auto", **kw))
    tokens, got = run(eng, prompts)
    assert tokens == ref_tokens
    assert eng.runner.fused.steps == got.eligible
    assert 0 < got.eligible < got.steps           # some steps fused, some (prefill) not


def test_models_and_ops_it_does_not_take(dirs, tmp_path):
    assert Engine.from_dir(dirs["fp32"]).runner.fused is not None
    small = make_tiny_engine(tmp_path / "d16", seed=1)               # head_dim 16: no C attention
    eng = Engine.from_dir(small)
    assert eng.runner.fused is None and "head_dim 16" in eng.runner.fused_reason
    eng = Engine.from_dir(dirs["int8"], internals=Internals(debug_checks=True))           # the checked ops: every call seen
    assert eng.runner.fused is None and "checked" in eng.runner.fused_reason
    eng = Engine.from_dir(dirs["fp32"], mode="lookahead", block_size=4)
    assert eng.runner.fused is not None          # lookahead: the layers around its attention (test_fused_lookahead)
    eng = Engine.from_dir(dirs["fp32"], internals=Internals(fused=False))
    assert eng.runner.fused is None and eng.runner.fused_reason == "fused=False"
    assert eng.sibling().runner.fused is None and eng.sibling(internals=Internals(fused=True)).runner.fused is not None
    eng = Engine.from_dir(dirs["fp32"], internals=Internals(impl="torch"))                # the torch table: no C entry
    assert eng.runner.fused is None and "torch" in eng.runner.fused_reason


def test_groups_the_kernel_does_not_take_run_the_python_path(tmp_path, monkeypatch):
    """Scales per 4 inputs (valid in an engine dir; the builder asks for multiples of 8): the C
    kernel reads eight weights of one group at a time, so the fused step refuses the first such
    projection and the Python path (linear_int8's torch dequantization) decodes."""
    from builder import quantize as quantize_mod

    monkeypatch.setattr(quantize_mod, "GROUP_MULTIPLE", 4)
    d = make_int8_engine(tmp_path / "g4", seed=25, group_size=4)
    eng = Engine.from_dir(d)
    assert eng.runner.fused is None and "layers.0.wqkv" in eng.runner.fused_reason
    assert eng.model.layers[0].wqkv.weight.group_size == 4
    tokens, rec = run(eng, random_prompts(21, 9, seed=2))
    assert [len(t) for t in tokens] == [GREEDY.max_tokens] * 2 and rec.eligible > 0


def test_a_wrong_binding_is_caught(dirs):
    """The comparison is sensitive: a decoder bound with another attention scale gives other logits."""
    prompts = random_prompts(20, seed=9)
    _, ref = run(engine(dirs["fp32"], "off"), prompts)
    eng = engine(dirs["fp32"], "torch")
    eng.runner.fused, _ = eng.model.fused_decoder(eng.pool.k, eng.pool.v, eng.runner.attn.scale * 1.01, silu="torch")
    _, got = run(eng, prompts)
    assert eng.runner.fused.steps > 0
    assert len(got.logits) == len(ref.logits) and not same(got, ref)
    assert torch.equal(flat(got)[0], flat(ref)[0])                  # the prefill's logits (Python path)


def test_weights_changed_in_place_are_rebound(dirs):
    """A weight changed in place (its version counter) is re-packed before the next fused step."""
    prompts = random_prompts(25, seed=4)
    engines = [engine(dirs[m], mode) for m in ("fp32", "int8") for mode in ("off", "torch")]
    assert all(e.runner.fused.exact for e in engines[1::2])
    for eng in engines:
        run(eng, prompts)                       # bound and used once
        with torch.no_grad():
            layer = eng.model.layers[1]
            layer.w2.weight.mul_(1.5) if isinstance(layer.w2.weight, torch.Tensor) else layer.w2.scale.mul_(1.5)
            eng.model.layers[0].attn_norm.weight.add_(0.25)
    (t0, r0), (t1, r1), (t2, r2), (t3, r3) = (run(eng, prompts) for eng in engines)
    assert engines[1].runner.fused.steps > 7 and engines[3].runner.fused.steps > 7
    assert t0 == t1 and t2 == t3
    assert same(r0, r1) and same(r2, r3)
    engines[0].model.layers[1].w2.weight.div_(1.5)                       # and the change did change them
    t4, r4 = run(engines[0], prompts)
    assert len(r4.logits) == len(r0.logits) and not same(r4, r0)


def test_a_step_the_kernel_refuses_writes_nothing(dirs):
    """Inconsistent step metadata (the new row's slot outside its run, a position past the RoPE
    table, a run past the pool, a token past the vocabulary) is refused in C before anything is
    written: run() returns None, the pool is untouched."""
    eng = engine(dirs["fp32"], "auto", block_size=4)
    dec, pool = eng.runner.fused, eng.pool
    pool.k.normal_(), pool.v.normal_()
    k0, v0 = pool.k.clone(), pool.v.clone()
    t = lambda *xs: torch.tensor(xs, dtype=torch.long)                 # noqa: E731
    args = (t(5), t(9), t(2), t(1), [0], [10])                          # consistent
    assert dec.run(*args) is None                                       # autograd on: the Python path
    with torch.inference_mode():
        assert dec.run(t(5), t(9), t(7), t(1), [0], [10]) is None          # slot block 7 is not 0 + 9 // 4
        assert dec.run(t(5), t(9), t(2), t(1), [0], [11]) is None          # lens must be position + 1
        assert dec.run(t(5), t(4096), t(1024), t(0), [0], [4097]) is None  # past max_position_embeddings
        assert dec.run(t(256), t(9), t(2), t(1), [0], [10]) is None        # token outside the vocabulary
        nb = pool.num_blocks
        assert dec.run(t(5), t(19), t(nb + 2), t(3), [nb - 2], [20]) is None   # a run past the pool's end
        assert torch.equal(pool.k, k0) and torch.equal(pool.v, v0) and dec.steps == 0
        out = dec.run(*args)                                               # consistent: runs, stores its row
        assert out is not None and out.shape == (1, 64) and dec.steps == 1
        assert not torch.equal(pool.k[:, :, 2, 1], k0[:, :, 2, 1])
        assert torch.equal(pool.k[:, :, 3:], k0[:, :, 3:])


INT8_ENGINE = Path(__file__).resolve().parents[1] / "engines" / "int8"


@pytest.mark.real_model
@pytest.mark.parametrize("which", ["default", "int8"])
def test_real_model_fused_step_equals_python_path(default_engine, which):
    """SmolLM2 (30 layers, D = 64, GQA 3): the default engine (fp32 weights, fp32 and fp16 KV) and
    the int8 engine where `make engine-int8` has built it; batch 2 over prompts of 300 and 40
    tokens. torch's SiLU: bit-equal logits, tokens and pool; the default: the same tokens, and
    bit-equal logits where torch's exp binds (fused.silu_binding)."""
    if which == "int8":
        if not (INT8_ENGINE / "engine.yaml").is_file():
            pytest.skip("engines/int8 is not built (make engine-int8)")
        base = Engine.from_dir(INT8_ENGINE, verify_checksums=False, max_batch_size=2, max_model_len=512)
    else:
        base = default_engine
    prompts = [base.tokenizer.encode(Path(__file__).read_text())[:n] for n in (300, 40)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for kv in (["float32", "float16"] if which == "default" else ["float16"]):
        results = {}
        for mode in ("off", "torch", "auto"):
            eng = base.sibling(max_batch_size=2, max_model_len=512, kv_dtype=kv, internals=Internals(fused=mode != "off"))
            if mode == "torch":
                eng.runner.fused, _ = eng.model.fused_decoder(eng.pool.k, eng.pool.v, eng.runner.attn.scale,
                                                              silu="torch")
            results[mode] = run(eng, prompts, params) + (eng,)
            if mode != "off":
                assert eng.runner.fused.steps == results[mode][1].eligible == 5       # every decode step
        (t0, r0, e0), (t1, r1, e1), (t2, r2, _) = results["off"], results["torch"], results["auto"]
        assert t0 == t1 == t2
        assert same(r0, r1) and torch.equal(e0.pool.k, e1.pool.k) and torch.equal(e0.pool.v, e1.pool.v)
        assert same(r0, r2) or not results["auto"][2].runner.fused.exact


def test_silu_binding_reproduces_torch_or_falls_back(dirs, monkeypatch):
    """torch's exp with torch's loop split gives F.silu(gate) * up bit for bit (where it is found);
    another split does not, which the probe sees; without torch's exp the decoder uses its own
    (not exact) and still decodes like the Python path."""
    from plugins.cpu import fused
    from plugins.cpu.loader import library
    exp8, chunk = fused.silu_binding(1536)
    if exp8 is None:
        pytest.skip("torch's vector exp does not reproduce F.silu on this machine")
    gu = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * 5
    want = torch.mul(torch.nn.functional.silu(gu[:, :48]), gu[:, 48:])
    def silu_mul(c: int) -> torch.Tensor:
        act = torch.empty_like(want)
        library().lkv_silu_mul(gu.data_ptr(), act.data_ptr(), 64, 48, exp8, c)
        return act
    assert torch.equal(silu_mul(chunk), want)
    # whether another split differs depends on the CPU (torch's exp is the same polynomial either
    # way; only the scalar tail's rows move): where it does, the probe must not have picked it
    for c in (8, 16, 32):
        assert torch.equal(silu_mul(c), want) or c != chunk, c
    monkeypatch.setattr(fused, "_silu_bindings", {})
    monkeypatch.setattr(fused, "torch_vector_exp", lambda: None)
    eng = engine(dirs["int8"], "auto")
    assert not eng.runner.fused.exact
    prompts = random_prompts(33, 12, seed=8)
    tokens, got = run(eng, prompts)
    ref_tokens, ref = run(engine(dirs["int8"], "off"), prompts)
    assert tokens == ref_tokens and eng.runner.fused.steps == got.eligible > 0
    assert max(float((a - b).abs().max()) for a, b in zip(flat(got), flat(ref))) <= LOGIT_TOL["float32"]


def test_load_weights_rebinds(dirs):
    """load_weights replaces the tensors (assign=True): the runner re-binds its fused step."""
    prompts = random_prompts(19, 7, seed=6)
    engines = [engine(dirs["int8"], mode) for mode in ("off", "auto")]
    for eng in engines:
        run(eng, prompts)
        state = {k: v.clone() for k, v in eng.model.state_dict().items()}
        state["layers.1.w13.scale"] *= 0.75
        eng.model.load_weights(state)
    first = engines[1].runner.fused
    (t0, r0), (t1, r1) = (run(eng, prompts) for eng in engines)
    assert engines[1].runner.fused is not first and engines[1].runner.fused.steps == r1.eligible > 0
    assert t0 == t1 and (same(r0, r1) or not engines[1].runner.fused.exact)
