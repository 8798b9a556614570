#!/usr/bin/env python3
"""Soak the served engine: N minutes of mixed prompt lengths with a share of the streams cancelled
mid-flight, sampling the python stub's memory and the engine's free KV blocks, in dense and in
lookahead mode.

    scripts/soak.py --minutes 10 --mode dense --mode lookahead --json results/soak.json --plot results/soak.png
    scripts/soak.py --minutes 1 --url 127.0.0.1:8001 --metrics-port 8002 --server-pid-file build/serve/tritonserver.pid

With --mode, each mode gets its own server (scripts/serve.sh start/stop, free ports, a run dir under
--run-dir); with --url, the running server is soaked once. Traffic goes to 127.0.0.1 only.

Load: --concurrency streams in flight (closed loop) until the time is up or --max-requests were
sent. Prompt lengths are drawn from --prompt-lens (tokens:weight, exact with the engine's
tokenizer); the first requests take each length once, so the warm-up has seen the longest.
A --cancel-share of the streams is cancelled after a random number of tokens (at most half of
their max_tokens). Every --sample-s seconds it samples the RSS of the python stub (the
tritonserver child that runs the model) and of tritonserver, and the metrics endpoint's gauges
(free / total KV blocks, queue, running).

Report, per mode: errors (every error response; the cancels it made itself are not errors),
output tokens/s per bucket (a minute in long runs) and the drift over the run (the mean of the
last third of the buckets after the warm-up against the first third), the stub's RSS growth from
the end of the warm-up to the end of the load (and its slope), and whether the free blocks came
back to the pool's total once the load stopped. The warm-up is a fifth of the run (at most 60 s),
or until a request of every prompt length has ended, if later (at most half the run).
The targets (issue 19): 0 errors, RSS growth < 5 %, blocks back to full. Exit status 1 when one
is missed. Table on stdout, JSON with --json (samples included), a plot with --plot (matplotlib).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runtime.threads import prepare_threads

prepare_threads()  # first: libgomp reads GOMP_SPINCOUNT once, when torch loads it (runtime/threads.py)

import numpy as np

from bench.load_workload import Prompts
from deploy.triton_env import free_ports

ROOT = Path(__file__).resolve().parents[1]

MODEL = "lookahead_llm"
TARGET_RSS_GROWTH_PCT = 5.0
GAUGES = {"lookahead_free_kv_blocks": "free_blocks", "lookahead_kv_blocks": "total_blocks",
          "lookahead_queue_depth": "queue", "lookahead_running_requests": "running",
          "lookahead_output_tokens_total": "output_tokens"}


# ---- the workload -------------------------------------------------------------------------------
def parse_lens(spec: str) -> list[tuple[int, float]]:
    """"24:5,200:3,1000:2,4000:1" -> [(24, 5.0), ...] (prompt tokens : weight)."""
    out = []
    for part in spec.split(","):
        n, _, w = part.partition(":")
        out.append((int(n), float(w or 1)))
    if not out or any(n < 1 or w <= 0 for n, w in out):
        raise argparse.ArgumentTypeError(f"--prompt-lens wants tokens:weight pairs, got {spec!r}")
    return out


@dataclass
class Plan:
    """Request i's prompt length, tokens to generate, and after how many tokens it is cancelled."""

    prompt_len: int
    max_tokens: int
    cancel_after: int | None


class Workload:
    def __init__(self, lens: list[tuple[int, float]], min_tokens: int, max_tokens: int, cancel_share: float,
                 tokenizer, seed: int):
        self.lens, self.seed = lens, seed
        self.min_tokens, self.max_tokens, self.cancel_share = min_tokens, max_tokens, cancel_share
        self.prompts = {n: Prompts(n, 0.0, None, tokenizer, seed + n) for n, _ in lens}

    def plan(self, i: int) -> Plan:
        rng = random.Random(self.seed * 7_919 + i)
        if i < len(self.lens):                       # each length once first, the longest included
            n = sorted(self.lens)[-1 - i][0]
        else:
            n = rng.choices([n for n, _ in self.lens], [w for _, w in self.lens])[0]
        k = rng.randint(self.min_tokens, self.max_tokens)
        # Cancelled within the first half of its tokens, so that the cancel lands well before the
        # final response: tritonserver 2.51 loses a cancel that lands just after it, and then its
        # stop waits out the exit timeout (docs/SERVING.md, "gRPC streaming clients").
        cancel = rng.randint(1, max(1, k // 2)) if k > 1 and rng.random() < self.cancel_share else None
        return Plan(n, k, cancel)

    def prompt(self, i: int, plan: Plan) -> str:
        return self.prompts[plan.prompt_len].get(i)


@dataclass
class Result:
    start: float
    end: float | None = None
    token_times: list[float] = field(default_factory=list)   # one entry per generated token
    prompt_len: int = 0
    cancelled: bool = False              # cancelled by us, as planned
    error: str | None = None


# ---- client side --------------------------------------------------------------------------------
def grpc_inputs(prompt: str, max_tokens: int):
    from tritonclient.grpc import InferInput

    def tensor(name, arr, dtype):
        t = InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t
    return [tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
            tensor("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
            tensor("stream", np.array([True]), "BOOL"),
            tensor("sampling_parameters", np.array([b'{"ignore_eos": true}'], dtype=np.object_), "BYTES")]


async def one_request(client, i: int, workload: Workload, timeout_s: float) -> Result:
    from serving.grpc_stream import stream_request

    plan = workload.plan(i)
    res = Result(start=time.monotonic(), prompt_len=plan.prompt_len)

    def on_response(result, error):
        now = time.monotonic()
        if error is not None:
            res.error, res.end = str(error), now
            return False
        n = int(result.as_numpy("num_output_tokens")[0])
        res.token_times += [now] * n
        if plan.cancel_after is not None and len(res.token_times) >= plan.cancel_after:
            res.cancelled, res.end = True, now
            return True                   # stream_request cancels the call
        if result.get_response().parameters["triton_final_response"].bool_param:
            res.end = now
        return False
    try:
        await asyncio.wait_for(stream_request(client, MODEL, grpc_inputs(workload.prompt(i, plan), plan.max_tokens),
                                              on_response), timeout_s)
    except asyncio.TimeoutError:
        res.error = f"no final response within {timeout_s:.0f} s"
    except Exception as e:               # connection refused, server gone: count it, keep going
        res.error = f"{type(e).__name__}: {e}"
    if res.end is None and res.error is None:
        res.error = "the stream ended without a final response"
    return res


# ---- server side: processes, memory, metrics -------------------------------------------------------
def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, comm) for every process (Linux /proc)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        out[int(stat.parent.name)] = (int(text.rsplit(")", 1)[1].split()[1]), comm)
    return out


def stub_pids(server_pid: int) -> list[int]:
    """The python backend stubs under tritonserver `server_pid` (comm "triton_python_b...")."""
    table, tree, frontier = _proc_table(), set(), [server_pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, (pp, _) in table.items() if pp == parent and p not in tree]
        tree.update(kids)
        frontier += kids
    return sorted(p for p in tree if table[p][1].startswith("triton_python"))


def rss_bytes(pid: int) -> int | None:
    try:
        m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def scrape(metrics_url: str) -> dict[str, float]:
    """Our gauges from the metrics endpoint, summed over model instances."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^(lookahead_\w+)\{[^}]*\} (\S+)$", text, re.M):
        if m[1] in GAUGES:
            out[GAUGES[m[1]]] = out.get(GAUGES[m[1]], 0.0) + float(m[2])
    return out


@dataclass
class Sample:
    t: float                             # seconds since the load started
    stub_rss: int | None
    server_rss: int | None
    free_blocks: float | None = None
    total_blocks: float | None = None
    queue: float | None = None
    running: float | None = None
    output_tokens: float | None = None
    phase: str = "load"                  # "load" or "settle" (after the load stopped)


def take_sample(t: float, server_pid: int | None, metrics_url: str, phase: str) -> Sample:
    stubs = stub_pids(server_pid) if server_pid else []
    rss = [rss_bytes(p) for p in stubs]
    s = Sample(t, sum(r for r in rss if r) if any(rss) else None, rss_bytes(server_pid) if server_pid else None,
               phase=phase)
    try:
        for k, v in scrape(metrics_url).items():
            setattr(s, k, v)
    except OSError:
        pass
    return s


# ---- one soak -------------------------------------------------------------------------------------
async def soak(url: str, metrics_url: str, server_pid: int | None, workload: Workload, args) -> dict:
    import tritonclient.grpc.aio as grpcclient

    duration = args.minutes * 60.0
    client = grpcclient.InferenceServerClient(url)
    results: list[Result] = []
    samples: list[Sample] = []
    t0 = time.monotonic()
    deadline = t0 + duration
    counter = iter(range(args.max_requests))
    load_done = asyncio.Event()

    async def worker() -> None:
        while time.monotonic() < deadline:
            i = next(counter, None)
            if i is None:
                return
            results.append(await one_request(client, i, workload, args.request_timeout))

    async def sampler() -> None:
        while not load_done.is_set():
            samples.append(await asyncio.to_thread(take_sample, time.monotonic() - t0, server_pid, metrics_url, "load"))
            try:
                await asyncio.wait_for(load_done.wait(), args.sample_s)
            except asyncio.TimeoutError:
                pass
    sampling = asyncio.create_task(sampler())
    try:
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    finally:
        t_load_end = time.monotonic() - t0
        load_done.set()
        await sampling
        await client.close()
    # The load stopped: wait for every block to come back (aborts are polled every 0.2 s).
    settle_deadline = time.monotonic() + args.settle_s
    while True:
        s = await asyncio.to_thread(take_sample, time.monotonic() - t0, server_pid, metrics_url, "settle")
        samples.append(s)
        if is_settled(s) or time.monotonic() > settle_deadline:
            break
        await asyncio.sleep(0.5)
    warmup = args.warmup_s if args.warmup_s is not None else default_warmup(results, t0, duration)
    bucket = args.bucket_s or max(10.0, min(60.0, duration / 6))
    return summarize_soak(results, samples, t0, t_load_end, warmup, bucket)


def default_warmup(results: list[Result], t0: float, duration: float) -> float:
    """A fifth of the run (at most 60 s), or longer: until a request of every prompt length has
    ended (the longest prefill sizes the allocator's caches), capped at half the run."""
    ends: dict[int, float] = {}
    for r in results:
        if r.end is not None:
            ends[r.prompt_len] = min(ends.get(r.prompt_len, math.inf), r.end - t0)
    every_length = max(ends.values(), default=0.0)
    return round(max(min(60.0, 0.2 * duration), min(every_length, 0.5 * duration)), 1)


def is_settled(s: Sample) -> bool:
    return (s.free_blocks is not None and s.total_blocks is not None and s.free_blocks == s.total_blocks
            and not s.running and not s.queue)


def throughput_trend(whole: list[dict], bucket_s: float) -> dict | None:
    """A least-squares line through the whole buckets' tokens/s: its slope as % of the mean per
    10 minutes, with two standard errors. The thirds' drift above swings with the prompt-length mix
    of a minute (a 4000-token prefill stalls every stream); a slope inside its 2 SE is no trend."""
    ys = np.array([b["tokens_per_s"] for b in whole if b["tokens_per_s"] is not None], dtype=float)
    if len(ys) < 3 or ys.mean() <= 0:
        return None
    xs = np.arange(len(ys)) * bucket_s / 600.0                      # in 10-minute units
    slope, intercept = np.polyfit(xs, ys, 1)
    resid = ys - (slope * xs + intercept)
    se = float(np.sqrt(resid @ resid / (len(ys) - 2) / ((xs - xs.mean()) @ (xs - xs.mean()))))
    pct = lambda v: round(100.0 * v / ys.mean(), 1)  # noqa: E731
    return {"pct_per_10min": pct(slope), "two_se_pct": pct(2 * se), "significant": abs(slope) > 2 * se}


def _trend(t: dict | None) -> str:
    if not t:
        return "-"
    return f"{t['pct_per_10min']:+.1f}% ± {t['two_se_pct']:.1f}%" + (" (a trend)" if t["significant"] else " (none)")


def summarize_soak(results: list[Result], samples: list[Sample], t0: float, t_load_end: float,
                   warmup_s: float, bucket_s: float) -> dict:
    """The report of one soak (pure: times are monotonic seconds, `t0` the load's start)."""
    errors = [r.error for r in results if r.error is not None]
    kinds: dict[str, int] = {}
    for e in errors:
        kind = "queue full" if "queue is full" in e else "timeout" if "within" in e else "other"
        kinds[kind] = kinds.get(kind, 0) + 1
    tokens = [t - t0 for r in results for t in r.token_times]
    n_buckets = max(1, math.ceil(t_load_end / bucket_s - 1e-9))
    buckets = []
    for b in range(n_buckets):
        lo, hi = b * bucket_s, min((b + 1) * bucket_s, t_load_end)
        n = sum(lo <= t < hi for t in tokens)
        buckets.append({"start_s": round(lo, 1), "end_s": round(hi, 1), "output_tokens": n,
                        "tokens_per_s": round(n / (hi - lo), 2) if hi > lo else None,
                        "completed": sum(r.end is not None and lo <= r.end - t0 < hi and not r.error for r in results)})
    # Drift: the last third of the whole buckets after the warm-up against the first third.
    whole = [b for b in buckets if b["end_s"] - b["start_s"] >= 0.999 * bucket_s and b["start_s"] >= warmup_s - 1e-9]
    drift = None
    third = len(whole) // 3 or 1
    first = np.mean([b["tokens_per_s"] for b in whole[:third]]) if len(whole) >= 2 else 0.0
    if first > 0:
        drift = round(100.0 * (np.mean([b["tokens_per_s"] for b in whole[-third:]]) / first - 1.0), 1)
    trend = throughput_trend(whole, bucket_s)

    load = [s for s in samples if s.phase == "load" and s.stub_rss]
    after = [s for s in load if s.t >= warmup_s]
    rss_warm = after[0].stub_rss if after else None
    rss_end = after[-1].stub_rss if after else None
    growth = round(100.0 * (rss_end / rss_warm - 1.0), 2) if rss_warm and rss_end else None
    slope = None
    if len(after) >= 3 and after[-1].t > after[0].t:
        slope = round(float(np.polyfit([s.t / 60 for s in after], [s.stub_rss / 2 ** 20 for s in after], 1)[0]), 2)
    final = samples[-1] if samples else None
    settled = bool(final and is_settled(final) and final.phase == "settle")
    settle_s = round(final.t - t_load_end, 2) if final and final.phase == "settle" else None
    done = [r for r in results if r.error is None]
    summary = {
        "duration_s": round(t_load_end, 1), "warmup_s": warmup_s, "bucket_s": bucket_s,
        "requests": len(results), "completed": sum(not r.cancelled for r in done),
        "cancelled": sum(r.cancelled for r in done), "errors": len(errors), "error_kinds": kinds,
        "error_examples": errors[:3],
        "prompt_lens": sorted({r.prompt_len for r in results}),
        "output_tokens": len(tokens), "output_tokens_per_s": round(len(tokens) / t_load_end, 2) if t_load_end else None,
        "buckets": buckets, "throughput_drift_pct": drift, "throughput_trend": trend,
        "stub_rss_mb": {"first": _mb(load[0].stub_rss) if load else None, "after_warmup": _mb(rss_warm),
                        "end": _mb(rss_end), "max": _mb(max((s.stub_rss for s in load), default=None)),
                        "growth_pct": growth, "slope_mb_per_min": slope},
        "server_rss_mb": {"first": _mb(next((s.server_rss for s in samples if s.server_rss), None)),
                          "end": _mb(next((s.server_rss for s in reversed(samples) if s.server_rss), None))},
        "blocks": {"total": _int(final.total_blocks if final else None),
                   "free_after_load": _int(final.free_blocks if final else None),
                   "min_free_during_load": _int(min((s.free_blocks for s in samples if s.phase == "load"
                                                     and s.free_blocks is not None), default=None)),
                   "back_to_full": settled, "settle_s": settle_s},
    }
    summary["targets"] = {"zero_errors": not errors,
                          f"rss_growth_under_{TARGET_RSS_GROWTH_PCT:g}_pct": growth is not None
                          and growth < TARGET_RSS_GROWTH_PCT,
                          "blocks_back_to_full": settled}
    summary["samples"] = [asdict(s) for s in samples]
    return summary


def _int(v) -> int | None:
    return None if v is None else int(v)


def _mb(v) -> float | None:
    return None if v is None else round(v / 2 ** 20, 1)


# ---- report ---------------------------------------------------------------------------------------
def table(summaries: dict[str, dict]) -> str:
    def rss(s):
        r = s["stub_rss_mb"]
        return f"{_f(r['after_warmup'])} -> {_f(r['end'])} MB"

    def blocks(s):
        b = s["blocks"]
        back = "yes" if b["back_to_full"] else "NO"
        settle = f" ({b['settle_s']} s)" if b["settle_s"] else ""
        return f"{_f(b['free_after_load'])}/{_f(b['total'])} {back}{settle}"
    rows = [
        ("minutes of load", lambda s: f"{s['duration_s'] / 60:.1f}"),
        ("requests (done/cancelled/errors)", lambda s: f"{s['completed']}/{s['cancelled']}/{s['errors']}"),
        ("prompt lengths (tokens)", lambda s: ",".join(map(str, s["prompt_lens"]))),
        ("output tokens/s", lambda s: _f(s["output_tokens_per_s"])),
        ("tokens/s per bucket", lambda s: " ".join(_f(b["tokens_per_s"], 0) for b in s["buckets"])),
        ("bucket (s) / warm-up (s)", lambda s: f"{s['bucket_s']:g} / {s['warmup_s']:g}"),
        ("throughput drift after warm-up", lambda s: _pct(s["throughput_drift_pct"])),
        ("trend per 10 min (± 2 SE)", lambda s: _trend(s.get("throughput_trend"))),
        ("stub RSS after warm-up -> end", rss),
        ("stub RSS growth (target < 5%)", lambda s: _pct(s["stub_rss_mb"]["growth_pct"])),
        ("stub RSS slope (MB/min)", lambda s: _f(s["stub_rss_mb"]["slope_mb_per_min"])),
        ("free blocks after load (full?)", blocks),
        ("targets met", lambda s: "yes" if all(s["targets"].values()) else
         "NO: " + ", ".join(k for k, v in s["targets"].items() if not v)),
    ]
    names = list(summaries)
    w0 = max(len(r[0]) for r in rows)
    cells = {n: [fmt(summaries[n]) for _, fmt in rows] for n in names}
    w = {n: max(len(n), *(len(c) for c in cells[n])) for n in names}
    lines = [f"{'':<{w0}}  " + "  ".join(f"{n:>{w[n]}}" for n in names)]
    for i, (label, _) in enumerate(rows):
        lines.append(f"{label:<{w0}}  " + "  ".join(f"{cells[n][i]:>{w[n]}}" for n in names))
    return "\n".join(lines)


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _pct(v) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def plot(summaries: dict[str, dict], path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("soak: matplotlib is not installed: no plot", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for name, s in summaries.items():
        pts = [x for x in s["samples"] if x["stub_rss"]]
        ax[0].plot([x["t"] / 60 for x in pts], [x["stub_rss"] / 2 ** 20 for x in pts], label=name)
        pts = [x for x in s["samples"] if x["free_blocks"] is not None]
        ax[1].plot([x["t"] / 60 for x in pts], [x["free_blocks"] for x in pts], label=name)
        rates = [b["tokens_per_s"] or 0 for b in s["buckets"]]
        ax[2].step([b["start_s"] / 60 for b in s["buckets"]] + [s["buckets"][-1]["end_s"] / 60], rates + rates[-1:],
                   where="post", label=name)
    ax[2].set_ylim(bottom=0)
    for a, title in zip(ax, ("python stub RSS (MB)", "free KV blocks", "output tokens/s per bucket")):
        a.set_title(title)
        a.set_xlabel("minutes since the load started")
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# ---- servers --------------------------------------------------------------------------------------
class Server:
    """scripts/serve.sh start/stop for one mode, on free ports, in its own run dir."""

    def __init__(self, engine: str, mode: str, run_dir: Path, timeout_s: int):
        self.engine, self.mode, self.run_dir, self.timeout_s = engine, mode, run_dir, timeout_s
        self.http, self.grpc, self.metrics = free_ports(3)

    def _serve(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([str(ROOT / "scripts" / "serve.sh"), *args, "--run-dir", str(self.run_dir)],
                              capture_output=True, text=True, timeout=timeout)

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        p = self._serve("start", "--engine", self.engine, "--mode", self.mode, "--http-port", str(self.http),
                        "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics),
                        "--timeout", str(self.timeout_s), timeout=self.timeout_s + 60)
        if p.returncode != 0:
            raise RuntimeError(f"serve.sh start --mode {self.mode} failed ({p.returncode}):\n{p.stdout}{p.stderr}")

    @property
    def pid(self) -> int:
        return int((self.run_dir / "tritonserver.pid").read_text())

    def stop(self) -> dict:
        t = time.monotonic()
        p = self._serve("stop", timeout=120)
        return {"rc": p.returncode, "seconds": round(time.monotonic() - t, 1),
                "output": (p.stdout + p.stderr).strip().splitlines()[-3:]}


# ---- main ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="minutes of load per mode")
    p.add_argument("--mode", action="append", choices=["dense", "lookahead"],
                   help="start a server in this mode (repeat for both); default: dense and lookahead")
    p.add_argument("--engine", default=str(ROOT / "engines" / "default"))
    p.add_argument("--run-dir", default=None,
                   help="run dirs of the started servers (default /tmp/lookahead_soak_<pid>)")
    p.add_argument("--start-timeout", type=int, default=240)
    p.add_argument("--url", help="soak this running server's gRPC address instead (127.0.0.1:PORT)")
    p.add_argument("--metrics-port", type=int, default=8002, help="with --url: its metrics port")
    p.add_argument("--server-pid-file", help="with --url: tritonserver's PID file, for the stub's RSS")
    p.add_argument("--label", default="served", help="with --url: the column name")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-requests", type=int, default=100_000, help="stop sending after this many")
    p.add_argument("--prompt-lens", type=parse_lens, default=parse_lens("24:5,200:3,1000:2,4000:1"),
                   help="prompt tokens:weight, comma-separated")
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--cancel-share", type=float, default=0.2, help="share of streams cancelled mid-flight")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--warmup-s", type=float, help="default: a fifth of the run, at most 60 s")
    p.add_argument("--bucket-s", type=float, help="throughput bucket (default: 60 s, or a sixth of a short run)")
    p.add_argument("--settle-s", type=float, default=30.0, help="wait this long for the blocks to come back")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    p.add_argument("--plot", help="write RSS, free blocks and throughput over time here (PNG)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.url and args.mode:
        sys.exit("soak: --url soaks a running server; --mode starts its own: pick one")
    if args.url and not args.url.startswith(("127.0.0.1:", "localhost:")):
        sys.exit(f"soak: traffic stays on this machine: --url must be 127.0.0.1:PORT, got {args.url}")
    if args.minutes <= 0 or args.concurrency < 1 or not 0 <= args.cancel_share <= 1 \
            or not 1 <= args.min_tokens <= args.max_tokens:
        sys.exit("soak: need --minutes > 0, --concurrency >= 1, 0 <= --cancel-share <= 1, "
                 "1 <= --min-tokens <= --max-tokens")
    tokenizer = None
    tok_dir = Path(args.engine) / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        from runtime.tokenizer import TextTokenizer
        tokenizer = TextTokenizer(tok_dir)
    workload = Workload(args.prompt_lens, args.min_tokens, args.max_tokens, args.cancel_share, tokenizer, args.seed)
    summaries: dict[str, dict] = {}
    if args.url:
        pid = int(Path(args.server_pid_file).read_text()) if args.server_pid_file else None
        summaries[args.label] = asyncio.run(soak(args.url, f"http://127.0.0.1:{args.metrics_port}/metrics", pid,
                                                 workload, args))
    else:
        root = Path(args.run_dir or f"/tmp/lookahead_soak_{os.getpid()}")
        for mode in args.mode or ["dense", "lookahead"]:
            server = Server(args.engine, mode, root / mode, args.start_timeout)
            print(f"soak: {mode}: starting a server (run dir {server.run_dir})", file=sys.stderr)
            server.start()
            try:
                print(f"soak: {mode}: {args.minutes:g} min of load", file=sys.stderr)
                summaries[mode] = asyncio.run(soak(f"127.0.0.1:{server.grpc}",
                                                   f"http://127.0.0.1:{server.metrics}/metrics", server.pid,
                                                   workload, args))
            finally:
                stopped = server.stop()
            summaries.get(mode, {})["server_stop"] = stopped
    print(table(summaries))
    report = {"config": {k: v for k, v in vars(args).items()}, "results": summaries}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    if args.plot:
        plot(summaries, args.plot)
    return 0 if all(all(s["targets"].values()) for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
