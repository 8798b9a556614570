"""One JSON results file that several processes of the GPU check add to, one check at a time.

    results = ResultFile(out / "kernel_check.json")
    results.update(device="NVIDIA H200")          # merge top-level fields
    results.append("checks", {...})               # add one row to a list
    results.put("shapes", "llama3-8b", {...})     # set one named entry of a section

Every call reads the file, merges, and replaces it atomically (write to a temporary file, then
`os.replace`): what was recorded before a crash, a sticky CUDA fault or a timeout kill is on disk,
and a child process (the large-index kernel cases, one model shape of the decode bench) adds its
rows to the same file as its parent. The processes take turns (a parent waits for its child), so
no lock is needed.

    python -m bench.gpu_results kernels out/gpu_check/kernel_check/kernel_check.json
    python -m bench.gpu_results bench out/gpu_check/decode_bench/decode_bench.json

print the one-line summary scripts/gpu_check.sh puts in its table (no torch import: it is quick).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


class ResultFile:
    def __init__(self, path: str | Path, fresh: bool = False):
        """fresh: start an empty file (the parent of a run); children open the existing one."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh or not self.path.exists():
            self._write({})

    def load(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def _write(self, doc: dict[str, Any]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=_plain) + "\n")
        os.replace(tmp, self.path)

    def update(self, **fields: Any) -> dict[str, Any]:
        doc = self.load()
        doc.update(fields)
        self._write(doc)
        return doc

    def put(self, key: str, name: str, value: Any) -> dict[str, Any]:
        """doc[key][name] = value (a named section, e.g. one model shape's sizing)."""
        doc = self.load()
        doc.setdefault(key, {})[name] = value
        self._write(doc)
        return doc

    def append(self, key: str, row: dict[str, Any]) -> dict[str, Any]:
        doc = self.load()
        doc.setdefault(key, []).append(row)
        self._write(doc)
        return doc


def _plain(value: Any) -> Any:
    """json.dumps' fallback: paths and other objects as strings, numpy/torch scalars as numbers."""
    if hasattr(value, "item"):
        try:
            return value.item()
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


def kernels_summary(doc: dict[str, Any]) -> str:
    """bench/gpu_kernels.py's results in one line."""
    if doc.get("build_error"):
        return f"the extension did not build ({doc['build_error'][-120:]})"
    checks = doc.get("checks", [])
    parts = [f"numerics {sum(c['ok'] for c in checks)}/{len(checks)}"]
    if doc.get("gather"):
        parts.append(f"gather/memcpy >= {min(g['gather_vs_memcpy'] for g in doc['gather']):.2f}")
        parts.append(f"memcpy H2D {max(g['memcpy_h2d_gbps'] for g in doc['gather']):.0f} GB/s")
    if doc.get("transfer"):
        parts.append(f"transfer engine/memcpy >= {min(t['engine_vs_memcpy'] for t in doc['transfer']):.2f}")
    if doc.get("child"):
        parts.append(f"{doc['child']['set']} cases: {doc['child']['note']}")
    if doc.get("errors"):
        parts.append(f"{len(doc['errors'])} errors")
    parts.append(f"{'extension load' if doc.get('prebuilt') else 'build'} {doc.get('build_s', 0):.0f}s")
    return "; ".join(parts)


def bench_summary(doc: dict[str, Any]) -> str:
    """bench/gpu_decode.py's results in one line."""
    rows = doc.get("results", [])
    bad = [r for r in rows if r.get("error")]
    parts = [f"{len(rows) - len(bad)}/{len(rows)} rows timed"]
    for c in doc.get("comparison", []):
        parts.append(f"{c['model']} {c['mode'].split('/')[-1]} {c['speedup']:.2f}x dense")
    hidden = [r["hidden_share"] for r in rows if r.get("hidden_share") is not None]
    if hidden:
        parts.append(f"hidden share {min(hidden):.0%}-{max(hidden):.0%}")
    if bad:
        parts.append(f"first error: {bad[0]['error'][:60]}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    kinds = {"kernels": kernels_summary, "bench": bench_summary}
    p = argparse.ArgumentParser(prog="python -m bench.gpu_results",
                                description="The one-line summary of a GPU check stage's JSON "
                                            "(scripts/gpu_check.sh's table).")
    p.add_argument("kind", choices=list(kinds), help="kernels: kernel_check.json; bench: decode_bench.json")
    p.add_argument("results", type=Path, help="the JSON file")
    args = p.parse_args(argv)
    print(kinds[args.kind](json.loads(args.results.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
