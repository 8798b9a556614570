"""An engine's speed with a busy process on one of its cores, beside its quiet speed.

    python -m bench.contention --engine engines/default --json results/contention.json

For each mode (dense, lookahead) and each setting of `adaptive_threads` (off: every step on the
engine's threads; on: runtime/thread_tuner.py picks fewer while fewer are faster), a fresh process
loads the engine on --threads threads and measures
- decode: --streams sequences of --prompt-tokens random ids, --decode-tokens greedy tokens each, the
  best of two rounds' `decode_step_seconds / decode_steps` (ms a step);
- prefill (dense only; --prefill-tokens, 0 skips): the best of two cold prompts, seconds;
once on a quiet machine and once beside a process that spins on one core (`while True: pass`). The
runs interleave (off, on, off, on ...) so a machine whose speed drifts lands on both sides. The
issue 42 target: busy <= 2.2x quiet (ideal: 2x for a step that had both cores).

Table on stdout, JSON with --json. Run it on an otherwise idle machine: the busy process is the
only contention it means to measure.

    python -m bench.contention --quiet-rounds 10 --modes lookahead,dense --json results/tuner_quiet.json

The quiet cost of the tuner's checks, sharper than the one pair above: --quiet-rounds pairs of
fresh processes a mode (decode only, as above), adaptive on and off in A B B A order, so a drift of
the machine's speed lands on both; per pair, on / off, and the median of those ratios (each its
own process: two engines in one share its OpenMP pools and transfer threads).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
from runtime.engine import Engine
from runtime.sampling import SamplingParams
import torch
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
e = Engine.from_dir(a["engine"], mode=a["mode"], max_batch_size=a["streams"], prefix_caching=False,
                    adaptive_threads=a["adaptive"])
prompts = [[100 + (7 * i + j) % 5000 for j in range(a["prompt_tokens"])] for i in range(a["streams"])]
e.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
out = {"decode_ms": None, "prefill_s": None}
for _ in range(2):
    c = dict(e.counters)
    e.generate(prompts, SamplingParams(max_tokens=a["decode_tokens"], ignore_eos=True))
    ms = 1000 * (e.counters["decode_step_seconds"] - c["decode_step_seconds"]) / (e.counters["decode_steps"] - c["decode_steps"])
    out["decode_ms"] = ms if out["decode_ms"] is None else min(out["decode_ms"], ms)
if a["prefill_tokens"]:
    p = [100 + (11 * j) % 5000 for j in range(a["prefill_tokens"])]
    for r in range(2):
        t = time.perf_counter()
        e.generate([[r] + p], SamplingParams(max_tokens=1))
        s = time.perf_counter() - t
        out["prefill_s"] = s if out["prefill_s"] is None else min(out["prefill_s"], s)
out.update(e.tuner.stats())
print(json.dumps(out))
"""

def quiet_cost(args: argparse.Namespace) -> list[dict]:
    """Per mode: --quiet-rounds pairs of fresh processes (decode only), the tuner on and off in A B
    B A order; each pair's on / off and their median."""
    rows = []
    quiet = argparse.Namespace(**{**vars(args), "prefill_tokens": 0})
    for mode in args.modes.split(","):
        on, off, checks = [], [], []
        for r in range(args.quiet_rounds):
            for adaptive in ((True, False) if r % 2 == 0 else (False, True)):
                out = run_child(quiet, mode, adaptive)
                (on if adaptive else off).append(out["decode_ms"])
                if adaptive:
                    checks.append(out["thread_checks"])
        ratios = [a / b for a, b in zip(on, off)]
        rows.append({"mode": mode, "on_ms": on, "off_ms": off, "ratios": ratios,
                     "median_ratio": statistics.median(ratios), "checks": checks})
        print(f"  {mode}: {rows[-1]}", file=sys.stderr)
    return rows


def quiet_table(rows: list[dict]) -> list[str]:
    lines = [f"{'mode':10} {'pairs':>6} {'on ms (median)':>15} {'off ms (median)':>16} {'on/off per pair':>32} "
             f"{'median':>7} {'checks':>7}"]
    for r in rows:
        spread = f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f}"
        lines.append(f"{r['mode']:10} {len(r['ratios']):6d} {statistics.median(r['on_ms']):15.2f} "
                     f"{statistics.median(r['off_ms']):16.2f} {spread:>32} {r['median_ratio']:7.3f} "
                     f"{max(r['checks']):>7}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.contention", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="engines/default")
    p.add_argument("--modes", default="dense,lookahead", help="comma-separated: dense, lookahead, sparse")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=4096, help="the dense prefill measured (0: none)")
    p.add_argument("--quiet-rounds", type=int, default=0, metavar="N",
                   help="instead: the tuner's quiet cost, N interleaved rounds a mode (see above)")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def run_child(args: argparse.Namespace, mode: str, adaptive: bool) -> dict:
    spec = {"engine": args.engine, "mode": mode, "threads": args.threads, "streams": args.streams,
            "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens, "adaptive": adaptive,
            "prefill_tokens": args.prefill_tokens if mode == "dense" else 0}
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], cwd=ROOT, capture_output=True, text=True,
                       timeout=3600)
    if r.returncode:
        raise SystemExit(f"a measurement failed ({mode}, adaptive {adaptive}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    for load in ("quiet", "busy"):
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
        try:
            for mode in args.modes.split(","):
                for adaptive in (False, True):
                    rows.append({"load": load, "mode": mode, "adaptive_threads": adaptive,
                                 **run_child(args, mode, adaptive)})
                    print(f"  {load} {mode} adaptive={adaptive}: {rows[-1]}", file=sys.stderr)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    return rows


def table(rows: list[dict]) -> list[str]:
    quiet = {(r["mode"], r["adaptive_threads"]): r for r in rows if r["load"] == "quiet"}
    lines = [f"{'mode':10} {'adaptive':8} {'load':6} {'decode ms':>10} {'x quiet':>8} {'prefill s':>10} {'x quiet':>8} "
             f"{'threads':>8}"]
    for r in rows:
        q = quiet[r["mode"], r["adaptive_threads"]]
        xd = r["decode_ms"] / q["decode_ms"]
        pf = f"{r['prefill_s']:10.2f} {r['prefill_s'] / q['prefill_s']:8.2f}" if r["prefill_s"] else f"{'-':>10} {'-':>8}"
        threads = f"{r.get('threads_decode', '-')}/{r.get('threads_prefill', '-')}"
        lines.append(f"{r['mode']:10} {str(r['adaptive_threads']):8} {r['load']:6} {r['decode_ms']:10.2f} {xd:8.2f} "
                     f"{pf} {threads:>8}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quiet_rounds:
        rows = quiet_cost(args)
        print("\n".join(quiet_table(rows)))
        print("on/off: a process with the tuner against the next (or previous) without, A B B A, each the best of "
              "two decode rounds; checks: the most any process with the tuner ran")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
        return 0
    rows = measure(args)
    print("\n".join(table(rows)))
    print("x quiet: against the same mode and setting on the quiet machine; threads: decode/prefill at the end")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
