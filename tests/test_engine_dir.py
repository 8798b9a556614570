"""The runtime refuses incomplete, incompatible or tampered engine dirs with a message saying which."""
from __future__ import annotations

import shutil

import pytest
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
