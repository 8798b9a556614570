"""Fixed-capacity copy lists (the residency manager's admissions made on the device without reading
their length): an unused entry names block -1, which `block_gather` turns into a zero row without
reading the pool (no PCIe traffic on a GPU), and no copy writes it into the device tier.

Checked on every path that can see such an entry: the torch implementation of `block_gather` and
its reference, the validating wrapper, the residency manager's copy job, the CUDA transfer engine's
row ids (its host-pool gather), and the CPU engines landing a fixed-capacity job.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import plugins
from plugins import reference as ref
from runtime.lookahead.residency import Admission, ResidencyManager
from runtime.transfer import CopyJob, SyncTransferEngine, ThreadTransferEngine
from runtime.transfer.cuda import _host_rows

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
    self = SimpleNamespace(
        lane_blocks=lane_blocks, pool_views=[(pool_k, pool_v)],
        tier=SimpleNamespace(views=[(dst_k, dst_v)], layout=SimpleNamespace(selected_start=1)),
        step_idx=7)
    return self


def test_residency_copy_job_names_minus_one_for_unused_entries():
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
    assert job.src_index[0].tolist() == [2, -1, 3, -1]                  # valid ones: their host blocks
    assert job.dst_index[2].tolist() == [1, 2, 3, 1]                    # selected_start + slot


@pytest.mark.parametrize("layout", ["block_major", "head_major"])
def test_cuda_engine_gathers_unused_entries_as_nothing(layout):
    """The CUDA engine's host-pool gather: an unused entry's row id is -1 in either pool layout (not
    the previous head's last row, which heads * NB + (-1) would be); gathered with the op, it is a
    zero row, and the valid mask then keeps the slot's own contents."""
    base = torch.randn(NB, KVH, BS, D) if layout == "block_major" else torch.randn(KVH, NB, BS, D)
    src = base if layout == "block_major" else base.transpose(0, 1)
    blocks, heads = torch.tensor([2, -1, 5, -1]), torch.tensor([1, 1, 0, 0])
    rows_k, _, row_ids = _host_rows(src, src, blocks, heads)
    assert row_ids[1] == -1 and row_ids[3] == -1 and (row_ids[[0, 2]] >= 0).all()
    got = torch.ops.lookahead.block_gather(rows_k, row_ids.view(1, -1))[0]
    assert not got[1].any() and not got[3].any()
    torch.testing.assert_close(got[0], src[2, 1], rtol=0, atol=0)
    torch.testing.assert_close(got[2], src[5, 0], rtol=0, atol=0)


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
