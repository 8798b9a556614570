"""RoPE scaling (issue 40, and the security issue's rope_scaling items): the tables equal
transformers' for every supported type, every bad rope_scaling is refused naming
`rope_scaling.<field>` where a ModelConfig is made, at build (config.json) and at load
(engine.yaml), and the tables hold the positions an engine runs, not max_position_embeddings.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from builder import BuildConfig, build
from builder.errors import SourceError
from runtime.config import LookaheadConfig, ModelConfig
from runtime.engine import Engine
from runtime.errors import ConfigError, EngineDirError
from runtime.memory_plan import plan_memory
from runtime.rope import RotaryEmbedding, rope_parameters
from runtime.sampling import SamplingParams
from tiny_engine import SMALL_LOOKAHEAD, TINY, make_tiny_engine, random_prompts

from builder_fixtures import edit_config, write_checkpoint

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 512}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}

# ---- the tables equal transformers' --------------------------------------------------------------

GOOD = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": LLAMA3,
    "yarn": YARN,
    "yarn legacy type key": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn no truncate, betas": dict(YARN, truncate=False, beta_fast=16, beta_slow=2.5),
    "yarn mscale ratio": dict(YARN, mscale=0.9, mscale_all_dim=0.7),
    "yarn attention_factor": dict(YARN, attention_factor=1.25, mscale=1.0, mscale_all_dim=1.0),
    "yarn zero-width ramp": dict(YARN, beta_fast=4.0, beta_slow=4.0),
    "yarn factor 1": dict(YARN, factor=1.0),
}


@pytest.mark.parametrize("name", list(GOOD))
def test_tables_equal_transformers(name):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling, D, theta, P = GOOD[name], 64, 500000.0, 4096
    params = {"rope_theta": theta, "rope_type": "default", **(scaling or {})}
    params.pop("type", None)
    params["rope_type"] = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=D * 4, num_attention_heads=4, max_position_embeddings=P,
                                          rope_parameters=params))
    inv, factor = rope_parameters(D, theta, scaling)
    torch.testing.assert_close(inv, hf.inv_freq, rtol=1e-6, atol=0)     # ours in float64, theirs in float32
    assert factor == pytest.approx(hf.attention_scaling, rel=1e-12)
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), torch.arange(P)[None])
    ours = RotaryEmbedding(D, P, theta, scaling, torch.float32)
    # an angle is position x frequency rounded to fp32: a few ulp of n rad apart below position n
    for n in (64, 512, P):
        atol = 4 * n * 2.0 ** -23
        torch.testing.assert_close(ours.cos[:n], cos[0, :n], rtol=0, atol=atol)
        torch.testing.assert_close(ours.sin[:n], sin[0, :n], rtol=0, atol=atol)


# ---- every bad rope_scaling is refused by name ----------------------------------------------------

BAD = [  # (rope_scaling, the field named, what the message says)
    ({"rope_type": "linear"}, "factor", "is missing"),
    ({"rope_type": "linear", "factor": "eight"}, "factor", "must be a finite number"),
    ({"rope_type": "linear", "factor": 0}, "factor", r"must be in \[1.0"),
    ({"rope_type": "linear", "factor": -2.0}, "factor", r"must be in \[1.0"),
    ({"rope_type": "linear", "factor": True}, "factor", "must be a finite number"),
    ({"rope_type": "linear", "factor": 1e300}, "factor", "must be in"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, "low_freq_factor",
     "is not a field of rope_type linear"),
    ({"rope_type": "default", "factor": 2.0}, "factor", "is not a field of rope_type default"),
    ({**LLAMA3, "high_freq_factor": 1.0}, "high_freq_factor", "must be greater than low_freq_factor"),
    ({k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}, "low_freq_factor", "is missing"),
    ({**LLAMA3, "original_max_position_embeddings": "8192"}, "original_max_position_embeddings", "without quotes"),
    ({**LLAMA3, "original_max_position_embeddings": 0}, "original_max_position_embeddings", "must be in"),
    ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings", "is missing"),
    ({**YARN, "beta_fast": 1.0, "beta_slow": 2.0}, "beta_slow", "is above beta_fast"),
    ({**YARN, "beta_fast": 0}, "beta_fast", r"must be in \(0"),
    ({**YARN, "truncate": "yes"}, "truncate", "must be true or false"),
    ({**YARN, "truncate": None}, "truncate", "must be true or false"),
    ({**YARN, "attention_factor": 0.0}, "attention_factor", r"must be in \(0"),
    ({**YARN, "mscale": -1.0}, "mscale", r"must be in \[0"),
    ({**YARN, "finetuned": True}, "finetuned", "is not a field of rope_type yarn"),
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type", "'dynamic' is not supported: dynamic NTK"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "rope_type",
     "'longrope' is not supported"),
    ({"rope_type": 3}, "rope_type", "must be a string"),
    ({"type": "linear", "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}, "type",
     "says 'linear' but rope_type says 'yarn'"),
]
IDS = [f"{s.get('rope_type', s.get('type'))}-{field}-{i}" for i, (s, field, _) in enumerate(BAD)]


@pytest.mark.parametrize("scaling,field,problem", BAD, ids=IDS)
def test_model_config_names_the_field(scaling, field, problem):
    with pytest.raises(ConfigError, match=f"^rope_scaling.{field}: .*{problem}") as e:
        ModelConfig(**{**TINY, "rope_scaling": scaling})
    assert e.value.field == f"rope_scaling.{field}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("rope") / "llama", "llama", max_position_embeddings=1024)


@pytest.mark.parametrize("layout", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("scaling,field,problem", BAD, ids=IDS)
def test_build_names_the_field(checkpoint, tmp_path, scaling, field, problem, layout):
    """transformers 4.x's rope_theta + rope_scaling, and 5.x's rope_parameters (theta inside)."""
    src = shutil.copytree(checkpoint, tmp_path / "src")
    if layout == "rope_scaling":
        edit_config(src, rope_parameters=None, rope_theta=10000.0, rope_scaling=scaling)
    else:
        edit_config(src, rope_parameters={"rope_theta": 10000.0, **scaling})
    with pytest.raises(SourceError, match=f"config.json: rope_scaling.{field}: .*{problem}"):
        build(BuildConfig(model=str(src), output=tmp_path / "engine", verify=False), log=lambda line: None)
    assert not (tmp_path / "engine").exists()


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("rope") / "e")


@pytest.mark.parametrize("scaling,field,problem", BAD, ids=IDS)
def test_load_names_the_field(engine_dir, tmp_path, scaling, field, problem):
    d = shutil.copytree(engine_dir, tmp_path / "e")
    doc = yaml.safe_load((d / "engine.yaml").read_text())
    doc["model"]["rope_scaling"] = scaling
    (d / "engine.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(EngineDirError, match=f"engine.yaml: rope_scaling.{field}: .*{problem}"):
        Engine.from_dir(d)


def test_build_accepts_each_supported_scaling_and_writes_it_as_given(checkpoint, tmp_path):
    for i, scaling in enumerate(s for s in GOOD.values() if s):
        src = shutil.copytree(checkpoint, tmp_path / f"src{i}")
        edit_config(src, rope_parameters={"rope_theta": 10000.0, **scaling})
        build(BuildConfig(model=str(src), output=tmp_path / f"e{i}", verify=False), log=lambda line: None)
        written = yaml.safe_load((tmp_path / f"e{i}" / "engine.yaml").read_text())["model"]["rope_scaling"]
        assert written == scaling
    assert json.loads((checkpoint / "config.json").read_text())["rope_parameters"]["rope_type"] == "default"


# ---- the tables hold the positions the engine runs ------------------------------------------------

def test_tables_are_sized_by_max_model_len_not_max_position_embeddings(tmp_path):
    """2^24 positions would be 8 GiB of fp32 tables; an engine of 64 positions holds 64."""
    d = make_tiny_engine(tmp_path / "e", lookahead=LookaheadConfig(max_model_len=64),
                         max_position_embeddings=1 << 24, rope_scaling=dict(YARN, original_max_position_embeddings=1 << 20))
    eng = Engine.from_dir(d)
    rope = eng.model.rope
    assert rope.cos.shape == rope.sin.shape == (64, TINY["head_dim"])
    plan = plan_memory(eng.manifest.model, eng.config, None, 4)
    assert plan.rope == 2 * rope.cos.numel() * 4
    big = eng.sibling(max_model_len=96)             # the same weights, longer tables of the same values
    assert big.model.rope.cos.shape[0] == 96 and eng.model.rope.cos.shape[0] == 64
    assert big.model.layers is eng.model.layers
    torch.testing.assert_close(big.model.rope.cos[:64], rope.cos, rtol=0, atol=0)
    prompt = random_prompts(80, seed=1)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    fresh = Engine.from_dir(d, max_model_len=96)
    assert big.generate(prompt, params)[0].token_ids == fresh.generate(prompt, params)[0].token_ids


@pytest.mark.parametrize("mode", ["dense", "lookahead"])
def test_a_sequence_of_exactly_max_model_len_runs(tmp_path, mode):
    """The last decode step's draft row sits at the last position: inside the tables."""
    d = make_tiny_engine(tmp_path / "e", lookahead=LookaheadConfig(max_model_len=32))
    kw = dict(SMALL_LOOKAHEAD, top_k=8) if mode == "lookahead" else dict(mode="dense")
    eng = Engine.from_dir(d, **kw)
    out = eng.generate(random_prompts(20, seed=2), SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and eng.model.rope.cos.shape[0] == 32
