#!/usr/bin/env python3
"""The product in a few minutes: one long-document question served from Triton in dense mode and in
lookahead mode, their answers and numbers side by side, then the load test (what `make demo` runs).

    scripts/demo.py [--engine engines/default] [--http-port 8000 --grpc-port 8001 --metrics-port 8002]
                    [--task niah_single --context 5120 --max-tokens 16] [--no-load-test] [--dry-run]

1. The question: a RULER needle-in-a-haystack sample (`bench/longctx_data.py`: a 7-digit "magic
   number" hidden in Paul Graham essays, ~5K tokens with the engine's chat template). The answer
   is checkable: RULER's scorer says whether the model found the needle.
2. `scripts/serve.sh start --mode dense`, the question over HTTP `/v2/models/lookahead_llm/
   generate_stream` (streamed, so TTFT and decode tokens/s are measured at the client), `serve.sh stop`.
   Then two more questions on the same document (`FOLLOW_UPS`): the server's prefix cache holds
   the document's KV blocks, so only the new question is prefilled; each one's TTFT and cached
   prompt tokens are shown beside the first's.
3. The same with `--mode lookahead`. Its numbers come from the server's metrics endpoint
   (serving/metrics.py), read before and after the request: counters as deltas; the rate
   gauges (hit rate, accept rate, agreement) are cumulative since the server started, and the
   server is fresh, so they are this request's (the table says so when they were not NaN before).
   Device bytes per sequence (working set, block summaries) are the server's gauges; the engine
   dir's config through runtime/memory_plan.py gives the same numbers (a server that does not export
   them falls back to these, and a mismatch is reported) and dense mode's KV (the whole context's K, V).
4. With the lookahead server still up, `scripts/load_test.py` (served vs in-process), then stop.

Servers are stopped on every exit path (failure, Ctrl-C, SIGTERM). --dry-run prints the plan and the
config-derived memory numbers without starting anything or generating data.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from runtime.threads import prepare_threads

prepare_threads()  # first: libgomp reads GOMP_SPINCOUNT once, when torch loads it (runtime/threads.py)

ROOT = Path(__file__).resolve().parents[1]

MODEL = "lookahead_llm"
MODES = ("dense", "lookahead")
LOAD_TEST_ARGS = ("--concurrency 4 --num-requests 16 --prompt-len 128 --prompt-len-std 32 --max-tokens 32 "
                  "--in-process --rounds 2 --json results/load_test.json --plot results/load_test.png")
PROGRESS_EVERY_S = 5.0
DEFAULT_RUN_DIR = ROOT / "build" / "serve"      # serve.sh's default --run-dir

# Metric families read (serving/metrics.py); a counter's delta is the request's.
COUNTERS = {"h2d_bytes": "lookahead_h2d_bytes_total", "urgent_blocks": "lookahead_urgent_blocks_total",
            "prefetched_blocks": "lookahead_prefetched_blocks_total",
            "drafts_proposed": "lookahead_drafts_proposed_total",
            "prompt_tokens": "lookahead_prompt_tokens_total", "output_tokens": "lookahead_output_tokens_total",
            "transfer_wait_s": "lookahead_transfer_wait_seconds_total"}
RATE_GAUGES = {"prefetch_hit_rate": "lookahead_prefetch_hit_rate",
               "draft_accept_rate": "lookahead_draft_accept_rate", "agreement": "lookahead_topk_agreement"}
DEVICE_PER_SEQ = {"device_working_set": "lookahead_device_working_set_bytes_per_sequence",
                  "device_summaries": "lookahead_device_summary_bytes_per_sequence"}


class DemoError(Exception):
    pass


# ---- metrics endpoint ------------------------------------------------------------------------------
def parse_metrics(text: str, model: str = MODEL) -> dict[str, float]:
    """Prometheus text -> {family: value} for the `lookahead_*` families of `model`, summed over
    instances (counters add up; with one instance, the default, a gauge is its value)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("lookahead_"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if labels and f'model="{model}"' not in labels:
            continue
        try:
            v = float(value)          # "Nan" (Triton's spelling) parses too
        except ValueError:
            continue
        old = out.get(name)
        out[name] = v if old is None or math.isnan(old) else old if math.isnan(v) else old + v
    return out


def scrape(metrics_port: int, timeout: float = 5.0) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", metrics_port, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read().decode("utf-8", "replace")
        if resp.status != 200:
            raise DemoError(f"metrics endpoint :{metrics_port} answered HTTP {resp.status}")
        return parse_metrics(body)
    finally:
        conn.close()


def nan_to_none(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) else v


def request_numbers(before: dict[str, float], after: dict[str, float]) -> dict:
    """What one request did, from scrapes taken before and after it: counters' deltas, and the rate
    gauges' values after, flagged `rates_since_start` when they already had a value before (another
    request then counts in them)."""
    out: dict = {}
    for key, name in COUNTERS.items():
        out[key] = (after[name] - before.get(name, 0.0)) if name in after else None
    for key, name in RATE_GAUGES.items():
        out[key] = nan_to_none(after.get(name))
    out["rates_since_start"] = any(nan_to_none(before.get(n)) is not None for n in RATE_GAUGES.values())
    for key, name in DEVICE_PER_SEQ.items():
        out[key] = nan_to_none(after.get(name))
    return out


# ---- what the config says about device memory ------------------------------------------------------
def kv_memory(engine_dir: str | Path, context_tokens: int) -> dict:
    """One sequence's device KV, from the engine dir's config with runtime/memory_plan.py's formulas:
    lookahead's working set and block summaries (the server's effective config: engine.yaml with
    mode=lookahead, top_k clamped as Engine does), and dense mode's K and V of `context_tokens`."""
    import torch

    from runtime.engine_dir import load_manifest
    from runtime.memory_plan import DTYPE_BYTES
    from runtime.spec import resolve_spec
    man = load_manifest(engine_dir, verify_checksums=False)
    spec = resolve_spec(man, torch.device("cpu"), {"mode": "lookahead"}, weights=False)
    plan, cfg, max_len = spec.memory_plan, spec.config, spec.max_model_len
    m, b = man.model, DTYPE_BYTES[cfg.kv_dtype]     # the KV's storage dtype, not the weights'
    per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * b          # K and V, every layer
    return {"working_set": plan.per_seq_device_tier,
            "summaries": plan.per_seq_device - plan.per_seq_device_tier,
            "lookahead_total": plan.per_seq_device,
            "dense_kv_per_token": per_token,
            "dense_context": per_token * context_tokens,
            "dense_at_max_len": per_token * max_len,
            "max_model_len": max_len,
            "block_bytes": 2 * cfg.block_size * m.head_dim * b,   # one (layer, KV head) block, K + V
            "config": {k: getattr(cfg, k) for k in ("top_k", "block_size", "fetch_ratio", "residency",
                                                    "miss_policy", "draft", "num_sink_blocks", "recent_window")}}


# ---- the question ----------------------------------------------------------------------------------
@dataclass
class Question:
    prompt: str
    answers: list[str]
    metric: str
    task: str
    context_len: int
    prompt_tokens: int
    follow_ups: list["Question"] = field(default_factory=list)   # more questions on the same document


# Asked after the first question, on the same document (its prompt's prefix): the engine's prefix
# cache serves the document's KV, so only the new question is prefilled. (label, question, checked?)
FOLLOW_UPS = (("2. the number, asked again",
               "What is the special magic number mentioned in the provided text? Answer with the number only.", True),
              ("3. what is the text about", "In one sentence, what is the text above about?", False))


FOLLOW_UP_TOKENS = 32


def make_question(engine_dir: str | Path, task: str, context_len: int, index: int = 0) -> Question:
    from bench import longctx_data as data
    from runtime.tokenizer import TextTokenizer
    tok = TextTokenizer(Path(engine_dir) / "tokenizer")
    count = lambda s: len(tok.encode(s))  # noqa: E731
    wrap = tok.apply_chat_template if tok.chat_template else (lambda s: s)
    s = data.ruler_samples(task, context_len, index + 1, count, wrap)[index]
    document = s.user.rsplit("\n", 1)[0]            # RULER's question is the user turn's last line
    follow = [Question(wrap(f"{document}\n{text}"), s.answers if checked else [], s.metric, task, context_len,
                       count(wrap(f"{document}\n{text}"))) for _, text, checked in FOLLOW_UPS]
    return Question(s.prompt, s.answers, s.metric, task, context_len, count(s.prompt), follow)


def found(answer: str, q: Question) -> bool | None:
    """Whether the answer has the expected one (None: a question whose answer is not checked)."""
    from bench import longctx_data as data
    return data.score(answer, q.answers, q.metric) >= 1.0 if q.answers else None


# ---- one request over HTTP generate_stream ---------------------------------------------------------
@dataclass
class Answer:
    text: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    ttft_s: float | None = None
    cached_tokens: int = 0               # prompt tokens the server's prefix cache served
    total_s: float | None = None
    decode_tokens_per_s: float | None = None
    error: str | None = None
    token_times: list[float] = field(default_factory=list, repr=False)


def sse_events(lines: Iterator[bytes]) -> Iterator[dict]:
    """`data: {...}` lines of a server-sent-event stream -> the JSON objects."""
    for raw in lines:
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("data:"):
            yield json.loads(line[5:].strip())


def stream_generate(http_port: int, prompt: str, max_tokens: int, timeout: float = 600.0,
                    clock: Callable[[], float] = time.perf_counter) -> Answer:
    """One greedy request on /v2/models/lookahead_llm/generate_stream, timed at the client."""
    body = json.dumps({"text_input": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
                       "exclude_input_in_output": True}).encode()
    ans = Answer()
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=timeout)
    t0 = clock()
    try:
        conn.request("POST", f"/v2/models/{MODEL}/generate_stream", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            payload = resp.read().decode("utf-8", "replace")
            try:
                payload = json.loads(payload).get("error", payload)
            except ValueError:
                pass
            ans.error = f"HTTP {resp.status}: {payload}"
            return ans
        parts = []
        for ev in sse_events(iter(resp.readline, b"")):
            if "error" in ev:
                ans.error = str(ev["error"])
                break
            n = int(ev.get("num_output_tokens", 0))
            if n:
                ans.token_times.extend([clock()] * n)
            ans.output_tokens += n
            ans.prompt_tokens = int(ev.get("num_input_tokens", ans.prompt_tokens))
            ans.cached_tokens = int(ev.get("num_cached_tokens", ans.cached_tokens))
            parts.append(ev.get("text_output", ""))
            if ev.get("finish_reason"):
                ans.finish_reason = ev["finish_reason"]
                break
        ans.text = "".join(parts)
    finally:
        conn.close()
    ans.total_s = clock() - t0
    if ans.token_times:
        ans.ttft_s = ans.token_times[0] - t0
        span = ans.token_times[-1] - ans.token_times[0]
        if len(ans.token_times) > 1 and span > 0:
            ans.decode_tokens_per_s = (len(ans.token_times) - 1) / span
    if ans.error is None and ans.finish_reason is None:
        ans.error = "the stream ended without a final response"
    return ans


def request_timeout(prompt_tokens: int) -> float:
    """Seconds to wait for a question's first byte: its cold prefill comes first, and on a 2-core AVX2
    CPU a 30K prompt takes ~15 min on the 0.5B model (600 s, the old fixed limit, cut it off)."""
    return 600.0 + 0.05 * prompt_tokens


def ask(http_port: int, metrics_port: int, q: Question, max_tokens: int, log=print,
        every_s: float = PROGRESS_EVERY_S, timeout: float | None = None) -> tuple[Answer, dict]:
    """Send the question and wait for its answer (at most `timeout` s, default
    `request_timeout(q.prompt_tokens)`), printing prefill progress (from the prompt-token counter)
    every `every_s`; -> (the answer, request_numbers of the scrapes around it)."""
    before = scrape(metrics_port)
    box: dict = {}
    limit = timeout if timeout is not None else request_timeout(q.prompt_tokens)

    def work() -> None:
        try:
            box["answer"] = stream_generate(http_port, q.prompt, max_tokens, timeout=limit)
        except BaseException as e:                     # re-raised below, in the main thread
            box["error"] = e
    worker = threading.Thread(target=work, name="demo-request", daemon=True)
    t0 = time.monotonic()
    worker.start()
    while worker.is_alive():
        worker.join(every_s)
        if worker.is_alive():
            try:
                now = scrape(metrics_port)
            except (OSError, DemoError):
                continue
            done = now.get(COUNTERS["prompt_tokens"], 0.0) - before.get(COUNTERS["prompt_tokens"], 0.0)
            out = now.get(COUNTERS["output_tokens"], 0.0) - before.get(COUNTERS["output_tokens"], 0.0)
            what = (f"prefill {int(min(done, q.prompt_tokens))}/{q.prompt_tokens} prompt tokens"
                    if out < 1 else f"decoding, {int(out)}/{max_tokens} tokens")
            log(f"  ... {time.monotonic() - t0:5.0f} s: {what}", flush=True)
    if "error" in box:
        raise box["error"]
    ans: Answer = box["answer"]
    # The step loop publishes stats every 0.5 s: wait until the output counter has this request's tokens.
    deadline, after = time.monotonic() + 5.0, scrape(metrics_port)
    while (after.get(COUNTERS["output_tokens"], 0.0) - before.get(COUNTERS["output_tokens"], 0.0)
           < ans.output_tokens and time.monotonic() < deadline):
        time.sleep(0.25)
        after = scrape(metrics_port)
    return ans, request_numbers(before, after)


def ask_follow_ups(args: argparse.Namespace, q: Question, mode: str, log=print) -> list[dict]:
    """The follow-up questions on the same document, one after another: each one's TTFT and the
    prompt tokens the prefix cache served."""
    out = []
    for i, f in enumerate(q.follow_ups, 2):
        # room for the answer's preamble ("The special magic number ... is 7761348"): 16 tokens cut it
        ans, _ = ask(args.http_port, args.metrics_port, f, max(args.max_tokens, FOLLOW_UP_TOKENS), log=log)
        if ans.error:
            raise DemoError(f"[{mode}] question {i} failed: {ans.error}")
        log(f"demo: [{mode}] question {i}: TTFT {ans.ttft_s:.2f} s with {ans.cached_tokens} of {f.prompt_tokens} "
            f"prompt tokens cached: {' '.join(ans.text.split())!r}", flush=True)
        out.append({"answer": {k: v for k, v in asdict(ans).items() if k != "token_times"}, "found": found(ans.text, f)})
    return out


def format_follow_ups(q: Question, results: dict[str, dict], modes: list[str]) -> str:
    """One row per question on the document: TTFT and cached prompt tokens in each mode."""
    head = f"{'question on the same document':<34}" + "".join(f"{m + ' TTFT':>16}{'cached':>9}{'found':>7}"
                                                              for m in modes)
    lines = [head, "-" * len(head)]
    texts = ["1. the RULER question (first)"] + [label for label, _, _ in FOLLOW_UPS]
    for i, text in enumerate(texts[: 1 + len(q.follow_ups)]):
        cells = ""
        for m in modes:
            r = results[m] if i == 0 else results[m].get("follow_ups", [{}] * i)[i - 1]
            a = r.get("answer", {})
            f = {True: "yes", False: "NO", None: "-"}[r.get("found")]
            cells += f"{_num(a.get('ttft_s'), '.2f', ' s'):>16}{a.get('cached_tokens', 0):>9}{f:>7}"
        lines.append(f"{text:<34}{cells}")
    return "\n".join(lines)


# ---- serve.sh ----------------------------------------------------------------------------------
class Server:
    """`scripts/serve.sh start ... ; scripts/serve.sh stop` as a context manager: stopped on any exit."""

    def __init__(self, args: argparse.Namespace, mode: str, log=print):
        self.args, self.mode, self.log = args, mode, log

    def start_cmd(self) -> list[str]:
        a = self.args
        return [str(ROOT / "scripts" / "serve.sh"), "start", "--engine", str(a.engine), "--mode", self.mode,
                "--http-port", str(a.http_port), "--grpc-port", str(a.grpc_port),
                "--metrics-port", str(a.metrics_port), *self._run_dir()]

    def stop_cmd(self) -> list[str]:
        return [str(ROOT / "scripts" / "serve.sh"), "stop", *self._run_dir()]

    def _run_dir(self) -> list[str]:
        return [] if self.args.run_dir is None else ["--run-dir", str(self.args.run_dir)]

    def _env(self) -> dict:
        return {**os.environ, "PYTHON": sys.executable}

    def __enter__(self) -> "Server":
        try:
            rc = subprocess.call(self.start_cmd(), env=self._env())
        except BaseException:
            self.__exit__()
            raise
        if rc != 0:
            self.__exit__()
            raise DemoError(f"serve.sh start --mode {self.mode} failed (exit {rc}; its message is above)")
        return self

    def __exit__(self, *exc) -> None:
        # A Ctrl-C or SIGTERM while stopping would leave the server up: the stop ignores them.
        old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            subprocess.call(self.stop_cmd(), env=self._env(), preexec_fn=_ignore_interrupts)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def load_test_cmd(args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "load_test.py"), "--url", f"127.0.0.1:{args.grpc_port}",
            *shlex.split(args.load_test_args),
            "--server-pid-file", str(Path(args.run_dir or DEFAULT_RUN_DIR) / "tritonserver.pid")]


# ---- the report --------------------------------------------------------------------------------
def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def _num(v: float | None, spec: str = ".1f", unit: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{unit}"


def served_device_bytes(numbers: dict | None, mem: dict) -> tuple[float, float]:
    """(working set, summaries) of one sequence: the server's gauges, else the config's plan."""
    numbers = numbers or {}
    ws, summ = numbers.get("device_working_set"), numbers.get("device_summaries")
    return (mem["working_set"] if ws is None else ws), (mem["summaries"] if summ is None else summ)


def build_rows(results: dict[str, dict], mem: dict) -> list[tuple[str, dict[str, str]]]:
    """(label, {mode: cell}) for the side-by-side table. results[mode] = {"answer": Answer as a dict,
    "found": bool, "numbers": request_numbers(...) or None}."""
    rows: list[tuple[str, dict[str, str]]] = []

    def row(label: str, fn: Callable[[str, dict], str]) -> None:
        rows.append((label, {m: fn(m, r) for m, r in results.items()}))

    def device(m: str, r: dict) -> str:
        if m == "dense":
            ctx = r["answer"]["prompt_tokens"] + r["answer"]["output_tokens"]
            return f"{fmt_bytes(mem['dense_kv_per_token'] * ctx)} (K+V of {ctx} tokens)"
        ws, summ = served_device_bytes(r["numbers"], mem)
        return f"{fmt_bytes(ws + summ)} ({fmt_bytes(ws)} + {fmt_bytes(summ)} summ.)"

    def la(key: str, fmt: Callable) -> Callable[[str, dict], str]:
        def cell(m: str, r: dict) -> str:
            if m == "dense":
                return "n/a"
            v = (r["numbers"] or {}).get(key)
            return fmt(v) + ("*" if (r["numbers"] or {}).get("rates_since_start") and key in RATE_GAUGES else "")
        return cell

    row("needle found", lambda m, r: "yes" if r["found"] else "NO")
    row("prompt / output tokens", lambda m, r: f"{r['answer']['prompt_tokens']} / {r['answer']['output_tokens']}")
    row("device KV per sequence", device)
    row("H2D bytes (this request)", lambda m, r: "0 (none)" if m == "dense" else
        la("h2d_bytes", lambda v: "-" if v is None else
           f"{fmt_bytes(v)} ({v / mem['block_bytes']:.0f} blocks)")(m, r))
    count = lambda v: _num(v, ".0f")  # noqa: E731
    row("  prefetched / urgent blocks", lambda m, r: "0 / 0" if m == "dense" else
        f"{la('prefetched_blocks', count)(m, r)} / {la('urgent_blocks', count)(m, r)}")
    row("prefetch hit rate", la("prefetch_hit_rate", _pct))
    row("draft accept rate", la("draft_accept_rate", _pct))
    row("top-K agreement", la("agreement", lambda v: _num(v, ".3f")))
    row("TTFT (prefill)", lambda m, r: _num(r["answer"]["ttft_s"], ".1f", " s"))
    row("decode tokens/s", lambda m, r: _num(r["answer"]["decode_tokens_per_s"], ".1f"))
    return rows


def format_table(rows: list[tuple[str, dict[str, str]]], modes: list[str]) -> str:
    w0 = max(len(label) for label, _ in rows)
    ws = {m: max(len(m), *(len(cells.get(m, "")) for _, cells in rows)) for m in modes}
    lines = [f"{'':<{w0}}  " + "  ".join(f"{m:>{ws[m]}}" for m in modes)]
    lines += [f"{label:<{w0}}  " + "  ".join(f"{cells.get(m, ''):>{ws[m]}}" for m in modes) for label, cells in rows]
    return "\n".join(lines)


LEGEND = """\
What the numbers mean:
  needle found            RULER's check: the hidden 7-digit number is in the answer.
  device KV per sequence  KV bytes one sequence keeps in the device tier. Dense: the K and V of every
                          context token (grows with the context). Lookahead: a fixed working set
                          (sink + recent window + top_k blocks per layer and KV head) plus the
                          per-block min/max key summaries used to score blocks; the same at any
                          context length. (On this CPU build the "device tier" is host memory standing
                          in for GPU memory; the bytes are what a GPU would hold.)
  H2D bytes               KV bytes copied host -> device for this request: the first working set after
                          prefill, then per step the blocks the draft predicted (prefetch, in the
                          background) and the misses. Dense copies nothing: its whole KV is resident.
  prefetched / urgent     the H2D copies in (layer, KV head) blocks: prefetched = predicted by the draft
                          and copied in the background; urgent = needed by the real query but missed by
                          the prefetch, fetched before attention while the step waited (miss policy urgent).
  prefetch hit rate       share of the blocks attention needed that were already on the device.
  draft accept rate       share of steps whose draft token (guessed one step ahead, in the same
                          forward pass) was the token actually generated.
  top-K agreement         mean overlap of the draft's predicted top-K block set with the real query's
                          (1.0: the draft picked exactly the blocks attention then wanted).
  TTFT                    time to first token at the client: mostly prefill of the whole prompt.
  decode tokens/s         tokens after the first, divided by the time they took (one sequence).
  *                       a rate marked so counts earlier requests too (the server was not fresh)."""


def print_report(q: Question, results: dict[str, dict], mem: dict, modes: list[str], log=print) -> None:
    log(f"\n=== {q.task}: one ~{q.prompt_tokens}-token document, one question (greedy) ===")
    log(f"expected answer: {', '.join(q.answers)}")
    for m in modes:
        r = results[m]
        text = " ".join(r["answer"]["text"].split())
        log(f"{m:>9} answer: {text!r}" + (f"  [error: {r['answer']['error']}]" if r["answer"]["error"] else ""))
    log("")
    log(format_table(build_rows(results, mem), modes))
    if q.follow_ups and all("follow_ups" in results[m] for m in modes):
        log("\nPrefix caching: the later questions reuse the document's KV (only the new question is prefilled):")
        log(format_follow_ups(q, results, modes))
    c = mem["config"]
    log(f"\nlookahead settings: top_k {c['top_k']} blocks of {c['block_size']} tokens, fetch_ratio "
        f"{c['fetch_ratio']}, residency {c['residency']}, miss policy {c['miss_policy']}, draft {c['draft']}; "
        f"at max_model_len {mem['max_model_len']} dense would need {fmt_bytes(mem['dense_at_max_len'])} per "
        f"sequence, lookahead still {fmt_bytes(mem['lookahead_total'])}.")
    if "lookahead" in results:
        ws, summ = served_device_bytes(results["lookahead"]["numbers"], mem)
        if (ws, summ) != (mem["working_set"], mem["summaries"]):
            log(f"note: the server reports {fmt_bytes(ws)} + {fmt_bytes(summ)} of device bytes per sequence, "
                f"the engine dir's config plans {fmt_bytes(mem['working_set'])} + {fmt_bytes(mem['summaries'])} "
                "(runtime/memory_plan.py): they should agree")
    log("")
    log(LEGEND)


# ---- main --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default=str(ROOT / "engines" / "default"))
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--run-dir", help=f"serve.sh's --run-dir (default: serve.sh's, {DEFAULT_RUN_DIR})")
    p.add_argument("--task", default="niah_single", help="a RULER task of bench/longctx_data.py")
    p.add_argument("--context", type=int, default=5120,
                   help="RULER length: prompt + RULER's answer reserve (5120: a ~5K-token prompt)")
    p.add_argument("--index", type=int, default=0, help="which sample of the task")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--request-timeout", type=float, default=None, metavar="S",
                   help="seconds to wait for the first question's answer (default: 600 + 0.05 a prompt token: a "
                        "30K prompt's cold prefill takes ~15 min on 2 AVX2 cores)")
    p.add_argument("--modes", default="dense,lookahead", help="comma-separated, of dense,lookahead")
    p.add_argument("--no-load-test", dest="load_test", action="store_false")
    p.add_argument("--load-test-args", default=LOAD_TEST_ARGS, help="scripts/load_test.py's options "
                   "(--url and --server-pid-file are added)")
    p.add_argument("--json", default=str(ROOT / "results" / "demo.json"), help="write the results here ('' : no)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the config's memory numbers; "
                                                          "start nothing")
    return p


def main(argv: list[str] | None = None, log=print) -> int:
    args = build_parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"demo: --modes must be a comma-separated list of {', '.join(MODES)}, got {args.modes!r}")
    modes.sort(key=MODES.index)       # dense first: the lookahead server then stays up for the load test
    if not (Path(args.engine) / "engine.yaml").is_file():
        raise SystemExit(f"demo: {args.engine} is not an engine dir (no engine.yaml); build one: make engine")
    mem = kv_memory(args.engine, args.context)
    if args.dry_run:
        log(f"demo (dry run): {args.task} at {args.context} tokens, max_tokens {args.max_tokens}, "
            f"engine {args.engine}")
        for m in modes:
            s = Server(args, m)
            log(f"  {shlex.join(s.start_cmd())}")
            log(f"  POST http://127.0.0.1:{args.http_port}/v2/models/{MODEL}/generate_stream; "
                f"GET http://127.0.0.1:{args.metrics_port}/metrics before and after")
            if m == "lookahead" and args.load_test:
                log(f"  {shlex.join(load_test_cmd(args))}")
            log(f"  {shlex.join(s.stop_cmd())}")
        log(f"device KV per sequence: lookahead {fmt_bytes(mem['lookahead_total'])} (working set "
            f"{fmt_bytes(mem['working_set'])} + summaries {fmt_bytes(mem['summaries'])}); dense "
            f"{fmt_bytes(mem['dense_context'])} at {args.context} tokens, {fmt_bytes(mem['dense_at_max_len'])} "
            f"at {mem['max_model_len']}")
        return 0

    signal.signal(signal.SIGTERM, _interrupt)
    t_start = time.monotonic()
    try:
        log(f"demo: building the question ({args.task}, ~{args.context} tokens, from RULER's generator) ...",
            flush=True)
        q = make_question(args.engine, args.task, args.context, args.index)
        log(f"demo: a {q.prompt_tokens}-token prompt; the answer to find: {', '.join(q.answers)}", flush=True)
        results: dict[str, dict] = {}
        load_rc = 0
        for m in modes:
            log(f"\ndemo: [{m}] starting the server", flush=True)
            with Server(args, m):
                log(f"demo: [{m}] asking (prefill of {q.prompt_tokens} tokens takes a while on a CPU)", flush=True)
                ans, numbers = ask(args.http_port, args.metrics_port, q, args.max_tokens, log=log,
                                   timeout=args.request_timeout)
                if ans.error:
                    raise DemoError(f"[{m}] the request failed: {ans.error}")
                results[m] = {"answer": {k: v for k, v in asdict(ans).items() if k != "token_times"},
                              "found": found(ans.text, q), "numbers": numbers if m == "lookahead" else None}
                log(f"demo: [{m}] answered in {ans.total_s:.1f} s: {' '.join(ans.text.split())!r}", flush=True)
                results[m]["follow_ups"] = ask_follow_ups(args, q, m, log)
                if m == "lookahead" and args.load_test:
                    print_report(q, results, mem, [x for x in modes if x in results], log)
                    log("\ndemo: load test against the lookahead server (served over gRPC streaming vs the same "
                        "workload in-process)", flush=True)
                    load_rc = subprocess.call(load_test_cmd(args), cwd=ROOT)
        if not (args.load_test and "lookahead" in modes):
            print_report(q, results, mem, modes, log)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"question": {**asdict(q), "prompt": None, "follow_ups": FOLLOW_UPS}, "memory": mem,
                                                   "results": results}, indent=2))
        log(f"\ndemo: done in {time.monotonic() - t_start:.0f} s"
            + (f"; the results are in {args.json}" if args.json else ""))
        return 1 if load_rc else 0
    except DemoError as e:
        log(f"demo: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        log("demo: interrupted (no server left running)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
