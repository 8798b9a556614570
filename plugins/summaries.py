"""`lookahead::update_summaries`: fold appended keys into the per-block min/max summaries, in place."""
from __future__ import annotations

import torch

from ._common import FLOAT_DTYPES, check_range, check_same, check_shape, check_tensor, define_op, fail


def _update_summaries_impl(kmin: torch.Tensor, kmax: torch.Tensor, keys: torch.Tensor,
                           block_ids: torch.Tensor, block_offsets: torch.Tensor) -> None:
    # kmin/kmax: [num_blocks, KVH, D]; keys: [T, KVH, D]; block_ids, block_offsets: [T]
    T = keys.shape[0]
    if T == 0:
        return
    if keys.dtype != kmin.dtype:     # fp16 / bf16 keys (the KV cache's storage) into fp32 summaries:
        keys = keys.to(kmin.dtype)   # widening is exact, so min/max stay exact
    # Work on the touched blocks only: the pool may hold ~1e6 blocks, a step touches ~B.
    blocks, slot = torch.unique(block_ids, return_inverse=True)         # [U], [T]
    if blocks.numel() == T:
        # One key per block (every decode step): a restart takes the key, the rest an elementwise
        # min/max; no scatter (scatter_reduce is ~10x slower than this on CPU for a handful of rows).
        fresh = (block_offsets == 0).view(T, 1, 1)
        for summary, fold in ((kmin, torch.minimum), (kmax, torch.maximum)):
            cur = summary.index_select(0, block_ids)
            summary.index_copy_(0, block_ids, torch.where(fresh, keys, fold(cur, keys)))
        return
    order = torch.arange(T, device=keys.device)
    # Sequential semantics: a token at offset 0 restarts its block, so only the tokens from a
    # block's last restart on count. last_reset[u] = -1 when block u keeps its old summary.
    is_reset = block_offsets == 0
    last_reset = torch.full((blocks.numel(),), -1, dtype=torch.int64, device=keys.device)
    last_reset.scatter_reduce_(0, slot[is_reset], order[is_reset], "amax")
    counts = order >= last_reset[slot]                                   # [T]

    restarted = last_reset >= 0
    src_slot = slot[counts].view(-1, 1, 1).expand(-1, *keys.shape[1:])
    src_keys = keys[counts]
    for summary, reduce in ((kmin, "amin"), (kmax, "amax")):
        cur = summary.index_select(0, blocks)                            # [U, KVH, D]
        cur[restarted] = keys[last_reset[restarted]]
        # min/max are exact and order-free, so one scatter equals the sequential fold.
        cur.scatter_reduce_(0, src_slot, src_keys, reduce)
        summary.index_copy_(0, blocks, cur)


def _update_summaries_fake(kmin: torch.Tensor, kmax: torch.Tensor, keys: torch.Tensor,
                           block_ids: torch.Tensor, block_offsets: torch.Tensor) -> None:
    return None


NARROW_KEY_DTYPES = (torch.float16, torch.bfloat16)   # keys folded into float32 summaries


define_op("update_summaries", _update_summaries_impl, _update_summaries_fake, mutates_args=("kmin", "kmax"))


def update_summaries(kmin: torch.Tensor, kmax: torch.Tensor, keys: torch.Tensor, block_ids: torch.Tensor,
                     block_offsets: torch.Tensor, *, check_indices: bool = True) -> None:
    """Fold appended keys into their blocks' coordinate-wise min/max, in place.

    Tokens apply in order: a token at offset 0 resets its block's summary to its key (the block
    is new or reused); any other token takes the min/max with the summary. Several tokens may
    land in one block in one call (prefill); the result equals applying them one by one.

    Parameters
    ----------
    kmin, kmax : Tensor, [num_blocks, KVH, D], float32/float16/bfloat16
        One layer's summaries; modified in place for the touched blocks only.
    keys : Tensor, [T, KVH, D], dtype of ``kmin``, or float16 / bfloat16 into float32 summaries
        The appended post-RoPE keys (e.g. as the KV cache stores them); narrower keys are widened
        first, which is exact: the summaries hold exactly the stored keys' min/max.
    block_ids : Tensor, [T], int64
        Block of each key, in ``[0, num_blocks)``.
    block_offsets : Tensor, [T], int64
        Slot of each key within its block, ``>= 0``; only ``== 0`` has a meaning here.
    check_indices : bool
        Check the id and offset ranges (reads them: a device sync on CUDA).
    """
    check_tensor("kmin", kmin, 3, FLOAT_DTYPES)
    check_same("kmax", kmax, "kmin", kmin)
    check_shape("kmax", kmax, kmin.shape, "[num_blocks, KVH, D] like kmin")
    check_tensor("keys", keys, 3, FLOAT_DTYPES)
    if keys.device != kmin.device:
        fail("keys", f"device {keys.device} differs from kmin's {kmin.device}")
    if keys.dtype != kmin.dtype and not (kmin.dtype == torch.float32 and keys.dtype in NARROW_KEY_DTYPES):
        fail("keys", f"dtype {keys.dtype}: must be kmin's {kmin.dtype}, or float16 / bfloat16 into float32 summaries")
    if keys.shape[1:] != kmin.shape[1:]:
        fail("keys", f"expected [T, KVH, D] with (KVH, D) = {tuple(kmin.shape[1:])}, got {tuple(keys.shape)}")
    T = keys.shape[0]
    for arg, t in (("block_ids", block_ids), ("block_offsets", block_offsets)):
        check_tensor(arg, t, 1, torch.int64)
        check_shape(arg, t, (T,), "[T], one per key")
        if t.device != kmin.device:
            fail(arg, f"device {t.device} differs from kmin's {kmin.device}")
    if kmin.data_ptr() == kmax.data_ptr() and kmin.numel():
        fail("kmax", "aliases kmin; they must be separate tensors")
    if check_indices:
        check_range("block_ids", block_ids, 0, kmin.shape[0])
        check_range("block_offsets", block_offsets, 0)
    if keys.dtype != kmin.dtype and kmin.device.type != "cpu":
        keys = keys.to(kmin.dtype)   # the CUDA kernel reads keys as kmin's dtype: widen here (T rows)
    torch.ops.lookahead.update_summaries(kmin, kmax, keys, block_ids, block_offsets)
