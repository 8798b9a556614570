"""The front's /generate and /generate_stream over gRPC (deploy/generate_front.py), against a real
tritonserver (tiny engine) and a Front in this process.

Issue 41 items 2, 6 and 7: through tritonserver's HTTP port a client that leaves never cancels
(its prompt is computed and `max_tokens` generated), and the body's integers wrap to INT32 or
answer 500. Through the front: the same answers as tritonserver's own /generate, a bad field is a
400 naming it, and a client that leaves aborts its request in the engine, mid-prefill included;
each disconnect test counts the engine's work (its metrics), not time.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from deploy.http_front import Front
from triton_fixtures import start_server, triton_backend_dir, triton_engine_dir  # noqa: F401

pytestmark = [pytest.mark.triton, pytest.mark.timeout(180)]
MODEL = "lookahead_llm"
PROMPT_TOKENS = 3000          # the byte tokenizer: one token a character
PREFILL_CHUNK = 1             # a long prompt is then thousands of engine steps (seconds on any machine
                              # against the ~0.5 s a disconnect takes to reach the engine): it lands mid-prefill


@pytest.fixture(scope="module")
def server(tmp_path_factory, triton_engine_dir, triton_backend_dir):
    from deploy.supervisor import clean_run

    srv = start_server(tmp_path_factory.mktemp("generate_front"), triton_engine_dir, triton_backend_dir,
                       prefill_chunk=PREFILL_CHUNK)
    yield srv
    try:
        srv.stop()
    finally:
        clean_run(srv.shm_prefix)


@pytest.fixture(scope="module")
def front(server):
    """A Front on its own event loop thread: tritonserver's HTTP port behind, its gRPC port for /generate*."""
    loop = asyncio.new_event_loop()
    f = Front("127.0.0.1", 0, "127.0.0.1", server.http_port, grpc_upstream=("127.0.0.1", server.grpc_port))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(f.start(), loop).result(10)
    f.url = f"http://127.0.0.1:{f.server.sockets[0].getsockname()[1]}"
    yield f
    asyncio.run_coroutine_threadsafe(f.aclose(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def post(url: str, body: dict | bytes) -> tuple[int, dict, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data), timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


SAME = [
    {"text_input": "hello", "max_tokens": 3},
    {"text_input": "hello", "max_tokens": 2, "exclude_input_in_output": True,
     "sampling_parameters": json.dumps({"n": 2, "logprobs": 1, "temperature": 1.0, "seed": 3})},
    {"text_input": "x", "max_tokens": 2, "n": 2, "stop": ["zz"]},
    {"text_input": "x", "max_tokens": 100_000},                    # refused by the model: its 400 passes through
]


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_answers_equal_tritonservers_own(server, front, route):
    for body in SAME + [{**b, "stream": True} for b in SAME if route == "generate_stream"]:
        direct = post(f"{server.http_url}/v2/models/{MODEL}/{route}", body)
        proxied = post(f"{front.url}/v2/models/{MODEL}/{route}", body)
        assert proxied[0] == direct[0] and proxied[2] == direct[2], (body, direct, proxied)
        assert proxied[1]["Content-Type"] == direct[1]["Content-Type"]
    code, _, out = post(f"{front.url}/v2/models/nope/generate", {"text_input": "x"})
    assert code == 404 and b"unknown model" in out


BAD = {   # body -> the field its 400 names; through tritonserver's own port each was served or a 500
    "max_tokens 2**32 + 3": ({"max_tokens": 4294967299}, "max_tokens: "),
    "top_k 2**32 + 1": ({"top_k": 4294967297}, "top_k: "),
    "text_input a number": ({"text_input": 5}, "text_input: "),
    "max_tokens 3.5": ({"max_tokens": 3.5}, "max_tokens: "),
    "stream 'yes'": ({"stream": "yes"}, "stream: "),
    "stop [1, 2]": ({"stop": [1, 2]}, "stop: "),
    "sampling_parameters an object": ({"sampling_parameters": {"n": 2}}, "sampling_parameters: "),
    "seed 2**63": ({"seed": 2 ** 63}, "seed: "),
    "a body that is not an object": ([], "body: "),
}


def test_a_bad_field_is_a_400_naming_it_before_anything_goes_upstream(server, front):
    before = server.metrics()
    refused = front.refused
    for name, (body, field) in BAD.items():
        doc = body if isinstance(body, list) else {"text_input": "hi", "max_tokens": 2, **body}
        for route in ("generate", "generate_stream"):
            code, headers, out = post(f"{front.url}/v2/models/{MODEL}/{route}", doc)
            text = out.decode()
            error = json.loads(text[len("data: "):] if route == "generate_stream" else text)["error"]
            assert code == 400 and error.startswith(field), (name, route, code, out)
    assert front.refused == refused + 2 * len(BAD)
    after = server.metrics()
    assert after["lookahead_prompt_tokens_total"] == before["lookahead_prompt_tokens_total"]   # nothing reached it
    # the lone surrogate, as raw JSON (json.dumps would escape it into a valid pair)
    code, _, out = post(f"{front.url}/v2/models/{MODEL}/generate", b'{"text_input": "\\ud800"}')
    assert code == 400 and json.loads(out)["error"].startswith("text_input: "), out


def wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)
    return value


def leave_during(server, front, route: str, body: dict, started) -> tuple[dict, dict]:
    """Send `body`, wait until `started(metrics delta)`, close the connection -> (the delta when it
    closed, the delta once the engine aborted the request)."""
    before = server.metrics()

    def delta_when(condition):
        d = {k: v - before.get(k, 0.0) for k, v in server.metrics().items()}
        return d if condition(d) else None
    data = json.dumps(body).encode()
    port = int(front.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v2/models/%s/%s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                  % (MODEL.encode(), route.encode(), len(data), data))
        at_close = wait_for(lambda: delta_when(started), "the engine started on the request")
    aborted = wait_for(lambda: delta_when(lambda d: d["lookahead_aborted_requests_total"] >= 1),
                       "the engine aborted the request")
    return at_close, aborted


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_a_client_that_leaves_mid_prefill_aborts_it(server, front, route):
    """Disconnected while the prompt is being prefilled: the engine aborts the request before the
    prefill ends (its computed prompt tokens stay short of the prompt) and generates nothing."""
    # a prompt of each route's own: the other's named blocks would be prefix-cache hits
    body = {"text_input": route[-1] * PROMPT_TOKENS, "max_tokens": 1000, "ignore_eos": True,
            "stream": route == "generate_stream"}
    at_close, aborted = leave_during(server, front, route, body,
                                     lambda d: d["lookahead_prompt_tokens_total"] > 0)
    assert aborted["lookahead_prompt_tokens_total"] < PROMPT_TOKENS, (at_close, aborted)
    assert aborted["lookahead_output_tokens_total"] == 0 and aborted["lookahead_finished_requests_total"] == 0
    wait_for(lambda: server.metrics()["lookahead_running_requests"] == 0, "the batch emptied")


def test_a_client_that_leaves_mid_decode_aborts_it(server, front):
    at_close, aborted = leave_during(server, front, "generate", {"text_input": "go", "max_tokens": 3000,
                                                                 "ignore_eos": True},
                                     lambda d: d["lookahead_output_tokens_total"] > 0)
    assert aborted["lookahead_output_tokens_total"] < 3000 and aborted["lookahead_finished_requests_total"] == 0
