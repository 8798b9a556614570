"""The C kernel of update_summaries (plugins/cpu/summaries.c via plugins.cpu.ops.update_summaries)
against the torch implementation the torch table runs (plugins/summaries.py), bit for bit, on
fresh random inputs: decode steps (one key per block), prefills with repeats and restarts in the
middle, 16-bit keys, NaN keys, the multithreaded column split; and the C table's entry."""
from __future__ import annotations

import pytest
import torch

from plugins.cpu import loader
from plugins.cpu import ops as cpu
from plugins.summaries import _update_summaries_impl

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"plugins.cpu: {loader.unavailable_reason()}")


def inputs(seed: int, T: int, num_blocks: int, kvh: int, D: int, dtype: torch.dtype = torch.float32,
           unique: bool = False, restart: float = 0.3):
    """Random summaries, keys and (ids, offsets): distinct ids when `unique` (a decode step), else
    ids drawn with repeats from a few blocks, each token a restart with probability `restart`."""
    g = torch.Generator().manual_seed(seed)
    kmin = torch.randn(num_blocks, kvh, D, generator=g)
    kmax = kmin + torch.rand(num_blocks, kvh, D, generator=g)
    keys = torch.randn(T, kvh, D, generator=g).to(dtype)
    if unique:
        ids = torch.randperm(num_blocks, generator=g)[:T]
    else:
        ids = torch.randint(0, max(1, min(num_blocks, T // 3 + 1)), (T,), generator=g)
    offsets = torch.where(torch.rand(T, generator=g) < restart, 0, torch.randint(1, 16, (T,), generator=g))
    return kmin, kmax, keys, ids, offsets


def both(kmin, kmax, keys, ids, offsets):
    """(C result, torch result), each (kmin, kmax), from clones of the same inputs."""
    c = (kmin.clone(), kmax.clone())
    t = (kmin.clone(), kmax.clone())
    cpu.update_summaries(c[0], c[1], keys, ids, offsets)
    _update_summaries_impl(t[0], t[1], keys, ids, offsets)
    return c, t


def assert_bits(c: tuple, t: tuple) -> None:
    for a, b in zip(c, t):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def sequential(kmin, kmax, keys, ids, offsets) -> None:
    """The contract's definition: the tokens applied one by one."""
    for i in range(keys.shape[0]):
        for summary, fold in ((kmin, torch.minimum), (kmax, torch.maximum)):
            key = keys[i].float()
            summary[ids[i]] = key if offsets[i] == 0 else fold(summary[ids[i]], key)


@pytest.mark.parametrize("seed,T,num_blocks,kvh,D", [
    (0, 1, 7, 1, 64),        # one key, one block
    (1, 4, 64, 2, 64),       # a decode step: four sequences
    (2, 5, 9, 3, 20),        # D not a multiple of 8: the scalar tail
    (3, 16, 1000, 8, 128),
])
def test_one_key_per_block(seed, T, num_blocks, kvh, D):
    assert_bits(*both(*inputs(seed, T, num_blocks, kvh, D, unique=True)))


@pytest.mark.parametrize("seed,T,num_blocks,kvh,D,restart", [
    (10, 40, 8, 2, 64, 0.3),     # many keys per block, restarts in the middle
    (11, 17, 3, 1, 12, 0.5),
    (12, 64, 5, 4, 32, 0.0),     # folds only, repeated blocks
    (13, 33, 4, 2, 16, 1.0),     # restarts only: the last one of each block wins
    (14, 300, 40, 8, 128, 0.2),  # enough work (LKV_PAR_MIN) for the threaded column split
])
def test_repeats_and_restarts(seed, T, num_blocks, kvh, D, restart):
    args = inputs(seed, T, num_blocks, kvh, D, restart=restart)
    (cmin, cmax), t = both(*args)
    assert_bits((cmin, cmax), t)
    kmin, kmax, keys, ids, offsets = args
    kmin, kmax = kmin.clone(), kmax.clone()
    sequential(kmin, kmax, keys, ids, offsets)
    assert_bits((cmin, cmax), (kmin, kmax))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed,T,unique", [(20, 6, True), (21, 50, False)])
def test_narrow_keys(dtype, seed, T, unique):
    assert_bits(*both(*inputs(seed, T, 32, 2, 40, dtype=dtype, unique=unique)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed,T,unique,restart", [(22, 6, True, 0.3), (23, 50, False, 0.3), (24, 900, False, 0.2)])
def test_summaries_in_the_keys_dtype(dtype, seed, T, unique, restart):
    """Summaries kept in the keys' 16-bit dtype (a min or max of keys is one of them): the kernel
    equals the torch implementation bit for bit, and the fp32 summaries narrowed (exactly); 900
    keys run the threaded column split."""
    kmin, kmax, keys, ids, offsets = inputs(seed, T, 32, 2, 40, dtype=dtype, unique=unique, restart=restart)
    kmin, kmax = kmin.to(dtype), kmax.to(dtype)
    c, t = both(kmin, kmax, keys, ids, offsets)
    for a, b in zip(c, t):
        assert a.dtype == dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))
    wide = (kmin.float(), kmax.float())
    cpu.update_summaries(*wide, keys, ids, offsets)
    assert all(torch.equal(a, w.to(dtype)) for a, w in zip(c, wide))


def test_fp32_keys_into_16_bit_summaries_run_the_torch_implementation():
    """Narrowing an fp32 key would round it: the kernel refuses that pairing, torch rounds."""
    kmin, kmax, keys, ids, offsets = inputs(25, 8, 16, 2, 16)
    assert_bits(*both(kmin, kmax, keys, ids, offsets))
    from plugins.cpu import loader as _loader
    lib = _loader.library()
    h = kmin.half()
    rc = lib.lkv_update_summaries(h.data_ptr(), h.clone().data_ptr(), keys.data_ptr(), ids.data_ptr(),
                                  offsets.data_ptr(), 8, 2, 16, 16, cpu.KV_DTYPES[torch.float32],
                                  cpu.KV_DTYPES[torch.float16], 1)
    assert rc == cpu.abi.Status.ARG


def test_threads_do_not_change_the_result():
    args = inputs(30, 800, 16, 3, 125, restart=0.2)     # T * KVH * D above the kernel's LKV_PAR_MIN
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        (a, b), _ = both(*args)
        torch.set_num_threads(4)
        (c, d), _ = both(*args)
    finally:
        torch.set_num_threads(threads)
    assert_bits((a, b), (c, d))


@pytest.mark.parametrize("seed,T,unique", [(40, 3, True), (41, 30, False)])
def test_nan_key_propagates(seed, T, unique):
    """A NaN key gives NaN exactly where torch's does; every other element is bit-identical.
    (torch's own NaN bit pattern depends on its vector width and the element's position, so
    only NaN-ness is compared there.)"""
    kmin, kmax, keys, ids, offsets = inputs(seed, T, 16, 2, 24, unique=unique)
    keys[0, 1, 3] = float("nan")
    keys[T - 1, 0, 23] = -float("nan")
    kmin[ids[1], 0, 5] = float("nan")          # a NaN already in a summary
    c, t = both(kmin, kmax, keys, ids, offsets)
    for a, b in zip(c, t):
        nan = torch.isnan(b)
        assert nan.any() and torch.equal(torch.isnan(a), nan)
        assert torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def test_out_of_range_id_raises_and_changes_nothing():
    kmin, kmax, keys, ids, offsets = inputs(50, 4, 8, 2, 16, unique=True)
    before = kmin.clone(), kmax.clone()
    for bad in (8, -1):
        ids[2] = bad
        with pytest.raises(ValueError, match="block_ids"):
            cpu.update_summaries(kmin, kmax, keys, ids, offsets)
        assert_bits((kmin, kmax), before)


def test_layouts_the_kernel_does_not_take_run_the_torch_implementation():
    """Strided keys and ids are copied; fp16 summaries of fp16 keys run the kernel; each equals the
    reference."""
    kmin, kmax, keys, ids, offsets = inputs(60, 12, 10, 2, 16)
    wide = torch.randn(12, 2, 32, generator=torch.Generator().manual_seed(61))
    keys = wide[:, :, ::2]
    assert_bits(*both(kmin, kmax, keys, ids.repeat_interleave(2)[::2], offsets))
    assert_bits(*both(kmin.half(), kmax.half(), keys.half(), ids, offsets))
    assert cpu.update_summaries(kmin, kmax, keys[:0], ids[:0], offsets[:0]) is None


def test_c_table_entry_is_the_kernel():
    from runtime.ops import select_ops
    assert select_ops(torch.device("cpu"), torch.float32, impl="c").update_summaries is cpu.update_summaries
    assert select_ops(torch.device("cpu"), torch.float32, impl="torch").update_summaries is _update_summaries_impl
