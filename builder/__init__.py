"""Lookahead-KV builder: a Hugging Face dir, a GGUF file or the default model -> a verified engine dir.

    from builder import build, BuildConfig
    result = build(BuildConfig(model="default", output="engines/default"))

The command line is `python scripts/build_engine.py --help` (derived from `BuildConfig`).
"""
from .pipeline import build
from .result import BuildResult
from .config import BuildConfig
from .errors import BuildError, OutputError, SourceError, VerifyError

__all__ = ["build", "BuildConfig", "BuildResult", "BuildError", "SourceError", "OutputError", "VerifyError"]
