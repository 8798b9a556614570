"""The engine spec (runtime/spec.py): what an engine runs is resolved once, from engine.yaml, the
caller's overrides and the host, before anything is allocated; precision is a property of the build
(engine.yaml's `precision:` section), and a precision the build did not verify, or a setting the mode
does not read, is refused by name."""
from __future__ import annotations

import logging
from dataclasses import FrozenInstanceError

import pytest
import torch

from builder import BuildConfig, BuildError
from runtime.cli import build_parser, lookahead_overrides
from runtime.config import BuildPrecision, LookaheadConfig
from runtime.engine import Engine
from runtime.engine_dir import load_manifest, write_manifest
from runtime.errors import ConfigError
from runtime.spec import GOVERNS, resolve_spec
from runtime.internals import Internals
from test_fused_decode import make_int8_engine
from tiny_engine import SMALL_LOOKAHEAD, make_tiny_engine, random_prompts

CPU = torch.device("cpu")
GREEDY_8 = dict(max_tokens=8, ignore_eos=True)


def with_record(path, precision: BuildPrecision | None, source_kind: str = "random"):
    """The engine dir at `path` with engine.yaml rewritten to carry `precision` (as a build writes it)."""
    m = load_manifest(path)
    write_manifest(path, name=m.name, model=m.model, dtype=m.dtype, lookahead=m.lookahead,
                   source={**m.source, "kind": source_kind}, versions=m.versions, quantization=m.quantization,
                   precision=precision)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    shape = dict(num_heads=6, num_kv_heads=2, head_dim=32)     # the prefill kernels' shapes
    return {
        "bf16": with_record(make_tiny_engine(root / "bf16", seed=3, **shape),
                            BuildPrecision("bfloat16", verified_prefill=("float32", "bfloat16"), host="AVX512_BF16")),
        "fp32": with_record(make_tiny_engine(root / "fp32", seed=3, **shape), BuildPrecision("float32")),
        "noverify": with_record(make_tiny_engine(root / "nov", seed=3, **shape),
                                BuildPrecision("float32", verified_prefill=None, verified_decode=None)),
        "legacy": with_record(make_tiny_engine(root / "legacy", seed=3, **shape), None, source_kind="gguf"),
        "int8": with_record(make_int8_engine(root / "int8", seed=4), BuildPrecision("float32")),
    }


# ---- precision is the build's ---------------------------------------------------------------------
def test_auto_runs_the_builds_precision_on_every_host(dirs):
    eng = Engine.from_dir(dirs["bf16"], block_size=4)
    assert eng.spec.prefill == eng.ops.prefill == eng.config.prefill_precision == "bfloat16"
    assert eng.spec.why["prefill"].startswith("auto: the build's")
    assert Engine.from_dir(dirs["fp32"], block_size=4).ops.prefill == "float32"
    # the torch table is the float32 reference, whatever the build chose (it has no prefill kernels)
    assert Engine.from_dir(dirs["bf16"], block_size=4, internals=Internals(impl="torch")).ops.prefill == "float32"


def test_a_precision_the_build_did_not_verify_is_refused_by_name(dirs):
    with pytest.raises(ConfigError, match=r"^prefill_precision: bfloat16 was not verified when this engine was "
                                          r"built \(verified: prefill float32; decode float32\) \(rebuild with "
                                          r"--prefill-precision bfloat16 .*allow_unverified_precision=True"):
        Engine.from_dir(dirs["fp32"], prefill_precision="bfloat16")
    with pytest.raises(ConfigError, match=r"^decode_precision: int8 was not verified"):
        Engine.from_dir(dirs["int8"], decode_precision="int8")
    eng = Engine.from_dir(dirs["fp32"], prefill_precision="bfloat16", allow_unverified_precision=True, block_size=4)
    assert eng.ops.prefill == "bfloat16"
    assert eng.describe()["precision"]["unverified"] == ["prefill_precision bfloat16"]
    # a sibling of an engine that was allowed keeps the permission; float32 is always verified
    assert eng.sibling(mode="sparse").ops.prefill == "bfloat16"
    assert Engine.from_dir(dirs["bf16"], prefill_precision="float32").ops.prefill == "float32"


def test_a_build_that_skipped_verification_holds_nothing_back(dirs):
    eng = Engine.from_dir(dirs["noverify"], prefill_precision="bfloat16", block_size=4)
    assert eng.ops.prefill == "bfloat16" and eng.describe()["precision"]["unverified"] == []
    assert eng.describe()["precision"]["verified_by_build"] == "nothing: built with --no-verify"


def test_a_dir_without_the_record_resolves_on_this_host_and_says_so(dirs, caplog):
    with caplog.at_level(logging.WARNING, logger="runtime.spec"):
        eng = Engine.from_dir(dirs["legacy"], block_size=4)
    assert any("records no build precision" in r.getMessage() for r in caplog.records)
    assert "rebuild to pin it" in eng.describe()["precision"]["prefill_from"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runtime.spec"):
        Engine.from_dir(dirs["fp32"], block_size=4)
    assert not caplog.records


def test_the_record_is_checked_when_engine_yaml_is_read(dirs, tmp_path):
    from runtime.errors import EngineDirError
    with pytest.raises(ConfigError, match=r"precision.prefill: 'auto' is not a resolved prefill precision"):
        BuildPrecision("auto")
    with pytest.raises(ConfigError, match=r"precision.verified_prefill: must be a list"):
        BuildPrecision("float32", verified_prefill=("float64",))
    m = load_manifest(dirs["bf16"])
    assert m.precision == BuildPrecision("bfloat16", verified_prefill=("float32", "bfloat16"), host="AVX512_BF16")
    text = (dirs["bf16"] / "engine.yaml").read_text().replace("prefill: bfloat16", "prefill: bf16")
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in dirs["bf16"].iterdir():
        (bad / p.name).symlink_to(p) if p.name != "engine.yaml" else (bad / p.name).write_text(text)
    with pytest.raises(EngineDirError, match="precision.prefill: 'bf16'"):
        load_manifest(bad, verify_checksums=False)


# ---- settings: one rule, refused where the mode does not read them ---------------------------------
@pytest.mark.parametrize("mode,field,value", [("dense", "top_k", 8), ("dense", "residency", "pingpong"),
                                              ("sparse", "miss_policy", "drop"), ("sparse", "prefill_top_k", 4)])
def test_a_setting_the_mode_does_not_read_is_refused(dirs, mode, field, value):
    with pytest.raises(ConfigError, match=rf"^{field}: is a .* setting: mode {mode} does not read it"):
        Engine.from_dir(dirs["fp32"], mode=mode, **{field: value})
    base = Engine.from_dir(dirs["fp32"], **SMALL_LOOKAHEAD)
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        base.sibling(mode=mode, **{field: value})
    assert base.sibling(mode=mode).config.mode == mode      # the parent's own settings are not the caller's


def test_every_setting_is_governed_by_a_known_rule():
    names = {f for f in LookaheadConfig.__dataclass_fields__}
    assert set(GOVERNS) < names
    assert names - set(GOVERNS) == {"mode", "block_size", "max_batch_size", "max_model_len", "kv_dtype",
                                    "prefix_caching", "prefill_precision", "decode_precision", "prefill_chunk"}


def test_the_spec_is_resolved_before_anything_is_allocated_and_frozen(dirs):
    spec = resolve_spec(load_manifest(dirs["bf16"]), CPU, {"mode": "lookahead", "top_k": 1 << 20})
    assert spec.config.top_k == spec.max_model_len // spec.config.block_size      # clamped to the context
    assert spec.config.kv_dtype == "float32" and spec.prefill == "bfloat16"
    assert spec.memory_plan.weights > 0 and spec.memory_plan.inputs.prefill == "bfloat16"
    with pytest.raises(FrozenInstanceError):
        spec.impl = "torch"
    eng = Engine(spec, Engine.from_dir(dirs["bf16"]).model, Engine.from_dir(dirs["bf16"]).tokenizer)
    assert eng.config == spec.config and eng.ops.prefill == "bfloat16"
    out = eng.generate(random_prompts(9, seed=1), None)[0]
    assert out.num_prompt_tokens == 9


# ---- the launchers take the same rule ---------------------------------------------------------------
def test_the_cli_flag_reaches_the_spec(dirs):
    args = build_parser().parse_args(["generate", "--engine", str(dirs["fp32"]), "--prompt", "x",
                                      "--prefill-precision", "bfloat16", "--allow-unverified-precision"])
    over = lookahead_overrides(args)
    assert over == {"prefill_precision": "bfloat16", "allow_unverified_precision": True}
    assert resolve_spec(load_manifest(dirs["fp32"]), CPU, over).unverified == ("prefill_precision bfloat16",)
    assert Engine.from_dir(dirs["fp32"], block_size=4, **over).ops.prefill == "bfloat16"


def test_the_launchers_refuse_what_the_workers_would(dirs, tmp_path):
    from deploy.dynamo_launch import LaunchError, check_engine
    from serving.config_template import write_model_repo
    with pytest.raises(LaunchError, match="top_k: is a sparse and lookahead setting"):
        check_engine(dirs["fp32"], {"mode": "dense", "top_k": 8})
    with pytest.raises(LaunchError, match="prefill_precision: bfloat16 was not verified"):
        check_engine(dirs["fp32"], {"prefill_precision": "bfloat16"})
    with pytest.raises(ConfigError, match="decode_precision: int8 was not verified"):
        write_model_repo(tmp_path / "repo", dirs["int8"], lookahead_overrides={"decode_precision": "int8"})


# ---- the builder resolves, verifies and records ---------------------------------------------------------
@pytest.mark.parametrize("kw,field", [(dict(prefill_precision="int8"), "prefill_precision"),
                                      (dict(prefill_precision="bfloat16", dtype="bfloat16"), "prefill_precision"),
                                      (dict(decode_precision="int8", quantize="int8"), "decode_precision"),
                                      (dict(decode_precision="int8", quantize="int8", group_size=0,
                                            prefill_precision="int8"), "decode_precision"),
                                      (dict(prefill_precision="fp8"), "prefill_precision")])
def test_the_builder_refuses_a_precision_it_cannot_verify(tmp_path, kw, field):
    with pytest.raises(BuildError) as e:
        BuildConfig(model="default", output=tmp_path / "e", **kw)
    assert e.value.field == field


def test_a_build_records_what_it_resolved_and_verified(tmp_path):
    from builder import build
    from builder_fixtures import write_checkpoint
    from runtime.ops import resolve_prefill
    src = write_checkpoint(tmp_path / "ckpt", "llama", seed=2, intermediate_size=128)
    log = []
    build(BuildConfig(model=str(src), output=tmp_path / "auto"), log=log.append)
    rec = load_manifest(tmp_path / "auto").precision
    here = resolve_prefill("auto", CPU, torch.float32, False)
    assert rec.prefill == here and rec.verified_prefill == tuple(dict.fromkeys(("float32", here)))
    assert rec.verified_decode == ("float32",) and "AVX512_BF16" in rec.host
    # asked for bf16 on any host: verified (the kernels, or their torch formulation), and run by auto
    build(BuildConfig(model=str(src), output=tmp_path / "bf16", prefill_precision="bfloat16"), log=log.append)
    rec = load_manifest(tmp_path / "bf16").precision
    assert rec.prefill == "bfloat16" and rec.verified_prefill == ("float32", "bfloat16")
    assert Engine.from_dir(tmp_path / "bf16").ops.prefill == "bfloat16"
    build(BuildConfig(model=str(src), output=tmp_path / "nov", verify=False), log=log.append)
    assert load_manifest(tmp_path / "nov").precision.verified_prefill is None


# ---- implementation knobs are not settings -----------------------------------------------------------
@pytest.mark.parametrize("knob,value", [("impl", "torch"), ("fused", False), ("debug_checks", True),
                                        ("transfer", "sync"), ("ops", None)])
def test_an_implementation_knob_given_as_a_setting_says_where_it_went(dirs, knob, value):
    with pytest.raises(TypeError, match=rf"{knob} is not a setting: pass internals=runtime\.internals\.Internals\({knob}="):
        Engine.from_dir(dirs["fp32"], block_size=4, **{knob: value})
    eng = Engine.from_dir(dirs["fp32"], block_size=4)
    with pytest.raises(TypeError, match="Engine.sibling: fused is not a setting"):
        eng.sibling(fused=False)
    with pytest.raises(ValueError, match="impl: one of"):
        Internals(impl="fast")


def test_a_sibling_keeps_the_engines_internals_unless_given_its_own(dirs):
    eng = Engine.from_dir(dirs["fp32"], block_size=4, internals=Internals(impl="torch", fused=False))
    sib = eng.sibling(mode="lookahead", top_k=4)
    assert sib.spec.impl == "torch" and sib.fused is False and sib.ops.name == eng.ops.name
    own = eng.sibling(internals=Internals(impl="torch", fused=True))
    assert own.fused is True


def test_a_user_must_know_few_settings_in_any_mode():
    """The settings a mode's user chooses (the rest are tuning with working defaults), at most 10,
    each one the mode reads; the CLI shows them as their own help group."""
    from runtime.spec import essential_settings
    sizes = {mode: essential_settings(mode) for mode in ("dense", "sparse", "lookahead")}
    assert {m: len(v) for m, v in sizes.items()} == {"dense": 4, "sparse": 5, "lookahead": 8}
    assert all(len(v) <= 10 for v in sizes.values())
    assert "top_k" not in sizes["dense"] and "residency" not in sizes["sparse"]
    parser = build_parser()
    gen = parser._subparsers._group_actions[0].choices["generate"]
    groups = {g.title.split(" (")[0]: [a.dest for a in g._group_actions] for g in gen._action_groups}
    assert groups["settings"] == list(sizes["lookahead"])
    assert "fetch_ratio" in groups["tuning"] and "prefill_precision" in groups["tuning"]
