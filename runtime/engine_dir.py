"""The engine directory: format, checksums, and the checks the runtime makes before loading.

    <engine>/engine.yaml          single source of truth (format, model, dtype, lookahead, checksums)
    <engine>/weights.safetensors  runtime layout, see WEIGHT_LAYOUT
    <engine>/tokenizer/           tokenizer.json (+ tokenizer_config.json, chat template)
    <engine>/build_report.json    what the builder verified

Written by `builder` (which calls `write_manifest`), read by `runtime.Engine.from_dir` (which calls
`load_manifest`). Any failure is an `EngineDirError` that says which file or field and what to do.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .config import LookaheadConfig, ModelConfig
from .errors import ConfigError, EngineDirError

FORMAT_VERSION = 1
MANIFEST = "engine.yaml"
WEIGHTS = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
REPORT = "build_report.json"
DTYPES = ("float32", "bfloat16", "float16")

# Runtime weight names and shapes (C = ModelConfig). Fused projections save a matmul launch each.
WEIGHT_LAYOUT = """
embed_tokens.weight              [vocab_size, hidden_size]
layers.{i}.attn_norm.weight      [hidden_size]
layers.{i}.wqkv.weight           [q_size + 2 * kv_size, hidden_size]   rows: q | k | v (HF head order)
layers.{i}.wqkv.bias             [q_size + 2 * kv_size]                only if attention_bias
layers.{i}.wo.weight             [hidden_size, q_size]
layers.{i}.mlp_norm.weight       [hidden_size]
layers.{i}.w13.weight            [2 * intermediate_size, hidden_size]  rows: gate | up
layers.{i}.w2.weight             [hidden_size, intermediate_size]
norm.weight                      [hidden_size]
lm_head.weight                   [vocab_size, hidden_size]             only if not tie_word_embeddings
"""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the runtime needs, with its shape."""
    h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, h), "norm.weight": (h,)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn_norm.weight": (h,),
            p + "wqkv.weight": (qkv, h),
            p + "wo.weight": (h, cfg.q_size),
            p + "mlp_norm.weight": (h,),
            p + "w13.weight": (2 * cfg.intermediate_size, h),
            p + "w2.weight": (h, cfg.intermediate_size),
        })
        if cfg.attention_bias:
            shapes[p + "wqkv.bias"] = (qkv,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Manifest:
    """Parsed engine.yaml."""

    path: Path
    model: ModelConfig
    dtype: str
    lookahead: LookaheadConfig
    files: dict[str, str]        # relative path -> sha256
    source: dict[str, Any]
    versions: dict[str, str]
    name: str = "engine"


def write_manifest(engine_dir: Path, *, name: str, model: ModelConfig, dtype: str,
                   lookahead: LookaheadConfig, source: dict[str, Any], versions: dict[str, str]) -> Path:
    """Checksum every file already in `engine_dir` (except the manifest) and write engine.yaml."""
    engine_dir = Path(engine_dir)
    files = {str(p.relative_to(engine_dir)): sha256_file(p)
             for p in sorted(engine_dir.rglob("*")) if p.is_file() and p.name != MANIFEST}
    doc = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "dtype": dtype,
        "model": model.to_dict(),
        "lookahead": lookahead.to_dict(),
        "source": source,
        "versions": versions,
        "files": files,
    }
    out = engine_dir / MANIFEST
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def load_manifest(engine_dir: str | Path, *, verify_checksums: bool = True) -> Manifest:
    """Read and validate an engine dir; raise EngineDirError naming what is wrong."""
    d = Path(engine_dir)
    if not d.is_dir():
        raise EngineDirError(f"engine dir {d} does not exist "
                             f"(build one: python scripts/build_engine.py --model default --output {d})")
    mpath = d / MANIFEST
    if not mpath.is_file():
        raise EngineDirError(f"{mpath} is missing: {d} is not a complete engine dir (rebuild it)")
    try:
        doc = yaml.safe_load(mpath.read_text())
    except yaml.YAMLError as e:
        raise EngineDirError(f"{mpath} is not valid YAML ({e.__class__.__name__}); rebuild the engine") from None
    if not isinstance(doc, dict):
        raise EngineDirError(f"{mpath} does not hold a mapping; rebuild the engine")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise EngineDirError(f"{mpath}: format_version {version!r} is incompatible with this runtime "
                             f"(expects {FORMAT_VERSION}); rebuild the engine with this version's builder")
    for key in ("model", "dtype", "lookahead", "files"):
        if key not in doc:
            raise EngineDirError(f"{mpath}: field {key!r} is missing; rebuild the engine")
    if doc["dtype"] not in DTYPES:
        raise EngineDirError(f"{mpath}: dtype {doc['dtype']!r} is not one of {DTYPES}")
    try:
        model = ModelConfig.from_dict(doc["model"])
        lookahead = LookaheadConfig.from_dict(doc["lookahead"])
    except (ConfigError, TypeError) as e:
        raise EngineDirError(f"{mpath}: {e}") from None
    files = dict(doc["files"])
    for required in (WEIGHTS, f"{TOKENIZER_DIR}/tokenizer.json"):
        if required not in files:
            raise EngineDirError(f"{mpath}: lists no {required}; rebuild the engine")
    for rel, digest in files.items():
        p = d / rel
        if not p.is_file():
            raise EngineDirError(f"{p} is missing: the engine dir is incomplete (rebuild it)")
        if verify_checksums and sha256_file(p) != digest:
            raise EngineDirError(f"{p} does not match its checksum in engine.yaml: the file was changed "
                                 "or corrupted after the build (rebuild the engine)")
    return Manifest(path=d, model=model, dtype=doc["dtype"], lookahead=lookahead, files=files,
                    source=dict(doc.get("source") or {}), versions=dict(doc.get("versions") or {}),
                    name=str(doc.get("name", d.name)))


def read_report(engine_dir: str | Path) -> dict[str, Any]:
    p = Path(engine_dir) / REPORT
    return json.loads(p.read_text()) if p.is_file() else {}
