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
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

import plugins  # defines torch.ops.lookahead.* (no CUDA build: select_ops registers the kernels)
from plugins import cpu
from plugins.cpu import bookkeeping, fused, lookahead_layer
from plugins.cpu.ops import dequantize_int8, int8_group_size, paged_mask  # noqa: F401  (the runtime's helpers)

IMPLS = ("auto", "c", "torch", "checked")
FUSED = ("fused_decoder", "lookahead_layer")     # entries that bind a whole step or layer to C


@dataclass(frozen=True)
class Ops:
    """One callable per op; signatures: `plugins/CONTRACTS.md`, F.linear, F.rms_norm's (x, weight,
    eps), and the plugins.cpu functions named beside the entries."""

    block_gather: Callable
    block_topk: Callable
    update_summaries: Callable
    lookahead_attention: Callable
    linear: Callable            # (x [M, K], weight [N, K] | Int8Weight, bias [N] | None) -> [M, N]
    rms_norm: Callable = lambda x, weight, eps: F.rms_norm(x, weight.shape, weight, eps)
    paged_attention: Callable | None = None     # plugins.cpu.attention_paged (None: per item)
    plan_slots: Callable | None = None          # bookkeeping.plan (None: SlotTable.plan_torch)
    copy_blocks: Callable | None = None         # bookkeeping.copy_blocks (None: torch indexing)
    fused_decoder: Callable | None = None       # fused.bind: a dense decode step in one C call
    lookahead_layer: Callable | None = None     # LookaheadLayer.bind: a lookahead layer in one
    name: str = ""

    def wrapped(self, wrap: Callable[[str, Callable], Callable], name: str | None = None) -> "Ops":
        """These ops with each callable replaced by `wrap(op_name, fn)` and no fused entries
        (tests: check, record every call)."""
        ops = {f.name: wrap(f.name, getattr(self, f.name)) for f in fields(self)
               if f.name not in ("name", *FUSED) and getattr(self, f.name) is not None}
        return replace(self, **ops, **dict.fromkeys(FUSED), name=name or f"{self.name}+wrapped")


def linear_int8_torch(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_int8's contract off the C table: dequantize on the tensors' device, then F.linear."""
    return F.linear(x, dequantize_int8(qweight, scale, x.dtype), bias)


def quantized_linear(dense: Callable, int8: Callable) -> Callable:
    """`linear` for an engine with int8 weights: a tensor weight goes to `dense`, an `Int8Weight`
    (anything else with qweight/scale) to `int8(x, qweight, scale, bias)`."""
    def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return dense(x, weight, bias)
        return int8(x, weight.qweight, weight.scale, bias)

    linear.__qualname__ = linear.__name__ = f"quantized_linear[{getattr(int8, '__name__', 'int8')}]"
    return linear


def c_applies(device: torch.device) -> str | None:
    """Why plugins/cpu's table does not apply on `device` (None: it does; its entries take the
    dtypes their kernels read, fp32 activations, and hand others to torch)."""
    if device.type != "cpu":
        return f"the C kernels run on CPU, not {device.type}"
    return None if cpu.available() else f"no CPU kernels ({cpu.loader.unavailable_reason()})"


def select_ops(device: torch.device, dtype: torch.dtype, impl: str = "auto", quantized: bool = False) -> Ops:
    """The kernel table for tensors of `dtype` on `device` (see the module docstring for `impl`).
    quantized: the model holds int8 weights (`Int8Weight`), which `linear` must also take."""
    if impl not in IMPLS:
        raise ValueError(f"impl: one of {IMPLS}, got {impl!r}")
    why = c_applies(device)
    if impl == "c" and why is not None:
        raise ValueError(f"impl='c': {why}")
    if device.type == "cuda":
        plugins.ensure_cuda_kernels()
    use_c = impl != "torch" and why is None
    if not use_c:
        d = plugins.direct if device.type == "cpu" else torch.ops.lookahead   # CPU: no dispatcher
        ops = Ops(d.block_gather, d.block_topk, d.update_summaries, d.lookahead_attention,
                  quantized_linear(F.linear, linear_int8_torch) if quantized else F.linear,
                  name=f"torch/{device.type}")
    else:
        d = plugins.direct
        ops = Ops(d.block_gather, cpu.ops.block_topk_op, cpu.ops.update_summaries, cpu.ops.lookahead_attention_op,
                  quantized_linear(cpu.linear, cpu.linear_int8) if quantized else cpu.linear,
                  rms_norm=cpu.rms_norm, paged_attention=cpu.attention_paged, plan_slots=bookkeeping.plan,
                  copy_blocks=bookkeeping.copy_blocks, fused_decoder=fused.bind,
                  lookahead_layer=lookahead_layer.LookaheadLayer.bind, name="c/cpu")
    if impl != "checked":
        return ops
    return replace(ops, block_gather=plugins.block_gather, update_summaries=plugins.update_summaries,
                   block_topk=functools.partial(plugins.block_topk, impl=ops.block_topk if use_c else None),
                   lookahead_attention=functools.partial(plugins.lookahead_attention,
                                                         impl=ops.lookahead_attention if use_c else None),
                   **dict.fromkeys(FUSED), name=f"checked/{ops.name}")
