"""Decode-step timing of the real engine, dense vs lookahead, under one device KV budget.

    python -m bench.gpu_decode --engines llama3-8b=out/engines/llama3-8b --out out/bench   # GPU, 32K
    python -m bench.gpu_decode --device cpu --engines tiny=/tmp/tiny --context 256 \\
        --steps 2 --warmup 1 --top-k 2 --recent-window 16 --bandwidth-gib 0.0625 --out /tmp/b   # CPU smoke

The engines are engine dirs (`NAME=DIR`, comma-separated), normally the random-weights dirs of
`scripts/build_engine.py --random-weights SHAPE` in the real shapes (SmolLM2-135M, Llama-3.1-8B, Qwen3-8B):
`Engine.from_dir(DIR, device=...)` generates their weights on the device. Timing only: random
weights say nothing about accuracy, and they make the draft agree with the model about as often
as chance, so the lookahead rows copy more than a trained model's would.

Each engine dir runs in a child process of its own (a sticky CUDA fault in one loses none of the
others' rows); every row is written to `<out>/decode_bench.json` as soon as it is measured
(bench/gpu_results.py), and the table is printed last.

Per shape (one child process):
1. the bandwidths of this run (bench.floor.device_bandwidths): a device-to-device copy (the
   device's memory) and a pinned host-to-device copy (the host link);
2. one model, loaded once: `Engine.from_dir(DIR, device=...)`, and every measured engine is an
   `Engine(...)` over that model (as `Engine.sibling` makes them) with its own config and pools;
3. one random prompt of `--context` tokens, prefilled once and replayed into every engine's
   backend through a `PrefillCache` (the backend stores it as in a real prefill, the matmuls are
   skipped); every sequence of every engine has that prompt and samples its warm-up steps with
   its own seed at temperature 1, so the batch diverges from its first token on; the timed
   rounds then run at temperature 0 (argmax: no sampling noise drawn on the host inside the timed
   window, where lookahead samples 20-28 rows a step against dense's 2);
4. the rows. The device KV budget is `--kv-budget-gib`, or `--dense-batch` dense sequences. Each
   mode runs at the largest batch its budget fits, sized by the runtime's memory plan
   (runtime.memory_plan.plan_memory: dense's device pool; lookahead's per-sequence device tier +
   block summaries, `per_seq_device`, the quantity `device_budget_bytes` bounds), lookahead also
   capped by `--host-kv-gib` (its host pool holds every sequence's whole cache) and `--max-batch`.
   Then the equal-batch rows: lookahead at dense's batch, dense at lookahead's batch (when the
   device has the memory).
5. host memory: a lookahead row's host pool is a pageable allocation page-locked in place
   (cudaHostRegister, `runtime.transfer.cuda.pin_pool`), not torch's pinned allocator, which
   rounds each allocation up to a power of two (40 GiB of KV pins 64) and keeps what is freed
   cached in the process, so the next row would find the host short. The pool is unregistered and
   freed when the row ends (`host_available_*_bytes` before and after each row say so); the
   plan's `host_pinned_bytes` is what registration takes (runtime.memory_plan, pinning
   "registered"). plugins/cpu's kernel library is built before anything is timed.

Timing (the same code on CPU, where StreamClock reads perf_counter):
- ms/step: CUDA events recorded on the compute stream around each of `--steps` engine steps (no
  device-wide synchronize inside the window: the transfer engine's streams count only where the
  compute stream waits for them); tokens/s: the tokens the steps emitted over that time. Beside
  it, `seq_steps_per_s` = batch x steps / time (ms/step and batch: what tokens/s would be if
  every step emitted a token for every sequence), `emitted_share` (the tokens over batch x
  steps: a pre-decoding step, a draft-chain re-seed, emits none) and the round's draft accept
  rate (`draft_accept_rate`), so a low tokens/s can be told from a slow step.
- stall: the time the compute stream waited for copies (the transfer engine's `wait_s`).
- hidden share = 1 - (ms/step with real transfers - ms/step with transfers already satisfied)
  / copy ms/step measured alone, clamped to [0, 1] (runtime.transfer.overlap.hidden_share; the
  unclamped value is kept beside it). "Already satisfied": the same engine, right after the timed
  steps, runs `--steps` more with its transfer engine switched to answer every copy as landed
  (MeteredTransfer.satisfied: the copy is counted and moves nothing, urgent ones included), so the
  step does all its own work and never waits for or competes with a copy. "Copy time alone":
  every copy job of the real round (recorded through `Engine.observe`'s `on_copy`, indices
  cloned) replayed through the same transfer engine with nothing else running: its wall time,
  first submit to last landing on the compute stream (the two copy streams run at once, so the
  sum of their busy times, kept as `copy_alone.busy_s`, would count overlapping copies twice).
- floor = max(device bytes / device bandwidth, H2D bytes / H2D bandwidth) (bench.floor.step_floor),
  with device bytes = the weights once + per sequence all KV at the context (dense) or the
  working set each layer attends over + the block summaries (lookahead) + the step's H2D bytes;
  x floor = ms/step over it.
- host syncs: one more step under torch.cuda.set_sync_debug_mode("warn"), the synchronizing calls
  torch makes on the step path counted (GPU only).
- CUDA graphs (dense rows): the step's forward pass at a fixed context is captured once and
  replayed `--graph-replays` times, against the same forward run eagerly (captures and replays
  counted). A whole engine step is not captured: its shapes change every step (the context grows
  by one token, and the block table, StepBatch and host-side scheduling are rebuilt on the host)
  and sampling reads the tokens back to the host. Lookahead rows are not captured: their layers
  interleave host-side bookkeeping and copy submission (cuda-python calls on the transfer
  engine's own streams) with the kernels (the row says so).

decode_bench.json: `machine`, `args`, `weights`, `prompts`, `targets`; `shapes` (per engine: its dir,
model config, the run's `bandwidth`, context, budget, `sizes_per_seq`, `rows_planned`, load and
prefill seconds); `results` (one row per mode and batch: model, mode, label ("budget" or "equal
batch (...)"), batch, batch_fit_in_budget, batch_cap, resident_bytes (plan) and
resident_bytes_runtime (the engine's stats), tokens_per_s, seq_steps_per_s, emitted_share,
draft_accept_rate, ms_per_step (+ _median, _each),
h2d_bytes_per_step, stall_ms_per_step, urgent_blocks_per_step, copy_busy_ms_per_step (copy streams
during the round), `satisfied` (the satisfied round), `copy_alone`, copy_alone_ms_per_step,
exposed_copy_ms_per_step, hidden_share (+ _unclamped), `floor` (device/h2d bytes and ms, floor_ms, bound),
x_floor, host_syncs_per_step, `cuda_graph` (captures, replays, eager_ms, graph_ms, ...),
peak_device_bytes, host_pinned_bytes, host_available_before_bytes / _after_bytes, prefill
seconds; or `error` / `skipped`); `comparison` (per shape and lookahead
mode: tokens/s over dense's at the budget's batches, against the 2x target); `elapsed_s`.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
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

from bench.floor import StreamClock, device_bandwidths, step_floor, step_read_bytes, weight_bytes
from bench.gpu_results import ResultFile
from runtime.config import LookaheadConfig
from runtime.engine import Engine
from runtime.engine_dir import load_manifest
from runtime.spec import resolve_spec
from runtime.kv_pool import KVPool
from runtime.lookahead.device_tier import num_buffers
from runtime.memory_plan import DTYPE_BYTES, available_host_bytes, plan_memory
from runtime.prefill_cache import PrefillCache
from runtime.sampling import SamplingParams
from runtime.step import StepBatch, StepItem
from runtime.transfer import Ticket, TransferEngine, make_transfer_engine
from runtime.transfer.overlap import hidden_share, share_or_none

ROOT = Path(__file__).resolve().parents[1]

try:                                             # the observation hooks (runtime/observe.py)
    from runtime.observe import Observer
except ImportError:                              # pragma: no cover - older runtimes
    Observer = object                            # type: ignore[misc,assignment]

GiB = 1 << 30
RESULTS = "decode_bench.json"
MODES = {"dense": dict(mode="dense"),
         "resident": dict(mode="lookahead", residency="resident", miss_policy="urgent", draft="dual_token"),
         "pingpong": dict(mode="lookahead", residency="pingpong", miss_policy="urgent", draft="dual_token")}
NO_LOOKAHEAD_GRAPH = ("not captured: a lookahead layer interleaves host-side bookkeeping and copy submission "
                      "(cuda-python calls on the transfer engine's own streams) with its kernels, so no capture "
                      "spans a layer")
TARGETS = {"speedup_at_equal_budget": 2.0, "hidden_share": 0.90, "x_floor": 1.6}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_decode", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", required=True, help="NAME=DIR[,NAME=DIR...]: engine dirs, in the order they run")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("out/gpu_decode"), help=f"directory for {RESULTS}")
    p.add_argument("--modes", default="dense,resident,pingpong")
    p.add_argument("--context", type=int, default=32768,
                   help="prompt tokens per sequence (capped by the engine's max_position_embeddings, with a note)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per round (default 16 GPU, 4 CPU)")
    p.add_argument("--warmup", type=int, default=3, help="decode steps before timing")
    p.add_argument("--dense-batch", type=int, default=2,
                   help="the device KV budget, in dense sequences at the context (default 2)")
    p.add_argument("--kv-budget-gib", type=float, default=None,
                   help="the device KV budget in GiB (overrides --dense-batch)")
    p.add_argument("--max-batch", type=int, default=64, help="cap on the lookahead batch")
    p.add_argument("--host-kv-gib", type=float, default=60.0,
                   help="cap on the lookahead host pool, GiB of KV (registered in place: it pins what it holds)")
    p.add_argument("--top-k", type=int, default=128, help="selected blocks per layer and KV head")
    p.add_argument("--recent-window", type=int, default=None, help="recent-window tokens (default: the engine's)")
    p.add_argument("--kv-dtype", default=None, choices=sorted(DTYPE_BYTES),
                   help="KV storage (default: the engine's dtype)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="bytes of each bandwidth copy (GiB)")
    p.add_argument("--graph-replays", type=int, default=None,
                   help="CUDA graph replays per dense row (default 20 GPU, 2 CPU)")
    p.add_argument("--no-equal-batch", action="store_true", help="skip the equal-batch rows")
    p.add_argument("--equal-batch-modes", default=None,
                   help="lookahead modes that also run at dense's batch (default: all of --modes; '' none)")
    p.add_argument("--time-budget-s", type=float, default=0.0,
                   help="stop starting shapes past this many seconds (0: no limit); each child gets what is left")
    p.add_argument("--child-shape", default=None, help=argparse.SUPPRESS)   # internal: run one shape here
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)   # internal: epoch seconds
    args = p.parse_args(argv)
    gpu = torch.device(args.device).type == "cuda"
    args.steps = args.steps or (16 if gpu else 4)
    args.graph_replays = args.graph_replays if args.graph_replays is not None else (20 if gpu else 2)
    try:
        args.engine_list = [(name, Path(path)) for name, _, path in
                            (item.partition("=") for item in args.engines.split(",") if item)]
    except ValueError:
        p.error("--engines: NAME=DIR[,NAME=DIR...]")
    if not args.engine_list or any(not name or not str(path) for name, path in args.engine_list):
        p.error("--engines: NAME=DIR[,NAME=DIR...]")
    for name in args.modes.split(","):
        if name not in MODES:
            p.error(f"--modes: {name!r} is unknown (known: {', '.join(MODES)})")
    if args.equal_batch_modes is None:
        args.equal_batch_modes = ",".join(m for m in args.modes.split(",") if m != "dense")
    for name in filter(None, args.equal_batch_modes.split(",")):
        if name not in MODES or name == "dense":
            p.error(f"--equal-batch-modes: {name!r} is not a lookahead mode (resident, pingpong)")
    return args


# ---- the engine the bench builds: its lookahead host pool registered, not allocated pinned ----------------
class RegisteredPoolEngine(Engine):
    """`Engine` whose lookahead host pool on a GPU is a pageable allocation page-locked in place
    (cudaHostRegister: `runtime.transfer.cuda.pin_pool`) rather than torch's pinned allocator's
    (KVPool(..., pin_memory=True)), which rounds each of K and V up to a power of two and caches
    them after they are freed. Registered, the pool pins its own bytes and gives them back (to the
    OS, unregistered) when the engine is collected. Everything else is Engine's."""

    def _make_pool(self, num_blocks: int, dtype: torch.dtype) -> KVPool:
        if self.config.mode != "lookahead" or self.device.type != "cuda":
            return super()._make_pool(num_blocks, dtype)
        from runtime.transfer.cuda import pin_pool
        return pin_pool(KVPool(self.manifest.model, num_blocks, self.config.block_size, dtype=dtype))


def release_host_memory(device: torch.device) -> None:
    """Whatever the row left cached: the device allocator's blocks and torch's pinned host cache
    (staging buffers; empty_cache does not return those)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()


def set_greedy(eng: Engine) -> None:
    """The running sequences sample by argmax from here on (temperature 0): the timed rounds draw no
    sampling noise on the host. The draft rows draw with the same params (DraftChain.draws)."""
    for seq in list(eng.scheduler.running) + list(eng.scheduler.waiting):
        seq.params = dataclasses.replace(seq.params, temperature=0.0)


def draft_counts(eng: Engine) -> tuple[int, int] | None:
    """(accepted, proposed) of the engine's draft chain so far; None without one (dense)."""
    chain = getattr(eng.runner, "chain", None)
    if chain is None:
        return None
    return int(getattr(chain, "accepted", 0)), int(getattr(chain, "proposed", 0))


# ---- the transfer engine the bench injects ------------------------------------------------------------
class DoneTicket(Ticket):
    """A copy answered as already landed (MeteredTransfer.satisfied): nothing to wait for."""

    def synchronize(self) -> None:
        if self.error:
            raise self.error


class MeteredTransfer(TransferEngine):
    """The runtime's own transfer engine (`inner`: CUDA streams on a GPU, the worker thread on CPU)
    behind the TransferEngine interface, injected with `Engine(..., transfer=...)`, plus one switch.

    satisfied=False: every call goes to `inner` (the real copies);
    satisfied=True:  every copy, urgent or not, is counted and answered as already landed: no byte
                     moves and nothing waits, as if the blocks were resident before the step ran.
    The counters (`h2d_bytes`, `jobs`, `urgent_jobs`) count both; `wait_s` and `transfer_s` are
    the inner engine's (the stall, the copy streams' busy time)."""

    def __init__(self, inner: TransferEngine):
        self.inner, self._own_wait_s = inner, 0.0      # before the base sets wait_s
        super().__init__()
        self.satisfied = False
        self.recorder: CopyRecorder | None = None     # only where the engine has no Engine.observe

    @property
    def wait_s(self) -> float:
        return self.inner.wait_s + self._own_wait_s

    @wait_s.setter
    def wait_s(self, value: float) -> None:
        # `wait_s += x` (account_inline) reads the sum and writes it back: keep only our own part,
        # or the inner engine's wait is counted twice
        self._own_wait_s = value - self.inner.wait_s

    @property
    def transfer_s(self) -> float | None:
        return getattr(self.inner, "transfer_s", None)

    @property
    def copy_kernel(self) -> bool | None:
        return getattr(self.inner, "copy_kernel", None)

    def submit(self, job, urgent: bool = False) -> Ticket:
        if self.recorder is not None:
            self.recorder.on_copy(job, urgent)
        counted = self._account(job, urgent)
        if not self.satisfied:
            return self.inner.submit(job, urgent)
        done = DoneTicket(counted.job_bytes, counted.urgent)
        done._done.set()
        return done

    def wait(self, ticket: Ticket | None) -> None:
        if isinstance(ticket, DoneTicket):
            if ticket.error:
                raise ticket.error
            return
        self.inner.wait(ticket)

    def close(self) -> None:
        self.inner.close()


def snapshot(job):
    """A copy job as submitted, its index tensors cloned (a runtime may reuse its index buffers)."""
    if not dataclasses.is_dataclass(job):
        return job
    changes = {}
    for name in ("src_index", "dst_index"):
        value = getattr(job, name, None)
        if isinstance(value, tuple):
            changes[name] = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in value)
    return dataclasses.replace(job, **changes) if changes else job


class CopyRecorder(Observer):
    """Observer.on_copy: snapshots every copy job handed to the transfer engine while `active`, and
    keeps them while `keep` (the real round, for the copy-time-alone replay). The satisfied round
    snapshots and drops them, so both rounds carry the same recording work."""

    def __init__(self) -> None:
        self.active = self.keep = False
        self.jobs: list[tuple[Any, bool]] = []

    def on_copy(self, job, urgent: bool) -> None:
        if self.active:
            snap = snapshot(job)
            if self.keep:
                self.jobs.append((snap, urgent))


def attach_recorder(eng: Engine, transfer: MeteredTransfer | None) -> tuple[CopyRecorder, str]:
    rec = CopyRecorder()
    observe = getattr(eng, "observe", None)
    if observe is not None and Observer is not object:
        observe(rec)
        return rec, "Engine.observe"
    if transfer is not None:
        transfer.recorder = rec
    return rec, "the injected transfer engine's submit"


def copy_time_alone(jobs: list[tuple[Any, bool]], transfer: MeteredTransfer, clock: StreamClock) -> dict[str, Any]:
    """The recorded jobs replayed one after another with nothing else running: `wall_s`, the
    compute stream's time from the first submit to the last landing (host submission included),
    is the copy time alone; `busy_s` is the copy streams' summed busy time (CUDA timing events,
    read through the inner engine's `transfer_s`; CPU: each job's own perf_counter time), which
    counts twice what the urgent and the prefetch streams copy at once."""
    inner = transfer.inner
    # the bytes moved, not a fixed-capacity list's capacity (`units_moved`: read once, after the round)
    total_bytes = sum(int(j.units_moved()) * j.unit_bytes for j, _ in jobs)
    if not jobs:
        return {"jobs": 0, "bytes": 0, "busy_s": 0.0, "wall_s": 0.0}
    clock.sync()
    if clock.cuda:
        busy0 = inner.transfer_s
        a = clock.mark()
        tickets = [inner.submit(job, urgent) for job, urgent in jobs]
        for t in tickets:
            inner.wait(t)
        wall = clock.seconds(a, clock.mark())
        busy = inner.transfer_s - busy0
    else:
        busy = 0.0
        a = clock.mark()
        for job, _ in jobs:
            t0 = time.perf_counter()
            job.execute()
            busy += time.perf_counter() - t0
        wall = clock.seconds(a, clock.mark())
    return {"jobs": len(jobs), "bytes": total_bytes, "busy_s": busy, "wall_s": wall}


# ---- one timed round ----------------------------------------------------------------------------------
def timed_round(eng: Engine, steps: int, clock: StreamClock) -> dict[str, Any]:
    """`steps` engine steps between marks on the compute stream (one mark after each step)."""
    clock.sync()
    before = eng.stats()
    drafts0 = draft_counts(eng)
    tr = getattr(getattr(eng.runner, "attn", None), "transfer", None)
    busy0 = getattr(tr, "transfer_s", None)
    marks, tokens = [clock.mark()], 0
    for _ in range(steps):
        outs = eng.step()
        tokens += sum(len(o.new_token_ids) for o in outs)
        marks.append(clock.mark())
    total = clock.seconds(marks[0], marks[-1])
    per = [clock.seconds(a, b) for a, b in zip(marks, marks[1:])]
    after = eng.stats()
    drafts1 = draft_counts(eng)
    busy1 = getattr(tr, "transfer_s", None)
    batch = len([s for s in eng.scheduler.running if not s.in_prefill]) or eng.config.max_batch_size
    accepted, proposed = ((drafts1[0] - drafts0[0], drafts1[1] - drafts0[1]) if drafts0 and drafts1 else (0, 0))
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("h2d_bytes", "transfer_wait_s", "urgent_blocks")
             if isinstance(after.get(k), (int, float)) and isinstance(before.get(k, 0), (int, float))}
    return {"steps": steps, "seconds": total, "ms_per_step": 1e3 * total / steps,
            "ms_per_step_median": 1e3 * statistics.median(per),
            "ms_per_step_each": [round(1e3 * t, 3) for t in per], "tokens": tokens,
            "tokens_per_s": tokens / total if total > 0 else None,
            "batch_decoding": batch, "seq_steps_per_s": batch * steps / total if total > 0 else None,
            "emitted_share": tokens / (batch * steps) if batch * steps else None,
            "draft_accept_rate": accepted / proposed if proposed else None, "drafts_proposed": proposed,
            "h2d_bytes_per_step": delta.get("h2d_bytes", 0) / steps,
            "stall_ms_per_step": 1e3 * delta.get("transfer_wait_s", 0.0) / steps,
            "urgent_blocks_per_step": delta.get("urgent_blocks", 0) / steps,
            "copy_busy_ms_per_step": (1e3 * (busy1 - busy0) / steps if busy0 is not None and busy1 is not None
                                      else None),
            "prefetch_hit_rate_since_start": after.get("prefetch_hit_rate"),
            "draft_accept_rate_since_start": after.get("draft_accept_rate")}


def count_host_syncs(eng: Engine, clock: StreamClock) -> dict[str, Any]:
    """One more engine step under `torch.cuda.set_sync_debug_mode("warn")`: the synchronizing CUDA
    calls torch makes on the step path (the engine's one sampling read-back included; the CUDA
    transfer engine's own cuda-python event calls are not torch's and are not seen)."""
    if not clock.cuda:
        return {"syncs": None, "note": "CUDA only (torch.cuda.set_sync_debug_mode)"}
    import warnings
    clock.sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    msgs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    return {"syncs": len(msgs), "first": msgs[0][:200] if msgs else None}


# ---- CUDA graphs for the dense step ------------------------------------------------------------------
def dense_graph(eng: Engine, replays: int, clock: StreamClock) -> dict[str, Any]:
    """The dense step's forward pass (model + logits) at the running sequences' current context:
    run eagerly `replays` times, then captured once in a CUDA graph and replayed `replays` times.
    Each run writes the same K/V slot again (the next position), so repeating it is harmless."""
    seqs = [s for s in eng.scheduler.running if not s.in_prefill]
    if not seqs:
        return {"captures": 0, "replays": 0, "skipped": "no decoding sequence"}
    items = [StepItem(s.seq_id, row, 1, s.num_cached, s.block_table) for row, s in enumerate(seqs)]
    batch = StepBatch.build(items, [s.token_at(s.num_cached) for s in seqs], eng.config.block_size, eng.device)
    model = eng.model
    backend = eng.runner.attn.step(batch)        # DenseAttention.step: this step's AttentionBackend
    out: dict[str, Any] = {"captures": 0, "replays": 0, "batch": len(seqs),
                           "context": max(s.num_cached for s in seqs) + 1}

    def forward() -> torch.Tensor:
        return model.logits(model(batch.tokens, batch.positions, backend))

    with torch.inference_mode():
        eager = forward()
        clock.sync()
        a = clock.mark()
        for _ in range(replays):
            forward()
        out["eager_ms"] = 1e3 * clock.seconds(a, clock.mark()) / max(1, replays)
        if not clock.cuda:
            out["graph"] = "not captured: CUDA graphs need a GPU (the eager forward above ran the same code)"
            return out
        try:
            side = torch.cuda.Stream(eng.device)
            side.wait_stream(torch.cuda.current_stream(eng.device))
            with torch.cuda.stream(side):
                for _ in range(2):                      # warm-up off the capture stream (cuBLAS workspaces)
                    forward()
            torch.cuda.current_stream(eng.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = forward()
            out["captures"] = 1
            graph.replay()
            clock.sync()
            out["graph_matches_eager"] = bool(torch.allclose(static, eager, rtol=2e-2, atol=2e-2))
            a = clock.mark()
            for _ in range(replays):
                graph.replay()
            out["graph_ms"] = 1e3 * clock.seconds(a, clock.mark()) / max(1, replays)
            out["replays"] = replays + 1
            out["graph_speedup"] = out["eager_ms"] / out["graph_ms"] if out["graph_ms"] > 0 else None
            del graph, static
        except Exception as e:                          # a host sync inside the forward ends the capture
            out["capture_error"] = f"{type(e).__name__}: {e}"[:400]
            torch.cuda.synchronize(eng.device)
    return out


# ---- sizing under one budget ---------------------------------------------------------------------------
@dataclasses.dataclass
class Sizing:
    """Per-sequence bytes from the runtime's memory plan (runtime/memory_plan.py)."""

    dense_device: int            # dense: its whole KV pool share, on the device
    lookahead_device: dict       # residency -> device tier + summaries (per_seq_device)
    lookahead_tier: dict         # residency -> device tier alone (per_seq_device_tier)
    attended: dict               # residency -> working-set bytes the layers attend over in one step
    summaries: int               # block summaries, all layers
    host: int                    # lookahead host pool share

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def sizing(mcfg, cfg: LookaheadConfig, dtype_bytes: int, device_type: str) -> Sizing:
    def plan(**kw):
        # the bench registers its host pools in place (RegisteredPoolEngine): they pin their own bytes
        return plan_memory(mcfg, cfg.replace(max_batch_size=1, **kw), None, dtype_bytes, weights=False,
                           device_type=device_type, pinning="registered")

    dense = plan(**MODES["dense"])
    dev, tier, attended = {}, {}, {}
    summaries = host = 0
    for res in ("resident", "pingpong"):
        p = plan(**MODES[res])
        dev[res], tier[res] = p.per_seq_device, p.per_seq_device_tier
        # every layer attends over one buffer's slots: pingpong refills its 2 buffers layer by layer
        nbuf = num_buffers(cfg.replace(**MODES[res]), mcfg.num_layers)
        attended[res] = p.per_seq_device_tier // nbuf * mcfg.num_layers
        summaries, host = p.per_seq_device - p.per_seq_device_tier, p.host_kv_pool
    return Sizing(dense.host_kv_pool, dev, tier, attended, summaries, host)


def weight_read_bytes(model) -> int:
    """bench.floor.weight_bytes for our model: an untied input embedding is left out."""
    emb = model.embed_tokens.weight
    return weight_bytes(model, emb, emb if model.lm_head is None else model.lm_head.weight)


def floor_fields(weights: int, kv_bytes_per_token: int, context: int, batch: int, mode: str, size: Sizing,
                 h2d_per_step: float, ms_per_step: float, bw: dict[str, Any]) -> dict[str, Any]:
    """The step's device bytes (bench.floor.step_read_bytes), its floor over both links and ms/step
    over it."""
    sparse = None if mode == "dense" else (size.attended[mode], size.summaries)
    device_bytes = step_read_bytes(weights, kv_bytes_per_token, context, batch, sparse, h2d_per_step)
    f = step_floor(device_bytes, h2d_per_step, bw["device_gbps"], bw["h2d_gbps"])
    f["x_floor"] = ms_per_step / f["floor_ms"] if f["floor_ms"] > 0 else None
    return f


# ---- one row ------------------------------------------------------------------------------------------
def run_row(loader: Engine, cache: PrefillCache, prompt: list[int], cfg: LookaheadConfig, mode: str,
            max_tokens: int, args, clock: StreamClock) -> dict[str, Any]:
    device = loader.device
    lookahead = cfg.mode == "lookahead"
    transfer = MeteredTransfer(make_transfer_engine("cuda" if clock.cuda else "thread")) if lookahead else None
    if clock.cuda:
        torch.cuda.reset_peak_memory_stats(device)
    row: dict[str, Any] = {"host_available_before_bytes": available_host_bytes()}
    if lookahead and clock.cuda:
        row["host_pinned_bytes"] = plan_memory(loader.manifest.model, cfg, None, DTYPE_BYTES[loader.manifest.dtype],
                                               weights=False, device_type="cuda", pinning="registered").host_kv_pool
    t0 = time.perf_counter()
    eng = RegisteredPoolEngine(resolve_spec(loader.manifest, device, base=cfg, weights=False), loader.model,
                               loader.tokenizer, transfer=transfer, prefill_cache=cache)
    row["build_s"] = time.perf_counter() - t0
    try:
        rec, row["copies_recorded_through"] = attach_recorder(eng, transfer)
        for i in range(cfg.max_batch_size):
            eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0,
                                                   seed=args.seed + 1 + i))
        hits0, t0 = cache.hits, time.perf_counter()
        steps = 0
        while steps == 0 or eng.scheduler.waiting or any(s.in_prefill for s in eng.scheduler.running):
            eng.step()
            steps += 1
        clock.sync()
        row.update(prefill_s=time.perf_counter() - t0, prefill_steps=steps, prefill_replayed=cache.hits - hits0)
        for _ in range(args.warmup):
            eng.step()
        set_greedy(eng)                              # the timed rounds at temperature 0
        rec.active = rec.keep = True
        real = timed_round(eng, args.steps, clock)
        rec.active = rec.keep = False
        row.update(real)
        row["host_syncs_per_step"] = count_host_syncs(eng, clock)
        if lookahead:
            transfer.satisfied = True
            eng.step()                              # lets the real round's last prefetches land untimed
            rec.active = True                       # the same snapshot work as the real round, dropped
            sat = timed_round(eng, args.steps, clock)
            rec.active = transfer.satisfied = False
            row["satisfied"] = {k: sat[k] for k in ("ms_per_step", "ms_per_step_each", "tokens_per_s",
                                                    "h2d_bytes_per_step", "urgent_blocks_per_step")}
            alone = copy_time_alone(rec.jobs, transfer, clock)
            row["copy_alone"] = alone
            copy_ms = 1e3 * alone["wall_s"] / args.steps          # wall time: the two streams overlap
            row["copy_alone_ms_per_step"] = copy_ms
            row["copy_alone_busy_ms_per_step"] = 1e3 * alone["busy_s"] / args.steps
            exposed = row["ms_per_step"] - sat["ms_per_step"]
            row["exposed_copy_ms_per_step"] = exposed
            row["hidden_share"] = share_or_none(hidden_share(row["ms_per_step"], sat["ms_per_step"], copy_ms))
            row["hidden_share_unclamped"] = 1.0 - exposed / copy_ms if copy_ms > 0 else None
            row["copy_kernel"] = transfer.copy_kernel
            row["cuda_graph"] = {"captures": 0, "replays": 0, "graph": NO_LOOKAHEAD_GRAPH}
        else:
            row["cuda_graph"] = dense_graph(eng, args.graph_replays, clock)
        stats = eng.stats()
        if lookahead:
            row["resident_bytes_runtime"] = (stats.get("device_resident_bytes", 0)
                                             + stats.get("device_summary_bytes_per_seq", 0) * cfg.max_batch_size)
        else:
            row["resident_bytes_runtime"] = eng.pool.k.nbytes + eng.pool.v.nbytes
        if real["tokens"] < cfg.max_batch_size * args.steps:
            row["note_tokens"] = (f"{real['tokens']} tokens in {args.steps} steps of batch {cfg.max_batch_size}: "
                                  "pre-decoding steps (draft chain re-seeds) emit none")
    finally:
        eng.close()
        del eng
        rec = None
        if transfer is not None:
            transfer.recorder = None
        release_host_memory(device)
    if clock.cuda:
        row["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    row["host_available_after_bytes"] = available_host_bytes()
    return row


def plan_rows(modes: list[str], size: Sizing, budget: int, args) -> list[dict[str, Any]]:
    """(mode, batch, label, fit) of every row: each mode at its budget's batch, then equal batches."""
    host_cap = int(args.host_kv_gib * GiB) // size.host
    rows, fits = [], {}
    for mode in modes:
        per_seq = size.dense_device if mode == "dense" else size.lookahead_device[mode]
        fit = budget // per_seq
        batch = fit if mode == "dense" else min(fit, args.max_batch, host_cap)
        fits[mode] = batch
        rows.append(dict(mode=mode, batch=batch, fit=fit, label="budget", per_seq=per_seq,
                         cap=None if mode == "dense" else
                         ("host pool" if host_cap < min(fit, args.max_batch) else
                          "--max-batch" if args.max_batch < fit else None)))
    if not args.no_equal_batch and "dense" in fits:
        dense_b = fits["dense"]
        equal = [m for m in args.equal_batch_modes.split(",") if m in fits]
        for mode in equal:
            if dense_b >= 1 and fits[mode] != dense_b:
                rows.append(dict(mode=mode, batch=dense_b, fit=None, label="equal batch (dense's)",
                                 per_seq=size.lookahead_device[mode], cap=None))
        la = max((fits[m] for m in modes if m != "dense"), default=0)
        if la > dense_b >= 0 and la >= 1:
            rows.append(dict(mode="dense", batch=la, fit=None, label="equal batch (lookahead's)",
                             per_seq=size.dense_device, cap=None))
    return rows


def device_room(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free


# ---- one shape (the child process) ---------------------------------------------------------------------
def run_shape(name: str, path: Path, args, results: ResultFile) -> int:
    device = torch.device(args.device)
    clock = StreamClock(device)
    shape: dict[str, Any] = {"engine_dir": str(path)}
    from plugins.cpu import loader as cpu_loader        # the C kernels every step calls: built before any timing
    t0 = time.perf_counter()
    shape["cpu_kernels"] = "built" if cpu_loader.library() is not None else cpu_loader.unavailable_reason()
    shape["cpu_kernels_s"] = time.perf_counter() - t0
    with torch.inference_mode():
        shape["bandwidth"] = bw = device_bandwidths(device, gib=args.bandwidth_gib)
    print(f"[{name}] {device}: device memory {bw['device_gbps']:.0f} GB/s (copy, read + write), "
          f"{bw['h2d_source']} -> device {bw['h2d_gbps']:.1f} GB/s", flush=True)
    manifest = load_manifest(path)
    mcfg = manifest.model
    shape["model"] = dataclasses.asdict(mcfg) if dataclasses.is_dataclass(mcfg) else str(mcfg)
    shape["weights"] = (f"random ({getattr(manifest, 'random_weights', None)})"
                        if getattr(manifest, "random_weights", None) else f"from {path} (source {manifest.source})")
    kv_dtype = args.kv_dtype or manifest.dtype
    max_tokens = args.warmup + 2 * args.steps + 10     # warm-up, two rounds, the settling and sync-count steps
    context = min(args.context, mcfg.max_position_embeddings - max_tokens)
    if context < args.context:
        shape["note_context"] = (f"--context {args.context} capped to {context}: the engine's max_position_embeddings "
                                 f"is {mcfg.max_position_embeddings} and {max_tokens} decode tokens follow the prompt")
        print(f"[{name}] {shape['note_context']}", flush=True)
    if context < 1:
        shape["error"] = shape["note_context"]
        results.put("shapes", name, shape)
        return 1
    max_len = context + max_tokens
    common = dict(top_k=args.top_k, kv_dtype=kv_dtype, max_model_len=max_len)
    if "prefix_caching" in {f.name for f in dataclasses.fields(LookaheadConfig)}:
        # every sequence keeps its own copy of the one prompt, as a batch of distinct prompts would
        # (shared prefix blocks would shrink the host pool and the copies below what is planned)
        common["prefix_caching"] = False
    if args.recent_window is not None:
        common["recent_window"] = args.recent_window
    base = manifest.lookahead.replace(**common)
    size = sizing(mcfg, base, DTYPE_BYTES[manifest.dtype], device.type)
    budget = int(args.kv_budget_gib * GiB) if args.kv_budget_gib else args.dense_batch * size.dense_device
    modes = args.modes.split(",")
    specs = plan_rows(modes, size, budget, args)
    shape.update(context=context, max_model_len=max_len, kv_dtype=kv_dtype, kv_budget_bytes=budget,
                 sizes_per_seq=size.as_dict(), rows_planned=[{k: v for k, v in s.items()} for s in specs])
    results.put("shapes", name, shape)

    t0 = time.perf_counter()
    bs = base.block_size
    loader = Engine.from_dir(path, device=args.device, mode="dense", max_batch_size=1, max_model_len=bs,
                             prefill_chunk=bs, kv_dtype=kv_dtype)
    clock.sync()
    shape["load_s"] = time.perf_counter() - t0
    weights = weight_read_bytes(loader.model)
    shape["weight_bytes"] = weights
    shape["ops"] = getattr(loader.ops, "name", str(loader.ops))
    shape["cuda_kernels_registered"] = {op: torch._C._dispatch_has_kernel_for_dispatch_key(f"lookahead::{op}", "CUDA")
                                        for op in ("block_gather", "block_topk", "update_summaries",
                                                   "lookahead_attention", "plan_slots", "copy_blocks")}
    # one prompt, prefilled once for real and replayed into every engine's backend
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, mcfg.vocab_size, (context,), generator=g).tolist()
    cache = PrefillCache(max_prompts=1)
    t0 = time.perf_counter()
    with torch.inference_mode():
        rec_cfg = base.replace(**MODES["dense"], max_batch_size=1, prefill_chunk=context)
        rec_eng = Engine(resolve_spec(loader.manifest, loader.device, base=rec_cfg, weights=False), loader.model,
                         loader.tokenizer, prefill_cache=cache)
        rec_eng.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while rec_eng.has_unfinished():
            rec_eng.step()
        rec_eng.close()
        del rec_eng
        gc.collect()
    clock.sync()
    shape["prefill_record_s"] = time.perf_counter() - t0
    results.put("shapes", name, shape)
    print(f"[{name}] {mcfg.num_layers} layers loaded in {shape['load_s']:.1f}s; {context}-token prompt prefilled in "
          f"{shape['prefill_record_s']:.1f}s; device KV budget {budget / GiB:.2f} GiB", flush=True)

    kv_token = 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * DTYPE_BYTES[kv_dtype]
    failed = 0
    for spec in specs:
        mode, batch = spec["mode"], spec["batch"]
        row: dict[str, Any] = {"model": name, "mode": mode if mode == "dense" else f"lookahead/{mode}",
                               "label": spec["label"], "context": context, "layers": mcfg.num_layers,
                               "dtype": manifest.dtype, "kv_dtype": kv_dtype, "batch": batch,
                               "batch_fit_in_budget": spec["fit"], "batch_cap": spec["cap"],
                               "kv_budget_bytes": budget, "resident_bytes_per_seq": spec["per_seq"],
                               "resident_bytes": spec["per_seq"] * batch}
        room = device_room(device)
        if args.deadline and time.time() > args.deadline - 15:
            row["skipped"] = "not run: the bench's time budget (--time-budget-s) ran out"
        elif batch < 1:
            row["error"] = f"the budget ({budget} bytes) holds no sequence of this mode ({spec['per_seq']} bytes each)"
        elif room is not None and spec["label"] != "budget" and spec["per_seq"] * batch > 0.8 * room:
            row["skipped"] = (f"needs {spec['per_seq'] * batch / GiB:.1f} GiB of device KV, "
                              f"{room / GiB:.1f} GiB is free")
        else:
            cfg = base.replace(**MODES[mode], max_batch_size=batch, prefill_chunk=batch * context)
            print(f"[{name}] {row['mode']} ({spec['label']}): batch {batch}, "
                  f"{spec['per_seq'] / 2**20:.1f} MiB of device KV per sequence", flush=True)
            try:
                row.update(run_row(loader, cache, prompt, cfg, mode, max_tokens, args, clock))
                row["floor"] = floor_fields(weights, kv_token, context, batch, mode, size, row["h2d_bytes_per_step"],
                                            row["ms_per_step"], bw)
                row["x_floor"] = row["floor"]["x_floor"]
            except Exception as e:           # one failing row must not hide the others' numbers
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {e}"[:500]
        failed += bool(row.get("error"))
        results.append("results", row)
    loader.close()
    return 1 if failed else 0


# ---- the parent: one child per shape, then the table ----------------------------------------------------
def machine(device: torch.device) -> dict[str, Any]:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cpus": os.cpu_count(), "device": str(device), "host": platform.node()}
    if device.type == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def comparison(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per shape: each lookahead mode's tokens/s at the budget's batch over dense's."""
    out = []
    rows = [r for r in doc.get("results", []) if not r.get("error") and r.get("tokens_per_s")]
    for name in dict.fromkeys(r["model"] for r in rows):
        dense = next((r for r in rows if r["model"] == name and r["mode"] == "dense" and r["label"] == "budget"), None)
        for r in rows:
            if r["model"] == name and r["mode"] != "dense" and r["label"] == "budget" and dense:
                out.append({"model": name, "mode": r["mode"], "dense_batch": dense["batch"], "batch": r["batch"],
                            "dense_tokens_per_s": dense["tokens_per_s"], "tokens_per_s": r["tokens_per_s"],
                            "speedup": r["tokens_per_s"] / dense["tokens_per_s"],
                            "target": TARGETS["speedup_at_equal_budget"]})
    return out


def fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def print_table(doc: dict[str, Any]) -> None:
    a = doc["args"]
    shapes = doc.get("shapes", {})
    bws = "; ".join(f"{n}: device {s['bandwidth']['device_gbps']:.0f} GB/s, H2D {s['bandwidth']['h2d_gbps']:.1f} GB/s"
                    for n, s in shapes.items() if "bandwidth" in s)
    timer = next((s["bandwidth"]["timer"] for s in shapes.values() if "bandwidth" in s), "-")
    timer = "CUDA events on the compute stream" if timer == "cuda events" else timer
    print(f"\ndecode steps on {doc['machine'].get('gpu', doc['machine']['device'])}: the real engine over "
          f"random-weights engine dirs, {a['context']}-token prompts, {a['steps']} timed steps after {a['warmup']} "
          f"({timer}); budget = "
          f"{str(a['kv_budget_gib']) + ' GiB' if a['kv_budget_gib'] else str(a['dense_batch']) + ' dense sequences'}"
          f" of device KV; bandwidths ({bws}); timed at temperature 0 (warm-up at 1); seq/s = batch x 1000 / "
          f"ms/step (every sequence a token a step), accept = the round's draft accept rate")
    head = (f"{'model':<14}{'mode':<20}{'rows':<12}{'batch':>6}{'KV MiB':>9}{'tok/s':>9}{'seq/s':>9}{'accept':>7}"
            f"{'ms/step':>9}{'H2D MiB':>9}{'stall ms':>9}{'copy ms':>9}{'hidden':>8}{'floor ms':>9}{'x floor':>9}"
            f"{'graph ms':>9}")
    print(head)
    for r in doc.get("results", []):
        label = "budget" if r.get("label") == "budget" else "equal b."
        line = (f"{r['model']:<14}{r['mode']:<20}{label:<12}{r['batch']:>6}"
                f"{r.get('resident_bytes', 0) / 2**20:>9.0f}")
        if r.get("error") or r.get("skipped"):
            print(f"{line}  {'ERROR ' + r['error'][:110] if r.get('error') else 'skipped: ' + r['skipped']}")
            continue
        g = r.get("cuda_graph") or {}
        print(f"{line}{r['tokens_per_s']:>9.1f}{fmt(r.get('seq_steps_per_s'), '.1f'):>9}"
              f"{fmt(r.get('draft_accept_rate'), '.0%'):>7}{r['ms_per_step']:>9.2f}"
              f"{r['h2d_bytes_per_step'] / 2**20:>9.1f}"
              f"{r['stall_ms_per_step']:>9.2f}{fmt(r.get('copy_alone_ms_per_step'), '.2f'):>9}"
              f"{fmt(r.get('hidden_share'), '.0%'):>8}{r['floor']['floor_ms']:>9.2f}"
              f"{fmt(r.get('x_floor'), '.2f'):>8}x{fmt(g.get('graph_ms'), '.2f'):>9}")
    for c in doc.get("comparison", []):
        print(f"{c['model']}: {c['mode']} at batch {c['batch']} / dense at batch {c['dense_batch']}, equal budget: "
              f"{c['speedup']:.2f}x tokens/s (target {c['target']:.1f}x)")
    for n, s in shapes.items():
        for key in ("error", "note_context"):
            if s.get(key):
                print(f"{n}: {s[key]}")


def child_argv(args, name: str) -> list[str]:
    argv = [sys.executable, "-m", "bench.gpu_decode", "--child-shape", name]
    if args.deadline:
        argv += ["--deadline", str(args.deadline)]
    for key, value in vars(args).items():
        if key in ("child_shape", "engine_list", "time_budget_s", "deadline") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_decode: --device cuda but torch.cuda.is_available() is False "
              "(use --device cpu for the smoke run)", file=sys.stderr)
        return 2
    out = args.out / RESULTS
    if args.child_shape:                            # one shape, in this (child) process
        path = dict(args.engine_list)[args.child_shape]
        try:
            return run_shape(args.child_shape, path, args, ResultFile(out))
        except Exception as e:
            traceback.print_exc()
            ResultFile(out).append("results", {"model": args.child_shape, "mode": "-", "label": "-", "batch": 0,
                                               "error": f"{type(e).__name__}: {e}"[:500]})
            return 1
    t_start = time.perf_counter()
    if args.time_budget_s:
        args.deadline = time.time() + args.time_budget_s
    results = ResultFile(out, fresh=True)
    results.update(machine=machine(device),
                   args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "engine_list"},
                   weights="random (the engine dirs' random_weights recipe): timing only, not accuracy",
                   prompts="one random prompt per shape, prefilled once and replayed into every engine (PrefillCache); "
                           "each sequence samples its warm-up steps with its own seed at temperature 1, the timed "
                           "rounds at temperature 0",
                   targets=TARGETS, results=[])
    rc = 0
    for name, path in args.engine_list:
        left = args.time_budget_s - (time.perf_counter() - t_start) if args.time_budget_s else None
        if left is not None and left < 10:
            results.put("shapes", name, {"engine_dir": str(path), "error": f"not run: {left:.0f}s of the budget left"})
            rc = 1
            continue
        try:
            proc = subprocess.run(child_argv(args, name), timeout=left - 5 if left else None)
            code = proc.returncode
            why = f"exit status {code}" if code > 0 else f"killed by signal {-code}"
        except subprocess.TimeoutExpired:
            code, why = 124, f"timed out after {left - 5:.0f}s"
        if code != 0:
            rc = 1
            doc = results.load()
            if not any(r.get("model") == name for r in doc.get("results", [])) or code < 0 or code == 124:
                results.append("results", {"model": name, "mode": "-", "label": "-", "batch": 0,
                                           "error": f"the {name} child process ended with {why}"})
    doc = results.update(comparison=comparison(results.load()), elapsed_s=time.perf_counter() - t_start)
    print_table(doc)
    print(f"\nwrote {out} ({doc['elapsed_s']:.0f} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
