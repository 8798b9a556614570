"""Fixed-capacity copy lists (the residency manager's admissions made on the device without reading
their length): a skipped entry is read and written by no copy. `block_gather` turns a -1 id into
a zero row without reading the pool; `copy_blocks` skips an entry `valid` marks off, whatever
block it names (-1 included), without reading it.

Checked on every path that can see such an entry: the torch implementation of `block_gather` and
its reference, the validating wrapper, `copy_blocks` through each door, the residency manager's
copy job, and the CPU engines landing a fixed-capacity job.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import plugins
from plugins import reference as ref
from runtime.lookahead.residency import Admission, ResidencyManager
from runtime.transfer import CopyJob, SyncTransferEngine, ThreadTransferEngine

NB, KVH, BS, D = 6, 2, 4, 8


def _pool(seed: int = 0) -> torch.Tensor:
    return torch.randn(NB, KVH, BS, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_block_gather_minus_one_is_a_zero_row(layout):
    src = _pool()
    if layout == "strided":                       # the head-major pool's by_block view
        src = src.transpose(0, 1).contiguous().transpose(0, 1)
    ids = torch.tensor([[3, -1, 0, -1], [-1, 5, 5, 2]])
    got = plugins.direct.block_gather(src, ids)
    want = ref.block_gather_ref(src, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not got[0, 1].any() and not got[1, 0].any() and not want[0, 3].any()
    torch.testing.assert_close(got[0, 0], src[3, 0], rtol=0, atol=0)
    torch.testing.assert_close(torch.ops.lookahead.block_gather(src, ids), want, rtol=0, atol=0)
    torch.testing.assert_close(plugins.block_gather(src, ids, check_indices=False), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="block_ids"):       # a user's -1 is still named by the checked wrapper
        plugins.block_gather(src, ids)


def test_reference_reads_nothing_for_minus_one():
    """The reference must not wrap -1 around to the last block (plain indexing would)."""
    src = _pool()
    out = ref.block_gather_ref(src, torch.tensor([[-1], [-1]]))
    assert not out.any() and src[-1].abs().sum() > 0


def _manager(pool_k, pool_v, dst_k, dst_v, lane_blocks):
    views = [(dst_k, dst_v)]
    self = SimpleNamespace(
        lane_blocks=lane_blocks, pool_views=[(pool_k, pool_v)],
        tier=SimpleNamespace(views=views, selected_views=[(k[:, :, 1:], v[:, :, 1:]) for k, v in views]),
        step_idx=7)
    return self


def test_residency_copy_job_addresses_the_selected_slots_and_keeps_the_valid_mask():
    pool = torch.randn(KVH, NB, BS, D)
    src = pool.transpose(0, 1)
    dst = torch.full((2, KVH, 4, BS, D), float("nan"))
    lane_blocks = torch.tensor([[4, 2, 1, -1], [0, 5, 3, -1]])        # logical -> host block per lane
    self = _manager(src, src, dst, dst.clone(), lane_blocks)
    valid = torch.tensor([True, False, True, False])
    adm = Admission(lanes=torch.tensor([0, 0, 1, 1]), heads=torch.tensor([0, 1, 1, 0]),
                    slots=torch.tensor([0, 1, 2, 0]), blocks=torch.tensor([1, 0, 2, 0]), valid=valid)
    job = ResidencyManager.job(self, 0, 0, adm)
    assert job.valid is valid
    assert job.src_index[0][valid].tolist() == [2, 3]                   # valid ones: their host blocks
    assert job.dst_index[2].tolist() == [0, 1, 2, 0]                    # selected slots, from the first
    assert job.dst_k.data_ptr() == dst[:, :, 1].data_ptr()              # ... which the view starts at
    SyncTransferEngine().submit(job)
    torch.testing.assert_close(dst[0, 0, 1], src[2, 0], rtol=0, atol=0)
    torch.testing.assert_close(dst[1, 1, 3], src[3, 1], rtol=0, atol=0)
    assert dst[0, 1, 2].isnan().all() and dst[1, 0, 1].isnan().all()   # the skipped entries' slots


@pytest.mark.parametrize("door", ["direct", "dispatch", "checked"])
@pytest.mark.parametrize("layout", ["block_major", "head_major"])
def test_copy_blocks_lands_valid_entries_only(door, layout):
    """copy_blocks against the reference, either pool layout, through each door; a skipped entry
    naming block -1 is neither read nor written."""
    base = torch.randn(NB, KVH, BS, D) if layout == "block_major" else torch.randn(KVH, NB, BS, D)
    src_k = base if layout == "block_major" else base.transpose(0, 1)
    src_v = src_k * 2
    dst_k, dst_v = (torch.randn(3, KVH, 5, BS, D) for _ in range(2))
    blocks, src_heads = torch.tensor([2, -1, 5, 0, 4]), torch.tensor([1, 1, 0, 0, 1])
    lanes, dst_heads, slots = torch.tensor([0, 2, 1, 2, 1]), torch.tensor([0, 1, 1, 0, 1]), torch.tensor([4, 0, 2, 2, 3])
    valid = torch.tensor([True, False, True, True, False])
    want_k, want_v = dst_k.clone(), dst_v.clone()
    for i in valid.nonzero().flatten().tolist():
        want_k[lanes[i], dst_heads[i], slots[i]] = src_k[blocks[i], src_heads[i]]
        want_v[lanes[i], dst_heads[i], slots[i]] = src_v[blocks[i], src_heads[i]]
    fn = {"direct": plugins.direct.copy_blocks, "dispatch": torch.ops.lookahead.copy_blocks,
          "checked": plugins.copy_blocks}[door]
    fn(src_k, src_v, dst_k, dst_v, blocks, src_heads, lanes, dst_heads, slots, valid)
    torch.testing.assert_close(dst_k, want_k, rtol=0, atol=0)
    torch.testing.assert_close(dst_v, want_v, rtol=0, atol=0)


def test_copy_blocks_wrapper_names_the_bad_argument():
    src, dst = torch.randn(NB, KVH, BS, D), torch.randn(2, KVH, 3, BS, D)
    ix = [torch.tensor([1]), torch.tensor([0]), torch.tensor([1]), torch.tensor([0]), torch.tensor([2])]
    for i, (name, bad) in enumerate([("blocks", NB), ("src_heads", KVH), ("lanes", 2), ("dst_heads", KVH),
                                     ("slots", 3)]):
        args = list(ix)
        args[i] = torch.tensor([bad])
        with pytest.raises(ValueError, match=f"^{name}:"):
            plugins.copy_blocks(src, src, dst, dst.clone(), *args)
    with pytest.raises(ValueError, match="^dst_k:"):
        plugins.copy_blocks(src, src, dst.half(), dst.half(), *ix)


@pytest.mark.parametrize("kind", ["sync", "thread"])
def test_fixed_capacity_job_lands_only_its_valid_entries(kind):
    src_k, src_v = _pool(1), _pool(2)
    dst_k = torch.full((2, KVH, 3, BS, D), float("nan"))
    dst_v = dst_k.clone()
    eng = SyncTransferEngine() if kind == "sync" else ThreadTransferEngine()
    valid = torch.tensor([True, False, True])
    job = CopyJob(src_k, src_v, dst_k, dst_v, (torch.tensor([4, -1, 1]), torch.tensor([0, 1, 1])),
                  (torch.tensor([0, 1, 1]), torch.tensor([0, 1, 1]), torch.tensor([2, 0, 1])), valid=valid)
    try:
        eng.wait(eng.submit(job, urgent=True))
    finally:
        eng.close()
    torch.testing.assert_close(dst_k[0, 0, 2], src_k[4, 0], rtol=0, atol=0)
    torch.testing.assert_close(dst_v[1, 1, 1], src_v[1, 1], rtol=0, atol=0)
    assert dst_k[1, 1, 0].isnan().all() and dst_v[1, 1, 0].isnan().all()     # the unused entry's slot
    assert eng.h2d_bytes == 2 * job.unit_bytes
