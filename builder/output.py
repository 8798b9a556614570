"""Write the engine dir atomically: build in a temp dir next to the output, rename at the end.

A failed or interrupted build leaves no engine dir (at most a hidden `.NAME.building-*` dir after a
kill -9), and `--force` never leaves the output missing or half-replaced on failure.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from runtime.engine_dir import MANIFEST

from .errors import OutputError


def check_output(output: Path, force: bool) -> None:
    """Refuse an output that exists (without force), is not an engine dir, or cannot be created."""
    if output.exists() or output.is_symlink():
        if not force:
            raise OutputError("already exists", field="output", value=output,
                              fix="pass --force to replace it, or choose another --output")
        if not output.is_dir():
            raise OutputError("exists and is not a directory", field="output", value=output,
                              fix="remove it or choose another --output")
        if any(output.iterdir()) and not (output / MANIFEST).is_file():
            # --force replaces engine dirs only: a typo must not wipe an unrelated directory.
            raise OutputError(f"is not an engine dir (no {MANIFEST}); refusing to replace it even with --force",
                              field="output", value=output, fix="choose another --output")
    ancestor = output.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"cannot be created: {ancestor} is not a directory", field="output", value=output,
                          fix="choose an --output under a directory")


@contextlib.contextmanager
def staged_output(output: Path, force: bool) -> Iterator[Path]:
    """Yield an empty temp dir; on normal exit it becomes `output`, on error it is removed."""
    output = output.absolute()
    check_output(output, force)
    created = _make_parents(output)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.building-", dir=output.parent))
    except OSError as e:
        _remove_dirs(created)
        raise OutputError(f"cannot be written ({e.strerror})", field="output", value=output,
                          fix="choose a writable location") from None
    try:
        yield tmp
        if output.exists() and not force:   # it appeared while we were building: still never clobber
            raise OutputError("was created by something else during the build", field="output", value=output,
                              fix="pass --force to replace it, or choose another --output")
        _replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(created)
        raise


def _make_parents(output: Path) -> list[Path]:
    """mkdir -p of the parent of `output`, returning the dirs it created (deepest last) for undo."""
    missing = []
    p = output.parent
    while not p.exists():
        missing.append(p)
        p = p.parent
    try:
        for d in reversed(missing):
            d.mkdir()
    except OSError as e:
        _remove_dirs(missing[::-1])
        raise OutputError(f"cannot be created ({e.strerror}: {e.filename})", field="output",
                          value=output, fix="choose a writable location") from None
    return missing[::-1]


def _remove_dirs(dirs: list[Path]) -> None:
    for d in reversed(dirs):   # deepest first; rmdir only succeeds on what is still empty
        with contextlib.suppress(OSError):
            d.rmdir()


def _normal_permissions(root: Path) -> None:
    """mkdtemp makes 0700 dirs (and safetensors 0600 files): give the engine dir the modes a plain
    mkdir/open would, so a server running as another user can read it."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [root, *root.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def _replace(tmp: Path, output: Path) -> None:
    _normal_permissions(tmp)
    if not output.exists():
        os.replace(tmp, output)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
    os.replace(output, old / "engine")      # rename(2) cannot replace a non-empty dir: move it aside
    try:
        os.replace(tmp, output)
    except OSError:
        os.replace(old / "engine", output)  # put the previous engine back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
