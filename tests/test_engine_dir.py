"""The runtime refuses incomplete, incompatible or tampered engine dirs with a message saying which."""
from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from runtime.config import LookaheadConfig, ModelConfig
from runtime.engine import Engine
from runtime.engine_dir import expected_shapes, load_manifest
from runtime.errors import ConfigError, EngineDirError
from tiny_engine import TINY, make_tiny_engine


@pytest.fixture
def eng_dir(tmp_path):
    return make_tiny_engine(tmp_path / "e")


def test_valid_dir_loads(eng_dir):
    m = load_manifest(eng_dir)
    assert m.model.num_layers == 2 and "weights.safetensors" in m.files


def test_missing_dir(tmp_path):
    with pytest.raises(EngineDirError, match="does not exist"):
        Engine.from_dir(tmp_path / "nope")


def test_missing_manifest(eng_dir):
    (eng_dir / "engine.yaml").unlink()
    with pytest.raises(EngineDirError, match="engine.yaml is missing"):
        Engine.from_dir(eng_dir)


def test_missing_listed_file(eng_dir):
    shutil.rmtree(eng_dir / "tokenizer")
    with pytest.raises(EngineDirError, match="tokenizer.json is missing"):
        Engine.from_dir(eng_dir)


def test_tampered_weights(eng_dir):
    with open(eng_dir / "weights.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(EngineDirError, match="weights.safetensors does not match its checksum"):
        Engine.from_dir(eng_dir)


def test_incompatible_format_version(eng_dir):
    doc = yaml.safe_load((eng_dir / "engine.yaml").read_text())
    doc["format_version"] = 99
    (eng_dir / "engine.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(EngineDirError, match="format_version 99 is incompatible"):
        Engine.from_dir(eng_dir)


def test_bad_field_in_manifest_names_it(eng_dir):
    doc = yaml.safe_load((eng_dir / "engine.yaml").read_text())
    doc["lookahead"]["top_k"] = 0
    (eng_dir / "engine.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(EngineDirError, match="top_k"):
        Engine.from_dir(eng_dir)


def test_expected_shapes_tied_and_bias():
    cfg = ModelConfig(**{**TINY, "tie_word_embeddings": True, "attention_bias": True})
    shapes = expected_shapes(cfg)
    assert "lm_head.weight" not in shapes
    assert shapes["layers.1.wqkv.bias"] == (6 * 16 + 2 * 2 * 16,)


@pytest.mark.parametrize("kwargs,field", [
    (dict(top_k=0), "top_k"), (dict(fetch_ratio=0.0), "fetch_ratio"), (dict(fetch_ratio=1.5), "fetch_ratio"),
    (dict(block_size=12), "block_size"), (dict(residency="lru"), "residency"),
    (dict(miss_policy="x"), "miss_policy"), (dict(mode="fast"), "mode"), (dict(draft="eagle"), "draft"),
])
def test_lookahead_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        LookaheadConfig(**kwargs)


def test_fetch_cap_follows_the_paper():
    assert LookaheadConfig().fetch_cap == 26           # ceil(0.2 * 128)
    assert LookaheadConfig(fetch_ratio=0.05).fetch_cap == 7
    assert LookaheadConfig(top_k=10, fetch_ratio=0.01).fetch_cap == 1


def test_unknown_override_is_named():
    with pytest.raises(ConfigError, match="^topk"):
        LookaheadConfig().replace(topk=3)


def test_unsupported_architecture_is_named():
    with pytest.raises(ConfigError, match="gpt2"):
        ModelConfig(**{**TINY, "architecture": "gpt2"})


# ---- random-weights recipes: no weights file, generated at load ---------------------------------

@pytest.fixture
def recipe_dir(tmp_path):
    from builder import BuildConfig, build
    out = tmp_path / "recipe"
    build(BuildConfig(output=out, random_weights="tiny", seed=5, tokenizer="bytes"), log=lambda line: None)
    return out


def _edit_manifest(d, change):
    doc = yaml.safe_load((d / "engine.yaml").read_text())
    change(doc)
    (d / "engine.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def test_recipe_loads_on_cpu_with_generated_weights(recipe_dir):
    m = load_manifest(recipe_dir)
    assert m.random_weights["seed"] == 5 and m.random_weights["init"] == "normal_fan_in"
    assert not (recipe_dir / "weights.safetensors").exists()
    eng = Engine.from_dir(recipe_dir, device="cpu")
    w = eng.model.layers[1].w2.weight
    assert w.device.type == "cpu" and w.dtype == torch.float32 and abs(w.std().item() - 128 ** -0.5) < 0.02
    norm = eng.model.layers[0].attn_norm.weight
    assert abs(norm.mean().item() - 1.0) < 0.05 and 0.05 < norm.std().item() < 0.15
    from runtime.model import random_weights
    again = dict(random_weights(m.model, 5, torch.float32, "cpu"))          # a function of the recipe
    assert torch.equal(again["layers.1.w2.weight"], w)


def test_recipe_with_a_weights_file_is_refused(recipe_dir):
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(recipe_dir / "weights.safetensors"))
    with pytest.raises(EngineDirError, match="weights.safetensors is not listed"):
        load_manifest(recipe_dir)
    _edit_manifest(recipe_dir, lambda d: d["files"].update({"weights.safetensors": "0" * 64}))
    with pytest.raises(EngineDirError, match="generated at load"):
        load_manifest(recipe_dir)


@pytest.mark.parametrize("change,message", [
    (lambda d: d["random_weights"].update(seed="5"), "random_weights.seed must be an integer"),
    (lambda d: d["random_weights"].update(seed=-1), "random_weights.seed must be an integer"),
    (lambda d: d["random_weights"].update(init="xavier"), "random_weights.init 'xavier' is not one of"),
    (lambda d: d["random_weights"].update(dtype="bfloat16"), "disagrees with dtype float32"),
    (lambda d: d.update(format_version=1), "needs format_version 2"),
])
def test_bad_recipe_is_refused(recipe_dir, change, message):
    _edit_manifest(recipe_dir, change)
    with pytest.raises(EngineDirError, match=message):
        load_manifest(recipe_dir, verify_checksums=False)
