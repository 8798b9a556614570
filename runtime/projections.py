"""A model's projections (and RMSNorms) with their kernels bound once, when the weights load.

    proj = Projections.bind(model)          # every layer's wqkv, wo, w13, w2, its norms, the logits head
    proj.layers[i].wqkv.decode(x)           # a decode row's kernel; .prefill(x): a prompt row's
    proj.fallbacks, proj.nbytes, proj.kernels()

For each projection and each kind of row, the kernel table's entry (`ops.decode_linear` or
`ops.linear` for decode rows and the logits, `ops.prefill_linear` for a prompt's) is bound to the
weight here: a C entry through its binder (`ops.BINDERS`: plugins/cpu/ops.py and prefill.py), which checks the weight once,
makes the packed copy now and returns a kernel that checks nothing per call; where the C kernel
does not take the weight, the op's torch formulation, with the reason in `fallbacks` (the engine
logs each at WARNING and reports them in `stats()["kernel_fallbacks"]`). Any other entry (the torch
table, a test's wrapped table) is called as it is, with the weight.

This is where the kernels of the model's weights are decided; runtime/ops.py decides the table
(which implementation of each op, at which precision) and the engine binds the pool-side ops its
mode calls (prompt and decode attention, block top-K, summary updates) to its pool here
(`bind_pool_kernels`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from .ops import BINDERS, NO_UNITS, POOL_BINDERS, POOL_ENTRIES, Kernel, Ops, QuantizedLinear


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def bind_weight(entry: Callable, weight, bias: torch.Tensor | None = None) -> Kernel:
    """`entry` (a kernel table's linear entry) bound to `weight` (a tensor or an Int8Weight) and
    `bias`: its binder's kernel for a C entry, else a call of the entry itself."""
    if isinstance(entry, QuantizedLinear):
        entry, args = (entry.dense, (weight,)) if isinstance(weight, torch.Tensor) else \
            (entry.int8, (weight.qweight, weight.scale))
    else:
        args = (weight,)
    binder = BINDERS.get(entry)
    if binder is not None:
        return binder(*args, bias)
    return Kernel(lambda x: entry(x, weight, bias), _name(entry))


@dataclass(frozen=True)
class Projection:
    """One weight's kernels: `decode` for a decode step's rows (and the logits), `prefill` for a
    prompt chunk's (the same kernel where the table has no prefill entry)."""

    name: str
    decode: Kernel
    prefill: Kernel


@dataclass(frozen=True)
class LayerProjections:
    """A layer's projections and its RMSNorms (each row alike: one kernel for every kind of row;
    q_norm / k_norm: qwen3's per-head norms, None elsewhere)."""

    wqkv: Projection
    wo: Projection
    w13: Projection
    w2: Projection
    attn_norm: Kernel
    mlp_norm: Kernel
    q_norm: Kernel | None = None
    k_norm: Kernel | None = None


def bind_norm(norm, ops: Ops) -> Kernel:
    """An RMSNorm module (weight [N], eps) bound to the table's `rms_norm`: the C binder's kernel,
    or the entry itself; a 16-bit weight takes the module's own upcasting formula."""
    w, eps = norm.weight, norm.eps
    if w.dtype != torch.float32:
        return Kernel(norm.upcast, "rms_norm(upcast)")
    binder = BINDERS.get(ops.rms_norm)
    if binder is not None:
        return binder(w, eps)
    entry = ops.rms_norm
    return Kernel(lambda x: entry(x, w, eps), _name(entry))


@dataclass(frozen=True)
class Projections:
    """Every projection of a model bound to its table's kernels (see the module docstring)."""

    layers: tuple[LayerProjections, ...]
    head: Projection                 # the logits' projection (the tied embedding or lm_head)
    norm: Kernel                     # the final RMSNorm
    ops_name: str

    @classmethod
    def bind(cls, model) -> "Projections":
        """`model`'s (a LlamaModel with its weights loaded) projections bound to `model.ops`."""
        ops: Ops = model.ops
        dec = ops.decode_linear or ops.linear
        pf = ops.prefill_linear

        def proj(name: str, module) -> Projection:
            w, b = module.weight, getattr(module, "bias", None)
            d = bind_weight(dec, w, b)
            p = bind_weight(pf, w, b) if pf is not None else (d if dec is ops.linear else bind_weight(ops.linear, w, b))
            return Projection(name, d, p)
        def norm(module) -> Kernel | None:
            return bind_norm(module, ops) if module is not None else None
        layers = tuple(LayerProjections(*(proj(f"layers.{i}.{n}", getattr(layer, n)) for n in ("wqkv", "wo", "w13", "w2")),
                                        *(norm(getattr(layer, n)) for n in ("attn_norm", "mlp_norm", "q_norm", "k_norm")))
                       for i, layer in enumerate(model.layers))
        head_module = model.embed_tokens if model.lm_head is None else model.lm_head
        head = Projection("logits", *(2 * (bind_weight(dec, head_module.weight, None),)))
        return cls(layers, head, norm(model.norm), ops.name)

    def all(self) -> list[Projection]:
        return [p for layer in self.layers for p in (layer.wqkv, layer.wo, layer.w13, layer.w2)] + [self.head]

    def norms(self) -> list[tuple[str, Kernel]]:
        return [(f"layers.{i}.{n}", k) for i, layer in enumerate(self.layers)
                for n in ("attn_norm", "mlp_norm", "q_norm", "k_norm")
                if (k := getattr(layer, n)) is not None] + [("norm", self.norm)]

    def kernels(self) -> dict[str, int]:
        """{"decode <impl>" / "prefill <impl>": how many projections run it; "norm <impl>": how many
        RMSNorms}."""
        out: dict[str, int] = {}
        for key in [f"{kind} {k.impl}" for p in self.all() for kind, k in (("decode", p.decode), ("prefill", p.prefill))] \
                + [f"norm {k.impl}" for _, k in self.norms()]:
            out[key] = out.get(key, 0) + 1
        return out

    @property
    def fallbacks(self) -> list[str]:
        """One line per (kind, reason): the projections whose C kernel does not take their weight
        and which run the op's torch formulation instead. A CPU without a precision's units is left
        to `ops.kernel_fallbacks`, which says it once for the whole table, with the fix."""
        seen: dict[tuple[str, str], list[str]] = {}
        for p in self.all():
            kinds = (("decode and prompt", p.decode),) if p.prefill is p.decode else \
                (("decode", p.decode), ("prompt", p.prefill))
            for kind, k in kinds:
                if k.fallback and not k.fallback.startswith(NO_UNITS):
                    seen.setdefault((f"{kind} rows of", k.fallback), []).append(p.name)
        for name, k in self.norms():
            if k.fallback:
                seen.setdefault(("every row of", k.fallback), []).append(name)
        return [f"{kind} {len(names)} {'RMSNorm' if 'norm' in names[0] else 'projection'}(s) "
                f"({names[0]}{', ...' if len(names) > 1 else ''}) run the torch formulation: {why}"
                for (kind, why), names in seen.items()]

    @property
    def nbytes(self) -> int:
        """Bytes of the packed copies the bound kernels hold (each counted once)."""
        seen: dict[int, int] = {}
        for p in self.all():
            for k in (p.decode, p.prefill):
                for b in k.buffers:
                    seen[b.data_ptr()] = b.numel() * b.element_size()
        return sum(seen.values())


def step_projection(batch=None, prompt: bool = False) -> Callable:
    """The projection of a step (a `StepBatch`): `linear(x, projection)` runs prompt-chunk rows
    through the projection's prefill kernel and decode rows through its decode kernel, each row as
    in a step of its own kind alone. prompt: every row is a prompt's (no batch); no batch: the
    decode kernel for every row."""
    if prompt or (batch is not None and batch.all_prompt):
        return _prefill_rows
    split = batch.row_kinds if batch is not None else None
    if split is None:
        return _decode_rows
    rows_prompt, rows_rest = split

    def linear(x: torch.Tensor, p: Projection) -> torch.Tensor:
        if p.prefill is p.decode:
            return p.decode(x)
        a = p.prefill(x[rows_prompt])
        out = x.new_empty(x.shape[0], a.shape[1])
        out[rows_prompt] = a
        out[rows_rest] = p.decode(x[rows_rest])
        return out
    return linear


def _decode_rows(x: torch.Tensor, p: Projection) -> torch.Tensor:
    return p.decode(x)


def _prefill_rows(x: torch.Tensor, p: Projection) -> torch.Tensor:
    return p.prefill(x)


# what each pool-side entry computes, for a fallback's line; and which entries a mode's steps call
POOL_OPS = {"prefill_attention": "prompt attention", "paged_attention": "dense decode attention",
            "lookahead_attention": "lookahead decode attention", "block_topk": "block top-K selection",
            "update_summaries": "block summary updates"}
MODE_POOL_OPS = {"dense": ("prefill_attention", "paged_attention"),
                 "sparse": ("prefill_attention", "paged_attention", "block_topk", "update_summaries"),
                 "lookahead": ("prefill_attention", "lookahead_attention", "block_topk", "update_summaries")}


def bind_pool_kernels(ops: Ops, pool_k: torch.Tensor, pool_v: torch.Tensor, num_heads: int,
                      mode: str = "lookahead", dtype: torch.dtype = torch.float32) -> tuple[Ops, list[str]]:
    """`ops` with the pool-side entries a `mode` engine calls bound to its KV pool ([L, KVH, NB,
    bs, D] K and V; the device tier and the fp32 block summaries share its KV heads and head_dim)
    and its queries (`dtype`, the model's): each entry's layout checked once, here, and why any of
    them runs the torch formulation instead of its C kernel (one line each; empty: none does). An
    entry that is not the C table's (a torch or test table) is left as it is (a table with none
    is returned as it is). A dense decode attention the kernel does not take is None in the
    returned table: the batched torch path attends (as on a torch table)."""
    kvh, D = pool_k.shape[-4], pool_k.shape[-1]
    dev, dt = pool_k.device, pool_k.dtype
    args = {"prefill_attention": (pool_k, pool_v, num_heads), "paged_attention": (pool_k, pool_v, num_heads, dtype),
            "lookahead_attention": (dev, dt, D, num_heads, kvh, 2 if mode == "lookahead" else 1, dtype),
            "block_topk": (dev, D, num_heads, kvh), "update_summaries": (dev, D, kvh)}
    bound, why = {}, []
    for name in MODE_POOL_OPS[mode]:
        if getattr(ops, name) is not POOL_ENTRIES[name]:
            continue
        k = POOL_BINDERS[name](*args[name])
        bound[name] = k.fn
        if k.fallback:
            why.append(f"{POOL_OPS[name]} runs the torch formulation: {k.fallback}")
    return (replace(ops, **bound) if bound else ops), why
