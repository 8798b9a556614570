"""bench/prefix_serve.py against a fake OpenAI server on loopback: streaming TTFT, usage and llama-server's
timings, concurrency, errors named with the request, and the percentile helper."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bench import prefix_serve as ps


class FakeServer:
    """Streams `chunks` words per request; `timings` adds llama-server's prompt_n; 'fail' in a prompt
    gives a 400. Records the bodies and the most requests in flight at once; with `hold`, the first
    requests wait (up to 10 s) until `hold` of them are in flight, so a client that keeps `hold` open
    reaches that peak however slowly its threads start on a loaded machine."""

    def __init__(self, timings: bool = False, delay: float = 0.0, hold: int = 0):
        self.bodies: list[dict] = []
        self.live = 0
        self.peak = 0
        lock = threading.Condition()
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.bodies.append(body)
                    outer.live += 1
                    outer.peak = max(outer.peak, outer.live)
                    lock.notify_all()
                    lock.wait_for(lambda: outer.peak >= hold, timeout=10)
                try:
                    if "fail" in body["prompt"]:
                        msg = b'{"error": "prompt refused"}'
                        self.send_response(400)
                        self.send_header("Content-Length", str(len(msg)))
                        self.end_headers()
                        self.wfile.write(msg)
                        return
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    time.sleep(delay)
                    n = body["max_tokens"]
                    prompt_tokens = len(body["prompt"].split())
                    for i in range(n):
                        self.wfile.write(f"data: {json.dumps({'choices': [{'text': f' w{i}'}]})}\n\n".encode())
                    final = {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                      "prompt_tokens_details": {"cached_tokens": prompt_tokens - 1}}}
                    if timings:
                        final["timings"] = {"prompt_n": 3}
                    self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
                finally:
                    with lock:
                        outer.live -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def test_complete_reads_the_stream_and_usage(server):
    r = ps.complete(server.url, "m", "a b c d", 3)
    assert r.text == " w0 w1 w2" and r.ttft_s is not None and r.ttft_s <= r.total_s
    assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.computed_tokens) == (4, 3, 3, None)
    assert ps.computed(r) == 1
    body = server.bodies[0]
    assert body["temperature"] == 0.0 and body["stream"] and body["ignore_eos"] and body["max_tokens"] == 3


def test_llama_server_timings_are_what_it_computed():
    s = FakeServer(timings=True)
    try:
        r = ps.complete(s.url, "m", "a b c d e", 2, {"cache_prompt": False})
        assert r.computed_tokens == 3 and ps.computed(r) == 3
        assert s.bodies[0]["cache_prompt"] is False
    finally:
        s.close()


def test_run_dqa_keeps_the_concurrency_and_sums():
    s = FakeServer(delay=0.05, hold=3)
    try:
        prompts = [(f"r{i}", "x " * (i + 2)) for i in range(6)]
        res = ps.run_dqa(s.url, "m", prompts, concurrency=3, max_tokens=2, log=lambda _m: None)
        assert res["n_requests"] == 6 and s.peak == 3
        assert res["output_tokens"] == 12
        assert res["prompt_tokens_total"] == sum(i + 2 for i in range(6))
        assert res["prefill_tokens_computed"] == 6            # one computed token each (prompt - cached)
        assert set(res["texts"]) == {f"r{i}" for i in range(6)}
    finally:
        s.close()


def test_a_refused_request_is_named(server):
    with pytest.raises(ps.ServerError, match=r"1 of 2 requests failed; first: bad: .*HTTP 400"):
        ps.run_dqa(server.url, "m", [("ok", "a b"), ("bad", "fail")], 2, 1, log=lambda _m: None)


def test_first_question_per_document_is_told_apart_from_later_ones():
    order = ["dqa-1-0", "dqa-0-2", "dqa-1-3", "dqa-0-1", "dqa-1-1"]
    ttft = {"dqa-1-0": 9.0, "dqa-0-2": 8.0, "dqa-1-3": 0.5, "dqa-0-1": 0.3, "dqa-1-1": None}
    got = ps.first_and_later(order, ttft, ps.dqa_doc)
    assert got["ttft_first_p50_s"] == 8.5 and got["ttft_later_p50_s"] == 0.4
    assert ps.dqa_doc("dqa-12-3") == "12" and ps.dqa_doc("r7") == "r7"


def test_a_server_that_reports_no_cached_tokens_has_no_hit_rate():
    """vLLM without --enable-prompt-tokens-details: unknown, not zero."""
    r = ps.Reply("x", 0.1, 0.2, prompt_tokens=10, cached_tokens=None, completion_tokens=1, computed_tokens=None)
    assert ps.computed(r) is None
    assert ps.computed(ps.Reply("x", 0.1, 0.2, 10, 4, 1, None)) == 6


def test_documents_cached_before_the_run_are_flagged():
    """A second run against the same server finds its documents cached: its "first question" is not cold."""
    order = ["dqa-0-0", "dqa-1-0", "dqa-0-1"]
    cold = {"dqa-0-0": ps.Reply("a", 9.0, 9.1, 6000, 0, 1, None), "dqa-1-0": ps.Reply("b", 9.0, 9.1, 6000, 0, 1, None),
            "dqa-0-1": ps.Reply("c", 0.1, 0.2, 6010, 5990, 1, None)}
    assert ps.first_cached(order, cold) == 0
    warm = dict(cold, **{"dqa-1-0": ps.Reply("b", 0.1, 0.2, 6000, 5984, 1, None)})
    assert ps.first_cached(order, warm) == 5984
    unknown = dict(cold, **{"dqa-0-0": ps.Reply("a", 9.0, 9.1, 6000, None, 1, None)})
    assert ps.first_cached(order, unknown) is None


def test_vllm_runs_on_every_core_unless_told_otherwise():
    """vLLM's own default binding reserves one core of two for its scheduler: our benches pass nobind."""
    env = ps.vllm_env(2, 6)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_KVCACHE_SPACE"] == "6"
    assert ps.vllm_env(1, 2, "0-1")["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert ps.VllmServer("/nowhere/python", Path("/tmp"), bind="auto").env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    with pytest.raises(ValueError, match="bind"):
        ps.vllm_env(2, 6, "")


def test_cpu_model_names_the_dot_product_units(tmp_path):
    from bench.runs import cpu_model
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert cpu_model(str(info)) == {"cpu_model": "Some CPU", "cpu_dot_products": ["avx512_bf16", "amx_bf16"]}
    assert cpu_model(str(tmp_path / "absent")) == {}


def test_pct():
    assert ps.pct([], 0.5) is None
    assert ps.pct([3.0, 1.0, 2.0], 0.5) == 2.0
    assert ps.pct([1.0, 2.0], 0.9) == pytest.approx(1.9)


def test_wait_http_names_what_is_not_ready():
    with pytest.raises(ps.ServerError, match=r"not ready after"):
        ps.wait_http("http://127.0.0.1:9", "/health", 0.6)
