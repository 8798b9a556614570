"""serve.sh under faults, against a real tritonserver (tiny engine): request bodies that crash
tritonserver 2.51, a dead python stub, a killed server, paths with spaces, a start that cannot succeed.

Runs two serve.sh run dirs (each with a space in its path and in its engine dir's path): `watched`
(--watch) for the module, and one without --watch for the death tests. Each test leaves no process
and no /dev/shm region of its runs behind, even when it fails (ServeSh.cleanup).
"""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from deploy.supervisor import pid_alive, shm_prefix_for
from deploy.triton_env import shm_regions
from triton_fixtures import ServeSh, triton_backend_dir, triton_engine_dir  # noqa: F401

pytestmark = [pytest.mark.triton, pytest.mark.timeout(180)]
MODEL = "lookahead_llm"
FIVE_MB = 5_000_000


@pytest.fixture(scope="module")
def spaced_engine(tmp_path_factory, triton_engine_dir, triton_backend_dir) -> object:
    dest = tmp_path_factory.mktemp("faults") / "engine dir"
    shutil.copytree(triton_engine_dir, dest)
    return dest


@pytest.fixture(scope="module")
def watched(tmp_path_factory, spaced_engine):
    run = ServeSh(tmp_path_factory.mktemp("faults") / "run dir (watched)", spaced_engine)
    try:
        run.sh("start", "--watch", "--timeout", "60", timeout=90, check=True)
        yield run
    finally:
        run.cleanup()
    assert not run.run_processes() and not shm_regions(run.shm_prefix)


@pytest.fixture
def unwatched(tmp_path, spaced_engine):
    run = ServeSh(tmp_path / "run dir", spaced_engine)
    try:
        yield run
    finally:
        run.cleanup()
    assert not run.run_processes() and not shm_regions(run.shm_prefix)


def post(url: str, body: bytes, timeout: float = 30, headers: dict | None = None) -> tuple[int, dict]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, body, headers=headers or {}), timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def generate(run: ServeSh, **fields) -> tuple[int, dict]:
    body = json.dumps({"text_input": "hello", "max_tokens": 2, **fields}).encode()
    return post(f"{run.http_url}/v2/models/{MODEL}/generate", body)


def raw_http(port: int, request: bytes, timeout: float = 30) -> bytes:
    """Send raw bytes, return everything the server sends until it closes (or the timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    return out


def grpc_inputs(**values):
    from tritonclient.grpc import InferInput

    out = []
    for name, v in values.items():
        if isinstance(v, (str, bytes)):
            arr = np.array([v.encode() if isinstance(v, str) else v], dtype=np.object_)
            dtype = "BYTES"
        elif isinstance(v, bool):
            arr, dtype = np.array([v]), "BOOL"
        else:
            arr, dtype = np.array([v], np.int32), "INT32"
        t = InferInput(name, [1], dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def grpc_stream(url: str, ins, on_first=None, timeout: float = 60) -> dict:
    """One streamed gRPC request; returns {"responses": n, "error": str | None, "seconds": s}."""
    import tritonclient.grpc.aio as grpcclient

    from serving.grpc_stream import stream_request

    out = {"responses": 0, "error": None}

    async def main():
        client = grpcclient.InferenceServerClient(url)
        t0 = time.monotonic()

        def on_response(result, error):
            if error is not None:
                out["error"] = str(error)
                return False
            out["responses"] += 1
            if out["responses"] == 1 and on_first:
                on_first()
        try:
            await asyncio.wait_for(stream_request(client, MODEL, ins, on_response), timeout)
        except asyncio.TimeoutError:
            out["error"] = "HUNG"
        except Exception as e:           # the stream's end as the client library reports it
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            out["seconds"] = time.monotonic() - t0
            await client.close()
    asyncio.run(main())
    return out


def wait_until(predicate, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(every)


# -- the watched run ------------------------------------------------------------------------------
def test_serves_from_a_run_dir_and_an_engine_dir_with_spaces(watched):
    assert " " in str(watched.run_dir) and " " in str(watched.engine_dir)
    code, out = generate(watched)
    assert code == 200 and out["num_output_tokens"] == 2, out
    status = watched.sh("status", timeout=30)
    assert status.returncode == 0 and status.stdout.startswith("serving"), status.stdout + status.stderr
    # the stub was launched through a shell-safe alias: its argv has no space
    (stub,) = watched.stub_pids()
    argv = open(f"/proc/{stub}/cmdline", "rb").read().split(b"\0")
    assert all(b" " not in a for a in argv), argv


def test_bodies_that_crash_tritonserver_are_refused_and_it_keeps_serving(watched):
    pid = watched.server_pid()
    url = f"{watched.http_url}/v2/models/{MODEL}"
    big = "x" * FIVE_MB
    refused = {
        "5 MB prompt on /generate": post(url + "/generate", json.dumps({"text_input": big}).encode()),
        "5 MB stop on /generate": post(url + "/generate", json.dumps(
            {"text_input": "hi", "max_tokens": 1, "stop": [big]}).encode()),
        "5 MB tensor on /infer": post(url + "/infer", json.dumps({"inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [big]}]}).encode()),
        # 1 MB of nested objects crashed it as well (a stack overflow while parsing)
        "175,000 nested objects": post(url + "/generate", b'{"text_input":"x","parameters":' +
                                       b'{"a":' * 175_000 + b"1" + b"}" * 175_000 + b"}"),
    }
    for name, (code, body) in refused.items():
        assert code in (400, 413) and body.get("error"), (name, code, body)
    assert refused["5 MB prompt on /generate"][0] == 413 and "exceeds" in refused["5 MB prompt on /generate"][1]["error"]
    # a chunked 5 MB body (no Content-Length): counted as it arrives
    body = json.dumps({"text_input": big}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 65536]), body[i:i + 65536]) for i in range(0, len(body), 65536))
    reply = raw_http(watched.http_port, b"POST /v2/models/lookahead_llm/generate HTTP/1.1\r\nHost: x\r\n"
                                        b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    # gRPC has its own message limit and survives 5 MB (50 MB tested by hand): a 5 MB stop string
    # gets an answer (the model may refuse it as too long: an error naming `stop`), not a crash
    r = grpc_stream(watched.grpc_url, grpc_inputs(text_input="hi", max_tokens=1, stop="y" * FIVE_MB))
    assert (r["error"] is None and r["responses"] == 1) or "stop" in r["error"], r
    # still the same server, never restarted, and it serves the next request
    code, out = generate(watched)
    assert code == 200 and out["num_output_tokens"] == 2
    assert watched.server_pid() == pid and watched.state()["RESTARTS"] == "0"


def test_the_front_passes_streams_and_keep_alive_through(watched):
    conn = http.client.HTTPConnection("127.0.0.1", watched.http_port, timeout=30)
    try:
        for _ in range(2):                              # two requests on one connection
            conn.request("POST", f"/v2/models/{MODEL}/generate_stream",
                         json.dumps({"text_input": "hello", "max_tokens": 5, "stream": True}))
            r = conn.getresponse()
            events = [json.loads(line[5:]) for line in r.read().decode().splitlines() if line.startswith("data:")]
            assert r.status == 200 and len(events) == 5 and events[-1]["finish_reason"] == "length"
        # ambiguous framing (request smuggling) is refused
        reply = raw_http(watched.http_port, b"POST /v2/models/lookahead_llm/generate HTTP/1.1\r\nHost: x\r\n"
                                            b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]
    finally:
        conn.close()


def test_a_dead_stub_is_restarted_and_streams_in_flight_get_an_error(watched):
    old_pid, (old_stub,) = watched.server_pid(), watched.stub_pids()
    old_regions = set(shm_regions(watched.shm_prefix))
    assert old_regions
    http_started, grpc_started = threading.Event(), threading.Event()
    results: dict = {}

    def http_stream():
        conn = http.client.HTTPConnection("127.0.0.1", watched.http_port, timeout=60)
        conn.request("POST", f"/v2/models/{MODEL}/generate_stream",
                     json.dumps({"text_input": "go on", "max_tokens": 3000, "stream": True}))
        r = conn.getresponse()
        data = b""
        try:
            while chunk := r.read1(65536):
                data += chunk
                http_started.set()
            results["http"] = ("complete", data)
        except (http.client.IncompleteRead, ConnectionError) as e:
            results["http"] = (type(e).__name__, data)
        conn.close()

    threads = [threading.Thread(target=http_stream),
               threading.Thread(target=lambda: results.update(grpc=grpc_stream(
                   watched.grpc_url, grpc_inputs(text_input="go on", max_tokens=3000, stream=True),
                   on_first=grpc_started.set)))]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: http_started.is_set() and grpc_started.is_set(), 20, "both streams started")
        time.sleep(0.3)
        os.kill(old_stub, signal.SIGKILL)
        status = watched.sh("status", timeout=30)
        assert status.returncode == 1 and status.stdout.startswith("not serving"), status.stdout
        for t in threads:
            t.join(30)
            assert not t.is_alive(), f"a stream still hangs: {results}"
    finally:
        for t in threads:
            t.join(60)
    log = (watched.run_dir / "supervisor.log").read_text()[-3000:]
    kind, data = results["http"]
    assert kind == "IncompleteRead" and b'data: {"error": "tritonserver closed the stream' in data[-400:], \
        (kind, data[-300:], log)
    assert results["grpc"]["error"] and "UNAVAILABLE" in results["grpc"]["error"], (results["grpc"], log)
    # ready *after* the restart was recorded: a state file read before the supervisor noticed the
    # death still says ready (seen once under load: status then found it restarting)
    wait_until(lambda: (st := watched.state()).get("STATE") == "ready" and int(st.get("RESTARTS", 0)) >= 1, 60,
               "the server restarted")
    status = watched.sh("status", timeout=30)
    assert status.returncode == 0, status.stdout
    state = watched.state()
    # the monitor sees the dead stub, or (seen once under load) tritonserver aborting over it first
    assert int(state["RESTARTS"]) >= 1 and ("stub died" in state["LAST_DEATH"]
                                            or "tritonserver exited with signal SIGABRT" in state["LAST_DEATH"]), state
    assert watched.server_pid() != old_pid and not pid_alive(old_pid)
    assert not old_regions & set(shm_regions(watched.shm_prefix)), "the dead server's regions are left"
    # the dead server's log was kept: rotated to .1 (.2 if a restart attempt failed), not truncated
    logs = [watched.run_dir / f"tritonserver.log.{i}" for i in range(1, 6)]
    assert any(f" {old_pid} " in p.read_text() for p in logs if p.exists()), log
    assert f" {watched.server_pid()} " in (watched.run_dir / "tritonserver.log").read_text()
    code, out = generate(watched)
    assert code == 200 and out["num_output_tokens"] == 2


def test_stop_is_quick_and_leaves_nothing(watched):
    t0 = time.monotonic()
    r = watched.sh("stop", timeout=60)
    assert r.returncode == 0 and "stopped" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "dynamo" not in r.stdout + r.stderr   # a Triton run dir only
    assert time.monotonic() - t0 < 25
    assert not watched.run_processes() and not shm_regions(watched.shm_prefix)
    assert watched.sh("status", timeout=30).returncode == 3


# -- without --watch ----------------------------------------------------------------------------
@pytest.mark.slow
def test_without_watch_deaths_are_reported_cleaned_up_and_stop_takes_seconds(unwatched):
    run = unwatched
    run.sh("start", "--timeout", "60", timeout=90, check=True)
    # 1. the stub dies: status says the model cannot serve; stop takes seconds, not 30
    (stub,) = run.stub_pids()
    os.kill(stub, signal.SIGKILL)
    wait_until(lambda: run.state().get("STATE") == "stub-dead", 10, "the supervisor saw the stub die")
    status = run.sh("status", timeout=30)
    assert status.returncode == 1 and "not healthy" in status.stdout, status.stdout
    t0 = time.monotonic()
    assert run.sh("stop", timeout=60).returncode == 0
    assert time.monotonic() - t0 < 10
    assert not run.run_processes() and not shm_regions(run.shm_prefix)
    first_pid_line = (run.run_dir / "tritonserver.log").read_text().splitlines()[0]

    # 2. the next start keeps the previous log; the server is killed while its stub hangs (SIGSTOP:
    #    it cannot notice its parent died, an orphan holding shared memory): both are cleaned up
    run.sh("start", "--timeout", "60", "--prefix-caching", "false", timeout=90, check=True)
    assert (run.run_dir / "tritonserver.log.1").read_text().splitlines()[0] == first_pid_line
    # --prefix-caching reaches the model's lookahead overrides
    config = (run.run_dir / "model_repo" / "lookahead_llm" / "config.pbtxt").read_text()
    assert '\\"prefix_caching\\": false' in config and run.state()["PREFIX_CACHING"] == "false"
    server, (stub,) = run.server_pid(), run.stub_pids()
    assert shm_regions(run.shm_prefix)
    os.kill(stub, signal.SIGSTOP)
    os.kill(server, signal.SIGKILL)
    wait_until(lambda: not run.run_processes(), 15, "the supervisor cleaned up and exited")
    assert not pid_alive(stub) and not shm_regions(run.shm_prefix)
    status = run.sh("status", timeout=30)
    assert status.returncode == 3 and "SIGKILL" in status.stdout, status.stdout

    # 3. everything killed at once (the supervisor too), a hung stub left holding its regions:
    #    the next start removes them (and only then starts its own server)
    run.sh("start", "--timeout", "60", timeout=90, check=True)
    supervisor, server, (stub,) = int(run.state()["SUPERVISOR_PID"]), run.server_pid(), run.stub_pids()
    os.kill(supervisor, signal.SIGKILL)
    os.kill(stub, signal.SIGSTOP)
    os.kill(server, signal.SIGKILL)
    wait_until(lambda: not pid_alive(server) and not pid_alive(supervisor), 10, "both died")
    left = set(shm_regions(run.shm_prefix))
    assert left and pid_alive(stub)
    run.sh("start", "--timeout", "60", timeout=90, check=True)
    assert not pid_alive(stub) and not left & set(shm_regions(run.shm_prefix))
    assert "removed what an earlier run" in (run.run_dir / "supervisor.log").read_text()


def test_a_start_that_cannot_succeed_fails_fast_with_the_log(tmp_path, spaced_engine, triton_backend_dir):
    run = ServeSh(tmp_path / "bad run", spaced_engine)
    # a stub that exits at once, as one whose launch failed (the split path did that): tritonserver
    # 2.51 then waits for it forever. Same size and mtime as the real one, so it is not replaced.
    real = triton_backend_dir / "python" / "triton_python_backend_stub"
    fake = run.run_dir / "backends" / "python" / "triton_python_backend_stub"
    fake.parent.mkdir(parents=True)
    script = b"#!/bin/sh\necho 'fake stub: cannot start' >&2\nexit 3\n"
    fake.write_bytes(script + b"#" * (real.stat().st_size - len(script)))
    fake.chmod(0o755)
    os.utime(fake, (real.stat().st_atime, real.stat().st_mtime))
    try:
        t0 = time.monotonic()
        r = run.sh("start", "--timeout", "120", timeout=150, env={"LOOKAHEAD_STUB_GRACE_S": "4"})
        took = time.monotonic() - t0
        assert r.returncode != 0 and took < 40, (took, r.stdout, r.stderr)
        assert "no python backend stub" in r.stderr and "fake stub: cannot start" in r.stderr, r.stderr
        assert "---- last lines of" in r.stderr
        assert not run.run_processes() and not shm_regions(run.shm_prefix)
    finally:
        run.cleanup()


def test_the_shm_prefix_is_the_run_dirs_own(tmp_path):
    a, b = shm_prefix_for(tmp_path / "a b"), shm_prefix_for(tmp_path / "a_b")
    assert a != b and a == shm_prefix_for(str(tmp_path / "a b") + "/") and a.replace("_", "").isalnum()


# -- the front's parsing, without a server --------------------------------------------------------
def test_the_front_refuses_ambiguous_framing_and_bad_json():
    from deploy.http_front import HttpError, body_framing, check_json, parse_head

    assert body_framing([("Content-Length", "12")]) == ("length", 12)
    assert body_framing([("Transfer-Encoding", "chunked")]) == ("chunked", 0)
    assert body_framing([]) == ("none", 0)
    for headers, status in (([("Content-Length", "3"), ("Transfer-Encoding", "chunked")], 400),
                            ([("Content-Length", "3"), ("content-length", "4")], 400),
                            ([("Content-Length", "-1")], 400), ([("Content-Length", "1e3")], 400),
                            ([("Transfer-Encoding", "gzip, chunked")], 501)):
        with pytest.raises(HttpError) as e:
            body_framing(headers)
        assert e.value.status == status, headers
    with pytest.raises(HttpError, match="folding"):
        parse_head(b"POST / HTTP/1.1\r\nA: b\r\n c")
    with pytest.raises(HttpError) as e:
        parse_head(b"POST / HTTP/2.0")
    assert e.value.status == 505
    check_json(b'{"text_input": "x"}', [])
    check_json(b'{"a": 1}' + b"\x00\x01binary", [("Inference-Header-Content-Length", "8")])
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"a": ', b'{"text_input": "\xff"}'):
        with pytest.raises(HttpError) as e:
            check_json(body, [])
        assert e.value.status == 400


def test_the_front_turns_a_full_queue_into_503_with_retry_after():
    """tritonserver 2.51 answers every model error 400; the front makes the retryable one 503."""
    import asyncio
    from deploy.http_front import Front

    full = b'{"error":"the waiting queue is full (4 requests); retry later"}'
    sse = b'data: {"error":"the waiting queue is full (4 requests); retry later"}\n\n'
    answers = {b"/full": b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(full), full),
               b"/full-sse": b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(sse), sse),
               b"/other": b'HTTP/1.1 400 Bad Request\r\nContent-Length: 17\r\n\r\n{"error":"other"}'}

    async def upstream(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        writer.write(answers[head.split(b" ")[1]])
        await writer.drain()
        writer.close()

    async def main():
        up = await asyncio.start_server(upstream, "127.0.0.1", 0)
        front = Front("127.0.0.1", 0, "127.0.0.1", up.sockets[0].getsockname()[1])
        await front.start()
        port = front.server.sockets[0].getsockname()[1]
        got = {}
        for path in ("/full", "/full-sse", "/other"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
                         % path.encode())
            await writer.drain()
            got[path] = await asyncio.wait_for(reader.read(), 10)
            writer.close()
        front.close()
        up.close()
        return got

    got = asyncio.run(main())
    for path in ("/full", "/full-sse"):
        assert got[path].startswith(b"HTTP/1.1 503 Service Unavailable"), got[path][:80]
        assert b"Retry-After: 1" in got[path] and b"the waiting queue is full" in got[path]
    assert got["/other"].startswith(b"HTTP/1.1 400") and b"Retry-After" not in got["/other"]
