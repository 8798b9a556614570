"""Build the CUDA kernels as a torch extension and make them the CUDA kernels of `torch.ops.lookahead.*`.

Nothing here runs at import: `plugins.ensure_cuda_kernels()` calls `register_cuda_kernels()` once
per process, where an engine selects its ops for a CUDA device (`runtime.ops.select_ops`) or the
CUDA transfer engine starts, and only when `torch.cuda.is_available()`. Importing this module
touches no CUDA API and compiles nothing.

The extension is built from the same `.cu` files as `scripts/compile_kernels.sh` and the
TensorRT plugins, with `torch.utils.cpp_extension.load`, cached on disk (`$LOOKAHEAD_CUDA_BUILD_DIR`,
default `build/torch_ext/` in the repository): the first process on a machine pays the compile
(15-25 s on 16 cores), later ones a ninja no-op. The C++ standard is torch's own (its
`cpp_extension` default, e.g. C++20 in torch 2.13: newer headers need it), never forced here.

Building ahead (what `scripts/gpu_check.sh` does as the first step of its kernels stage)::

    python -m plugins.cuda.loader build [--dry-run]

removes a stale lock (`build/torch_ext/lock`, which torch <= 2.13 leaves behind when a build is
killed, and on which every later build then waits forever), builds, and records the module's
path in `prebuilt.json`. With `LOOKAHEAD_CUDA_PREBUILT=1` a process imports that module directly
(no ninja, no lock, no compile) and, when there is none, fails at once (the torch implementations
then serve CUDA tensors) instead of compiling in the middle of a timed stage.

Pinned host memory. The transfer engine reads blocks straight from the host KV pool with::

    out = torch.ops.lookahead.block_gather(host_pool, block_ids)   # host_pool: pinned CPU tensor
                                                                    # block_ids: int64 on the GPU

The dispatcher picks the CUDA kernel because one argument (``block_ids``) is a CUDA tensor; the
kernel reads the pool through its device-mapped (UVA) address with 16-byte loads, on the current
stream, and returns ``out`` on ``block_ids``' device. The host pool must be contiguous and pinned
(``pin_memory()``, ``torch.empty(..., pin_memory=True)`` or ``cudaHostRegister``). The public wrapper
``plugins.block_gather`` checks that src and block_ids share a device, so this mixed-device call
goes through ``torch.ops`` directly (the runtime's transfer engine is its one caller). An id of
-1 gives a zero row and reads nothing (the fixed-capacity lists' unused entries).

Dtypes. The kernels read one dtype per call (the bindings refuse anything else). The wrappers
here take the KV-storage pairs of plugins/CONTRACTS.md (16-bit K/V under fp32 queries, 16-bit
keys into fp32 summaries) and widen the 16-bit inputs first (a copy).
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

KERNEL_DIR = Path(__file__).resolve().parent
SOURCES = ("block_gather.cu", "block_topk.cu", "update_summaries.cu", "lookahead_attention.cu", "plan_slots.cu",
           "copy_blocks.cu", "torch_bindings.cpp")
EXTENSION_NAME = "lookahead_kv_cuda"
# As in scripts/compile_kernels.sh, less its -std: torch adds its own C++ standard (the one its
# headers need), the arch of the visible GPU (or TORCH_CUDA_ARCH_LIST) and its
# no-implicit-half-conversion defines.
CUDA_FLAGS = ("-O3",)
CXX_FLAGS = ("-O3",)
# Head dims the attention kernel is instantiated for; others use the torch implementation.
ATTENTION_HEAD_DIMS = (64, 128, 256)
PREBUILT_ENV = "LOOKAHEAD_CUDA_PREBUILT"
PREBUILT_FILE = "prebuilt.json"
# A lock older than this is a killed build's (a real one takes well under a minute on the GPU
# machine); load_extension removes it rather than wait on it forever.
STALE_LOCK_S = 900


def build_dir() -> Path:
    """Where the extension is built and cached: `$LOOKAHEAD_CUDA_BUILD_DIR` or `<repo>/build/torch_ext`."""
    return Path(os.environ.get("LOOKAHEAD_CUDA_BUILD_DIR", KERNEL_DIR.parents[1] / "build" / "torch_ext"))


def lock_path() -> Path:
    """torch.utils.cpp_extension's build lock (a FileBaton) in the build directory."""
    return build_dir() / "lock"


def clear_stale_lock(max_age_s: float | None = STALE_LOCK_S) -> bool:
    """Remove the build lock when it is older than `max_age_s` (None: whatever its age, for a caller
    that knows no build runs). True when one was removed."""
    lock = lock_path()
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if max_age_s is not None and age < max_age_s:
        return False
    try:
        lock.unlink()
    except FileNotFoundError:
        return False
    print(f"plugins.cuda.loader: removed a stale build lock {lock} ({age:.0f} s old)", file=sys.stderr)
    return True


def _import_prebuilt():
    """The module `build` recorded in prebuilt.json, imported from its file (no ninja, no lock)."""
    record = build_dir() / PREBUILT_FILE
    try:
        path = Path(json.loads(record.read_text())["module"])
    except (FileNotFoundError, KeyError, json.JSONDecodeError) as e:
        raise FileNotFoundError(f"{PREBUILT_ENV}=1 but no prebuilt extension is recorded in {record} ({e}); "
                                "run python -m plugins.cuda.loader build") from None
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the prebuilt extension {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile():
    from torch.utils import cpp_extension

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    clear_stale_lock()
    module = cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(KERNEL_DIR / s) for s in SOURCES],
        extra_include_paths=[str(KERNEL_DIR)],
        extra_cflags=list(CXX_FLAGS),
        extra_cuda_cflags=list(CUDA_FLAGS),
        build_directory=str(out),
        verbose=False,
    )
    tmp = out / f".{PREBUILT_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"module": str(Path(module.__file__).resolve()), "torch": torch.__version__}))
    os.replace(tmp, out / PREBUILT_FILE)
    return module


@functools.cache
def load_extension():
    """The compiled extension module: the prebuilt one under `LOOKAHEAD_CUDA_PREBUILT=1`, else built
    on the first call of a process (from the on-disk cache after)."""
    if os.environ.get(PREBUILT_ENV) == "1":
        return _import_prebuilt()
    return _compile()


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, contiguous with a 16-byte-aligned start (the attention kernel moves K/V in 16-byte vectors)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


KV_STORAGE = (torch.float16, torch.bfloat16)       # stored under fp32 queries / summaries (CONTRACTS.md)


def _widened(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`: the KV-storage pairs widened (a copy); any other mismatch is the binding's to refuse."""
    return t.to(dtype) if t.dtype != dtype and dtype == torch.float32 and t.dtype in KV_STORAGE else t


def _summary_rows(t: torch.Tensor) -> bool:
    """A [B, NB, KVH, D] summary view the top-K kernel reads in place: any batch stride, the rest dense."""
    b, nb, kvh, d = t.shape
    return (t.stride(3) == 1 and (kvh == 1 or t.stride(2) == d) and (nb == 1 or t.stride(1) == kvh * d)
            and (b <= 1 or t.stride(0) >= nb * kvh * d))


def _block_gather(src: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    device = block_ids.device if block_ids.is_cuda else src.device
    num_kv_heads, n = block_ids.shape
    out = torch.empty((num_kv_heads, n, src.shape[2], src.shape[3]), dtype=src.dtype, device=device)
    # A host src must stay as it is (a .contiguous() copy would not be pinned); the kernel checks.
    src = src if not src.is_cuda else src.contiguous()
    load_extension().block_gather_out(src, block_ids.to(device).contiguous(), out)
    return out


def _block_topk(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, valid: torch.Tensor,
                k: int, group_score: str = "sum") -> tuple[torch.Tensor, torch.Tensor]:
    B, num_blocks, num_kv_heads, _ = kmin.shape
    lead = tuple(q.shape[:-2])                   # (B,) or (B, R): R rows per sequence, one launch
    if q.dim() == 4:
        q, valid = q.reshape(-1, *q.shape[2:]), valid.reshape(-1, num_blocks)
    indices = torch.empty((q.shape[0], num_kv_heads, k), dtype=torch.int64, device=q.device)
    scores = torch.empty((q.shape[0], num_kv_heads, num_blocks), dtype=torch.float32, device=q.device)
    # The summaries are read where they lie (a [:lanes, :blocks] view of the runtime's tables has a
    # batch stride of its own): a copy only for a layout the kernel cannot stride through.
    if not (_summary_rows(kmin) and kmin.stride() == kmax.stride()):
        kmin, kmax = kmin.contiguous(), kmax.contiguous()
    load_extension().block_topk_out(q.contiguous(), kmin, kmax, valid.contiguous(),
                                    k, group_score == "max", indices, scores)
    return indices.view(*lead, num_kv_heads, k), scores.view(*lead, num_kv_heads, num_blocks)


def _update_summaries(kmin: torch.Tensor, kmax: torch.Tensor, keys: torch.Tensor, block_ids: torch.Tensor,
                      block_offsets: torch.Tensor) -> None:
    if not (kmin.is_contiguous() and kmax.is_contiguous()):
        # In place on a strided view: fold into dense copies, then write them back.
        dense_min, dense_max = kmin.contiguous(), kmax.contiguous()
        _update_summaries(dense_min, dense_max, keys, block_ids, block_offsets)
        kmin.copy_(dense_min)
        kmax.copy_(dense_max)
        return
    load_extension().update_summaries(kmin, kmax, _widened(keys, kmin.dtype).contiguous(), block_ids.contiguous(),
                                      block_offsets.contiguous())


def _lookahead_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_mask: torch.Tensor,
                         k_extra: torch.Tensor, v_extra: torch.Tensor, extra_mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    if q.shape[-1] not in ATTENTION_HEAD_DIMS:  # e.g. the tiny test models (head_dim 16)
        from ..attention import _lookahead_attention_impl
        return _lookahead_attention_impl(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale)
    q = q.contiguous()
    k, v, k_extra, v_extra = (_widened(t, q.dtype) for t in (k, v, k_extra, v_extra))
    out = torch.empty_like(q)
    load_extension().lookahead_attention_out(q, _aligned(k), _aligned(v), kv_mask.contiguous(), _aligned(k_extra),
                                             _aligned(v_extra), extra_mask.contiguous(), float(scale), out)
    return out


def _plan_slots(block: torch.Tensor, last_used: torch.Tensor, slot_of: torch.Tensor, lanes: torch.Tensor,
                want: torch.Tensor, scores: torch.Tensor, cap: int,
                step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ..plan import admit_per_head

    n = want.shape[0] * want.shape[1] * admit_per_head(cap, want.shape[-1], block.shape[-1])
    slots, blocks = (torch.empty(n, dtype=torch.int64, device=block.device) for _ in range(2))
    valid = torch.empty(n, dtype=torch.bool, device=block.device)
    # the tables are written in place: a strided view cannot be made contiguous here (the binding refuses it)
    load_extension().plan_slots_out(block, last_used, slot_of, lanes.contiguous(), want.contiguous(),
                                    scores.contiguous(), int(cap), int(step), slots, blocks, valid)
    return slots, blocks, valid


def _copy_blocks(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                 blocks: torch.Tensor, src_heads: torch.Tensor, lanes: torch.Tensor, dst_heads: torch.Tensor,
                 slots: torch.Tensor, valid: torch.Tensor | None) -> None:
    # the host pool is read where it is (pinned: the kernel maps it); the indices go where the kernel reads them
    device = dst_k.device
    index = [t.to(device, non_blocking=True).contiguous() for t in (blocks, src_heads, lanes, dst_heads, slots)]
    if valid is not None:
        valid = valid.to(device, non_blocking=True).contiguous()
    load_extension().copy_blocks(src_k, src_v, dst_k, dst_v, *index, valid)


KERNELS = {
    "block_gather": _block_gather,
    "block_topk": _block_topk,
    "update_summaries": _update_summaries,
    "lookahead_attention": _lookahead_attention,
    "plan_slots": _plan_slots,
    "copy_blocks": _copy_blocks,
}


@functools.cache
def register_cuda_kernels() -> None:
    """Build (or import the prebuilt) extension and register its kernels for the CUDA dispatch key.

    Call only where ``torch.cuda.is_available()``; the ops must already be defined (importing
    ``plugins`` defines them). Idempotent: later calls return at once.
    """
    load_extension()
    for name, fn in KERNELS.items():
        torch.library.register_kernel(f"lookahead::{name}", "cuda", fn)


# ---- building ahead: python -m plugins.cuda.loader build ----------------------------------------------
def build(dry_run: bool = False) -> int:
    """The kernels stage's first step: remove a stale lock (no other build runs: the caller says
    so), drop the old prebuilt record, build, record the module. 0 when built (dry run: when the
    plan is printed), 1 when the build failed, 2 without a CUDA build of torch and a GPU."""
    from torch.utils import cpp_extension

    out = build_dir()
    print(f"build dir {out}; sources {', '.join(SOURCES)}")
    print(f"flags: cxx {list(CXX_FLAGS)}, nvcc {list(CUDA_FLAGS)} (+ torch's own: its C++ standard, "
          f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', 'the visible GPU')}); "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}, CUDA_HOME {cpp_extension.CUDA_HOME}")
    removed = clear_stale_lock(max_age_s=None)
    print("stale lock: " + (f"removed {lock_path()}" if removed else "none"))
    if dry_run:
        print("dry run: nothing compiled")
        return 0
    if torch.version.cuda is None or not torch.cuda.is_available():
        print(f"no CUDA build of torch with a visible GPU here (torch {torch.__version__}): nothing to build",
              file=sys.stderr)
        return 2
    (out / PREBUILT_FILE).unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        module = _compile()
    except Exception as e:  # noqa: BLE001 - the compiler's message is the result
        print(f"build failed after {time.perf_counter() - t0:.1f} s: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"built {module.__file__} in {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m plugins.cuda.loader", description=build.__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["build"])
    p.add_argument("--dry-run", action="store_true", help="remove a stale lock and print the plan; compile nothing")
    args = p.parse_args(argv)
    return build(dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
