"""Old commit against new: bench_decode.py from two commits, run alternately in one session (ABBA order).

    python scripts/bench_ab.py --old ddb024d --new HEAD --rounds 2 --json results/ab.json -- \
        --contexts 8192 --batches 4 --hf-impls default --decode-steps 16 --modes all

Each commit runs from its own detached worktree under build/ab/ (engines/ linked in, so both read
the same engine dir), with this checkout's Python environment and that worktree first on the
import path. The runs go old, new, new, old, old, new, ... so a slow minute falls on both alike.
The table gives each mode's decode tokens/s per commit (median over its runs), the run-to-run
spread (max - min over min, per commit) and new/old; a difference inside the spread is noise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from runtime.threads import prepare_threads

prepare_threads()  # first: libgomp reads GOMP_SPINCOUNT once, when torch loads it (runtime/threads.py)

ROOT = Path(__file__).resolve().parents[1]
AB_DIR = ROOT / "build" / "ab"


def worktree(ref: str) -> tuple[str, Path]:
    """A detached worktree of `ref` (made once per commit), with engines/ linked to this checkout's."""
    sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = AB_DIR / sha
    if not path.exists():
        AB_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    link = path / "engines"
    if not link.exists():
        link.symlink_to(ROOT / "engines")
    return sha, path


def run_once(path: Path, bench_args: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    script = path / "scripts" / "bench_decode.py"
    if not script.exists():                 # a commit from before its rename
        script = path / "scripts" / "bench.py"
    cmd = [sys.executable, str(script), *bench_args, "--json", str(out)]
    print(f"$ ({path.name}) {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=path, env=env, check=True)
    return json.loads(out.read_text())


def order(rounds: int) -> list[int]:
    """ABBA...: 0 = old, 1 = new; `rounds` runs of each."""
    return [(i + (i // 2)) % 2 for i in range(2 * rounds)]


def summarise(runs: dict[int, list[dict]]) -> list[dict]:
    """Per (context, batch, impl): tokens/s of each run of each commit, medians, spreads, new/old."""
    keyed: dict[tuple, dict[int, list[float]]] = {}
    for side, docs in runs.items():
        for doc in docs:
            for r in doc["rows"]:
                key = (r["context"], r["batch"], r["impl"])
                keyed.setdefault(key, {0: [], 1: []})[side].append(r["decode_tokens_per_s"])
    table = []
    for (ctx, batch, impl), by in keyed.items():
        if not by[0] or not by[1]:
            continue
        med = [statistics.median(by[s]) for s in (0, 1)]
        spread = [(max(by[s]) - min(by[s])) / min(by[s]) for s in (0, 1)]
        table.append({"context": ctx, "batch": batch, "impl": impl, "old": by[0], "new": by[1],
                      "old_median": med[0], "new_median": med[1], "old_spread": spread[0], "new_spread": spread[1],
                      "new_over_old": med[1] / med[0],
                      "within_spread": abs(med[1] / med[0] - 1) <= max(spread)})
    return table


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="the commit to compare against (any git ref)")
    p.add_argument("--new", default="HEAD", help="the commit under test (default: HEAD; commit your work first)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each commit (default: 2)")
    p.add_argument("--json", help="write every run's rows and the summary here")
    args = p.parse_args(ours)
    if args.rounds < 1:
        p.error("--rounds: must be >= 1")
    sides = [worktree(args.old), worktree(args.new)]
    runs: dict[int, list[dict]] = {0: [], 1: []}
    for i, side in enumerate(order(args.rounds)):
        sha, path = sides[side]
        runs[side].append(run_once(path, bench_args, AB_DIR / f"{sha}_{i}.json"))
    table = summarise(runs)
    print(f"\nold {sides[0][0]} vs new {sides[1][0]}, {args.rounds} runs each, ABBA order; decode tokens/s\n")
    print("| context | batch | mode | old (median) | new (median) | new/old | spread old | spread new | inside |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['context']} | {r['batch']} | {r['impl']} | {r['old_median']:.1f} | {r['new_median']:.1f} | "
              f"{r['new_over_old']:.3f} | {100 * r['old_spread']:.1f}% | {100 * r['new_spread']:.1f}% | "
              f"{'yes' if r['within_spread'] else 'NO'} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"old": sides[0][0], "new": sides[1][0], "bench_args": bench_args,
                                               "runs": runs, "summary": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
