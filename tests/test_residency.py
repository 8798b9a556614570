"""SlotTable (capped eviction) against a plain-Python statement of the rule, on random request streams."""
from __future__ import annotations

import random

import pytest
import torch

from plugins import cpu
from plugins.cpu import loader
from plugins.reference import plan_slot_rule
from runtime.lookahead.residency import SlotTable
from runtime.ops import select_ops

PATHS = ["torch", "dispatcher", pytest.param("cpu_kernel", marks=pytest.mark.skipif(
    not cpu.available(), reason=f"plugins.cpu: {loader.unavailable_reason()}"))]


@pytest.mark.parametrize("path", PATHS)
def test_plan_matches_the_rule_and_keeps_the_inverse_map_true(path):
    rng = random.Random(0)
    B, KVH, K, NB, bufs = 3, 2, 6, 20, 2
    # the C table's plan kernel, or none (plan_torch)
    kernel = select_ops(torch.device("cpu"), torch.float32, "c").plan_slots if path == "cpu_kernel" else None
    # plan_torch's op: its torch implementation, or through the dispatcher (as a CUDA engine calls it)
    fixed = torch.ops.lookahead.plan_slots if path == "dispatcher" else None
    table = SlotTable(bufs, B, KVH, K, NB, kernel=kernel, fixed=fixed)
    held = [[[[-1] * K for _ in range(KVH)] for _ in range(B)] for _ in range(bufs)]
    last = [[[[-1] * K for _ in range(KVH)] for _ in range(B)] for _ in range(bufs)]
    total = 0
    for step in range(1, 60):
        buf = rng.randrange(bufs)
        lanes = sorted(rng.sample(range(B), rng.randint(1, B)))
        kw = rng.randint(1, K)
        want = torch.full((len(lanes), KVH, kw), -1, dtype=torch.long)
        for i in range(len(lanes)):
            for h in range(KVH):
                n = rng.randint(0, kw)
                want[i, h, :n] = torch.tensor(rng.sample(range(NB), n))
        scores = torch.randint(0, 4, (len(lanes), KVH, NB)).float()        # ties on purpose
        prio = torch.where(want >= 0, scores.gather(-1, want.clamp(min=0)), 0.0)
        cap = rng.randint(1, K)
        adm = table.plan(buf, torch.tensor(lanes), want, scores, cap, step)
        entries = list(zip(adm.lanes.tolist(), adm.heads.tolist(), adm.slots.tolist(), adm.blocks.tolist()))
        if adm.valid is not None:       # plan_torch: a fixed-capacity list, B x KVH x min(cap, K') entries
            assert table.kernel is None and len(adm) == len(lanes) * KVH * min(cap, kw)
            assert len({e[:3] for e in entries}) == len(entries)            # distinct destinations
            assert all(0 <= b < NB and 0 <= s < K for _, _, s, b in entries)  # skipped ones are in range
            entries = [e for e, ok in zip(entries, adm.valid.tolist()) if ok]
        got = sorted(entries)
        exp = []
        for i, lane in enumerate(lanes):
            for h in range(KVH):
                hl, ls, a = plan_slot_rule(held[buf][lane][h], last[buf][lane][h], want[i, h].tolist(),
                                     prio[i, h].tolist(), cap, step)
                held[buf][lane][h], last[buf][lane][h] = hl, ls
                exp += [(lane, h, s, b) for s, b in a]
        assert got == sorted(exp), step
        total += len(exp)
        assert table.block.tolist() == held and table.last_used.tolist() == last
        # the host's bound: every selected slot at or past high is empty, in every lane
        assert (table.block[buf, :, :, table.high[buf]:] < 0).all()
        # the inverse map agrees with the table, and resident() is set membership
        for bf in range(bufs):
            for lane in range(B):
                for h in range(KVH):
                    for b in range(NB):
                        s = int(table.slot_of[bf, lane, h, b])
                        assert (s >= 0) == (b in held[bf][lane][h]) and (s < 0 or held[bf][lane][h][s] == b)
        probe = torch.randint(-1, NB, (len(lanes), KVH, 5))
        res = table.resident(buf, torch.tensor(lanes), probe)
        for i, lane in enumerate(lanes):
            for h in range(KVH):
                for j, b in enumerate(probe[i, h].tolist()):
                    assert bool(res[i, h, j]) == (b >= 0 and b in held[buf][lane][h])
    assert total > 100                                              # the stream did admit and evict


def test_assign_and_reset_keep_the_inverse_map_true():
    table = SlotTable(2, 2, 1, 4, 10)
    table.assign(1, torch.tensor([0, 1]), torch.tensor([[[3, 7, -1, 1]], [[-1, -1, -1, -1]]]), step=5)
    assert table.resident(1, torch.tensor([0]), torch.tensor([[[1, 3, 7, 2, -1]]])).tolist() == \
        [[[True, True, True, False, False]]]
    assert table.slot_of[1, 0, 0, 7] == 1 and (table.slot_of[1, 1] < 0).all()
    table.assign(1, torch.tensor([0]), torch.tensor([[[2, -1, -1, -1]]]), step=6)
    assert table.resident(1, torch.tensor([0]), torch.tensor([[[3, 2]]])).tolist() == [[[False, True]]]
    table.reset_lane(0)
    assert (table.slot_of[:, 0] < 0).all() and (table.block[:, 0] < 0).all()


def test_metrics_agreement_and_hits_count_the_overlap():
    from runtime.lookahead.metrics import LookaheadMetrics
    m = LookaheadMetrics(num_layers=2, num_lanes=3)
    true = torch.tensor([[[1, 5, 9, -1]], [[2, 3, -1, -1]]])        # lanes 2 and 0, one KV head
    pred = torch.tensor([[[5, 9, 11, 40]], [[-1, -1, -1, -1]]])
    resident = torch.tensor([[[True, False, True, False]], [[False, False, False, False]]])
    # layer 0 had no prediction yet: its hits count, its agreement does not
    m.record_step([0, 1], torch.tensor([2, 0]), torch.stack([torch.full_like(pred, -1), pred]),
                  torch.tensor([False, True]), torch.stack([true, true]), torch.stack([resident, resident]))
    assert m.per_layer_agreement() == [None, (2 / 3 + 0.0) / 2]
    s = m.summary()
    assert s["prefetch_hit_rate"] == 2 / 5
    lane2 = m.take_lane(2)
    assert lane2["agreement_mean"] == 2 / 3 and lane2["prefetch_hit_rate"] == 2 / 3
    assert m.take_lane(0)["agreement_mean"] == 0.0


@pytest.mark.skipif(not cpu.available(), reason=f"plugins.cpu: {loader.unavailable_reason()}")
def test_kernel_plan_refuses_out_of_range_indices_and_leaves_the_table():
    table = SlotTable(1, 2, 1, 4, 10, kernel=select_ops(torch.device("cpu"), torch.float32, "c").plan_slots)
    table.plan(0, torch.tensor([0]), torch.tensor([[[3, 7]]]), torch.ones(1, 1, 10), 2, step=1)
    before = [t.clone() for t in (table.block, table.last_used, table.slot_of)]
    for lanes, want in ((torch.tensor([2]), torch.tensor([[[1]]])), (torch.tensor([0]), torch.tensor([[[10]]]))):
        with pytest.raises(IndexError, match="SlotTable.plan"):
            table.plan(0, lanes, want, torch.ones(1, 1, 11), 1, step=2)
    assert all(torch.equal(a, b) for a, b in zip(before, (table.block, table.last_used, table.slot_of)))
