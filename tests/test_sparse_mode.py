"""Sparse mode (runtime/sparse.py): top-K sparse attention over the KV cache where it lies.

Checked on fresh random tiny models (fp32 and int8 weights), fp32 and fp16 KV:
- the selection: `BlockSelection`'s key mask equals a brute-force construction from
  `plugins.reference.block_topk_ref` (sink + window + the top-K candidate blocks);
- with `top_k` covering every candidate, sparse mode is dense mode bit for bit (every key seen);
- the fused C step (decode.c select_keys) equals the Python path bit for bit: logits, pool,
  summaries; and it ran;
- it selects what lookahead mode without a draft (sparse attention on demand) selects: the same
  greedy tokens, logits within summation-order error;
- the summaries are exactly the min/max of every block's stored keys;
- the memory plan counts the summaries as allocated.
"""
from __future__ import annotations

import pytest
import torch

from plugins import cpu
from plugins.reference import block_topk_ref
from runtime.config import LookaheadConfig
from runtime.engine import Engine
from runtime.spec import settings_for
from runtime.lookahead.device_tier import SlotLayout
from runtime.ops import select_ops
from runtime.sampling import SamplingParams
from runtime.sparse import BlockSelection
from runtime.internals import Internals
from test_fused_decode import fp32_and_int8_dirs
from test_fused_lookahead import run as run_recorded
from tiny_engine import random_prompts

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no CPU kernels")

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
GEOMETRY = dict(block_size=4, recent_window=8, num_sink_blocks=1, max_batch_size=4)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return fp32_and_int8_dirs(tmp_path_factory.mktemp("sparse"), seed=41)


def run(eng: Engine, prompts):
    """(greedy tokens per prompt, every emitted logit row in step and sequence order)."""
    tokens, rec = run_recorded(eng, prompts, GREEDY)
    return tokens, [step[s] for step in rec.logits for s in sorted(step)]


def engine(d, fused: bool, **kw) -> Engine:
    settings = {**GEOMETRY, **kw}
    eng = Engine.from_dir(d, internals=Internals(fused=fused), **settings_for(settings.get("mode", "dense"), settings))
    assert (eng.runner.fused is not None) == fused, eng.runner.fused_reason
    return eng


PROMPTS = {1: (70,), 3: (70, 23, 51)}


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
@pytest.mark.parametrize("model", ["fp32", "int8"])
def test_every_block_selected_is_dense_bit_for_bit(dirs, monkeypatch, model, kv_dtype):
    prompts = random_prompts(*PROMPTS[3], seed=1)
    for fused in (False, True):
        ref_tokens, ref = run(engine(dirs[model], fused, mode="dense", kv_dtype=kv_dtype), prompts)
        eng = engine(dirs[model], fused, mode="sparse", top_k=64, kv_dtype=kv_dtype)
        tokens, got = run(eng, prompts)
        assert tokens == ref_tokens and len(got) == len(ref)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
@pytest.mark.parametrize("model", ["fp32", "int8"])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_step_equals_python_path(dirs, monkeypatch, model, kv_dtype, batch, threads):
    torch.set_num_threads(threads)
    prompts = random_prompts(*PROMPTS[batch], seed=batch)
    kw = dict(mode="sparse", top_k=2, kv_dtype=kv_dtype)
    ref_eng = engine(dirs[model], False, **kw)
    ref_tokens, ref = run(ref_eng, prompts)
    eng = engine(dirs[model], True, **kw)
    tokens, got = run(eng, prompts)
    assert eng.runner.fused.steps > 0 and eng.runner.fused.exact
    assert tokens == ref_tokens and len(got) == len(ref)
    for a, b in zip(got, ref):
        assert torch.equal(a, b), float((a - b).abs().max())
    assert torch.equal(eng.pool.k, ref_eng.pool.k) and torch.equal(eng.pool.v, ref_eng.pool.v)
    sel, ref_sel = eng.runner.attn.selection, ref_eng.runner.attn.selection
    assert torch.equal(sel.kmin, ref_sel.kmin) and torch.equal(sel.kmax, ref_sel.kmax)


def test_sparse_differs_from_dense_when_it_selects(dirs, monkeypatch):
    """The comparisons above can fail: with 2 of ~14 candidate blocks, sparse is not dense."""
    prompts = random_prompts(*PROMPTS[3], seed=2)
    _, dense = run(engine(dirs["fp32"], True, mode="dense"), prompts)
    _, sparse = run(engine(dirs["fp32"], True, mode="sparse", top_k=2), prompts)
    assert any(not torch.equal(a, b) for a, b in zip(dense, sparse))


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_selects_what_lookahead_without_a_draft_selects(dirs, monkeypatch, kv_dtype):
    prompts = random_prompts(*PROMPTS[3], seed=3)
    kw = dict(top_k=3, kv_dtype=kv_dtype)
    la_tokens, la = run(engine(dirs["fp32"], True, mode="lookahead", draft="none", miss_policy="urgent",
                               residency="resident", **kw), prompts)
    tokens, got = run(engine(dirs["fp32"], True, mode="sparse", **kw), prompts)
    assert tokens == la_tokens and len(got) == len(la)
    # the same keys, summed in another order (slots vs positions); under fp16 KV lookahead mode also
    # attends to the step's own row in fp32 (an extra key, stored after the step), sparse mode to
    # the row as the pool stores it: one rounding of one key and value
    atol = {"float32": 1e-4, "float16": 2e-3}[kv_dtype]
    for a, b in zip(got, la):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


def test_mask_equals_a_brute_force_selection():
    g = torch.Generator().manual_seed(5)
    from runtime.config import ModelConfig
    from runtime.kv_pool import KVPool
    mcfg = ModelConfig(architecture="llama", vocab_size=50, hidden_size=64, intermediate_size=64, num_layers=2,
                       num_heads=6, num_kv_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=1e4)
    cfg = LookaheadConfig(mode="sparse", block_size=4, top_k=3, recent_window=8, num_sink_blocks=1)
    pool = KVPool(mcfg, 64, 4)
    for group_score in ("max", "sum"):
        sel = BlockSelection(mcfg, cfg.replace(group_score=group_score), pool, select_ops(torch.device("cpu"),
                                                                                          torch.float32))
        sel.kmin.copy_(torch.randn(sel.kmin.shape, generator=g))
        sel.kmax.copy_(sel.kmin + torch.rand(sel.kmin.shape, generator=g))
        lay = SlotLayout.from_config(cfg)
        starts, lens = [0, 20, 40], [37, 6, 80]
        q = torch.randn(3, 6, 32, generator=g)
        mask = sel.mask(1, q, starts, lens)
        for b, (r, n) in enumerate(zip(starts, lens)):
            nb, w0 = -(-n // 4), lay.window_start(n)
            valid = torch.zeros(1, nb, dtype=torch.bool)
            valid[0, lay.num_sink:w0] = True
            want = torch.zeros(2, n, dtype=torch.bool)
            want[:, :min(4 * lay.num_sink, n)] = True
            want[:, w0 * 4:] = True
            if w0 > lay.num_sink:
                idx, _ = block_topk_ref(q[b:b + 1], sel.kmin[1, r:r + nb][None], sel.kmax[1, r:r + nb][None], valid,
                                        min(3, nb), group_score)
                for h in range(2):
                    for blk in idx[0, h].tolist():
                        if blk >= 0:
                            want[h, blk * 4: blk * 4 + 4] = True
            assert torch.equal(mask[b, :, :n], want), (group_score, b)
            assert not mask[b, :, n:].any()
            ids = list(range(r, r + nb))
            assert torch.equal(sel.mask_for(1, q[b], ids, n), want)


def test_summaries_are_the_stored_keys_min_and_max(dirs, monkeypatch):
    eng = engine(dirs["int8"], True, mode="sparse", top_k=2, kv_dtype="float16")
    for p in random_prompts(*PROMPTS[3], seed=4):
        eng.add_request(p, GREEDY)
    sel, checked = eng.runner.attn.selection, 0
    while eng.has_unfinished():
        eng.step()
        for s in eng.scheduler.running:       # after every step: each block of each running sequence
            n = s.num_cached
            for i, blk in enumerate(s.block_table[: -(-n // 4)]):
                keys = eng.pool.k[:, :, blk, :min(4, n - 4 * i)].float()     # [L, KVH, filled, D]
                assert torch.equal(sel.kmin[:, blk], keys.amin(2)) and torch.equal(sel.kmax[:, blk], keys.amax(2))
                checked += 1
    assert checked > 100


def test_memory_plan_counts_the_summaries(dirs, monkeypatch):
    from runtime.memory_plan import plan_memory
    eng = engine(dirs["fp32"], True, mode="sparse", top_k=2)
    plan = plan_memory(eng.manifest.model, eng.config, eng.pool.num_blocks, 4, eng.max_model_len, weights=False)
    assert plan.summaries == eng.runner.attn.selection.nbytes() > 0
    assert plan.device_tier == 0
