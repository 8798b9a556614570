"""The lookahead ops, registered as `torch.ops.lookahead.*` on import (once).

    block_gather         head-wise gather of KV blocks (host tier -> device tier)
    block_topk           Quest upper-bound block scores + head-wise top-K per KV head
    update_summaries     in-place per-block min/max key summaries
    lookahead_attention  dual-row sparse attention with GQA

Each op has a torch implementation (any device; written for CPU), a plain-torch reference in
`plugins.reference`, and a contract in `plugins/CONTRACTS.md`. The wrappers below validate
arguments and dispatch through `torch.ops.lookahead`, so CUDA kernels registered by
`plugins.cuda` take over for CUDA tensors without changing callers.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from . import reference
from .attention import _lookahead_attention_impl, lookahead_attention
from .gather import _block_gather_impl, block_gather
from .summaries import _update_summaries_impl, update_summaries
from .topk import _block_topk_impl, block_topk

__all__ = ["block_gather", "block_topk", "update_summaries", "lookahead_attention", "reference", "direct"]

# The ops' implementations without the dispatcher, for callers that build every argument
# themselves on CPU tensors (the lookahead runtime's hot path): a `torch.ops.lookahead` call
# costs ~0.1 ms of dispatch here (torch profiler), about what a decode-size op computes in.
# Not for CUDA tensors: there the dispatcher is what routes to plugins.cuda's kernels.
direct = SimpleNamespace(block_gather=_block_gather_impl, block_topk=_block_topk_impl,
                         update_summaries=_update_summaries_impl, lookahead_attention=_lookahead_attention_impl)

logger = logging.getLogger(__name__)


def _register_cuda_kernels() -> None:
    """Override the CUDA dispatch key with `plugins.cuda`'s kernels where a GPU and they exist."""
    if not torch.cuda.is_available():
        return
    try:
        from .cuda.loader import register_cuda_kernels
    except ImportError as e:
        logger.debug("plugins.cuda not available (%s); the torch implementations serve CUDA", e)
        return
    try:
        register_cuda_kernels()
    except Exception as e:  # a failed build must not take the ops down: torch impls still work
        logger.warning("CUDA kernels for torch.ops.lookahead failed to register (%s: %s); "
                       "using the torch implementations", type(e).__name__, e)


_register_cuda_kernels()
