"""The debug check (`debug_checks=True`): before every decode attention, every device slot the
attention is about to read holds what the tables say, and none past the host's bound is used.
A wrong draft may cost transfers, never the cache's contents: the tests run with this check on.
It reads the device on the host freely: a debug check, off the hot path."""
from __future__ import annotations

import torch

from ..kv_pool import KVPool
from .device_tier import DeviceTier
from .residency import ResidencyManager
from .step_plan import DecodePart


def check_integrity(tier: DeviceTier, residency: ResidencyManager, pool: KVPool, layer: int, d: DecodePart) -> None:
    """Selected slots must equal their host blocks; sink/window slots must equal the host tokens
    that the mask exposes. Raises AssertionError naming the first mismatch (compared on the host)."""
    lay, buf = tier.layout, residency.buffer_of(layer)
    bs = lay.block_size
    held = residency.slots.block[buf, d.lanes]                                 # [B, KVH, K]
    # the host's bound on the occupied selected slots, which attention trusts without looking
    high = residency.slots.high[buf]
    assert (residency.slots.block[buf, :, :, high:] < 0).all(), \
        f"layer {layer}: a selected slot at or past SlotTable.high = {high} holds a block"
    b_i, h_i, j_i = (held >= 0).nonzero(as_tuple=True)
    host = residency.lane_blocks[d.lanes[b_i], held[b_i, h_i, j_i]]
    for dev, src in zip((tier.k, tier.v), pool.by_block(layer)):
        got = dev[buf, d.lanes[b_i], h_i, lay.selected_start + j_i].cpu()
        bad = (got != src[host.cpu(), h_i.cpu()]).flatten(1).any(-1).nonzero()
        assert bad.numel() == 0, f"layer {layer}: selected slot {int(j_i[bad[0]])} of lane " \
                                 f"{int(d.lanes[b_i[bad[0]]])} does not hold its block"
    for lane, c in zip(d.lane_list, d.context_lens):
        for h in range(tier.kvh):
            mask = d.base_mask[lane].view(lay.selected_start, bs)
            for slot in range(lay.selected_start):
                n = int(mask[slot].sum())
                if n == 0:
                    continue
                blk = slot if slot < lay.num_sink else next(
                    b for b in range(lay.window_start(c), (c - 1) // bs + 1) if lay.device_slot(b) == slot)
                host_block = int(residency.lane_blocks[lane, blk])
                assert torch.equal(tier.k[buf, lane, h, slot, :n].cpu(), pool.k[layer, h, host_block, :n]), \
                    f"layer {layer} lane {lane} head {h}: window/sink slot {slot} is stale"
