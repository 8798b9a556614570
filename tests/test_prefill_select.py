"""Block-sparse prefill (runtime/lookahead/prefill_select.py): the blocks it picks, the attention it computes, and
that it changes nothing where every candidate fits the budget."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.config import LookaheadConfig
from runtime.lookahead.prefill_select import SCORE_ROWS, PrefillSelection
from runtime.lookahead.summaries import BlockSummaries
from runtime.ops import select_ops

from tiny_engine import make_tiny_engine, random_prompts


def _summaries(keys: torch.Tensor, lanes: int, lane: int, max_blocks: int, bs: int) -> BlockSummaries:
    """keys [n, KVH, D] of one sequence in lane `lane` -> its summaries, as the backend folds them."""
    n, kvh, d = keys.shape
    s = BlockSummaries(1, lanes, max_blocks, kvh, d, torch.float32, torch.device("cpu"), select_ops(torch.device("cpu"), torch.float32))
    pos = torch.arange(n)
    s.update(slice(0, 1), keys[None], torch.full((n,), lane), pos // bs, pos % bs)
    return s


def _reference_pick(q, keys, bs, num_sink, w0, top_k, rows):
    """Quest's bound by brute force: per row, head and candidate block sum_d max(q_d min_d, q_d max_d), the max
    over the sampled rows and the group's heads, each KV head's top-K, their union."""
    kvh = keys.shape[1]
    blocks = keys[: w0 * bs].view(w0, bs, kvh, -1)
    kmin, kmax = blocks.amin(1), blocks.amax(1)                                    # [w0, KVH, D]
    qs = q[rows].view(len(rows), kvh, -1, q.shape[-1])                              # [R, KVH, G, D]
    b = torch.maximum(qs[:, :, :, None] * kmin.permute(1, 0, 2)[None, :, None],
                      qs[:, :, :, None] * kmax.permute(1, 0, 2)[None, :, None]).sum(-1)   # [R, KVH, G, w0]
    score = b.amax(0).amax(1)[:, num_sink:]                                         # [KVH, candidates]
    return sorted(set((score.topk(top_k, -1).indices + num_sink).flatten().tolist()))


def test_the_picked_blocks_are_quests_top_k_of_the_sampled_rows():
    g = torch.Generator().manual_seed(0)
    bs, kvh, h, d, n_ctx, n = 16, 2, 6, 32, 1000, 100
    keys = torch.randn(n_ctx, kvh, d, generator=g)
    q = torch.randn(n, h, d, generator=g)
    cfg = LookaheadConfig(mode="lookahead", prefill_top_k=7, prefill_window=64, num_sink_blocks=1)
    sel = PrefillSelection(cfg, _summaries(keys, 3, 2, 80, bs))
    table = list(range(500, 500 + 63))                   # the sequence's pool blocks, anywhere in the pool
    got = sel.select(0, 2, q, table, n_ctx)
    assert got is not None
    w0 = (n_ctx - n - 64) // bs
    rows = torch.linspace(n - 1, 0, SCORE_ROWS).round().long().unique()
    picked = _reference_pick(q, keys, bs, 1, w0, 7, rows)
    assert 7 <= len(picked) <= 14
    blocks, length = got
    assert blocks == [500] + [500 + b for b in picked] + table[w0:-(-n_ctx // bs)]
    assert length == (1 + len(picked)) * bs + n_ctx - w0 * bs


def test_a_chunk_whose_candidates_fit_the_budget_is_dense():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(600, 2, 32, generator=g)
    cfg = LookaheadConfig(mode="lookahead", prefill_top_k=40, prefill_window=64)
    sel = PrefillSelection(cfg, _summaries(keys, 1, 0, 40, 16))
    assert sel.select(0, 0, torch.randn(50, 6, 32, generator=g), list(range(38)), 600) is None   # 29 candidates


def test_the_sparse_chunk_attends_to_exactly_its_selected_keys():
    """The kernel over the selection's table equals dense attention masked to sink + selected + window, causal."""
    from plugins.cpu.prefill import prefill_attention_op
    g = torch.Generator().manual_seed(2)
    bs, kvh, h, d, n_ctx, n = 16, 2, 4, 32, 900, 64
    keys, vals = (torch.randn(n_ctx, kvh, d, generator=g) for _ in range(2))
    q = torch.randn(n, h, d, generator=g)
    nb = -(-n_ctx // bs)
    perm = torch.randperm(nb, generator=g)                                   # pool blocks in any order
    pool_k, pool_v = (torch.zeros(kvh, nb, bs, d) for _ in range(2))
    pos = torch.arange(n_ctx)
    pool_k[:, perm[pos // bs], pos % bs] = keys.transpose(0, 1)
    pool_v[:, perm[pos // bs], pos % bs] = vals.transpose(0, 1)
    cfg = LookaheadConfig(mode="lookahead", prefill_top_k=5, prefill_window=100, num_sink_blocks=1)
    sel = PrefillSelection(cfg, _summaries(keys, 1, 0, nb, bs))
    table, length = sel.select(0, 0, q, perm.tolist(), n_ctx)
    got = prefill_attention_op(q, pool_k, pool_v, table, length, d ** -0.5)
    logical = {perm.tolist().index(b) for b in table}
    w0 = (n_ctx - n - 100) // bs
    visible = torch.tensor([(p // bs) in logical for p in range(n_ctx)])
    assert visible[w0 * bs:].all() and visible[:bs].all()
    mask = visible[None] & (pos[None] <= (n_ctx - n + torch.arange(n))[:, None])          # [n, n_ctx]
    kh, vh = (F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None].repeat_interleave(h // kvh, 1),
        vals.transpose(0, 1)[None].repeat_interleave(h // kvh, 1), attn_mask=mask, scale=d ** -0.5), None)
    want = kh[0].transpose(0, 1)
    assert torch.allclose(got, want, atol=3e-2, rtol=3e-2)     # the kernel's bf16 numerics (CONTRACTS.md)


def test_an_engine_with_every_candidate_in_budget_prefills_as_dense(tmp_path):
    from runtime.engine import Engine
    from runtime.sampling import SamplingParams
    d = make_tiny_engine(tmp_path / "tiny", seed=3)
    ids = random_prompts(2500, seed=1)[0]
    outs = {}
    for ptk in (0, 1000, 8):
        e = Engine.from_dir(d, mode="lookahead", prefill_top_k=ptk, prefill_window=256, max_model_len=4096)
        try:
            outs[ptk] = e.generate([ids], SamplingParams(max_tokens=6))[0].token_ids
            sel = e.runner.attn.prefill_select
            outs[f"{ptk}/chunks"] = None if sel is None else (sel.chunks, sel.dense_chunks)
        finally:
            e.close()
    # 5 chunks of 512: the first has no earlier context (never selected); the others are dense at K = 1000 and
    # sparse at K = 8 (their 15+ candidates, before a 256-token window)
    assert outs[1000] == outs[0] and outs["1000/chunks"] == (0, 4)
    assert outs["8/chunks"] == (4, 0)


def test_a_sparse_prefill_never_replays_a_dense_one(tmp_path):
    """Siblings share a prefill cache (the evals' modes): a block-sparse prefill computes its own, and a dense
    sibling's later run replays the dense recording, not the sparse one."""
    from runtime.engine import Engine
    from runtime.prefill_cache import PrefillCache
    from runtime.sampling import SamplingParams
    d = make_tiny_engine(tmp_path / "tiny", seed=4)
    ids = random_prompts(2000, seed=2)[0]
    cache = PrefillCache(max_prompts=2)
    base = Engine.from_dir(d, max_model_len=4096)
    out = {}
    try:
        for name, ptk in (("dense", 0), ("sparse", 8), ("dense again", 0), ("sparse again", 8)):
            e = base.sibling(cache, mode="lookahead", prefill_top_k=ptk, prefill_window=256, max_model_len=4096)
            hits = cache.hits
            out[name] = (e.generate([ids], SamplingParams(max_tokens=5))[0].token_ids, cache.hits - hits)
            e.close()
    finally:
        base.close()
    assert out["dense"][1] == 0 and out["sparse"][1] == 0
    assert out["dense again"] == (out["dense"][0], 1) and out["sparse again"] == (out["sparse"][0], 1)
    assert out["sparse"][0] != out["dense"][0]        # a random tiny model: 8 blocks of ~100 change its tokens
