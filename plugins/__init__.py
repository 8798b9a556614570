"""The lookahead ops, defined as `torch.ops.lookahead.*` on import (once); importing compiles nothing.

    block_gather         head-wise gather of KV blocks (host tier -> device tier)
    block_topk           Quest upper-bound block scores + head-wise top-K per KV head
    update_summaries     in-place per-block min/max key summaries
    lookahead_attention  dual-row sparse attention with GQA
    plan_slots           capped admission into a lane's selected slots (the residency's slot plan)
    copy_blocks          a copy job's (block, KV head) units of K and V into device slots

Each op has a torch implementation (any device; written for CPU), a plain-torch reference in
`plugins.reference`, and a contract in `plugins/CONTRACTS.md`. The wrappers below validate
arguments and dispatch through `torch.ops.lookahead`, so CUDA kernels registered by
`plugins.cuda` take over for CUDA tensors without changing callers.

The CUDA kernels are not built at import: `ensure_cuda_kernels()` builds (or loads the prebuilt)
extension and registers it, once per process. The runtime calls it where an engine selects its
ops for a CUDA device (`runtime.ops.select_ops`) and where the CUDA transfer engine starts;
`scripts/gpu_check.sh` builds the extension as the first step of its kernels stage.
"""
from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import torch

from . import reference
from .attention import _lookahead_attention_impl, lookahead_attention
from .copy import _copy_blocks_impl, copy_blocks
from .gather import _block_gather_impl, block_gather
from .plan import _plan_slots_impl, plan_slots
from .summaries import _update_summaries_impl, update_summaries
from .topk import _block_topk_impl, block_topk

__all__ = ["block_gather", "block_topk", "update_summaries", "lookahead_attention", "plan_slots", "copy_blocks",
           "reference", "direct",
           "ensure_cuda_kernels"]

# The ops' implementations without the dispatcher, for callers that build every argument
# themselves on CPU tensors (the lookahead runtime's hot path): a `torch.ops.lookahead` call
# costs ~0.1 ms of dispatch here (torch profiler), about what a decode-size op computes in.
# Not for CUDA tensors: there the dispatcher is what routes to plugins.cuda's kernels.
direct = SimpleNamespace(block_gather=_block_gather_impl, block_topk=_block_topk_impl,
                         update_summaries=_update_summaries_impl, lookahead_attention=_lookahead_attention_impl,
                         plan_slots=_plan_slots_impl, copy_blocks=_copy_blocks_impl)

logger = logging.getLogger(__name__)


def _register_cuda_kernels() -> bool:
    """One attempt: override the CUDA dispatch key with `plugins.cuda`'s kernels where a GPU and
    they exist. True when registered; a failure logs a warning and keeps the torch implementations."""
    if not torch.cuda.is_available():
        return False
    try:
        from .cuda.loader import register_cuda_kernels
    except ImportError as e:
        logger.debug("plugins.cuda not available (%s); the torch implementations serve CUDA", e)
        return False
    try:
        register_cuda_kernels()
    except Exception as e:  # a failed build must not take the ops down: torch impls still work
        logger.warning("CUDA kernels for torch.ops.lookahead failed to register (%s: %s); "
                       "using the torch implementations", type(e).__name__, e)
        return False
    return True


_CUDA_KERNELS: dict[str, bool] = {}       # the answer of this process's one attempt
_CUDA_LOCK = threading.Lock()


def ensure_cuda_kernels() -> bool:
    """Make `plugins.cuda`'s kernels the CUDA kernels of `torch.ops.lookahead.*`, once per process.

    Builds the extension on the first call of a machine (15-25 s on 16 cores; cached on disk
    after), or imports the prebuilt one (`plugins.cuda.loader`). Returns whether the kernels are
    registered: False without a GPU, and when the build fails (a warning says why, and the
    torch implementations keep serving CUDA tensors). Later calls return the first answer."""
    with _CUDA_LOCK:
        if "registered" not in _CUDA_KERNELS:
            _CUDA_KERNELS["registered"] = _register_cuda_kernels()
        return _CUDA_KERNELS["registered"]
