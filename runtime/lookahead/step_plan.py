"""The step plan of lookahead mode: built once per step by the runner (`build_plan`), frozen, read by
every layer.

The runner lays out the step's rows as lists (`StepRows`); `build_plan` turns them into tensors on
the host and moves them to the engine's device in one go (`to_device`: one pinned buffer, one
asynchronous copy per step): no layer makes, moves or changes metadata of its own, and nothing
of the plan is read back from the device (what the host decides with, it keeps as plain values:
`context_lens`, `lane_list`, `predecode_list`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from ..device import to_device
from ..step import StepBatch, StepItem
from .device_tier import SlotLayout


@dataclass(frozen=True)
class PrefillPart:
    item: StepItem
    lane: int
    completes_prompt: bool
    # the chunk that completes the prompt seeds the first working set from its last token's query:
    seed_valid: torch.Tensor | None = None   # [lane + 1, max_blocks] bool: the seed's candidates (row `lane`)
    seed_lane: torch.Tensor | None = None    # [1] int64: `lane`, on the device


@dataclass(frozen=True)
class DecodePart:
    """The decode lanes of a step: each has a real row (stored) and a draft row (never stored).

    A pre-decoding lane (`predecode`) runs its current token in both rows: neither is stored, and
    the draft row, which sees only itself, is the real row of the lane's next step computed ahead
    (its draw becomes the first draft of a re-seeded chain, runtime/draft.py).
    """

    lanes: torch.Tensor            # [B] lane of each decoding sequence (device)
    real_rows: torch.Tensor        # [B] row of the real token in the flat batch
    draft_rows: torch.Tensor       # [B] ([0] without look-ahead)
    num_lanes: int                 # lanes [0, num_lanes) are computed; inactive ones are masked out
    base_mask: torch.Tensor        # [num_lanes, (S + Wb) * bs] bool: sink + window tokens visible
                                   # (not this step's own token: an extra key of the attention)
    lane_active: torch.Tensor      # [num_lanes] bool
    cand_masks: torch.Tensor       # [num_lanes, rows, max_blocks] bool: top-K candidates of the
                                   # real query (this step) and of the draft query (the next step)
    context_lens: tuple[int, ...]  # per decoding lane, after this step's real token
    # Index forms for the hot path: when the lanes are 0..B-1 and the step holds only decode rows,
    # interleaved (real, draft) per lane, these are slices, so indexing gives views, not copies.
    lane_ix: slice | torch.Tensor
    real_ix: slice | torch.Tensor
    packed: bool                   # rows are exactly [real0, draft0, real1, draft1, ...]
                                   # (or [real0, real1, ...] without a draft row)
    rows: int                      # query rows per lane: real + draft, or 1 without look-ahead
    extra_mask: torch.Tensor       # [num_lanes, rows, rows] bool: which of this step's own rows
                                   # each row sees (real: itself; draft: real and itself)
    predecode: torch.Tensor        # [num_lanes] bool: the lane pre-decodes this step
    lane_list: tuple[int, ...]     # `lanes` on the host
    predecode_list: tuple[bool, ...]   # `predecode` per decoding sequence, on the host
    # every lane's sink and window blocks that the host pool holds (its first c - 1 tokens), as
    # [3, n] (lane, device slot, logical block): the ping-pong refill's fixed copies, the same in
    # every layer of the step
    fixed: torch.Tensor | None = None
    # what the draft row attends beside its own top-K when it reads them from the host pool
    # (LookaheadAttention.draft_attention "own"): per lane, the logical sink and window blocks of
    # the step the draft row runs ahead of ([num_lanes, S + Wb] int64, -1 padded), and the tokens
    # the host pool holds (the first c - 1; 0 for a lane that does not decode)
    draft_fixed: torch.Tensor | None = None
    draft_stored: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.lane_list)


@dataclass(frozen=True)
class StepPlan:
    batch: StepBatch
    real_rows: torch.Tensor        # [T_real] rows stored in the cache (prefill tokens + real decode rows)
    real_lanes: torch.Tensor       # [T_real] lane of each stored row
    real_logical: torch.Tensor     # [T_real] logical block of each stored row
    write_through: torch.Tensor | slice  # [T_w] int64: the stored rows whose block is a sink or
                                   # ends in the window; a prefill that wraps the ring writes each
                                   # (slot, offset) once. slice(None) when every row is (decode steps)
    prefill: tuple[PrefillPart, ...]
    decode: DecodePart | None
    real_ix: slice | torch.Tensor  # real_rows, as a slice when the decode is packed
    pool_blocks: torch.Tensor      # batch.slot_blocks / slot_offsets on the host
    pool_offsets: torch.Tensor     # (the host pool's write indices)
    sample_rows: torch.Tensor | None = None   # [E + D] the rows whose logits the step draws: the
                                   # emitting rows (completed prompts' last tokens, then the real
                                   # rows that do not pre-decode), then the draft rows

    @property
    def store_only(self) -> bool:
        """A replayed prefill: store the recorded K/V and seed; no attention (batch.store_only)."""
        return self.batch.store_only


@dataclass
class StepRows:
    """A step's rows as the runner lays them out (lists; made tensors once, in `build_plan`)."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    stored: list[int] = field(default_factory=list)          # rows whose K/V the cache keeps
    stored_lanes: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)          # per stored row: host block, offset,
    offsets: list[int] = field(default_factory=list)         # and whether it is written through
    keep: list[bool] = field(default_factory=list)
    items: list[StepItem] = field(default_factory=list)
    prefill: list[tuple[StepItem, int, bool]] = field(default_factory=list)   # (item, lane, completes)
    dec_lanes: list[int] = field(default_factory=list)       # per decoding sequence
    dec_real: list[int] = field(default_factory=list)
    dec_draft: list[int] = field(default_factory=list)
    dec_ctx: list[int] = field(default_factory=list)
    dec_seqs: list = field(default_factory=list)
    dec_pre: list[bool] = field(default_factory=list)        # the sequence pre-decodes this step

    def add(self, token: int, pos: int, store: tuple[int, int, int, bool] | None) -> int:
        """Append a row; `store` = (lane, host block, offset, write-through) for a stored row."""
        row = len(self.tokens)
        self.tokens.append(token)
        self.positions.append(pos)
        if store is not None:
            lane, block, offset, keep = store
            self.stored.append(row), self.stored_lanes.append(lane)
            self.blocks.append(block), self.offsets.append(offset), self.keep.append(keep)
        return row


def build_plan(r: StepRows, layout: SlotLayout, max_blocks: int, device: torch.device,
               store_only: bool = False) -> StepPlan:
    """The step's plan, complete: tensors made on the host from the row lists, moved once."""
    rows = torch.tensor([r.tokens, r.positions], dtype=torch.long)                       # [2, T]
    stored = torch.tensor([r.stored, r.stored_lanes, r.blocks, r.offsets,
                           [r.positions[i] // layout.block_size for i in r.stored]], dtype=torch.long)  # [5, T_real]
    # the written-through rows as indices (made on the host: a bool mask would be a nonzero on the device)
    keep = None if all(r.keep) else torch.tensor([i for i, k in enumerate(r.keep) if k], dtype=torch.long)
    s_rows, s_lanes, s_blocks, s_offsets, s_logical = stored.unbind(0)
    batch = StepBatch(r.items, *rows.unbind(0), s_blocks, s_offsets, store_only=store_only)
    decode = (_decode_part(layout, r.dec_lanes, r.dec_real, r.dec_draft, r.dec_ctx, max_blocks,
                           only_decode=not r.prefill, predecode=r.dec_pre)
              if r.dec_lanes else None)
    # a packed decode step stores every real row: a slice of them is a view, not a copy
    real_ix = decode.real_ix if decode is not None and decode.packed and not any(r.dec_pre) else s_rows
    prefill = tuple(_prefill_part(layout, it, lane, done, max_blocks) for it, lane, done in r.prefill)
    emit = ([it.row_start + it.num_tokens - 1 for it, _, done in r.prefill if done]
            + [row for row, pre in zip(r.dec_real, r.dec_pre) if not pre])
    sample = torch.tensor(emit + r.dec_draft, dtype=torch.long)
    plan = StepPlan(batch, s_rows, s_lanes, s_logical, keep if keep is not None else slice(None), prefill, decode,
                    real_ix, pool_blocks=stored[2], pool_offsets=stored[3], sample_rows=sample)
    return _moved(plan, device)


# the plan's fields that stay on the host: the host pool's write indices
HOST_FIELDS = frozenset({"pool_blocks", "pool_offsets"})
MOVE = to_device        # how the plan is moved (tests put a packing copy here to run it on CPU)


def _moved(plan: StepPlan, device: torch.device) -> StepPlan:
    """`plan` with every tensor a layer reads on `device`, all moved in one `to_device` call."""
    if device.type == "cpu" and MOVE is to_device:
        return plan
    parts = [plan.batch, plan.decode, *plan.prefill, plan]
    found: dict[int, torch.Tensor] = {}
    for part in parts:
        for f in fields(part) if part is not None else ():
            v = getattr(part, f.name)
            if isinstance(v, torch.Tensor) and f.name not in HOST_FIELDS:
                found.setdefault(id(v), v)
    moved = dict(zip(found, MOVE(device, *found.values())))

    def swap(part):
        if part is None:
            return None
        return replace(part, **{f.name: moved[id(v)] for f in fields(part)
                                if isinstance(v := getattr(part, f.name), torch.Tensor) and id(v) in moved
                                and f.name not in HOST_FIELDS})
    return replace(swap(plan), batch=swap(plan.batch), decode=swap(plan.decode),
                   prefill=tuple(swap(p) for p in plan.prefill))


def _prefill_part(layout: SlotLayout, item: StepItem, lane: int, completes: bool, max_blocks: int) -> PrefillPart:
    """A prefill chunk (host tensors); the one that completes the prompt carries its seed's
    candidate mask."""
    if not completes:
        return PrefillPart(item, lane, False)
    valid = torch.zeros(lane + 1, max_blocks, dtype=torch.bool)
    valid[lane] = candidate_mask(layout, item.context_len + 1, max_blocks)
    return PrefillPart(item, lane, True, valid, torch.tensor([lane]))


def window_mask(layout: SlotLayout, context_len: int, visible: int | None = None) -> torch.Tensor:
    """bool [(S + Wb) * bs]: which sink/window slot tokens hold context for `context_len` tokens.

    The window is the one of `context_len` tokens; only the first `visible` (default: all) tokens
    are exposed: a decode step's own token is not in the device tier yet (it is an extra key).
    """
    bs = layout.block_size
    visible = context_len if visible is None else visible
    mask = torch.zeros(layout.selected_start, bs, dtype=torch.bool)
    for b in layout.fixed_blocks((context_len - 1) // bs, context_len):
        mask[layout.device_slot(b), : max(0, min(bs, visible - b * bs))] = True
    return mask.view(-1)


def candidate_mask(layout: SlotLayout, context_len: int, max_blocks: int) -> torch.Tensor:
    """bool [max_blocks] (host): the top-K candidates of a query at `context_len` tokens."""
    m = torch.zeros(max_blocks, dtype=torch.bool)
    m[layout.num_sink: layout.window_start(context_len)] = True
    return m


def _decode_part(layout: SlotLayout, lanes: list[int], real_rows: list[int], draft_rows: list[int],
                 context_lens: list[int], max_blocks: int, only_decode: bool,
                 predecode: list[bool] | None = None) -> DecodePart:
    """The plan's `DecodePart` (host tensors, moved with the rest of the plan): `predecode[i]`:
    lane i pre-decodes (its draft row is at the real row's position)."""
    n = max(lanes) + 1
    predecode = predecode or [False] * len(lanes)
    base = torch.zeros(n, layout.selected_start * layout.block_size, dtype=torch.bool)
    cand = torch.zeros(n, 2, max_blocks, dtype=torch.bool)
    active = torch.zeros(n, dtype=torch.bool)
    pre = torch.zeros(n, dtype=torch.bool)
    d_fixed = [[-1] * layout.selected_start for _ in range(n)]
    d_stored = [0] * n
    fixed: list[tuple[int, int, int]] = []
    for lane, c, p in zip(lanes, context_lens, predecode):
        base[lane] = window_mask(layout, c, visible=c - 1)
        cand[lane, 0] = candidate_mask(layout, c, max_blocks)
        cand[lane, 1] = candidate_mask(layout, c if p else c + 1, max_blocks)
        active[lane] = True
        pre[lane] = p
        # the host holds c - 1 tokens of the lane; this step's token is stored at the end of the step
        last = (c - 2) // layout.block_size
        fixed += [(lane, layout.device_slot(b), b) for b in layout.fixed_blocks(last, c)]
        # the draft row runs ahead of the next step (of this one when pre-decoding): its window
        ahead = layout.fixed_blocks(last, c if p else c + 1)
        d_fixed[lane][: len(ahead)] = ahead
        d_stored[lane] = c - 1
    rows = 2 if draft_rows else 1
    extra = torch.tensor([[True, False], [True, True]])[:rows, :rows].expand(n, rows, rows)
    if any(predecode):  # a pre-decoding row sees only itself: the real row is the same token
        extra = extra.clone()
        extra[pre, 1, 0] = False
    ids = torch.tensor([lanes, real_rows, draft_rows or real_rows], dtype=torch.long)   # [3, B]
    fixed_t = torch.tensor(fixed, dtype=torch.long).view(-1, 3).t().contiguous()       # [3, n_fixed]
    t_lanes, t_real, t_draft = ids.unbind(0)
    # the index forms: slices (views) when the lanes are 0..n-1 and the rows interleave
    consecutive = lanes == list(range(n))
    packed = (consecutive and only_decode and real_rows == list(range(0, rows * n, rows))
              and (rows == 1 or draft_rows == list(range(1, rows * n, rows))))
    return DecodePart(t_lanes, t_real, t_draft if draft_rows else t_draft[:0], n, base, active, cand[:, :rows],
                      tuple(context_lens), lane_ix=slice(0, n) if consecutive else t_lanes,
                      real_ix=slice(0, rows * n, rows) if packed else t_real, packed=packed, rows=rows,
                      extra_mask=extra, predecode=pre, lane_list=tuple(lanes),
                      predecode_list=tuple(predecode), fixed=fixed_t,
                      draft_fixed=torch.tensor(d_fixed, dtype=torch.long) if draft_rows else None,
                      draft_stored=torch.tensor(d_stored, dtype=torch.long) if draft_rows else None)
