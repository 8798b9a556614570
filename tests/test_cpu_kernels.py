"""plugins/cpu: the C kernels against torch on fresh random inputs, in the layouts the runtime
passes them (strided views of the device tier and the summaries), and their fallbacks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import plugins
from plugins import cpu
from plugins import reference as ref
from plugins.attention import _attention_math
from plugins.cpu import loader
from runtime.ops import select_ops

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"plugins.cpu: {loader.unavailable_reason()}")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 16])
@pytest.mark.parametrize("n_out,n_in", [(960, 576), (577, 100), (1, 8), (6, 3), (32, 1536), (40, 70), (8, 33)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_matches_torch(rows, n_out, n_in, threads):
    g = _gen(rows * 1000 + n_out)
    x, w, b = (torch.randn(s, generator=g) for s in ((rows, n_in), (n_out, n_in), (n_out,)))
    torch.set_num_threads(threads)
    for bias in (None, b):
        torch.testing.assert_close(cpu.linear(x, w, bias), F.linear(x, w, bias), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cpu.linear(x.t().contiguous().t(), w), F.linear(x, w), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows,n", [(1, 576), (8, 576), (3, 64), (16, 8)])
def test_rms_norm_matches_torch(rows, n):
    g = _gen(rows * 7 + n)
    x, w = torch.randn(rows, n + 5, generator=g)[:, 2:n + 2] * 3, torch.randn(n, generator=g)     # strided rows
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), F.rms_norm(x, (n,), w, 1e-5), atol=1e-5, rtol=1e-5)
    assert cpu.rms_norm(torch.zeros(2, n), w, 1e-5).abs().max() == 0                  # eps keeps 0/0 away


def test_rms_norm_falls_back_where_the_kernel_does_not_apply():
    g = _gen(5)
    for x, w in ((torch.randn(2, 12, generator=g), torch.randn(12, generator=g)),                # N % 8
                 (torch.randn(2, 3, 16, generator=g), torch.randn(16, generator=g)),             # 3-D
                 (torch.randn(2, 16, generator=g).half(), torch.randn(16, generator=g).half())):  # fp16
        torch.testing.assert_close(cpu.rms_norm(x, w, 1e-6), F.rms_norm(x, w.shape, w, 1e-6))
    x = torch.randn(2, 16, generator=g, requires_grad=True)
    cpu.rms_norm(x, torch.ones(16), 1e-6).sum().backward()                                # autograd intact
    assert x.grad is not None


def test_linear_falls_back_where_the_kernel_does_not_apply():
    g = _gen(1)
    w = torch.randn(40, 24, generator=g)
    for x in (torch.randn(17, 24, generator=g), torch.randn(2, 3, 24, generator=g)):       # many rows; 3-D
        torch.testing.assert_close(cpu.linear(x, w), F.linear(x, w))
    xh, wh = torch.randn(2, 24, generator=g).half(), w.half()
    assert cpu.linear(xh, wh).dtype == torch.float16
    x = torch.randn(2, 24, generator=g, requires_grad=True)
    cpu.linear(x, w).sum().backward()                                                     # autograd intact
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, -1))
    with pytest.raises(RuntimeError):
        cpu.linear(torch.randn(2, 23), w)                                                 # torch's shape error


def _device_tier(g, B, KVH, slots, D, used):
    """K/V as the runtime passes them: a [:B, :, :used] view of a larger [lanes, KVH, slots, D] buffer."""
    k = torch.randn(B + 1, KVH, slots, D, generator=g)
    v = torch.randn(B + 1, KVH, slots, D, generator=g)
    return k[:B, :, :used], v[:B, :, :used]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("B,R,H,KVH,D,used,E", [(4, 2, 9, 3, 64, 300, 2), (2, 1, 32, 8, 128, 77, 1),
                                                 (1, 2, 4, 4, 32, 9, 2), (3, 2, 64, 2, 64, 40, 0)])
def test_attention_matches_torch_on_runtime_layouts(seed, B, R, H, KVH, D, used, E):
    g = _gen(seed)
    q = torch.randn(B, R, H, D, generator=g)
    k, v = _device_tier(g, B, KVH, used + 16, D, used)
    kv_mask = torch.rand(B, KVH, used, generator=g) < 0.5
    kv_mask[0, 0] = False                                     # a head that selected nothing
    # the rows' own K/V: views into one fused projection, K and V with different strides
    qkv = torch.randn(B * R, 3 * KVH * D + 5, generator=g)
    kx = qkv[:, :KVH * D].reshape(B, R, KVH, D)[:, :E].transpose(1, 2)
    vx = qkv[:, 2 * KVH * D + 5:].reshape(B, R, KVH, D)[:, :E].transpose(1, 2)
    extra_mask = torch.ones(R, E, dtype=torch.bool).tril().expand(B, R, E).contiguous()
    if E:
        extra_mask[-1, 0] = False
    args = (q, k, v, kv_mask, kx, vx, extra_mask, D ** -0.5)
    assert cpu.attention_supported(q, k, v, kx, vx)
    torch.testing.assert_close(cpu.attention(*args), _attention_math(*args), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(plugins.lookahead_attention(*args), ref.lookahead_attention_ref(*args),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("case", ["random", "first range empty", "only the last keys", "nothing visible"])
def test_attention_split_over_key_ranges_matches_torch(threads, case):
    # Fewer (sequence, KV head) units than 2 x threads: each unit's keys are split into ranges
    # attended on different threads and merged by their softmax max and denominator (attention.c,
    # key_splits); the extra keys go with the first range. Ranges that see no key must drop out.
    g = _gen(threads * 10 + len(case))
    B, R, H, KVH, D, N, E = 1, 2, 9, 3, 64, 1500, 2
    q = torch.randn(B, R, H, D, generator=g)
    k, v = _device_tier(g, B, KVH, N + 16, D, N)
    kv_mask = torch.rand(B, KVH, N, generator=g) < 0.7
    if case == "first range empty":
        kv_mask[..., :800] = False
    elif case == "only the last keys":
        kv_mask[..., :-3] = False
    elif case == "nothing visible":
        kv_mask[:] = False
    kx, vx = torch.randn(B, KVH, E, D, generator=g), torch.randn(B, KVH, E, D, generator=g)
    extra_mask = torch.ones(B, R, E, dtype=torch.bool).tril()
    if case == "nothing visible":
        extra_mask[:] = False
    args = (q, k, v, kv_mask, kx, vx, extra_mask, D ** -0.5)
    torch.set_num_threads(threads)
    out = cpu.attention(*args)
    torch.testing.assert_close(out, _attention_math(*args), atol=2e-5, rtol=1e-5)
    if case == "nothing visible":
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("threads", [1, 2])
def test_attention_paged_matches_torch_per_sequence(threads):
    # one call for sequences of different lengths at different runs of one pool layer
    g = _gen(40 + threads)
    KVH, H, D, bs, nb = 3, 9, 64, 16, 90
    pool_k, pool_v = torch.randn(KVH, nb, bs, D, generator=g), torch.randn(KVH, nb, bs, D, generator=g)
    starts, lens = [3, 40, 0, 70], [600, 17, 1, 320]
    q = torch.randn(len(lens), H, D, generator=g)
    torch.set_num_threads(threads)
    out = cpu.attention_paged(q, pool_k, pool_v, starts, lens, D ** -0.5)
    for b, (s, n) in enumerate(zip(starts, lens)):
        k = pool_k[:, s:].reshape(KVH, -1, D)[:, :n]
        v = pool_v[:, s:].reshape(KVH, -1, D)[:, :n]
        expected = F.scaled_dot_product_attention(q[b][None, :, None], k[None], v[None], scale=D ** -0.5,
                                                  enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[b], expected, atol=2e-5, rtol=1e-5)
    # arguments it does not take: None (the caller's per-sequence path runs), never a read past the pool
    assert cpu.attention_paged(q, pool_k, pool_v, [3, 40, 0, 89], lens, 0.125) is None        # runs off the end
    assert cpu.attention_paged(q, pool_k, pool_v, starts[:3], lens[:3], 0.125) is None        # B mismatch
    assert cpu.attention_paged(q[..., :16], pool_k[..., :16], pool_v[..., :16], starts, lens, 0.125) is None
    assert cpu.attention_paged(q, pool_k.transpose(1, 2), pool_v.transpose(1, 2), starts, lens, 0.125) is None
    with pytest.raises(ValueError, match="mask"):
        cpu.attention_paged(q, pool_k, pool_v, starts, lens, 0.125, cpu.paged_mask(lens[:2], KVH))




@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_paged_block_tables_match_torch_and_runs(threads, dtype):
    """Sequences whose blocks lie anywhere in the pool (a shared cached prefix, a fragmented free
    list): the same result as torch over the gathered keys, and bit for bit the run entry's where
    a table is a run. A pool past 2^16 rows, so a block id times the block size is a large row."""
    g = _gen(60 + threads)
    KVH, H, D, bs, nb = 3, 9, 64, 16, 5000
    pool_k = torch.randn(KVH, nb, bs, D, generator=g).to(dtype)
    pool_v = torch.randn(KVH, nb, bs, D, generator=g).to(dtype)
    lens = [600, 17, 1, 320]
    tables = [torch.randperm(nb, generator=g)[: -(-n // bs) + 2].tolist() for n in lens]   # spare blocks past the end
    tables[1] = [4990, 4999]                                     # the last blocks of the pool
    q = torch.randn(len(lens), H, D, generator=g)
    torch.set_num_threads(threads)
    out = cpu.attention_paged(q, pool_k, pool_v, None, lens, D ** -0.5, tables=tables)
    for b, (t, n) in enumerate(zip(tables, lens)):
        ids = torch.tensor(t)
        k = pool_k[:, ids].reshape(KVH, -1, D)[:, :n].float()
        v = pool_v[:, ids].reshape(KVH, -1, D)[:, :n].float()
        expected = F.scaled_dot_product_attention(q[b][None, :, None], k[None], v[None], scale=D ** -0.5,
                                                  enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[b], expected, atol=2e-5, rtol=1e-5)
    runs = [list(range(s, s + 40)) for s in (3, 100, 0, 2000)]
    assert torch.equal(cpu.attention_paged(q, pool_k, pool_v, None, lens, 0.125, tables=runs),
                       cpu.attention_paged(q, pool_k, pool_v, [3, 100, 0, 2000], lens, 0.125))
    short = [t[:1] for t in tables]                              # a table that does not cover its keys
    assert cpu.attention_paged(q, pool_k, pool_v, None, lens, 0.125, tables=short) is None
    bad = [t.copy() for t in tables]
    bad[2][0] = nb                                               # a block past the pool
    assert cpu.attention_paged(q, pool_k, pool_v, None, lens, 0.125, tables=bad) is None
def test_attention_zero_keys_and_unsupported_shapes():
    g = _gen(3)
    q = torch.randn(2, 2, 6, 64, generator=g)
    k = v = torch.randn(2, 3, 0, 64, generator=g)
    kx = vx = torch.randn(2, 3, 2, 64, generator=g)
    none = torch.zeros(2, 2, 2, dtype=torch.bool)
    out = cpu.attention(q, k, v, torch.zeros(2, 3, 0, dtype=torch.bool), kx, vx, none, 0.125)
    assert torch.equal(out, torch.zeros_like(out))                                  # sees no key: zeros
    assert not cpu.attention_supported(q[..., :16], k[..., :16], v[..., :16], kx[..., :16], vx[..., :16])
    assert not cpu.attention_supported(q.half(), k.half(), v.half(), kx.half(), vx.half())
    wide = torch.randn(2, 3, 9, 64, generator=g)
    assert not cpu.attention_supported(q, k, v, wide, wide)                          # E > 8


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("group_score", ["sum", "max"])
def test_block_topk_on_runtime_layouts(seed, group_score):
    # the runtime scores a [:n, :nb] view of [lanes * max_blocks, KVH, D] summaries with a
    # [:, :, :nb] view of its candidate masks
    g = _gen(seed)
    lanes, max_blocks, KVH, D, n, nb, R, H, k = 4, 70, 3, 64, 3, 61, 2, 9, 16
    a, b = torch.randn(2, lanes * max_blocks, KVH, D, generator=g)
    kmin = torch.minimum(a, b).view(lanes, max_blocks, KVH, D)[:n, :nb]
    kmax = torch.maximum(a, b).view(lanes, max_blocks, KVH, D)[:n, :nb]
    valid = (torch.rand(n, R, max_blocks, generator=g) < 0.8)[..., :nb]
    valid[2, 1, 5:] = False                                                           # fewer than k
    q = torch.randn(n, R, H, D, generator=g)
    assert cpu.block_topk_supported(q, kmin, kmax, valid)
    idx, scores = plugins.block_topk(q, kmin, kmax, valid, k, group_score)
    idx_ref, scores_ref = ref.block_topk_ref(q, kmin, kmax, valid, k, group_score)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(scores, scores_ref, atol=1e-4, rtol=1e-5)
    assert (idx[2, 1, :, 5:] == -1).all()                                            # padding


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_score", ["sum", "max"])
def test_block_topk_over_16_bit_summaries(dtype, group_score):
    """Summaries kept in the KV dtype (runtime/lookahead/summaries.py): the C kernel widens them as
    it reads, so scores and picks equal those of the same values widened to fp32 first, bit for
    bit, at D 64 (the unrolled form) and 40, with the last blocks' tail (NB % 4 != 0)."""
    for D, nb in ((64, 61), (40, 23)):
        g = _gen(7)
        a, b = torch.randn(2, 3, nb, 2, D, generator=g)
        kmin, kmax = torch.minimum(a, b).to(dtype), torch.maximum(a, b).to(dtype)
        valid = torch.rand(3, 2, nb, generator=g) < 0.9
        q = torch.randn(3, 2, 6, D, generator=g)
        assert cpu.block_topk_supported(q, kmin, kmax, valid)
        idx, scores = cpu.block_topk(q, kmin, kmax, valid, 8, group_score)
        idx32, scores32 = cpu.block_topk(q, kmin.float(), kmax.float(), valid, 8, group_score)
        assert torch.equal(idx, idx32) and torch.equal(scores, scores32)
        idx_t, scores_t = plugins.direct.block_topk(q, kmin, kmax, valid, 8, group_score)    # the torch table's
        assert torch.equal(idx, idx_t)
        torch.testing.assert_close(scores, scores_t, atol=1e-4, rtol=1e-5)
        with pytest.raises(ValueError, match="kmin"):
            plugins.block_topk(q.half(), kmin.float(), kmax.float(), valid, 8, group_score)


def test_the_torch_table_has_no_c_entry():
    """impl="torch" (what LOOKAHEAD_CPU_KERNELS=0 was): no entry of the table is a C kernel's."""
    c, t = select_ops(torch.device("cpu"), torch.float32, "c"), select_ops(torch.device("cpu"), torch.float32, "torch")
    assert c.fused_decoder is not None and c.plan_slots is not None and c.linear is cpu.linear
    for name in ("paged_attention", "plan_slots", "fused_decoder", "lookahead_layer"):
        assert getattr(t, name) is None, name
    # the slot plan and the copies are the ops' torch implementations (one op each through the dispatcher)
    assert t.plan_slots_fixed is plugins.direct.plan_slots and t.copy_blocks.op is plugins.direct.copy_blocks
    assert c.copy_blocks is not t.copy_blocks
    assert t.linear is F.linear and t.block_topk is plugins.direct.block_topk
    assert all(getattr(t, f) is not getattr(c, f) for f in ("linear", "rms_norm", "block_topk", "lookahead_attention"))
    with pytest.raises(ValueError, match="impl='c'"):
        select_ops(torch.device("cuda"), torch.float32, "c")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [30, 300])          # 300 units: split over the calling thread's team
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_copy_blocks_matches_indexing_and_checks_bounds(dtype, n, threads):
    from plugins.cpu import bookkeeping
    from runtime.transfer import CopyJob
    torch.set_num_threads(threads)
    g = _gen(4)
    L, KVH, NB, bs, D, lanes, slots = 2, 3, 50, 16, 64, 4, 80
    pool_k, pool_v = torch.randn(2, L, KVH, NB, bs, D, generator=g).to(dtype)     # head-major, as KVPool
    src_k, src_v = pool_k[1].transpose(0, 1), pool_v[1].transpose(0, 1)  # KVPool.by_block's views
    dst_k, dst_v = torch.zeros(2, lanes, KVH, slots, bs, D, dtype=dtype)
    src_index = (torch.randint(0, NB, (n,), generator=g), torch.randint(0, KVH, (n,), generator=g))
    flat = torch.randperm(lanes * slots, generator=g)[:n]                 # distinct destinations
    dst_index = (flat // slots, src_index[1], flat % slots)
    assert bookkeeping.copy_blocks(src_k, src_v, dst_k, dst_v, src_index, dst_index)     # the C path ran
    ek, ev = torch.zeros_like(dst_k), torch.zeros_like(dst_v)
    ek[dst_index], ev[dst_index] = src_k[src_index], src_v[src_index]
    assert torch.equal(dst_k, ek) and torch.equal(dst_v, ev)
    dst_k.zero_(), dst_v.zero_()
    CopyJob(src_k, src_v, dst_k, dst_v, src_index, dst_index).execute()
    assert torch.equal(dst_k, ek) and torch.equal(dst_v, ev)
    bad = (dst_index[0], dst_index[1], dst_index[2] + slots)
    with pytest.raises(IndexError, match="copy_blocks"):
        bookkeeping.copy_blocks(src_k, src_v, dst_k, dst_v, src_index, bad)
    other = torch.float32 if dtype != torch.float32 else torch.float16      # mixed dtypes: torch's path
    assert not bookkeeping.copy_blocks(src_k, src_v, dst_k.to(other), dst_v.to(other), src_index, dst_index)
    if dtype != torch.float32:           # an odd unit of 16-bit elements is not whole 4-byte words
        odd_k, odd_v = (t[:, :, :1, :33] for t in (src_k, src_v))
        assert not bookkeeping.copy_blocks(odd_k.contiguous(), odd_v.contiguous(), dst_k[..., :1, :33].contiguous(),
                                           dst_v[..., :1, :33].contiguous(), src_index, dst_index)
    short = (dst_index[0][:-1], dst_index[1][:-1], dst_index[2][:-1])
    assert not bookkeeping.copy_blocks(src_k, src_v, dst_k, dst_v, src_index, short)  # left to torch's error


def test_linear_packed_weights_follow_in_place_changes():
    g = _gen(5)
    w, x = torch.randn(32, 24, generator=g), torch.randn(3, 24, generator=g)
    first = cpu.linear(x, w)
    assert cpu.ops.packed_weight(w) is not None                       # N % 8 == 0: the packed path
    with torch.no_grad():
        w.mul_(2.0)                                                   # in place: the pack must follow
    torch.testing.assert_close(cpu.linear(x, w), 2 * first, atol=1e-4, rtol=1e-5)
    assert cpu.ops.packed_weight(torch.randn(20, 24)) is None          # N % 8 != 0: F.linear runs
    wt = torch.randn(24, 32, generator=g).t()                         # a transposed (strided) weight packs too
    torch.testing.assert_close(cpu.linear(x, wt), F.linear(x, wt), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 37, 300])
def test_dense_decode_attention_on_a_pool_view(length):
    from runtime.attention_dense import decode_attention
    g = _gen(length)
    H, KVH, D, bs = 9, 3, 64, 16
    pool_k, pool_v = torch.randn(2, KVH, 40, bs, D, generator=g)                      # [KVH, blocks, bs, D]
    n = -(-length // bs)
    k = pool_k[:, 5:5 + n].reshape(KVH, n * bs, D)[:, :length]                       # KVPool.read's view
    v = pool_v[:, 5:5 + n].reshape(KVH, n * bs, D)[:, :length]
    q = torch.randn(H, D, generator=g)
    expected = F.scaled_dot_product_attention(q[None, :, None], k[None], v[None], scale=D ** -0.5,
                                              enable_gqa=True)[0, :, 0]
    torch.testing.assert_close(decode_attention(q, k, v, D ** -0.5), expected, atol=2e-5, rtol=1e-5)


def test_kernels_show_up_in_the_torch_profiler():
    # bench_decode.py --profile groups ops by name; ctypes calls are invisible unless they open a range
    from torch.profiler import profile
    with profile() as prof:
        cpu.linear(torch.randn(2, 24), torch.randn(32, 24))
    assert "lookahead_cpu::linear" in {e.key for e in prof.key_averages()}


def test_unvalidated_op_entry_never_hands_the_kernels_inconsistent_shapes():
    # torch.ops.lookahead.* skips the wrappers' checks (CONTRACTS.md); inputs a kernel would read
    # out of bounds must take the torch path, which raises, instead
    g = _gen(6)
    q = torch.randn(2, 2, 6, 64, generator=g)
    kmin = torch.randn(2, 10, 3, 64, generator=g)
    valid = torch.ones(2, 2, 10, dtype=torch.bool)
    assert cpu.block_topk_supported(q, kmin, kmin + 1, valid, 4)
    for bad_kmax, bad_valid, k in ((kmin[:, :5] + 1, valid, 4), (kmin + 1, valid[:, :, :5], 4), (kmin + 1, valid, 11)):
        assert not cpu.block_topk_supported(q, kmin, bad_kmax, bad_valid, k)
        with pytest.raises((RuntimeError, IndexError, ValueError)):
            torch.ops.lookahead.block_topk(q, kmin, bad_kmax, bad_valid, k, "max")
    k = v = torch.randn(2, 3, 20, 64, generator=g)
    kx = vx = torch.randn(2, 3, 2, 64, generator=g)
    mask, xm = torch.ones(2, 3, 20, dtype=torch.bool), torch.ones(2, 2, 2, dtype=torch.bool)
    assert cpu.attention_supported(q, k, v, kx, vx, mask, xm)
    for args in ((k, v[:, :, :10], mask, xm), (k, v, mask[:, :, :10], xm), (k, v, mask, xm[:, :1])):
        assert not cpu.attention_supported(q, args[0], args[1], kx, vx, args[2], args[3])
        with pytest.raises((RuntimeError, IndexError, ValueError)):
            torch.ops.lookahead.lookahead_attention(q, args[0], args[1], args[2], kx, vx, args[3], 0.125)


def test_dense_backend_batches_decode_rows_into_one_paged_call():
    # A step with two decode items in runs of blocks (one paged kernel call a layer), one whose
    # blocks are scattered and a prefill chunk (their own paths): every row as attention alone gives.
    from runtime.attention_dense import DenseAttention
    from runtime.config import ModelConfig
    from runtime.kv_pool import KVPool
    from runtime.step import StepBatch, StepItem
    g = _gen(50)
    cfg = ModelConfig(architecture="llama", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=64, max_position_embeddings=512)
    bs = 4
    pool = KVPool(cfg, num_blocks=60, block_size=bs)
    pool.k.normal_(generator=g), pool.v.normal_(generator=g)
    items = [StepItem(0, 0, 1, 37, list(range(2, 12))),            # decode, blocks 2..11
             StepItem(1, 1, 3, 8, [30, 31, 32]),                    # prefill chunk at 8..10
             StepItem(2, 4, 1, 13, [50, 40, 41, 44]),               # decode, scattered blocks
             StepItem(3, 5, 1, 5, [20, 21])]                        # decode, blocks 20..21
    batch = StepBatch.build(items, [0] * 6, bs)
    q, k, v = (torch.randn(6, h, 64, generator=g) for h in (6, 2, 2))
    calls = []

    def record(name, fn):               # the table's paged kernel, its block tables noted
        return (lambda *a, **kw: calls.append(a[7]) or fn(*a, **kw)) if name == "paged_attention" else fn
    ops = select_ops(torch.device("cpu"), torch.float32).wrapped(record)
    out = DenseAttention(pool, 0.125, ops).step(batch).forward(1, q, k, v)
    # every decode item in one call, the scattered blocks' too (their block tables)
    assert calls == [[list(range(2, 12)), [50, 40, 41, 44], [20, 21]]]
    for it in items:
        rows = slice(it.row_start, it.row_start + it.num_tokens)
        kc, vc = pool.read(1, it.block_table, it.context_len)
        n, L = it.num_tokens, it.context_len
        mask = torch.ones(n, L, dtype=torch.bool).tril(diagonal=L - n)
        expected = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], kc[None], vc[None], attn_mask=mask,
                                                  scale=0.125, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[rows], expected, atol=2e-5, rtol=1e-5)
