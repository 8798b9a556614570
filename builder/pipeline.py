"""`build(BuildConfig) -> BuildResult`: checkpoint -> verified engine dir, in six timed stages.

    resolve source -> load -> convert -> write -> verify -> checksum

Everything is written into a temp dir next to the output, which replaces the output only after the
manifest (engine.yaml, written last, checksums every other file) is in place.
"""
from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors.torch import save_file

from runtime.config import LookaheadConfig, ModelConfig
from runtime.engine_dir import REPORT, TOKENIZER_DIR, WEIGHTS, write_manifest

from .checkpoint import CONFIG, GENERATION_CONFIG, read_json, read_tensors
from .config import BuildConfig
from .convert import convert
from .gguf_cache import cached_hf_dir
from .hf_config import model_config_from_hf
from .output import staged_output
from .sources import Source, checksum, resolve_source
from .tokenizer import save_tokenizer
from .verify import verify

Log = Callable[[str], None]


@dataclass
class BuildResult:
    """What a build produced: the engine dir and its build report (also in build_report.json)."""

    path: Path
    report: dict[str, Any]


def build(config: BuildConfig, *, log: Log | None = None) -> BuildResult:
    """Build the engine dir `config.output` from `config.model`.

    Parameters
    ----------
    config : the build's options.
    log : receives one line per stage with its elapsed seconds (default: print to stdout).

    Raises
    ------
    BuildError
        Any problem a user can cause or fix (see builder.errors); the output is left untouched.
    """
    log = log or _print
    stages = _Stages(log)
    with staged_output(config.output, config.force) as tmp:
        with stages("resolve source") as note:
            source = resolve_source(config.model, log)
            note(f"{source.kind} {source.path}")
        with stages("load") as note:
            model_cfg, tensors, where = _load(source, log)
            note(f"{model_cfg.architecture}, {model_cfg.num_layers} layers, {len(tensors)} tensors")
        with stages("convert") as note:
            weights = convert(tensors, model_cfg, getattr(torch, config.dtype), where)
            del tensors
            note(f"{sum(w.numel() for w in weights.values()) / 1e6:.1f}M parameters, {config.dtype}")
        with stages("write") as note:
            save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
            del weights
            tokenizer = save_tokenizer(source.hf_dir, tmp / TOKENIZER_DIR, model_cfg.vocab_size, where)
            note(f"{WEIGHTS}, {TOKENIZER_DIR}/ ({tokenizer['num_tokens']} tokens)")
            if "warning" in tokenizer:
                log(f"warning: {tokenizer['warning']}")
        with stages("verify") as note:
            verification = verify(source.hf_dir, tmp, model_cfg, config.dtype) if config.verify else {"skipped": True}
            note(_verify_summary(verification))
        with stages("checksum"):
            report = _report(config, source, tokenizer, verification, stages.seconds)
            (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
            write_manifest(tmp, name=config.name, model=model_cfg, dtype=config.dtype,
                           lookahead=LookaheadConfig(max_model_len=model_cfg.max_position_embeddings),
                           source=source.to_manifest(), versions=versions())
    log(f"built {config.output} in {sum(stages.seconds.values()):.1f}s")
    return BuildResult(path=Path(config.output), report=report)


def _load(source: Source, log: Log) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """Validate the config first (cheap, and the most common refusal), then read the weights."""
    where = str(source.path)
    if source.kind == "gguf":
        sha = checksum(source)[source.path.name]
        source.hf_dir = cached_hf_dir(source.path, sha, log)
    cfg = read_json(source.hf_dir / CONFIG)
    generation = read_json(source.hf_dir / GENERATION_CONFIG, required=False)
    config_where = str(source.hf_dir / CONFIG) if source.kind == "hf_dir" else where
    model_cfg = model_config_from_hf(cfg, generation, where=config_where)
    if source.kind == "hf_dir":
        checksum(source)
    return model_cfg, read_tensors(source.hf_dir), where


def _verify_summary(v: dict[str, Any]) -> str:
    if v.get("skipped"):
        return "skipped (--no-verify)"
    return (f"max |Δlogit| {v['max_abs_logit_diff']:.2e}, argmax agreement {v['argmax_agreement']:.1%}, "
            f"greedy {'match' if v['greedy_match'] else 'differ'}")


def _report(config: BuildConfig, source: Source, tokenizer: dict[str, Any], verification: dict[str, Any],
            seconds: dict[str, float]) -> dict[str, Any]:
    return {
        "name": config.name,
        "dtype": config.dtype,
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": source.to_manifest(),
        "tokenizer": tokenizer,
        "verification": verification,
        "stage_seconds": {k: round(v, 3) for k, v in seconds.items()},
        "versions": versions(),
    }


def versions() -> dict[str, str]:
    """Versions of everything that shaped the engine's bytes, for engine.yaml."""
    out = {"lookahead-kv": _version("lookahead-kv"), "python": platform.python_version()}
    for pkg in ("torch", "transformers", "safetensors"):
        out[pkg] = _version(pkg)
    return out


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return _source_tree_version() if dist == "lookahead-kv" else "not installed"


def _source_tree_version() -> str:
    """When run from a checkout that is not pip-installed, read pyproject.toml's version."""
    import tomllib

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        return tomllib.loads(pyproject.read_text())["project"]["version"] + "+source"
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


class _Stages:
    """Times named stages and logs one line per stage: `[3/6] convert   1.2s  detail`."""

    NAMES = ("resolve source", "load", "convert", "write", "verify", "checksum")

    def __init__(self, log: Log):
        self.log, self.seconds = log, {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[Callable[[str], None]]:
        detail: list[str] = []
        t0 = time.perf_counter()
        yield detail.append
        self.seconds[name] = time.perf_counter() - t0
        n = self.NAMES.index(name) + 1
        self.log(f"[{n}/{len(self.NAMES)}] {name:<15}{self.seconds[name]:7.1f}s  {' '.join(detail)}".rstrip())


def _print(line: str) -> None:
    print(line, flush=True)
