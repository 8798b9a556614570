"""The op implementations one engine calls, chosen once from its (device, dtype).

    ops = select_ops(torch.device("cpu"), torch.float32)
    ops.block_topk(q, kmin, kmax, valid, k, "max")      # plugins.direct: no dispatcher on CPU

Every caller on the decode path (the model's projections, the lookahead backend's scoring,
attention and summaries) reads its ops from the engine's `Ops`, never from a module global, so
the choice follows the device the tensors live on: on CPU the ops' implementations are called
directly (`plugins.direct`: a `torch.ops` dispatch costs about what a decode-size op computes
in), on CUDA through `torch.ops.lookahead`, whose CUDA key `plugins.cuda` registers its kernels
for: `select_ops` for a CUDA device is where that happens (`plugins.ensure_cuda_kernels()`, once
per process; importing `plugins` compiles nothing). `checked=True` gives the argument-checking wrappers (`plugins.<op>`) on the same arguments,
for tests. A test may pass an `Ops` of its own (e.g. one that records or checks every argument).

A weight-only int8 engine (`quantized=True`) gets a `linear` that also takes an `Int8Weight`
(runtime/model.py: qweight int8 [N, K], scale fp32 [N, K // G] or [N]) and sends it to `plugins.cpu.linear_int8`
(on CPU; a dequantizing torch path elsewhere); its fp32 tensors take the fp32 path as before.
An fp32 engine's `linear` is exactly what it was, with no extra check per call.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

import plugins  # defines torch.ops.lookahead.* (no CUDA build: select_ops registers the kernels)
from plugins import cpu


@dataclass(frozen=True)
class Ops:
    """One callable per op; the signatures are those of `plugins/CONTRACTS.md` and F.linear."""

    block_gather: Callable
    block_topk: Callable
    update_summaries: Callable
    lookahead_attention: Callable
    linear: Callable            # (x [M, K], weight [N, K] | Int8Weight, bias [N] | None) -> [M, N]
    name: str = ""

    def wrapped(self, wrap: Callable[[str, Callable], Callable], name: str | None = None) -> "Ops":
        """These ops with each callable replaced by `wrap(op_name, fn)` (tests: check, record)."""
        ops = {f.name: wrap(f.name, getattr(self, f.name)) for f in fields(self) if f.name != "name"}
        return Ops(**ops, name=name or f"{self.name}+wrapped")


def linear_int8_torch(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_int8's contract off the CPU: dequantize on the tensors' device, then F.linear."""
    return F.linear(x, cpu.ops.dequantize_int8(qweight, scale, x.dtype), bias)


def quantized_linear(dense: Callable, int8: Callable) -> Callable:
    """`linear` for an engine with int8 weights: a tensor weight goes to `dense`, an `Int8Weight`
    (anything else with qweight/scale) to `int8(x, qweight, scale, bias)`."""
    def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return dense(x, weight, bias)
        return int8(x, weight.qweight, weight.scale, bias)

    linear.__qualname__ = linear.__name__ = f"quantized_linear[{getattr(int8, '__name__', 'int8')}]"
    linear.parts = (dense, int8)       # what it dispatches to (the fused step checks them by identity)
    return linear


def select_ops(device: torch.device, dtype: torch.dtype, checked: bool = False, quantized: bool = False) -> Ops:
    """The ops for tensors of `dtype` on `device`. checked: the validating wrappers (tests).
    quantized: the model holds int8 weights (`Int8Weight`), which `linear` must also take.
    On a CUDA device the first call of a process builds (or loads) and registers the CUDA kernels."""
    if device.type == "cuda":
        plugins.ensure_cuda_kernels()
    # plugins.cpu.linear runs its C kernel for a decode step's few fp32 rows and is F.linear
    # otherwise; on a GPU F.linear is cuBLAS
    linear = cpu.linear if device.type == "cpu" and dtype == torch.float32 else F.linear
    if quantized:
        linear = quantized_linear(linear, cpu.linear_int8 if device.type == "cpu" else linear_int8_torch)
    if checked:
        return Ops(plugins.block_gather, plugins.block_topk, plugins.update_summaries,
                   plugins.lookahead_attention, linear, name=f"checked/{device.type}")
    if device.type == "cpu":
        d = plugins.direct
        return Ops(d.block_gather, d.block_topk, d.update_summaries, d.lookahead_attention, linear, name="direct/cpu")
    o = torch.ops.lookahead
    return Ops(o.block_gather, o.block_topk, o.update_summaries, o.lookahead_attention, linear,
               name=f"dispatch/{device.type}")
