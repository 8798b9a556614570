"""Numerics of the lookahead ops: the torch implementations against the plain-torch references,
the references against independent checks (dense SDPA, brute force), argument validation, and
the torch.library registration (opcheck, compile)."""
from __future__ import annotations

import functools
import importlib
import itertools
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import plugins
from plugins import cpu
from plugins import reference as ref
from plugins.reference import TOLERANCES
from runtime.ops import select_ops

FLOATS = [torch.float32, torch.bfloat16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- block_gather

@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads,block_size,head_dim,n", [(3, 16, 64, 40), (1, 4, 8, 1), (2, 2, 16, 0)])
def test_block_gather_matches_reference(seed, dtype, num_kv_heads, block_size, head_dim, n):
    g = _gen(seed)
    src = _randn(g, 97, num_kv_heads, block_size, head_dim, dtype=dtype)
    ids = torch.randint(0, 97, (num_kv_heads, n), generator=g)             # repeats included
    out = plugins.block_gather(src, ids)
    assert out.shape == (num_kv_heads, n, block_size, head_dim) and out.dtype == dtype
    assert torch.equal(out, ref.block_gather_ref(src, ids))                # a copy: bit-exact


def test_block_gather_non_contiguous_src():
    g = _gen(2)
    src = _randn(g, 20, 3, 8, 16).transpose(2, 3)                          # [20, 3, 16, 8] strided
    ids = torch.randint(0, 20, (3, 9), generator=g)
    assert torch.equal(plugins.block_gather(src, ids), ref.block_gather_ref(src, ids))


def test_block_gather_large_block_ids():
    # Block ids near 2**20 whose element offsets pass 2**31 (16-bit elements, 4 GiB of virtual
    # memory): an int32 offset anywhere overflows. torch.empty maps the pool lazily; only the
    # gathered blocks are written and read.
    num_blocks, num_kv_heads, block_size, head_dim = 2**20 + 8, 2, 16, 64
    assert num_blocks * num_kv_heads * block_size * head_dim > 2**31
    src = torch.empty((num_blocks, num_kv_heads, block_size, head_dim), dtype=torch.float16)
    ids = torch.tensor([[num_blocks - 1, 2**20, 3, 2**20 + 5], [2**20 + 7, 0, num_blocks - 2, 2**20 - 1]])
    g = _gen(3)
    for h in range(num_kv_heads):
        src[ids[h], h] = _randn(g, ids.shape[1], block_size, head_dim, dtype=torch.float16)
    out = plugins.block_gather(src, ids)
    assert torch.equal(out, ref.block_gather_ref(src, ids))
    assert torch.equal(out[1, 0], src[2**20 + 7, 1])


# ---------------------------------------------------------------- block_topk

@pytest.fixture(params=["cpu_kernel", "torch"])
def topk_path(request):
    """The checked op over the C table's entry (fp32 CPU inputs with D % 8 == 0: its C kernel) or
    the torch table's: each test runs both."""
    if request.param == "cpu_kernel" and not cpu.available():
        pytest.skip("no CPU kernels")
    impl = "c" if request.param == "cpu_kernel" else "torch"
    return functools.partial(plugins.block_topk, impl=select_ops(torch.device("cpu"), torch.float32, impl).block_topk)


def _summaries(g, B, NB, KVH, D, dtype):
    a, b = _randn(g, B, NB, KVH, D, dtype=dtype), _randn(g, B, NB, KVH, D, dtype=dtype)
    return torch.minimum(a, b), torch.maximum(a, b)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("k", [1, 7, 40])
@pytest.mark.parametrize("group_score", ["sum", "max"])
def test_block_topk_matches_reference(seed, dtype, group, k, group_score, topk_path):
    g = _gen(seed)
    B, KVH, D, NB = 2, 3, 32, 40
    q = _randn(g, B, KVH * group, D, dtype=dtype)
    kmin, kmax = _summaries(g, B, NB, KVH, D, dtype)
    valid = torch.rand(B, NB, generator=g) < 0.8
    valid[1, 25:] = False                                                 # a shorter sequence
    idx, scores = topk_path(q, kmin, kmax, valid, k, group_score)
    idx_ref, scores_ref = ref.block_topk_ref(q, kmin, kmax, valid, k, group_score)
    assert idx.dtype == torch.int64 and scores.dtype == torch.float32
    assert torch.equal(idx, idx_ref)
    _assert_close(scores, scores_ref, torch.float32)                      # fp32 math for every dtype


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", FLOATS)
def test_block_topk_rows_match_reference_row_by_row(seed, dtype, topk_path):
    # A decode step scores the real and the draft query in one call, each with its own mask.
    g = _gen(seed)
    B, R, KVH, group, D, NB, k = 3, 2, 3, 3, 32, 50, 9
    q = _randn(g, B, R, KVH * group, D, dtype=dtype)
    kmin, kmax = _summaries(g, B, NB, KVH, D, dtype)
    valid = torch.rand(B, R, NB, generator=g) < 0.8
    valid[2, :, 6:] = False                                               # fewer valid blocks than k
    idx, scores = topk_path(q, kmin, kmax, valid, k)
    assert idx.shape == (B, R, KVH, k) and scores.shape == (B, R, KVH, NB)
    idx_ref, scores_ref = ref.block_topk_ref(q, kmin, kmax, valid, k)
    assert torch.equal(idx, idx_ref)
    _assert_close(scores, scores_ref, torch.float32)
    for r in range(R):                                                    # = the one-row op
        one_idx, one_scores = topk_path(q[:, r].contiguous(), kmin, kmax, valid[:, r].contiguous(), k)
        assert torch.equal(idx[:, r], one_idx)
        _assert_close(scores[:, r], one_scores, torch.float32)
    assert not torch.equal(idx[:, 0], idx[:, 1])                          # the rows are really distinct


def test_block_topk_max_keeps_a_block_only_one_head_wants(topk_path):
    # One head of a group of three scores block 5 highest by far, the other two rank it last:
    # the group's max keeps it in the top 2, the group's sum drops it.
    D, NB = 8, 8
    q = torch.eye(D)[[0, 1, 1]][None]                                               # [1, H=3, D]
    keys = torch.zeros(1, NB, 1, D)
    keys[0, :, 0, 1] = torch.arange(NB, dtype=torch.float32) / NB                   # heads 1, 2: later is better
    keys[0, 5, 0, 0], keys[0, 5, 0, 1] = 1.5, -1.0                                   # head 0's block
    valid = torch.ones(1, NB, dtype=torch.bool)
    top_max, _ = topk_path(q, keys, keys, valid, 2, "max")
    top_sum, _ = topk_path(q, keys, keys, valid, 2, "sum")
    assert top_max.tolist() == [[[5, 7]]]
    assert 5 not in top_sum.flatten().tolist()
    with pytest.raises(ValueError, match=r"^group_score: 'mean' is unknown"):
        topk_path(q, keys, keys, valid, 2, "mean")


def test_block_topk_rows_need_a_mask_per_row():
    q = torch.zeros(2, 2, 4, 8)
    kmin = torch.zeros(2, 10, 2, 8)
    with pytest.raises(ValueError, match=r"^valid: "):
        plugins.block_topk(q, kmin, kmin + 1, torch.ones(2, 10, dtype=torch.bool), 3)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("group_score", ["sum", "max"])
def test_block_topk_ties_go_to_lower_block_id(seed, dtype, group_score, topk_path):
    # Small integers make every product and sum exact in fp32, so scores tie often and exactly,
    # whatever the summation order: indices must still agree with the reference bit for bit.
    g = _gen(seed)
    B, H, KVH, D, NB = 2, 6, 2, 8, 48
    q = torch.randint(-2, 3, (B, H, D), generator=g).to(dtype)
    a = torch.randint(-2, 3, (B, NB, KVH, D), generator=g).to(dtype)
    b = torch.randint(-2, 3, (B, NB, KVH, D), generator=g).to(dtype)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    valid = torch.ones(B, NB, dtype=torch.bool)
    idx, scores = topk_path(q, kmin, kmax, valid, 10, group_score)
    idx_ref, scores_ref = ref.block_topk_ref(q, kmin, kmax, valid, 10, group_score)
    assert torch.equal(scores, scores_ref)
    assert torch.equal(idx, idx_ref)
    threshold = scores.gather(-1, idx).amin(-1, keepdim=True)
    assert ((scores == threshold).sum(-1) > 1).any(), "the inputs should produce ties at the boundary"


def _bound_by_corners(q, kmin, kmax):
    """Brute force: the Quest bound of head h is the max over the box's 2**D corners of q_h . corner."""
    B, H, D = q.shape
    NB, KVH = kmin.shape[1], kmin.shape[2]
    group = H // KVH
    per_head = torch.full((B, H, NB), float("-inf"), dtype=torch.float64)
    for bits in itertools.product([False, True], repeat=D):
        corners = torch.where(torch.tensor(bits), kmax, kmin).double()   # [B, NB, KVH, D]
        for h in range(H):
            dots = (corners[:, :, h // group] * q[:, h].double().unsqueeze(1)).sum(-1)
            per_head[:, h] = torch.maximum(per_head[:, h], dots)
    return per_head.view(B, KVH, group, NB).sum(2)                        # [B, KVH, NB]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("group", [1, 3])
def test_block_topk_against_brute_force(seed, group, topk_path):
    g = _gen(seed)
    B, KVH, D, NB, k = 2, 2, 4, 30, 9
    q = _randn(g, B, KVH * group, D)
    kmin, kmax = _summaries(g, B, NB, KVH, D, torch.float32)
    valid = torch.rand(B, NB, generator=g) < 0.7
    idx, scores = topk_path(q, kmin, kmax, valid, k)

    bound = _bound_by_corners(q, kmin, kmax)
    vmask = valid.unsqueeze(1).expand_as(bound)
    torch.testing.assert_close(scores[vmask].double(), bound[vmask], atol=1e-5, rtol=1e-5)
    assert torch.all(scores[~vmask] == float("-inf"))
    for b, h in itertools.product(range(B), range(KVH)):
        row = idx[b, h].tolist()
        m = min(k, int(valid[b].sum()))
        chosen, pad = row[:m], row[m:]
        assert pad == [-1] * (k - m) and chosen == sorted(set(chosen))
        assert all(valid[b, i] for i in chosen)
        s = bound[b, h]
        for i in chosen:                                                   # every pick beats every reject
            for j in (j for j in range(NB) if valid[b, j] and j not in chosen):
                assert s[i] > s[j] or (s[i] == s[j] and i < j)


def test_block_topk_pads_with_minus_one(topk_path):
    g = _gen(4)
    B, H, KVH, D, NB = 1, 3, 3, 8, 12
    q = _randn(g, B, H, D)
    kmin, kmax = _summaries(g, B, NB, KVH, D, torch.float32)
    kmin[0, 5], kmax[0, 5] = float("inf"), float("-inf")                 # an empty block's summary
    valid = torch.zeros(B, NB, dtype=torch.bool)
    valid[0, [2, 5, 9]] = True
    valid[0, 5] = False
    idx, scores = topk_path(q, kmin, kmax, valid, 6)
    assert idx.tolist() == [[[2, 9, -1, -1, -1, -1]] * KVH]
    assert torch.isfinite(scores[0, :, [2, 9]]).all() and (scores[0, :, 5] == float("-inf")).all()
    assert torch.equal(idx, ref.block_topk_ref(q, kmin, kmax, valid, 6)[0])


def test_block_topk_large_block_ids():
    # 2**20 + 5 blocks (head_dim 2): winners planted at ids past 2**20 must come back intact.
    NB = 2**20 + 5
    g = _gen(5)
    q = torch.tensor([[[1.0, 0.5]]])                                      # [B=1, H=1, D=2]
    kmin = _randn(g, 1, NB, 1, 2) * 0.1
    kmax = kmin + 0.1
    winners = [3, 2**20 - 1, 2**20 + 2, NB - 1]
    kmax[0, winners] += torch.tensor([4.0, 1.0, 2.0, 3.0]).view(4, 1, 1)
    valid = torch.ones(1, NB, dtype=torch.bool)
    idx, scores = plugins.block_topk(q, kmin, kmax, valid, 4)
    assert idx.tolist() == [[winners]]
    assert scores.shape == (1, 1, NB) and float(scores[0, 0, NB - 1]) > 3.0


# ---------------------------------------------------------------- update_summaries

def _update_inputs(g, num_blocks, KVH, D, T, dtype):
    kmin = _randn(g, num_blocks, KVH, D, dtype=dtype)
    kmax = kmin + _randn(g, num_blocks, KVH, D, dtype=dtype).abs()
    keys = _randn(g, T, KVH, D, dtype=dtype)
    ids = torch.randint(0, num_blocks, (T,), generator=g)
    offsets = torch.randint(0, 3, (T,), generator=g)                      # ~1/3 resets
    return kmin, kmax, keys, ids, offsets


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T", [1, 5, 64])
def test_update_summaries_matches_reference(seed, dtype, T):
    # Few blocks, many tokens: blocks get several tokens, resets and tokens before a reset.
    g = _gen(seed)
    kmin, kmax, keys, ids, offsets = _update_inputs(g, 7, 3, 16, T, dtype)
    kmin_ref, kmax_ref = kmin.clone(), kmax.clone()
    out = plugins.update_summaries(kmin, kmax, keys, ids, offsets)
    ref.update_summaries_ref(kmin_ref, kmax_ref, keys, ids, offsets)
    assert out is None
    assert torch.equal(kmin, kmin_ref) and torch.equal(kmax, kmax_ref)     # min/max: bit-exact


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", FLOATS)
def test_update_summaries_one_key_per_block_matches_reference(seed, dtype):
    # A decode step: every key lands in a different block (the op's scatter-free path).
    g = _gen(seed)
    kmin, kmax, keys, _, offsets = _update_inputs(g, 64, 3, 16, 8, dtype)
    ids = torch.randperm(64, generator=g)[:8]
    kmin_ref, kmax_ref = kmin.clone(), kmax.clone()
    plugins.update_summaries(kmin, kmax, keys, ids, offsets)
    ref.update_summaries_ref(kmin_ref, kmax_ref, keys, ids, offsets)
    assert torch.equal(kmin, kmin_ref) and torch.equal(kmax, kmax_ref)
    assert not torch.equal(kmin, _update_inputs(_gen(seed), 64, 3, 16, 8, dtype)[0])   # it wrote


def test_update_summaries_reset_after_tokens_of_the_same_call():
    # A block gets tokens, then is reset (reused) within the call: only the reset and later count.
    kmin, kmax = torch.full((2, 1, 2), 9.0), torch.full((2, 1, 2), 10.0)
    keys = torch.tensor([[-5.0, 5.0], [1.0, 2.0], [3.0, -1.0], [0.5, 0.5]]).view(4, 1, 2)
    plugins.update_summaries(kmin, kmax, keys, torch.tensor([1, 1, 1, 0]), torch.tensor([3, 0, 1, 2]))
    assert kmin[1, 0].tolist() == [1.0, -1.0] and kmax[1, 0].tolist() == [3.0, 2.0]
    assert kmin[0, 0].tolist() == [0.5, 0.5] and kmax[0, 0].tolist() == [10.0, 10.0]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", FLOATS)
def test_prefill_in_one_call_equals_token_by_token(seed, dtype):
    # Two sequences' prompts written through a block table, as the runtime's prefill does.
    g = _gen(seed)
    block_size, KVH, D, num_blocks = 4, 3, 8, 32
    kmin, kmax = _randn(g, num_blocks, KVH, D, dtype=dtype), _randn(g, num_blocks, KVH, D, dtype=dtype)
    tables = [torch.randperm(num_blocks, generator=g)[:5], torch.randperm(num_blocks, generator=g)[:3]]
    tables[1] = tables[1][~torch.isin(tables[1], tables[0])]
    lengths = [17, 4 * len(tables[1]) - 1]
    pos = torch.cat([torch.arange(n) for n in lengths])
    ids = torch.cat([t[torch.arange(n) // block_size] for t, n in zip(tables, lengths)])
    keys = _randn(g, len(pos), KVH, D, dtype=dtype)

    one_min, one_max = kmin.clone(), kmax.clone()
    plugins.update_summaries(one_min, one_max, keys, ids, pos % block_size)
    step_min, step_max = kmin.clone(), kmax.clone()
    for t in range(len(pos)):
        plugins.update_summaries(step_min, step_max, keys[t:t + 1], ids[t:t + 1], pos[t:t + 1] % block_size)
    assert torch.equal(one_min, step_min) and torch.equal(one_max, step_max)
    # And the summaries are the true min/max of each block's keys.
    first = ids[0]
    assert torch.equal(one_min[first], keys[:block_size].amin(0))
    assert torch.equal(one_max[first], keys[:block_size].amax(0))


def test_update_summaries_large_block_ids():
    g = _gen(6)
    num_blocks = 2**20 + 8
    kmin, kmax, keys, _, _ = _update_inputs(g, num_blocks, 1, 2, 6, torch.float32)
    ids = torch.tensor([num_blocks - 1, 2**20, num_blocks - 1, 2**20 + 3, 2**20, 7])
    offsets = torch.tensor([0, 5, 1, 0, 6, 2])
    kmin_ref, kmax_ref = kmin.clone(), kmax.clone()
    plugins.update_summaries(kmin, kmax, keys, ids, offsets)
    ref.update_summaries_ref(kmin_ref, kmax_ref, keys, ids, offsets)
    assert torch.equal(kmin, kmin_ref) and torch.equal(kmax, kmax_ref)
    assert torch.equal(kmin[num_blocks - 1], torch.minimum(keys[0], keys[2]))


# ---------------------------------------------------------------- lookahead_attention

def _attention_inputs(seed, B, R, H, KVH, N, E, D, dtype):
    g = _gen(seed)
    q = _randn(g, B, R, H, D, dtype=dtype)
    k, v = _randn(g, B, KVH, N, D, dtype=dtype), _randn(g, B, KVH, N, D, dtype=dtype)
    kv_mask = torch.rand(B, KVH, N, generator=g) < 0.6                    # per-head selections + padding
    k_extra, v_extra = _randn(g, B, KVH, E, D, dtype=dtype), _randn(g, B, KVH, E, D, dtype=dtype)
    # Row r sees the fresh rows 0..r (the real row itself; the draft row the real row and itself).
    extra_mask = torch.ones(R, E, dtype=torch.bool).tril().expand(B, R, E).clone()
    return q, k, v, kv_mask, k_extra, v_extra, extra_mask, D ** -0.5


SHAPES = [  # B, R, H, KVH, N, E, D
    (2, 2, 9, 3, 70, 2, 64),
    (3, 2, 2, 2, 33, 2, 16),
    (1, 1, 6, 2, 5, 1, 8),
    (2, 2, 3, 3, 40, 0, 32),
]


@pytest.fixture(params=["cpu_kernel", "torch"])
def attention_path(request):
    """The checked op over the C table's entry (fp32 CPU inputs: its C kernel) or the torch
    table's: each test runs both."""
    if request.param == "cpu_kernel" and not cpu.available():
        pytest.skip("no CPU kernels")
    impl = "c" if request.param == "cpu_kernel" else "torch"
    return functools.partial(plugins.lookahead_attention,
                             impl=select_ops(torch.device("cpu"), torch.float32, impl).lookahead_attention)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_lookahead_attention_matches_reference(seed, dtype, shape, attention_path):
    args = _attention_inputs(seed, *shape, dtype=dtype)
    out = attention_path(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    _assert_close(out, ref.lookahead_attention_ref(*args), dtype)


def _dense_sdpa(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale):
    """Independent check: dense SDPA over [k; k_extra] with the visibility as an explicit mask."""
    B, R, H, _ = q.shape
    KVH, N, E = k.shape[1], k.shape[2], k_extra.shape[2]
    mask = torch.cat([kv_mask.unsqueeze(2).expand(B, KVH, R, N),
                      extra_mask.unsqueeze(1).expand(B, KVH, R, E)], dim=-1)
    mask = mask.repeat_interleave(H // KVH, dim=1)                        # [B, H, R, N+E]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), torch.cat([k, k_extra], 2),
                                         torch.cat([v, v_extra], 2), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_lookahead_attention_reference_equals_dense_sdpa(seed, shape, attention_path):
    args = _attention_inputs(seed + 10, *shape, dtype=torch.float32)
    expected = _dense_sdpa(*args)
    _assert_close(ref.lookahead_attention_ref(*args), expected, torch.float32)
    _assert_close(attention_path(*args), expected, torch.float32)


def test_lookahead_attention_draft_row_sees_real_row_not_reverse():
    # Only the extra keys are visible and the values are one-hot: row 0 must copy v_extra[0],
    # row 1 a mix that includes v_extra[1].
    B, R, H, KVH, N, E, D = 1, 2, 2, 1, 4, 2, 4
    q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale = _attention_inputs(7, B, R, H, KVH, N, E, D,
                                                                              torch.float32)
    kv_mask.zero_()
    v_extra[0, 0] = torch.eye(D)[:E]
    out = plugins.lookahead_attention(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale)
    assert torch.equal(out[0, 0], torch.eye(D)[0].expand(H, D))
    assert (out[0, 1, :, 1] > 0).all()


def test_lookahead_attention_row_without_keys_is_zero(attention_path):
    args = list(_attention_inputs(8, 2, 2, 6, 2, 20, 2, 32, torch.float32))
    args[3][0] = False                    # kv_mask: sequence 0 selected nothing
    args[6][0, 0] = False                 # extra_mask: its real row does not see itself either
    out = attention_path(*args)
    expected = ref.lookahead_attention_ref(*args)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    assert torch.equal(expected[0, 0], torch.zeros_like(expected[0, 0]))
    assert torch.isfinite(out).all()
    _assert_close(out, expected, torch.float32)


def test_ops_accept_strided_inputs_under_inference_mode():
    # The runtime slices q and keys out of a fused projection and runs under inference_mode.
    g = _gen(12)
    B, R, H, KVH, N, E, D = 2, 2, 6, 2, 30, 2, 16
    q = _randn(g, B, R, H, 2 * D)[..., :D]
    k = _randn(g, B, KVH, D, N).transpose(2, 3)
    args = list(_attention_inputs(12, B, R, H, KVH, N, E, D, torch.float32))
    args[0], args[1] = q, k
    q1 = _randn(g, B, H, 3 * D)[..., D:2 * D]
    kmin, kmax = _summaries(g, B, 20, KVH, D, torch.float32)
    valid = torch.ones(B, 20, dtype=torch.bool)
    smin, smax = _randn(g, 9, KVH, D), _randn(g, 9, KVH, D)
    keys = _randn(g, 4, KVH, 2 * D)[..., D:]
    ids, offsets = torch.tensor([3, 3, 8, 0]), torch.tensor([0, 1, 4, 2])
    with torch.inference_mode():
        out = plugins.lookahead_attention(*args)
        idx, _ = plugins.block_topk(q1, kmin, kmax, valid, 5)
        plugins.update_summaries(smin, smax, keys, ids, offsets)
    _assert_close(out, ref.lookahead_attention_ref(*args), torch.float32)
    assert torch.equal(idx, ref.block_topk_ref(q1, kmin, kmax, valid, 5)[0])
    assert torch.equal(smin[3], torch.minimum(keys[0], keys[1]))


def test_direct_entries_compute_what_the_dispatched_ops_do():
    # plugins.direct: the lookahead runtime's CPU entry (no dispatcher); the same results
    g = _gen(13)
    args = _attention_inputs(13, 2, 2, 6, 2, 40, 2, 32, torch.float32)
    _assert_close(plugins.direct.lookahead_attention(*args), torch.ops.lookahead.lookahead_attention(*args),
                  torch.float32)
    q = _randn(g, 2, 2, 6, 32)
    kmin, kmax = _summaries(g, 2, 20, 2, 32, torch.float32)
    valid = torch.rand(2, 2, 20, generator=g) < 0.8
    for a, b in zip(plugins.direct.block_topk(q, kmin, kmax, valid, 6, "max"),
                    torch.ops.lookahead.block_topk(q, kmin, kmax, valid, 6, "max")):
        assert torch.equal(a, b)
    src, ids = _randn(g, 10, 2, 4, 8), torch.randint(0, 10, (2, 3), generator=g)
    assert torch.equal(plugins.direct.block_gather(src, ids), torch.ops.lookahead.block_gather(src, ids))
    smin, smax = _randn(g, 9, 2, 8), _randn(g, 9, 2, 8)
    keys, bids, offs = _randn(g, 4, 2, 8), torch.tensor([3, 3, 8, 0]), torch.tensor([0, 1, 4, 2])
    mins = [smin.clone(), smin.clone()]
    maxs = [smax.clone(), smax.clone()]
    plugins.direct.update_summaries(mins[0], maxs[0], keys, bids, offs)
    torch.ops.lookahead.update_summaries(mins[1], maxs[1], keys, bids, offs)
    assert torch.equal(mins[0], mins[1]) and torch.equal(maxs[0], maxs[1]) and not torch.equal(mins[0], smin)


# ---------------------------------------------------------------- validation

def _valid_calls():
    g = _gen(9)
    src, ids = _randn(g, 10, 2, 4, 8), torch.randint(0, 10, (2, 3), generator=g)
    q3 = _randn(g, 2, 6, 8)
    kmin, kmax = _summaries(g, 2, 10, 2, 8, torch.float32)
    valid = torch.ones(2, 10, dtype=torch.bool)
    smin, smax = _randn(g, 10, 2, 8), _randn(g, 10, 2, 8)
    keys, bids, offs = _randn(g, 4, 2, 8), torch.tensor([1, 2, 3, 9]), torch.tensor([0, 1, 2, 3])
    att = _attention_inputs(9, 2, 2, 6, 2, 12, 2, 8, torch.float32)
    return {
        "block_gather": (plugins.block_gather, [src, ids]),
        "block_topk": (plugins.block_topk, [q3, kmin, kmax, valid, 4]),
        "update_summaries": (plugins.update_summaries, [smin, smax, keys, bids, offs]),
        "lookahead_attention": (plugins.lookahead_attention, list(att)),
    }


BAD_ARGUMENTS = [  # op, position, how to break it, the argument the error must name
    ("block_gather", 0, lambda t: t[0], "src"),
    ("block_gather", 0, lambda t: t.to(torch.int32), "src"),
    ("block_gather", 1, lambda t: t.to(torch.int32), "block_ids"),
    ("block_gather", 1, lambda t: t[:1], "block_ids"),
    ("block_gather", 1, lambda t: t.fill_(10), "block_ids"),
    ("block_gather", 1, lambda t: t.fill_(-1), "block_ids"),
    ("block_topk", 0, lambda t: t[0], "q"),
    ("block_topk", 0, lambda t: t[:, :5], "kmin"),                        # 5 heads, 2 KV heads
    ("block_topk", 1, lambda t: t.double(), "kmin"),
    ("block_topk", 2, lambda t: t[:, :9], "kmax"),
    ("block_topk", 3, lambda t: t.float(), "valid"),
    ("block_topk", 3, lambda t: t[:, :9], "valid"),
    ("block_topk", 4, lambda k: 0, "k"),
    ("block_topk", 4, lambda k: 11, "k"),
    ("block_topk", 4, lambda k: 2.0, "k"),
    ("update_summaries", 1, lambda t: t.half(), "kmax"),
    ("update_summaries", 2, lambda t: t[:, :1], "keys"),
    ("update_summaries", 3, lambda t: t.to(torch.int32), "block_ids"),
    ("update_summaries", 3, lambda t: t + 1, "block_ids"),                # id 10 of 10 blocks
    ("update_summaries", 4, lambda t: t[:3], "block_offsets"),
    ("update_summaries", 4, lambda t: t - 1, "block_offsets"),
    ("lookahead_attention", 0, lambda t: t[0], "q"),
    ("lookahead_attention", 1, lambda t: t.half(), "k"),
    ("lookahead_attention", 1, lambda t: t[:, :, :, :4], "k"),
    ("lookahead_attention", 2, lambda t: t[:, :, :7], "v"),
    ("lookahead_attention", 3, lambda t: t.int(), "kv_mask"),
    ("lookahead_attention", 4, lambda t: t[:, :, :, :4], "k_extra"),
    ("lookahead_attention", 5, lambda t: t[:, :, :1], "v_extra"),
    ("lookahead_attention", 6, lambda t: t[:, :1], "extra_mask"),
    ("lookahead_attention", 7, lambda s: 0.0, "scale"),
    ("lookahead_attention", 7, lambda s: float("nan"), "scale"),
]


@pytest.mark.parametrize("op,pos,breaker,arg", BAD_ARGUMENTS,
                         ids=[f"{op}-{arg}-{i}" for i, (op, _, _, arg) in enumerate(BAD_ARGUMENTS)])
def test_wrapper_rejects_bad_argument(op, pos, breaker, arg):
    fn, args = _valid_calls()[op]
    fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])   # the unbroken call works
    args[pos] = breaker(args[pos])
    with pytest.raises(ValueError, match=rf"^{arg}: "):
        fn(*args)


def test_update_summaries_rejects_aliased_summaries():
    t = torch.randn(4, 1, 2)
    with pytest.raises(ValueError, match=r"^kmax: "):
        plugins.update_summaries(t, t, torch.randn(1, 1, 2), torch.tensor([0]), torch.tensor([0]))


# ---------------------------------------------------------------- registration

def _op_samples():
    g = _gen(11)
    kmin, kmax = _summaries(g, 2, 10, 2, 8, torch.float32)
    return {
        "block_gather": (_randn(g, 10, 2, 4, 8), torch.randint(0, 10, (2, 3), generator=g)),
        "block_topk": (_randn(g, 2, 6, 8), kmin, kmax, torch.rand(2, 10, generator=g) < 0.7, 4),
        "update_summaries": (_randn(g, 10, 2, 8), _randn(g, 10, 2, 8), _randn(g, 5, 2, 8),
                             torch.tensor([1, 1, 4, 9, 1]), torch.tensor([0, 1, 3, 5, 0])),
        "lookahead_attention": _attention_inputs(11, 2, 2, 6, 2, 12, 2, 8, torch.float32),
        "plan_slots": _plan_inputs(g),
    }


def _plan_inputs(g: torch.Generator, lanes_total: int = 4, kvh: int = 2, top_k: int = 6, max_blocks: int = 20):
    """A slot table a plan has filled, and a next request for lanes 2 and 0 (cap 3, step 2)."""
    block, last = (torch.full((lanes_total, kvh, top_k), -1, dtype=torch.long) for _ in range(2))
    slot_of = torch.full((lanes_total, kvh, max_blocks + 1), -1, dtype=torch.long)
    first = torch.stack([torch.randperm(max_blocks, generator=g)[:top_k] for _ in range(lanes_total * kvh)])
    torch.ops.lookahead.plan_slots(block, last, slot_of, torch.arange(lanes_total), first.view(lanes_total, kvh, -1),
                                   torch.rand(lanes_total, kvh, max_blocks, generator=g), top_k, 1)
    want = torch.stack([torch.randperm(max_blocks, generator=g)[:top_k] for _ in range(2 * kvh)]).view(2, kvh, -1)
    want[..., -1] = -1
    return block, last, slot_of, torch.tensor([2, 0]), want, torch.rand(2, kvh, max_blocks, generator=g), 3, 2


@pytest.mark.parametrize("name", ["block_gather", "block_topk", "update_summaries", "lookahead_attention",
                                  "plan_slots"])
def test_registered_op_passes_opcheck(name):
    op = getattr(torch.ops.lookahead, name)
    args = _op_samples()[name]
    assert callable(op)
    op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    torch.library.opcheck(op.default, args)


def test_ops_compile_in_one_graph():
    samples = _op_samples()

    def step(gather_args, topk_args, attn_args):
        blocks = torch.ops.lookahead.block_gather(*gather_args)
        idx, scores = torch.ops.lookahead.block_topk(*topk_args)
        return blocks.sum() + scores.amax() + idx.sum() + torch.ops.lookahead.lookahead_attention(*attn_args)

    args = (samples["block_gather"], samples["block_topk"], samples["lookahead_attention"])
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), step(*args))


def test_plan_slots_matches_the_reference_and_refuses_bad_arguments():
    g = _gen(12)
    args = _plan_inputs(g)
    tables = [t.clone() for t in args[:3]]
    slots, blocks, valid = plugins.plan_slots(*args)
    expected = ref.plan_slots_ref(*tables, *args[3:])
    kc = 3
    got = [(i // (2 * kc), i // kc % 2, s, b) for i, (s, b, ok) in
           enumerate(zip(slots.tolist(), blocks.tolist(), valid.tolist())) if ok]
    assert got == expected and len(expected) > 0
    assert all(torch.equal(a, b) for a, b in zip(args[:3], tables))
    block, last, slot_of, lanes, want, scores, cap, step = args
    bad = {
        "lanes": dict(lanes=torch.tensor([0, 0])),
        "want": dict(want=torch.full_like(want, 21)),
        "scores": dict(scores=scores.double()),
        "cap": dict(cap=-1),
        "last_used": dict(last_used=last[:, :1]),
    }
    for arg, change in bad.items():
        call = dict(block=block, last_used=last, slot_of=slot_of, lanes=lanes, want=want, scores=scores, cap=cap,
                    step=step) | change
        with pytest.raises(ValueError, match=f"^{arg}:"):
            plugins.plan_slots(**call)


def test_registration_is_idempotent():
    for module in (plugins.gather, plugins.topk, plugins.summaries, plugins.attention, plugins.plan):
        importlib.reload(module)
    importlib.reload(plugins)
    src, ids = _op_samples()["block_gather"]
    assert torch.equal(plugins.block_gather(src, ids), ref.block_gather_ref(src, ids))


def _fake_loader(monkeypatch, register):
    package = types.ModuleType("plugins.cuda")
    loader = types.ModuleType("plugins.cuda.loader")
    loader.register_cuda_kernels = register
    package.loader = loader
    monkeypatch.setitem(sys.modules, "plugins.cuda", package)
    monkeypatch.setitem(sys.modules, "plugins.cuda.loader", loader)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_cuda_kernels_registered_when_a_gpu_is_present(monkeypatch):
    calls = []
    _fake_loader(monkeypatch, lambda: calls.append(1))
    plugins._register_cuda_kernels()
    assert calls == [1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plugins._register_cuda_kernels()
    assert calls == [1]


def test_cuda_kernel_failure_warns_and_keeps_the_torch_ops(monkeypatch, caplog):
    def broken():
        raise RuntimeError("nvcc exploded")

    _fake_loader(monkeypatch, broken)
    with caplog.at_level(logging.WARNING, logger="plugins"):
        plugins._register_cuda_kernels()
    assert "nvcc exploded" in caplog.text
    monkeypatch.setitem(sys.modules, "plugins.cuda.loader", None)           # not importable: silent
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="plugins"):
        plugins._register_cuda_kernels()
    assert caplog.text == ""


@pytest.mark.parametrize("seed", [0, 1])
def test_lookahead_attention_any_strides_match_reference(seed):
    # K/V rows with a stride other than D, heads interleaved with tokens, a transposed K: the fused
    # CPU kernel trusts a unit last-dim stride, the op must hold whatever the tensor's layout.
    g = _gen(30 + seed)
    B, R, H, KVH, N, E, D = 2, 2, 6, 2, 30, 2, 16
    args = list(_attention_inputs(30 + seed, B, R, H, KVH, N, E, D, torch.float32))
    args[0] = _randn(g, B, R, H, 3 * D)[..., D:2 * D]
    args[1] = _randn(g, B, KVH, 2 * N, 2 * D)[:, :, ::2, :D]
    args[2] = _randn(g, B, N, KVH, D).transpose(1, 2)
    _assert_close(plugins.lookahead_attention(*args), ref.lookahead_attention_ref(*args), torch.float32)
    args[1] = _randn(g, B, KVH, D, N).transpose(2, 3)
    _assert_close(plugins.lookahead_attention(*args), ref.lookahead_attention_ref(*args), torch.float32)
