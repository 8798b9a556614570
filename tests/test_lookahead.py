"""Lookahead mode's invariants (DESIGN.md), on a tiny random model with a long context."""
from __future__ import annotations

import pytest
import torch

from runtime.attention_dense import prefill_attention
from runtime.draft import DraftSource, RandomDraft
from runtime.engine import Engine
from runtime.errors import ConfigError
from runtime.sampling import SamplingParams
from tiny_engine import make_tiny_engine

SP = SamplingParams(max_tokens=16, ignore_eos=True)
SMALL = dict(mode="lookahead", block_size=4, recent_window=8, num_sink_blocks=1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("tiny_la"), seed=3)


def prompts(*lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def run(engine, ps, sp=SP, checks=True):
    """Generate and capture the logits each sequence sampled from, per step."""
    logits: dict[int, list[torch.Tensor]] = {}
    orig = engine.runner.run
    def spy(work):
        out = orig(work)
        for sid, lg in out.items():
            logits.setdefault(sid, []).append(lg.clone())
        return out
    engine.runner.run = spy
    if checks and hasattr(engine.runner, "attn"):
        engine.runner.attn.debug_checks = True
    outs = engine.generate(ps, sp)
    engine.close()
    return outs, [torch.stack(v) for _, v in sorted(logits.items())]


class OracleDraft(DraftSource):
    """A perfect draft: the true next token, looked up in a reference run's continuations."""

    def __init__(self, continuations: list[list[int]], prompt_lens: list[int]):
        self.table = list(zip(prompt_lens, continuations))

    def propose(self, context, model_guess):
        for n, cont in self.table:
            k = len(context) - n                # index of the token after `context`
            if 0 < k < len(cont) and context[n:] == cont[:k]:
                return cont[k]
        return context[-1]


@pytest.mark.parametrize("residency", ["resident", "pingpong"])
@pytest.mark.parametrize("miss", ["urgent", "drop"])
def test_k_covering_every_block_equals_dense(tiny_dir, residency, miss):
    ps = prompts(150, 61, 97)
    dense, dl = run(Engine.from_dir(tiny_dir, block_size=4), ps)
    la, ll = run(Engine.from_dir(tiny_dir, **SMALL, top_k=64, residency=residency, miss_policy=miss), ps)
    assert [c.token_ids for c in la] == [c.token_ids for c in dense]
    for a, b in zip(ll, dl):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_without_lookahead_k_covering_every_block_equals_dense(tiny_dir):
    ps = prompts(150, 61, 97)
    dense, dl = run(Engine.from_dir(tiny_dir, block_size=4), ps)
    la, ll = run(Engine.from_dir(tiny_dir, **SMALL, top_k=64, draft="none"), ps)
    assert [c.token_ids for c in la] == [c.token_ids for c in dense]
    for a, b in zip(ll, dl):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_without_lookahead_needs_urgent_and_resident(tiny_dir):
    from runtime.errors import ConfigError
    with pytest.raises(ConfigError, match="miss_policy"):
        Engine.from_dir(tiny_dir, **SMALL, draft="none", miss_policy="drop")
    with pytest.raises(ConfigError, match="residency"):
        Engine.from_dir(tiny_dir, **SMALL, draft="none", residency="pingpong")


class QuestReference:
    """Independent reference backend: dense cache; each decode row attends to sink + the real
    query's Quest top-K blocks (summaries recomputed from the stored keys) + the recent window."""

    def __init__(self, pool, scale, top_k, sink, window_blocks, group_score="sum"):
        self.pool, self.scale, self.k, self.s, self.wb = pool, scale, top_k, sink, window_blocks
        self.group_score = group_score      # the GQA group's heads (dim 1 of sc): summed or their max
        self.batch = None            # set by DenseRunner before each forward

    def forward(self, layer, q, k, v):
        b, bs = self.batch, self.pool.block_size
        self.pool.write(layer, k, v, b.slot_blocks, b.slot_offsets)
        out = torch.empty_like(q)
        for it in b.items:
            rows = slice(it.row_start, it.row_start + it.num_tokens)
            kc, vc = self.pool.read(layer, it.block_table, it.context_len)     # [KVH, L, D]
            if it.num_tokens > 1 or it.start_pos == 0:
                out[rows] = prefill_attention(q[rows], kc, vc)
                continue
            L, kvh, d = it.context_len, kc.shape[0], kc.shape[-1]
            last = (L - 1) // bs
            w0 = max(self.s, last - self.wb + 1)
            keep = torch.zeros(kvh, L, dtype=torch.bool)
            keep[:, : min(self.s, last + 1) * bs] = True
            keep[:, w0 * bs:] = True
            qg = q[rows][0].view(kvh, -1, d)                                       # [KVH, G, D]
            if w0 > self.s:
                kb = kc[:, : w0 * bs].reshape(kvh, w0, bs, d)[:, self.s:]          # [KVH, C, bs, D]
                kmin, kmax = kb.amin(2), kb.amax(2)
                sc = torch.maximum(qg[:, :, None] * kmin[:, None], qg[:, :, None] * kmax[:, None])
                per_head = sc.sum(-1)                                               # [KVH, G, C]
                group = per_head.sum(1) if self.group_score == "sum" else per_head.amax(1)
                top = torch.topk(group, min(self.k, w0 - self.s), dim=-1).indices + self.s
                for h in range(kvh):
                    for blk in top[h].tolist():
                        keep[h, blk * bs:(blk + 1) * bs] = True
            att = ((qg @ kc.transpose(1, 2)) * self.scale).masked_fill(~keep[:, None, :], float("-inf"))
            out[rows] = (torch.softmax(att, -1) @ vc).reshape(1, *q.shape[1:])
        return out


@pytest.mark.parametrize("residency,draft,group_score", [
    ("resident", "dual_token", "sum"), ("pingpong", "dual_token", "sum"), ("resident", "none", "sum"),
    ("resident", "dual_token", "max"), ("pingpong", "dual_token", "max")])
def test_urgent_equals_reference_sparse_attention(tiny_dir, residency, draft, group_score):
    # draft "none": no look-ahead at all, every block fetched on demand: the same output
    ps = prompts(150, 110, seed=4)
    engine = Engine.from_dir(tiny_dir, **SMALL, top_k=6, residency=residency, miss_policy="urgent", draft=draft,
                             group_score=group_score)
    la, ll = run(engine, ps)
    if draft == "none":
        assert engine.stats()["urgent_blocks"] > 0 and engine.stats()["draft_accept_rate"] is None
    ref_engine = Engine.from_dir(tiny_dir, block_size=4)
    ref_engine.runner.attn = QuestReference(ref_engine.pool, 16 ** -0.5, top_k=6, sink=1, window_blocks=3,
                                            group_score=group_score)
    rf, rl = run(ref_engine, ps, checks=False)
    assert [c.token_ids for c in la] == [c.token_ids for c in rf]
    for a, b in zip(ll, rl):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("residency", ["resident", "pingpong"])
def test_adversarial_draft_under_urgent_equals_perfect_draft(tiny_dir, residency):
    ps = prompts(170, 90, seed=5)
    cfg = dict(SMALL, top_k=5, residency=residency, miss_policy="urgent")
    base = Engine.from_dir(tiny_dir, **cfg)
    good, gl = run(base, ps)
    oracle = Engine.from_dir(tiny_dir, **cfg)
    oracle.runner.chain.source = OracleDraft([c.token_ids for c in good], [len(p) for p in ps])
    perfect, pl = run(oracle, ps)
    rnd = Engine.from_dir(tiny_dir, **cfg)
    rnd.runner.chain.source = RandomDraft(256, seed=1)
    bad, bl = run(rnd, ps)                       # debug_checks: the cache is never corrupted
    assert [c.token_ids for c in bad] == [c.token_ids for c in perfect] == [c.token_ids for c in good]
    for a, b in zip(bl, pl):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    s_bad, s_good = rnd.stats(), oracle.stats()
    assert s_bad["urgent_blocks"] > s_good["urgent_blocks"]        # a bad draft only costs transfers
    assert s_good["draft_accept_rate"] > 0.9 and s_bad["draft_accept_rate"] < 0.2


def test_random_draft_under_drop_never_corrupts_the_cache(tiny_dir):
    eng = Engine.from_dir(tiny_dir, **SMALL, top_k=4, miss_policy="drop", fetch_ratio=0.25)
    eng.runner.chain.source = RandomDraft(256, seed=2)
    urgent_steps = []
    orig = eng.runner.attn.transfer.submit
    eng.runner.attn.transfer.submit = lambda job, urgent=False: (
        urgent and urgent_steps.append(job.tag[0]), orig(job, urgent))[1]
    outs, _ = run(eng, prompts(160, 120, seed=6))      # check_integrity runs before every attention
    assert all(len(o.token_ids) == SP.max_tokens for o in outs)
    # drop fetches misses only at the first decode step (step 2: both prompts prefill in step 1),
    # whose working set the seed predicted, not a draft
    assert eng.stats()["urgent_blocks"] > 0 and set(urgent_steps) == {2}


@pytest.mark.parametrize("residency", ["resident", "pingpong"])
def test_h2d_bytes_equal_admitted_blocks_times_block_bytes(tiny_dir, residency):
    eng = Engine.from_dir(tiny_dir, **SMALL, top_k=5, residency=residency, transfer="sync")
    jobs = []
    orig = eng.runner.attn.transfer.submit
    eng.runner.attn.transfer.submit = lambda job, urgent=False: (jobs.append(job), orig(job, urgent))[1]
    run(eng, prompts(140, 75, seed=7))
    unit = 2 * 4 * 16 * 4                            # K+V of one (block, head): 2 * bs * D * fp32
    st = eng.stats()
    assert st["h2d_bytes"] == sum(j.num_units for j in jobs) * unit > 0
    if residency == "resident":                       # every unit moved is an admitted block
        assert st["h2d_bytes"] == (st["prefetched_blocks"] + st["urgent_blocks"]) * unit


@pytest.mark.parametrize("residency", ["resident", "pingpong"])
def test_device_bytes_do_not_grow_with_context_and_respect_the_budget(tiny_dir, residency):
    sizes = []
    for max_len in (512, 4096):
        eng = Engine.from_dir(tiny_dir, **SMALL, top_k=8, residency=residency, max_model_len=max_len)
        sizes.append(eng.runner.attn.device_bytes_per_lane())
        eng.close()
    assert sizes[0] == sizes[1]
    per_seq = sizes[0]
    eng = Engine.from_dir(tiny_dir, **SMALL, top_k=8, residency=residency, device_budget_bytes=per_seq)
    outs, _ = run(eng, prompts(1000, seed=8), SamplingParams(max_tokens=4, ignore_eos=True))
    dense_bytes = 2 * 2 * 2 * (1004 // 4 + 1) * 4 * 16 * 4   # layers * K,V * KVH * blocks * bs * D * 4
    assert per_seq <= eng.config.device_budget_bytes and per_seq < dense_bytes / 3
    with pytest.raises(ConfigError, match="device_budget_bytes"):
        Engine.from_dir(tiny_dir, **SMALL, top_k=8, residency=residency, device_budget_bytes=per_seq - 1)
    with pytest.raises(ConfigError, match="sink and recent window"):
        Engine.from_dir(tiny_dir, **SMALL, top_k=8, residency=residency, device_budget_bytes=64)


def test_metrics_are_reported(tiny_dir):
    eng = Engine.from_dir(tiny_dir, **SMALL, top_k=4)
    outs, _ = run(eng, prompts(200, 120, seed=9))
    st = eng.stats()
    per_req = [o.metrics for o in outs]
    assert sum(m["urgent_blocks"] for m in per_req) == st["urgent_blocks"] > 0
    assert sum(m["prefetched_blocks"] for m in per_req) == st["prefetched_blocks"]
    assert all(0 <= m["prefetch_hit_rate"] <= 1 and m["draft_accept_rate"] is not None for m in per_req)
    assert 0 <= st["prefetch_hit_rate"] <= 1 and 0 <= st["agreement_mean"] <= 1
    assert len(st["agreement_per_layer"]) == 2 and st["h2d_bytes"] > 0
