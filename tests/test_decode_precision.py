"""decode_precision int8: an int8 engine's decode rows quantized per row and group (W8A8, the
prompt kernel's numerics), on fresh random tiny int8 models.

- the fused C step (dense, and lookahead's layers around its attention) equals the Python path
  bit for bit, and both differ from weight-only decode by activation rounding only;
- each decode row's projections are `prefill.linear_w8a8` of that row: a row's result does not
  depend on the rows batched with it (one sequence alone, or with two others: the same tokens);
- every row's logits take W8A8 too (prompt and decode rows alike);
- the config is refused by name where it cannot apply (per-channel weights included: a row's
  activations would share one scale), and the memory plan counts the W8A8 copies
  the decode rows and the logits keep, once when an int8 prefill keeps them too.
"""
from __future__ import annotations

import pytest
import torch

from plugins.cpu import prefill
from runtime.engine import Engine
from runtime.errors import ConfigError
from runtime.memory_plan import plan_memory
from runtime.sampling import SamplingParams
from runtime.internals import Internals
from test_fused_decode import flat, make_int8_engine, run as fused_run
from tiny_engine import SMALL_LOOKAHEAD, make_tiny_engine, random_prompts

needs_vnni = pytest.mark.skipif(not prefill.int8_dot_products(), reason="this CPU has no AVX512_VNNI")
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_precision")
    return {"int8": make_int8_engine(root / "int8", seed=31, attention_bias=True),
            "int8g16": make_int8_engine(root / "int8g16", seed=32, group_size=16),
            "int8pc": make_int8_engine(root / "int8pc", seed=33, group_size=0),
            "fp32": make_tiny_engine(root / "fp32", seed=34, head_dim=32)}


def run(eng: Engine, prompts, params=GREEDY):
    """(tokens, every emitted row's logits in step order): test_fused_decode's run, flattened."""
    tokens, rec = fused_run(eng, prompts, params)
    return tokens, flat(rec)


@needs_vnni
@pytest.mark.parametrize("model", ["int8", "int8g16"])
@pytest.mark.parametrize("mode", ["dense", "lookahead"])
def test_fused_w8a8_decode_equals_the_python_path(dirs, model, mode):
    prompts = random_prompts(37, 12, 60, seed=4)
    kw = dict(decode_precision="int8", prefill_precision="float32", max_batch_size=4, block_size=4)
    kw.update(dict(SMALL_LOOKAHEAD, top_k=6) if mode == "lookahead" else {})
    ref_tokens, ref = run(Engine.from_dir(dirs[model], internals=Internals(fused=False), **kw), prompts)
    eng = Engine.from_dir(dirs[model], **kw)
    assert eng.runner.fused is not None and eng.runner.fused.w8a8, eng.runner.fused_reason
    tokens, got = run(eng, prompts)
    assert eng.runner.fused.steps > 0 and tokens == ref_tokens
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
    # against weight-only decode: the prompts' last rows (the same hidden states: the logits' own
    # W8A8 rounding), then each sequence's first decode row, where its first token is the same
    two = SamplingParams(max_tokens=2, ignore_eos=True)
    (w8, w8_logits), (wo, wo_logits) = (run(Engine.from_dir(dirs[model], **{**kw, "decode_precision": d}), prompts, two)
                                        for d in ("int8", "float32"))
    n = len(prompts)
    same_first = [a[0] == b[0] for a, b in zip(w8, wo)]
    rows = list(zip(w8_logits[:n], wo_logits[:n])) + [r for r, ok in zip(zip(w8_logits[n:], wo_logits[n:]), same_first)
                                                      if ok]
    assert len(rows) > n
    tol = 0.1
    for a, b in rows:
        assert not torch.equal(a, b) and float((a - b).abs().max()) < tol * float(b.std())


@needs_vnni
def test_a_row_decodes_alike_alone_and_batched(dirs):
    p = random_prompts(50, 20, 33, seed=9)
    kw = dict(decode_precision="int8", block_size=4, max_batch_size=4)
    alone = Engine.from_dir(dirs["int8"], **kw).generate([p[0]], GREEDY)[0].token_ids
    batched = Engine.from_dir(dirs["int8"], **kw).generate(p, GREEDY)[0].token_ids
    assert alone == batched


def test_refused_by_name_where_it_cannot_apply(dirs):
    """On any CPU: an fp32 engine, a precision that is none, and an engine with one weight scale
    per output channel (its activations would take one scale per row: the rejected rounding)."""
    with pytest.raises(ConfigError, match="decode_precision: int8 needs int8 weights"):
        Engine.from_dir(dirs["fp32"], decode_precision="int8")
    with pytest.raises(ConfigError, match=r"decode_precision: int8 on an engine with one weight scale per output "
                                          r"channel .*rebuild with --group-size 64"):
        Engine.from_dir(dirs["int8pc"], decode_precision="int8")
    with pytest.raises(ConfigError, match="decode_precision"):
        Engine.from_dir(dirs["int8"], decode_precision="bfloat16")


@needs_vnni
@pytest.mark.parametrize("prefill_precision", ["float32", "int8"])
def test_the_plan_counts_the_w8a8_copies_once(dirs, prefill_precision):
    eng = Engine.from_dir(dirs["int8"], decode_precision="int8", prefill_precision=prefill_precision, block_size=4)
    eng.generate(random_prompts(30, seed=8), GREEDY)
    mats = [mod.qweight for layer in eng.model.layers for mod in (layer.wqkv, layer.wo, layer.w13, layer.w2)]
    head = eng.model.embed_tokens if eng.model.lm_head is None else eng.model.lm_head
    mats.append(head.weight.qweight)                                 # the logits' weight
    kept = sum(x.numel() * x.element_size() for q in mats for x in q._lkv_w8a8[1])
    q = eng.manifest.quantization
    plan = plan_memory(eng.manifest.model, eng.config, None, 4, prefill=prefill_precision,
                       int8_group=q["group_size"], decode="int8")
    assert kept > 0 and plan.prefill_weights == kept


@pytest.mark.parametrize("has_units", [False, True])
def test_a_precision_this_cpu_runs_in_torch_is_warned_and_counted(dirs, monkeypatch, caplog, has_units):
    """A C table at int8 prefill and decode precision on a CPU without the units runs their torch
    formulations: a WARNING at load and `stats()["kernel_fallbacks"]` name each, never silence;
    with the units (or a torch table, chosen) there is nothing to say."""
    import logging

    import runtime.ops as ops_mod
    monkeypatch.setattr(ops_mod, "prefill_kernels_take", lambda precision: has_units)
    with caplog.at_level(logging.WARNING, logger="runtime.engine"):
        eng = Engine.from_dir(dirs["int8"], prefill_precision="int8", decode_precision="int8", block_size=4)
    said = eng.stats()["kernel_fallbacks"]
    if has_units:
        assert said == [] and not caplog.records
    else:
        assert [line.split(":")[0] for line in said] == ["prefill_precision int8", "decode_precision int8"]
        assert all("AVX512_VNNI" in line for line in said)
        assert [r.getMessage() for r in caplog.records] == said
    torch_table = Engine.from_dir(dirs["int8"], prefill_precision="int8", decode_precision="int8", block_size=4,
                                  internals=Internals(impl="torch"))
    assert torch_table.stats()["kernel_fallbacks"] == []
