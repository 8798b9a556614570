#!/usr/bin/env python3
"""One-shot GPU check of the lookahead CUDA kernels (the kernel part of the H200 check).

    python scripts/gpu_kernel_check.py --out out/gpu_kernel_check [--no-large]

1. Builds the kernels through ``plugins.cuda.loader`` (a torch extension, cached on disk).
2. Checks every kernel against ``plugins.reference`` on fresh random inputs: fp32, bf16 and fp16,
   outputs poisoned first, plus one case per op with data past 2^31 elements (``--no-large``
   skips those; they need ~16 GB of GPU memory).
3. Measures pinned host->device bandwidth of a plain ``cudaMemcpyAsync`` against the gather
   kernel moving the same bytes as scattered KV blocks (target: gather >= 80% of memcpy), the
   same gather from HBM, and device-to-device copy bandwidth.

Prints a short table last and writes everything to ``<out>/kernel_check.json``. Exits 2 on a
machine without CUDA, 1 if any numerics check fails. About 1-2 minutes on an H200, most of it
the first build.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (num_kv_heads, block_size, head_dim) of one layer's pool, bf16: rows of 2 KB and 4 KB.
GATHER_SHAPES = {"smollm2": (3, 16, 64), "llama8b": (8, 16, 128)}
POOL_BYTES = 1 << 30        # pinned host pool per shape: reads land all over 1 GB
TRANSFER_BYTES = 64 << 20   # bytes moved per timed transfer
COPY_BYTES = 1 << 30        # device-to-device copy
GATHER_TARGET = 0.80        # gather bandwidth / memcpy bandwidth


def time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e6)


def measure_gather(ext, name: str, num_kv_heads: int, block_size: int, head_dim: int) -> dict:
    row_bytes = block_size * head_dim * 2
    num_blocks = POOL_BYTES // (num_kv_heads * row_bytes)
    n = TRANSFER_BYTES // (num_kv_heads * row_bytes)
    # Pinned pages are resident from allocation; their values do not matter for timing.
    pool = torch.empty((num_blocks, num_kv_heads, block_size, head_dim), dtype=torch.bfloat16, pin_memory=True)
    ids = torch.randint(0, num_blocks, (num_kv_heads, n), device="cuda")
    out = torch.empty((num_kv_heads, n, block_size, head_dim), dtype=torch.bfloat16, device="cuda")
    nbytes = out.numel() * out.element_size()
    contiguous = pool.view(-1)[: out.numel()]          # the same bytes, one pinned range

    memcpy_ms = time_ms(lambda: out.view(-1).copy_(contiguous, non_blocking=True))
    gather_ms = time_ms(lambda: ext.block_gather_out(pool, ids, out))
    device_pool = pool.to("cuda")
    hbm_ms = time_ms(lambda: ext.block_gather_out(device_pool, ids, out))
    del device_pool
    return {
        "shape": name, "row_bytes": row_bytes, "bytes": nbytes, "blocks_per_head": n,
        "memcpy_h2d_gbps": gbps(nbytes, memcpy_ms), "gather_host_gbps": gbps(nbytes, gather_ms),
        "gather_hbm_gbps": gbps(nbytes, hbm_ms), "gather_vs_memcpy": memcpy_ms / gather_ms,
    }


def measure_copy() -> dict:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    # Bytes copied per second; the memory moves twice that (read + write).
    return {"bytes": COPY_BYTES, "d2d_copy_gbps": gbps(COPY_BYTES, ms)}


def print_table(report: dict) -> None:
    checks = report["checks"]
    failed = [c for c in checks if not c["ok"]]
    print(f"\nkernel numerics: {len(checks) - len(failed)}/{len(checks)} checks passed "
          f"(build {report['build_s']:.0f} s)")
    by_op: dict[str, list[dict]] = {}
    for c in checks:
        by_op.setdefault(c["op"], []).append(c)
    print(f"  {'op':<22}{'checks':>8}{'worst |err|':>14}")
    for op, rows in by_op.items():
        worst = max(r["max_abs_err"] for r in rows)
        print(f"  {op:<22}{sum(r['ok'] for r in rows):>4}/{len(rows):<3}{worst:>14.3g}")
    for c in failed:
        print(f"  FAILED {c['op']} {c['dtype']} {c['case']}: max |err| {c['max_abs_err']:.3g} {c['detail']}")
    print(f"\n  {'bandwidth, GB/s':<22}{'memcpy H2D':>11}{'gather host':>13}{'ratio':>8}{'gather HBM':>12}")
    for g in report["gather"]:
        label = f"{g['shape']} ({g['row_bytes'] // 1024} KB rows)"
        mark = "" if g["gather_vs_memcpy"] >= GATHER_TARGET else f"  < {GATHER_TARGET:.0%} target"
        print(f"  {label:<22}{g['memcpy_h2d_gbps']:>11.1f}{g['gather_host_gbps']:>13.1f}"
              f"{g['gather_vs_memcpy']:>8.2f}{g['gather_hbm_gbps']:>12.1f}{mark}")
    print(f"  {'device-to-device copy':<22}{report['copy']['d2d_copy_gbps']:>11.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/gpu_kernel_check"),
                        help="directory for kernel_check.json")
    parser.add_argument("--no-large", action="store_true", help="skip the >2^31-element cases (~16 GB)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_kernel_check: no CUDA device (torch.cuda.is_available() is False); "
              "this check runs on the GPU machine only", file=sys.stderr)
        return 2

    t0 = time.perf_counter()   # importing plugins already builds and registers the kernels on a GPU
    from plugins.cuda import loader, numerics

    ext = loader.load_extension()
    loader.register_cuda_kernels()
    build_s = time.perf_counter() - t0
    print(f"built the kernels in {build_s:.1f} s on {torch.cuda.get_device_name()}", flush=True)

    checks = []
    for check in numerics.run_checks(large=not args.no_large):
        checks.append(dataclasses.asdict(check))
        print(f"  {'ok  ' if check.ok else 'FAIL'} {check.op} {check.dtype} {check.case} "
              f"max|err|={check.max_abs_err:.3g} {check.detail}", flush=True)
    report = {
        "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__, "cuda": torch.version.cuda, "build_s": build_s, "checks": checks,
        "gather": [measure_gather(ext, name, *shape) for name, shape in GATHER_SHAPES.items()],
        "copy": measure_copy(), "gather_target": GATHER_TARGET,
    }
    report["targets_met"] = {
        "numerics": all(c["ok"] for c in checks),
        "gather_vs_memcpy": all(g["gather_vs_memcpy"] >= GATHER_TARGET for g in report["gather"]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_check.json").write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"\nwrote {args.out / 'kernel_check.json'}")
    return 0 if report["targets_met"]["numerics"] else 1


if __name__ == "__main__":
    sys.exit(main())
