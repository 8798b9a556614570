"""Resolve `--model` to a source: the default model, a named source (builder/named_sources.py), a
Hugging Face model dir, or a .gguf file."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from runtime.engine_dir import sha256_file

from .checkpoint import CONFIG, GENERATION_CONFIG, SAFETENSORS_INDEX, safetensors_files
from .config import DEFAULT_MODEL
from .assemble import named_gguf
from .default_model import GGUF_NAME, PACKAGE, VERSION, default_gguf
from .errors import SourceError
from .named_sources import NAMED_SOURCES

MODEL_FIX = f"pass a Hugging Face model dir or a .gguf file, or one of: {', '.join([DEFAULT_MODEL, *NAMED_SOURCES])}"
GGUF_MAGIC = b"GGUF"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "chat_template.jinja")


@dataclass
class Source:
    """Where the weights come from.

    `kind` is "hf_dir" or "gguf"; `path` is what the user named; `checksums` maps each source file
    (relative to the dir, or the GGUF's name) to its sha256 (filled by `checksum`). A GGUF is read
    through `hf_dir`, its cached Hugging Face-style conversion, set at load time.
    """

    kind: str
    path: Path
    hf_dir: Path | None = None
    checksums: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_manifest(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path), "sha256": dict(self.checksums), **self.extra}


def resolve_source(model: str, log: Callable[[str], None]) -> Source:
    """Find the source `model` names (installing the default model, or a named source's parts, when
    missing); reads no weights.

    Raises
    ------
    SourceError
        The path is missing, or is neither a model dir nor a GGUF file; a named source's parts
        cannot be installed or do not assemble to their pinned sha256.
    """
    if model == DEFAULT_MODEL:
        path = default_gguf(log)
        return _gguf_source(path, extra={"model": "default", "package": f"{PACKAGE}=={VERSION}",
                                         "file": GGUF_NAME})
    if model in NAMED_SOURCES:
        named = NAMED_SOURCES[model]
        return _gguf_source(named_gguf(named, log), extra=named.manifest())
    path = Path(model).expanduser().resolve()
    if not path.exists():
        raise SourceError("no such file or directory", field="model", value=model, fix=MODEL_FIX)
    if path.is_dir():
        if not (path / CONFIG).is_file():
            raise SourceError(f"is a directory without {CONFIG}", field="model", value=model, fix=MODEL_FIX)
        return Source("hf_dir", path, hf_dir=path)
    if path.suffix.lower() != ".gguf":
        raise SourceError("is neither a model directory nor a .gguf file", field="model", value=model,
                          fix=MODEL_FIX)
    return _gguf_source(path)


def checksum(source: Source) -> dict[str, str]:
    """sha256 of every file the engine is built from; stored on `source` and returned."""
    if source.kind == "gguf":
        files = [source.path]
        root = source.path.parent
    else:
        root = source.path
        names = [CONFIG, GENERATION_CONFIG, SAFETENSORS_INDEX, *_TOKENIZER_FILES]
        files = [root / n for n in names if (root / n).is_file()] + safetensors_files(root)
    source.checksums = {str(p.relative_to(root)): sha256_file(p) for p in files}
    return source.checksums


def _gguf_source(path: Path, extra: dict[str, Any] | None = None) -> Source:
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise SourceError(f"{path} does not start with the GGUF magic bytes",
                              fix="the file is corrupt or not a GGUF")
    return Source("gguf", path, extra=dict(extra or {}))
