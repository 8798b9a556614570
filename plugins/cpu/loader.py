"""Build plugins/cpu/*.c with the machine's C compiler on first use, into two libraries, and bind
them with ctypes.

- the base library (`library()`): AVX2 + FMA + F16C, every kernel a decode step, attention,
  top-K, summaries, residency, the linears and prefill attention's AVX2 path run;
- the AVX-512 library (`avx512_library()`): the kernels that use AVX-512 BF16 / VNNI, the prefill
  GEMMs (bf16, W8A8: gemm.c) and prefill attention's bf16 tiles (prefill_attention_bf16.c, which
  the base library's driver is handed). Its kernels check the CPU before running (LKV_ERR_ISA, or
  no tiles, without those units).

The two are compiled apart (in parallel) and neither links against the other: a compiler that
fails on the AVX-512 targets loses only that library, logged at WARNING with the compiler's
message, and the base one still loads (the prefill paths then run their torch formulations;
`avx512_unavailable_reason()` says why). Each library lands in build/cpu/ (git-ignored), named by
a hash of its sources, the header and the flags, so an edited kernel is rebuilt and a stale one
never loaded.

When it opens a library the loader binds every function's signature and compares the library's
ABI descriptor (lkv_abi_describe) with the ctypes mirror (abi.verify): a difference raises
abi.AbiMismatch there, before any kernel is called, never a silent fallback.

The kernels need AVX2, FMA and F16C (x86-64 since 2013); without them or a compiler `library()`
returns None with the reason in `unavailable_reason()`, and an engine's kernel table is the torch
one (runtime/ops.py; `impl="torch"` chooses it anyway). The libraries are built and loaded where a
table is chosen (an engine's start).
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import abi

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
HEADERS = [HERE / "common.h", HERE / "lkv_abi.h", HERE / "prefill_attention.h"]
BUILD_DIR = Path(__file__).resolve().parents[2] / "build" / "cpu"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared", "-fopenmp", "-std=c11"]

_lock = threading.Lock()
_state: dict[str, object] = {}       # "lib", "reason", "avx512", "avx512_reason" (once built or refused)
LOADED = _state

_i64, _p, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
BASE_SIGNATURES = {  # (restype, argtypes) of each kernel; see lkv_abi.h for the arguments
    "lkv_abi_describe": abi.DESCRIBE,
    "lkv_linear_packed": (None, [_p, _i64, _i64, _p, _i64, _p, _p, _int]),
    "lkv_linear_int8": (None, [_p, _i64, _i64, _p, _i64, _p, _i64, _p, _p, _int]),
    "lkv_block_topk": (_int, [_p, _p, _p, _i64, _p] + [_i64] * 9 + [_int, _p, _p, _int, _int]),
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
    "lkv_ext_qkv": (_int, [_p, _p, _p, _i64, _p, _p, _p, _int]),
    "lkv_ext_rest": (_int, [_p, _p, _p, _i64, _p, _int]),
    "lkv_ext_end": (None, [_p, _p, _p]),
    "lkv_lookahead_layer": (_int, [_p, _p]),                   # a lookahead decode layer (fused.LookaheadLayer)
    "lkv_update_summaries": (_int, [_p] * 5 + [_i64] * 4 + [_int, _int, _int]),   # update_summaries (summaries.c)
    "lkv_prefill_attention": (_int, [_p, _i64, _p, _p, _i64, _p] + [_i64] * 6 + [ctypes.c_float, _p, _i64]
                              + [_int] * 2 + [_p]),            # prefill attention (prefill_attention.c)
}
AVX512_SIGNATURES = {
    "lkv_abi_describe": abi.DESCRIBE,
    "lkv_prefill_bf16_tiles": (_p, []),                        # prefill attention's bf16 tiles
    "lkv_gemm_supported": (_int, []),                          # the prefill GEMMs (gemm.c)
    "lkv_pack_bf16": (None, [_p, _i64, _i64, _i64, _p, _int]),
    "lkv_gemm_bf16": (_int, [_p, _i64, _i64, _i64, _p, _i64, _p, _p, _i64, _int]),
    "lkv_pack_w8a8": (None, [_p, _p, _i64, _i64, _i64, _p, _p, _p, _int]),
    "lkv_quantize_rows": (_int, [_p, _i64, _i64, _i64, _i64, _p, _p, _int]),
    "lkv_gemm_w8a8_scratch": (_int, [_p, _i64, _i64, _i64, _i64, _p, _p, _p, _i64, _p, _p, _i64, _int, _p, _p]),
    "lkv_gemm_w8a8": (_int, [_p, _i64, _i64, _i64, _i64, _p, _p, _p, _i64, _p, _p, _i64, _int]),
}


@dataclass(frozen=True, eq=False)
class LibrarySpec:
    """One library: its name in logs and state ("base", "avx512"), file stem, sources and the
    signatures bound when it is opened."""
    name: str
    stem: str
    sources: tuple[Path, ...]
    signatures: dict

    @property
    def flags(self) -> list[str]:
        return FLAGS


BASE = LibrarySpec("base", "liblookahead_cpu", tuple(HERE / n for n in (
    "abi.c", "linear.c", "linear_int8.c", "attention.c", "topk.c", "residency.c", "elementwise.c", "decode.c",
    "lookahead_layer.c", "summaries.c", "prefill_attention.c")), BASE_SIGNATURES)
AVX512 = LibrarySpec("avx512", "liblookahead_cpu_avx512", tuple(HERE / n for n in (
    "abi.c", "gemm.c", "prefill_attention_bf16.c")), AVX512_SIGNATURES)
LIBRARIES = (BASE, AVX512)
SOURCES = sorted({p for spec in LIBRARIES for p in spec.sources})


class Unavailable(RuntimeError):
    """The kernels cannot be built or opened here (no AVX2, no compiler, a compile failure)."""


class CompileError(Unavailable):
    """The compiler failed on a library's sources; the message ends with its output."""


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


def build_library(spec: LibrarySpec, cc: str) -> Path:
    """The path of `spec`'s library built by `cc`, compiling it first unless it is in BUILD_DIR
    already (named by a hash of the sources, headers and flags; written atomically). The sources
    are compiled by a few compiler processes at once (`compile_groups`), then linked. CompileError
    with the compiler's message when it fails."""
    tag = hashlib.sha256(b"".join(p.read_bytes() for p in (*spec.sources, *HEADERS))
                         + " ".join([cc, *spec.flags]).encode()).hexdigest()[:16]
    lib = BUILD_DIR / f"{spec.stem}-{tag}.so"
    if lib.exists():
        return lib
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=BUILD_DIR) as tmp:     # atomic: build, then rename

        def run(cmd: list[str]) -> subprocess.CompletedProcess:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)   # -c writes <stem>.o here

        groups = compile_groups(spec.sources)
        with ThreadPoolExecutor(len(groups)) as pool:
            procs = list(pool.map(run, ([cc, *spec.flags, "-c", *map(str, g)] for g in groups)))
        out = Path(tmp) / lib.name
        if all(p.returncode == 0 for p in procs):
            procs.append(run([cc, *spec.flags, "-o", str(out), *(f"{src.stem}.o" for src in spec.sources), "-lm"]))
        errors = "\n".join(p.stderr.strip() for p in procs if p.returncode != 0)
        if errors:
            raise CompileError(f"{cc} failed on the {spec.name} library: {errors[-800:]}")
        os.replace(out, lib)
    return lib


def compile_groups(sources: tuple[Path, ...]) -> list[list[Path]]:
    """The sources in as many compiler invocations as this library's share of the CPUs (both
    libraries build at once), largest first round the groups: a compiler process per CPU, not per
    file (each process costs its own start-up)."""
    n = max(1, min(len(sources), (os.cpu_count() or 1) // len(LIBRARIES)))
    ranked = sorted(sources, key=lambda p: p.stat().st_size, reverse=True)
    return [ranked[i::n] for i in range(n)]


def open_library(spec: LibrarySpec, path: Path) -> ctypes.CDLL:
    """`path` opened, its functions bound to spec's signatures and its ABI checked against the
    ctypes mirror (abi.verify: AbiMismatch before any kernel is called)."""
    dll = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in spec.signatures.items():
        fn = getattr(dll, name)
        fn.restype, fn.argtypes = restype, argtypes
    abi.verify(dll, spec.name)
    return dll


def _load() -> None:
    """Build (both at once) and open both libraries into _state; AbiMismatch propagates, and
    nothing is stored then."""
    why = refusal(platform.machine(), cpu_flags())
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if why is None and cc is None:
        why = "no C compiler (install gcc, or set CC)"
    if why is not None:
        logger.info("CPU kernels unavailable (%s); using torch", why)
        _state.update(lib=None, reason=why, avx512=None, avx512_reason=why)
        return

    def build(spec: LibrarySpec) -> Path | Unavailable:
        try:
            return build_library(spec, cc)
        except Unavailable as e:
            return e

    with ThreadPoolExecutor(len(LIBRARIES)) as pool:     # the compiles run side by side
        built = dict(zip(LIBRARIES, pool.map(build, LIBRARIES)))
    opened: dict[str, tuple[ctypes.CDLL | None, str | None]] = {}
    for spec, result in built.items():
        if isinstance(result, Path):
            try:
                opened[spec.name] = (open_library(spec, result), None)
                continue
            except OSError as e:
                result = Unavailable(f"cannot open {result.name}: {e}")
        opened[spec.name] = (None, str(result))
        if spec is BASE:
            logger.warning("CPU kernels unavailable (%s); using torch", result)
        else:
            logger.warning("the AVX-512 CPU kernels (prefill GEMMs, W8A8, bf16 prefill attention) are unavailable "
                           "(%s); the base kernels do not need them", result)
    (lib, reason), (lib512, reason512) = opened[BASE.name], opened[AVX512.name]
    _state.update(lib=lib, reason=reason, avx512=lib512, avx512_reason=reason512)


def library() -> ctypes.CDLL | None:
    """The base kernels, or None (the reason: `unavailable_reason()`). Built once per process
    (with the AVX-512 library)."""
    with _lock:
        if "lib" not in _state:
            _load()
        return _state["lib"]  # type: ignore[return-value]


def avx512_library() -> ctypes.CDLL | None:
    """The AVX-512 BF16 / VNNI kernels (built even where the CPU lacks them: they check it), or
    None (the reason: `avx512_unavailable_reason()`)."""
    with _lock:
        if "avx512" not in _state:
            _load()
        return _state["avx512"]  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    library()
    return _state.get("reason")  # type: ignore[return-value]


def avx512_unavailable_reason() -> str | None:
    avx512_library()
    return _state.get("avx512_reason")  # type: ignore[return-value]
