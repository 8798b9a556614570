"""`lookahead::block_gather`: head-wise gather of KV blocks (host tier -> device tier)."""
from __future__ import annotations

import torch

from ._common import FLOAT_DTYPES, check_range, check_tensor, define_op, fail


def _block_gather_impl(src: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    # src: [NB, KVH, bs, D], block_ids: [KVH, n] -> [KVH, n, bs, D] on block_ids' device; an id of
    # -1 (an unused entry of a fixed-capacity list) gives a zero row, as the CUDA kernel does
    if block_ids.device != src.device:
        # The host -> device move: ids on the device name the blocks of a host pool (the CUDA
        # kernel reads pinned memory directly; here, gather on the host, then copy once).
        return _block_gather_impl(src, block_ids.to(src.device)).to(block_ids.device)
    num_blocks, num_kv_heads, block_size, head_dim = src.shape
    n = block_ids.shape[1]
    heads = torch.arange(num_kv_heads, device=block_ids.device).unsqueeze(1)  # [KVH, 1]
    unused = block_ids < 0
    ids = block_ids.clamp(min=0)          # no host read of whether any is unused: read row 0, zero it
    if src.is_contiguous():
        # A (block, head) pair is one contiguous row of bs*D elements: a single index_select of
        # whole rows is a memcpy per row, faster than advanced indexing over four dims.
        rows = src.view(num_blocks * num_kv_heads, block_size * head_dim)
        flat = (ids * num_kv_heads + heads).reshape(-1)                  # int64: no overflow
        out = rows.index_select(0, flat).view(num_kv_heads, n, block_size, head_dim)
    else:
        out = src[ids, heads]
    return out.masked_fill_(unused[..., None, None], 0)


def _block_gather_fake(src: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    return src.new_empty((src.shape[1], block_ids.shape[1], src.shape[2], src.shape[3]),
                         device=block_ids.device)


define_op("block_gather", _block_gather_impl, _block_gather_fake)


def block_gather(src: torch.Tensor, block_ids: torch.Tensor, *, check_indices: bool = True) -> torch.Tensor:
    """Gather per-KV-head blocks: ``out[h, i] = src[block_ids[h, i], h]``.

    Each KV head reads its own block list, so a head's working set moves independently.

    Parameters
    ----------
    src : Tensor, [num_blocks, num_kv_heads, block_size, head_dim], float32/float16/bfloat16
        One layer's KV pool (K or V). Not modified.
    block_ids : Tensor, [num_kv_heads, n], int64
        Block ids to read, each in ``[0, num_blocks)``; repeats are allowed. With
        ``check_indices=False`` an id may also be -1: a zero row, nothing read (the unused entries
        of a fixed-capacity list; the op does this on every device).
    check_indices : bool
        Check the id range (reads the ids: a device sync on CUDA).

    Returns
    -------
    Tensor, [num_kv_heads, n, block_size, head_dim], dtype and device of ``src``; a new tensor.
    """
    check_tensor("src", src, 4, FLOAT_DTYPES)
    check_tensor("block_ids", block_ids, 2, torch.int64)
    if block_ids.device != src.device:
        fail("block_ids", f"device {block_ids.device} differs from src's {src.device}")
    if block_ids.shape[0] != src.shape[1]:
        fail("block_ids", f"expected {src.shape[1]} rows (num_kv_heads of src), got {block_ids.shape[0]}")
    if check_indices:
        check_range("block_ids", block_ids, 0, src.shape[0])
    return torch.ops.lookahead.block_gather(src, block_ids)

