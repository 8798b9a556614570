"""Per-step tensors of the lookahead backend, built once per step by the runner, read by every layer.

Built on the host from lists, then moved to the engine's device in one go (`to_device`): no layer
makes or moves metadata of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device import to_device
from ..step import StepBatch, StepItem
from .layout import SlotLayout


@dataclass
class PrefillPart:
    item: StepItem
    lane: int
    completes_prompt: bool


@dataclass
class DecodePart:
    """The decode lanes of a step: each has a real row (stored) and a draft row (never stored).

    A pre-decoding lane (`predecode`) runs its current token in both rows: neither is stored, and
    the draft row, which sees only itself, is the real row of the lane's next step computed ahead
    (its draw becomes the first draft of a re-seeded chain, runtime/draft.py).
    """

    lanes: torch.Tensor            # [B] lane of each decoding sequence (device)
    real_rows: torch.Tensor        # [B] row of the real token in the flat batch
    draft_rows: torch.Tensor       # [B]
    num_lanes: int                 # lanes [0, num_lanes) are computed; inactive ones are masked out
    base_mask: torch.Tensor        # [num_lanes, (S + Wb) * bs] bool: sink + window tokens visible
                                   # (not this step's own token: an extra key of the attention)
    lane_active: torch.Tensor      # [num_lanes] bool
    cand_masks: torch.Tensor       # [num_lanes, rows, max_blocks] bool: top-K candidates of the
                                   # real query (this step) and of the draft query (the next step)
    context_lens: list[int]        # per decoding lane, after this step's real token
    # Index forms for the hot path: when the lanes are 0..B-1 and the step holds only decode rows,
    # interleaved (real, draft) per lane, these are slices, so indexing gives views, not copies.
    lane_ix: slice | torch.Tensor | None = None
    real_ix: slice | torch.Tensor | None = None
    packed: bool = False           # rows are exactly [real0, draft0, real1, draft1, ...]
                                   # (or [real0, real1, ...] without a draft row)
    rows: int = 2                  # query rows per lane: real + draft, or 1 without look-ahead
    extra_mask: torch.Tensor | None = None   # [num_lanes, rows, rows] bool: which of this step's
                                   # own rows each row sees (real: itself; draft: real and itself)
    predecode: torch.Tensor | None = None    # [num_lanes] bool: the lane pre-decodes this step
    lane_list: list[int] | None = None       # `lanes` on the host (the ping-pong refill's lists)

    @property
    def size(self) -> int:
        return int(self.lanes.numel())


@dataclass
class StepPlan:
    batch: StepBatch
    real_rows: torch.Tensor        # [T_real] rows stored in the cache (prefill tokens + real decode rows)
    real_lanes: torch.Tensor       # [T_real] lane of each stored row
    real_logical: torch.Tensor     # [T_real] logical block of each stored row
    write_through: torch.Tensor | slice  # [T_real] bool: row's block is a sink or ends in the
                                   # window; a prefill that wraps the ring writes each (slot, offset)
                                   # once. slice(None) when every row does (decode steps)
    prefill: list[PrefillPart]
    decode: DecodePart | None
    real_ix: slice | torch.Tensor | None = None   # real_rows, as a slice when the decode is packed
    pool_blocks: torch.Tensor | None = None       # batch.slot_blocks / slot_offsets on the host
    pool_offsets: torch.Tensor | None = None      # (the host pool's write indices)


def window_mask(layout: SlotLayout, context_len: int, visible: int | None = None) -> torch.Tensor:
    """bool [(S + Wb) * bs]: which sink/window slot tokens hold context for `context_len` tokens.

    The window is the one of `context_len` tokens; only the first `visible` (default: all) tokens
    are exposed: a decode step's own token is not in the device tier yet (it is an extra key).
    """
    bs, s = layout.block_size, layout.num_sink
    visible = context_len if visible is None else visible
    mask = torch.zeros(layout.selected_start, bs, dtype=torch.bool)
    last = (context_len - 1) // bs
    blocks = list(range(min(s, last + 1))) + list(range(layout.window_start(context_len), last + 1))
    for b in blocks:
        mask[layout.device_slot(b), : max(0, min(bs, visible - b * bs))] = True
    return mask.view(-1)


def candidate_mask(layout: SlotLayout, context_len: int, max_blocks: int) -> torch.Tensor:
    """bool [max_blocks] (host): the top-K candidates of a query at `context_len` tokens."""
    m = torch.zeros(max_blocks, dtype=torch.bool)
    m[layout.num_sink: layout.window_start(context_len)] = True
    return m


def build_decode_part(layout: SlotLayout, lanes: list[int], real_rows: list[int], draft_rows: list[int],
                      context_lens: list[int], max_blocks: int, only_decode: bool,
                      predecode: list[bool] | None = None,
                      device: torch.device = torch.device("cpu")) -> DecodePart:
    """`predecode[i]`: lane i pre-decodes (its draft row is at the real row's position). The
    tensors are built on the host and moved to `device` once."""
    n = max(lanes) + 1
    predecode = predecode or [False] * len(lanes)
    base = torch.zeros(n, layout.selected_start * layout.block_size, dtype=torch.bool)
    cand = torch.zeros(n, 2, max_blocks, dtype=torch.bool)
    active = torch.zeros(n, dtype=torch.bool)
    pre = torch.zeros(n, dtype=torch.bool)
    for lane, c, p in zip(lanes, context_lens, predecode):
        base[lane] = window_mask(layout, c, visible=c - 1)
        cand[lane, 0] = candidate_mask(layout, c, max_blocks)
        cand[lane, 1] = candidate_mask(layout, c if p else c + 1, max_blocks)
        active[lane] = True
        pre[lane] = p
    rows = 2 if draft_rows else 1
    extra = torch.tensor([[True, False], [True, True]])[:rows, :rows].expand(n, rows, rows)
    if any(predecode):  # a pre-decoding row sees only itself: the real row is the same token
        extra = extra.clone()
        extra[pre, 1, 0] = False
    ids = torch.tensor([lanes, real_rows, draft_rows or real_rows], dtype=torch.long)   # [3, B]
    ids, base, active, cand, pre, extra = to_device(device, ids, base, active, cand[:, :rows], pre, extra)
    t_lanes, t_real, t_draft = ids.unbind(0)
    part = DecodePart(t_lanes, t_real, t_draft if draft_rows else t_draft[:0], n, base, active, cand,
                      list(context_lens), rows=rows, extra_mask=extra, predecode=pre, lane_list=list(lanes))
    part.lane_ix, part.real_ix = part.lanes, part.real_rows
    if lanes == list(range(n)):
        part.lane_ix = slice(0, n)
        part.packed = (only_decode and real_rows == list(range(0, rows * n, rows))
                       and (rows == 1 or draft_rows == list(range(1, rows * n, rows))))
        if part.packed:
            part.real_ix = slice(0, rows * n, rows)     # the step's rows are then views of q/k/v
    return part
