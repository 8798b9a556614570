"""The fused layers around the lookahead backend (plugins/cpu/fused.py `run_layers`, decode.c's
lkv_ext_*, issue 18 item 4): a lookahead decode step runs each layer's non-attention stages in C,
one call each side of the backend's (Python) attention, in place of the model's Python layers,
which stay the reference.

Checked on fresh random tiny models (fp32, weight-only int8 with a qkv bias, qwen3 with YaRN), at 1 and 3
sequences, for every residency and miss policy and for sparse attention without look-ahead
(`draft none`), with fp32 and fp16 KV, at 1 and 2 threads:
- every emitted logit and token, every byte of the host pool, the device tier, the slot tables and
  the summaries, and the look-ahead metrics equal the Python path's (`Engine.from_dir(..., fused=False)`),
  bit for bit, where the fused SiLU is exact (`runner.fused.exact`);
- the path ran: `runner.fused.steps` equals the decode-only steps, and prefill steps ran the
  Python path; under the resident policy every decode layer of every step (packed or not, beside
  prefill rows or not) was one C call of the backend (plugins/cpu/lookahead_layer.c: scoring,
  admission, the urgent copy with the transfer engine's kernel, attention, the prediction); an
  observer of scores, or debug checks, keep the torch layer, with the same results;
- the comparison can fail: a decoder whose attention output is perturbed, or a C layer whose
  output is, gives other logits.
"""
from __future__ import annotations

import pytest
import torch

from plugins import cpu
from runtime.engine import Engine
from runtime.observe import Observer
from runtime.sampling import SamplingParams
from runtime.internals import Internals
from test_fused_decode import fp32_and_int8_dirs
from tiny_engine import SMALL_LOOKAHEAD, random_prompts

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no CPU kernels")

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
MODES = {
    "resident-urgent": dict(residency="resident", miss_policy="urgent"),
    "resident-drop": dict(residency="resident", miss_policy="drop"),
    "pingpong": dict(residency="pingpong", miss_policy="urgent"),
    "sparse-ondemand": dict(residency="resident", miss_policy="urgent", draft="none"),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return fp32_and_int8_dirs(tmp_path_factory.mktemp("fused_la"), seed=31)


class Record(Observer):
    """Each step's emitted logits, how many steps were decode-only (the fused path's) and how
    many had decode lanes (the C layer's)."""

    def __init__(self):
        self.logits, self.decode_only, self.decoding = [], 0, 0

    def on_plan(self, plan):
        self.decode_only += not plan.prefill and plan.decode is not None and not plan.batch.store_only
        self.decoding += plan.decode is not None

    def on_step_end(self, logits):
        self.logits.append({k: v.clone() for k, v in logits.items()})


def engine(d, fused: bool, **kw) -> Engine:
    eng = Engine.from_dir(d, mode="lookahead", internals=Internals(fused=fused), **kw)
    assert (eng.runner.fused is not None) == fused, eng.runner.fused_reason
    return eng


def run(eng: Engine, prompts, params: SamplingParams = GREEDY):
    rec = eng.observe(Record())
    try:
        out = eng.generate(prompts, params)
    finally:
        eng.observers.remove(rec)
    rec.metrics = [c.metrics for c in out]       # each request's own (its lane's tallies)
    return [c.token_ids for c in out], rec


def state(eng: Engine) -> dict[str, torch.Tensor]:
    """Every tensor the lookahead step writes: host pool, device tier, slot tables, summaries
    (after the last step's prefetch copies, still in flight on the transfer thread, have landed)."""
    a = eng.runner.attn
    for tickets in a.residency.tickets.values():
        for t in tickets:
            a.transfer.wait(t)
    return {"pool.k": eng.pool.k, "pool.v": eng.pool.v, "tier.k": a.dev_k, "tier.v": a.dev_v,
            "slots.block": a.slots.block, "slots.last_used": a.slots.last_used, "slots.slot_of": a.slots.slot_of,
            "kmin": a.kmin, "kmax": a.kmax, "pred": a.residency.pred}


def check_equal(eng, ref_eng, got, ref, tokens, ref_tokens):
    assert tokens == ref_tokens
    assert eng.runner.fused.steps == got.decode_only > 0
    assert eng.runner.fused.binds == 1          # the pool's writes do not re-bind the weights
    assert ref_eng.runner.attn.c_layer is None
    c = eng.runner.attn.c_layer
    if eng.runner.attn.cfg.residency == "resident":     # every decode layer in one C call
        assert c is not None, eng.runner.attn.c_layer_reason
        assert c.calls == got.decoding * len(eng.model.layers) > 0
    else:
        assert c is None
    assert len(got.logits) == len(ref.logits)
    for a, b in zip(got.logits, ref.logits):
        assert a.keys() == b.keys()
        for sid in a:
            if eng.runner.fused.exact:
                assert torch.equal(a[sid], b[sid]), float((a[sid] - b[sid]).abs().max())
            else:           # SiLU by common.h's exp: a few ulp (test_fused_decode.LOGIT_TOL)
                torch.testing.assert_close(a[sid], b[sid], rtol=0, atol=3e-4)
    if not eng.runner.fused.exact:
        return
    for name, t in state(eng).items():
        assert torch.equal(t, state(ref_eng)[name]), name
    m, r = eng.runner.stats(), ref_eng.runner.stats()
    for key in ("h2d_bytes", "urgent_blocks", "prefetched_blocks", "prefetch_hit_rate", "agreement_mean"):
        assert m[key] == r[key], key
    assert got.metrics == ref.metrics and got.metrics


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
@pytest.mark.parametrize("model", ["fp32", "int8", "qwen3"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_layers_equal_python_path(dirs, mode, model, kv_dtype, batch):
    torch.set_num_threads(1)
    prompts = random_prompts(*([70] if batch == 1 else [70, 23, 51]), seed=batch)
    kw = dict(SMALL_LOOKAHEAD, top_k=4, kv_dtype=kv_dtype, max_batch_size=4, **MODES[mode])
    kw.pop("mode")
    ref_eng = engine(dirs[model], False, **kw)
    ref_tokens, ref = run(ref_eng, prompts)
    eng = engine(dirs[model], True, **kw)
    tokens, got = run(eng, prompts)
    check_equal(eng, ref_eng, got, ref, tokens, ref_tokens)


@pytest.mark.parametrize("mode", ["resident-drop", "sparse-ondemand"])
def test_bit_equal_at_two_threads(dirs, mode):
    torch.set_num_threads(2)
    prompts = random_prompts(300, 41, seed=7)
    kw = dict(SMALL_LOOKAHEAD, top_k=8, kv_dtype="float16", max_batch_size=2, **MODES[mode])
    kw.pop("mode")
    ref_eng = engine(dirs["int8"], False, **kw)
    ref_tokens, ref = run(ref_eng, prompts)
    eng = engine(dirs["int8"], True, **kw)
    tokens, got = run(eng, prompts)
    check_equal(eng, ref_eng, got, ref, tokens, ref_tokens)


class ScoreTap(Observer):
    """Keeps the real rows' top-K of every decode layer (an observer of scores)."""

    def __init__(self):
        self.idx = []

    def on_scores(self, layer, rows, lanes, idx, scores):
        if rows[0] == "real":
            self.idx.append(idx.clone())


@pytest.mark.parametrize("mode,kv_dtype", [("sparse-ondemand", "float32"), ("sparse-ondemand", "float16"),
                                           ("resident-drop", "float16")])
def test_fused_layer_yields_to_observers_and_debug_checks(dirs, mode, kv_dtype):
    """An observer of scores, or debug checks, keep the backend's Python layer: the tokens and
    the state are those of the C layer, which did not run (its observers saw every layer)."""
    torch.set_num_threads(1)
    prompts = random_prompts(90, 37, seed=5)
    kw = dict(SMALL_LOOKAHEAD, top_k=4, kv_dtype=kv_dtype, max_batch_size=2, **MODES[mode])
    kw.pop("mode")
    eng = engine(dirs["int8"], True, **kw)
    tokens, _ = run(eng, prompts)
    assert eng.runner.attn.c_layer.calls > 0
    tapped = engine(dirs["int8"], True, **kw)
    tap = tapped.observe(ScoreTap())
    tapped_tokens, _ = run(tapped, prompts)
    assert tapped_tokens == tokens and tap.idx
    assert tapped.runner.attn.c_layer.calls == 0
    for name, t in state(tapped).items():
        assert torch.equal(t, state(eng)[name]), name
    checked = Engine.from_dir(dirs["int8"], mode="lookahead", internals=Internals(debug_checks=True), **kw)   # checked ops: no fused layers
    assert run(checked, prompts)[0] == tokens
    assert checked.runner.attn.c_layer is None and checked.runner.fused is None


def test_a_perturbed_fused_layer_is_caught(dirs, monkeypatch):
    """The comparison can fail: one layer's C attention output (sparse-ondemand) nudged by 2^-20
    gives other logits than the Python layer."""
    torch.set_num_threads(1)
    prompts = random_prompts(120, seed=9)
    kw = dict(SMALL_LOOKAHEAD, top_k=4, max_batch_size=1, **MODES["sparse-ondemand"])
    kw.pop("mode")
    ref_eng = engine(dirs["fp32"], False, **kw)
    _, ref = run(ref_eng, prompts)
    eng = engine(dirs["fp32"], True, **kw)
    od = eng.runner.attn.c_layer
    real = od.run

    def nudged(layer, buf, q, k, v, out, *rest):
        r = real(layer, buf, q, k, v, out, *rest)
        if layer == 1:
            out.mul_(1 + 2 ** -20)
        return r
    monkeypatch.setattr(od, "run", nudged)
    _, got = run(eng, prompts)
    assert od.calls > 0
    assert any(not torch.equal(a[s], b[s]) for a, b in zip(got.logits, ref.logits) for s in a)


def test_a_perturbed_attention_is_caught(dirs, monkeypatch):
    """The comparison is sensitive: one ulp-scale change to one layer's attention output of the
    fused path changes the logits."""
    torch.set_num_threads(1)
    prompts = random_prompts(40, seed=11)
    kw = dict(SMALL_LOOKAHEAD, top_k=4, max_batch_size=2)
    kw.pop("mode")
    ref_eng = engine(dirs["fp32"], False, **kw)
    _, ref = run(ref_eng, prompts)
    eng = engine(dirs["fp32"], True, **kw)
    fused = eng.runner.fused

    def nudged(attend):
        def forward(layer, q, k, v):
            o = attend(layer, q, k, v)
            return o * (1 + 2 ** -20) if layer == 1 else o
        return forward
    real = fused.run_layers
    monkeypatch.setattr(fused, "run_layers", lambda t, p, attend: real(t, p, nudged(attend)))
    _, got = run(eng, prompts)
    assert fused.steps > 0
    assert any(not torch.equal(a[s], b[s]) for a, b in zip(got.logits, ref.logits) for s in a)


def test_a_bad_attention_output_is_a_clear_error(dirs):
    torch.set_num_threads(1)
    kw = dict(SMALL_LOOKAHEAD, top_k=4)
    kw.pop("mode")
    eng = engine(dirs["fp32"], True, **kw)
    t = torch.tensor([1, 2], dtype=torch.long)
    with torch.inference_mode(), pytest.raises(ValueError, match="attend: expected o"):
        eng.runner.fused.run_layers(t, t, lambda layer, q, k, v: q[:, :1])


STEP_MODULES = 21       # the project modules a lookahead decode step enters (docs/ARCHITECTURE.md lists them)


def test_a_decode_step_enters_few_modules(dirs):
    """tests/step_modules.py over a fused lookahead decode step (the C layer, resident-urgent):
    at most STEP_MODULES project files run a Python function, and plugins is entered only through
    the kernel table's C entries. The checks can fail: the Python layers (fused=False) enter the
    model's layers and the slot plan's wrapper."""
    from step_modules import step_modules, warm_decode
    torch.set_num_threads(1)
    kw = dict(SMALL_LOOKAHEAD, top_k=4, max_batch_size=2, **MODES["resident-urgent"])
    kw.pop("mode")
    entered = {}
    for fused in (True, False):
        eng = engine(dirs["fp32"], fused, **kw)
        with torch.inference_mode():
            warm_decode(eng)
            entered[fused] = step_modules(eng)
        eng.close()
    fused_plugins = {"plugins/cpu/fused.py", "plugins/cpu/ops.py"}
    mods = entered[True]
    assert len(mods) <= STEP_MODULES, mods
    assert "runtime/transfer/thread.py" in mods                  # the prediction's copies were queued
    assert {m for m in mods if m.startswith("plugins/")} <= fused_plugins, mods
    python = entered[False]
    assert "runtime/rope.py" in python and not {m for m in python if m.startswith("plugins/")} <= fused_plugins
