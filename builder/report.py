"""build_report.json and the `versions` section of engine.yaml."""
from __future__ import annotations

import datetime
import importlib.metadata
import platform
from pathlib import Path
from typing import Any

from .config import BuildConfig
from .sources import Source


def build_report(config: BuildConfig, source: Source, tokenizer: dict[str, Any],
                 verification: dict[str, Any], seconds: dict[str, float],
                 quantization: dict[str, Any] | None = None) -> dict[str, Any]:
    """What was built from what, what verification measured, and how long each stage took.
    quantization: the engine.yaml section of an int8 build (its verification is `verification`)."""
    report = {
        "name": config.name,
        "dtype": config.dtype,
        "built_at": _now(),
        "source": source.to_manifest(),
        "tokenizer": tokenizer,
        "verification": verification,
        "stage_seconds": {k: round(v, 3) for k, v in seconds.items()},
        "versions": versions(),
    }
    if quantization is not None:
        report["quantization"] = quantization
    return report


def build_report_random(config: BuildConfig, recipe: dict[str, Any], tokenizer: dict[str, Any],
                        seconds: dict[str, float]) -> dict[str, Any]:
    """The report of a --random-weights build: the recipe, and that nothing was verified."""
    return {
        "name": config.name,
        "dtype": config.dtype,
        "built_at": _now(),
        "source": {"kind": "random", "shape": config.random_weights, "seed": config.seed},
        "random_weights": recipe,
        "tokenizer": tokenizer,
        "verification": {"skipped": True, "reason": "random weights: no source model to verify against"},
        "stage_seconds": {k: round(v, 3) for k, v in seconds.items()},
        "versions": versions(),
    }


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, str]:
    """Versions of everything that shaped the engine's bytes."""
    out = {"lookahead-kv": _version("lookahead-kv"), "python": platform.python_version()}
    for dist in ("torch", "transformers", "safetensors"):
        out[dist] = _version(dist)
    return out


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return _source_tree_version() if dist == "lookahead-kv" else "not installed"


def _source_tree_version() -> str:
    """Run from a checkout that is not pip-installed: pyproject.toml's version, marked as such."""
    try:
        import tomllib  # Python >= 3.11

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"] + "+source"
    except (ImportError, OSError, KeyError, ValueError):
        return "unknown"
