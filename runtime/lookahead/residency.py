"""Which logical block each selected device slot holds, and the capped-eviction admission rule.

Bookkeeping only (small int tensors, no KV bytes): `plan` decides, the transfer engine moves.
Shapes: `[num_buffers, lanes, KVH, K]`; a buffer is a layer (resident) or a ping-pong half.
The tables live on the engine's device, beside the slots they describe.
An inverse map (logical block -> slot) makes membership a gather instead of a K x K' compare.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from plugins.cpu import bookkeeping


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
    def __init__(self, num_buffers: int, num_lanes: int, num_kv_heads: int, top_k: int, max_blocks: int,
                 device: torch.device = torch.device("cpu")):
        shape = (num_buffers, num_lanes, num_kv_heads, top_k)
        self.top_k, self.max_blocks, self.device = top_k, max_blocks, device
        self.block = torch.full(shape, -1, dtype=torch.long, device=device)
        self.last_used = torch.full(shape, -1, dtype=torch.long, device=device)
        # slot_of[..., b] = slot holding logical block b, or -1; column max_blocks stands for "no
        # block" (-1 entries of a request) and stays -1
        self.slot_of = torch.full((num_buffers, num_lanes, num_kv_heads, max_blocks + 1), -1, dtype=torch.long,
                                  device=device)
        self.use_kernel = True          # tests compare the C plan with plan_torch
        # per buffer: every selected slot at or past high[buf] is empty in every lane (a bound that
        # only grows: attention leaves those slots out without looking at the table)
        self.high = [0] * num_buffers

    def reset_lane(self, lane: int) -> None:
        self.block[:, lane] = -1
        self.last_used[:, lane] = -1
        self.slot_of[:, lane] = -1

    def _col(self, blocks: torch.Tensor) -> torch.Tensor:
        return torch.where(blocks >= 0, blocks, self.max_blocks)

    def resident(self, buf: int, lanes: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """blocks [B, KVH, n] (-1 = none) -> bool [B, KVH, n]: is the block in a selected slot?"""
        return self.slot_of[buf, lanes].gather(-1, self._col(blocks)) >= 0

    def assign(self, buf: int, lanes: torch.Tensor, blocks: torch.Tensor, step: int) -> None:
        """Ping-pong refill: slot j of each (lane, head) now holds blocks[..., j]."""
        self.block[buf, lanes] = blocks
        self.high[buf] = max(self.high[buf], blocks.shape[-1])
        self.last_used[buf, lanes] = torch.where(blocks >= 0, step, -1)
        inv = torch.full_like(self.slot_of[buf, lanes], -1)
        slots = torch.arange(blocks.shape[-1], device=self.device).expand_as(blocks)
        inv.scatter_(-1, self._col(blocks), torch.where(blocks >= 0, slots, -1))
        inv[..., self.max_blocks] = -1
        self.slot_of[buf, lanes] = inv

    def plan(self, buf: int, lanes: torch.Tensor, want: torch.Tensor, priority: torch.Tensor,
             cap: int, step: int) -> Admission:
        """Admit up to `cap` missing wanted blocks per (lane, head), best `priority` first, each
        into the slot of a least-recently-selected block that is not wanted (empty slots first).
        `lanes`: a tensor of lane ids, or a slice of consecutive lanes (start set, step 1).

        want, priority: [B, KVH, K'] (want -1 = padding, K' <= K). Updates the table in place.
        On CPU this runs as one C call (plugins/cpu/residency.c); `plan_torch` is the same rule
        in torch ops, its reference in the tests.
        """
        adm = None
        if self.use_kernel:
            lane_ids = (torch.arange(lanes.start, lanes.start + want.shape[0], device=self.device)
                        if isinstance(lanes, slice)
                        else lanes)
            out = bookkeeping.plan(self.block[buf], self.last_used[buf], self.slot_of[buf], lane_ids, want,
                                   priority, cap, step)
            adm = Admission(*out) if out is not None else None
        if adm is None:
            adm = self.plan_torch(buf, lanes, want, priority, cap, step)
        if len(adm):
            self.high[buf] = max(self.high[buf], int(adm.slots.max()) + 1)
        return adm

    def plan_torch(self, buf: int, lanes: torch.Tensor, want: torch.Tensor, priority: torch.Tensor,
                   cap: int, step: int) -> Admission:
        """`plan` in torch ops."""
        held = self.block[buf, lanes]                                           # [B, KVH, K]
        last = self.last_used[buf, lanes]
        inv = self.slot_of[buf, lanes]
        valid = want >= 0
        where = inv.gather(-1, self._col(want))                                 # [B, KVH, K'] slot or -1
        missing = valid & (where < 0)
        # slots holding a wanted block: scatter into a spare column K for the not-held ones
        slot_wanted = torch.zeros(*held.shape[:-1], self.top_k + 1, dtype=torch.bool, device=self.device)
        slot_wanted.scatter_(-1, torch.where(where >= 0, where, self.top_k), True)
        slot_wanted = slot_wanted[..., : self.top_k]
        last = torch.where(slot_wanted, step, last)
        victims = torch.argsort(torch.where(slot_wanted, torch.iinfo(torch.long).max, last), dim=-1,
                                stable=True)
        order = torch.argsort(torch.where(missing, -priority, float("inf")), dim=-1, stable=True)
        if not bool(missing.any()):           # nothing to admit: only the recency update
            self.last_used[buf, lanes] = last
            empty = torch.zeros(0, dtype=torch.long, device=self.device)
            return Admission(empty, empty, empty, empty)
        n_admit = missing.sum(-1).clamp(max=cap)                                # [B, KVH]
        take = torch.arange(want.shape[-1], device=self.device) < n_admit[..., None]                # [B, KVH, K']
        b_idx, h_idx, j_idx = take.nonzero(as_tuple=True)
        slots = victims[b_idx, h_idx, j_idx]
        blocks = want.gather(-1, order)[b_idx, h_idx, j_idx]
        evicted = held[b_idx, h_idx, slots]
        inv[b_idx, h_idx, self._col(evicted)] = -1
        inv[b_idx, h_idx, blocks] = slots
        inv[..., self.max_blocks] = -1
        held[b_idx, h_idx, slots] = blocks
        last[b_idx, h_idx, slots] = step
        self.last_used[buf, lanes] = last
        if not isinstance(lanes, slice):     # a slice indexes views: held and inv were updated in place
            self.block[buf, lanes] = held
            self.slot_of[buf, lanes] = inv
        lane_ids = b_idx + lanes.start if isinstance(lanes, slice) else lanes[b_idx]
        return Admission(lane_ids, h_idx, slots, blocks)
