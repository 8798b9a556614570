"""The Dynamo deployment's operations without Dynamo: router and prefix-caching flags, the OpenAI
front's refusals, the watcher that restarts a dead worker, and `status` / `serve.sh status` on a
run dir whose worker died (stand-in processes whose command lines carry the launcher's markers).
tests/test_dynamo.py runs the same against a real frontend and workers."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy import dynamo_launch as dl
from deploy.http_front import Front, HttpError
from deploy.openai_front import check_openai_body, openai_error_body

ROOT = Path(__file__).resolve().parents[1]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


# ---- commands -------------------------------------------------------------------------------------
def test_router_mode_reaches_the_frontend_and_kv_is_the_default_with_two_workers():
    fe = dl.frontend_command("py", 9000, "file", "ns", "kv")
    assert fe[fe.index("--router-mode") + 1] == "kv"
    # kv routing prices a block to prefill at KV_PREFILL_WEIGHT (CPU workers); other modes have no such flag
    assert fe[fe.index("--router-prefill-load-scale") + 1] == "8"
    assert "--router-prefill-load-scale" not in dl.frontend_command("py", 9000, "file", "ns", "round-robin")
    fe2 = dl.frontend_command("py", 9000, "file", "ns", "kv", kv_prefill_weight=2.5)
    assert fe2[fe2.index("--router-prefill-load-scale") + 1] == "2.5"
    with pytest.raises(dl.LaunchError, match=r"^kv_prefill_weight: must be a number > 0"):
        dl.frontend_command("py", 9000, "file", "ns", "kv", kv_prefill_weight=0)
    assert dl.default_router(1) == "round-robin" and dl.default_router(2) == "kv"
    with pytest.raises(dl.LaunchError, match=r"^router: 'nearest' is unknown"):
        dl.frontend_command("py", 9000, "file", "ns", "nearest")
    with pytest.raises(dl.LaunchError, match=r"^router: "):
        dl.start("engines/none", workers=2, router_mode="fastest", progress=None)


def test_prefix_caching_false_reaches_the_worker_as_a_value():
    """A bool lookahead override is written as true/false (False was dropped before, so
    --prefix-caching false never reached a worker); worker flags stay plain switches."""
    cmd = dl.worker_command("py", "E", 0, run_dir=Path("/r"), model_name="m", namespace="n",
                            lookahead_overrides={"prefix_caching": False, "mode": "lookahead"},
                            worker_options={"no_verify_checksums": True, "no_kv_events": False})
    assert cmd[cmd.index("--prefix-caching") + 1] == "false" and "--no-verify-checksums" in cmd
    assert "--no-kv-events" not in cmd
    cmd = dl.worker_command("py", "E", 0, run_dir=Path("/r"), model_name="m", namespace="n",
                            lookahead_overrides={"prefix_caching": True})
    assert cmd[cmd.index("--prefix-caching") + 1] == "true"


def test_prefix_caching_reaches_the_triton_model_config(tmp_path):
    from serving import config_template as ct
    from tiny_engine import make_tiny_engine

    engine = make_tiny_engine(tmp_path / "e")
    assert ct.main(["--engine", str(engine), "--out", str(tmp_path / "repo"), "--device", "cpu",
                    "--prefix-caching", "false"]) == 0
    text = (tmp_path / "repo" / "lookahead_llm" / "config.pbtxt").read_text()
    assert '\\"prefix_caching\\": false' in text


def test_serve_sh_refuses_bad_router_and_prefix_caching_values():
    serve = str(ROOT / "scripts" / "serve.sh")
    for flags, text in ((["--router", "fastest"], "--router must be kv, round-robin or random, got 'fastest'"),
                        (["--prefix-caching", "maybe"], "--prefix-caching must be true or false, got 'maybe'")):
        r = subprocess.run([serve, "start", "--frontend", "dynamo", *flags], capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and text in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ---- the OpenAI front ------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, field", [
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    (CHAT, {"tool_choice": "auto"}, "tool_choice"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"logit_bias": {"5": 1}}, "logit_bias"),
    (CHAT, {"n": "2"}, "n"),
    (CHAT, {"n": 2.5}, "n"),
    (CHAT, {"logprobs": 2}, "logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
    (COMPLETIONS, {"suffix": "end"}, "suffix"),
    (COMPLETIONS, {"echo": True, "prompt": "a", "stream": True}, "echo"),        # echo: non-streaming only
    (COMPLETIONS, {"echo": True, "prompt": ["a", "b"]}, "echo"),                 # one prompt a request
    (COMPLETIONS, {"echo": "yes", "prompt": "a"}, "echo"),
    (COMPLETIONS, {"logprobs": True}, "logprobs"),
    (COMPLETIONS, {"prompt_logprobs": "2", "prompt": "a"}, "prompt_logprobs"),
    (COMPLETIONS, {"prompt_logprobs": 2, "prompt": "a", "stream": True}, "prompt_logprobs"),    # as vLLM
    (COMPLETIONS, {"prompt_logprobs": 0, "prompt": ["a", "b"]}, "prompt_logprobs"),
    (CHAT, {"prompt_logprobs": 1.5}, "prompt_logprobs"),
    (CHAT, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_the_front_refuses_what_no_worker_sees_by_name(path, body, field):
    with pytest.raises(HttpError) as err:
        check_openai_body(path, {"model": "m", "max_tokens": 4, **body})
    assert err.value.status == 400 and err.value.field == field
    assert str(err.value).startswith(field + ":") and "\n" not in str(err.value)
    doc = json.loads(openai_error_body(400, str(err.value), field))
    assert doc["error"]["param"] == field and doc["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path, body", [
    (CHAT, {"tools": [], "tool_choice": "none", "logit_bias": {}, "n": 2, "logprobs": True, "top_logprobs": 0}),
    (COMPLETIONS, {"echo": False, "suffix": None, "logprobs": 2, "n": 1}),
    (COMPLETIONS, {"echo": True, "prompt": [[5, 6, 7]], "logprobs": 1, "max_tokens": 1}),    # lm-eval's request
    (COMPLETIONS, {"echo": True, "prompt": [5, 6, 7], "stream": False}),
    (COMPLETIONS, {"prompt_logprobs": 3, "prompt": "a", "echo": True, "logprobs": 2}),
    (CHAT, {"prompt_logprobs": 2, "stream": False}),
    ("/v1/models", {"tools": [1]}),
])
def test_the_front_passes_what_is_off_or_served(path, body):
    check_openai_body(path, body)


def test_the_front_answers_its_refusals_before_the_upstream(tmp_path):
    """A refused body never reaches the frontend; others are proxied unchanged."""
    from deploy.openai_front import check_openai_request

    async def main():
        seen = []

        async def upstream(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int([h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0])
            seen.append(await reader.readexactly(length))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
            await writer.drain()
            writer.close()
        up = await asyncio.start_server(upstream, "127.0.0.1", 0)
        front = Front("127.0.0.1", 0, "127.0.0.1", up.sockets[0].getsockname()[1], check=check_openai_request,
                      error_body=openai_error_body, upstream_name="the Dynamo frontend")
        await front.start()
        port = front.server.sockets[0].getsockname()[1]
        serve = asyncio.ensure_future(front.serve())

        async def post(body):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            data = json.dumps(body).encode()
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(data), data))
            await w.drain()
            text = await r.read()
            w.close()
            return text
        refused = await post({"model": "m", "messages": [], "tools": [{"type": "function"}]})
        served = await post({"model": "m", "messages": []})
        front.close()
        serve.cancel()
        up.close()
        return refused, served, seen
    refused, served, seen = asyncio.run(main())
    assert refused.startswith(b"HTTP/1.1 400") and b'"param": "tools"' in refused
    assert served.startswith(b"HTTP/1.1 200") and len(seen) == 1 and b"tools" not in seen[0]


def test_echo_puts_the_prompt_and_its_logprobs_in_front_of_each_choice():
    """The front's rewrite of a completions `echo`: the request asks for the worker's engine_data
    and k alternatives per prompt token; the answer gets the prompt's text, tokens,
    log-probabilities (None first), top alternatives (k of them plus the prompt token) and offsets
    in front of the output's, and loses the engine_data it did not ask for. Other requests are not
    touched (tests/test_openai_echo.py has the rest)."""
    from deploy.http_front import Request
    from deploy.openai_front import prompt_logprobs_rewrite

    def request(body):
        req = Request("POST", "/v1/completions", "HTTP/1.1", [("Content-Type", "application/json")])
        req.body = json.dumps(body).encode()
        return req
    assert prompt_logprobs_rewrite(request({"prompt": "a", "echo": False})) is None
    req = request({"model": "m", "prompt": "Hi there", "max_tokens": 1, "logprobs": 1, "echo": True})
    transform = prompt_logprobs_rewrite(req)
    sent = json.loads(req.body)
    assert sent["nvext"] == {"extra_fields": ["engine_data"]} and sent["prompt_logprobs"] == 1
    plp = [None, {"7": {"logprob": -2.0, "rank": 3, "decoded_token": " there"},
                  "9": {"logprob": -0.5, "rank": 1, "decoded_token": "!"},
                  "4": {"logprob": -1.0, "rank": 2, "decoded_token": ","}}]
    answer = {"choices": [{"index": 0, "text": " you", "logprobs": {"tokens": [" you"], "token_logprobs": [-0.1],
                                                                  "top_logprobs": [{" you": -0.1}], "text_offset": []}}],
              "usage": {"prompt_tokens": 2},
              "nvext": {"engine_data": {"prompt_logprobs": plp, "prompt_token_ids": [3, 7],
                                        "prompt_tokens": ["Hi", " there"]}}}
    out = json.loads(transform(200, json.dumps(answer).encode()))
    choice = out["choices"][0]
    assert choice["text"] == "Hi there you" and "nvext" not in out and "prompt_logprobs" not in choice
    assert choice["logprobs"] == {"tokens": ["Hi", " there", " you"], "token_logprobs": [None, -2.0, -0.1],
                                  "top_logprobs": [None, {"!": -0.5, " there": -2.0}, {" you": -0.1}],
                                  "text_offset": [0, 2, 8]}
    assert transform(400, b'{"error": 1}') == b'{"error": 1}'           # errors pass as they are
    with pytest.raises(ValueError, match="no prompt log-probabilities"):
        transform(200, json.dumps({"choices": []}).encode())
    # token-id prompts: the text is the tokens' own; echo without logprobs: the text only, k = 0 asked
    req = request({"prompt": [[3, 7]], "echo": True, "nvext": {"extra_fields": ["engine_data"]}})
    transform = prompt_logprobs_rewrite(req)
    assert json.loads(req.body)["prompt_logprobs"] == 0
    out = json.loads(transform(200, json.dumps(answer).encode()))
    assert out["choices"][0]["text"] == "Hi there you" and out["choices"][0]["logprobs"]["tokens"] == [" you"]
    assert "engine_data" in out["nvext"]                                 # asked for: kept


# ---- the watcher and status ------------------------------------------------------------------------
def _stand_in(marker: str, seconds: float = 600) -> list[str]:
    """A process whose command line carries the launcher's marker for its kind."""
    return [sys.executable, "-c", f"import time; time.sleep({seconds})", marker]


def _fake_run_dir(tmp_path: Path, workers: int = 2, watch: bool = True) -> tuple[Path, dict]:
    run = tmp_path / "run"
    run.mkdir()
    commands = {"frontend": {"cmd": _stand_in("dynamo.frontend"), "env": {}}}
    procs = {"frontend": subprocess.Popen(commands["frontend"]["cmd"], start_new_session=True),
             "front": subprocess.Popen(_stand_in("deploy.dynamo_launch"), start_new_session=True)}
    for i in range(workers):
        commands[f"worker-{i}"] = {"cmd": _stand_in("serving.dynamo_worker"), "env": {"DYN_SYSTEM_PORT": "1"}}
        procs[f"worker-{i}"] = subprocess.Popen(commands[f"worker-{i}"]["cmd"], start_new_session=True)
        (run / f"worker-{i}.ready").write_text("{}")
        (run / f"worker-{i}.stats.json").write_text(json.dumps({"mode": "dense", "free_blocks": 7, "total_blocks": 8,
                                                                "num_running": 1}))
    for name, proc in procs.items():
        (run / f"{name}.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + 10          # until each has exec'd (its command line carries the marker)
    while not all(dl._alive(p.pid, dl._marker(n)) for n, p in procs.items()):
        assert time.monotonic() < deadline, "the stand-in processes did not start"
        time.sleep(0.02)
    dep = {"url": "http://127.0.0.1:1/v1", "model": "m", "http_port": 1, "internal_http_port": 1, "discovery": "file",
           "worker_pids": [procs[f"worker-{i}"].pid for i in range(workers)], "worker_system_ports": [],
           "router_mode": "kv", "watch": watch, "env": {}, "cwd": str(ROOT), "commands": commands}
    (run / "deployment.json").write_text(json.dumps(dep))
    return run, procs


def _kill(procs: dict) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(60)
def test_watcher_restarts_a_killed_worker_and_status_follows(tmp_path):
    run, procs = _fake_run_dir(tmp_path)
    dep = json.loads((run / "deployment.json").read_text())
    watcher = dl.Watcher(run, dep, say=lambda m: None)
    try:
        assert watcher.check() == []                       # all alive: nothing to do
        os.killpg(procs["worker-1"].pid, signal.SIGKILL)
        procs["worker-1"].wait()
        st = dl.status(run)
        assert st["workers"]["worker-1"]["up"] is False and st["workers"]["worker-0"]["up"] is True
        lines = []
        assert dl.print_status(st, out=lines.append) == 1
        assert any(line.startswith("  worker-1: DOWN") for line in lines), lines
        assert not any("worker-1: up" in line for line in lines)
        assert watcher.check() == ["worker-1"]
        new_pid = int((run / "worker-1.pid").read_text())
        deadline = time.monotonic() + 10
        while not dl._alive(new_pid, "serving.dynamo_worker"):
            assert time.monotonic() < deadline, "the restarted worker is not running"
            time.sleep(0.02)
        assert new_pid != procs["worker-1"].pid
        assert json.loads((run / "watch.json").read_text())["restarts"] == {"worker-1": 1}
        assert not (run / "worker-1.ready").exists()          # the new worker writes it once registered
        lines = []
        assert dl.print_status(dl.status(run), out=lines.append) == 1
        assert any("worker-1: starting (pid %d, restarts 1" % new_pid in line for line in lines), lines
        (run / "worker-1.ready").write_text("{}")
        assert dl.status(run)["workers"]["worker-1"]["up"] is True
        assert "---- watch: restarting worker-1" in (run / "worker-1.log").read_text()
    finally:
        _kill(procs)
        for child in watcher.children.values():
            child.kill()
            child.wait()


@pytest.mark.timeout(60)
def test_watcher_removes_a_dead_workers_discovery_entries(tmp_path):
    """A SIGKILLed worker cannot unregister: its file-discovery entries (named by the instance id in
    its ready file) go before it is restarted, so the frontend stops routing to it."""
    run, procs = _fake_run_dir(tmp_path)
    dep = json.loads((run / "deployment.json").read_text())
    inst = run / "kv" / "v1" / "instances"
    inst.mkdir(parents=True)
    dead, other = inst / "lookahead%2Fbackend%2Fgenerate%2F5f00c0ffee", inst / "lookahead%2Fbackend%2Fgenerate%2Fabc1"
    dead.write_text("{}")
    other.write_text("{}")
    (inst / "lookahead%2Fbackend%2Fworker%5Fkv%5Fquery%5Fsource%5F12%2F5f00c0ffee").write_text("{}")
    (run / "worker-1.ready").write_text(json.dumps({"instance_id": "5f00c0ffee"}))
    watcher = dl.Watcher(run, dep, say=lambda m: None)
    try:
        os.killpg(procs["worker-1"].pid, signal.SIGKILL)
        procs["worker-1"].wait()
        assert watcher.check() == ["worker-1"]
        assert sorted(p.name for p in inst.iterdir()) == [other.name]
        assert "removed its 2 discovery entries" in watcher.state["deaths"]["worker-1"]
    finally:
        _kill(procs)
        for child in watcher.children.values():
            child.kill()
            child.wait()


@pytest.mark.timeout(60)
def test_watcher_gives_up_on_a_worker_that_keeps_dying(tmp_path, monkeypatch):
    monkeypatch.setattr(dl, "RESTART_BACKOFF_S", (0, 0))
    run, procs = _fake_run_dir(tmp_path, workers=1)
    dep = json.loads((run / "deployment.json").read_text())
    dep["commands"]["worker-0"]["cmd"] = [sys.executable, "-c", "raise SystemExit(3)", "serving.dynamo_worker"]
    watcher = dl.Watcher(run, dep, say=lambda m: None)
    try:
        os.killpg(procs["worker-0"].pid, signal.SIGKILL)
        procs["worker-0"].wait()
        for _ in range(40):
            watcher.check()
            if watcher.state["gave_up"]:
                break
            time.sleep(0.1)
        assert "worker-0" in watcher.state["gave_up"] and "code 3" in watcher.state["gave_up"]["worker-0"]
        assert watcher.state["restarts"]["worker-0"] == 3           # the first restart and one per delay
        lines = []
        dl.print_status(dl.status(run), out=lines.append)
        assert any("worker-0: DOWN" in line and "gave up" in line for line in lines), lines
    finally:
        _kill(procs)


@pytest.mark.timeout(60)
def test_stop_stops_the_watching_front_first(tmp_path):
    run, procs = _fake_run_dir(tmp_path)
    try:
        assert [dl._tier(n) for n in ("front", "worker-0", "frontend", "etcd")] == [0, 1, 2, 3]
        stopped = dl.stop(run, grace_s=2, progress=None)
        assert stopped == ["front", "frontend", "worker-0", "worker-1"]
        assert dl.status(run)["running"] == {} and not list(run.glob("*.pid"))
        lines = []
        assert dl.print_status(dl.status(run), out=lines.append) == 3
    finally:
        _kill(procs)


@pytest.mark.timeout(60)
def test_serve_sh_status_finds_a_dynamo_run_dir_and_names_the_dead_worker(tmp_path):
    """The probe's finding: `serve.sh status --run-dir DIR` said "not running" (exit 3) for a Dynamo
    run dir whose frontend and other worker still served, and `--frontend dynamo` exited 0 with the
    dead worker's last stats. Now both say which worker is down and exit 1."""
    run, procs = _fake_run_dir(tmp_path, watch=False)
    serve = str(ROOT / "scripts" / "serve.sh")
    try:
        os.killpg(procs["worker-0"].pid, signal.SIGKILL)
        procs["worker-0"].wait()
        for flags in ([], ["--frontend", "dynamo"]):
            r = subprocess.run([serve, "status", "--run-dir", str(run), *flags], capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 1, r.stdout + r.stderr
            assert "worker-0: DOWN" in r.stdout and "worker-1: up" in r.stdout and "not running (" not in r.stdout
            assert "--watch" in r.stdout                  # how to get dead workers restarted
    finally:
        _kill(procs)
    r = subprocess.run([serve, "status", "--run-dir", str(run)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "not running" in r.stdout
