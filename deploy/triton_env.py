"""Run the tritonserver that ships inside the `nvidia-pytriton` wheel (no container, no GPU needed).

The wheel's server runs outside NVIDIA's container, on a machine without a GPU too, once it is given
what follows (installing the wheel: docs/INSTALL.md, "Triton Inference Server"); this module builds it:
- a backend dir `<dir>/python/` holding libtriton_python.so, triton_python_backend_utils.py and the
  stub built for this interpreter's Python version;
- `LD_LIBRARY_PATH=<LIBDIR of this python>:<site-packages>/nvidia_pytriton.libs`, or the stub loads the
  system libpython against pyenv's standard library;
- `PATH=<venv>/bin:$PATH`, so the stub's interpreter finds the venv's packages;
- CPU-only flags and a unique shm-region prefix, so leftover /dev/shm regions can be found;
- paths the python backend can launch its stub from: it runs `bash -c "exec <backend-dir>/python/
  triton_python_backend_stub <model-repository>/<model>/1/model.py ..."` without quoting, so a path with
  a space (or any shell character) is split, or worse, run. `shell_safe_alias` gives such a directory a
  plain symlink name (under /tmp/lookahead-kv-<uid>/), and `ServerOptions.argv` refuses unsafe paths.

    python -m deploy.triton_env exec --repo R --backend-dir B --http-port 8000 ... # becomes tritonserver
    python -m deploy.triton_env print --repo R --backend-dir B                      # shows env + argv
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import socket
import stat
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import LookaheadError


class TritonNotFound(LookaheadError):
    """The bundled tritonserver (nvidia-pytriton) is not installed in this environment."""


class UnsafePath(LookaheadError):
    """A path the python backend would pass through `bash -c` unquoted."""


# What the stub's `bash -c` command line takes as one word, unchanged (no space, quote, $, *, ...).
_SHELL_SAFE = re.compile(r"[A-Za-z0-9_./+@%=:,-]+")


def shell_safe(path: str | Path) -> bool:
    return bool(_SHELL_SAFE.fullmatch(str(path)))


def _alias_dir() -> Path:
    base = Path(tempfile.gettempdir())
    return (base if shell_safe(base) else Path("/tmp")) / f"lookahead-kv-{os.getuid()}"


def _alias_path(links: Path, target: Path) -> Path:
    return links / hashlib.sha1(str(target).encode()).hexdigest()[:16]


def remove_shell_safe_alias(directory: str | Path) -> None:
    """Remove the alias `shell_safe_alias(directory)` made, if any (once no server uses it)."""
    target = Path(os.path.abspath(directory))
    link = _alias_path(_alias_dir(), target)
    try:
        if os.path.islink(link) and os.readlink(link) == str(target):
            os.unlink(link)
    except OSError:
        pass


def shell_safe_alias(directory: str | Path) -> Path:
    """`directory` (absolute) when it is shell-safe, else a symlink to it with a shell-safe name.

    The link lives in /tmp/lookahead-kv-<uid>/ (created 0700; refused when it is not a directory of
    ours), named after a hash of the target, so the same directory always gets the same link.
    """
    target = Path(os.path.abspath(directory))
    if shell_safe(target):
        return target
    links = _alias_dir()
    try:
        links.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(links)
    except OSError as e:
        raise UnsafePath(f"{target} has characters the python backend's stub launch cannot take, and the "
                         f"directory for its alias ({links}) cannot be made: {e}") from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise UnsafePath(f"{links} (for a shell-safe alias of {target}) is not a private directory of "
                         f"this user; remove it, or use a path without spaces or shell characters")
    link = _alias_path(links, target)
    if os.path.islink(link) and os.readlink(link) == str(target):
        return link
    tmp = links / f".{link.name}.{os.getpid()}"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)                      # atomic: a stale link is replaced, never half-made
    return link


def pytriton_dirs() -> tuple[Path, Path]:
    """(<site-packages>/pytriton/tritonserver, <site-packages>/nvidia_pytriton.libs)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise TritonNotFound("tritonserver is not installed: pip install 'nvidia-pytriton==0.7.0' "
                             "(or `pip install -e '.[serve]'`)")
    site = Path(spec.origin).parent.parent
    root = site / "pytriton" / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise TritonNotFound(f"{root}/bin/tritonserver is missing: reinstall nvidia-pytriton==0.7.0")
    return root, site / "nvidia_pytriton.libs"


def tritonserver_binary() -> Path:
    return pytriton_dirs()[0] / "bin" / "tritonserver"


def make_backend_dir(dest: str | Path, python_version: str | None = None) -> Path:
    """Assemble `<dest>/python/` for this interpreter's Python; returns `dest` (--backend-directory)."""
    root, _ = pytriton_dirs()
    ver = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").iterdir())
        raise TritonNotFound(f"no python backend stub for Python {ver} in nvidia-pytriton (has: {', '.join(have)})")
    out = Path(dest) / "python"
    out.mkdir(parents=True, exist_ok=True)
    backend = root / "backends" / "python"
    for src in (backend / "libtriton_python.so", backend / "triton_python_backend_utils.py", stub):
        _copy_if_changed(src, out / src.name)
    return Path(dest)


def _copy_if_changed(src: Path, dst: Path) -> None:
    # Copies, not symlinks: the stub and library resolve their own dependencies via LD_LIBRARY_PATH.
    s = src.stat()
    if dst.is_file() and dst.stat().st_size == s.st_size and dst.stat().st_mtime >= s.st_mtime:
        return
    shutil.copy2(src, dst)


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment tritonserver (and so the python stub) must run with."""
    env = dict(os.environ if base is None else base)
    _, libs = pytriton_dirs()
    libdir = sysconfig.get_config_var("LIBDIR")
    ld = [p for p in (libdir, str(libs), env.get("LD_LIBRARY_PATH", "")) if p]
    env["LD_LIBRARY_PATH"] = ":".join(ld)
    env["PATH"] = os.pathsep.join([str(Path(sys.prefix) / "bin"), env.get("PATH", "")])
    return env


@dataclass
class ServerOptions:
    model_repository: Path
    backend_dir: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    shm_prefix: str = "lookahead_"
    host: str = "127.0.0.1"
    # A ceiling, not a wait: tritonserver exits once the model has unloaded, 2.7-2.8 s after TERM on
    # the 2-core VM, loaded or not. Before model.py froze its startup objects a loaded VM took
    # 4.6-4.8 s, a hair under the old 5 s, past which the server exits 1 ("Exit timeout expired").
    exit_timeout_s: int = 15
    log_verbose: int = 0

    def shell_safe(self) -> "ServerOptions":
        """A copy whose model repository and backend dir are shell-safe (aliased when needed)."""
        from dataclasses import replace
        return replace(self, model_repository=shell_safe_alias(self.model_repository),
                       backend_dir=shell_safe_alias(self.backend_dir))

    def argv(self) -> list[str]:
        for what, value in (("model repository", self.model_repository), ("backend dir", self.backend_dir)):
            if not shell_safe(value):
                raise UnsafePath(f"the {what} {str(value)!r} has a space or shell character, which the python "
                                 f"backend's stub launch splits; use ServerOptions.shell_safe() (a symlink alias)")
        if not re.fullmatch(r"[A-Za-z0-9_]+", self.shm_prefix):
            raise UnsafePath(f"shm prefix {self.shm_prefix!r}: use letters, digits and _ only")
        return [
            str(tritonserver_binary()),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={self.backend_dir}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false",
            "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0",
            f"--exit-timeout-secs={self.exit_timeout_s}", "--strict-readiness=true",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--log-verbose={self.log_verbose}",
        ]


def shm_regions(prefix: str) -> list[Path]:
    """Shared-memory regions the python backend created under `prefix` (none once it stopped cleanly)."""
    shm = Path("/dev/shm")
    return sorted(shm.glob(prefix + "*")) if shm.is_dir() else []


def remove_shm_regions(prefix: str) -> list[Path]:
    """Remove the regions under `prefix` (left by a server or stub that died); returns those removed."""
    if not prefix or not re.fullmatch(r"[A-Za-z0-9_]+", prefix):
        raise ValueError(f"refusing to remove /dev/shm/{prefix}*: not a prefix this project makes")
    removed = []
    for region in shm_regions(prefix):
        try:
            region.unlink()
            removed.append(region)
        except FileNotFoundError:
            pass
    return removed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deploy.triton_env", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["exec", "print"], help="exec: become tritonserver; print: show it")
    p.add_argument("--repo", required=True, help="model repository")
    p.add_argument("--backend-dir", required=True, help="built here when missing")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--shm-prefix", default=f"lookahead_{os.getpid()}_")
    p.add_argument("--log-verbose", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        backend = make_backend_dir(args.backend_dir)
        # abspath, not resolve: a shell-safe alias (a symlink) must stay what the stub launch sees
        opts = ServerOptions(Path(os.path.abspath(args.repo)), Path(os.path.abspath(backend)), args.http_port,
                             args.grpc_port, args.metrics_port, args.shm_prefix,
                             log_verbose=args.log_verbose).shell_safe()
        cmd, env = opts.argv(), server_env()
    except LookaheadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.action == "print":
        print(f"LD_LIBRARY_PATH={shlex.quote(env['LD_LIBRARY_PATH'])}")
        print(f"PATH={shlex.quote(env['PATH'])}")
        print(shlex.join(cmd))
        return 0
    sys.stdout.flush()
    os.execve(cmd[0], cmd, env)          # same PID: a PID file written by the caller names the server


if __name__ == "__main__":
    sys.exit(main())


def free_ports(n: int) -> list[int]:
    """n distinct ports the kernel calls free on 127.0.0.1 right now (held together, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
