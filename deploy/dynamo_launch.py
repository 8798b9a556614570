"""Start and stop an NVIDIA Dynamo deployment of an engine: one OpenAI frontend and N workers.

    python -m deploy.dynamo_launch start --engine engines/default [--workers 2] [--http-port 8000]
        [--router kv|round-robin|random] [--watch] [--device cpu|cuda|cuda:N] [--run-dir build/dynamo]
        [--discovery file|etcd] [--mode lookahead --top-k 64 --prefix-caching false ...]
    python -m deploy.dynamo_launch status [--run-dir build/dynamo]
    python -m deploy.dynamo_launch stop   [--run-dir build/dynamo]

From Python: `start(engine_dir, workers=2, http_port=P, run_dir=..., lookahead_overrides={...})`
returns a `Deployment` (url, model, pids); `stop(run_dir)` ends it.

Everything listens on 127.0.0.1. `start` runs `python -m dynamo.frontend --http-host 127.0.0.1
--http-port <internal> --discovery-backend file --request-plane tcp --event-plane zmq --router-mode
R`, N `python -m serving.dynamo_worker` processes with the environment the frontend and workers
need (every *_HOST = 127.0.0.1, DYN_FILE_KV under the run dir), and the front
(`python -m deploy.dynamo_launch front`) on the public port P: deploy.http_front with the checks
of deploy/openai_front.py (OpenAI fields no worker sees are refused by name) and, with `watch`,
the `Watcher`, which restarts a worker or the frontend that dies. It waits until every worker has
registered and `/v1/models` lists the model, printing progress, and writes PID files, logs and
`deployment.json` (the commands and environment, for the watcher) under the run dir. `stop` sends
SIGTERM to each PID (the front first, so nothing is restarted, then the workers, so they leave
discovery before the frontend goes), then SIGKILL to any still alive after `grace_s`; a PID is
only signalled while its /proc cmdline is still the process started here. `status` says which
processes are up (a worker is up once registered) and exits 0 / 1 (which are not) / 3.

Routing (`router_mode`, `--router`): kv (the default with 2+ workers) sends a request to the worker
whose prefix cache holds the longest prefix of its blocks, weighed by load; round-robin; random.

Discovery. `file` (default): one machine, no servers needed; discovery state lives in
`<run-dir>/kv`, wiped at each start. `etcd`: for several machines; workers and frontend find each
other through etcd (`--etcd-endpoints`, default http://127.0.0.1:2379) and send requests and
events over NATS (`--nats-server`, default nats://127.0.0.1:4222). Debian's `etcd-server` and
`nats-server` packages provide both; `--start-etcd-nats` starts them here on loopback (data under
the run dir) and `stop` stops them. On other machines start workers only:
`python -m serving.dynamo_worker --engine DIR --discovery-backend etcd --request-plane nats
--event-plane nats` with ETCD_ENDPOINTS and NATS_SERVER pointing at the shared servers (and
DYN_TCP_RPC_HOST etc. set to an address the frontend can reach).

`--device` (default auto: cuda when torch has a GPU, else cpu) is every worker's `--device`; one
that is not there is refused before any process starts.

Errors are one line (a taken port, a bad engine dir, setting or device, Dynamo missing), except a process
that dies while starting: then the last lines of its log follow, and everything started is stopped.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

HOST = "127.0.0.1"
DEFAULT_RUN_DIR = "build/dynamo"
DEFAULT_MODEL_NAME = "lookahead_llm"
DEFAULT_NAMESPACE = "lookahead"
DEFAULT_HTTP_PORT = 8000
PEEK_MS = 1000          # the frontend holds a stream's HTTP status this long for a worker's 4xx
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class LaunchError(RuntimeError):
    """Starting or stopping failed; `str()` is what to print (one line, or a line and a log tail)."""


@dataclasses.dataclass
class Deployment:
    run_dir: Path
    url: str                 # http://127.0.0.1:P/v1
    http_port: int
    model: str
    namespace: str
    discovery: str
    frontend_pid: int
    worker_pids: list[int]
    worker_system_ports: list[int]
    infra_pids: dict[str, int]

    def stats(self, index: int) -> dict[str, Any]:
        """Worker `index`'s last published engine stats (free_blocks, total_blocks, num_running, ...)."""
        return json.loads((self.run_dir / f"worker-{index}.stats.json").read_text())

    def stats_url(self, index: int) -> str:
        return f"http://{HOST}:{self.worker_system_ports[index]}/engine/stats"


# ---- environment ------------------------------------------------------------------------------------
def base_env(run_dir: Path, discovery: str = "file", *, etcd_endpoints: str | None = None,
             nats_server: str | None = None) -> dict[str, str]:
    """The DYN_* settings every process of a deployment shares (loopback hosts, the discovery and planes)."""
    env = {"DYN_TCP_RPC_HOST": HOST, "DYN_TCP_RESPONSE_STREAM_HOST": HOST, "DYN_EVENT_PLANE_HOST": HOST,
           "DYN_SYSTEM_HOST": HOST, "DYN_SDK_DISABLE_ANSI_LOGGING": "1", "NO_COLOR": "1",
           "PYTHONUNBUFFERED": "1"}
    if discovery == "file":
        env.update(DYN_DISCOVERY_BACKEND="file", DYN_FILE_KV=str(run_dir / "kv"), DYN_REQUEST_PLANE="tcp",
                   DYN_EVENT_PLANE="zmq")
    elif discovery == "etcd":
        env.update(DYN_DISCOVERY_BACKEND="etcd", ETCD_ENDPOINTS=etcd_endpoints or f"http://{HOST}:2379",
                   NATS_SERVER=nats_server or f"nats://{HOST}:4222", DYN_REQUEST_PLANE="nats",
                   DYN_EVENT_PLANE="nats")
    else:
        raise LaunchError(f"discovery: {discovery!r} is unknown (use file or etcd)")
    return env


ROUTER_MODES = ("kv", "round-robin", "random")
# The kv router's cost of a worker is (prompt blocks it must prefill, less those it holds) x this
# weight + the blocks its running requests hold. The router's own weight, 1, prices a prompt block
# like a resident decode block, as on a GPU; on these CPU workers prefilling one block (16 tokens)
# takes about as long as decoding ~10 tokens, so at 1 a worker busy with one decode loses to an idle
# one at almost every request, holding the prefix or not (measured: kv routing then computed 8 % more
# prefill than round-robin; at 8, 36 % of round-robin's). The launcher's --kv-prefill-weight sets it.
KV_PREFILL_WEIGHT = 8.0


def default_router(workers: int) -> str:
    """kv when there is a choice of worker (a repeated prefix goes where its KV blocks are)."""
    return "kv" if workers > 1 else "round-robin"


def frontend_command(python: str, http_port: int, discovery: str, namespace: str,
                     router_mode: str = "round-robin", kv_prefill_weight: float = KV_PREFILL_WEIGHT) -> list[str]:
    """The frontend's command. `router_mode` kv: the frontend's KV router picks the worker whose
    cache holds the longest prefix of the request's blocks (from the workers' KV events on the
    event plane, ZMQ here; block size from the model card), weighed against the workers' load."""
    if router_mode not in ROUTER_MODES:
        raise LaunchError(f"router: {router_mode!r} is unknown (use {', '.join(ROUTER_MODES)})")
    if not (isinstance(kv_prefill_weight, (int, float)) and 0 < kv_prefill_weight < 1e6):
        raise LaunchError(f"kv_prefill_weight: must be a number > 0, got {kv_prefill_weight!r} (e.g. {KV_PREFILL_WEIGHT})")
    planes = {"file": ("file", "tcp", "zmq"), "etcd": ("etcd", "nats", "nats")}[discovery]
    weight = ["--router-prefill-load-scale", f"{float(kv_prefill_weight):g}"] if router_mode == "kv" else []
    return [python, "-m", "dynamo.frontend", "--http-host", HOST, "--http-port", str(http_port),
            "--discovery-backend", planes[0], "--request-plane", planes[1], "--event-plane", planes[2],
            "--namespace", namespace, "--router-mode", router_mode, *weight]


def worker_command(python: str, engine_dir: str, index: int, *, run_dir: Path, model_name: str, namespace: str,
                   lookahead_overrides: dict[str, Any] | None = None, threads: int | None = None,
                   worker_options: dict[str, Any] | None = None) -> list[str]:
    cmd = [python, "-m", "serving.dynamo_worker", "--engine", str(engine_dir), "--worker-index", str(index),
           "--run-dir", str(run_dir), "--model-name", model_name, "--namespace", namespace]
    if threads:
        cmd += ["--threads", str(threads)]
    for key, value in (worker_options or {}).items():
        if value is True:
            cmd.append("--" + key.replace("_", "-"))
        elif value is not None and value is not False:
            cmd += ["--" + key.replace("_", "-"), str(value)]
    for key, value in (lookahead_overrides or {}).items():     # a LookaheadConfig field takes a value
        if value is not None:
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            cmd += ["--" + key.replace("_", "-"), text]
    return cmd


def front_command(python: str, run_dir: Path) -> list[str]:
    return [python, "-m", "deploy.dynamo_launch", "front", "--run-dir", str(run_dir)]


# ---- checks ------------------------------------------------------------------------------------------
def check_port_free(port: int, what: str = "--http-port") -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((HOST, port))
    except OSError as e:
        owner = _port_owner(port)
        raise LaunchError(f"port {port} on {HOST} is taken{f' by {owner}' if owner else ''} ({e.strerror}): "
                          f"stop that process or pick another {what}") from None
    finally:
        s.close()


def _port_owner(port: int) -> str:
    if not shutil.which("ss"):
        return ""
    try:
        out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    m = re.search(r'users:\(\("([^"]*)",pid=(\d+)', out)
    return f"{m.group(1)} (pid {m.group(2)})" if m else ""


def free_port(below_32768: bool = False) -> int:
    """A port free on 127.0.0.1 now. `below_32768`: Dynamo 1.6 reads DYN_SYSTEM_PORT as an i16, so a
    worker's system port must be under 32768 (the kernel's ephemeral ports are above)."""
    if not below_32768:
        with socket.socket() as s:
            s.bind((HOST, 0))
            return s.getsockname()[1]
    import random
    for port in random.Random(os.getpid() ^ time.monotonic_ns()).sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    raise LaunchError("no free port in 20000-32767 on 127.0.0.1 for a worker's system server")


def check_engine(engine_dir: str | Path, lookahead_overrides: dict[str, Any] | None, device: str | None = None) -> None:
    """A bad engine dir or setting, found before any process starts (checksums: the workers check them):
    the settings resolved as every worker will resolve them (runtime/spec.py: a setting the mode does
    not read, an unverified precision, a plan the host cannot hold); the tokenizer too, so a chat
    template that cannot render (or finish) is named here, not after a wait for workers that never
    register."""
    from runtime.device import resolve_device
    from runtime.errors import LookaheadError
    from runtime.engine_dir import load_manifest
    from runtime.spec import resolve_spec
    from runtime.tokenizer import TextTokenizer
    try:
        manifest = load_manifest(engine_dir, verify_checksums=False)
        resolve_spec(manifest, resolve_device(device), lookahead_overrides)
        TextTokenizer.from_engine(manifest)
    except LookaheadError as e:
        raise LaunchError(f"engine {engine_dir}: {e}") from None
    except (TypeError, ValueError) as e:       # an override that is not a LookaheadConfig field
        raise LaunchError(f"engine {engine_dir}: bad lookahead override ({e})") from None


def check_device(device: str | None) -> None:
    """A device that is not here (cuda on a machine without a GPU), refused before any process starts."""
    from runtime.device import resolve_device
    from runtime.errors import LookaheadError
    try:
        resolve_device(device)
    except LookaheadError as e:
        raise LaunchError(str(e)) from None


def check_dynamo(python: str) -> None:
    code = "import dynamo.frontend, dynamo.llm, dynamo.runtime"
    r = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise LaunchError(f"NVIDIA Dynamo is not importable by {python} ({last}): run scripts/install_dynamo.sh")


# ---- processes ---------------------------------------------------------------------------------------
def _spawn(cmd: list[str], env: dict[str, str], log_path: Path, cwd: str | Path | None = None) -> subprocess.Popen:
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, start_new_session=True)
    finally:
        log.close()


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    rows = [_ANSI.sub("", r) for r in text.splitlines() if r.strip()]
    return "\n".join(rows[-lines:])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int, marker: str) -> bool:
    """`pid` runs and is still the process we started (its cmdline holds `marker`)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    cmd = _cmdline(pid)
    return marker in cmd if cmd else False


def _markers() -> dict[str, str]:
    return {"frontend": "dynamo.frontend", "worker": "serving.dynamo_worker", "etcd": "etcd",
            "nats": "nats-server", "front": "deploy.dynamo_launch"}


def _marker(name: str) -> str:
    return _markers()["worker" if name.startswith("worker") else name]


def _get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _models(http_port: int) -> list[str]:
    try:
        return [m.get("id") for m in _get_json(f"http://{HOST}:{http_port}/v1/models").get("data", [])]
    except (OSError, ValueError, urllib.error.URLError):
        return []


def _num_instances(run_dir: Path, namespace: str) -> int:
    """Registered endpoint instances in file discovery (one file per live worker)."""
    d = run_dir / "kv" / "v1" / "instances"
    prefix = f"{namespace}%2F"
    try:
        return sum(1 for p in d.iterdir() if p.name.startswith(prefix))
    except OSError:
        return 0


# ---- start / stop / status ---------------------------------------------------------------------------
def start(engine_dir: str | Path, *, workers: int = 1, http_port: int = DEFAULT_HTTP_PORT,
          run_dir: str | Path = DEFAULT_RUN_DIR, lookahead_overrides: dict[str, Any] | None = None,
          discovery: str = "file", model_name: str = DEFAULT_MODEL_NAME, namespace: str = DEFAULT_NAMESPACE,
          python: str | None = None, timeout: float = 180.0, threads: int | None = None,
          worker_options: dict[str, Any] | None = None, etcd_endpoints: str | None = None,
          nats_server: str | None = None, start_etcd_nats: bool = False, device: str | None = None,
          router_mode: str | None = None, watch: bool = False, kv_prefill_weight: float = KV_PREFILL_WEIGHT,
          progress: Callable[[str], None] | None = print) -> Deployment:
    """Start the frontend, `workers` workers and the front; return once all serve and /v1/models
    lists the model.

    `worker_options`: more dynamo_worker flags by name (num_host_blocks, max_queue,
    default_max_tokens, no_verify_checksums...). `threads`: torch threads per worker (default: the
    cores shared out). `device`: every worker's (None: auto). `router_mode`: kv, round-robin or
    random (default: kv with more than one worker). `watch`: the front restarts a worker (or the
    frontend) that dies. Raises LaunchError, having stopped whatever it started."""
    python = python or sys.executable
    run_dir = Path(run_dir).resolve()
    say = progress or (lambda _msg: None)
    if workers < 1:
        raise LaunchError(f"workers: must be >= 1, got {workers}")
    if discovery not in ("file", "etcd"):
        raise LaunchError(f"discovery: {discovery!r} is unknown (use file or etcd)")
    router_mode = router_mode or default_router(workers)
    if router_mode not in ROUTER_MODES:
        raise LaunchError(f"router: {router_mode!r} is unknown (use {', '.join(ROUTER_MODES)})")
    running = _running_pids(run_dir)
    if running:
        raise LaunchError(f"a deployment is already running from {run_dir} (pids {sorted(running.values())}): "
                          f"stop it first (python -m deploy.dynamo_launch stop --run-dir {run_dir})")
    check_device(device)
    check_engine(engine_dir, lookahead_overrides, device)
    check_port_free(http_port)
    check_dynamo(python)
    run_dir.mkdir(parents=True, exist_ok=True)
    for pattern in ("*.pid", "worker-*.ready", "worker-*.stats.json", "*.log", "watch.json"):
        for p in run_dir.glob(pattern):
            p.unlink(missing_ok=True)
    shutil.rmtree(run_dir / "kv", ignore_errors=True)
    threads = threads or max(1, (os.cpu_count() or 1) // workers)
    repo_root = Path(__file__).resolve().parents[1]      # so `-m runtime...` resolves with any python
    infra: dict[str, int] = {}
    procs: dict[str, subprocess.Popen] = {}
    try:
        if discovery == "etcd" and start_etcd_nats:
            etcd_endpoints, nats_server = _start_etcd_nats(run_dir, infra, say)
        shared = base_env(run_dir, discovery, etcd_endpoints=etcd_endpoints, nats_server=nats_server)
        shared["PYTHONPATH"] = str(repo_root) + (os.pathsep + os.environ["PYTHONPATH"]
                                                 if os.environ.get("PYTHONPATH") else "")
        env = {**os.environ, **shared}
        env.pop("DYN_SYSTEM_PORT", None)
        internal_port = free_port()             # the frontend's; the public port is the front's
        fe_cmd = frontend_command(python, internal_port, discovery, namespace, router_mode, kv_prefill_weight)
        fe_env = {"DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS": str(PEEK_MS)}
        procs["frontend"] = _spawn(fe_cmd, {**env, **fe_env}, run_dir / "frontend.log", cwd=repo_root)
        (run_dir / "frontend.pid").write_text(str(procs["frontend"].pid))
        sys_ports, commands = [], {"frontend": {"cmd": fe_cmd, "env": fe_env}}
        for i in range(workers):
            port = free_port(below_32768=True)
            sys_ports.append(port)
            cmd = worker_command(python, str(Path(engine_dir).resolve()), i, run_dir=run_dir, model_name=model_name,
                                 namespace=namespace, lookahead_overrides=lookahead_overrides, threads=threads,
                                 worker_options={**(worker_options or {}), "device": device})
            commands[f"worker-{i}"] = {"cmd": cmd, "env": {"DYN_SYSTEM_PORT": str(port)}}
            procs[f"worker-{i}"] = _spawn(cmd, {**env, "DYN_SYSTEM_PORT": str(port)}, run_dir / f"worker-{i}.log",
                                          cwd=repo_root)
            (run_dir / f"worker-{i}.pid").write_text(str(procs[f"worker-{i}"].pid))
        dep = Deployment(run_dir, f"http://{HOST}:{http_port}/v1", http_port, model_name, namespace, discovery,
                         procs["frontend"].pid, [procs[f"worker-{i}"].pid for i in range(workers)], sys_ports, infra)
        (run_dir / "deployment.json").write_text(json.dumps(
            {**dataclasses.asdict(dep), "run_dir": str(run_dir), "engine": str(engine_dir),
             "device": device or "auto", "lookahead_overrides": lookahead_overrides or {},
             "router_mode": router_mode, "watch": watch, "internal_http_port": internal_port,
             "env": shared, "cwd": str(repo_root), "commands": commands}, indent=1))
        procs["front"] = _spawn(front_command(python, run_dir), env, run_dir / "front.log", cwd=repo_root)
        (run_dir / "front.pid").write_text(str(procs["front"].pid))
        say(f"dynamo: starting frontend (pid {dep.frontend_pid}, port {http_port}, router {router_mode}) and "
            f"{workers} worker(s) (pids {dep.worker_pids}, engine {engine_dir}){'; --watch' if watch else ''}; "
            f"logs in {run_dir}")
        _wait_ready(dep, procs, timeout, say)
    except BaseException:
        _terminate(procs, infra)
        raise
    say(f"dynamo: ready: model {model_name!r} at {dep.url} ({workers} worker(s), router {router_mode}); "
        f"stop: python -m deploy.dynamo_launch stop --run-dir {run_dir}")
    return dep


def _wait_ready(dep: Deployment, procs: dict[str, subprocess.Popen], timeout: float, say) -> None:
    t0 = last_say = time.monotonic()
    n = len(dep.worker_pids)
    while True:
        for name, proc in procs.items():
            rc = proc.poll()
            if rc is not None:
                log = dep.run_dir / f"{name}.log"
                raise LaunchError(f"{name} (pid {proc.pid}) exited with code {rc} while starting; "
                                  f"last lines of {log}:\n{log_tail(log)}")
        ready = [i for i in range(n) if (dep.run_dir / f"worker-{i}.ready").exists()]
        models = _models(dep.http_port)
        registered = _num_instances(dep.run_dir, dep.namespace) if dep.discovery == "file" else len(ready)
        if len(ready) == n and dep.model in models and registered >= n:
            return
        elapsed = time.monotonic() - t0
        if elapsed > timeout:
            raise LaunchError(f"not ready after {timeout:.0f} s (workers ready: {len(ready)}/{n}, registered: "
                              f"{registered}/{n}, /v1/models: {models}); see the logs in {dep.run_dir}")
        if time.monotonic() - last_say >= 5:
            last_say = time.monotonic()
            say(f"dynamo: waiting ({elapsed:.0f} s): workers loaded {len(ready)}/{n}, registered {registered}/{n}, "
                f"/v1/models {'lists ' + repr(dep.model) if dep.model in models else 'not yet'}")
        time.sleep(0.25)


def _start_etcd_nats(run_dir: Path, infra: dict[str, int], say) -> tuple[str, str]:
    etcd, nats = shutil.which("etcd"), shutil.which("nats-server")
    if not etcd or not nats:
        raise LaunchError("--start-etcd-nats needs etcd and nats-server on PATH "
                          "(Debian: apt-get install etcd-server nats-server)")
    client, peer, nport = free_port(), free_port(), free_port()
    env = dict(os.environ)
    for d in ("etcd-data", "nats-data"):          # a fresh registry: nothing left from the last run
        shutil.rmtree(run_dir / d, ignore_errors=True)
    p = _spawn([etcd, "--name", "lookahead", "--data-dir", str(run_dir / "etcd-data"),
                "--listen-client-urls", f"http://{HOST}:{client}", "--advertise-client-urls", f"http://{HOST}:{client}",
                "--listen-peer-urls", f"http://{HOST}:{peer}", "--initial-advertise-peer-urls", f"http://{HOST}:{peer}",
                "--initial-cluster", f"lookahead=http://{HOST}:{peer}"], env, run_dir / "etcd.log")
    infra["etcd"] = p.pid
    (run_dir / "etcd.pid").write_text(str(p.pid))
    q = _spawn([nats, "-a", HOST, "-p", str(nport), "-js", "-sd", str(run_dir / "nats-data")], env,
               run_dir / "nats.log")
    infra["nats"] = q.pid
    (run_dir / "nats.pid").write_text(str(q.pid))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20:
        for name, proc in (("etcd", p), ("nats", q)):
            if proc.poll() is not None:
                log = run_dir / f"{name}.log"
                raise LaunchError(f"{name} exited with code {proc.returncode} while starting; "
                                  f"last lines of {log}:\n{log_tail(log)}")
        try:
            _get_json(f"http://{HOST}:{client}/health")
            with socket.create_connection((HOST, nport), timeout=1):
                pass
            say(f"dynamo: etcd on {HOST}:{client} (pid {p.pid}), nats on {HOST}:{nport} (pid {q.pid})")
            return f"http://{HOST}:{client}", f"nats://{HOST}:{nport}"
        except (OSError, ValueError, urllib.error.URLError):
            time.sleep(0.25)
    raise LaunchError("etcd / nats-server not reachable after 20 s; see etcd.log and nats.log in " + str(run_dir))


def _running_pids(run_dir: Path) -> dict[str, int]:
    """name -> pid of this run dir's processes that are still alive (and still ours)."""
    out = {}
    for f in Path(run_dir).glob("*.pid"):
        name = f.stem
        try:
            pid = int(f.read_text().strip())
        except (OSError, ValueError):
            continue
        if name in _markers() or name.startswith("worker-"):
            if _alive(pid, _marker(name)):
                out[name] = pid
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        if os.getpgid(pid) == pid:          # started with start_new_session: its group is its own
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tier(name: str) -> int:
    """Stop order: the front first (its watcher would restart a worker stopped under it), then the
    workers (they leave discovery before the frontend goes), the frontend, etcd/nats."""
    return 0 if name == "front" else 1 if name.startswith("worker") else 2 if name == "frontend" else 3


def _stop_pids(pids: dict[str, int], grace_s: float) -> list[str]:
    """SIGTERM every pid tier by tier (see _tier), SIGKILL survivors of a tier after grace_s."""
    order = sorted(pids, key=lambda n: (_tier(n), n))
    marker = {n: _marker(n) for n in order}
    killed = []
    for tier in (0, 1, 2, 3):
        names = [n for n in order if _tier(n) == tier]
        for n in names:
            _signal(pids[n], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(pids[n], marker[n]) for n in names):
            time.sleep(0.1)
        for n in names:
            if _alive(pids[n], marker[n]):
                _signal(pids[n], signal.SIGKILL)
                killed.append(n)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(pids[n], marker[n]) for n in order):
        time.sleep(0.05)
    return killed


def _terminate(procs: dict[str, subprocess.Popen], infra: dict[str, int]) -> None:
    pids = {n: p.pid for n, p in procs.items() if p.poll() is None}
    pids.update({n: pid for n, pid in infra.items()})
    _stop_pids(pids, grace_s=3.0)
    for p in procs.values():
        try:
            p.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


def stop(run_dir: str | Path = DEFAULT_RUN_DIR, *, grace_s: float = 5.0,
         progress: Callable[[str], None] | None = print) -> list[str]:
    """Stop every process of the deployment in `run_dir` by PID; returns the names stopped."""
    run_dir = Path(run_dir).resolve()
    say = progress or (lambda _msg: None)
    pids = _running_pids(run_dir)
    if not pids:
        say(f"dynamo: not running (no live process from {run_dir})")
    else:
        killed = _stop_pids(pids, grace_s)
        say(f"dynamo: stopped {', '.join(f'{n} (pid {p})' for n, p in sorted(pids.items()))}"
            + (f"; killed after {grace_s:.0f} s: {', '.join(killed)}" if killed else ""))
    for f in run_dir.glob("*.pid"):
        f.unlink(missing_ok=True)
    for f in run_dir.glob("worker-*.ready"):
        f.unlink(missing_ok=True)
    return sorted(pids)


def is_run_dir(run_dir: str | Path) -> bool:
    """Whether `run_dir` holds (or held) a Dynamo deployment started here."""
    d = Path(run_dir)
    return (d / "deployment.json").is_file() or (d / "frontend.pid").is_file() or any(d.glob("worker-*.pid"))


def status(run_dir: str | Path = DEFAULT_RUN_DIR) -> dict[str, Any]:
    """What runs from `run_dir`: pids alive, whether /v1/models lists the model, and per worker
    whether it is up (its process alive, and its stats route answering when it has one), its last
    stats (`stale` when the worker is down) and its restarts by the watcher."""
    run_dir = Path(run_dir).resolve()
    try:
        dep = json.loads((run_dir / "deployment.json").read_text())
    except (OSError, ValueError):
        dep = {}
    alive = _running_pids(run_dir)
    watch = _read_watch(run_dir)
    out: dict[str, Any] = {"run_dir": str(run_dir), "running": alive, "url": dep.get("url"), "model": dep.get("model"),
                           "router_mode": dep.get("router_mode"), "watch": bool(dep.get("watch")),
                           "restarts": watch.get("restarts", {}), "gave_up": watch.get("gave_up", {})}
    if dep.get("http_port") and "front" in alive:
        out["models"] = _models(dep["http_port"])
    elif dep.get("internal_http_port") and "frontend" in alive:
        out["models"] = _models(dep["internal_http_port"])
    names = sorted({f.name.split(".")[0] for f in run_dir.glob("worker-*.pid")} |
                   {f"worker-{i}" for i in range(len(dep.get("worker_pids") or []))}, key=_worker_key)
    ports = dep.get("worker_system_ports") or []
    workers = {}
    for name in names:
        try:
            stats = json.loads((run_dir / f"{name}.stats.json").read_text())
        except (OSError, ValueError):
            stats = {}
        up = name in alive
        live = None
        i = _worker_key(name)
        if up and i < len(ports):
            try:
                live = _get_json(f"http://{HOST}:{ports[i]}/engine/stats", timeout=2.0)
            except (OSError, ValueError, urllib.error.URLError):
                live = None
        ready = up and (run_dir / f"{name}.ready").is_file()       # registered with the frontend
        workers[name] = {**(live or stats), "up": ready, "alive": up, "answers": live is not None,
                         "pid": alive.get(name), "stale": live is None,
                         "restarts": watch.get("restarts", {}).get(name, 0)}
    out["workers"] = workers
    return out


def _worker_key(name: str) -> int:
    try:
        return int(name.split("-", 1)[1])
    except (IndexError, ValueError):
        return 1 << 30


def _read_watch(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "watch.json").read_text())
    except (OSError, ValueError):
        return {}


def print_status(st: dict[str, Any], out=print) -> int:
    """The CLI's report of `status()`: 0 every process up and the model listed, 1 running but not
    whole (a worker, the front or the frontend down or still starting: named), 3 nothing running.
    A worker that is down is reported down, never with its last stats as if it served."""
    running = st["running"]
    if not running:
        out(f"dynamo: not running ({st['run_dir']})")
        return 3
    workers = st["workers"]
    down = [n for n, w in workers.items() if not w["up"]]
    missing = [n for n in ("frontend", "front") if n not in running]
    listed = st.get("model") in (st.get("models") or [])
    whole = not down and not missing and listed
    head = "serving" if whole else "degraded"
    out(f"dynamo: {head}: model {st['model']!r} at {st['url']} (router {st.get('router_mode')}, "
        f"watch {'on' if st.get('watch') else 'off'}); /v1/models: {st.get('models')}; "
        f"workers up {len(workers) - len(down)}/{len(workers)}")
    for name in ("frontend", "front"):
        out(f"  {name}: {'up (pid %d)' % running[name] if name in running else 'DOWN'}")
    for name, w in workers.items():
        restarts = f", restarts {w['restarts']}" if w.get("restarts") else ""
        if w.get("alive") and not w["up"]:
            out(f"  {name}: starting (pid {w['pid']}{restarts}: loading its engine, not registered yet)")
            continue
        if not w["up"]:
            gave_up = st.get("gave_up", {}).get(name)
            out(f"  {name}: DOWN (not running{restarts}{'; the watcher gave up: ' + gave_up if gave_up else ''}"
                f"{'' if st.get('watch') else '; start with --watch to restart dead workers'})")
            continue
        hit = w.get("prefix_cache_hit_rate")
        out(f"  {name}: up (pid {w['pid']}{restarts}): mode {w.get('mode')}, running {w.get('num_running')}, "
            f"waiting {w.get('num_waiting')}, free blocks {w.get('free_blocks')}/{w.get('total_blocks')}, "
            f"prefix cache hit rate {'-' if hit is None else f'{hit:.2f}'} ({w.get('cached_blocks')} blocks cached, "
            f"{w.get('prefix_cache_evictions')} evicted), finished {w.get('finished_requests')}, "
            f"aborted {w.get('aborted_requests')}, {w.get('tokens_per_s') or 0:.1f} tokens/s")
    if down or missing:
        out(f"dynamo: not up: {', '.join(missing + [n + (' (starting)' if workers[n].get('alive') else '') for n in down])}")
    elif not listed:
        out("dynamo: the frontend does not list the model (yet)")
    return 0 if whole else 1


# ---- the front: OpenAI checks in front of the frontend, and the watcher ----------------------------
WATCH_EVERY_S = 1.0
RESTART_BACKOFF_S = (1, 2, 5, 10, 30)     # after a quick death; a worker that keeps dying is given up on
QUICK_DEATH_S = 60.0


class Watcher:
    """Restarts a dead worker (or frontend) of a deployment with the command and environment it was
    started with (deployment.json). Restarts and deaths go to watch.json and front.log. A process
    that dies again within QUICK_DEATH_S waits RESTART_BACKOFF_S before its next start; after the
    last delay it is given up on (status says so)."""

    def __init__(self, run_dir: Path, dep: dict[str, Any], say=None):
        self.run_dir, self.dep = run_dir, dep
        self.say = say or (lambda m: print(m, flush=True))
        self.children: dict[str, subprocess.Popen] = {}
        self.state: dict[str, Any] = {"restarts": {}, "deaths": {}, "gave_up": {}}
        self._started: dict[str, float] = {}
        self._quick: dict[str, int] = {}
        self._due: dict[str, float] = {}

    def names(self) -> list[str]:
        return [n for n in self.dep.get("commands", {}) if n == "frontend" or n.startswith("worker-")]

    def _pid(self, name: str) -> int | None:
        try:
            return int((self.run_dir / f"{name}.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def check(self) -> list[str]:
        """One pass: restart what is dead and due; returns the names (re)started."""
        started = []
        now = time.monotonic()
        for name in self.names():
            child = self.children.get(name)
            if child is not None:
                child.poll()                      # reap our own children
            pid = self._pid(name)
            if pid is not None and _alive(pid, _marker(name)):
                continue
            if name in self.state["gave_up"]:
                continue
            if name not in self._due:             # a death seen for the first time
                rc = child.returncode if child is not None and child.pid == pid else None
                what = f"{name} (pid {pid}) died" + (f" with code {rc}" if rc is not None else "")
                if name.startswith("worker-"):
                    gone = self.forget(name)
                    if gone:
                        what += f"; removed its {len(gone)} discovery entries"
                self.state["deaths"][name] = what
                quick = now - self._started.get(name, -1e9) < QUICK_DEATH_S
                self._quick[name] = self._quick.get(name, 0) + 1 if quick else 0
                if self._quick[name] > len(RESTART_BACKOFF_S):
                    self.state["gave_up"][name] = f"{what}, {self._quick[name]} times within {QUICK_DEATH_S:.0f} s of its start"
                    self.say(f"watch: {self.state['gave_up'][name]}: not restarting it")
                    self._save()
                    continue
                delay = RESTART_BACKOFF_S[self._quick[name] - 1] if self._quick[name] else 0
                self._due[name] = now + delay
                self.say(f"watch: {what}; restarting it" + (f" in {delay} s" if delay else ""))
            if now < self._due[name]:
                continue
            del self._due[name]
            self._restart(name)
            started.append(name)
        return started

    def forget(self, name: str) -> list[Path]:
        """Remove a dead worker's entries from file discovery (its ready file names its instance):
        a SIGKILLed worker cannot unregister, and until its entries go the frontend may still
        route to it (503s). Returns the files removed."""
        try:
            instance = json.loads((self.run_dir / f"{name}.ready").read_text()).get("instance_id")
        except (OSError, ValueError, AttributeError):
            return []
        if not instance or self.dep.get("discovery", "file") != "file":
            return []
        removed = []
        for f in (self.run_dir / "kv").rglob("*"):
            if f.is_file() and f.name.lower().endswith(f"%2f{instance}".lower()):
                f.unlink(missing_ok=True)
                removed.append(f)
        return removed

    def _restart(self, name: str) -> None:
        spec = self.dep["commands"][name]
        env = {**os.environ, **self.dep.get("env", {}), **spec.get("env", {})}
        if name == "frontend":
            env["DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS"] = str(PEEK_MS)
        (self.run_dir / f"{name}.ready").unlink(missing_ok=True)
        log_path = self.run_dir / f"{name}.log"
        with open(log_path, "ab") as f:
            f.write(f"---- watch: restarting {name} at {time.strftime('%Y-%m-%d %H:%M:%S')} ----\n".encode())
        proc = _spawn(spec["cmd"], env, log_path, cwd=self.dep.get("cwd"))
        self.children[name] = proc
        (self.run_dir / f"{name}.pid").write_text(str(proc.pid))
        self._started[name] = time.monotonic()
        self.state["restarts"][name] = self.state["restarts"].get(name, 0) + 1
        self.say(f"watch: started {name} again (pid {proc.pid}, restart {self.state['restarts'][name]})")
        self._save()

    def _save(self) -> None:
        tmp = self.run_dir / f".watch.json.{os.getpid()}"
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.run_dir / "watch.json")

    def stop_children(self) -> None:
        for proc in self.children.values():
            proc.poll()


def run_front(run_dir: str | Path) -> int:
    """The front process of a deployment (started by `start`): deploy.http_front on the public
    port, refusing what the engine cannot serve (deploy/openai_front.py) before the frontend on
    its internal port sees it, plus, with watch, the Watcher."""
    import asyncio
    import logging

    from .http_front import Front
    from .openai_front import check_openai_request, openai_error_body, prompt_logprobs_rewrite

    run_dir = Path(run_dir).resolve()
    dep = json.loads((run_dir / "deployment.json").read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s front: %(message)s")
    front = Front(HOST, dep["http_port"], HOST, dep["internal_http_port"], check=check_openai_request,
                  error_body=openai_error_body, upstream_name="the Dynamo frontend",
                  rewrite=prompt_logprobs_rewrite)
    watcher = Watcher(run_dir, dep, say=lambda m: logging.info("%s", m)) if dep.get("watch") else None

    async def watch(stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), WATCH_EVERY_S)
            except asyncio.TimeoutError:
                pass
            if not stop.is_set() and watcher is not None:
                await asyncio.to_thread(watcher.check)

    async def main() -> None:
        await front.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        serve = asyncio.ensure_future(front.serve())
        logging.info("OpenAI front on %s:%d -> the Dynamo frontend on %s:%d%s", HOST, dep["http_port"], HOST,
                     dep["internal_http_port"], "; watching the workers" if watcher else "")
        await watch(stop)
        front.close()
        serve.cancel()
    try:
        asyncio.run(main())
    except OSError as e:
        print(f"front: cannot listen on {HOST}:{dep['http_port']}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


# ---- CLI ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from runtime.cli import add_lookahead_flags

    p = argparse.ArgumentParser(prog="python -m deploy.dynamo_launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("start", help="start the frontend and N workers, wait until they serve")
    s.add_argument("--engine", default="engines/default")
    s.add_argument("--workers", type=int, default=1)
    s.add_argument("--device", default=None,
                   help="every worker's device: cpu, cuda or cuda:N (default: auto, cuda when torch has a GPU, "
                        "else cpu)")
    s.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT)
    s.add_argument("--run-dir", default=DEFAULT_RUN_DIR)
    s.add_argument("--discovery", choices=("file", "etcd"), default="file")
    s.add_argument("--model-name", default=DEFAULT_MODEL_NAME)
    s.add_argument("--namespace", default=DEFAULT_NAMESPACE)
    s.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for readiness")
    s.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: cores / workers)")
    s.add_argument("--python", default=None, help="the interpreter with dynamo installed (default: this one)")
    s.add_argument("--num-host-blocks", type=int, default=None)
    s.add_argument("--max-queue", type=int, default=None)
    s.add_argument("--default-max-tokens", type=int, default=None)
    s.add_argument("--etcd-endpoints", default=None, help="with --discovery etcd (default http://127.0.0.1:2379)")
    s.add_argument("--nats-server", default=None, help="with --discovery etcd (default nats://127.0.0.1:4222)")
    s.add_argument("--start-etcd-nats", action="store_true",
                   help="with --discovery etcd: start etcd and nats-server here on loopback")
    s.add_argument("--router", choices=ROUTER_MODES, default=None,
                   help="how the frontend picks a worker (default: kv with more than one worker, else round-robin)")
    s.add_argument("--kv-prefill-weight", type=float, default=KV_PREFILL_WEIGHT,
                   help="kv routing: what a prompt block to prefill costs against a block a running request "
                        "holds (default: %(default)s, for CPU workers; Dynamo's own is 1)")
    s.add_argument("--watch", action="store_true", help="restart a worker (or the frontend) that dies")
    s.add_argument("--no-kv-events", action="store_true", help="workers publish no KV events (kv routing guesses)")
    add_lookahead_flags(s)
    for name in ("stop", "status", "front"):
        q = sub.add_parser(name, help="(internal) the front process of a deployment" if name == "front" else None)
        q.add_argument("--run-dir", default=DEFAULT_RUN_DIR)
        if name == "stop":
            q.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    return p


def main(argv: list[str] | None = None) -> int:
    from runtime.cli import lookahead_overrides

    args = build_parser().parse_args(argv)
    try:
        if args.action == "start":
            opts = {k: getattr(args, k) for k in ("num_host_blocks", "max_queue", "default_max_tokens",
                                                  "no_kv_events")}
            start(args.engine, workers=args.workers, http_port=args.http_port, run_dir=args.run_dir,
                  lookahead_overrides=lookahead_overrides(args), discovery=args.discovery,
                  model_name=args.model_name, namespace=args.namespace, python=args.python, timeout=args.timeout,
                  threads=args.threads, worker_options=opts, etcd_endpoints=args.etcd_endpoints,
                  nats_server=args.nats_server, start_etcd_nats=args.start_etcd_nats, device=args.device,
                  router_mode=args.router, watch=args.watch, kv_prefill_weight=args.kv_prefill_weight)
            return 0
        if args.action == "stop":
            stop(args.run_dir, grace_s=args.grace)
            return 0
        if args.action == "front":
            return run_front(args.run_dir)
        return print_status(status(args.run_dir))
    except LaunchError as e:
        print(f"dynamo_launch: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
