"""scripts/demo.py (what `make demo` runs) without a tritonserver: the metrics arithmetic, the table,
the HTTP client against a fake server, the orchestration with serve.sh and the load test stubbed out,
the question on a tiny engine, and --dry-run. A real run takes minutes (README: `make demo`)."""
from __future__ import annotations

import json
import math
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tiny_engine import make_tiny_engine

from bench import longctx_data as data
from script_loader import load_script

demo = load_script("scripts/demo.py")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("tiny_demo"), seed=3)


class Log:
    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, *parts, file=None, flush=False):
        self.lines.append(" ".join(str(p) for p in parts))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


# ---- metrics arithmetic ---------------------------------------------------------------------------
PROM = """\
# HELP lookahead_h2d_bytes_total KV bytes copied host to device
# TYPE lookahead_h2d_bytes_total counter
lookahead_h2d_bytes_total{instance="lookahead_llm_0_0",model="lookahead_llm"} 1000
lookahead_h2d_bytes_total{instance="lookahead_llm_0_1",model="lookahead_llm"} 24
lookahead_h2d_bytes_total{instance="other_0",model="other"} 5
lookahead_prefetch_hit_rate{instance="lookahead_llm_0_0",model="lookahead_llm"} Nan
lookahead_topk_agreement{instance="lookahead_llm_0_0",model="lookahead_llm"} 0.5
lookahead_topk_agreement{instance="lookahead_llm_0_1",model="lookahead_llm"} Nan
nv_inference_count{model="lookahead_llm",version="1"} 7
"""


def test_parse_metrics_sums_instances_of_the_model_and_keeps_nan():
    m = demo.parse_metrics(PROM)
    assert m["lookahead_h2d_bytes_total"] == 1024.0                 # both instances, not "other"
    assert math.isnan(m["lookahead_prefetch_hit_rate"])
    assert m["lookahead_topk_agreement"] == 0.5                     # a NaN instance adds nothing
    assert "nv_inference_count" not in m


def test_request_numbers_are_counter_deltas_and_flag_stale_rates():
    before = {"lookahead_h2d_bytes_total": 100.0, "lookahead_urgent_blocks_total": 3.0,
              "lookahead_output_tokens_total": 1.0, "lookahead_prefetch_hit_rate": math.nan,
              "lookahead_draft_accept_rate": math.nan, "lookahead_topk_agreement": math.nan}
    after = {**before, "lookahead_h2d_bytes_total": 900.0, "lookahead_urgent_blocks_total": 10.0,
             "lookahead_output_tokens_total": 17.0, "lookahead_prefetch_hit_rate": 0.9,
             "lookahead_draft_accept_rate": 0.75, "lookahead_topk_agreement": 0.98,
             "lookahead_device_working_set_bytes_per_sequence": 4096.0}
    n = demo.request_numbers(before, after)
    assert (n["h2d_bytes"], n["urgent_blocks"], n["output_tokens"]) == (800.0, 7.0, 16.0)
    assert (n["prefetch_hit_rate"], n["draft_accept_rate"], n["agreement"]) == (0.9, 0.75, 0.98)
    assert n["device_working_set"] == 4096.0 and n["device_summaries"] is None
    assert n["prefetched_blocks"] is None                           # an older server: not exported
    assert n["rates_since_start"] is False
    stale = demo.request_numbers({**before, "lookahead_prefetch_hit_rate": 0.5}, after)
    assert stale["rates_since_start"] is True


def test_exported_families_include_what_the_demo_reads():
    from serving.metrics import METRICS
    names = {s.name for s in METRICS}
    assert set(demo.COUNTERS.values()) <= names
    assert set(demo.RATE_GAUGES.values()) | set(demo.DEVICE_PER_SEQ.values()) <= names


def test_kv_memory_matches_the_engine_the_server_loads(tiny_dir):
    """The config-derived numbers (memory_plan's formulas) are what the runtime reports, i.e. what the
    server's gauges export, so the fallback and the note in the report are right."""
    from runtime.engine import Engine
    mem = demo.kv_memory(tiny_dir, 1000)
    eng = Engine.from_dir(tiny_dir, mode="lookahead", verify_checksums=False)
    try:
        stats = eng.stats()
        assert stats["device_bytes_per_seq"] == mem["working_set"]
        assert stats["device_summary_bytes_per_seq"] == mem["summaries"]
    finally:
        eng.close()
    cfg = eng.manifest.model
    assert mem["lookahead_total"] == mem["working_set"] + mem["summaries"] and mem["summaries"] > 0
    assert mem["dense_context"] == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 1000
    assert mem["block_bytes"] == 2 * 16 * cfg.head_dim * 4


def test_kv_memory_counts_the_kv_dtype_not_the_weights(tmp_path):
    """fp32 weights with fp16 KV (every int8 build): dense's K and V are 2 bytes a value, as its pool
    holds them (the demo said twice that: 703 MiB for the 0.5B at 30K, against 352)."""
    from runtime.config import LookaheadConfig
    from runtime.engine import Engine
    half = make_tiny_engine(tmp_path / "half", seed=3, lookahead=LookaheadConfig(kv_dtype="float16"))
    mem = demo.kv_memory(half, 1000)
    eng = Engine.from_dir(half, mode="dense", verify_checksums=False)
    try:
        pool = eng.pool
        per_token = 2 * pool.k.element_size() * pool.k[:, :, 0, 0].numel()   # K + V: [L, KVH, D] a token
        assert pool.k.dtype == torch.float16 and mem["dense_kv_per_token"] == per_token
        assert mem["dense_context"] == per_token * 1000
    finally:
        eng.close()


# ---- the report -----------------------------------------------------------------------------------
def results_fixture(rates_since_start=False):
    def ans(text, n):
        return {"text": text, "prompt_tokens": 4986, "output_tokens": n, "finish_reason": "length",
                "ttft_s": 25.5, "total_s": 26.0, "decode_tokens_per_s": 28.04, "error": None}
    numbers = {"h2d_bytes": 296615936.0, "urgent_blocks": 15419.0, "prefetched_blocks": 20789.0,
               "prefetch_hit_rate": 0.9163, "draft_accept_rate": 1.0, "agreement": 0.98636,
               "device_working_set": None, "device_summaries": None, "rates_since_start": rates_since_start}
    return {"dense": {"answer": ans("7761348.", 10), "found": True, "numbers": None},
            "lookahead": {"answer": ans("7761348. This", 16), "found": False, "numbers": numbers}}


def test_table_puts_modes_side_by_side():
    mem = {"working_set": 98764800, "summaries": 23592960, "lookahead_total": 122357760,
           "dense_kv_per_token": 46080, "block_bytes": 8192}
    rows = dict(demo.build_rows(results_fixture(), mem))
    assert rows["needle found"] == {"dense": "yes", "lookahead": "NO"}
    assert rows["device KV per sequence"]["dense"] == "219.6 MiB (K+V of 4996 tokens)"
    assert rows["device KV per sequence"]["lookahead"] == "116.7 MiB (94.2 MiB + 22.5 MiB summ.)"
    assert rows["H2D bytes (this request)"] == {"dense": "0 (none)", "lookahead": "282.9 MiB (36208 blocks)"}
    assert rows["  prefetched / urgent blocks"]["lookahead"] == "20789 / 15419"
    assert rows["prefetch hit rate"] == {"dense": "n/a", "lookahead": "91.6 %"}
    assert rows["draft accept rate"]["lookahead"] == "100.0 %"
    assert rows["top-K agreement"]["lookahead"] == "0.986"
    assert rows["TTFT (prefill)"]["dense"] == "25.5 s" and rows["decode tokens/s"]["lookahead"] == "28.0"
    stale = dict(demo.build_rows(results_fixture(rates_since_start=True), mem))
    assert stale["prefetch hit rate"]["lookahead"] == "91.6 %*" and stale["H2D bytes (this request)"][
        "lookahead"].endswith("blocks)")
    served = results_fixture()
    served["lookahead"]["numbers"].update(device_working_set=1048576.0, device_summaries=1048576.0)
    assert dict(demo.build_rows(served, mem))["device KV per sequence"]["lookahead"] == \
        "2.0 MiB (1.0 MiB + 1.0 MiB summ.)"                # the server's gauges win over the plan
    log = Log()
    demo.print_report(QUESTION, served, {**mem, "config": dict.fromkeys(
        ("top_k", "block_size", "fetch_ratio", "residency", "miss_policy", "draft"), 1),
        "max_model_len": 8192, "dense_at_max_len": 1}, ["dense", "lookahead"], log=log)
    assert "they should agree" in log.text and "expected answer: 7761348" in log.text
    table = demo.format_table(demo.build_rows(results_fixture(), mem), ["dense", "lookahead"])
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1 and lines[0].split() == ["dense", "lookahead"]


# ---- the client against a fake server -------------------------------------------------------------
class FakeTriton:
    """/v2/models/lookahead_llm/generate_stream (SSE, one token per event) and /metrics, whose
    counters move as the request is served."""

    def __init__(self, tokens=("7761", "348", "."), error=None, delay_s=0.0):
        self.tokens, self.error, self.delay_s = tokens, error, delay_s
        self.counters = {"lookahead_prompt_tokens_total": 1.0, "lookahead_output_tokens_total": 1.0,
                         "lookahead_h2d_bytes_total": 0.0}
        self.gauges = {"lookahead_prefetch_hit_rate": math.nan,
                       "lookahead_device_working_set_bytes_per_sequence": 4096.0,
                       "lookahead_device_summary_bytes_per_sequence": 1024.0}
        self.bodies: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                values = {**fake.counters, **fake.gauges}
                text = "".join(f'{k}{{model="lookahead_llm"}} {v}\n' for k, v in values.items())
                self._send(200, "text/plain", text.replace("nan", "Nan").encode())

            def do_POST(self):
                import time
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                if fake.error:
                    return self._send(400, "application/json", json.dumps({"error": fake.error}).encode())
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                time.sleep(fake.delay_s)
                fake.counters["lookahead_prompt_tokens_total"] += 100
                for i, tok in enumerate(fake.tokens):
                    last = i == len(fake.tokens) - 1
                    fake.counters["lookahead_output_tokens_total"] += 1
                    fake.counters["lookahead_h2d_bytes_total"] += 8192
                    if last:
                        fake.gauges["lookahead_prefetch_hit_rate"] = 0.8
                    ev = {"model_name": "lookahead_llm", "num_input_tokens": 100, "num_output_tokens": 1,
                          "text_output": tok, **({"finish_reason": "length"} if last else {})}
                    self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.01)

            def _send(self, status, ctype, payload):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_triton():
    servers = []

    def make(**kw):
        servers.append(FakeTriton(**kw))
        return servers[-1]
    yield make
    for s in servers:
        s.close()


QUESTION = demo.Question("<haystack> What is the number?", ["7761348"], "all", "niah_single", 128, 100,
                         [demo.Question("<haystack> The number?", ["7761348"], "all", "niah_single", 128, 98),
                          demo.Question("<haystack> About?", [], "all", "niah_single", 128, 97)])


def test_ask_streams_times_and_reads_the_metrics(fake_triton):
    srv = fake_triton(delay_s=0.3)
    log = Log()
    ans, numbers = demo.ask(srv.port, srv.port, QUESTION, 3, log=log, every_s=0.1)
    assert srv.bodies == [{"text_input": QUESTION.prompt, "max_tokens": 3, "stream": True, "temperature": 0.0,
                           "exclude_input_in_output": True}]
    assert (ans.text, ans.output_tokens, ans.prompt_tokens, ans.finish_reason, ans.error) == \
        ("7761348.", 3, 100, "length", None)
    assert ans.ttft_s >= 0.3 and ans.decode_tokens_per_s > 0 and ans.total_s >= ans.ttft_s
    assert demo.found(ans.text, QUESTION)
    assert numbers["h2d_bytes"] == 3 * 8192 and numbers["output_tokens"] == 3 and numbers["prompt_tokens"] == 100
    assert numbers["prefetch_hit_rate"] == 0.8 and numbers["rates_since_start"] is False
    assert (numbers["device_working_set"], numbers["device_summaries"]) == (4096.0, 1024.0)
    assert any("prefill 0/100 prompt tokens" in line for line in log.lines)      # progress while waiting


def test_the_first_answer_waits_for_a_long_prompts_prefill(fake_triton, monkeypatch):
    """A 30K prompt's cold prefill takes ~15 min on 2 AVX2 cores: the wait scales with the prompt
    (the fixed 600 s cut the 0.5B's 30K demo off), and it is the request's own socket timeout."""
    assert demo.request_timeout(5000) == 850.0 and demo.request_timeout(30000) >= 1800
    srv, seen, real = fake_triton(), [], demo.stream_generate
    monkeypatch.setattr(demo, "stream_generate", lambda *a, timeout: seen.append(timeout) or real(*a, timeout=timeout))
    demo.ask(srv.port, srv.port, QUESTION, 3, log=Log(), every_s=0.1)
    assert seen == [demo.request_timeout(QUESTION.prompt_tokens)]


def test_request_timeout_sets_the_wait(stubbed):
    assert demo.main(["--engine", str(stubbed.dir), "--no-load-test", "--request-timeout", "1234"], log=Log()) == 0
    assert stubbed.timeouts[0] == 1234.0


def test_ask_reports_an_error_response(fake_triton):
    srv = fake_triton(error="max_tokens: must be > 0")
    ans, _ = demo.ask(srv.port, srv.port, QUESTION, 3, log=Log(), every_s=0.1)
    assert ans.error == "HTTP 400: max_tokens: must be > 0" and ans.output_tokens == 0


def test_sse_events_and_an_error_event():
    lines = [b'data: {"text_output": "a", "num_output_tokens": 1}\n', b"\n", b": comment\n",
             b'data: {"error": "boom"}\n']
    assert list(demo.sse_events(iter(lines))) == [{"text_output": "a", "num_output_tokens": 1}, {"error": "boom"}]


# ---- orchestration: serve.sh and the load test stubbed out ------------------------------------------
@pytest.fixture
def stubbed(monkeypatch, tiny_dir):
    """main() with serve.sh, the request and the load test replaced by recorders."""
    calls: list[tuple] = []
    up: list[str] = []

    def call(cmd, **kw):
        name = Path(cmd[0]).name if Path(cmd[0]).name != Path(sys.executable).name else Path(cmd[1]).name
        if name == "serve.sh":
            calls.append(("serve.sh", cmd[1], cmd[cmd.index("--mode") + 1] if "--mode" in cmd else None))
            if cmd[1] == "start":
                up.append(cmd[cmd.index("--mode") + 1])
            else:
                up.clear()
            return stubbed.start_rc if cmd[1] == "start" else 0
        calls.append(("load_test", tuple(up)))
        assert "--server-pid-file" in cmd and "--url" in cmd
        return stubbed.load_rc

    def ask(http_port, metrics_port, q, max_tokens, log=print, every_s=5.0, timeout=None):
        calls.append(("ask", tuple(up)))
        stubbed.timeouts.append(timeout)
        if stubbed.interrupt_in_ask:
            raise KeyboardInterrupt
        a = demo.Answer(text="The number is 7761348.", prompt_tokens=q.prompt_tokens, output_tokens=5,
                        finish_reason="stop", ttft_s=1.0, total_s=1.5, decode_tokens_per_s=8.0)
        n = demo.request_numbers({}, {"lookahead_h2d_bytes_total": 8192.0, "lookahead_prefetch_hit_rate": 0.9})
        return a, n
    stubbed.start_rc, stubbed.load_rc, stubbed.interrupt_in_ask = 0, 0, False
    monkeypatch.setattr(demo.subprocess, "call", call)
    monkeypatch.setattr(demo, "ask", ask)
    monkeypatch.setattr(demo, "make_question", lambda *a: QUESTION)
    monkeypatch.setattr(demo.signal, "signal", lambda *a: None)
    stubbed.calls, stubbed.dir, stubbed.timeouts = calls, tiny_dir, []
    return stubbed


def test_main_runs_dense_then_lookahead_then_the_load_test_and_stops_each(stubbed, tmp_path):
    log = Log()
    out = tmp_path / "demo.json"
    rc = demo.main(["--engine", str(stubbed.dir), "--http-port", "18000", "--json", str(out)], log=log)
    assert rc == 0
    # three questions on the document in each mode: the first, then two that hit its cached KV
    assert stubbed.calls == [("serve.sh", "start", "dense"), *[("ask", ("dense",))] * 3, ("serve.sh", "stop", None),
                             ("serve.sh", "start", "lookahead"), *[("ask", ("lookahead",))] * 3,
                             ("load_test", ("lookahead",)), ("serve.sh", "stop", None)]
    text = log.text
    assert "needle found" in text and "What the numbers mean" in text and "expected answer: 7761348" in text
    table = text[text.index("Prefix caching"):]
    assert "2. the number, asked again" in table and "3. what is the text about" in table
    assert "cached" in table.splitlines()[1]
    assert text.index("What the numbers mean") < text.index("load test against the lookahead server")
    saved = json.loads(out.read_text())
    assert saved["results"]["lookahead"]["numbers"]["h2d_bytes"] == 8192.0
    assert saved["results"]["dense"]["found"] is True and saved["question"]["prompt"] is None


def test_main_stops_the_server_on_failure_and_interrupt(stubbed):
    stubbed.load_rc = 1
    assert demo.main(["--engine", str(stubbed.dir), "--json", ""], log=Log()) == 1
    assert stubbed.calls[-1] == ("serve.sh", "stop", None)
    stubbed.calls.clear()
    stubbed.start_rc = 1                                 # serve.sh start failed: stop anyway, exit 1
    log = Log()
    assert demo.main(["--engine", str(stubbed.dir), "--json", ""], log=log) == 1
    assert stubbed.calls == [("serve.sh", "start", "dense"), ("serve.sh", "stop", None)]
    assert "serve.sh start --mode dense failed" in log.text
    stubbed.calls.clear()
    stubbed.start_rc, stubbed.interrupt_in_ask = 0, True  # Ctrl-C during the request
    assert demo.main(["--engine", str(stubbed.dir), "--json", ""], log=Log()) == 130
    assert stubbed.calls == [("serve.sh", "start", "dense"), ("ask", ("dense",)), ("serve.sh", "stop", None)]


def test_dry_run_prints_the_plan_and_starts_nothing(tiny_dir, monkeypatch):
    monkeypatch.setattr(demo.subprocess, "call", lambda *a, **k: pytest.fail("--dry-run ran a command"))
    log = Log()
    assert demo.main(["--engine", str(tiny_dir), "--http-port", "18100", "--grpc-port", "18101",
                      "--metrics-port", "18102", "--dry-run"], log=log) == 0
    text = log.text
    assert "--mode dense --http-port 18100 --grpc-port 18101 --metrics-port 18102" in text
    assert text.index("--mode dense") < text.index("--mode lookahead") < \
        text.index("load_test.py --url 127.0.0.1:18101")
    assert "summaries" in text
    assert "--run-dir" not in text                       # serve.sh's default run dir, and its PID file
    assert f"--server-pid-file {demo.DEFAULT_RUN_DIR / 'tritonserver.pid'}" in text
    log = Log()
    demo.main(["--engine", str(tiny_dir), "--run-dir", "/tmp/x", "--dry-run"], log=log)
    assert "stop --run-dir /tmp/x" in log.text and "--server-pid-file /tmp/x/tritonserver.pid" in log.text


def test_bad_arguments_are_refused(tiny_dir, tmp_path):
    with pytest.raises(SystemExit, match="--modes"):
        demo.main(["--engine", str(tiny_dir), "--modes", "sparse", "--dry-run"], log=Log())
    with pytest.raises(SystemExit, match="not an engine dir"):
        demo.main(["--engine", str(tmp_path), "--dry-run"], log=Log())


# ---- the question -------------------------------------------------------------------------------
@pytest.mark.skipif(not data.ruler_available(), reason=f"RULER's generators are not installed ({data.RULER_PIP})")
def test_make_question_is_a_ruler_needle_of_the_asked_length(tiny_dir, monkeypatch):
    fake = types.ModuleType("wonderwords")       # NIAH's 6M-pair word list takes ~15 s: a small one
    fake.random_word = types.SimpleNamespace(
        _get_words_from_text_file=lambda name: ["red", "blue", "green"] if "adj" in name else ["fox", "owl", "elk"])
    monkeypatch.setitem(sys.modules, "wonderwords", fake)
    data._generator_module.cache_clear()
    try:
        q = demo.make_question(tiny_dir, "niah_single", 1024)
    finally:
        data._generator_module.cache_clear()
    assert 800 <= q.prompt_tokens <= 1024 and len(q.answers) == 1 and q.answers[0] in q.prompt
    assert demo.found(f"It is {q.answers[0]}.", q) and not demo.found("no idea", q)
