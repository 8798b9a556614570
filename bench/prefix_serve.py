"""Prefix-caching workloads over HTTP: the same document-QA prompts sent to an OpenAI
/v1/completions server at a fixed concurrency (bench_prefix.py --peer / --dynamo).

- `complete()` posts one streaming completion and times it (TTFT = the first chunk with text);
  usage gives the prompt and cached tokens, and llama-server's `timings.prompt_n` the prompt tokens it
  really computed.
- `run_dqa()` sends the prompts in order at concurrency C (a new one starts when one ends) and
  returns the same summary as the in-process bench.
- `LlamaServer` runs llama.cpp's `llama-server` (built by `python -m bench.llama_cpp build --server`) on a
  GGUF, one slot per concurrent request, its prompt cache on.
- `VllmServer` runs vLLM CPU's OpenAI server (a venv of its own, docs/INSTALL.md) on the Hugging Face
  dir our engine was built from, prefix caching on, bf16 by default.
- `DynamoDeployment` runs `scripts/serve.sh start --frontend dynamo` with N workers, a router and a
  host pool size, and stops it.
"""
from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class ServerError(RuntimeError):
    """The server refused a request or did not come up."""


@dataclass
class Reply:
    text: str
    ttft_s: float | None
    total_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    computed_tokens: int | None         # prompt tokens the server says it computed (llama-server), else None


def _split(url: str) -> tuple[str, int, str]:
    u = urllib.parse.urlsplit(url)
    return u.hostname or "127.0.0.1", u.port or 80, u.path.rstrip("/")


def complete(url: str, model: str, prompt: str, max_tokens: int, extra: dict | None = None,
             timeout: float = 900.0) -> Reply:
    """One streaming /v1/completions request at temperature 0, `ignore_eos` so every reply has
    `max_tokens` tokens."""
    host, port, base = _split(url)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **(extra or {})}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict = {}
    timings: dict = {}
    try:
        conn.request("POST", f"{base}/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ServerError(f"{url}: HTTP {resp.status}: {resp.read()[:400]!r}")
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerError(f"{url}: {chunk['error']}")
            for c in chunk.get("choices") or []:
                if c.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(c["text"])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    finally:
        conn.close()
    details = usage.get("prompt_tokens_details") or {}
    return Reply(text="".join(text), ttft_s=ttft, total_s=time.perf_counter() - t0,
                 prompt_tokens=usage.get("prompt_tokens"), cached_tokens=details.get("cached_tokens"),
                 completion_tokens=usage.get("completion_tokens"),
                 computed_tokens=timings.get("prompt_n"))


def pct(xs: list[float], p: float) -> float | None:
    """The p-quantile of xs, linearly interpolated (None for no values)."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def first_and_later(order: list[str], ttft: dict[str, float | None], doc_of) -> dict:
    """TTFT percentiles of each document's first request (in sending order: its document is cold)
    apart from the later ones (their document may be cached): `order` the request ids as sent,
    `ttft` id -> seconds, `doc_of(id)` the document a request asks about."""
    firsts = first_requests(order, doc_of)
    first = [ttft[rid] for rid in order if rid in firsts and ttft.get(rid) is not None]
    later = [ttft[rid] for rid in order if rid not in firsts and ttft.get(rid) is not None]
    return {"ttft_first_p50_s": pct(first, 0.5), "ttft_later_p50_s": pct(later, 0.5),
            "ttft_later_p90_s": pct(later, 0.9)}


def first_requests(order: list[str], doc_of) -> set[str]:
    """The ids in `order` that are the first request of their document (`doc_of(id)`)."""
    seen: set = set()
    firsts: set[str] = set()
    for rid in order:
        if doc_of(rid) not in seen:
            firsts.add(rid)
        seen.add(doc_of(rid))
    return firsts


def dqa_doc(rid: str) -> str:
    """The document of a document-QA request id `dqa-<doc>-<question>` (any other id: its own)."""
    return rid.split("-")[1] if rid.startswith("dqa-") else rid


def computed(r: Reply) -> int | None:
    """Prompt tokens the server computed for `r`: its own count (llama-server), else the prompt
    less its cached tokens; None where it reports neither (vLLM without
    --enable-prompt-tokens-details reports no cached tokens: not the same as none cached)."""
    if r.computed_tokens is not None:
        return r.computed_tokens
    if r.prompt_tokens is not None and r.cached_tokens is not None:
        return r.prompt_tokens - r.cached_tokens
    return None


def run_dqa(url: str, model: str, prompts: list[tuple[str, str]], concurrency: int, max_tokens: int,
            extra: dict | None = None, log=print) -> dict:
    """`prompts` (id, text) in order at `concurrency`; the summary bench_prefix prints."""
    work: queue.Queue = queue.Queue()
    for item in prompts:
        work.put(item)
    replies: dict[str, Reply] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                rid, text = work.get_nowait()
            except queue.Empty:
                return
            try:
                r = complete(url, model, text, max_tokens, extra)
            except Exception as e:      # noqa: BLE001 — reported with the request id, the run goes on
                with lock:
                    errors.append(f"{rid}: {e}")
                continue
            with lock:
                replies[rid] = r
                if len(replies) % max(1, len(prompts) // 8) == 0:
                    log(f"  {len(replies)}/{len(prompts)} done")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise ServerError(f"{len(errors)} of {len(prompts)} requests failed; first: {errors[0]}")
    ttfts = [r.ttft_s for r in replies.values() if r.ttft_s is not None]
    out = sum(r.completion_tokens or 0 for r in replies.values())
    comp = [computed(r) for r in replies.values()]
    prompt_total = sum(r.prompt_tokens or 0 for r in replies.values())
    reported = [r.cached_tokens for r in replies.values() if r.cached_tokens is not None]
    cached_total = sum(reported) if len(reported) == len(replies) else None
    return {"n_requests": len(replies), "ttft_p50_s": pct(ttfts, 0.5), "ttft_p90_s": pct(ttfts, 0.9),
            "output_tokens": out, "wall_s": wall, "output_tokens_per_s": out / wall if wall else None,
            "prefill_tokens_computed": sum(c for c in comp if c is not None) if all(c is not None for c in comp)
            else None,
            "prompt_tokens_total": prompt_total, "cached_tokens_total": cached_total,
            "hit_rate": cached_total / prompt_total if prompt_total and cached_total is not None else None,
            **first_and_later([rid for rid, _ in prompts], {rid: r.ttft_s for rid, r in replies.items()}, dqa_doc),
            "first_cached_tokens": first_cached([rid for rid, _ in prompts], replies),
            "texts": {rid: r.text for rid, r in replies.items()}}


def first_cached(order: list[str], replies: dict[str, Reply]) -> int | None:
    """Cached prompt tokens the server reported for each document's first request (in sending order),
    summed: more than 0 means the documents were in its cache before the run, so the "first question"
    TTFTs are not cold. None where the server reports no cached tokens."""
    cached = [replies[rid].cached_tokens for rid in first_requests(order, dqa_doc) if rid in replies]
    return None if None in cached else sum(cached)


def wait_http(url: str, path: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    host, port, base = _split(url)
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"the server exited with {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection(host, port, timeout=5)
            conn.request("GET", base + path)
            r = conn.getresponse()
            r.read()
            conn.close()
            if r.status == 200:
                return
            last = f"HTTP {r.status}"
        except OSError as e:
            last = str(e)
        time.sleep(0.5)
    raise ServerError(f"{url}{path} not ready after {timeout:.0f}s ({last})")


class LlamaServer:
    """llama.cpp's server on `model` with `slots` parallel slots of `ctx_per_slot` tokens each and its
    prompt cache on (the default: `cache_prompt` per request, slots reused by prompt similarity, a RAM
    cache of earlier prompts)."""

    def __init__(self, binary: Path, model: Path, slots: int, ctx_per_slot: int, threads: int = 2,
                 port: int = 8090, cache_ram_mib: int = 8192, log_path: Path | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path or ROOT / "build" / "llama.cpp" / "server.log"
        self.command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                        "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot),
                        "--cache-ram", str(cache_ram_mib), "-fa", "off", "--no-webui"]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_http(self.url, "/health", 300, self.proc)
        except BaseException:
            self.__exit__(None, None, None)
            raise ServerError(f"llama-server did not start: see {self.log_path} "
                              f"({' '.join(self.command)})") from None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


VLLM_BIND_HELP = ("vLLM's VLLM_CPU_OMP_THREADS_BIND: nobind (every core, as ours), auto (vLLM's default: on a 2-core "
                  "machine its threads share one core) or a CPU list (default: %(default)s)")


def vllm_env(threads: int, kv_gib: int, bind: str = "nobind") -> dict[str, str]:
    """The environment vLLM CPU runs in beside us: `threads` OpenMP threads, `kv_gib` GiB of KV
    cache, and its thread binding. vLLM's own default ("auto") reserves one core per worker for its
    scheduler process and pins the OpenMP threads to the cores left: on a 2-core machine its
    `threads` threads then share one core (an 8K prefill took 38 s so, 20 s on both cores). "nobind"
    (the default here) leaves them on every core, as ours run; any other value is passed as
    VLLM_CPU_OMP_THREADS_BIND (a CPU list such as "0-1")."""
    if not bind:
        raise ValueError("vLLM bind: empty; use nobind, auto or a CPU list such as 0-1")
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "OMP_NUM_THREADS": str(threads),
            "VLLM_CPU_OMP_THREADS_BIND": bind}


class VllmServer:
    """vLLM CPU's OpenAI server (`python -m vllm.entrypoints.openai.api_server`: its `vllm` command
    looks up a distribution named `vllm`, which `vllm-cpu` is not) on `hf_dir`, served as `model`,
    prefix caching on, `kv_gib` GiB of KV cache, `threads` OpenMP threads bound by `bind` (vllm_env)."""

    def __init__(self, python: str, hf_dir: Path, model: str = "lookahead_llm", dtype: str = "bfloat16",
                 max_model_len: int = 8192, port: int = 8200, threads: int = 2, kv_gib: int = 6,
                 log_path: Path | None = None, bind: str = "nobind"):
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path or ROOT / "build" / "vllm" / "server.log"
        self.command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                        "--served-model-name", model, "--dtype", dtype, "--max-model-len", str(max_model_len),
                        "--enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port)]
        self.env = vllm_env(threads, kv_gib, bind)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "VllmServer":
        if not Path(self.command[0]).exists():
            raise ServerError(f"{self.command[0]}: no such python (install vLLM CPU: docs/INSTALL.md, "
                              "'vLLM CPU (optional peer)')")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        try:
            wait_http(self.url, "/v1/models", 600, self.proc)
        except BaseException:
            self.__exit__(None, None, None)
            raise ServerError(f"vLLM did not start: see {self.log_path} ({' '.join(self.command)})") from None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


class DynamoDeployment:
    """`scripts/serve.sh start --frontend dynamo` with `workers` workers and `router`, each worker's host
    pool `num_host_blocks` blocks; stopped on exit."""

    def __init__(self, engine: str, workers: int, router: str, num_host_blocks: int | None, port: int = 8070,
                 run_dir: Path | None = None, extra: list[str] | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.run_dir = run_dir or ROOT / "build" / f"bench_prefix_dynamo_{router}"
        self.start_cmd = ["bash", str(ROOT / "scripts" / "serve.sh"), "start", "--frontend", "dynamo",
                          "--engine", engine, "--workers", str(workers), "--router", router, "--http-port", str(port),
                          "--run-dir", str(self.run_dir), "--timeout", "600", "--"]
        if num_host_blocks:
            self.start_cmd += ["--num-host-blocks", str(num_host_blocks)]
        self.start_cmd += list(extra or [])
        self.stop_cmd = ["bash", str(ROOT / "scripts" / "serve.sh"), "stop", "--run-dir", str(self.run_dir)]

    def __enter__(self) -> "DynamoDeployment":
        r = subprocess.run(self.start_cmd, capture_output=True, text=True)
        if r.returncode != 0:
            subprocess.run(self.stop_cmd, capture_output=True)
            raise ServerError(f"Dynamo did not start ({' '.join(self.start_cmd)}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        return self

    def __exit__(self, *exc: Any) -> None:
        subprocess.run(self.stop_cmd, capture_output=True)
