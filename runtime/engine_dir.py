"""The engine directory: format, checksums, and the checks the runtime makes before loading.

    <engine>/engine.yaml          single source of truth (format, model, dtype, lookahead, checksums)
    <engine>/weights.safetensors  runtime layout, see WEIGHT_LAYOUT (absent for a random-weights recipe)
    <engine>/tokenizer/           tokenizer.json (+ tokenizer_config.json, chat template)
    <engine>/build_report.json    what the builder verified

Written by `builder` (which calls `write_manifest`), read by `runtime.Engine.from_dir` (which calls
`load_manifest`). Any failure is an `EngineDirError` that says which file or field and what to do.
The checksums are not signed, so `load_manifest` also distrusts a dir whose manifest matches its
files: engine.yaml is bounded before it is parsed (MAX_MANIFEST_BYTES, no YAML aliases, known keys,
bounded strings), every path it names must stay inside the dir (no `..`, no absolute path, no
symlink out), and the weights' safetensors header must describe exactly the model's tensors before
any is read. Every other reader of the dir (tokenizer, chat template, Dynamo worker) gets its paths
from `engine_file`: inside the dir, and listed with a checksum.

Two optional sections (format_version 2; a dir without them is written as version 1, as before):

    quantization:     weight-only int8 (QUANT_SCHEME): the roles it names hold `qweight` int8
                      [N, K] + `scale` fp32 instead of `weight` (symmetric; `granularity`
                      per_output_channel: scale [N]; per_group: scale [N, K // group_size])
    random_weights:   a recipe (shape, seed, dtype, init) instead of weights.safetensors: the
                      runtime generates the weights on the target device at load (model.py)

and one that any version may carry (a runtime that predates it refuses the dir by the unknown key):

    precision:        what the builder resolved `prefill_precision: auto` to on its host and which
                      precisions it verified against the source model (config.BuildPrecision; the
                      runtime runs the first for auto and refuses the unverified, runtime/spec.py)
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .config import BuildPrecision, LookaheadConfig, ModelConfig, check_known_keys
from .errors import ConfigError, EngineDirError

FORMAT_VERSION = 1               # what a plain engine dir is written as
FORMAT_VERSION_EXTENDED = 2      # a dir with a quantization or random_weights section
SUPPORTED_FORMAT_VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_EXTENDED)
MANIFEST = "engine.yaml"
WEIGHTS = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
REPORT = "build_report.json"
DTYPES = ("float32", "bfloat16", "float16")
SAFETENSORS_DTYPES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2), "int8": ("I8", 1)}
# Weight-only int8: the only scheme this runtime implements, and what each of its fields must say.
QUANT_SCHEME = {"scheme": "int8", "symmetric": True, "scale_dtype": "float32"}
# Its scale layouts (`granularity`): one scale per output channel (scale [N]; `group_size` 0, or
# absent as in engines built before groups), or one per `group_size` consecutive inputs of each
# output channel (scale [N, K // group_size]; group_size divides every quantized K).
GRANULARITIES = ("per_output_channel", "per_group")
# Weights that may be quantized, by role: the four projections of every layer, the embedding
# (tied: its scales serve the lookup and the logits) and an untied lm_head.
QUANTIZABLE = ("embed_tokens", "wqkv", "wo", "w13", "w2", "lm_head")
RANDOM_INITS = ("normal_fan_in",)   # weights ~ N(0, 1/fan_in); norms ~ 1 + 0.1 N(0, 1)
MAX_HEADER_BYTES = 100 << 20     # the safetensors library's own limit on a header
SHA256 = re.compile(r"[0-9a-f]{64}")     # a digest in engine.yaml's files
# Files the runtime reads when they are there (the tokenizer's config and chat template, which the
# Dynamo worker hands its frontend too): each must lie inside the engine dir, and be listed, so its
# checksum covers it; `engine_file` is how every reader gets their paths.
RUNTIME_READS = (WEIGHTS, f"{TOKENIZER_DIR}/tokenizer.json", f"{TOKENIZER_DIR}/tokenizer_config.json",
                 f"{TOKENIZER_DIR}/chat_template.jinja")
# engine.yaml is parsed before anything is checked, so its size and shape are bounded first: a real
# one is a few KB, a name a few words, a string field (a path, a version) a line.
MAX_MANIFEST_BYTES = 1 << 20
MAX_NAME_CHARS = 256
MAX_STRING_CHARS = 4096
TOP_LEVEL_FIELDS = ("format_version", "name", "dtype", "model", "lookahead", "source", "versions",
                    "quantization", "random_weights", "tokenizer", "precision", "files")

# Runtime weight names and shapes (C = ModelConfig). Fused projections save a matmul launch each.
WEIGHT_LAYOUT = """
embed_tokens.weight              [vocab_size, hidden_size]
layers.{i}.attn_norm.weight      [hidden_size]
layers.{i}.wqkv.weight           [q_size + 2 * kv_size, hidden_size]   rows: q | k | v (HF head order)
layers.{i}.wqkv.bias             [q_size + 2 * kv_size]                only if attention_bias
layers.{i}.q_norm.weight         [head_dim]                            only if qk_norm (qwen3): each q head's RMSNorm
layers.{i}.k_norm.weight         [head_dim]                            only if qk_norm: each k head's
layers.{i}.wo.weight             [hidden_size, q_size]
layers.{i}.mlp_norm.weight       [hidden_size]
layers.{i}.w13.weight            [2 * intermediate_size, hidden_size]  rows: gate | up
layers.{i}.w2.weight             [hidden_size, intermediate_size]
norm.weight                      [hidden_size]
lm_head.weight                   [vocab_size, hidden_size]             only if not tie_word_embeddings

Quantized (engine.yaml `quantization.quantized` lists the roles): `<role>.weight` [N, K] is stored
as `<role>.qweight` [N, K] int8 and `<role>.scale` float32, [N] per output channel or [N, K // G]
per group of G = `quantization.group_size` inputs: W[n, k] ~= qweight[n, k] * scale[n, k // G]
(G = K per output channel); norms and biases stay in the engine's dtype (float32).
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
        if cfg.qk_norm:
            shapes.update({p + "q_norm.weight": (cfg.head_dim,), p + "k_norm.weight": (cfg.head_dim,)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def expected_tensors(cfg: ModelConfig, dtype: str,
                     quantization: dict[str, Any] | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the weights file: name -> (shape, dtype name), with the quantized roles'
    weights as qweight (int8) + scale (float32: [N], or [N, K // G] for quantization.group_size G)."""
    roles = set(quantization["quantized"]) if quantization else set()
    G = group_size(quantization) if quantization else 0
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, shape in expected_shapes(cfg).items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in roles:
            out[module + ".qweight"] = (shape, "int8")
            out[module + ".scale"] = ((shape[0], shape[1] // G) if G else (shape[0],), QUANT_SCHEME["scale_dtype"])
        else:
            out[name] = (shape, dtype)
    return out


def group_size(quantization: dict[str, Any]) -> int:
    """The inputs per scale of a `quantization:` section: its group_size for per_group, else 0 (one
    scale per output channel)."""
    return int(quantization.get("group_size") or 0) if quantization.get("granularity") == "per_group" else 0


def contained_path(d: Path, rel: Any, mpath: Path) -> Path:
    """`d / rel` if it stays inside the engine dir `d` after following symlinks; else
    EngineDirError. Refused: non-strings, absolute paths, any `..` component, and symlinks (of the
    file or a folder above it) that lead out of the dir: an engine dir whose manifest names
    ../../etc/passwd, or whose weights link to it, must not make us read it."""
    if not isinstance(rel, str) or not rel:
        raise EngineDirError(f"{mpath}: files: {rel!r} is not a relative path; rebuild the engine")
    parts = rel.replace("\\", "/").split("/")
    if os.path.isabs(rel) or rel.startswith(("/", "\\")) or ".." in parts:
        raise EngineDirError(f"{mpath}: files: {rel!r} points outside the engine dir (absolute or '..'); "
                             "the manifest may only name files inside it: rebuild the engine")
    p = d / rel
    try:
        root, real = d.resolve(), p.resolve()
    except (OSError, RuntimeError):          # a symlink loop
        raise EngineDirError(f"{p} is a symlink that cannot be resolved (a loop?): rebuild the engine") from None
    if real != root and root not in real.parents:
        raise EngineDirError(f"{p} is a symlink (or lies under one) to {real}, outside the engine dir "
                             f"{root}: copy the file into the engine dir instead of linking it, or rebuild the engine")
    return p


def engine_file(manifest: "Manifest", rel: str) -> Path | None:
    """The path to read the engine dir's file `rel` from, or None when the dir has none. The one
    way any process (runtime, Triton model, Dynamo worker) opens a file of a loaded engine dir: it
    lies inside the dir (`contained_path`) and is listed in engine.yaml's files, so a checksum
    covers it; a file there but not listed is refused, never read."""
    return _listed_path(manifest.path, rel, manifest.files, manifest.path / MANIFEST)


def _listed_path(d: Path, rel: str, files: dict[str, str], mpath: Path) -> Path | None:
    p = contained_path(d, rel, mpath)
    if rel in files:
        return p
    if p.exists() or p.is_symlink():
        raise EngineDirError(f"{p} is not listed in {mpath}'s files, so no checksum covers it: it was "
                             "added after the build (remove it, or rebuild the engine)")
    return None


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
    quantization: dict[str, Any] | None = None     # QUANT_SCHEME, granularity, group_size, `quantized` roles, ...
    random_weights: dict[str, Any] | None = None   # shape, seed, dtype, init: no weights file
    tokenizer: dict[str, Any] | None = None        # informational (random weights: token_ids)
    precision: BuildPrecision | None = None        # what the builder resolved and verified (runtime/spec.py)

    @property
    def has_weights_file(self) -> bool:
        return self.random_weights is None


def write_manifest(engine_dir: Path, *, name: str, model: ModelConfig, dtype: str,
                   lookahead: LookaheadConfig, source: dict[str, Any], versions: dict[str, str],
                   quantization: dict[str, Any] | None = None, random_weights: dict[str, Any] | None = None,
                   tokenizer: dict[str, Any] | None = None, precision: BuildPrecision | None = None) -> Path:
    """Checksum every file already in `engine_dir` (except the manifest) and write engine.yaml.

    quantization / random_weights / tokenizer / precision: the optional sections (see the module docstring);
    with either of the first two the dir is format_version 2, which older runtimes refuse."""
    engine_dir = Path(engine_dir)
    files = {str(p.relative_to(engine_dir)): sha256_file(p)
             for p in sorted(engine_dir.rglob("*")) if p.is_file() and p.name != MANIFEST}
    extended = quantization is not None or random_weights is not None
    doc = {
        "format_version": FORMAT_VERSION_EXTENDED if extended else FORMAT_VERSION,
        "name": name,
        "dtype": dtype,
        "model": model.to_dict(),
        "lookahead": lookahead.to_dict(),
        "source": source,
        "versions": versions,
    }
    for key, section in (("quantization", quantization), ("random_weights", random_weights),
                         ("tokenizer", tokenizer), ("precision", precision and precision.to_dict())):
        if section is not None:
            doc[key] = section
    doc["files"] = files
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
    doc = _read_manifest(d, mpath)
    version = doc.get("format_version")
    if version not in SUPPORTED_FORMAT_VERSIONS or isinstance(version, bool):
        raise EngineDirError(f"{mpath}: format_version {_short(version)} is incompatible with this runtime "
                             f"(expects {' or '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}); rebuild the "
                             "engine with this version's builder")
    for key in ("model", "dtype", "lookahead", "files"):
        if key not in doc:
            raise EngineDirError(f"{mpath}: field {key!r} is missing; rebuild the engine")
    if not isinstance(doc["dtype"], str) or doc["dtype"] not in DTYPES:
        raise EngineDirError(f"{mpath}: dtype {_short(doc['dtype'])} is not one of {DTYPES}")
    try:
        check_known_keys(doc, TOP_LEVEL_FIELDS)
        _check_strings(doc)
        name = _name(doc.get("name", d.name))
        model = ModelConfig.from_dict(doc["model"])
        lookahead = LookaheadConfig.from_dict(doc["lookahead"])
        precision = BuildPrecision.from_dict(doc["precision"]) if doc.get("precision") is not None else None
    except (ConfigError, TypeError) as e:
        raise EngineDirError(f"{mpath}: {e}") from None
    extended = [k for k in ("quantization", "random_weights") if doc.get(k) is not None]
    if extended and version != FORMAT_VERSION_EXTENDED:
        raise EngineDirError(f"{mpath}: section {extended[0]!r} needs format_version "
                             f"{FORMAT_VERSION_EXTENDED}, the file says {version}; rebuild the engine")
    quantization = _quantization(doc.get("quantization"), mpath, model, doc["dtype"])
    random_weights = _random_weights(doc.get("random_weights"), mpath, doc["dtype"])
    if quantization is not None and random_weights is not None:
        raise EngineDirError(f"{mpath}: random_weights cannot be quantized; rebuild the engine")
    files = _check_files(d, mpath, doc["files"], verify_checksums, weights_file=random_weights is None)
    if random_weights is None:
        check_weights_header(d / WEIGHTS, model, doc["dtype"], quantization)
    tokenizer = doc.get("tokenizer")
    return Manifest(path=d, model=model, dtype=doc["dtype"], lookahead=lookahead, files=files,
                    source=_mapping(doc.get("source")), versions=_mapping(doc.get("versions")),
                    name=name, quantization=quantization,
                    random_weights=random_weights, tokenizer=_mapping(tokenizer) if tokenizer is not None else None,
                    precision=precision)


class _ManifestLoader(yaml.SafeLoader):
    """yaml.SafeLoader without anchors and aliases: an alias lets one node stand for many, so a
    1 KB engine.yaml can stand for gigabytes (a "billion laughs") once anything walks or prints it.
    The builder never writes them (write_manifest's safe_dump of fresh objects)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if getattr(event, "anchor", None) is not None:
            raise _AliasError(event.start_mark)
        return super().compose_node(parent, index)


class _AliasError(yaml.YAMLError):
    def __init__(self, mark: Any):
        self.mark = mark


def _read_manifest(d: Path, mpath: Path) -> dict[str, Any]:
    """engine.yaml as a mapping: inside the dir, at most MAX_MANIFEST_BYTES, UTF-8 YAML without
    anchors or aliases, nested at most as deep as the parser's recursion allows."""
    contained_path(d, MANIFEST, mpath)
    if not mpath.is_file():
        raise EngineDirError(f"{mpath} is missing: {d} is not a complete engine dir (rebuild it)")
    with open(mpath, "rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise EngineDirError(f"{mpath} is over {MAX_MANIFEST_BYTES >> 20} MiB (a built one is a few KB): "
                             "rebuild the engine")
    try:
        doc = yaml.load(raw.decode("utf-8"), Loader=_ManifestLoader)
    except UnicodeDecodeError:
        raise EngineDirError(f"{mpath} is not UTF-8 text; rebuild the engine") from None
    except _AliasError as e:
        raise EngineDirError(f"{mpath} line {e.mark.line + 1}: YAML anchors and aliases (&name, *name) are not "
                             "allowed in engine.yaml (a few bytes of them can stand for gigabytes); rebuild "
                             "the engine") from None
    except yaml.YAMLError as e:
        raise EngineDirError(f"{mpath} is not valid YAML ({e.__class__.__name__}); rebuild the engine") from None
    except RecursionError:
        raise EngineDirError(f"{mpath} nests too deep to be an engine.yaml; rebuild the engine") from None
    if not isinstance(doc, dict):
        raise EngineDirError(f"{mpath} does not hold a mapping; rebuild the engine")
    return doc


def _check_strings(v: Any, where: str = "") -> None:
    """Every string in engine.yaml (keys and values) is at most MAX_STRING_CHARS long."""
    if isinstance(v, str) and len(v) > MAX_STRING_CHARS:
        raise ConfigError(where or "engine.yaml", f"is a string of {len(v)} characters, over {MAX_STRING_CHARS}",
                          "rebuild the engine")
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for key, value in items:
        _check_strings(key, where)
        _check_strings(value, f"{where}.{key}" if where else str(key))


def _name(v: Any) -> str:
    """engine.yaml's `name`: a string of 1 to MAX_NAME_CHARS printable characters."""
    if not isinstance(v, str) or not 0 < len(v) <= MAX_NAME_CHARS or not v.isprintable():
        raise ConfigError("name", f"must be a string of 1 to {MAX_NAME_CHARS} printable characters, got "
                                  f"{_short(v)}", "rebuild the engine (scripts/build_engine.py --name NAME)")
    return v


def _quantization(q: Any, mpath: Path, model: ModelConfig, dtype: str) -> dict[str, Any] | None:
    """engine.yaml's `quantization:` section: the one scheme this runtime runs, in a scale layout it
    knows (GRANULARITIES: a group size dividing every quantized weight's inputs), on roles it knows."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise EngineDirError(f"{mpath}: quantization must be a mapping; rebuild the engine")
    for key, want in QUANT_SCHEME.items():
        if q.get(key) != want:
            raise EngineDirError(f"{mpath}: quantization.{key} is {_short(q.get(key))}, this runtime runs only "
                                 f"{key}: {want!r} (weight-only int8, symmetric fp32 scales); rebuild the engine")
    if q.get("granularity") not in GRANULARITIES:
        raise EngineDirError(f"{mpath}: quantization.granularity is {_short(q.get('granularity'))}, this runtime "
                             f"runs {' or '.join(GRANULARITIES)}; rebuild the engine")
    G = q.get("group_size", 0)
    per_group = q["granularity"] == "per_group"
    if not isinstance(G, int) or isinstance(G, bool) or G < 0 or (G > 0) != per_group:
        raise EngineDirError(f"{mpath}: quantization.group_size is {_short(G)}, but granularity {q['granularity']} "
                             f"takes {'a positive number of inputs per scale' if per_group else '0 (or none)'}; "
                             "rebuild the engine")
    roles = q.get("quantized")
    allowed = [r for r in QUANTIZABLE if r != "lm_head" or not model.tie_word_embeddings]
    if (not isinstance(roles, list) or not roles or not all(isinstance(r, str) for r in roles)
            or len(set(roles)) != len(roles) or not set(roles) <= set(allowed)):
        raise EngineDirError(f"{mpath}: quantization.quantized must list weights among {allowed}, got "
                             f"{_short(roles)}; rebuild the engine")
    for name, shape in expected_shapes(model).items() if G else ():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in roles and shape[1] % G:
            raise EngineDirError(f"{mpath}: quantization.group_size {G} does not divide the {shape[1]} inputs of "
                                 f"{module}.qweight {list(shape)}; rebuild the engine")
    if dtype != "float32":
        raise EngineDirError(f"{mpath}: int8 weights run with float32 activations, but dtype is {dtype}; "
                             "rebuild the engine")
    return dict(q)


def _random_weights(r: Any, mpath: Path, dtype: str) -> dict[str, Any] | None:
    """engine.yaml's `random_weights:` recipe: generated at load, so every field must be usable."""
    if r is None:
        return None
    if not isinstance(r, dict):
        raise EngineDirError(f"{mpath}: random_weights must be a mapping; rebuild the engine")
    seed = r.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63:
        raise EngineDirError(f"{mpath}: random_weights.seed must be an integer in [0, 2^63), got {_short(seed)}")
    if r.get("init") not in RANDOM_INITS:
        raise EngineDirError(f"{mpath}: random_weights.init {_short(r.get('init'))} is not one of {RANDOM_INITS}")
    if r.get("dtype", dtype) != dtype:
        raise EngineDirError(f"{mpath}: random_weights.dtype {_short(r.get('dtype'))} disagrees with dtype {dtype}")
    return dict(r)


def _mapping(v: Any) -> dict[str, Any]:
    """An informational section (source, versions): a mapping, or empty when it is anything else."""
    return dict(v) if isinstance(v, dict) else {}


def _check_files(d: Path, mpath: Path, files: Any, verify_checksums: bool,
                 weights_file: bool = True) -> dict[str, str]:
    """The manifest's `files:` (relative path -> sha256): every one inside the dir, present and
    (verify_checksums) matching; every file the runtime reads listed among them. weights_file:
    False for a random-weights recipe, which must list none."""
    if not isinstance(files, dict) or not all(isinstance(v, str) and SHA256.fullmatch(v) for v in files.values()):
        raise EngineDirError(f"{mpath}: files must map relative paths to sha256 digests (64 hex digits); "
                             "rebuild the engine")
    for required in ((WEIGHTS,) if weights_file else ()) + (f"{TOKENIZER_DIR}/tokenizer.json",):
        if required not in files:
            raise EngineDirError(f"{mpath}: lists no {required}; rebuild the engine")
    if not weights_file and WEIGHTS in files:
        raise EngineDirError(f"{mpath}: lists {WEIGHTS}, but random_weights says the weights are generated "
                             "at load; rebuild the engine")
    paths = {rel: contained_path(d, rel, mpath) for rel in files}     # all checked before any is read
    for rel in RUNTIME_READS:
        _listed_path(d, rel, files, mpath)
    for rel, digest in files.items():
        p = paths[rel]
        if not p.is_file():
            raise EngineDirError(f"{p} is missing: the engine dir is incomplete (rebuild it)")
        if verify_checksums and sha256_file(p) != digest:
            raise EngineDirError(f"{p} does not match its checksum in engine.yaml: the file was changed "
                                 "or corrupted after the build (rebuild the engine)")
    return dict(files)


def read_weights_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """(header, data start, file size) of a safetensors file, reading only its header: 8 bytes of
    little-endian length, then that much JSON. Never allocates more than MAX_HEADER_BYTES."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise EngineDirError(f"{path} is truncated ({size} bytes, no safetensors header): rebuild the engine")
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise EngineDirError(f"{path}: its safetensors header claims {n} bytes, more than the file's "
                                 f"{size - 8} after the length (truncated or corrupt): rebuild the engine")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise EngineDirError(f"{path}: its safetensors header is not valid JSON (corrupt file): "
                             "rebuild the engine") from None
    if not isinstance(header, dict):
        raise EngineDirError(f"{path}: its safetensors header is not a JSON object: rebuild the engine")
    return header, 8 + n, size


def check_weights_header(path: Path, cfg: ModelConfig, dtype: str,
                         quantization: dict[str, Any] | None = None) -> None:
    """Before any weight is loaded: the header lists exactly `expected_tensors(cfg, dtype,
    quantization)`, each tensor in its dtype (the manifest's; int8 + float32 scales for quantized
    weights) with its data inside the file. A truncated file, a header claiming a huge
    shape, or weights of another model fail here in one line naming the tensor, instead of in
    safetensors or load_state_dict (a long traceback, or a huge allocation)."""
    header, start, size = read_weights_header(path)
    layout = expected_tensors(cfg, dtype, quantization)
    expected = {name: shape for name, (shape, _) in layout.items()}
    for name, shape in expected.items():
        tensor_dtype = layout[name][1]
        want_dtype, itemsize = SAFETENSORS_DTYPES[tensor_dtype]
        info = header.get(name)
        if not isinstance(info, dict):
            raise EngineDirError(f"{path}: tensor {name} is missing (the weights do not match engine.yaml's "
                                 "model): rebuild the engine")
        got = info.get("shape")
        if not isinstance(got, list) or tuple(got) != shape:
            raise EngineDirError(f"{path}: tensor {name} has shape {_short(got)}, engine.yaml's model needs "
                                 f"{list(shape)}: rebuild the engine")
        if info.get("dtype") != want_dtype:
            raise EngineDirError(f"{path}: tensor {name} is {_short(info.get('dtype'))}, engine.yaml says dtype "
                                 f"{tensor_dtype} ({want_dtype}): rebuild the engine")
        offsets = info.get("data_offsets")
        nbytes = math.prod(shape) * itemsize
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or offsets[0] < 0 or offsets[1] - offsets[0] != nbytes):
            raise EngineDirError(f"{path}: tensor {name} has data offsets {_short(offsets)}, not a span of its "
                                 f"{nbytes} bytes (corrupt header): rebuild the engine")
        if start + offsets[1] > size:
            raise EngineDirError(f"{path}: tensor {name}'s data ends at byte {start + offsets[1]}, past the end "
                                 f"of the file ({size} bytes): the file is truncated, rebuild the engine")
    extra = sorted(set(header) - set(expected) - {"__metadata__"})
    if extra:
        raise EngineDirError(f"{path}: tensor {_short(extra[0])} is not part of engine.yaml's model "
                             "(the weights are another model's): rebuild the engine")
    # as safetensors requires: the spans tile the data exactly, in some order, with no gap or overlap
    end = 0
    for name in sorted(expected, key=lambda t: header[t]["data_offsets"]):
        first, last = header[name]["data_offsets"]
        if first != end:
            raise EngineDirError(f"{path}: tensor {name}'s data starts at {first}, where {end} was expected "
                                 "(overlapping or gapped offsets: corrupt header): rebuild the engine")
        end = last
    if start + end != size:
        raise EngineDirError(f"{path}: the tensors' data ends at byte {start + end} but the file has {size} "
                             "(trailing bytes: corrupt file): rebuild the engine")


def _short(v: Any, limit: int = 80) -> str:
    """repr of a header value, cut short: a hostile header may hold a megabyte in one field."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def read_report(engine_dir: str | Path) -> dict[str, Any]:
    p = engine_file(load_manifest(engine_dir, verify_checksums=False), REPORT)
    return json.loads(p.read_text()) if p is not None else {}
