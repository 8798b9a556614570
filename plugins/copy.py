"""`lookahead::copy_blocks`: copy (block, KV head) units of K and V into device slots, in place.

What a copy job of the residency manager does (runtime/transfer/base.py, `CopyJob`): for entry
i, `dst[lanes[i], dst_heads[i], slots[i]] = src[blocks[i], src_heads[i]]` for K and V alike. On a GPU
the source is the host pool, read from pinned memory by the kernel, and one launch copies a
whole job; `valid` (a fixed-capacity list) skips entries without a host read.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._common import FLOAT_DTYPES, check_range, check_shape, check_tensor, define_op, fail


def _copy_blocks_impl(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                      blocks: torch.Tensor, src_heads: torch.Tensor, lanes: torch.Tensor, dst_heads: torch.Tensor,
                      slots: torch.Tensor, valid: Optional[torch.Tensor]) -> None:
    # src [NB, KVH, bs, D]; dst [L, KVH, S, bs, D]; the indices and valid [n]
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        rows = src[blocks.to(src.device), src_heads.to(src.device)].to(dst.device)   # a skipped entry: any row
        if valid is not None:          # skipped entries write their destination's own contents back
            rows = torch.where(valid.view(-1, 1, 1), rows, dst[lanes, dst_heads, slots])
        dst[lanes, dst_heads, slots] = rows


def _copy_blocks_fake(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                      blocks: torch.Tensor, src_heads: torch.Tensor, lanes: torch.Tensor, dst_heads: torch.Tensor,
                      slots: torch.Tensor, valid: Optional[torch.Tensor]) -> None:
    return None


define_op("copy_blocks", _copy_blocks_impl, _copy_blocks_fake, mutates_args=("dst_k", "dst_v"))


def copy_blocks(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                blocks: torch.Tensor, src_heads: torch.Tensor, lanes: torch.Tensor, dst_heads: torch.Tensor,
                slots: torch.Tensor, valid: torch.Tensor | None = None, *, check_indices: bool = True) -> None:
    """Copy units of K and V: ``dst[lanes[i], dst_heads[i], slots[i]] = src[blocks[i], src_heads[i]]``.

    Parameters
    ----------
    src_k, src_v : Tensor, [NB, KVH, bs, D]
        One layer of the host pool (any strides; on a GPU: pinned host memory or the device).
    dst_k, dst_v : Tensor, [L, KVH, S, bs, D], dtype of src, updated in place
        One buffer of the device tier.
    blocks, src_heads, lanes, dst_heads, slots : Tensor, [n], int64
        Entry i's source block and KV head, and its destination lane, KV head and slot. Every
        entry's destination, skipped or not, is distinct.
    valid : Tensor, [n], bool, optional
        A fixed-capacity list: only entries with ``valid[i]`` are copied; the others leave their
        destination as it was (their indices must still be in range; a skipped block may be -1).
    """
    check_tensor("src_k", src_k, 4, FLOAT_DTYPES)
    check_shape("src_v", src_v, src_k.shape, "[NB, KVH, bs, D] like src_k")
    check_tensor("dst_k", dst_k, 5, src_k.dtype)
    check_shape("dst_v", dst_v, dst_k.shape, "[L, KVH, S, bs, D] like dst_k")
    if dst_k.shape[1] != src_k.shape[1] or dst_k.shape[3:] != src_k.shape[2:]:
        fail("dst_k", f"expected [L, {src_k.shape[1]}, S, {src_k.shape[2]}, {src_k.shape[3]}] like src_k, "
                      f"got {tuple(dst_k.shape)}")
    for name, t in (("src_v", src_v), ("dst_v", dst_v)):
        if t.dtype != src_k.dtype:
            fail(name, f"dtype {t.dtype} differs from src_k's {src_k.dtype}")
    n = blocks.shape[0] if blocks.dim() == 1 else -1
    indices = (("blocks", blocks), ("src_heads", src_heads), ("lanes", lanes), ("dst_heads", dst_heads),
               ("slots", slots))
    for name, t in indices:
        check_tensor(name, t, 1, torch.int64)
        check_shape(name, t, (n,), "[n] like blocks")
    if valid is not None:
        check_tensor("valid", valid, 1, torch.bool)
        check_shape("valid", valid, (n,), "[n] like blocks")
    if check_indices:
        check_range("blocks", blocks if valid is None else blocks[valid], 0, src_k.shape[0])
        check_range("src_heads", src_heads, 0, src_k.shape[1])
        check_range("lanes", lanes, 0, dst_k.shape[0])
        check_range("dst_heads", dst_heads, 0, dst_k.shape[1])
        check_range("slots", slots, 0, dst_k.shape[2])
    torch.ops.lookahead.copy_blocks(src_k, src_v, dst_k, dst_v, blocks, src_heads, lanes, dst_heads, slots, valid)
