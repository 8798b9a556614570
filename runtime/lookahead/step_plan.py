"""Per-step tensors of the lookahead backend, built once per step by the runner, read by every layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..step import StepBatch, StepItem
from .layout import SlotLayout


@dataclass
class PrefillPart:
    item: StepItem
    lane: int
    completes_prompt: bool


@dataclass
class DecodePart:
    """The decode lanes of a step: each has a real row (stored) and a draft row (never stored)."""

    lanes: torch.Tensor            # [B] lane of each decoding sequence
    real_rows: torch.Tensor        # [B] row of the real token in the flat batch
    draft_rows: torch.Tensor       # [B]
    num_lanes: int                 # lanes [0, num_lanes) are computed; inactive ones are masked out
    base_mask: torch.Tensor        # [num_lanes, (S + Wb) * bs] bool: sink + window tokens visible
    lane_active: torch.Tensor      # [num_lanes] bool
    cand_masks: torch.Tensor       # [num_lanes, 2, max_blocks] bool: top-K candidates of the real
                                   # query (this step) and of the draft query (the next step)
    context_lens: list[int]        # per decoding lane, after this step's real token

    @property
    def size(self) -> int:
        return int(self.lanes.numel())


@dataclass
class StepPlan:
    batch: StepBatch
    real_rows: torch.Tensor        # [T_real] rows stored in the cache (prefill tokens + real decode rows)
    real_lanes: torch.Tensor       # [T_real] lane of each stored row
    real_logical: torch.Tensor     # [T_real] logical block of each stored row
    write_through: torch.Tensor    # [T_real] bool: row's block is a sink or ends in the window; a
                                   # prefill that wraps the ring writes each (slot, offset) once
    prefill: list[PrefillPart]
    decode: DecodePart | None


def window_mask(layout: SlotLayout, context_len: int) -> torch.Tensor:
    """bool [(S + Wb) * bs]: which sink/window slot tokens hold context for `context_len` tokens."""
    bs, s = layout.block_size, layout.num_sink
    mask = torch.zeros(layout.selected_start, bs, dtype=torch.bool)
    last = (context_len - 1) // bs
    blocks = list(range(min(s, last + 1))) + list(range(layout.window_start(context_len), last + 1))
    for b in blocks:
        mask[layout.device_slot(b), : min(bs, context_len - b * bs)] = True
    return mask.view(-1)


def candidate_mask(layout: SlotLayout, context_len: int, max_blocks: int) -> torch.Tensor:
    m = torch.zeros(max_blocks, dtype=torch.bool)
    m[layout.num_sink: layout.window_start(context_len)] = True
    return m


def build_decode_part(layout: SlotLayout, lanes: list[int], real_rows: list[int], draft_rows: list[int],
                      context_lens: list[int], max_blocks: int) -> DecodePart:
    n = max(lanes) + 1
    base = torch.zeros(n, layout.selected_start * layout.block_size, dtype=torch.bool)
    cand = torch.zeros(n, 2, max_blocks, dtype=torch.bool)
    active = torch.zeros(n, dtype=torch.bool)
    for lane, c in zip(lanes, context_lens):
        base[lane] = window_mask(layout, c)
        cand[lane, 0] = candidate_mask(layout, c, max_blocks)
        cand[lane, 1] = candidate_mask(layout, c + 1, max_blocks)
        active[lane] = True
    t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return DecodePart(t(lanes), t(real_rows), t(draft_rows), n, base, active, cand, list(context_lens))
