"""Build plugins/cpu/*.c with the machine's C compiler on first use and bind it with ctypes.

The library lands in build/cpu/ (git-ignored), named by a hash of the source and flags, so an
edited kernel is rebuilt and a stale one never loaded. It needs AVX2, FMA and F16C (x86-64
since 2013); without them or a compiler `library()` returns None with the reason in
`unavailable_reason()`, and an engine's kernel table is the torch one (runtime/ops.py; `impl="torch"`
chooses it anyway). The library is built and loaded where a table is chosen (an engine's start).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name)
           for name in ("linear.c", "linear_int8.c", "attention.c", "topk.c", "residency.c", "elementwise.c",
                        "decode.c", "lookahead_layer.c", "summaries.c", "prefill_attention.c", "gemm.c")]
HEADERS = [Path(__file__).with_name("common.h")]
BUILD_DIR = Path(__file__).resolve().parents[2] / "build" / "cpu"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared", "-fopenmp", "-std=c11"]

_lock = threading.Lock()
_state: dict[str, object] = {}       # "lib" (once built or refused), "reason"
LOADED = _state

_i64, _p, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
SIGNATURES = {       # (restype, argtypes) of each kernel; see the C sources for the arguments
    "lkv_linear_packed": (None, [_p, _i64, _i64, _p, _i64, _p, _p, _int]),
    "lkv_linear_int8": (None, [_p, _i64, _i64, _p, _i64, _p, _i64, _p, _p, _int]),
    "lkv_block_topk": (_int, [_p, _p, _p, _i64, _p] + [_i64] * 9 + [_int, _p, _p, _int]),
    "lkv_attention": (_int, [_p, _p, _p, _i64, _i64, _p, _p, _i64, _i64, _i64, _p, _i64, _i64, _i64, _p, _p]
                      + [_i64] * 7 + [ctypes.c_float, _int, _int]),
    "lkv_attention_paged": (_int, [_p, _p, _p, _p, _i64, _p, _p] + [_i64] * 5 + [ctypes.c_float, _int, _int]),
    "lkv_attention_paged_table": (_int, [_p, _p, _p, _p, _i64, _i64, _i64, _p, _p] + [_i64] * 5
                                  + [ctypes.c_float, _int, _int]),
    "lkv_rmsnorm": (None, [_p, _i64, _p, ctypes.c_float, _p, _i64, _i64, _i64]),
    "lkv_plan": (_i64, [_p] * 4 + [_i64] * 5 + [_p, _p] + [_i64] * 3 + [_p] * 4),
    "lkv_copy_blocks": (_int, [_p] * 2 + [_i64] * 2 + [_p] * 2 + [_i64] * 3 + [_p] * 5 + [_i64] * 6),
    "lkv_decode": (_int, [_p, _p, _p, _i64, _i64, _int]),       # the fused decode step (fused.py)
    "lkv_silu_mul": (None, [_p, _p, _i64, _i64, _p, _i64]),
    "lkv_ext_begin": (_int, [_p, _p, _p]),                      # the layers around an outside attention
    "lkv_ext_qkv": (None, [_p, _p, _p, _i64, _p, _p, _p, _int]),
    "lkv_ext_rest": (None, [_p, _p, _p, _i64, _p, _int]),
    "lkv_ext_end": (None, [_p, _p, _p]),
    "lkv_lookahead_layer": (_int, [_p, _p]),                   # a lookahead decode layer (lookahead_layer.py)
    "lkv_update_summaries": (_int, [_p] * 5 + [_i64] * 4 + [_int, _int]),   # update_summaries (summaries.c)
    "lkv_prefill_attention": (_int, [_p, _i64, _p, _p, _i64, _p] + [_i64] * 6 + [ctypes.c_float, _p, _i64]
                              + [_int] * 3),                   # prefill attention (prefill_attention.c)
    "lkv_prefill_bf16_supported": (_int, []),
    "lkv_gemm_supported": (_int, []),                          # the prefill GEMMs (gemm.c)
    "lkv_pack_bf16": (None, [_p, _i64, _i64, _i64, _p, _int]),
    "lkv_gemm_bf16": (_int, [_p, _i64, _i64, _i64, _p, _i64, _p, _p, _i64, _int]),
    "lkv_pack_w8a8": (None, [_p, _p, _i64, _i64, _i64, _p, _p, _p, _int]),
    "lkv_quantize_rows": (None, [_p, _i64, _i64, _i64, _i64, _p, _p, _int]),
    "lkv_gemm_w8a8": (_int, [_p, _i64, _i64, _i64, _i64, _p, _p, _p, _i64, _p, _p, _i64, _int]),
}


def cpu_flags() -> set[str]:
    """This machine's CPU feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def refusal(machine: str, flags: set[str]) -> str | None:
    """Why the kernels do not build for this machine type and these CPU flags (None: they do)."""
    if machine not in ("x86_64", "AMD64"):
        return f"the kernels are x86-64 AVX2 code; this machine is {machine}"
    missing = {"avx2", "fma", "f16c"} - flags
    return f"the CPU lacks {', '.join(sorted(missing))}" if missing else None


def _build() -> ctypes.CDLL:
    why = refusal(platform.machine(), cpu_flags())
    if why is not None:
        raise RuntimeError(why)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (install gcc, or set CC)")
    tag = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join([cc, *FLAGS]).encode())
    tag = tag.hexdigest()[:16]
    lib = BUILD_DIR / f"liblookahead_cpu-{tag}.so"
    if not lib.exists():
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=BUILD_DIR) as tmp:     # atomic: build, then rename
            out = Path(tmp) / lib.name
            proc = subprocess.run([cc, *FLAGS, "-o", str(out), *map(str, SOURCES), "-lm"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-400:]}")
            os.replace(out, lib)
    dll = ctypes.CDLL(str(lib))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(dll, name)
        fn.restype, fn.argtypes = restype, argtypes
    return dll


def library() -> ctypes.CDLL | None:
    """The built kernels, or None (the reason: `unavailable_reason()`). Built once per process."""
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"] = _build()
            except (OSError, RuntimeError) as e:
                _state["lib"], _state["reason"] = None, str(e)
                logger.info("CPU kernels unavailable (%s); using torch", e)
        return _state["lib"]  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    library()
    return _state.get("reason")  # type: ignore[return-value]
