"""One served run dir: tritonserver behind the HTTP front, cleaned up after any death, restarted on --watch.

`scripts/serve.sh` drives this module; it is the process `serve.sh start` leaves running:

    python -m deploy.supervisor run --run-dir R --http-port 8000 --grpc-port 8001 \\
        --metrics-port 8002 [--watch] [--instances N] [--max-body-bytes B] [--timeout S]
    python -m deploy.supervisor stop --run-dir R      # seconds, even with a dead stub
    python -m deploy.supervisor status --run-dir R    # 0 serving, 1 running but not serving, 3 not running

`run` expects R/model_repo (written by `serving.config_template`). It

- binds the public HTTP port with `deploy.http_front` (body-size cap, JSON check; /generate* over
  tritonserver's gRPC port, so a disconnect cancels) and the public gRPC port with `deploy.grpc_guard`
  (tensor checks, no `triton_grpc_error` upstream, serving methods only), and starts tritonserver on
  internal loopback HTTP and gRPC ports; metrics is tritonserver's own port;
- keeps each run's log: R/tritonserver.log is rotated to .1 ... .5 before every server start;
- names the python backend's /dev/shm regions with a prefix unique to R (`lkv_<hash of R>_`), so after
  any death (SIGKILL of the server or of its stub included) its regions and stray
  `triton_python_backend_stub` processes, and only those of this run, are found and removed;
- watches the server and its stubs. tritonserver 2.51 keeps answering ready after its stub died, and
  every request then fails ("Stub process ... is not healthy") or hangs. Without --watch a dead server
  ends the supervisor (after the clean-up) and a dead stub is reported by `status`; with --watch either
  restarts the server, as does a liveness probe (one real one-token request) that fails twice in a row
  (three times when it only timed out). Restarting kills the old server, so requests in flight end with
  an error (gRPC UNAVAILABLE, HTTP connection closed) instead of hanging;
- fails a start fast, with the reason: the server exiting, or no python stub alive for 15 s while the
  model loads (a stub that cannot be launched leaves 2.51 waiting forever).

Files in R: supervisor.pid, tritonserver.pid (the current server: load_test.py --server-pid-file reads
it), tritonserver.env (ports, state, restarts), tritonserver.log*, supervisor.log*.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import LookaheadError
from .grpc_guard import Guard
from .http_front import DEFAULT_MAX_BODY_BYTES, Front
from .probe import ProbeResult, probe, probe_async
from runtime.threads import prepare_threads
from .triton_env import ServerOptions, make_backend_dir, remove_shell_safe_alias, remove_shm_regions, \
    server_env

log = logging.getLogger("lookahead.supervisor")

STUB_NAME = "triton_python_backend_stub"
STUB_COMM = STUB_NAME[:15]                 # /proc/<pid>/stat truncates the command name to 15 bytes
LOG_KEEP = 5
# No live stub for this long while the model loads: the start failed (LOOKAHEAD_STUB_GRACE_S overrides).
STUB_GRACE_S = float(os.environ.get("LOOKAHEAD_STUB_GRACE_S", "15"))
DEAD_STUB_TERM_GRACE_S = 2.0               # a server whose stub died never finishes its unload: don't wait
RESTART_BACKOFF_S = (1, 2, 5, 10, 30)      # after the last one fails too, the supervisor gives up
MONITOR_EVERY_S = 0.5


def shm_prefix_for(run_dir: str | Path) -> str:
    """The python backend's shm-region prefix for a run dir: stable, unique to it, shell-safe."""
    return "lkv_" + hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:10] + "_"


@dataclass
class RunFiles:
    run_dir: Path

    def __post_init__(self):
        self.run_dir = Path(os.path.abspath(self.run_dir))

    @property
    def supervisor_pid(self) -> Path:
        return self.run_dir / "supervisor.pid"

    @property
    def server_pid(self) -> Path:
        return self.run_dir / "tritonserver.pid"

    @property
    def state(self) -> Path:
        return self.run_dir / "tritonserver.env"

    @property
    def server_log(self) -> Path:
        return self.run_dir / "tritonserver.log"

    @property
    def supervisor_log(self) -> Path:
        return self.run_dir / "supervisor.log"

    @property
    def model_repo(self) -> Path:
        return self.run_dir / "model_repo"

    @property
    def backends(self) -> Path:
        return self.run_dir / "backends"

    def read_state(self) -> dict[str, str]:
        try:
            lines = self.state.read_text().splitlines()
        except OSError:
            return {}
        return dict(line.split("=", 1) for line in lines if "=" in line)

    def write_state(self, values: dict[str, str]) -> None:
        _write_atomic(self.state, "".join(f"{k}={v}\n" for k, v in values.items()))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def rotate_log(path: Path, keep: int = LOG_KEEP) -> None:
    """path -> path.1 -> ... -> path.<keep> (the oldest dropped); nothing to do for a missing or empty log."""
    try:
        if path.stat().st_size == 0:
            return
    except FileNotFoundError:
        return
    for i in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
    os.replace(path, path.with_name(f"{path.name}.1"))


# -- processes (Linux /proc) ---------------------------------------------------------------------
@dataclass
class ProcInfo:
    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")


def proc_info(pid: int) -> ProcInfo | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return ProcInfo(pid, comm, fields[0], int(fields[1]), int(fields[2]))


def proc_cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def pid_alive(pid: int) -> bool:
    info = proc_info(pid)
    return info is not None and info.alive


def live_stubs(server_pid: int) -> list[int]:
    """The server's python-stub children that are alive (a killed stub stays a zombie until reaped)."""
    out = []
    for pid in all_pids():
        info = proc_info(pid)
        if info and info.ppid == server_pid and info.comm == STUB_COMM and info.alive:
            out.append(pid)
    return out


def stubs_of_run(prefix: str) -> list[int]:
    """Every live python stub whose shm region carries `prefix` (this run's), wherever its parent went."""
    out = []
    for pid in all_pids():
        argv = proc_cmdline(pid)
        if argv and os.path.basename(argv[0]) == STUB_NAME and any(a.startswith(prefix) for a in argv[1:]):
            if pid_alive(pid):
                out.append(pid)
    return out


def is_our_server(pid: int, prefix: str) -> bool:
    argv = proc_cmdline(pid)
    return bool(argv) and os.path.basename(argv[0]) == "tritonserver" and \
        f"--backend-config=python,shm-region-prefix-name={prefix}" in argv and pid_alive(pid)


def is_our_supervisor(pid: int, run_dir: Path) -> bool:
    argv = proc_cmdline(pid)
    if "deploy.supervisor" not in argv or "run" not in argv or "--run-dir" not in argv[:-1]:
        return False
    return os.path.abspath(argv[argv.index("--run-dir") + 1]) == os.path.abspath(run_dir) and pid_alive(pid)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if pid_alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def kill_stray_stubs(prefix: str) -> list[int]:
    """SIGKILL this run's stubs (orphans of a dead server, or a hung one ignoring SIGTERM)."""
    pids = stubs_of_run(prefix)
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    wait_gone(pids, 5.0)
    return pids


def clean_run(prefix: str) -> tuple[list[int], list[Path]]:
    """After a server is gone: kill this run's stray stubs, then remove its shm regions."""
    stubs = kill_stray_stubs(prefix)
    return stubs, remove_shm_regions(prefix)


def free_port(host: str = "127.0.0.1", avoid: tuple[int, ...] = ()) -> int:
    """A port the kernel calls free now, not one of `avoid` (the run's other ports, free while a
    server restarts: the kernel may hand one of them out)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port
    raise OSError(f"no free port on {host} outside {avoid}")


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


# -- the supervisor ----------------------------------------------------------------------------
@dataclass
class Settings:
    run_dir: Path
    http_port: int
    grpc_port: int
    metrics_port: int
    instances: int = 1
    watch: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    timeout_s: float = 180.0
    probe_interval_s: float = 10.0
    probe_timeout_s: float = 30.0
    info: dict[str, str] = field(default_factory=dict)     # shown in the state file (engine, mode)


class StartFailed(Exception):
    pass


class Supervisor:
    def __init__(self, settings: Settings):
        self.s = settings
        self.files = RunFiles(settings.run_dir)
        self.prefix = shm_prefix_for(self.files.run_dir)
        self.front = Front("127.0.0.1", settings.http_port, "127.0.0.1", 0, max_body_bytes=settings.max_body_bytes)
        self.guard = Guard("127.0.0.1", settings.grpc_port)
        self.proc: subprocess.Popen | None = None
        self.upstream_port = 0
        self.upstream_grpc_port = 0
        self.state = "starting"
        self.restarts = 0
        self.last_death = ""
        self.stop_requested = asyncio.Event()
        self._stub_dead_reported = False

    # state file
    def _publish(self, state: str | None = None) -> None:
        if state:
            self.state = state
        values = {"STATE": self.state, "SUPERVISOR_PID": str(os.getpid()),
                  "PID": str(self.proc.pid if self.proc else ""),
                  "HTTP_PORT": str(self.s.http_port), "GRPC_PORT": str(self.s.grpc_port),
                  "METRICS_PORT": str(self.s.metrics_port), "UPSTREAM_HTTP_PORT": str(self.upstream_port),
                  "UPSTREAM_GRPC_PORT": str(self.upstream_grpc_port),
                  "WATCH": "1" if self.s.watch else "0", "MAX_BODY_BYTES": str(self.s.max_body_bytes),
                  "SHM_PREFIX": self.prefix, "RESTARTS": str(self.restarts), "LAST_DEATH": self.last_death,
                  **{k.upper(): v for k, v in self.s.info.items()}}
        self.files.write_state(values)

    def _options(self) -> ServerOptions:
        backend = make_backend_dir(self.files.backends)
        return ServerOptions(self.files.model_repo, backend, self.upstream_port, self.upstream_grpc_port,
                             self.s.metrics_port, shm_prefix=self.prefix).shell_safe()

    # one server
    def _spawn(self) -> None:
        rotate_log(self.files.server_log)
        public = (self.s.http_port, self.s.grpc_port, self.s.metrics_port)
        self.upstream_port = free_port(avoid=public)
        self.upstream_grpc_port = free_port(avoid=public + (self.upstream_port,))
        argv = self._options().argv()
        env = server_env()
        prepare_threads(env)                # tritonserver's python stub loads torch: it starts with them
        with open(self.files.server_log, "ab") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        _write_atomic(self.files.server_pid, f"{self.proc.pid}\n")
        self.front.upstream = ("127.0.0.1", self.upstream_port)
        self.guard.upstream = ("127.0.0.1", self.upstream_grpc_port)
        self.front.grpc_upstream = ("127.0.0.1", self.upstream_grpc_port)    # /generate*: cancellable over gRPC
        self._stub_dead_reported = False
        log.info("started tritonserver pid %d (internal HTTP port %d, gRPC port %d); log %s", self.proc.pid,
                 self.upstream_port, self.upstream_grpc_port, self.files.server_log)

    async def _wait_ready(self) -> None:
        """Until the server answers ready and a probe generates a token; StartFailed with the reason."""
        t0 = time.monotonic()
        deadline = t0 + self.s.timeout_s
        stub_seen = t0
        url = f"http://127.0.0.1:{self.upstream_port}"
        while True:
            if self.stop_requested.is_set():
                raise StartFailed("stop requested during start-up")
            rc = self.proc.poll()
            if rc is not None:
                raise StartFailed(f"tritonserver exited with {_describe_rc(rc)} during start-up")
            now = time.monotonic()
            if live_stubs(self.proc.pid):
                stub_seen = now
            elif now - stub_seen > STUB_GRACE_S:
                raise StartFailed(f"no python backend stub has been alive for {STUB_GRACE_S:.0f} s while the "
                                  f"model loads: its launch failed (see the log)")
            if now > deadline:
                raise StartFailed(f"not ready after {self.s.timeout_s:.0f} s")
            if await asyncio.to_thread(_http_ok, url + "/v2/health/ready"):
                result = await self._probe()
                if result is None:
                    continue                                  # stop requested: raised above
                if result.ok:
                    log.info("ready after %.1f s (probe: %s)", now - t0, result.detail)
                    return
                log.warning("ready, but the probe failed: %s", result)
                await asyncio.sleep(1.0)
            await asyncio.sleep(0.25)

    async def _probe(self) -> ProbeResult | None:
        """One probe of the internal port; None when a stop was requested meanwhile (it is cancelled)."""
        task = asyncio.ensure_future(probe_async("127.0.0.1", self.upstream_port, self.s.probe_timeout_s))
        stop = asyncio.ensure_future(self.stop_requested.wait())
        done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if task in done:
            return task.result()
        task.cancel()
        return None

    async def _kill_server(self, reason: str, grace: float | None = None) -> None:
        """TERM (a short grace when the stub is dead), then SIGKILL the server's process group."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            if grace is None:
                stub_alive = bool(live_stubs(proc.pid))
                grace = ServerOptions.exit_timeout_s + 5.0 if stub_alive else DEAD_STUB_TERM_GRACE_S
            log.info("stopping tritonserver pid %d (%s; waiting at most %.0f s)", proc.pid, reason, grace)
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), grace)
            except asyncio.TimeoutError:
                log.warning("tritonserver pid %d still running after %.0f s: SIGKILL", proc.pid, grace)
        # the server's own group (it is a session leader): its stubs, still running or not
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        await asyncio.to_thread(proc.wait)
        stubs, regions = await asyncio.to_thread(clean_run, self.prefix)
        if stubs or regions:
            log.info("cleaned up after pid %d: killed stubs %s, removed %d shm region(s)", proc.pid, stubs,
                     len(regions))

    # the whole run
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_requested.set)
        _write_atomic(self.files.supervisor_pid, f"{os.getpid()}\n")
        self._publish("starting")
        try:
            await self.front.start()
        except OSError as e:
            return self._cannot_listen(f"cannot listen on 127.0.0.1:{self.s.http_port}: {e.strerror or e}")
        try:
            await self.guard.start()
        except (OSError, RuntimeError) as e:
            self.front.close()
            return self._cannot_listen(f"cannot listen on 127.0.0.1:{self.s.grpc_port} (gRPC): {e}")
        stubs, regions = clean_run(self.prefix)
        if stubs or regions:
            log.warning("removed what an earlier run of %s left: stubs %s, %d shm region(s)", self.files.run_dir,
                        stubs, len(regions))
        front_task = asyncio.create_task(self.front.serve())
        rc = 0
        try:
            try:
                self._spawn()
            except (LookaheadError, OSError) as e:
                raise StartFailed(f"cannot start tritonserver: {e}") from e
            self._publish("starting")
            await self._wait_ready()
            self._publish("ready")
            rc = await self._monitor()
        except StartFailed as e:
            self.last_death = str(e)
            log.error("start failed: %s", e)
            rc = 0 if self.stop_requested.is_set() else 1
            self._publish("failed" if rc else "stopping")
        finally:
            if self.state not in ("failed", "dead"):
                self._publish("stopping")
            # New connections are refused at once; those open see the server's graceful stop.
            if self.front.server is not None:
                self.front.server.close()
            await self._kill_server("stop" if self.stop_requested.is_set() else "shutdown")
            self.front.close()
            await self.guard.stop()
            front_task.cancel()
            self._publish(self.state if self.state in ("failed", "dead") else "stopped")
            for directory in (self.files.model_repo, self.files.backends):
                remove_shell_safe_alias(directory)
            for pid_file in (self.files.server_pid, self.files.supervisor_pid):
                pid_file.unlink(missing_ok=True)
            log.info("supervisor exits (%s)", self.state)
        return rc

    def _cannot_listen(self, why: str) -> int:
        self.last_death = why
        log.error("%s", why)
        self._publish("failed")
        self.files.supervisor_pid.unlink(missing_ok=True)
        return 2

    async def _monitor(self) -> int:
        probe_due = time.monotonic() + self.s.probe_interval_s
        fails = timeouts = 0
        while not self.stop_requested.is_set():
            try:
                await asyncio.wait_for(self.stop_requested.wait(), MONITOR_EVERY_S)
                break
            except asyncio.TimeoutError:
                pass
            death = ""
            rc = self.proc.poll()
            if rc is not None:
                death = f"tritonserver exited with {_describe_rc(rc)}"
            elif len(live_stubs(self.proc.pid)) < self.s.instances:
                death = "the python backend stub died (the server still answers ready, but cannot serve)"
            elif self.s.watch and time.monotonic() >= probe_due:
                result = await self._probe()
                probe_due = time.monotonic() + self.s.probe_interval_s
                if result is None:
                    break                                     # stop requested
                if result.ok:
                    fails = timeouts = 0
                elif result.busy:
                    timeouts += 1
                    log.warning("probe %d/3 got no token (busy?): %s", timeouts, result)
                    if timeouts >= 3:
                        death = f"3 probes in a row got no token: {result.detail}"
                else:
                    fails += 1
                    log.warning("probe %d/2 failed: %s", fails, result)
                    if fails >= 2:
                        death = f"2 probes in a row failed: {result.detail}"
            if not death:
                continue
            if not self.s.watch:
                if rc is None:                   # the stub died: report it; `stop` is fast, `status` says so
                    if not self._stub_dead_reported:
                        log.error("%s; not restarting (no --watch): run serve.sh stop / start", death)
                        self.last_death = death
                        self._stub_dead_reported = True
                        self._publish("stub-dead")
                    continue
                log.error("%s; not restarting (no --watch)", death)
                self.last_death = death
                self._publish("dead")
                return 1
            self.last_death = death
            log.error("%s: restarting the server", death)
            if not await self._restart():
                return 1
            fails = timeouts = 0
            probe_due = time.monotonic() + self.s.probe_interval_s
        return 0

    async def _restart(self) -> bool:
        self._publish("restarting")
        # a sick server: its requests in flight are stuck, so no graceful drain; their clients get an error
        await self._kill_server("restart", grace=DEAD_STUB_TERM_GRACE_S)
        for attempt, delay in enumerate(RESTART_BACKOFF_S, 1):
            self.restarts += 1
            try:
                self._spawn()
                self._publish("restarting")
                await self._wait_ready()
                self._publish("ready")
                log.info("restarted (restart %d)", self.restarts)
                return True
            except (StartFailed, LookaheadError, OSError) as e:
                if self.stop_requested.is_set():
                    return True
                log.error("restart attempt %d failed: %s; next in %d s", attempt, e, delay)
                await self._kill_server("failed restart", grace=DEAD_STUB_TERM_GRACE_S)
                try:
                    await asyncio.wait_for(self.stop_requested.wait(), delay)
                    return True
                except asyncio.TimeoutError:
                    pass
        self.last_death += f"; {len(RESTART_BACKOFF_S)} restarts failed, gave up"
        self._publish("failed")
        return False


def _describe_rc(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"status {rc}"


# -- stop and status (another process) -----------------------------------------------------------
def stop(run_dir: str | Path, timeout: float = 30.0, out=print) -> int:
    """Stop the run in `run_dir`: its supervisor, else (it was killed) its server; then clean up."""
    files = RunFiles(run_dir)
    prefix = shm_prefix_for(files.run_dir)
    state = files.read_state()
    stopped_any = False
    sup = _read_pid(files.supervisor_pid)
    t0 = time.monotonic()
    if sup and is_our_supervisor(sup, files.run_dir):
        stopped_any = True
        _signal(sup, signal.SIGTERM)
        if wait_gone([sup], timeout):
            out(f"serve.sh: warning: supervisor pid {sup} still running after {timeout:.0f} s: SIGKILL")
            _signal(sup, signal.SIGKILL)
            wait_gone([sup], 5.0)
    server = _read_pid(files.server_pid) or (int(state["PID"]) if state.get("PID", "").isdigit() else None)
    if server and is_our_server(server, prefix):     # the supervisor was killed, or gave up on it
        stopped_any = True
        grace = ServerOptions.exit_timeout_s + 5.0 if live_stubs(server) else DEAD_STUB_TERM_GRACE_S
        _signal(server, signal.SIGTERM)
        if wait_gone([server], grace):
            out(f"serve.sh: warning: tritonserver pid {server} still running after {grace:.0f} s: SIGKILL")
        try:
            os.killpg(server, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        wait_gone([server], 5.0)
    stubs, regions = clean_run(prefix)
    if stubs:
        out(f"serve.sh: warning: killed stray python stubs of this run: {', '.join(map(str, stubs))}")
    if regions:
        out(f"serve.sh: warning: removed leftover shared memory /dev/shm/{prefix}* ({len(regions)} region(s))")
    for pid_file in (files.server_pid, files.supervisor_pid):
        pid_file.unlink(missing_ok=True)
    for directory in (files.model_repo, files.backends):
        remove_shell_safe_alias(directory)
    if state and state.get("STATE") not in ("stopped", "dead", "failed"):
        state["STATE"] = "stopped"
        files.write_state(state)
    if stopped_any:
        out(f"serve.sh: stopped (in {time.monotonic() - t0:.1f} s)")
    else:
        out("serve.sh: not running")
    return 0


def status(run_dir: str | Path, probe_timeout: float = 10.0, out=print) -> int:
    """0 serving, 1 running but not serving (the reason), 3 not running."""
    files = RunFiles(run_dir)
    state = files.read_state()
    sup = _read_pid(files.supervisor_pid)
    if not (sup and is_our_supervisor(sup, files.run_dir)):
        server = _read_pid(files.server_pid)
        if server and is_our_server(server, shm_prefix_for(files.run_dir)):
            out(f"not serving: tritonserver pid {server} runs without its supervisor; run: scripts/serve.sh stop")
            return 1
        last = state.get("LAST_DEATH")
        out("not running" + (f" (the last run ended: {last}; its log: {files.server_log})" if last and
                             state.get("STATE") in ("dead", "failed") else ""))
        return 3
    http = state.get("HTTP_PORT", "")
    name = f"supervisor pid {sup}, tritonserver pid {state.get('PID') or '-'}"
    if state.get("STATE") in ("starting", "restarting"):
        out(f"not serving: {state['STATE']} ({name})")
        return 1
    result = probe(f"http://127.0.0.1:{http}", probe_timeout)
    restarts = state.get("RESTARTS", "0")
    extra = f"; restarts {restarts}, last: {state.get('LAST_DEATH')}" if restarts != "0" else ""
    if result.ok:
        out(f"serving on http://127.0.0.1:{http} (probe: {result.detail} in {result.seconds:.2f} s; {name}{extra})")
        return 0
    why = state.get("LAST_DEATH") if state.get("STATE") == "stub-dead" else ""
    out(f"not serving: {result.detail}{f' ({why})' if why else ''} ({name}, state {state.get('STATE')}{extra})")
    return 1


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.supervisor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    r = sub.add_parser("run", help="serve R/model_repo until SIGTERM")
    r.add_argument("--run-dir", required=True)
    r.add_argument("--http-port", type=int, default=8000)
    r.add_argument("--grpc-port", type=int, default=8001)
    r.add_argument("--metrics-port", type=int, default=8002)
    r.add_argument("--instances", type=int, default=1)
    r.add_argument("--watch", action="store_true", help="restart the server when it or its stub dies")
    r.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    r.add_argument("--timeout", type=float, default=180.0, help="seconds a start may take")
    r.add_argument("--probe-interval", type=float, default=10.0)
    r.add_argument("--probe-timeout", type=float, default=30.0)
    r.add_argument("--info", action="append", default=[], metavar="KEY=VALUE", help="recorded in the state file")
    for name in ("stop", "status"):
        q = sub.add_parser(name)
        q.add_argument("--run-dir", required=True)
        q.add_argument("--timeout", type=float, default=30.0 if name == "stop" else 10.0)
    args = p.parse_args(argv)
    if args.action == "stop":
        return stop(args.run_dir, args.timeout)
    if args.action == "status":
        return status(args.run_dir, args.timeout)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor: %(levelname)s %(message)s")
    settings = Settings(Path(args.run_dir), args.http_port, args.grpc_port, args.metrics_port, args.instances,
                        args.watch, args.max_body_bytes, args.timeout, args.probe_interval, args.probe_timeout,
                        dict(kv.split("=", 1) for kv in args.info if "=" in kv))
    try:
        sup = Supervisor(settings)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return asyncio.run(sup.run())


if __name__ == "__main__":
    sys.exit(main())
