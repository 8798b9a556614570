#!/usr/bin/env python3
"""Decode-step timing, dense vs lookahead, under one HBM KV budget, on Llama-shaped random weights.

    python scripts/gpu_decode_bench.py --out out/gpu_decode_bench                           # GPU, 32K
    python scripts/gpu_decode_bench.py --device cpu --context 2048 --layers 2 --out /tmp/b   # CPU smoke

Shapes: `smollm2` (SmolLM2-135M, the default engine's config) and `llama8b` (Llama-3-8B: 32 layers,
hidden 4096, 32 heads, 8 KV heads, head dim 128, intermediate 14336, vocab 128256), with random
weights (LlamaModel.random's distribution), bf16 on a GPU. Timing only: random weights say nothing
about accuracy. `--layers` cuts the depth (smoke runs).

Modes, each through the runtime's Engine (scheduler, chunked prefill, runner, attention backend):
- dense: the whole KV cache in device memory; its batch is the budget divided by one sequence's KV
  at the context, so the budget *is* dense's max batch (by default the budget is two sequences);
- lookahead resident / pingpong, miss policy urgent, dual-token draft: the full cache in pinned
  host memory; in device memory a bounded working set plus the block summaries, both counted
  against the same budget; batch = budget // (working set + summaries), capped by `--max-batch`
  and by `--host-kv-gib` (the host pool holds every sequence's full cache).

Per mode: decode tokens/s over the timed steps, ms/step, stall (time the compute stream waited for
KV copies), copy time (time the copy streams, or the CPU engine's thread, spent copying), the share
of copy time hidden under compute (1 - stall / copy time), H2D bytes per step, on a GPU the peak
device memory, and the step's bandwidth floor as scripts/bench.py defines it (bench_floor.py): the
bytes a step must read from the device's memory (the weights once, and each sequence's KV at the
context: all of it for dense, the working set + block summaries + the step's H2D bytes for
lookahead) over the device's bandwidth measured at the start of the run, with ms/step over it.
JSON goes to `<out>/decode_bench.json` after every mode; a table is printed last.

Prompts are prefilled with the engine's chunked prefill (`--prefill-chunk`, 4096 tokens on a GPU).

The engine runs where the model is (`Engine` places everything on `model.device`): dense keeps its
KV pool in device memory; lookahead keeps its host pool pinned and its device tier, summaries
and bookkeeping on the GPU. A lookahead step still copies its stored rows down to the host pool
(one blocking copy per store) and has host syncs in its bookkeeping (issue 16).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_floor import memory_bandwidth, step_read_bytes, weight_bytes  # noqa: E402

from runtime.block_manager import blocks_needed  # noqa: E402
from runtime.config import LookaheadConfig, ModelConfig  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.engine_dir import Manifest  # noqa: E402
from runtime.lookahead.layout import SlotLayout  # noqa: E402
from runtime.model import LlamaModel  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402
from runtime.transfer import ThreadTransferEngine  # noqa: E402

GiB = 1 << 30
SHAPES: dict[str, dict[str, Any]] = {
    # engines/default/engine.yaml (SmolLM2-135M-Instruct); max_position_embeddings is raised per run
    "smollm2": dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True),
    "llama8b": dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                    rope_theta=500000.0, tie_word_embeddings=False),
}
MODES = {"dense": dict(mode="dense"),
         "resident": dict(mode="lookahead", residency="resident", miss_policy="urgent", draft="dual_token"),
         "pingpong": dict(mode="lookahead", residency="pingpong", miss_policy="urgent", draft="dual_token")}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("out/gpu_decode_bench"), help="directory for decode_bench.json")
    p.add_argument("--models", default=None,
                   help="comma list of shapes (default: smollm2,llama8b on a GPU; smollm2 on CPU, where "
                        "llama8b's embeddings alone take 4 GB in fp32)")
    p.add_argument("--modes", default="dense,resident,pingpong")
    p.add_argument("--context", type=int, default=32768, help="prompt tokens per sequence")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers (smoke runs)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (default 16 GPU, 6 CPU)")
    p.add_argument("--warmup", type=int, default=3, help="decode steps before timing")
    p.add_argument("--dense-batch", type=int, default=2,
                   help="the HBM KV budget, in dense sequences at the context (default 2)")
    p.add_argument("--kv-budget-gib", type=float, default=None, help="the HBM KV budget in GiB (overrides --dense-batch)")
    p.add_argument("--max-batch", type=int, default=None, help="lookahead batch cap (default 4 GPU, 2 CPU)")
    p.add_argument("--host-kv-gib", type=float, default=48.0, help="cap on the pinned host pool (GiB)")
    p.add_argument("--top-k", type=int, default=128, help="selected blocks per layer and KV head")
    p.add_argument("--prefill-chunk", type=int, default=None, help="tokens per prefill step (default 4096 GPU, 1024 CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth-gib", type=float, default=1.0,
                   help="tensor size of the bandwidth measurement (GiB; the floor's divisor)")
    args = p.parse_args(argv)
    gpu = torch.device(args.device).type == "cuda"
    args.models = args.models or ("smollm2,llama8b" if gpu else "smollm2")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.steps = args.steps or (16 if gpu else 6)
    args.max_batch = args.max_batch or (4 if gpu else 2)
    args.prefill_chunk = args.prefill_chunk or (4096 if gpu else 1024)
    for name in args.models.split(","):
        if name not in SHAPES:
            p.error(f"--models: {name!r} is unknown (known: {', '.join(SHAPES)})")
    for name in args.modes.split(","):
        if name not in MODES:
            p.error(f"--modes: {name!r} is unknown (known: {', '.join(MODES)})")
    return args


# ---- the model ------------------------------------------------------------------------------------
def model_config(shape: str, layers: int | None, max_len: int) -> ModelConfig:
    kw = dict(SHAPES[shape])
    if layers:
        kw["num_layers"] = layers
    return ModelConfig(**kw, max_position_embeddings=max(max_len, 8192))


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int) -> LlamaModel:
    """LlamaModel.random on CPU; on a GPU the same distribution drawn there, in `dtype` (no fp32 copy)."""
    if device.type == "cpu":
        return LlamaModel.random(cfg, seed=seed, dtype=dtype).eval().requires_grad_(False)
    model = LlamaModel(cfg, dtype=dtype, device=str(device), empty=True)   # parameters on meta, RoPE on device
    g = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, p in model.named_parameters():
        w = torch.randn(p.shape, generator=g, device=device, dtype=dtype)
        weights[name] = 1.0 + 0.1 * w if name.endswith("norm.weight") else w * (1.0 / p.shape[-1] ** 0.5)
    model.load_weights(weights)
    return model.eval().requires_grad_(False)


# ---- the engine from a random model (no engine dir) --------------------------------------------------
class NullTokenizer:
    """Random weights have no vocabulary: prompts are token ids and outputs are not detokenized."""

    def encode(self, text: str) -> list[int]:
        raise TypeError("this benchmark sends token ids, not text")

    def decode(self, ids: list[int]) -> str:
        return ""


class TimedThreadTransferEngine(ThreadTransferEngine):
    """The CPU engine, plus `transfer_s`: the time its worker spends copying (for the hidden share)."""

    def __init__(self) -> None:
        super().__init__()
        self.transfer_s = 0.0

    def submit(self, job, urgent: bool = False):
        run = job.execute

        def timed() -> None:
            t0 = time.perf_counter()
            run()
            self.transfer_s += time.perf_counter() - t0     # one writer: the worker thread

        job.execute = timed
        return super().submit(job, urgent)


class BenchEngine(Engine):
    """The runtime's Engine over an in-memory manifest and a random model; it runs where the model
    lives (Engine places the pools, the device tier and the step's tensors on `model.device`). On
    CPU its copies go through a thread engine that also times them."""

    def __init__(self, model: LlamaModel, mcfg: ModelConfig, lcfg: LookaheadConfig, device: torch.device,
                 num_host_blocks: int, dtype_name: str):
        manifest = Manifest(path=Path("random-weights"), model=mcfg, dtype=dtype_name, lookahead=lcfg, files={},
                            source={"kind": "random"}, versions={}, name="random-weights")
        transfer = "cuda" if device.type == "cuda" else (TimedThreadTransferEngine() if lcfg.mode != "dense" else None)
        super().__init__(manifest, model, NullTokenizer(), lcfg, num_host_blocks=num_host_blocks, transfer=transfer)


# ---- sizing under one budget --------------------------------------------------------------------------
def sizing(mcfg: ModelConfig, lcfg: LookaheadConfig, elt: int, max_len: int) -> dict[str, int]:
    """Bytes per sequence: dense KV in device memory; lookahead's device working set and summaries
    (as runtime/lookahead/attention.py allocates them) and its full host copy."""
    bs, L, kvh, d = lcfg.block_size, mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim
    nblocks = blocks_needed(max_len, bs)
    full = nblocks * bs * 2 * L * kvh * d * elt
    slot = 2 * kvh * bs * d * elt                                   # one slot of K and V, every KV head
    buffers = 2 if lcfg.residency == "pingpong" else L
    return {"dense_kv": full, "host_kv": full,
            "working_set": buffers * SlotLayout.from_config(lcfg).num_slots * slot,
            "summaries": 2 * L * nblocks * kvh * d * elt}


def weight_read_bytes(model: LlamaModel) -> int:
    """bench_floor.weight_bytes for our model: an untied input embedding is left out."""
    emb = model.embed_tokens.weight
    return weight_bytes(model, emb, emb if model.lm_head is None else model.lm_head.weight)


def floor_fields(weights: int, mcfg: ModelConfig, lcfg: LookaheadConfig, elt: int, mode: str, batch: int,
                 context: int, h2d_per_step: float, ms_per_step: float, bandwidth_gbps: float) -> dict[str, Any]:
    """The step's read bytes at `context` tokens per sequence, its floor ms at `bandwidth_gbps`, and
    ms/step over it (bench_floor.step_read_bytes' definition)."""
    kv_per_token = 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * elt
    sparse = None
    if mode != "dense":
        s = sizing(mcfg, lcfg, elt, context)
        sparse = (s["working_set"], s["summaries"])
    read = step_read_bytes(weights, kv_per_token, context, batch, sparse, h2d_per_step)
    floor_ms = 1e3 * read / (bandwidth_gbps * 1e9)
    return {"step_read_bytes": read, "floor_ms": floor_ms, "x_floor": ms_per_step / floor_ms}


# ---- one mode -------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(model, mcfg, lcfg: LookaheadConfig, batch: int, prompts: list[list[int]], max_tokens: int,
             args, device: torch.device) -> dict[str, Any]:
    nblocks = batch * blocks_needed(lcfg.max_model_len, lcfg.block_size)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    row: dict[str, Any] = {}
    with torch.inference_mode():
        t0 = time.perf_counter()
        eng = BenchEngine(model, mcfg, lcfg, device, nblocks, args.dtype)
        row["build_s"] = time.perf_counter() - t0
        try:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            for p in prompts[:batch]:
                eng.add_request(p, params)
            t0 = time.perf_counter()
            eng.step()                       # admits every request (the batch is the engine's max)
            prefill_steps = 1
            while eng.scheduler.waiting or any(s.in_prefill for s in eng.scheduler.running):
                eng.step()
                prefill_steps += 1
            sync(device)
            row.update(prefill_s=time.perf_counter() - t0, prefill_steps=prefill_steps)
            for _ in range(args.warmup):
                eng.step()
            sync(device)
            before, tr = eng.stats(), getattr(getattr(eng.runner, "attn", None), "transfer", None)
            copy0 = getattr(tr, "transfer_s", 0.0)
            times, tokens = [], 0
            for _ in range(args.steps):
                t0 = time.perf_counter()
                outs = eng.step()
                sync(device)
                times.append(time.perf_counter() - t0)
                tokens += sum(len(o.new_token_ids) for o in outs)
            after = eng.stats()
            copy_s = getattr(tr, "transfer_s", 0.0) - copy0
            stall_s = after["transfer_wait_s"] - before["transfer_wait_s"]
            attn = getattr(eng.runner, "attn", None)
            row.update(
                tokens=tokens, tokens_per_s=tokens / sum(times), ms_per_step=1e3 * statistics.median(times),
                ms_per_step_all=[round(1e3 * t, 3) for t in times], stall_s=stall_s, copy_s=copy_s,
                hidden_share=(min(1.0, max(0.0, 1.0 - stall_s / copy_s)) if copy_s > 0 else None),
                h2d_bytes_per_step=(after["h2d_bytes"] - before["h2d_bytes"]) / args.steps,
                urgent_blocks=after["urgent_blocks"] - before["urgent_blocks"],
                # the runtime keeps these two as rates since the engine started (prefill and warm-up included)
                prefetch_hit_rate_whole_run=after.get("prefetch_hit_rate"),
                draft_accept_rate_whole_run=after.get("draft_accept_rate"),
                gather_kernel=getattr(tr, "gather_kernel", None),
                device_bytes_per_seq_runtime=(attn.working_set_bytes_per_lane()
                                              if hasattr(attn, "working_set_bytes_per_lane") else None))
            if tokens != batch * args.steps:
                row["note"] = f"{tokens} tokens in {args.steps} steps of batch {batch}: sequences ended early"
        finally:
            eng.close()
            del eng
            gc.collect()
    if device.type == "cuda":
        row["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.empty_cache()
    return row


def run_shape(shape: str, args, device: torch.device, results: list[dict], write) -> None:
    dtype = DTYPES[args.dtype]
    elt = torch.empty((), dtype=dtype).element_size()
    modes = args.modes.split(",")
    # Sequences that finish prefill early decode while the others prefill: room for those tokens.
    base = LookaheadConfig(top_k=args.top_k, prefill_chunk=args.prefill_chunk)
    est_batch = max(args.dense_batch, args.max_batch)
    max_tokens = args.warmup + args.steps + 2 + est_batch * (-(-args.context // args.prefill_chunk) + 1)
    max_len = args.context + max_tokens
    mcfg = model_config(shape, args.layers, max_len)
    sizes = {m: sizing(mcfg, base.replace(**MODES[m]), elt, max_len) for m in modes}
    dense_kv = sizing(mcfg, base, elt, max_len)["dense_kv"]
    budget = int(args.kv_budget_gib * GiB) if args.kv_budget_gib else args.dense_batch * dense_kv
    t0 = time.perf_counter()
    model = random_model(mcfg, dtype, device, args.seed)
    weights = weight_read_bytes(model)
    sync(device)
    print(f"[{shape}] {mcfg.num_layers} layers, random weights in {time.perf_counter() - t0:.1f}s; "
          f"KV budget {budget / GiB:.2f} GiB = {budget / dense_kv:.2f} dense sequences of {max_len} tokens",
          flush=True)
    g = torch.Generator().manual_seed(args.seed)
    n_prompts = max(args.max_batch, budget // dense_kv, 1)
    prompts = [torch.randint(0, mcfg.vocab_size, (args.context,), generator=g).tolist() for _ in range(n_prompts)]
    for mode in modes:
        s = sizes[mode]
        per_seq_device = s["dense_kv"] if mode == "dense" else s["working_set"] + s["summaries"]
        fit = budget // per_seq_device
        batch = fit if mode == "dense" else min(fit, args.max_batch, int(args.host_kv_gib * GiB) // s["host_kv"])
        row = {"model": shape, "mode": mode if mode == "dense" else f"lookahead/{mode}", "context": args.context,
               "layers": mcfg.num_layers, "dtype": args.dtype, "batch": batch, "batch_fit_in_budget": fit,
               "kv_budget_bytes": budget, "device_kv_bytes_per_seq": per_seq_device,
               "device_kv_bytes": per_seq_device * batch, "sizes_per_seq": s}
        if batch < 1:
            row["error"] = (f"the budget ({budget} bytes) holds no sequence of this mode ({per_seq_device} bytes each)"
                            if fit < 1 else f"--host-kv-gib {args.host_kv_gib} holds no sequence ({s['host_kv']} bytes)")
        else:
            lcfg = base.replace(**MODES[mode], max_batch_size=batch, max_model_len=max_len)
            print(f"[{shape}] {row['mode']}: batch {batch} (the budget fits {fit}), "
                  f"{per_seq_device / 2**20:.1f} MiB of device KV per sequence", flush=True)
            try:
                row.update(run_mode(model, mcfg, lcfg, batch, prompts, max_tokens, args, device))
                row.update(floor_fields(weights, mcfg, lcfg, elt, mode, batch, args.context,
                                        row["h2d_bytes_per_step"], row["ms_per_step"], args.bandwidth_gbps))
                ws = row.get("device_bytes_per_seq_runtime")
                if mode != "dense" and ws is not None and ws != s["working_set"]:
                    row["note_sizes"] = (f"the runtime's working set is {ws} bytes per sequence, this script's "
                                         f"sizing says {s['working_set']}: the budget arithmetic is off")
            except Exception as e:           # one failing mode must not hide the others' numbers
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {e}"
        results.append(row)
        write()
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- report -----------------------------------------------------------------------------------------------
def machine(device: torch.device) -> dict[str, Any]:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cpus": os.cpu_count(), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / GiB, 1)
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def print_table(doc: dict[str, Any]) -> None:
    rows = doc["results"]
    a = doc["args"]
    print(f"\ndecode steps on {doc['machine'].get('gpu', doc['machine']['device'])}: random weights in the "
          f"real shapes ({a['dtype']}), {a['context']} prompt tokens, {a['steps']} timed steps after {a['warmup']}; "
          f"HBM KV budget = {a['dense_batch'] if not a['kv_budget_gib'] else a['kv_budget_gib']}"
          f"{' dense sequences' if not a['kv_budget_gib'] else ' GiB'} (dense's max batch); "
          f"lookahead batch = min(budget fit, --max-batch {a['max_batch']}, host pool); floor = bytes a step "
          f"reads / {a['bandwidth_gbps']:.0f} GB/s (measured, {doc['memory_bandwidth']['device']})")
    head = f"{'model':<9}{'mode':<20}{'batch':>6}{'fit':>5}{'KV MiB':>9}{'tok/s':>9}{'ms/step':>9}" \
           f"{'stall s':>9}{'copy s':>8}{'hidden':>8}{'H2D MiB/step':>14}{'floor ms':>10}{'x floor':>9}"
    print(head)
    for r in rows:
        line = f"{r['model']:<9}{r['mode']:<20}{r['batch']:>6}{r['batch_fit_in_budget']:>5}" \
               f"{r['device_kv_bytes'] / 2**20:>9.0f}"
        if r.get("error"):
            print(f"{line}  ERROR {r['error'][:120]}")
            continue
        h2d = r["h2d_bytes_per_step"] / 2**20
        print(f"{line}{r['tokens_per_s']:>9.1f}{r['ms_per_step']:>9.1f}{r['stall_s']:>9.3f}{r['copy_s']:>8.3f}"
              f"{fmt(r['hidden_share'], '.0%'):>8}{h2d:>14.1f}{fmt(r.get('floor_ms'), '.2f'):>10}"
              f"{fmt(r.get('x_floor'), '.2f'):>8}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_decode_bench: --device cuda but torch.cuda.is_available() is False "
              "(use --device cpu for the smoke run)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "decode_bench.json"
    t_start = time.perf_counter()
    doc: dict[str, Any] = {"machine": machine(device), "args": {k: str(v) if isinstance(v, Path) else v
                                                                 for k, v in vars(args).items()},
                           "weights": "random (LlamaModel.random's distribution): timing only, not accuracy",
                           "results": []}

    def write() -> None:
        doc["elapsed_s"] = time.perf_counter() - t_start
        out.write_text(json.dumps(doc, indent=1) + "\n")

    with torch.inference_mode():
        doc["memory_bandwidth"] = memory_bandwidth(gib=args.bandwidth_gib, device=device)
    args.bandwidth_gbps = doc["args"]["bandwidth_gbps"] = doc["memory_bandwidth"]["bandwidth_gbps"]
    print(f"memory bandwidth of {device}: {args.bandwidth_gbps:.1f} GB/s (best of a sum and a copy over "
          f"{args.bandwidth_gib:g} GiB): the floor's divisor", flush=True)
    for shape in args.models.split(","):
        try:
            run_shape(shape, args, device, doc["results"], write)
        except Exception as e:
            traceback.print_exc()
            doc["results"].append({"model": shape, "mode": "-", "batch": 0, "batch_fit_in_budget": 0,
                                   "device_kv_bytes": 0, "error": f"{type(e).__name__}: {e}"})
            write()
    write()
    print_table(doc)
    print(f"\nwrote {out} ({doc['elapsed_s']:.0f} s)")
    return 1 if any(r.get("error") for r in doc["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
