"""Import an entry point (scripts/*.py, experiments/*.py) as a module, by its path.

scripts/ is never put on sys.path: its files' names would shadow installed modules for the whole
test session. Each file is loaded once, as `script_<stem>` (e.g. `script_bench_decode`).
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str) -> types.ModuleType:
    """`load_script("scripts/bench_decode.py")`: the module, registered in sys.modules (dataclasses need it)."""
    path = ROOT / relpath
    name = f"script_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
