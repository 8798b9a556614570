"""The Python side of plugins/cpu/lkv_abi.h: the ctypes mirror of its structs, its storage and
return codes and its limits, the exceptions its return codes map to, and the check of the mirror
against a built library's descriptor.

    verify(lib, "base")          # once, when the loader opens a library: AbiMismatch on any difference
    raise_for(rc, "what ran")    # a kernel's nonzero return code -> its typed KernelError

`lkv_abi_describe` (abi.c) reports, as the compiler laid them out, every struct's size and
alignment and every field's offset and size, the storage codes, the return codes and the limits;
`verify` compares each with what is here (ctypes.sizeof / alignment, each field's offset and size,
the constants) and raises `AbiMismatch` naming the first struct and field (or constant) that
differs. Nothing here imports torch: the loader uses it before any kernel is bound.
"""
from __future__ import annotations

import ctypes
import enum
from typing import NoReturn

_i64, _p, _f, _d = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_double

VERSION = 2                     # LKV_ABI_VERSION

# K/V storage codes (LKV_KV_*): the kv_dtype / key_dtype arguments (ops.KV_DTYPES maps torch dtypes)
KV_F32, KV_F16, KV_BF16 = 0, 1, 2
STORAGE = {"LKV_KV_F32": KV_F32, "LKV_KV_F16": KV_F16, "LKV_KV_BF16": KV_BF16}

# limits the kernels check (LKV_MAX_*, LKV_W8A8_MAX_GROUP)
MAX_ROWS = 16                   # lkv_decode / lkv_ext_*: rows of a step
MAX_KV_ROW = 4096               # lkv_decode: KVH * D
MAX_EXTRA_KEYS = 8              # lkv_attention: extra keys
MAX_GROUP_ROWS = 64             # lkv_attention*: query rows per KV head (R * H / KVH)
W8A8_MAX_GROUP = (2 ** 31 - 1) // (255 * 128)   # W8A8: inputs one int32 accumulator sums (G; K per channel)
PREFILL_TILES = 7               # prefill attention's bf16 tile table (one library hands it to the other)
LIMITS = {"LKV_MAX_ROWS": MAX_ROWS, "LKV_MAX_KV_ROW": MAX_KV_ROW, "LKV_MAX_EXTRA_KEYS": MAX_EXTRA_KEYS,
          "LKV_MAX_GROUP_ROWS": MAX_GROUP_ROWS, "LKV_W8A8_MAX_GROUP": W8A8_MAX_GROUP,
          "LKV_PREFILL_TILES": PREFILL_TILES}


class Status(enum.IntEnum):
    """The kernels' return codes (lkv_abi.h); C name: LKV_ + the member's `c_name`."""
    OK = 0
    NOMEM = -1
    ARG = -2
    DECLINED = -3
    ISA = -4
    RANGE = -5
    SCRATCH = -6
    LIMIT = -7

    @property
    def c_name(self) -> str:
        return "LKV_" + ("" if self.name in ("OK", "DECLINED") else "ERR_") + self.name


DECLINED = int(Status.DECLINED)      # plain ints for the hot paths' comparisons


# ---- exceptions --------------------------------------------------------------------------------

class KernelError(RuntimeError):
    """A CPU kernel returned a nonzero code. `code`: the Status (or the int, if unknown); `kernel`:
    what was called. The subclasses also derive from the built-in error of their kind."""

    def __init__(self, message: str, code: int, kernel: str):
        super().__init__(message)
        self.code, self.kernel = code, kernel


class KernelOutOfMemory(KernelError, MemoryError):
    """LKV_ERR_NOMEM: a scratch allocation inside the kernel failed."""


class KernelArgumentError(KernelError, ValueError):
    """LKV_ERR_ARG: the kernel refused an argument (a size, a code, a layout); nothing written."""


class KernelDeclined(KernelError):
    """LKV_DECLINED raised where the caller has no other path (callers with one test for it first)."""


class UnsupportedISA(KernelError):
    """LKV_ERR_ISA: this CPU lacks the instructions the kernel needs (AVX-512 BF16 / VNNI)."""


class KernelIndexError(KernelError, IndexError):
    """LKV_ERR_RANGE: an index (block id, lane, slot) was out of range; nothing changed."""


class ScratchTooSmall(KernelError):
    """LKV_ERR_SCRATCH: the scratch the caller passed is smaller than the call needs."""


class KernelLimitError(KernelError, ValueError):
    """LKV_ERR_LIMIT: a size is above one of the kernel's limits (LIMITS)."""


_ERRORS: dict[int, tuple[type[KernelError], str]] = {
    Status.NOMEM: (KernelOutOfMemory, "a scratch allocation failed (out of memory)"),
    Status.ARG: (KernelArgumentError, "the kernel refused its arguments"),
    Status.DECLINED: (KernelDeclined, "the kernel declined the call (not one its path takes); nothing was written"),
    Status.ISA: (UnsupportedISA, "this CPU lacks the instructions the kernel needs (AVX-512 BF16 / VNNI)"),
    Status.RANGE: (KernelIndexError, "an index was out of range; nothing was changed"),
    Status.SCRATCH: (ScratchTooSmall, "the scratch it was given is smaller than the call needs"),
    Status.LIMIT: (KernelLimitError, "a size is above the kernel's limit"),
}


def error(rc: int, kernel: str, detail: str | None = None) -> KernelError:
    """The exception for kernel `kernel`'s return code `rc` (nonzero), its message saying what
    failed: "<kernel> (CPU kernel): <what the code means> [LKV_...]", then `detail` if given."""
    rc = int(rc)
    if rc == Status.OK:
        raise ValueError(f"{kernel}: return code 0 (LKV_OK) is not an error")
    if rc in _ERRORS:
        cls, what = _ERRORS[rc]
        code: int = Status(rc)
        what = f"{what} [{Status(rc).c_name}]"
    else:
        cls, what, code = KernelError, f"unknown return code {rc}", rc
    return cls(f"{kernel} (CPU kernel): {what}" + (f": {detail}" if detail else ""), code, kernel)


def raise_for(rc: int, kernel: str, detail: str | None = None) -> NoReturn:
    """Raise `error(rc, kernel, detail)`."""
    raise error(rc, kernel, detail)


# ---- the ctypes mirror of lkv_abi.h's structs ----------------------------------------------------

class Linear(ctypes.Structure):            # LkvLinear
    _fields_ = [("w", _p), ("scale", _p), ("bias", _p), ("n", _i64), ("k", _i64), ("int8", _i64), ("group", _i64),
                ("wq8", _p), ("wsc8", _p), ("wsum8", _p), ("group8", _i64)]


class Layer(ctypes.Structure):             # LkvLayer
    _fields_ = [("attn_norm", _p), ("mlp_norm", _p), ("wqkv", Linear), ("wo", Linear), ("w13", Linear),
                ("w2", Linear), ("k", _p), ("v", _p), ("q_norm", _p), ("k_norm", _p)]


class Model(ctypes.Structure):             # LkvModel
    _fields_ = [(n, _i64) for n in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab",
                                    "num_blocks", "block_size", "max_pos", "kv_dtype")] + \
               [("eps", _f), ("scale", _f), ("cos", _p), ("sin", _p), ("embed", _p), ("embed_scale", _p),
                ("norm", _p), ("layers", ctypes.POINTER(Layer)), ("exp8", _p), ("silu_chunk", _i64),
                ("embed_group", _i64), ("sel_kmin", _p), ("sel_kmax", _p)] + \
               [(n, _i64) for n in ("sel_top_k", "sel_sink", "sel_window", "sel_group_max")] + \
               [("w8a8", _p)]


class Step(ctypes.Structure):              # LkvStep
    _fields_ = [("B", _i64), ("N", _i64)] + [(n, _p) for n in ("tokens", "positions", "slot_blocks", "slot_offsets",
                                                               "run_starts", "lens", "tables")] + \
               [("table_stride", _i64)]


class Work(ctypes.Structure):              # LkvWork
    _fields_ = [(n, _p) for n in ("x", "h", "qkv", "q", "o", "t", "gu", "act", "out", "mask", "boff",
                                  "sel_scores", "sel_idx", "sel_valid", "xq", "sx")] + \
               [("xq_len", _i64), ("sx_len", _i64)]


LAYER_BOUND = ("kmin", "kmax", "pool_k", "pool_v", "tier_k", "tier_v", "tier_mask", "block", "last_used", "slot_of",
               "lane_blocks", "pred", "has_pred")


class LayerTensors(ctypes.Structure):      # LkvLayerTensors
    _fields_ = [(n, _p) for n in LAYER_BOUND] + \
               [(n, _i64) for n in ("layers", "lanes", "kv_heads", "heads", "head_dim", "block_size", "max_blocks",
                                    "top_k", "sel_start", "slots", "pool_blocks", "elem_bytes", "kv_dtype",
                                    "group_max")] + \
               [(n, _p) for n in ("scores", "prio", "idx", "want", "lists", "lane_ids", "mask", "dtab", "dmask",
                                  "dxmask", "dq", "dout", "copy")]


class LayerCall(ctypes.Structure):         # LkvLayerCall
    _fields_ = [(n, _i64) for n in ("layer", "buf", "n", "rows", "nb", "k_sel", "step", "used_none", "used_adm",
                                    "nthreads")] + \
               [("q", _p), ("kx", _p), ("vx", _p)] + [(n, _i64) for n in ("xksb", "xksh", "xkse", "xvsb", "xvsh",
                                                                           "xvse")] + \
               [("cand", _p), ("cand_sb", _i64), ("cand_sr", _i64), ("extra_mask", _p), ("fetch", _p),
                ("active", _p), ("scale", _f), ("out", _p), ("true_idx", _p), ("resident", _p),
                ("predict_cap", _i64), ("pred_adm", _p), ("urgent_adm", _p), ("draft_fixed", _p),
                ("draft_stored", _p), ("copy_s", _d),
                ("admitted", _i64), ("used", _i64), ("predicted", _i64)]


# C name -> mirror: what `verify` checks (the tests swap an entry for a wrong mirror)
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "LkvLinear": Linear, "LkvLayer": Layer, "LkvModel": Model, "LkvStep": Step, "LkvWork": Work,
    "LkvLayerTensors": LayerTensors, "LkvLayerCall": LayerCall}


# ---- the descriptor and its check ----------------------------------------------------------------

class Entry(ctypes.Structure):             # LkvAbiEntry
    _fields_ = [("name", ctypes.c_char_p), ("value", _i64), ("size", _i64)]


DESCRIBE = (_i64, [ctypes.POINTER(ctypes.POINTER(Entry))])     # lkv_abi_describe's (restype, argtypes)


class AbiMismatch(RuntimeError):
    """A built library's lkv_abi.h and this mirror disagree. `struct` and `field` name where (for a
    constant: the kind, e.g. "code", and its C name); `c` and `python` the two values. The loader
    raises it at load, before any kernel is called: the kernels are never used with a wrong mirror."""

    def __init__(self, library: str, struct: str, field: str | None, c, python):
        where = struct if field is None else f"{struct}.{field}"
        super().__init__(f"the {library} CPU kernel library's ABI differs from plugins/cpu/abi.py at {where}: "
                         f"C (lkv_abi_describe) has {c}, the ctypes mirror {python}; lkv_abi.h and abi.py "
                         f"must change together")
        self.library, self.struct, self.field, self.c, self.python = library, struct, field, c, python


def describe(lib) -> dict[str, tuple[int, int]]:
    """A library's descriptor: {entry name: (value, size)} (names as in lkv_abi.h's LkvAbiEntry)."""
    entries = ctypes.POINTER(Entry)()
    n = lib.lkv_abi_describe(ctypes.byref(entries))
    return {entries[i].name.decode(): (entries[i].value, entries[i].size) for i in range(n)}


def mirror() -> dict[str, tuple[int, int]]:
    """What `describe` must return, from this module: the same names, the ctypes layouts."""
    out = {"version": (VERSION, 0)}
    out.update({f"storage:{k}": (v, 0) for k, v in STORAGE.items()})
    out.update({f"code:{s.c_name}": (int(s), 0) for s in Status})
    out.update({f"limit:{k}": (v, 0) for k, v in LIMITS.items()})
    for name, cls in STRUCTS.items():
        out[f"struct:{name}"] = (ctypes.sizeof(cls), ctypes.alignment(cls))
        for field, *_ in cls._fields_:
            d = getattr(cls, field)
            out[f"field:{name}.{field}"] = (d.offset, d.size)
    return out


def verify(lib, library: str) -> None:
    """AbiMismatch at the first entry where `lib`'s descriptor and the mirror differ: an entry one
    of them lacks, else the first field (in the mirror's order), else a struct's size or a constant."""
    c, py = describe(lib), mirror()

    def where(key: str) -> tuple[str, str | None]:
        kind, _, rest = key.partition(":")
        if kind == "field":
            struct, _, field = rest.partition(".")
            return struct, field
        return (rest, None) if kind == "struct" else (kind, rest or None)

    # an entry only one side has first (the likely cause of the offsets that follow it), then the
    # fields, then the structs' sizes
    order = [k for k in c if k not in py] + [k for k in py if k not in c]
    order += sorted((k for k in py if k in c), key=lambda k: k.startswith("struct:"))
    for key in order:
        if c.get(key) != py.get(key):
            struct, field = where(key)
            show = lambda v, kind=key.partition(":")[0]: (   # noqa: E731
                "no such entry" if v is None
                else f"offset {v[0]}, size {v[1]}" if kind == "field"
                else f"size {v[0]}, alignment {v[1]}" if kind == "struct" else f"value {v[0]}")
            raise AbiMismatch(library, struct, field, show(c.get(key)), show(py.get(key)))
