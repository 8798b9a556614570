"""A real tritonserver for tests: tiny engine, free ephemeral ports, a unique /dev/shm prefix.

    from triton_fixtures import triton_server  # noqa: F401  (a session fixture)

`ServeSh` runs `scripts/serve.sh` (the supervisor, the HTTP front) on its own run dir and free ports,
and `ServeSh.cleanup()` ends whatever that run left (processes of its shm prefix, its regions).

Skips (with the reason) where the bundled tritonserver (nvidia-pytriton) or tritonclient is missing.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from deploy.triton_env import free_ports
from tiny_engine import make_tiny_engine

READY_TIMEOUT_S = 120
SERVE_SH = Path(__file__).resolve().parents[1] / "scripts" / "serve.sh"


@dataclass
class TritonServer:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    shm_prefix: str
    log_path: Path
    engine_dir: Path
    stray_stubs: list[int] = field(default_factory=list)     # what stop() had to kill / remove after
    stray_regions: list[Path] = field(default_factory=list)  # the server was gone (a clean exit: none)
    stopped: bool = False                                    # stop() ran (idempotent)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def metrics(self) -> dict[str, float]:
        return read_metrics(self.metrics_port)

    def log_tail(self, n: int = 40) -> str:
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if not ln.startswith(("|", "+"))]
        return "\n".join(lines[-n:])

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit status (idempotent). Whatever way the server ends, its
        Python-backend stubs and /dev/shm regions end with it: a server SIGKILLed here (or one that
        died) leaves its stubs behind, reparented to init, holding their regions."""
        from deploy.supervisor import clean_run
        try:
            if self.proc.poll() is not None and not self.stopped:
                # it ended before anyone stopped it: say how, with its log's tail, in the test's
                # output (the log itself lies under pytest's basetemp, which later runs rotate away)
                print(f"tritonserver (pid {self.proc.pid}) had exited with {self.proc.returncode} before stop():\n"
                      f"{self.log_tail()}", file=sys.stderr)
            self.stopped = True
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                    raise AssertionError(f"tritonserver ignored SIGTERM for {timeout} s:\n{self.log_tail()}")
            return self.proc.returncode
        finally:
            self.stray_stubs, self.stray_regions = clean_run(self.shm_prefix)



def read_metrics(port: int) -> dict[str, float]:
    """Our lookahead_* families from a metrics endpoint, by name (one instance)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(lookahead_\w+)\{[^}]*\} (\S+)$", text, re.M)}


def _ready(url: str) -> bool:
    try:
        return urllib.request.urlopen(url + "/v2/health/ready", timeout=2).status == 200
    except OSError:
        return False


def start_server(workdir: Path, engine_dir: Path, backend_dir: Path, **lookahead_overrides) -> TritonServer:
    """Write a model repository for `engine_dir` and start tritonserver on it; waits until ready."""
    from serving.config_template import write_model_repo
    from deploy.triton_env import ServerOptions, server_env

    repo = write_model_repo(workdir / "model_repo", engine_dir, lookahead_overrides=lookahead_overrides)
    http, grpc, metrics = free_ports(3)
    prefix = f"lkvtest_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
    opts = ServerOptions(repo, backend_dir, http, grpc, metrics, shm_prefix=prefix).shell_safe()
    log_path = workdir / "tritonserver.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(opts.argv(), env=server_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    server = TritonServer(proc, http, grpc, metrics, prefix, log_path, Path(engine_dir))
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not _ready(server.http_url):
        if proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with {proc.returncode} during start-up:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"tritonserver not ready after {READY_TIMEOUT_S} s:\n{server.log_tail()}")
        time.sleep(0.25)
    return server


@pytest.fixture(scope="session")
def triton_backend_dir(tmp_path_factory) -> Path:
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed (pip install -e '.[serve]')")
    from deploy.triton_env import TritonNotFound, make_backend_dir
    try:
        return make_backend_dir(tmp_path_factory.mktemp("triton_backends"))
    except TritonNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def triton_engine_dir(tmp_path_factory) -> Path:
    return make_tiny_engine(tmp_path_factory.mktemp("triton_tiny"), seed=11)


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory, triton_engine_dir, triton_backend_dir):
    server = start_server(tmp_path_factory.mktemp("triton"), triton_engine_dir, triton_backend_dir)
    yield server
    server.stop()                    # also ends whatever a failed test left: stubs of this prefix, its regions


@dataclass
class ServeSh:
    """One `scripts/serve.sh` run dir on free ports; every call is bounded by a timeout."""
    run_dir: Path
    engine_dir: Path
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0

    def __post_init__(self):
        if not self.http_port:
            self.http_port, self.grpc_port, self.metrics_port = free_ports(3)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def shm_prefix(self) -> str:
        from deploy.supervisor import shm_prefix_for
        return shm_prefix_for(self.run_dir)

    def sh(self, action: str, *args: str, timeout: float = 120, env: dict | None = None,
           check: bool = False) -> subprocess.CompletedProcess:
        cmd = ["bash", str(SERVE_SH), action, "--run-dir", str(self.run_dir), *args]
        if action in ("start", "restart"):
            cmd += ["--engine", str(self.engine_dir), "--http-port", str(self.http_port),
                    "--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                           env={**os.environ, **(env or {})})
        if check and r.returncode != 0:
            raise AssertionError(f"serve.sh {action} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
        return r

    def metrics(self) -> dict[str, float]:
        return read_metrics(self.metrics_port)

    def state(self) -> dict[str, str]:
        from deploy.supervisor import RunFiles
        return RunFiles(self.run_dir).read_state()

    def server_pid(self) -> int:
        return int((self.run_dir / "tritonserver.pid").read_text())

    def stub_pids(self) -> list[int]:
        from deploy.supervisor import live_stubs
        return live_stubs(self.server_pid())

    def run_processes(self) -> list[int]:
        """Live processes of this run: its supervisor, tritonserver and stubs (by their command lines)."""
        from deploy.supervisor import all_pids, pid_alive, proc_cmdline
        mine = []
        for pid in all_pids():
            argv = proc_cmdline(pid)
            if pid != os.getpid() and pid_alive(pid) and (
                    any(a.startswith(self.shm_prefix) or a.endswith("=" + self.shm_prefix) for a in argv)
                    or ("deploy.supervisor" in argv and str(self.run_dir) in argv)):
                mine.append(pid)
        return mine

    def cleanup(self) -> None:
        """Stop the run (serve.sh stop), then SIGKILL anything of it still there; remove its regions."""
        from deploy.supervisor import clean_run
        try:
            self.sh("stop", timeout=60)
        finally:
            for pid in self.run_processes():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            clean_run(self.shm_prefix)
