"""Shared plumbing for the ops: idempotent registration and argument checks.

Every public wrapper validates its arguments here before dispatch, so a caller's mistake is a
`ValueError` that names the argument, never an index error from deep inside a kernel.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

NAMESPACE = "lookahead"
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def define_op(name: str, impl: Callable, fake: Callable, mutates_args: Iterable[str] = ()) -> None:
    """Register `lookahead::<name>` with `impl` for every device and `fake` for meta/compile.

    The torch implementation is registered without `device_types`, so it serves any device;
    `plugins.cuda` overrides the CUDA key with its kernels. Registering twice (a module reload)
    is a no-op: the dispatcher refuses duplicate schemas, and the first registration stands.
    """
    if hasattr(getattr(torch.ops, NAMESPACE), name):
        return
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=tuple(mutates_args))
    op.register_fake(fake)


def fail(arg: str, problem: str) -> None:
    raise ValueError(f"{arg}: {problem}")


def check_tensor(arg: str, t: object, ndim: int, dtypes: Sequence[torch.dtype] | torch.dtype) -> None:
    """`t` is a tensor of rank `ndim` whose dtype is one of `dtypes`."""
    if not isinstance(t, torch.Tensor):
        fail(arg, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        fail(arg, f"expected {ndim} dimensions, got shape {tuple(t.shape)}")
    allowed = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    if t.dtype not in allowed:
        fail(arg, f"expected dtype in {[str(d) for d in allowed]}, got {t.dtype}")


def check_shape(arg: str, t: torch.Tensor, expected: Sequence[int], what: str) -> None:
    """`t.shape == expected`; `what` names the dims, e.g. "[B, KVH, N] like kv_mask"."""
    if tuple(t.shape) != tuple(expected):
        fail(arg, f"expected shape {tuple(expected)} {what}, got {tuple(t.shape)}")


def check_same(arg: str, t: torch.Tensor, ref_arg: str, ref: torch.Tensor) -> None:
    """`t` shares dtype and device with `ref` (kernels read both with one element type)."""
    if t.dtype != ref.dtype:
        fail(arg, f"dtype {t.dtype} differs from {ref_arg}'s {ref.dtype}")
    if t.device != ref.device:
        fail(arg, f"device {t.device} differs from {ref_arg}'s {ref.device}")


def check_range(arg: str, t: torch.Tensor, low: int, high: int | None = None) -> None:
    """Every element of the integer tensor `t` lies in [low, high) (no upper bound if `high` is None).

    Reads the values (a device sync on CUDA); wrappers let hot-path callers whose indices come
    from their own bookkeeping skip it with `check_indices=False`.
    """
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low or (high is not None and hi >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        fail(arg, f"values must be {bound}, got min {lo}, max {hi}")
