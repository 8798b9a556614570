"""One-shot check of the lookahead CUDA kernels (the kernel part of the H200 check).

    python -m bench.gpu_kernels --out out/gpu_kernels [--no-large]
    python -m bench.gpu_kernels --device cpu --out /tmp/k     # CPU smoke: the same machinery

1. Loads the kernels through ``plugins.cuda.loader`` (the torch extension: in scripts/gpu_check.sh
   built by the kbuild step before this runs, and imported here with ``LOOKAHEAD_CUDA_PREBUILT=1``,
   no compile; run alone, built on first use and cached on disk) and registers them for the CUDA
   dispatch key of ``torch.ops.lookahead.*``.
2. Checks every kernel against ``plugins.reference`` on fresh random inputs (fp32, bf16, fp16,
   outputs poisoned first; ``bench/cuda_numerics.py``) through three doors: the extension's
   entry points (``ext``), ``torch.ops.lookahead.*`` as the runtime calls them (``dispatch``:
   the loader's wrappers and the dispatcher) and the validating public wrappers ``plugins.<op>``
   (``wrappers``).
3. Bandwidth: pinned host->device ``cudaMemcpyAsync`` against the gather kernel moving the same
   bytes as scattered KV blocks (target: gather >= 80% of memcpy), the same gather from HBM, the
   runtime's CUDA transfer engine moving a CopyJob of that size, and a device-to-device copy.
4. The cases with data past 2^31 elements (``--no-large`` skips them; they need ~16 GB) run in a
   child process of this script with a timeout, so a sticky CUDA fault or a hang there cannot
   take the other results with it.

Every check is appended to ``<out>/kernel_check.json`` as soon as it has run (bench/gpu_results.py;
the child appends to the same file), and a short table is printed last. Exits 2 without CUDA
(unless ``--device cpu``), 1 if any numerics check fails.

kernel_check.json: device, capability, torch, cuda, build_s (the load; or build_error), build_dir, prebuilt,
cuda_kernels_registered {op: bool}; `checks` (target = ext | dispatch | wrappers | cpu-smoke, set =
small | large | smoke, op, dtype, case, ok, max_abs_err, detail, seconds), `skipped` (not
applicable, with the reason); `gather` (per shape: memcpy_h2d_gbps, gather_host_gbps,
gather_hbm_gbps, gather_vs_memcpy), `transfer` (per shape: the transfer engine's engine_gbps and
engine_vs_memcpy), `copy` (d2d), `child` (set, rc, note, seconds), `errors`, `targets_met`.

``--device cpu`` (gpu_check.sh --dry-run) runs the same code on CPU against the torch
implementations behind ``torch.ops.lookahead`` (no extension: it needs a CUDA torch), with one
dtype, small bandwidth tensors and a small case set in the child. The attention checks put NaN in
hidden keys, which the CUDA kernel must ignore but the torch implementation's contract excludes
(finite padding), so on CPU attention is checked through its reference only (a smoke of the
machinery, not of numerics).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.floor import StreamClock
from bench.gpu_results import ResultFile

RESULTS = "kernel_check.json"
OPS = ("block_gather", "block_topk", "update_summaries", "lookahead_attention", "plan_slots", "copy_blocks")
# (num_kv_heads, block_size, head_dim) of one layer's pool, bf16: rows of 2 KB and 4 KB.
GATHER_SHAPES = {"smollm2": (3, 16, 64), "llama8b": (8, 16, 128)}
GATHER_TARGET = 0.80        # gather bandwidth / memcpy bandwidth
# case sets of the child process: the large-index cases (GPU), one small case per op (CPU smoke)
CHILD_SETS = ("large", "smoke")


# ---- the three doors ---------------------------------------------------------------------------------
def as_rows(q: torch.Tensor, kmin: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The extension's block_topk takes R query rows per sequence flat ([B * R, H, D], valid
    [B * R, NB]); the op takes them as [B, R, H, D], [B, R, NB]."""
    B = kmin.shape[0]
    if q.shape[0] == B:
        return q, valid
    return q.view(B, -1, *q.shape[1:]), valid.view(B, -1, valid.shape[-1])


class DispatchEntryPoints:
    """The extension's entry points, written as the runtime calls the ops: `torch.ops.lookahead.*`
    (on a GPU the CUDA dispatch key, i.e. plugins/cuda/loader.py's wrappers around the kernels)."""

    @staticmethod
    def block_gather_out(src, block_ids, out):
        out.copy_(torch.ops.lookahead.block_gather(src, block_ids))

    @staticmethod
    def block_topk_out(q, kmin, kmax, valid, k, group_max, indices, scores):
        q, valid = as_rows(q, kmin, valid)
        got_i, got_s = torch.ops.lookahead.block_topk(q, kmin, kmax, valid, k, "max" if group_max else "sum")
        indices.copy_(got_i.view(indices.shape))
        scores.copy_(got_s.view(scores.shape))

    @staticmethod
    def update_summaries(kmin, kmax, keys, block_ids, block_offsets):
        torch.ops.lookahead.update_summaries(kmin, kmax, keys, block_ids, block_offsets)

    @staticmethod
    def lookahead_attention_out(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale, out):
        out.copy_(torch.ops.lookahead.lookahead_attention(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale))

    @staticmethod
    def copy_blocks(*args):
        torch.ops.lookahead.copy_blocks(*args)

    @staticmethod
    def plan_slots_out(block, last_used, slot_of, lanes, want, scores, cap, step, slots, blocks, valid):
        for out, got in zip((slots, blocks, valid), torch.ops.lookahead.plan_slots(block, last_used, slot_of, lanes,
                                                                                   want, scores, cap, step)):
            out.copy_(got)


class WrapperEntryPoints:
    """The same through the public, validating wrappers `plugins.<op>`."""

    @staticmethod
    def block_gather_out(src, block_ids, out):
        import plugins
        out.copy_(plugins.block_gather(src, block_ids))

    @staticmethod
    def block_topk_out(q, kmin, kmax, valid, k, group_max, indices, scores):
        import plugins
        q, valid = as_rows(q, kmin, valid)
        got_i, got_s = plugins.block_topk(q, kmin, kmax, valid, k, "max" if group_max else "sum")
        indices.copy_(got_i.view(indices.shape))
        scores.copy_(got_s.view(scores.shape))

    @staticmethod
    def update_summaries(kmin, kmax, keys, block_ids, block_offsets):
        import plugins
        plugins.update_summaries(kmin, kmax, keys, block_ids, block_offsets)

    @staticmethod
    def lookahead_attention_out(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale, out):
        import plugins
        out.copy_(plugins.lookahead_attention(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale))

    @staticmethod
    def copy_blocks(*args):
        import plugins
        plugins.copy_blocks(*args)

    @staticmethod
    def plan_slots_out(block, last_used, slot_of, lanes, want, scores, cap, step, slots, blocks, valid):
        import plugins
        for out, got in zip((slots, blocks, valid), plugins.plan_slots(block, last_used, slot_of, lanes, want,
                                                                       scores, cap, step)):
            out.copy_(got)


class CpuSmokeEntryPoints(DispatchEntryPoints):
    """CPU: torch.ops for three ops; attention through its reference (module docstring)."""

    @staticmethod
    def lookahead_attention_out(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale, out):
        from plugins.reference import lookahead_attention_ref
        out.copy_(lookahead_attention_ref(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale))


# (target, op, case) that cannot run: the reason
NOT_APPLICABLE = {
    ("wrappers", "copy_blocks", "host"): "plugins.copy_blocks takes the indices on the host pool's device; the "
                                         "transfer engine's mixed-device call goes through torch.ops, checked "
                                         "by the dispatch target",
    ("wrappers", "block_gather", "host"): "plugins.block_gather takes src and block_ids on one device; the "
                                          "mixed-device call (pinned host pool, ids on the GPU) goes through "
                                          "torch.ops, checked by the dispatch target",
}


def op_of(fn) -> str:
    return fn.__name__.removeprefix("check_")


def targets(device: torch.device) -> list[tuple[str, object]]:
    from bench import cuda_numerics as numerics
    if device.type == "cuda":
        return [("ext", numerics.cuda_target()), ("dispatch", numerics.Target("cuda", DispatchEntryPoints())),
                ("wrappers", numerics.Target("cuda", WrapperEntryPoints()))]
    return [("cpu-smoke", numerics.Target("cpu", CpuSmokeEntryPoints()))]


def plan(case_set: str, device: torch.device) -> list[tuple]:
    """(fn, dtype, case) of a case set: "small" (every small case, every dtype; bf16 only on CPU),
    "large" (one >2^31-element case per op that has one, bf16) or "smoke" (one small case per op, bf16)."""
    from bench import cuda_numerics as numerics
    if case_set == "large":
        return [(fn, torch.bfloat16, "large") for fn in numerics.LARGE_CASES]
    if case_set == "smoke":
        return [(fn, torch.bfloat16, cases[0]) for fn, cases in numerics.SMALL_CASES.items()]
    dtypes = numerics.DTYPES if device.type == "cuda" else (torch.bfloat16,)
    return [(fn, dtype, case) for dtype in dtypes for fn, cases in numerics.SMALL_CASES.items() for case in cases]


def run_checks(case_set: str, device: torch.device, results: ResultFile, doors: list[tuple[str, object]]) -> int:
    """Run a case set through each door, appending every check to the results as it completes.
    An exception is a failed check (one broken kernel does not hide the others). Returns failures."""
    from bench import cuda_numerics as numerics
    failed = 0
    for door, target in doors:
        for fn, dtype, case in plan(case_set, device):
            name = str(dtype).removeprefix("torch.")
            skip = NOT_APPLICABLE.get((door, op_of(fn), case))
            if skip:
                results.append("skipped", {"target": door, "op": op_of(fn), "dtype": name, "case": case,
                                           "reason": skip})
                continue
            t0 = time.perf_counter()
            try:
                got = fn(dtype, case, target)
                checks = got if isinstance(got, list) else [got]
            except Exception as e:  # noqa: BLE001 - reported, not swallowed
                checks = [numerics.Check(op_of(fn), name, case, False, float("nan"), f"{type(e).__name__}: {e}"[:400])]
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()     # the large cases need their gigabytes back
            for c in checks:
                row = {"target": door, "set": case_set, "op": c.op, "dtype": c.dtype, "case": c.case, "ok": c.ok,
                       "max_abs_err": c.max_abs_err, "detail": c.detail, "seconds": round(time.perf_counter() - t0, 3)}
                results.append("checks", row)
                failed += not c.ok
                print(f"  {'ok  ' if c.ok else 'FAIL'} {door:<9} {c.op} {c.dtype} {c.case} "
                      f"max|err|={c.max_abs_err:.3g} {c.detail}", flush=True)
    return failed


# ---- bandwidth ---------------------------------------------------------------------------------------
def time_ms(fn, clock: StreamClock, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() on the compute stream (CUDA events; perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    clock.sync()
    times = []
    for _ in range(iters):
        a = clock.mark()
        fn()
        times.append(1e3 * clock.seconds(a, clock.mark()))
    return statistics.median(times)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e6)


def measure_gather(ext, name: str, num_kv_heads: int, block_size: int, head_dim: int, pool_bytes: int,
                   transfer_bytes: int, device: torch.device) -> dict:
    clock, cuda = StreamClock(device), device.type == "cuda"
    row_bytes = block_size * head_dim * 2
    num_blocks = pool_bytes // (num_kv_heads * row_bytes)
    n = max(1, transfer_bytes // (num_kv_heads * row_bytes))
    # Pinned pages are resident from allocation; their values do not matter for timing.
    pool = torch.empty((num_blocks, num_kv_heads, block_size, head_dim), dtype=torch.bfloat16, pin_memory=cuda)
    ids = torch.randint(0, num_blocks, (num_kv_heads, n), device=device)
    out = torch.empty((num_kv_heads, n, block_size, head_dim), dtype=torch.bfloat16, device=device)
    nbytes = out.numel() * out.element_size()
    contiguous = pool.view(-1)[: out.numel()]          # the same bytes, one pinned range
    memcpy_ms = time_ms(lambda: out.view(-1).copy_(contiguous, non_blocking=True), clock)
    gather_ms = time_ms(lambda: ext.block_gather_out(pool, ids, out), clock)
    device_pool = pool.to(device)
    hbm_ms = time_ms(lambda: ext.block_gather_out(device_pool, ids, out), clock)
    return {"shape": name, "row_bytes": row_bytes, "bytes": nbytes, "blocks_per_head": n,
            "memcpy_h2d_gbps": gbps(nbytes, memcpy_ms), "gather_host_gbps": gbps(nbytes, gather_ms),
            "gather_hbm_gbps": gbps(nbytes, hbm_ms), "gather_vs_memcpy": memcpy_ms / gather_ms}


def measure_transfer_engine(name: str, num_kv_heads: int, block_size: int, head_dim: int, pool_bytes: int,
                            transfer_bytes: int, device: torch.device) -> dict:
    """The runtime's transfer engine (CUDA streams; on CPU the inline engine) moving one CopyJob of
    `transfer_bytes` (K and V) from a head-major pinned pool view into device slots, as the
    lookahead backend submits them (device index tensors), against a memcpy of the same bytes."""
    from runtime.transfer import CopyJob, make_transfer_engine
    clock, cuda = StreamClock(device), device.type == "cuda"
    eng = make_transfer_engine("cuda" if cuda else "sync")
    try:
        unit = block_size * head_dim * 2                   # one (block, head) of K, bf16
        num_blocks = pool_bytes // (2 * num_kv_heads * unit)
        per_head = max(1, transfer_bytes // (2 * num_kv_heads * unit))
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        pool_k = torch.empty(shape, dtype=torch.bfloat16, pin_memory=cuda)
        pool_v = torch.empty(shape, dtype=torch.bfloat16, pin_memory=cuda)
        dst = (1, num_kv_heads, per_head, block_size, head_dim)
        dst_k = torch.empty(dst, dtype=torch.bfloat16, device=device)
        dst_v = torch.empty(dst, dtype=torch.bfloat16, device=device)
        heads = torch.arange(num_kv_heads, device=device).repeat_interleave(per_head)
        slots = torch.arange(per_head, device=device).repeat(num_kv_heads)
        blocks = torch.randint(0, num_blocks, (heads.numel(),), device=device)
        # the engine's copy kernel, as a residency manager hands it (on a CPU: the C memcpy)
        from runtime.ops import select_ops
        kernel = select_ops(torch.device(device), torch.bfloat16).copy_blocks
        job = CopyJob(pool_k.transpose(0, 1), pool_v.transpose(0, 1), dst_k, dst_v, (blocks, heads),
                      (torch.zeros_like(heads), heads, slots), tag=("kernel_check",), kernel=kernel)
        nbytes = job.nbytes
        engine_ms = time_ms(lambda: eng.wait(eng.submit(job)), clock)
        flat = pool_k.view(-1)[: nbytes // 4], pool_v.view(-1)[: nbytes // 4]

        def memcpy() -> None:
            dst_k.view(-1)[: flat[0].numel()].copy_(flat[0], non_blocking=True)
            dst_v.view(-1)[: flat[1].numel()].copy_(flat[1], non_blocking=True)

        memcpy_ms = time_ms(memcpy, clock)
        return {"shape": name, "engine": type(eng).__name__, "bytes": nbytes, "units": job.num_units,
                "copy_kernel": getattr(eng, "copy_kernel", None), "engine_gbps": gbps(nbytes, engine_ms),
                "memcpy_h2d_gbps": gbps(nbytes, memcpy_ms), "engine_vs_memcpy": memcpy_ms / engine_ms}
    finally:
        eng.close()


def measure_copy(nbytes: int, device: torch.device) -> dict:
    clock = StreamClock(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), clock)
    # Bytes copied per second; the memory moves twice that (read + write).
    return {"bytes": nbytes, "d2d_copy_gbps": gbps(nbytes, ms), "d2d_read_write_gbps": 2 * gbps(nbytes, ms)}


# ---- the child process ---------------------------------------------------------------------------------
def run_child(args, results: ResultFile, device: torch.device) -> int:
    import plugins  # noqa: F401  (defines the ops; the ext door loads the extension itself)
    from bench import cuda_numerics as numerics
    doors = [("ext", numerics.cuda_target())] if device.type == "cuda" else targets(device)
    return 1 if run_checks(args.child, device, results, doors) else 0


def spawn_child(case_set: str, args, results: ResultFile) -> dict:
    """This script as a child process running one case set; its checks land in the same JSON."""
    argv = [sys.executable, "-m", "bench.gpu_kernels", "--child", case_set, "--out", str(args.out),
            "--device", args.device]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, timeout=args.child_timeout)
        rc, note = proc.returncode, ("ok" if proc.returncode == 0 else
                                     f"exit status {proc.returncode}" if proc.returncode > 0 else
                                     f"killed by signal {-proc.returncode}")
    except subprocess.TimeoutExpired:
        rc, note = 124, f"timed out after {args.child_timeout}s"
    info = {"set": case_set, "rc": rc, "note": note, "seconds": round(time.perf_counter() - t0, 1)}
    results.update(child=info)
    return info


# ---- report ----------------------------------------------------------------------------------------------
def summarize(doc: dict) -> dict:
    checks = doc.get("checks", [])
    met = {"numerics": bool(checks) and all(c["ok"] for c in checks)}
    if doc.get("gather"):
        met["gather_vs_memcpy"] = all(g["gather_vs_memcpy"] >= GATHER_TARGET for g in doc["gather"])
    child = doc.get("child")
    if child:
        met["child_" + child["set"]] = child["rc"] == 0
    return met


def print_table(doc: dict) -> None:
    checks = doc.get("checks", [])
    failed = [c for c in checks if not c["ok"]]
    print(f"\nkernel numerics on {doc.get('device')}: {len(checks) - len(failed)}/{len(checks)} checks passed "
          f"(build {doc.get('build_s', 0):.0f} s)")
    by: dict[tuple, list[dict]] = {}
    for c in checks:
        by.setdefault((c["target"], c["op"]), []).append(c)
    print(f"  {'door':<10}{'op':<22}{'checks':>8}{'worst |err|':>14}")
    for (door, op), rows in by.items():
        worst = max(r["max_abs_err"] for r in rows)
        print(f"  {door:<10}{op:<22}{sum(r['ok'] for r in rows):>4}/{len(rows):<3}{worst:>14.3g}")
    for c in failed:
        print(f"  FAILED {c['target']} {c['op']} {c['dtype']} {c['case']}: max |err| {c['max_abs_err']:.3g} "
              f"{c['detail']}")
    for s in doc.get("skipped", []):
        print(f"  not applicable: {s['target']} {s['op']} {s['case']} ({s['reason'][:90]})")
    if doc.get("child"):
        c = doc["child"]
        print(f"  child process ({c['set']} cases): {c['note']} in {c['seconds']} s")
    if doc.get("gather"):
        print(f"\n  {'bandwidth, GB/s':<22}{'memcpy H2D':>11}{'gather host':>13}{'ratio':>8}{'gather HBM':>12}")
        for g in doc["gather"]:
            label = f"{g['shape']} ({g['row_bytes'] // 1024} KB rows)"
            mark = "" if g["gather_vs_memcpy"] >= GATHER_TARGET else f"  < {GATHER_TARGET:.0%} target"
            print(f"  {label:<22}{g['memcpy_h2d_gbps']:>11.1f}{g['gather_host_gbps']:>13.1f}"
                  f"{g['gather_vs_memcpy']:>8.2f}{g['gather_hbm_gbps']:>12.1f}{mark}")
    for t in doc.get("transfer", []):
        print(f"  {t['shape'] + ' ' + t['engine']:<34}{t['engine_gbps']:>9.1f} GB/s "
              f"= {t['engine_vs_memcpy']:.2f}x memcpy")
    if doc.get("copy"):
        print(f"  {'device-to-device copy':<22}{doc['copy']['d2d_copy_gbps']:>11.1f} (bytes copied per second)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/gpu_kernels"), help=f"directory for {RESULTS}")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda (the check), or cpu (a smoke run of the same code against the torch ops)")
    parser.add_argument("--no-large", action="store_true", help="skip the >2^31-element cases (~16 GB)")
    parser.add_argument("--child-timeout", type=int, default=90, help="seconds for the child process's cases")
    parser.add_argument("--pool-mib", type=int, default=None,
                        help="bandwidth: pinned pool per shape (default 1024; CPU 32)")
    parser.add_argument("--transfer-mib", type=int, default=None,
                        help="bandwidth: bytes per transfer (default 64; CPU 4)")
    parser.add_argument("--child", choices=CHILD_SETS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device (torch.cuda.is_available() is False); this check runs on the GPU "
              "machine (use --device cpu for the smoke run)", file=sys.stderr)
        return 2
    cuda = device.type == "cuda"
    pool = (args.pool_mib or (1024 if cuda else 32)) << 20
    transfer = (args.transfer_mib or (64 if cuda else 4)) << 20
    out = args.out / RESULTS
    if args.child:
        return run_child(args, ResultFile(out), device)

    results = ResultFile(out, fresh=True)
    results.update(device=torch.cuda.get_device_name() if cuda else "cpu",
                   capability=list(torch.cuda.get_device_capability()) if cuda else None,
                   torch=torch.__version__, cuda=torch.version.cuda, gather_target=GATHER_TARGET, checks=[])
    from plugins.cpu import loader as cpu_loader     # the CPU transfer path's C copy: built before any timing
    cpu_loader.library()
    t0 = time.perf_counter()
    import plugins  # noqa: F401  (defines the ops; compiles nothing)
    from plugins.cuda import loader
    if cuda:
        try:
            ext = loader.load_extension()
            loader.register_cuda_kernels()
        except Exception as e:  # noqa: BLE001 - the build log is the one thing worth keeping here
            results.update(build_s=time.perf_counter() - t0, build_error=f"{type(e).__name__}: {e}"[-4000:],
                           build_dir=str(loader.build_dir()), targets_met={"numerics": False})
            print(f"gpu_kernels: the extension did not build: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    else:
        ext = DispatchEntryPoints()
    registered = {op: torch._C._dispatch_has_kernel_for_dispatch_key(f"lookahead::{op}", "CUDA") for op in OPS}
    prebuilt = os.environ.get(loader.PREBUILT_ENV) == "1"
    results.update(build_s=time.perf_counter() - t0, cuda_kernels_registered=registered,
                   build_dir=str(loader.build_dir()), prebuilt=prebuilt)
    what = ("loaded the prebuilt kernels" if prebuilt else "built the kernels") if cuda else \
        "no CUDA build on CPU; ops loaded"
    print(f"{what} in {time.perf_counter() - t0:.1f} s "
          f"on {torch.cuda.get_device_name() if cuda else 'cpu'}; CUDA kernels registered: {registered}", flush=True)

    run_checks("small", device, results, targets(device))
    for name, shape in GATHER_SHAPES.items():
        try:
            results.append("gather", measure_gather(ext, name, *shape, pool, transfer, device))
        except Exception as e:  # noqa: BLE001
            results.append("errors", {"part": f"gather {name}", "error": f"{type(e).__name__}: {e}"[:400]})
        try:
            results.append("transfer", measure_transfer_engine(name, *shape, pool, transfer, device))
        except Exception as e:  # noqa: BLE001
            results.append("errors", {"part": f"transfer engine {name}", "error": f"{type(e).__name__}: {e}"[:400]})
        if cuda:
            torch.cuda.empty_cache()
    results.update(copy=measure_copy(pool, device))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if not (cuda and args.no_large):
        spawn_child("large" if cuda else "smoke", args, results)
    doc = results.load()
    met = summarize(doc)
    doc = results.update(targets_met=met)
    print_table(doc)
    for e in doc.get("errors", []):
        print(f"  ERROR {e['part']}: {e['error']}")
    print(f"\nwrote {out}")
    return 0 if met["numerics"] and not doc.get("errors") and all(met.get(k, True) for k in met if
                                                                   k.startswith("child_")) else 1


if __name__ == "__main__":
    sys.exit(main())
