"""Which logical block each selected device slot holds, and the capped-eviction admission rule.

Bookkeeping only (small int tensors, no KV bytes): `plan` decides, the transfer engine moves.
Shapes: `[num_buffers, lanes, KVH, K]`; a buffer is a layer (resident) or a ping-pong half.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Admission:
    """Blocks to copy in: slot `slots[i]` of (lanes[i], heads[i]) receives logical block `blocks[i]`."""

    lanes: torch.Tensor
    heads: torch.Tensor
    slots: torch.Tensor
    blocks: torch.Tensor

    def __len__(self) -> int:
        return int(self.lanes.numel())


class SlotTable:
    def __init__(self, num_buffers: int, num_lanes: int, num_kv_heads: int, top_k: int):
        shape = (num_buffers, num_lanes, num_kv_heads, top_k)
        self.block = torch.full(shape, -1, dtype=torch.long)
        self.last_used = torch.full(shape, -1, dtype=torch.long)

    def reset_lane(self, lane: int) -> None:
        self.block[:, lane] = -1
        self.last_used[:, lane] = -1

    def resident(self, buf: int, lanes: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """blocks [B, KVH, n] (-1 = none) -> bool [B, KVH, n]: is the block in a selected slot?"""
        held = self.block[buf, lanes]                                           # [B, KVH, K]
        return ((blocks[..., :, None] == held[..., None, :]) & (held >= 0)[..., None, :]).any(-1) & (blocks >= 0)

    def assign(self, buf: int, lanes: torch.Tensor, blocks: torch.Tensor, step: int) -> None:
        """Ping-pong refill: slot j of each (lane, head) now holds blocks[..., j]."""
        self.block[buf, lanes] = blocks
        self.last_used[buf, lanes] = torch.where(blocks >= 0, step, -1)

    def plan(self, buf: int, lanes: torch.Tensor, want: torch.Tensor, priority: torch.Tensor,
             cap: int, step: int) -> Admission:
        """Admit up to `cap` missing wanted blocks per (lane, head), best `priority` first, each
        into the slot of a least-recently-selected block that is not wanted (empty slots first).

        want, priority: [B, KVH, K'] (want -1 = padding, K' <= K). Updates the table in place.
        """
        held = self.block[buf, lanes]                                           # [B, KVH, K]
        last = self.last_used[buf, lanes]
        valid = want >= 0
        eq = (held[..., :, None] == want[..., None, :]) & valid[..., None, :]  # [B, KVH, K, K']
        slot_wanted = eq.any(-1) & (held >= 0)                                  # keep these
        missing = valid & ~eq.any(-2)                                           # [B, KVH, K']
        last = torch.where(slot_wanted, step, last)
        victims = torch.argsort(torch.where(slot_wanted, torch.iinfo(torch.long).max, last), dim=-1,
                                stable=True)
        order = torch.argsort(torch.where(missing, -priority, float("inf")), dim=-1, stable=True)
        n_admit = missing.sum(-1).clamp(max=cap)                                # [B, KVH]
        k_want = want.shape[-1]
        take = torch.arange(k_want) < n_admit[..., None]                        # [B, KVH, K']
        b_idx, h_idx, j_idx = take.nonzero(as_tuple=True)
        slots = victims[b_idx, h_idx, j_idx]
        blocks = want.gather(-1, order)[b_idx, h_idx, j_idx]
        held[b_idx, h_idx, slots] = blocks
        last[b_idx, h_idx, slots] = step
        self.block[buf, lanes] = held
        self.last_used[buf, lanes] = last
        return Admission(lanes[b_idx], h_idx, slots, blocks)
