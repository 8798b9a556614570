"""torch-facing wrappers of residency.c: the lookahead runtime's slot planning and block copies.

Both return None (plan) or False (copy) when the C library or the layout does not apply; the
callers then run their torch formulation.
"""
from __future__ import annotations

import ctypes

import torch

from .abi import Status, raise_for
from .ops import loaded as library, traced


def plan(block: torch.Tensor, last_used: torch.Tensor, slot_of: torch.Tensor, lanes: torch.Tensor,
         want: torch.Tensor, priority: torch.Tensor, cap: int, step: int):
    """SlotTable.plan on one buffer's tables (block/last_used [lanes, KVH, K], slot_of [lanes, KVH,
    MB + 1], updated in place) -> (lanes, heads, slots, blocks) of the admissions, or None."""
    lib = library()
    if (lib is None or not (block.is_contiguous() and last_used.is_contiguous() and slot_of.is_contiguous())
            or block.dtype != torch.int64 or block.device.type != "cpu"):
        return None
    want = want.to(torch.int64).contiguous()
    priority = priority.to(torch.float32).contiguous()
    lanes = lanes.to(torch.int64).contiguous()
    B, kvh, kw = want.shape
    if priority.shape != want.shape or lanes.shape != (B,) or kvh != block.shape[1]:
        return None                     # plan_torch raises its own error
    cap_rows = max(0, min(cap, kw))
    out = torch.empty(4, B * kvh * cap_rows, dtype=torch.int64)
    with traced("plan"):
        n = lib.lkv_plan(block.data_ptr(), last_used.data_ptr(), slot_of.data_ptr(), lanes.data_ptr(), block.shape[0],
                         B, kvh, block.shape[-1], slot_of.shape[-1] - 1, want.data_ptr(), priority.data_ptr(), kw,
                         cap_rows, step, *(out.data_ptr() + i * out.stride(0) * 8 for i in range(4)))
    if n < 0:
        raise_for(n, "SlotTable.plan", None if n != Status.RANGE else
                  f"a lane outside [0, {block.shape[0]}) or a wanted block outside [-1, {slot_of.shape[-1] - 1})")
    return out[:, :n].unbind(0)


def copy_blocks(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                src_index: tuple[torch.Tensor, ...], dst_index: tuple[torch.Tensor, ...],
                valid: torch.Tensor | None = None) -> bool:
    """dst[lanes, heads, slots] = src[blocks, heads] for K and V (CopyJob's layouts: src [NB, KVH,
    bs, D], dst [lanes, KVH, slots, bs, D]); False when the C path does not apply (nothing done).
    valid: bool [n], the entries to copy of a fixed-capacity list (host memory, like every
    tensor of this path: selecting them reads no device)."""
    lib = library()
    # residency.c copies bytes (memcpy) in 4-byte words: a 16-bit pool is addressed as pairs of
    # elements, which every unit (bs x D, D even) and every stride of these layouts is
    words = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 2}.get(src_k.dtype)
    unit = src_k.shape[2] * src_k.shape[3]
    strides = (*src_k.stride()[:2], *dst_k.stride()[:3])
    if (lib is None or words is None or src_k.device.type != "cpu"
            or any(t.dtype != src_k.dtype or t.device.type != "cpu" for t in (src_v, dst_k, dst_v))
            or src_k.shape != src_v.shape or dst_k.shape != dst_v.shape
            or src_k.stride() != src_v.stride() or dst_k.stride() != dst_v.stride()
            or src_k.stride()[2:] != (src_k.shape[3], 1) or dst_k.stride()[3:] != (dst_k.shape[4], 1)
            or dst_k.shape[3:] != src_k.shape[2:] or unit % words or any(st % words for st in strides)
            or any(t.data_ptr() % 4 for t in (src_k, src_v, dst_k, dst_v))):
        return False
    if valid is not None:
        if valid.device.type != "cpu" or any(t.device.type != "cpu" for t in (*src_index, *dst_index)):
            return False
        src_index, dst_index = (tuple(t[valid] for t in ix) for ix in (src_index, dst_index))
    sb, sh = (t.to(torch.int64).contiguous() for t in src_index)
    dl, dh, ds = (t.to(torch.int64).contiguous() for t in dst_index)
    if any(t.dim() != 1 or t.numel() != sb.numel() for t in (sh, dl, dh, ds)):
        return False                    # indexing raises its own error for mismatched indices
    with traced("copy_blocks"):
        s_blk, s_head, d_lane, d_head, d_slot = (st // words for st in strides)
        rc = lib.lkv_copy_blocks(src_k.data_ptr(), src_v.data_ptr(), s_blk, s_head,
                                 dst_k.data_ptr(), dst_v.data_ptr(), d_lane, d_head, d_slot,
                                 sb.data_ptr(), sh.data_ptr(), dl.data_ptr(), dh.data_ptr(), ds.data_ptr(), sb.numel(),
                                 unit // words, src_k.shape[0], src_k.shape[1], dst_k.shape[0], dst_k.shape[2])
    if rc != 0:
        raise_for(rc, "copy_blocks", f"an index outside src [{src_k.shape[0]}, {src_k.shape[1]}] or dst "
                                     f"[{dst_k.shape[0]}, {dst_k.shape[1]}, {dst_k.shape[2]}]")
    return True


def c_copy_kernel() -> int | None:
    """The address of residency.c's lkv_copy_blocks, what `copy_blocks` runs: for a C caller that
    makes a copy inline (lookahead_layer.c's urgent copy, handed over by the transfer engine);
    None without the library."""
    lib = library()
    return None if lib is None else ctypes.cast(lib.lkv_copy_blocks, ctypes.c_void_p).value


copy_blocks.c_kernel = c_copy_kernel
