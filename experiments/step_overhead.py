#!/usr/bin/env python
"""How much of a dense decode step is spent outside the C kernels, with the fused step off and on.

    .venv/bin/python experiments/step_overhead.py --engine engines/default engines/int8 --context 2048 8192 \\
        --batch 1 4 --steps 20 --repeats 5 --threads 1 --fused off on --json build/step_overhead.json

For each (engine, context, batch) it makes one engine per `--fused` setting over the same loaded
model (`Engine.sibling(fused=...)`), gives each `batch` sequences whose first
`context - 1` tokens are already in the pool (random K/V: the values do not change a dense step's
work, and a real 8K x 4 prefill would take minutes), and then interleaves `--repeats` blocks of
`--steps` decode steps between the settings (the order alternating), so that load on the machine
falls on both alike. Reported, as medians over the timed steps:

- ms/step: `DenseRunner.run` (the forward pass and the logits; the engine's sampling and
  scheduling are not in it);
- ms in kernels: wall time inside the ctypes calls of plugins/cpu (every one goes through
  `loader.library()`, which this script points at a timing proxy), the ctypes argument conversion
  included; ms outside = ms/step - ms in kernels, with the proxy's own cost (measured at start,
  per call) taken out;
- C calls and aten calls per step: the proxy's count, and torch.profiler's `aten::` events
  (nested ones included) over an untimed block of steps.

Prints a table and writes the rows as JSON (--json). One setting at a time: --fused on, or off.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from plugins.cpu import loader
from runtime.engine import Engine
from runtime.sampling import SamplingParams


class KernelClock:
    """Stands in for the ctypes library: each kernel call is timed and counted."""

    def __init__(self, lib):
        self._lib, self.ns, self.calls = lib, 0, 0

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        clock, now = self, time.perf_counter_ns

        def timed(*args):
            t0 = now()
            out = fn(*args)
            clock.ns += now() - t0
            clock.calls += 1
            return out
        self.__dict__[name] = timed
        return timed


def probe_cost_ns(n: int = 200_000) -> float:
    """The proxy's own cost per call (a Python call and two clock reads) over a bare call."""
    now = time.perf_counter_ns

    def bare():
        return None

    class Lib:
        f = staticmethod(bare)
    clock = KernelClock(Lib())
    f = clock.f
    t0 = now()
    for _ in range(n):
        bare()
    t1 = now()
    for _ in range(n):
        f()
    t2 = now()
    return max(0.0, ((t2 - t1) - (t1 - t0)) / n)


def ready_engine(base: Engine, fused: str, batch: int, context: int, steps_total: int, max_len: int,
                 seed: int) -> Engine:
    """A sibling of `base` whose `batch` sequences have `context - 1` tokens in the pool (random
    K/V) and decode next (their last prompt token first, a one-token step like a decode step)."""
    eng = base.sibling(max_batch_size=batch, max_model_len=max_len, fused=fused == "on")
    g = torch.Generator().manual_seed(seed)
    vocab = eng.manifest.model.vocab_size
    params = SamplingParams(max_tokens=steps_total + 1, ignore_eos=True)
    for b in range(batch):
        eng.add_request(torch.randint(0, vocab, (context,), generator=g).tolist(), params)
    eng._drain_inbox()                    # (private) admit without prefilling: the pool is filled below
    eng.scheduler._admit()
    assert len(eng.scheduler.running) == batch, "the pool did not admit every sequence"
    for seq in eng.scheduler.running:
        seq.num_cached = context - 1
    return eng


def fill_pool(eng: Engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in (eng.pool.k, eng.pool.v):
        for layer in range(t.shape[0]):
            t[layer].copy_(torch.randn(t[layer].shape, generator=g) * 0.5)


def timed_steps(eng: Engine, clock: KernelClock, n: int, out: dict) -> None:
    run = eng.runner.run
    for _ in range(n):
        work = eng.scheduler.schedule()
        assert work and all(k == 1 for _, k in work), "not a decode step"
        ns0, c0 = clock.ns, clock.calls
        t0 = time.perf_counter_ns()
        logits = run(work)
        t1 = time.perf_counter_ns()
        out["step_ms"].append((t1 - t0) / 1e6)
        out["kernel_ms"].append((clock.ns - ns0) / 1e6)
        out["calls"].append(clock.calls - c0)
        out["context"].append(sum(s.num_cached for s, _ in work) / len(work))
        # the engine's own sampling and bookkeeping, untimed (the next step needs the tokens)
        for seq in [s for s, _ in work if s.seq_id in logits]:
            seq.append_token(int(logits[seq.seq_id].argmax()), ())


def aten_calls(eng: Engine, n: int) -> float:
    from torch.profiler import ProfilerActivity, profile
    clock = KernelClock(loader._state["lib"])
    sink = {"step_ms": [], "kernel_ms": [], "calls": [], "context": []}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        timed_steps(eng, clock, n, sink)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / n


def measure(args, engine_dir: str, context: int, batch: int, probe_ns: float) -> list[dict]:
    per_setting = args.repeats * args.steps + args.warmup + args.profile_steps
    max_len = context + per_setting + 8
    base = Engine.from_dir(engine_dir, verify_checksums=False, mode="dense", max_batch_size=1,
                           max_model_len=16)          # the loaded model; its own pool is a token one
    limit = min(max_len, base.manifest.model.max_position_embeddings)
    start = min(context, limit - per_setting - 8)              # at 8192 the decode starts a little earlier
    engines = {}
    for i, fused in enumerate(args.fused):
        eng = engines[fused] = ready_engine(base, fused, batch, start, per_setting, limit, seed=batch)
        if i == 0:
            fill_pool(eng, seed=context)
        else:
            eng.pool.k.copy_(engines[args.fused[0]].pool.k), eng.pool.v.copy_(engines[args.fused[0]].pool.v)
        if fused == "on" and eng.runner.fused is None:
            raise SystemExit(f"{engine_dir}: the fused step is not available: {eng.runner.fused_reason}")
    clock = KernelClock(loader._state["lib"])
    loader._state["lib"] = clock
    try:
        samples = {f: {"step_ms": [], "kernel_ms": [], "calls": [], "context": []} for f in args.fused}
        with torch.inference_mode():
            for f, eng in engines.items():
                timed_steps(eng, clock, args.warmup, {k: [] for k in samples[f]})
            for rep in range(args.repeats):
                for f in (args.fused if rep % 2 == 0 else args.fused[::-1]):
                    timed_steps(engines[f], clock, args.steps, samples[f])
            atens = {f: aten_calls(eng, args.profile_steps) for f, eng in engines.items()}
    finally:
        loader._state["lib"] = clock._lib
    rows = []
    for f, s in samples.items():
        eng = engines[f]
        outside = [st - k - c * probe_ns / 1e6 for st, k, c in zip(s["step_ms"], s["kernel_ms"], s["calls"])]
        rows.append({"engine": Path(engine_dir).name, "batch": batch, "context": round(statistics.mean(s["context"])),
                     "fused": f, "threads": args.threads, "steps": len(s["step_ms"]),
                     "ms_per_step": round(statistics.median(s["step_ms"]), 3),
                     "ms_in_kernels": round(statistics.median(s["kernel_ms"]), 3),
                     "ms_outside": round(statistics.median(outside), 3),
                     "c_calls_per_step": statistics.mean(s["calls"]),
                     "aten_calls_per_step": round(atens[f], 1),
                     "fused_steps": getattr(eng.runner.fused, "steps", 0),
                     "kv_dtype": str(eng.pool.dtype).removeprefix("torch."),
                     "ms_per_step_samples": [round(x, 3) for x in s["step_ms"]],
                     "ms_outside_samples": [round(x, 3) for x in outside]})
    for eng in engines.values():
        eng.close()
    return rows


def table(rows: list[dict]) -> str:
    head = ("engine", "kv", "context", "batch", "fused", "ms/step", "ms in kernels", "ms outside", "C calls",
            "aten calls")
    lines = [head] + [(r["engine"], r["kv_dtype"], str(r["context"]), str(r["batch"]), r["fused"],
                       f"{r['ms_per_step']:.2f}", f"{r['ms_in_kernels']:.2f}", f"{r['ms_outside']:.2f}",
                       f"{r['c_calls_per_step']:.0f}", f"{r['aten_calls_per_step']:.0f}") for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    fmt = lambda line: "  ".join(c.rjust(w) for c, w in zip(line, widths))  # noqa: E731
    return "\n".join([fmt(lines[0]), "  ".join("-" * w for w in widths), *map(fmt, lines[1:])])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", nargs="+", default=["engines/default"])
    p.add_argument("--context", nargs="+", type=int, default=[2048], help="tokens in the cache when decoding starts")
    p.add_argument("--batch", nargs="+", type=int, default=[1])
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per block")
    p.add_argument("--repeats", type=int, default=3, help="blocks per setting, interleaved")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=3, help="untimed steps under torch.profiler (aten counts)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fused", nargs="+", choices=("off", "on"), default=["off", "on"])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if loader.library() is None:
        raise SystemExit(f"no CPU kernels: {loader.unavailable_reason()}")
    probe_ns = probe_cost_ns()
    rows = []
    for engine_dir in args.engine:
        for context in args.context:
            for batch in args.batch:
                rows += measure(args, engine_dir, context, batch, probe_ns)
                print(table(rows[-len(args.fused):]), flush=True)
    print()
    print(table(rows))
    print(f"(medians of {args.repeats} x {args.steps} steps; {args.threads} thread(s); probe cost "
          f"{probe_ns:.0f} ns/call removed from 'outside'; load average {os.getloadavg()[0]:.1f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "probe_ns_per_call": probe_ns, "argv": sys.argv[1:],
                                         "loadavg": os.getloadavg()}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
