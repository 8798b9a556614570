"""Weight-only int8 engines: the quantizer's bounds, the int8 layout and manifest, the runtime path,
and the build-time verification against the fp32 source (which must fail on a corrupted weight).

Fast: tiny random checkpoints (builder_fixtures). The default model's int8 build is measured by
`make engine-int8` (numbers in builder/verify_int8.py).
"""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from builder import BuildConfig, BuildError, build
from builder import quantize as quantize_mod
from builder import verify_int8 as verify_int8_mod
from builder.cli import main
from builder.errors import VerifyError
from builder.quantize import QMAX, dequantize_int8, quantize_int8, quantize_weights
from plugins.reference import linear_int8_ref
from plugins import cpu
from runtime.attention_ref import CausalAttention
from runtime.config import ModelConfig
from runtime.engine import Engine
from runtime.engine_dir import (FORMAT_VERSION, FORMAT_VERSION_EXTENDED, REPORT, WEIGHTS, expected_tensors,
                                load_manifest, sha256_file)
from runtime.errors import EngineDirError
from runtime.model import Int8Embedding, Int8Linear, Int8Weight, LlamaModel
from runtime.ops import select_ops
from runtime.sampling import SamplingParams

from builder_fixtures import write_checkpoint
from tiny_engine import make_tiny_engine


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def quiet_build(**kw):
    return build(BuildConfig(**kw), log=lambda line: None)


# intermediate 128 (builder_fixtures: 96): the default group of 64 inputs divides every weight's inputs
WIDE = dict(intermediate_size=128)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"tied": write_checkpoint(root / "tied", "llama", seed=11, tie_word_embeddings=True, **WIDE),
            "untied": write_checkpoint(root / "untied", "llama", seed=12, **WIDE),
            "qwen2": write_checkpoint(root / "qwen2", "qwen2", seed=13, tie_word_embeddings=True, **WIDE)}


@pytest.fixture(scope="module")
def int8_engines(ckpts, tmp_path_factory):
    """One verified int8 build per checkpoint (the default: a scale per 64 inputs), and its report;
    and "per_channel": the tied one built with --group-size 0 (a scale per output channel)."""
    root = tmp_path_factory.mktemp("int8")
    out = {name: (root / name, quiet_build(model=str(src), output=root / name, quantize="int8").report)
           for name, src in ckpts.items()}
    out["per_channel"] = (root / "pc", quiet_build(model=str(ckpts["tied"]), output=root / "pc", quantize="int8",
                                                   group_size=0).report)
    return out


# --- the quantizer ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,seed", [((64, 96), 0), ((576, 1536), 1), ((8, 3), 2), ((1, 4096), 3)])
def test_round_trip_error_is_at_most_half_a_step(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 3     # rows of varied scale
    w[0, 0] = 40.0                                                                     # an outlier row
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.dtype == torch.float32 and scale.shape == (shape[0],)
    assert int(q.abs().max()) <= QMAX and int(q.min()) >= -QMAX
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / QMAX)
    assert torch.equal(q.abs().amax(dim=1), torch.full((shape[0],), QMAX, dtype=torch.int8))  # the range is used
    err = (dequantize_int8(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-5) + 1e-7).all())
    # relative to each row's largest weight: at most 1/254
    assert float((err.amax(dim=1) / w.abs().amax(dim=1)).max()) <= 1 / (2 * QMAX) + 1e-6


def test_zero_rows_and_bfloat16_input():
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(5))
    w[3] = 0
    q, scale = quantize_int8(w.to(torch.bfloat16))
    assert scale[3] == 0 and not q[3].any() and torch.isfinite(scale).all()
    assert torch.equal(dequantize_int8(q, scale)[3], torch.zeros(32))
    err = (dequantize_int8(q, scale) - w.to(torch.bfloat16).float()).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-5) + 1e-7).all())


@pytest.mark.parametrize("shape,G,seed", [((64, 96), 32, 0), ((576, 1536), 64, 1), ((8, 64), 8, 2), ((3, 4096), 64, 3)])
def test_grouped_round_trip_error_is_at_most_half_a_step_per_group(shape, G, seed):
    g = torch.Generator().manual_seed(seed)
    N, K = shape
    w = torch.randn(shape, generator=g) * (torch.rand(N, K // G, generator=g) * 3).repeat_interleave(G, 1)
    w[0, 0] = 40.0                                                             # an outlier in one group
    q, scale = quantize_int8(w, G)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.dtype == torch.float32 and scale.shape == (N, K // G)
    assert int(q.abs().max()) <= QMAX and int(q.min()) >= -QMAX
    groups = w.reshape(N, K // G, G)
    torch.testing.assert_close(scale, groups.abs().amax(dim=2) / QMAX)
    assert torch.equal(q.reshape(N, K // G, G).abs().amax(dim=2), torch.full((N, K // G), QMAX, dtype=torch.int8))
    err = (dequantize_int8(q, scale) - w).abs().reshape(N, K // G, G)
    assert bool((err <= scale[:, :, None] / 2 * (1 + 1e-5) + 1e-7).all())
    assert float(scale[0, 0]) == pytest.approx(40.0 / QMAX) and bool((scale[0, 1:] < 0.1).all())  # only its group
    # a group of all K inputs is the per-channel scheme: the same qweight, scale [N, 1] for [N]
    q0, s0 = quantize_int8(w)
    qk, sk = quantize_int8(w, K)
    assert torch.equal(qk, q0) and sk.shape == (N, 1) and torch.equal(sk[:, 0], s0)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_int8(w, K - 1 if K > 2 else 3)


def test_groups_of_64_are_at_least_as_accurate_as_per_channel_with_outlier_columns():
    """A few input channels much larger than the rest (what outlier activation dims leave in LLM
    weights) set every row's per-channel scale; a group's scale only where the group holds one."""
    g = torch.Generator().manual_seed(4)
    N, K = 576, 1536
    w = torch.randn(N, K, generator=g) * 0.02
    w[:, torch.randperm(K, generator=g)[:6]] *= 40
    x = torch.randn(16, K, generator=g)
    rel = {}
    for G in (0, 64):
        q, s = quantize_int8(w, G)
        wq = dequantize_int8(q, s)
        rel[G] = (float((wq - w).norm() / w.norm()), float((x @ wq.T - x @ w.T).norm() / (x @ w.T).norm()))
    assert rel[64][0] <= rel[0][0] and rel[64][1] <= rel[0][1]
    assert rel[64][0] < 0.5 * rel[0][0]                          # here by far: most groups hold no outlier
    _, s0 = quantize_int8(w)
    _, s64 = quantize_int8(w, 64)
    assert bool((s64 <= s0[:, None]).all())                      # no group's step exceeds its row's


def test_quantized_layout_and_roles():
    untied = ModelConfig(architecture="qwen2", vocab_size=100, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, attention_bias=True)
    weights = dict(LlamaModel.random(untied, seed=3).state_dict())
    out, section = quantize_weights(weights, untied, group_size=16)
    assert section["quantized"] == ["embed_tokens", "wqkv", "wo", "w13", "w2", "lm_head"]
    assert (section["granularity"], section["group_size"]) == ("per_group", 16)
    assert {k: (tuple(v.shape), str(v.dtype).split(".")[1]) for k, v in out.items()} == expected_tensors(
        untied, "float32", section)
    assert out["layers.0.w2.scale"].shape == (32, 3) and out["embed_tokens.scale"].shape == (100, 2)
    per_channel, pc = quantize_weights(weights, untied, group_size=0)
    assert (pc["granularity"], pc["group_size"]) == ("per_output_channel", 0)
    assert per_channel["layers.0.w2.scale"].shape == (32,) and per_channel["embed_tokens.scale"].shape == (100,)
    assert {k: tuple(v.shape) for k, v in per_channel.items()} == {
        k: v[0] for k, v in expected_tensors(untied, "float32", {k: v for k, v in pc.items() if k != "group_size"}
                                             ).items()}                       # as engines built before groups
    with pytest.raises(BuildError, match="group_size 64: does not divide the 32 inputs of embed_tokens.weight"):
        quantize_weights(weights, untied)                                     # the default, 64
    assert out["layers.0.wqkv.bias"].dtype == torch.float32 and out["norm.weight"].dtype == torch.float32
    assert torch.equal(out["layers.1.attn_norm.weight"], weights["layers.1.attn_norm.weight"])
    assert "layers.0.wo.weight" not in out and out["layers.0.wo.qweight"].dtype == torch.int8
    tied = ModelConfig(**{**untied.to_dict(), "tie_word_embeddings": True, "architecture": "llama",
                          "attention_bias": False})
    _, section = quantize_weights(dict(LlamaModel.random(tied, seed=3).state_dict()), tied, group_size=8)
    assert "lm_head" not in section["quantized"] and "tied_lm_head" in section
    with pytest.raises(BuildError, match="quantize int4"):
        quantize_weights(weights, untied, "int4")


# --- the runtime path ---------------------------------------------------------------------------

def test_quantized_linear_matches_reference_and_fp32_ops_are_unchanged():
    g = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(3, 96, generator=g), torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    q, s = quantize_int8(w)
    ops = select_ops(torch.device("cpu"), torch.float32, quantized=True)
    torch.testing.assert_close(ops.linear(x, Int8Weight(q, s), b), linear_int8_ref(x, q, s, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))   # fp32 weights too
    assert select_ops(torch.device("cpu"), torch.float32).linear is cpu.linear              # fp32 engines: as before
    assert select_ops(torch.device("cpu"), torch.float32, "checked").linear is cpu.linear


@pytest.mark.parametrize("group_size", [0, 32])
def test_int8_model_equals_fp32_model_on_dequantized_weights(group_size):
    """The int8 modules (lookup, projections, the tied logits) compute exactly what an fp32 model
    holding the dequantized weights computes, per output channel or per group."""
    cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)
    qstate, section = quantize_weights(dict(LlamaModel.random(cfg, seed=9).state_dict()), cfg, group_size=group_size)
    int8 = LlamaModel(cfg, empty=True, quantized=section["quantized"])
    int8.load_weights(qstate)
    deq = {}
    for k, v in qstate.items():
        if k.endswith(".qweight"):
            deq[k[: -len("qweight")] + "weight"] = dequantize_int8(v, qstate[k[: -len("qweight")] + "scale"])
        elif not k.endswith(".scale"):
            deq[k] = v
    fp32 = LlamaModel(cfg, empty=True)
    fp32.load_weights(deq)
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        a = int8.logits(int8(ids, torch.arange(20), CausalAttention()))
        b = fp32.logits(fp32(ids, torch.arange(20), CausalAttention()))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert next(int8.parameters()).dtype == torch.float32       # what Engine reads as the model's dtype
    assert int8.layers[0].w2.weight.group_size == (group_size or 96)
    with torch.inference_mode():                                 # the lookup: the dequantized rows, bit for bit
        assert torch.equal(int8.embed_tokens(ids), fp32.embed_tokens(ids))


def test_int8_modules_take_the_scale_layout_they_load():
    """The scale's shape in the state dict sets the layout ([N]: per output channel, [N, K // G]:
    per group); one that fits neither is refused naming the tensor."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 96, generator=g)
    with torch.device("meta"):
        lin, emb = Int8Linear(96, 40, bias=False), Int8Embedding(40, 96)
    for G in (0, 32, 96):
        q, s = quantize_int8(w, G)
        for m in (lin, emb):
            m.load_state_dict({"qweight": q, "scale": s}, assign=True)
            assert m.scale.shape == s.shape and m.weight.group_size == (G or 96)
            assert torch.equal(m.weight.dequantize(), dequantize_int8(q, s))
        rows = torch.tensor([[3, 0], [39, 3]])
        assert torch.equal(emb(rows), dequantize_int8(q, s)[rows])                      # [2, 2, 96]
    parent = torch.nn.Module()
    parent.wo = Int8Linear(96, 40, bias=False)
    for bad in ((40, 5), (40, 97), (39,), (40, 2, 48)):
        with pytest.raises(EngineDirError, match=re.escape(f"wo.scale has shape {list(bad)}, but wo.qweight [40, 96]")):
            parent.load_state_dict({"wo.qweight": q, "wo.scale": torch.ones(bad)}, assign=True)


# --- int8 engine dirs -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tied", "untied", "qwen2", "per_channel"])
def test_int8_engine_builds_verifies_loads_and_decodes(int8_engines, name):
    out, report = int8_engines[name]
    m = load_manifest(out)
    doc = yaml.safe_load((out / "engine.yaml").read_text())
    assert doc["format_version"] == FORMAT_VERSION_EXTENDED and m.dtype == "float32"
    q = m.quantization
    G = 0 if name == "per_channel" else 64                     # the default: a scale per 64 inputs
    assert (q["scheme"], q["granularity"], q["group_size"], q["symmetric"], q["scale_dtype"]) == (
        "int8", "per_group" if G else "per_output_channel", G, True, "float32")
    assert doc["quantization"]["group_size"] == G and report["quantization"]["group_size"] == G
    assert ("lm_head" in q["quantized"]) == (name == "untied")
    v = report["verification"]
    assert v["passed"] and q["verification"]["passed"] and q["verification"]["tolerance"] == v["tolerance"]
    assert v["max_rel_logit_diff"] < v["tolerance"]["rel_logit"]
    assert v["greedy_agreement"] >= v["tolerance"]["min_greedy_agreement"]
    assert len(v["prompts"]) == 3 and all(p["greedy_steps"] == 32 for p in v["prompts"])
    assert v["perplexity"]["num_tokens"] > 100 and v["perplexity"]["increase"] < v["tolerance"]["max_ppl_increase"]
    assert json.loads((out / REPORT).read_text())["quantization"]["quantized"] == q["quantized"]
    weights = load_file(str(out / WEIGHTS))
    assert weights["layers.0.w13.qweight"].dtype == torch.int8 and weights["embed_tokens.scale"].dtype == torch.float32
    assert weights["layers.0.w2.scale"].shape == ((64, 2) if G else (64,))      # w2: 128 inputs
    assert weights["embed_tokens.scale"].shape == ((128, 1) if G else (128,))
    eng = Engine.from_dir(out)
    assert eng.model.layers[0].w2.weight.group_size == (G or 128)
    assert eng.model.quantized == frozenset(q["quantized"])
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    got = eng.generate([[1, 5, 9, 3, 7, 2, 4]], params)[0].token_ids
    assert len(got) == 10
    # the engine decodes like the int8 model with full recompute (the cache and C kernels change nothing)
    ids = [1, 5, 9, 3, 7, 2, 4]
    with torch.inference_mode():
        for _ in range(10):
            h = eng.model(torch.tensor(ids), torch.arange(len(ids)), CausalAttention())
            ids.append(int(eng.model.logits(h[-1:])[0].argmax()))
    assert got == ids[7:]


def test_int8_weights_are_about_a_quarter(int8_engines, ckpts, tmp_path):
    out, _ = int8_engines["untied"]
    fp32 = quiet_build(model=str(ckpts["untied"]), output=tmp_path / "fp32", verify=False)
    b = load_manifest(out).quantization["quantized_bytes"]
    assert b["int8"] < 0.27 * b["float32"]
    assert (out / WEIGHTS).stat().st_size < 0.35 * (fp32.path / WEIGHTS).stat().st_size


def _corrupting(monkeypatch, corrupt):
    real = quantize_mod.quantize_weights

    def quantize(weights, cfg, scheme="int8", group_size=64):
        out, section = real(weights, cfg, scheme, group_size)
        corrupt(out)
        return out, section

    monkeypatch.setattr("builder.pipeline.quantize_weights", quantize)


@pytest.mark.parametrize("corrupt", [
    lambda w: w["layers.0.w2.scale"].mul_(2),                                      # a wrong scale
    lambda w: w["layers.1.wqkv.qweight"].copy_(w["layers.1.wqkv.qweight"].flip(0)),  # rows out of order
    lambda w: w["embed_tokens.scale"][:64].zero_(),                                 # lost rows of the embedding
], ids=["scale", "row-order", "embedding"])
def test_verification_fails_on_a_corrupted_weight(ckpts, tmp_path, monkeypatch, corrupt):
    _corrupting(monkeypatch, corrupt)
    out = tmp_path / "new" / "engine"
    with pytest.raises(VerifyError, match="int8 verification failed"):
        quiet_build(model=str(ckpts["tied"]), output=out, quantize="int8")
    assert not (tmp_path / "new").exists()          # nothing written


def test_each_tolerance_is_enforced(ckpts, tmp_path, monkeypatch):
    """Tighten one bound at a time past what a correct build measures: each check must fire."""
    base = verify_int8_mod.INT8_TOLERANCE
    cases = [(dict(rel_logit=1e-4), "max |Δlogit|"), (dict(min_greedy_agreement=1.01), "greedy agreement"),
             (dict(max_ppl_increase=-0.5), "perplexity")]
    for i, (change, message) in enumerate(cases):
        monkeypatch.setattr(verify_int8_mod, "INT8_TOLERANCE",
                            verify_int8_mod.Int8Tolerance(**{**base.__dict__, **change}))
        with pytest.raises(VerifyError, match=message.replace("|", r"\|")):
            quiet_build(model=str(ckpts["untied"]), output=tmp_path / f"e{i}", quantize="int8")


def test_cli_quantize_options(ckpts, tmp_path, capsys):
    src, out = str(ckpts["tied"]), str(tmp_path / "e")
    assert main(["--model", src, "--output", out, "--quantize", "int8", "--dtype", "bfloat16"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --quantize int8: cannot be combined with --dtype bfloat16 (int8 weights run with float32 "
        "activations: drop --dtype or pass --dtype float32)"]
    assert main(["--model", src, "--output", out, "--quantize", "int4"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --quantize int4: is not a supported quantization (use one of: int8)"]
    assert not (tmp_path / "e").exists()
    assert main(["--model", src, "--output", out, "--quantize", "int8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [l.split("]")[0] for l in lines if l.startswith("[")] == [f"[{i}/6" for i in range(1, 7)]
    assert sum("verify int8: prompt" in l for l in lines) == 3 and any("perplexity" in l for l in lines)
    assert any("-> int8, a scale per 64 inputs" in l for l in lines)


def test_a_bad_group_size_is_refused_naming_the_flag(ckpts, tmp_path, capsys):
    src, out = str(ckpts["tied"]), str(tmp_path / "e")
    for g, problem in (("48", "does not divide the 64 inputs of embed_tokens.weight"),     # hidden 64
                       ("-8", "must be 0 (one scale per output channel) or a positive multiple of 8"),
                       ("12", "a positive multiple of 8")):
        assert main(["--model", src, "--output", out, "--quantize", "int8", "--group-size", g]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --group-size {g}: ") and problem in err[0], err
    assert not (tmp_path / "e").exists()
    for bad in (12, -8, True, "64"):
        with pytest.raises(BuildError) as e:
            BuildConfig(model=src, output=out, quantize="int8", group_size=bad)
        assert e.value.field == "group_size"


# --- the manifest refuses what this runtime cannot run ----------------------------------------------

@pytest.fixture
def int8_dir(int8_engines, tmp_path):
    return shutil.copytree(int8_engines["tied"][0], tmp_path / "copy")


def _edit(d, change):
    doc = yaml.safe_load((d / "engine.yaml").read_text())
    change(doc)
    (d / "engine.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


@pytest.mark.parametrize("change,message", [
    (lambda d: d["quantization"].update(scheme="int4"), "quantization.scheme is 'int4'"),
    (lambda d: d["quantization"].update(granularity="per_tensor"), "quantization.granularity"),
    (lambda d: d["quantization"].pop("group_size"), "quantization.group_size is 0, but granularity per_group"),
    (lambda d: d["quantization"].update(group_size=True), "quantization.group_size is True"),
    (lambda d: d["quantization"].update(granularity="per_output_channel"),
     "quantization.group_size is 64, but granularity per_output_channel takes 0"),
    (lambda d: d["quantization"].update(group_size=48),
     "quantization.group_size 48 does not divide the 64 inputs of embed_tokens.qweight [128, 64]"),
    (lambda d: d["quantization"].update(group_size=32),               # disagrees with the stored scales
     "tensor embed_tokens.scale has shape [128, 1], engine.yaml's model needs [128, 2]"),
    (lambda d: d["quantization"].update(quantized=["wqkv", "attn_norm"]), "quantization.quantized must list"),
    (lambda d: d["quantization"].update(quantized=["lm_head"]), "quantization.quantized must list"),  # tied
    (lambda d: d.update(dtype="bfloat16"), "float32 activations"),
    (lambda d: d.update(format_version=FORMAT_VERSION), "needs format_version 2"),
])
def test_bad_quantization_section_is_refused(int8_dir, change, message):
    _edit(int8_dir, change)
    with pytest.raises(EngineDirError, match=re.escape(message)):
        load_manifest(int8_dir, verify_checksums=False)


def test_engines_built_before_groups_load_and_decode_as_before(int8_engines, tmp_path):
    """What every int8 engine built before groups says (granularity per_output_channel, no
    group_size, scale [N]) loads, and decodes as the --group-size 0 build does."""
    new = int8_engines["per_channel"][0]
    old = shutil.copytree(new, tmp_path / "old")
    _edit(old, lambda d: d["quantization"].pop("group_size"))
    m = load_manifest(old)
    assert "group_size" not in m.quantization and m.quantization["granularity"] == "per_output_channel"
    assert expected_tensors(m.model, "float32", m.quantization)["layers.1.w2.scale"] == ((64,), "float32")
    params, prompt = SamplingParams(max_tokens=10, ignore_eos=True), [[1, 5, 9, 3, 7, 2, 4]]
    got = Engine.from_dir(old).generate(prompt, params)[0].token_ids
    assert got == Engine.from_dir(new).generate(prompt, params)[0].token_ids and len(got) == 10


def test_int8_header_is_checked(int8_dir):
    t = load_file(str(int8_dir / WEIGHTS))
    t["layers.0.wo.qweight"] = t["layers.0.wo.qweight"].float()        # int8 expected
    save_file(t, str(int8_dir / WEIGHTS))
    _edit(int8_dir, lambda d: d["files"].update({WEIGHTS: sha256_file(int8_dir / WEIGHTS)}))
    with pytest.raises(EngineDirError, match="layers.0.wo.qweight is 'F32', engine.yaml says dtype int8"):
        Engine.from_dir(int8_dir)


def test_fp32_dirs_keep_format_version_1(tmp_path):
    d = make_tiny_engine(tmp_path / "fp32")
    doc = yaml.safe_load((d / "engine.yaml").read_text())
    assert doc["format_version"] == FORMAT_VERSION == 1 and "quantization" not in doc
    assert load_manifest(d).quantization is None


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_the_memory_plan_counts_int8_weights_as_stored(int8_engines, name):
    """The check made before the weights are read counts the bytes the loaded model holds (not
    4 bytes a parameter: that refused int8 engines a host could hold)."""
    from runtime.memory_plan import plan_memory

    out, _ = int8_engines[name]
    m = load_manifest(out)
    eng = Engine.from_dir(out)
    held = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in eng.model.state_dict().values()}.values())
    b = m.quantization["quantized_bytes"]
    plan = plan_memory(m.model, eng.config, None, 4, weight_saving=b["float32"] - b["int8"])
    fp32 = plan_memory(m.model, eng.config, None, 4)
    assert plan.weights == held < 0.5 * fp32.weights
