"""The kernel table: every op one engine calls, chosen once from (device, dtype, impl).

    ops = select_ops(torch.device("cpu"), torch.float32)     # impl="auto"
    ops.block_topk(q, kmin, kmax, valid, k, "max")

The one door to `plugins`: the model, the backends, the slot table and the copy jobs call their
engine's `Ops`, never `plugins`. impl "c": plugins/cpu's C kernels (on CPU; ValueError where they
do not build); "torch": the torch implementations (the references the C paths equal), no C
entry; "auto": "c" where it applies, else "torch" (on a GPU `torch.ops.lookahead`, whose CUDA key
`plugins.cuda` registers, built here once per process); "checked": auto's kernels behind the
argument-checking wrappers (`plugins.<op>`), no fused entry (tests, `debug_checks`). An entry only
C has is None in a torch table (its caller runs its torch path). `wrapped`: a test's table that
records or checks every call. A quantized engine's `linear` also takes an `Int8Weight`.

The prefill entries (`prefill_linear`, `prefill_attention`) are what a prompt's rows compute with,
by the engine's prefill precision (`resolve_prefill`): None at float32 (the rows take `linear` and
the backends' torch attention, as decode-era code always did); at bfloat16 and int8 the prefill
kernels of plugins/cpu (bf16 / int8 dot products, fp32 sums), or their torch formulations in a
torch table.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

import plugins  # defines torch.ops.lookahead.* (no CUDA build: select_ops registers the kernels)
from plugins import cpu
from plugins.cpu import bookkeeping, fused, prefill
from plugins.cpu.ops import dequantize_int8, int8_group_size, paged_mask  # noqa: F401  (the runtime's helpers)

from .config import DECODE_PRECISIONS, PREFILL_PRECISIONS
from .errors import ConfigError

IMPLS = ("auto", "c", "torch", "checked")
Kernel, NO_UNITS = cpu.ops.Kernel, cpu.ops.NO_UNITS      # a kernel bound to one weight or pool (runtime/projections.py)
# the C entries of a kernel table that bind to one weight at load, and their binders
BINDERS: dict[Callable, Callable[..., Kernel]] = {
    cpu.ops.linear: cpu.ops.bind_linear,
    cpu.ops.linear_int8: cpu.ops.bind_linear_int8,
    cpu.ops.rms_norm: cpu.ops.bind_rms_norm,
    prefill.linear_bf16: prefill.bind_linear_bf16,
    prefill.linear_bf16_int8: prefill.bind_linear_bf16_int8,
    prefill.linear_w8a8: prefill.bind_linear_w8a8,
}
# the C entries of a kernel table that the engine binds to its KV pool and summaries at load
# (runtime/projections.py `bind_pool_kernels`), by the Ops field that holds them
POOL_ENTRIES: dict[str, Callable] = {
    "prefill_attention": prefill.prefill_attention_op,
    "paged_attention": cpu.attention_paged,
    "lookahead_attention": cpu.ops.lookahead_attention_op,
    "block_topk": cpu.ops.block_topk_op,
    "update_summaries": cpu.ops.update_summaries,
}
POOL_BINDERS = {"prefill_attention": prefill.bind_prefill_attention,
                "paged_attention": cpu.ops.bind_paged_attention,
                "lookahead_attention": cpu.ops.bind_lookahead_attention,
                "block_topk": cpu.ops.bind_block_topk,
                "update_summaries": cpu.ops.bind_update_summaries}
FUSED = ("fused_decoder", "lookahead_layer")     # entries that bind a whole step or layer to C


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch table's RMSNorm (F.rms_norm over the last dim)."""
    return F.rms_norm(x, weight.shape, weight, eps)


def job_copy(op: Callable) -> Callable:
    """`lookahead::copy_blocks` (or one of its doors) as a table's `copy_blocks` entry: a CopyJob's
    call, (src_k, src_v, dst_k, dst_v, src_index, dst_index, valid) -> True."""
    def copy(src_k, src_v, dst_k, dst_v, src_index, dst_index, valid=None) -> bool:
        op(src_k, src_v, dst_k, dst_v, *src_index, *dst_index, valid)
        return True
    copy.op = op
    return copy


@dataclass(frozen=True)
class Ops:
    """One callable per op; signatures: `plugins/CONTRACTS.md`, F.linear, F.rms_norm's (x, weight,
    eps), and the plugins.cpu functions named beside the entries."""

    block_gather: Callable
    block_topk: Callable
    update_summaries: Callable
    lookahead_attention: Callable
    linear: Callable            # (x [M, K], weight [N, K] | Int8Weight, bias [N] | None) -> [M, N]
    rms_norm: Callable = torch_rms_norm
    paged_attention: Callable | None = None     # plugins.cpu.attention_paged (None: per item)
    plan_slots: Callable | None = None          # bookkeeping.plan, exact lists (None: plan_slots_fixed)
    # lookahead::plan_slots: the slot plan as a fixed-capacity list, one op (one kernel on a GPU)
    plan_slots_fixed: Callable = plugins.direct.plan_slots
    # a CopyJob's copy, True when done (bookkeeping.copy_blocks; a torch table's `job_copy` of
    # lookahead::copy_blocks, one kernel on a GPU; None: the op's torch implementation)
    copy_blocks: Callable | None = None
    fused_decoder: Callable | None = None       # fused.bind: a dense decode step in one C call
    lookahead_layer: Callable | None = None     # LookaheadLayer.bind: a lookahead layer in one
    # a prompt's rows (None: `linear` and the backends' torch attention, the float32 reference)
    prefill_linear: Callable | None = None      # as `linear`
    prefill_attention: Callable | None = None   # (q [n, H, D], k, v [KVH, NB, bs, D] one pool layer,
                                                #  block_table, context_len, scale) -> [n, H, D]
    prefill: str = "float32"                    # the resolved prefill precision
    # a decode row's projections (None: `linear`); at decode precision int8, an int8 weight's W8A8
    decode_linear: Callable | None = None
    decode: str = "float32"                     # the decode precision
    name: str = ""

    @property
    def c_kernels(self) -> bool:
        """Whether this is the C kernel table (plugins/cpu) or one wrapped around it ("c/cpu+wrapped")."""
        return self.name.startswith("c/")

    def wrapped(self, wrap: Callable[[str, Callable], Callable], name: str | None = None) -> "Ops":
        """These ops with each callable replaced by `wrap(op_name, fn)` and no fused entries
        (tests: check, record every call)."""
        ops = {f.name: wrap(f.name, getattr(self, f.name)) for f in fields(self)
               if f.name not in ("name", "prefill", "decode", *FUSED) and getattr(self, f.name) is not None}
        return replace(self, **ops, **dict.fromkeys(FUSED), name=name or f"{self.name}+wrapped")

    def with_prefill(self, precision: str, quantized: bool) -> "Ops":
        """This table with the prefill entries of `precision` (resolved; a sibling engine's choice),
        C kernels when this table is C's."""
        return replace(self, **{**dict.fromkeys(("prefill_linear", "prefill_attention")),
                                **prefill_entries(precision, self.c_kernels, quantized)})

    def with_decode(self, precision: str) -> "Ops":
        """This table with the decode rows' projections at `precision` (`resolve_decode`): int8
        weights through the W8A8 kernel (C where this table is C's, else its torch formulation)."""
        if precision == "float32":
            return replace(self, decode_linear=None, decode="float32")
        c = self.c_kernels
        int8 = prefill.linear_w8a8 if c else prefill.linear_w8a8_torch
        return replace(self, decode_linear=QuantizedLinear(cpu.linear if c else F.linear, int8), decode=precision)


# W8A8 under "auto" only where the weights' groups are this fine or finer: activations quantized
# per token (group 0, a scale per output channel) cost the default model 4.5 % perplexity, per 64
# inputs 0.3 % (docs/SETTINGS.md)
AUTO_W8A8_MAX_GROUP = 64


def resolve_decode(decode: str, quantized: bool, group: int = AUTO_W8A8_MAX_GROUP) -> str:
    """The decode precision an engine runs: ConfigError naming `decode_precision` for one it
    cannot take (int8 without int8 weights; int8 on an engine with one weight scale per output
    channel, `group` 0, whose activations would take one scale per row: +4.5 % perplexity, the
    rounding docs/SETTINGS.md rejected)."""
    if decode not in DECODE_PRECISIONS:
        raise ConfigError("decode_precision", f"{decode!r} is not a decode precision",
                          f"use one of {', '.join(DECODE_PRECISIONS)}")
    if decode == "int8" and not quantized:
        raise ConfigError("decode_precision", "int8 needs int8 weights",
                          "build an int8 engine (make engine-int8), or leave it float32")
    if decode == "int8" and group == 0:
        raise ConfigError("decode_precision", "int8 on an engine with one weight scale per output channel "
                          "(built with --group-size 0) would quantize each row's activations with one scale "
                          "(+4.5 % perplexity)", "rebuild with --group-size 64 (the default), or leave it float32")
    return decode


def linear_int8_torch(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_int8's contract off the C table: dequantize on the tensors' device, then F.linear."""
    return F.linear(x, dequantize_int8(qweight, scale, x.dtype), bias)


@dataclass(frozen=True)
class QuantizedLinear:
    """`linear` for an engine with int8 weights: a tensor weight goes to `dense`, an `Int8Weight`
    (anything else with qweight/scale) to `int8(x, qweight, scale, bias)`. runtime/projections.py
    binds each half to its weights at load."""

    dense: Callable
    int8: Callable

    def __call__(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return self.dense(x, weight, bias)
        return self.int8(x, weight.qweight, weight.scale, bias)



def c_applies(device: torch.device) -> str | None:
    """Why plugins/cpu's table does not apply on `device` (None: it does; its entries take the
    dtypes their kernels read, fp32 activations, and hand others to torch)."""
    if device.type != "cpu":
        return f"the C kernels run on CPU, not {device.type}"
    return None if cpu.available() else f"no CPU kernels ({cpu.loader.unavailable_reason()})"



def resolve_prefill(prefill: str, device: torch.device, dtype: torch.dtype, quantized: bool,
                    impl: str = "auto", int8_group: int = AUTO_W8A8_MAX_GROUP) -> str:
    """The prefill precision an engine runs: `prefill` itself, or for "auto" the fastest accurate
    one this machine and engine have: int8 (an int8 engine whose weights have groups of at most
    AUTO_W8A8_MAX_GROUP inputs, `int8_group`, on a CPU with AVX512_VNNI), bfloat16 (CPUs with
    AVX512_BF16), else float32. ConfigError naming `prefill_precision` for
    one the engine cannot take (int8 without int8 weights; anything but auto on a 16-bit engine,
    which prefills in its own dtype)."""
    if prefill not in PREFILL_PRECISIONS:
        raise ConfigError("prefill_precision", f"{prefill!r} is not a prefill precision",
                          f"use one of {', '.join(PREFILL_PRECISIONS)}")
    if dtype != torch.float32:
        if prefill not in ("auto", "float32"):
            raise ConfigError("prefill_precision", f"{prefill} under {dtype} weights: a 16-bit engine prefills in "
                              "its own dtype", "leave it auto")
        return "float32"
    if prefill == "int8" and not quantized:
        raise ConfigError("prefill_precision", "int8 needs int8 weights",
                          "build an int8 engine (make engine-int8), or use bfloat16")
    if prefill != "auto":
        return prefill
    if impl == "torch" or c_applies(device) is not None:
        return "float32"
    if quantized and 0 < int8_group <= AUTO_W8A8_MAX_GROUP and prefill_kernels_take("int8"):
        return "int8"
    return "bfloat16" if prefill_kernels_take("bfloat16") else "float32"


def kernel_fallbacks(ops: Ops) -> list[str]:
    """What of `ops`' chosen precisions runs a torch formulation instead of its C kernel on this
    CPU (a C table at prefill or decode precision bfloat16 / int8 without the AVX-512 units: the
    same contract, other roundings, several times slower): one line each, for a WARNING at load
    and `Engine.stats()["kernel_fallbacks"]`. Empty for a torch table (chosen, not fallen to)."""
    if not ops.c_kernels:
        return []
    units = {"bfloat16": "AVX512_BF16", "int8": "AVX512_VNNI"}
    return [f"{what}_precision {p}: this CPU has no {units[p]}, so its {what} rows run the torch formulation "
            f"(slower than float32 here; set {what}_precision: float32, or run on a CPU with {units[p]})"
            for what, p in (("prefill", ops.prefill), ("decode", ops.decode))
            if p in units and not prefill_kernels_take(p)]


def prefill_kernels_take(precision: str) -> bool:
    """Whether this CPU has the dot-product units the `precision` prefill kernels use."""
    return prefill.int8_dot_products() if precision == "int8" else prefill.bf16_dot_products()


def host_units() -> str:
    """This CPU's prefill dot-product units, as a build records where it resolved `auto`."""
    have = {"AVX512_BF16": prefill_kernels_take("bfloat16"), "AVX512_VNNI": prefill_kernels_take("int8")}
    return ", ".join(("" if ok else "no ") + unit for unit, ok in have.items())


def prefill_entries(precision: str, use_c: bool, quantized: bool) -> dict:
    """The prefill entries of a table at `precision` (resolved): the C kernels (use_c) or their
    torch formulations; none at float32."""
    if precision == "float32":
        return {"prefill": "float32"}
    p = prefill
    dense = p.linear_bf16 if use_c else p.linear_bf16_torch
    if precision == "int8":
        int8 = p.linear_w8a8 if use_c else p.linear_w8a8_torch
    else:
        int8 = p.linear_bf16_int8 if use_c else (lambda x, q, s, b=None: p.linear_bf16_torch(x, dequantize_int8(q, s), b))
    return {"prefill_linear": QuantizedLinear(dense, int8) if quantized else dense,
            "prefill_attention": p.prefill_attention_op if use_c else p.prefill_attention_torch,
            "prefill": precision}


def select_ops(device: torch.device, dtype: torch.dtype, impl: str = "auto", quantized: bool = False,
               prefill: str = "float32") -> Ops:
    """The kernel table for tensors of `dtype` on `device` (see the module docstring for `impl`).
    quantized: the model holds int8 weights (`Int8Weight`), which `linear` must also take.
    prefill: the prefill precision (`resolve_prefill`; "auto" resolves here)."""
    if impl not in IMPLS:
        raise ValueError(f"impl: one of {IMPLS}, got {impl!r}")
    why = c_applies(device)
    if impl == "c" and why is not None:
        raise ValueError(f"impl='c': {why}")
    if device.type == "cuda":
        plugins.ensure_cuda_kernels()
    use_c = impl != "torch" and why is None
    extra = prefill_entries(resolve_prefill(prefill, device, dtype, quantized, impl), use_c, quantized)
    if not use_c:
        d = plugins.direct if device.type == "cpu" else torch.ops.lookahead   # CPU: no dispatcher
        ops = Ops(d.block_gather, d.block_topk, d.update_summaries, d.lookahead_attention,
                  QuantizedLinear(F.linear, linear_int8_torch) if quantized else F.linear,
                  plan_slots_fixed=d.plan_slots, copy_blocks=job_copy(d.copy_blocks), name=f"torch/{device.type}",
                  **extra)
    else:
        d = plugins.direct
        ops = Ops(d.block_gather, cpu.ops.block_topk_op, cpu.ops.update_summaries, cpu.ops.lookahead_attention_op,
                  QuantizedLinear(cpu.linear, cpu.linear_int8) if quantized else cpu.linear,
                  rms_norm=cpu.rms_norm, paged_attention=cpu.attention_paged, plan_slots=bookkeeping.plan,
                  copy_blocks=bookkeeping.copy_blocks, fused_decoder=fused.bind,
                  lookahead_layer=fused.LookaheadLayer.bind, name="c/cpu", **extra)
    if impl != "checked":
        return ops
    return replace(ops, block_gather=plugins.block_gather, update_summaries=plugins.update_summaries,
                   plan_slots_fixed=plugins.plan_slots,
                   copy_blocks=ops.copy_blocks if use_c else job_copy(plugins.copy_blocks),
                   block_topk=functools.partial(plugins.block_topk, impl=ops.block_topk if use_c else None),
                   lookahead_attention=functools.partial(plugins.lookahead_attention,
                                                         impl=ops.lookahead_attention if use_c else None),
                   **dict.fromkeys(FUSED), name=f"checked/{ops.name}")
