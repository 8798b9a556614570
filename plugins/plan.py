"""`lookahead::plan_slots`: capped admission of wanted blocks into a lane's selected slots, in place.

The residency manager's slot plan (runtime/lookahead/residency.py, `SlotTable.plan`) as one op, so
that a CUDA engine's decode layer launches one kernel per plan instead of ~40 small ones. The
output is a fixed-capacity list (made on the device without reading how many entries are real):
B x KVH x kc entries, flat, in (lane, head, rank) order, `valid` marking the admissions.
"""
from __future__ import annotations

import torch

from ._common import check_range, check_shape, check_tensor, define_op, fail


def admit_per_head(cap: int, wanted: int, top_k: int) -> int:
    """kc: the entries a plan lists per (lane, head)."""
    return max(0, min(cap, wanted, top_k))


def _plan_slots_impl(block: torch.Tensor, last_used: torch.Tensor, slot_of: torch.Tensor, lanes: torch.Tensor,
                     want: torch.Tensor, scores: torch.Tensor, cap: int,
                     step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # block, last_used [NL, KVH, K]; slot_of [NL, KVH, M + 1] (column M: "no block", stays -1);
    # lanes [B]; want [B, KVH, K']; scores [B, KVH, NS]
    K, M = block.shape[-1], slot_of.shape[-1] - 1
    priority = scores.gather(-1, want.clamp(min=0))
    held, last, inv = block[lanes], last_used[lanes], slot_of[lanes]           # [B, KVH, *] copies
    col = torch.where(want >= 0, want, M)
    where = inv.gather(-1, col)                                                 # slot holding it, or -1
    missing = (want >= 0) & (where < 0)
    # the slots holding a wanted block: scattered into a spare column K for the blocks not held
    slot_wanted = torch.zeros(*held.shape[:-1], K + 1, dtype=torch.bool, device=block.device)
    slot_wanted.scatter_(-1, torch.where(where >= 0, where, K), True)
    slot_wanted = slot_wanted[..., :K]
    last = torch.where(slot_wanted, step, last)
    # victims: empty slots first (last_used -1), then least recently selected; wanted slots never
    victims = torch.argsort(torch.where(slot_wanted, torch.iinfo(torch.long).max, last), dim=-1, stable=True)
    order = torch.argsort(torch.where(missing, -priority, float("inf")), dim=-1, stable=True)
    kc = admit_per_head(cap, want.shape[-1], K)
    take = torch.arange(kc, device=block.device) < missing.sum(-1).clamp(max=cap)[..., None]   # [B, KVH, kc]
    # rank j goes into victim j: distinct slots per (lane, head), so the untaken entries name slots
    # no admission writes (a copy skips them)
    slots = victims[..., :kc]
    blocks = torch.where(take, want.gather(-1, order[..., :kc]), 0)
    evicted = held.gather(-1, slots)
    inv.scatter_(-1, torch.where(take & (evicted >= 0), evicted, M), -1)
    inv.scatter_(-1, torch.where(take, blocks, M), torch.where(take, slots, -1))
    inv[..., M] = -1
    held.scatter_(-1, slots, torch.where(take, blocks, evicted))
    last.scatter_(-1, slots, torch.where(take, step, last.gather(-1, slots)))
    block[lanes] = held
    last_used[lanes] = last
    slot_of[lanes] = inv
    return slots.reshape(-1), blocks.reshape(-1), take.reshape(-1)


def _plan_slots_fake(block: torch.Tensor, last_used: torch.Tensor, slot_of: torch.Tensor, lanes: torch.Tensor,
                     want: torch.Tensor, scores: torch.Tensor, cap: int,
                     step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = want.shape[0] * want.shape[1] * admit_per_head(cap, want.shape[-1], block.shape[-1])
    return want.new_empty(n), want.new_empty(n), want.new_empty(n, dtype=torch.bool)


define_op("plan_slots", _plan_slots_impl, _plan_slots_fake, mutates_args=("block", "last_used", "slot_of"))


def plan_slots(block: torch.Tensor, last_used: torch.Tensor, slot_of: torch.Tensor, lanes: torch.Tensor,
               want: torch.Tensor, scores: torch.Tensor, cap: int, step: int, *,
               check_indices: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Admit up to ``cap`` missing wanted blocks per (lane, KV head), best score first, each
    into the slot of the least recently selected block that is not wanted (empty slots first).

    Parameters
    ----------
    block, last_used : Tensor, [NL, KVH, K], int64, updated in place
        The logical block each selected slot of each lane holds (-1: empty), and the step that last
        selected it (-1: never).
    slot_of : Tensor, [NL, KVH, M + 1], int64, updated in place
        The inverse map: the slot holding logical block b, or -1; column M stays -1.
    lanes : Tensor, [B], int64
        The distinct lanes planned, in [0, NL).
    want : Tensor, [B, KVH, K'], int64, K' <= K
        The wanted blocks of each lane's row (-1 = padding; distinct otherwise).
    scores : Tensor, [B, KVH, NS], float32
        The blocks' scores: a wanted block's priority is its score, finite (ties: the earlier request).
        NS > every wanted block.
    cap, step : int
        Admissions per (lane, head), and the step stamped on admitted and wanted slots.

    Returns
    -------
    slots, blocks : Tensor, [B * KVH * kc], int64, kc = max(0, min(cap, K', K)), flat in (row of
        lanes, head, rank) order: rank j of (lane, head) puts its block into its slot. A (lane,
        head)'s slots are distinct, so an untaken rank names a slot no admission writes (block 0).
    valid : Tensor, [B * KVH * kc], bool
        Which ranks are admissions: the first min(cap, missing) of each (lane, head).
    """
    check_tensor("block", block, 3, torch.int64)
    NL, KVH, K = block.shape
    check_tensor("last_used", last_used, 3, torch.int64)
    check_shape("last_used", last_used, block.shape, "[NL, KVH, K] like block")
    check_tensor("slot_of", slot_of, 3, torch.int64)
    if slot_of.shape[:2] != block.shape[:2] or slot_of.shape[2] < 1:
        fail("slot_of", f"expected shape ({NL}, {KVH}, M + 1) like block, got {tuple(slot_of.shape)}")
    check_tensor("lanes", lanes, 1, torch.int64)
    check_tensor("want", want, 3, torch.int64)
    B, _, kw = want.shape
    check_shape("want", want, (lanes.shape[0], KVH, kw), "[B, KVH, K'] (B = len(lanes))")
    if kw > K:
        fail("want", f"wants {kw} blocks per head, more than the table's {K} slots")
    check_tensor("scores", scores, 3, torch.float32)
    if scores.shape[:2] != want.shape[:2]:
        fail("scores", f"expected shape ({B}, {KVH}, NS) like want, got {tuple(scores.shape)}")
    if cap < 0:
        fail("cap", f"must be >= 0, got {cap}")
    for name, t in (("block", block), ("last_used", last_used), ("slot_of", slot_of), ("lanes", lanes),
                    ("want", want), ("scores", scores)):
        if t.device != block.device:
            fail(name, f"device {t.device} differs from block's {block.device}")
    if check_indices:
        check_range("lanes", lanes, 0, NL)
        if lanes.unique().numel() != lanes.numel():
            fail("lanes", "must be distinct (each lane's rows are planned once)")
        check_range("want", want, -1, min(slot_of.shape[2] - 1, scores.shape[2]))
    return torch.ops.lookahead.plan_slots(block, last_used, slot_of, lanes, want, scores, int(cap), int(step))
