"""Lookahead mode's invariants (docs/ARCHITECTURE.md), on a tiny random model with a long context."""
from __future__ import annotations

import threading

import pytest
import torch

import plugins.cpu
from runtime.attention_dense import prefill_attention
from runtime.draft import DraftSource, RandomDraft
from runtime.engine import Engine
from runtime.errors import ConfigError
from runtime.observe import Observer
from runtime.sampling import SamplingParams
from runtime.transfer import SyncTransferEngine
from runtime.internals import Internals
from tiny_engine import SMALL_LOOKAHEAD as SMALL, make_tiny_engine, random_prompts as prompts

SP = SamplingParams(max_tokens=16, ignore_eos=True)
CHECKED = dict(SMALL, internals=Internals(debug_checks=True))    # the checked ops, and check_integrity before every attention


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("tiny_la"), seed=3)


class StepLogits(Observer):
    """The logits each sequence sampled from, per step (the engine's on_step_end hook)."""

    def __init__(self):
        self.by_seq: dict[int, list[torch.Tensor]] = {}

    def on_step_end(self, logits):
        for sid, lg in logits.items():
            self.by_seq.setdefault(sid, []).append(lg.clone())


def run(engine, ps, sp=SP):
    """Generate and capture the logits each sequence sampled from, per step."""
    seen = engine.observe(StepLogits())
    outs = engine.generate(ps, sp)
    engine.close()
    return outs, [torch.stack(v) for _, v in sorted(seen.by_seq.items())]


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
    la, ll = run(Engine.from_dir(tiny_dir, **CHECKED, top_k=64, residency=residency, miss_policy=miss), ps)
    assert [c.token_ids for c in la] == [c.token_ids for c in dense]
    for a, b in zip(ll, dl):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_without_lookahead_k_covering_every_block_equals_dense(tiny_dir):
    ps = prompts(150, 61, 97)
    dense, dl = run(Engine.from_dir(tiny_dir, block_size=4), ps)
    la, ll = run(Engine.from_dir(tiny_dir, **CHECKED, top_k=64, draft="none"), ps)
    assert [c.token_ids for c in la] == [c.token_ids for c in dense]
    for a, b in zip(ll, dl):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_without_lookahead_needs_urgent_and_resident(tiny_dir):
    from runtime.errors import ConfigError
    with pytest.raises(ConfigError, match="miss_policy"):
        Engine.from_dir(tiny_dir, **CHECKED, draft="none", miss_policy="drop")
    with pytest.raises(ConfigError, match="residency"):
        Engine.from_dir(tiny_dir, **CHECKED, draft="none", residency="pingpong")


class QuestReference:
    """Independent reference backend: dense cache; each decode row attends to sink + the real
    query's Quest top-K blocks (summaries recomputed from the stored keys) + the recent window."""

    def __init__(self, pool, scale, top_k, sink, window_blocks, group_score="sum"):
        self.pool, self.scale, self.k, self.s, self.wb = pool, scale, top_k, sink, window_blocks
        self.group_score = group_score      # the GQA group's heads (dim 1 of sc): summed or their max
        self.batch = None            # the step's, from DenseRunner (`step`)

    def step(self, batch):
        """DenseRunner's per-step backend: this reference, with the step's batch."""
        self.batch = batch
        return self

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
    engine = Engine.from_dir(tiny_dir, **CHECKED, top_k=6, residency=residency, miss_policy="urgent", draft=draft,
                             group_score=group_score, prefill_precision="float32")   # the reference's precision
    la, ll = run(engine, ps)
    if draft == "none":
        assert engine.stats()["urgent_blocks"] > 0 and engine.stats()["draft_accept_rate"] is None
    ref_engine = Engine.from_dir(tiny_dir, block_size=4, prefill_precision="float32")
    ref_engine.runner.attn = QuestReference(ref_engine.pool, 16 ** -0.5, top_k=6, sink=1, window_blocks=3,
                                            group_score=group_score)
    rf, rl = run(ref_engine, ps)
    assert [c.token_ids for c in la] == [c.token_ids for c in rf]
    for a, b in zip(ll, rl):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("residency", ["resident", "pingpong"])
def test_adversarial_draft_under_urgent_equals_perfect_draft(tiny_dir, residency):
    ps = prompts(170, 90, seed=5)
    cfg = dict(CHECKED, top_k=5, residency=residency, miss_policy="urgent")
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


class UrgentSteps(Observer):
    """The step of every urgent copy job (the on_copy hook)."""

    def __init__(self):
        self.steps = []

    def on_copy(self, job, urgent):
        if urgent:
            self.steps.append(job.tag[0])


class CountingTransfer(SyncTransferEngine):
    """A transfer engine that copies inline, one (block, head) unit at a time, and counts the
    bytes it copies (not the engine's own accounting)."""

    def __init__(self):
        super().__init__()
        self.copied_bytes = 0

    def submit(self, job, urgent=False):
        ticket = self._account(job, urgent)
        valid = job.valid.tolist() if job.valid is not None else [True] * job.num_units
        for src, dst in ((job.src_k, job.dst_k), (job.src_v, job.dst_v)):
            for b, h, lane, h2, slot, ok in zip(*(t.tolist() for t in (*job.src_index, *job.dst_index)), valid):
                if not ok:              # a fixed-capacity list's skipped entry
                    continue
                dst[lane, h2, slot].copy_(src[b, h])
                self.copied_bytes += src[b, h].numel() * src.element_size()
        ticket._done.set()
        return ticket


def test_random_draft_under_drop_never_corrupts_the_cache(tiny_dir):
    transfer = CountingTransfer()
    eng = Engine.from_dir(tiny_dir, **SMALL, top_k=4, miss_policy="drop", fetch_ratio=0.25,
                          internals=Internals(debug_checks=True, transfer=transfer))
    eng.runner.chain.source = RandomDraft(256, seed=2)
    urgent = eng.observe(UrgentSteps())
    outs, _ = run(eng, prompts(160, 120, seed=6))      # check_integrity runs before every attention
    assert all(len(o.token_ids) == SP.max_tokens for o in outs)
    # drop fetches misses only at the first decode step (step 2: both prompts prefill in step 1),
    # whose working set the seed predicted, not a draft
    assert eng.stats()["urgent_blocks"] > 0 and set(urgent.steps) == {2}
    assert transfer.urgent_jobs == len(urgent.steps)   # every job the transfer engine got was observed


@pytest.mark.parametrize("plan_path", ["cpu_kernel", "torch"])
@pytest.mark.parametrize("top_k", [5, 40])          # 40: more slots than candidates, padded copy lists
@pytest.mark.parametrize("residency", ["resident", "pingpong"])
def test_h2d_bytes_equal_the_bytes_copied(tiny_dir, residency, top_k, plan_path):
    transfer = CountingTransfer()
    # torch: the torch table's slot plan (fixed-capacity lists, as on a GPU)
    eng = Engine.from_dir(tiny_dir, **SMALL, top_k=top_k, residency=residency,
                          internals=Internals(debug_checks=True, transfer=transfer,
                                              impl="checked" if plan_path == "cpu_kernel" else "torch"))
    run(eng, prompts(140, 75, seed=7))               # check_integrity: the copies landed where told
    unit = 2 * 4 * 16 * 4                            # K+V of one (block, head): 2 * bs * D * fp32
    st = eng.stats()
    assert st["h2d_bytes"] == transfer.copied_bytes > 0
    if residency == "resident":                       # every unit moved is an admitted block
        assert st["h2d_bytes"] == (st["prefetched_blocks"] + st["urgent_blocks"]) * unit


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory):
    """Four layers: resident holds four layer buffers, pingpong two."""
    return make_tiny_engine(tmp_path_factory.mktemp("tiny_la4"), seed=3, num_layers=4)


@pytest.mark.parametrize("residency,buffers", [("resident", 4), ("pingpong", 2)])
def test_device_bytes_are_working_set_plus_summaries_and_respect_the_budget(four_layer_dir, residency, buffers):
    layers, kvh, d, bs, fp32 = 4, 2, 16, 4, 4
    slots = 1 + (8 // bs + 1) + 8                     # sink, window ring (recent_window 8), top_k
    working = buffers * 2 * kvh * slots * bs * d * fp32
    per_seq = {}
    for max_len in (512, 2048):
        eng = Engine.from_dir(four_layer_dir, **CHECKED, top_k=8, residency=residency, max_model_len=max_len)
        attn, lanes = eng.runner.attn, eng.config.max_batch_size
        summaries = 2 * layers * (max_len // bs) * kvh * d * fp32      # kmin + kmax per block
        assert attn.working_set_bytes_per_lane() == working            # not by context
        assert attn.device_bytes_per_lane() == working + summaries
        held = sum(t.numel() * t.element_size() for t in (attn.dev_k, attn.dev_v, attn.kmin, attn.kmax))
        assert held == lanes * (working + summaries)                   # what the tensors hold
        per_seq[max_len] = working + summaries
        eng.close()
    dense_kv = 2 * layers * kvh * 2048 * d * fp32                      # one sequence at max_model_len
    assert per_seq[2048] < dense_kv / 3
    eng = Engine.from_dir(four_layer_dir, **CHECKED, top_k=8, residency=residency, max_model_len=2048,
                          device_budget_bytes=per_seq[2048])
    outs, _ = run(eng, prompts(1000, seed=8), SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(outs[0].token_ids) == 4
    with pytest.raises(ConfigError, match="device_budget_bytes: top_k=8 needs"):
        Engine.from_dir(four_layer_dir, **CHECKED, top_k=8, residency=residency, max_model_len=2048,
                        device_budget_bytes=per_seq[2048] - 1)
    with pytest.raises(ConfigError, match="sink and recent window with the block summaries"):
        Engine.from_dir(four_layer_dir, **CHECKED, top_k=8, residency=residency, max_model_len=2048,
                        device_budget_bytes=per_seq[2048] - working + 1)


def test_metrics_are_reported(tiny_dir):
    eng = Engine.from_dir(tiny_dir, **CHECKED, top_k=4)
    outs, _ = run(eng, prompts(200, 120, seed=9))
    st = eng.stats()
    per_req = [o.metrics for o in outs]
    assert sum(m["urgent_blocks"] for m in per_req) == st["urgent_blocks"] > 0
    assert sum(m["prefetched_blocks"] for m in per_req) == st["prefetched_blocks"]
    assert all(0 <= m["prefetch_hit_rate"] <= 1 and m["draft_accept_rate"] is not None for m in per_req)
    assert 0 <= st["prefetch_hit_rate"] <= 1 and 0 <= st["agreement_mean"] <= 1
    assert len(st["agreement_per_layer"]) == 2 and st["h2d_bytes"] > 0


@pytest.mark.parametrize("lead", [1, 3])
def test_pingpong_prefetch_lead_sizes_the_buffers_and_keeps_the_output(four_layer_dir, lead):
    """Layer l + lead is refilled into layer l's buffer: `lead` buffers; under urgent the output
    is exact sparse attention whatever the lead."""
    ps = prompts(150, 90, seed=10)
    cfg = dict(CHECKED, top_k=5, residency="pingpong", miss_policy="urgent")
    base = Engine.from_dir(four_layer_dir, **cfg)
    ref, rl = run(base, ps)
    eng = Engine.from_dir(four_layer_dir, **cfg, prefetch_lead=lead)
    assert eng.runner.attn.num_buffers == lead
    assert eng.runner.attn.working_set_bytes_per_lane() * 2 == base.runner.attn.working_set_bytes_per_lane() * lead
    out, ol = run(eng, ps)                       # check_integrity before every attention
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    for a, b in zip(ol, rl):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class Recorder(Observer):
    """Every hook call, in order (the observation API of runtime/observe.py)."""

    def __init__(self):
        self.calls = []

    def on_batch(self, batch):
        self.calls.append(("batch", batch))

    def on_plan(self, plan):
        self.calls.append(("plan", plan))

    def on_scores(self, layer, rows, lanes, idx, scores):
        self.calls.append(("scores", layer, rows, list(lanes), idx.shape, scores.shape))

    def on_copy(self, job, urgent):
        self.calls.append(("copy", job.tag, urgent))

    def on_step_end(self, logits):
        self.calls.append(("end", sorted(logits)))


@pytest.mark.parametrize("residency", ["resident", "pingpong"])
def test_observers_see_every_step_and_cannot_change_it(tiny_dir, residency):
    """The hooks fire once per step in order (batch, plan, per layer scores, copies, step end),
    the copies they see are every job the transfer engine got, the plan is frozen, and observing
    changes nothing."""
    import dataclasses
    ps = prompts(90, 50, seed=11)
    cfg = dict(CHECKED, top_k=3, residency=residency)
    plain, pl = run(Engine.from_dir(tiny_dir, **cfg), ps)
    eng = Engine.from_dir(tiny_dir, **cfg)
    rec = eng.observe(Recorder())
    seen, sl = run(eng, ps)
    assert [c.token_ids for c in seen] == [c.token_ids for c in plain]
    assert all(torch.equal(a, b) for a, b in zip(sl, pl))
    kinds = [c[0] for c in rec.calls]
    steps = eng.stats()["steps"]
    assert kinds.count("batch") == kinds.count("plan") == kinds.count("end") == steps
    assert kinds.count("copy") == eng.runner.attn.transfer.jobs > 0
    plans = [c[1] for c in rec.calls if c[0] == "plan"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plans[0].real_ix = None
    decode = [p for p in plans if p.decode is not None]
    scores = [c for c in rec.calls if c[0] == "scores"]
    # two layers per decode step, real and draft rows; one seed per prompt and layer
    assert sum(c[2] == ("real", "draft") for c in scores) == 2 * len(decode)
    assert sum(c[2] == ("seed",) for c in scores) == 2 * len(ps)
    for c in scores:
        assert c[4][:2] == c[5][:2] and c[4][1] == len(c[2]) and c[4][-1] == 3
    from runtime.observe import Observers
    none = Observers()
    assert not none and none.add(rec) is rec and none      # call sites test it: free when empty
    none.remove(rec)
    assert not none
    with pytest.raises(TypeError, match="Observer"):
        none.add(object())


@pytest.mark.parametrize("impl", ["checked", "c", "torch"])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_summaries_are_the_minmax_of_the_stored_keys_in_their_dtype(impl, kv_dtype):
    """16-bit KV storage on CPU: the summaries are kept in the KV dtype (half the bytes of fp32)
    and are exactly the min/max of the keys as stored (rounded to that dtype); a GPU keeps fp32."""
    from runtime.lookahead.summaries import BlockSummaries, summary_dtype
    from runtime.ops import select_ops
    cpu = torch.device("cpu")
    if impl == "c" and not plugins.cpu.available():
        pytest.skip("no CPU kernels")
    s = BlockSummaries(2, 1, 4, 2, 8, kv_dtype, cpu, select_ops(cpu, torch.float32, impl))
    assert s.kmin.dtype == s.kmax.dtype == kv_dtype
    assert s.nbytes(2, 4) == 2 * 2 * 4 * 2 * 8 * 2
    assert summary_dtype(kv_dtype, torch.device("cuda")) == torch.float32
    keys = torch.randn(2, 8, 2, 8) * 3                        # [L, T, KVH, D]: two blocks of 4
    lanes, logical = torch.zeros(8, dtype=torch.long), torch.arange(8) // 4
    s.update(slice(0, 2), keys, lanes, logical, torch.arange(8) % 4)
    stored = keys.to(kv_dtype).float().view(2, 2, 4, 2, 8)
    torch.testing.assert_close(s.kmin[:, :2].float(), stored.amin(2), rtol=0, atol=0)
    torch.testing.assert_close(s.kmax[:, :2].float(), stored.amax(2), rtol=0, atol=0)
    assert not torch.equal(stored.amin(2), keys.view(2, 2, 4, 2, 8).amin(2))    # the rounding shows
    q = torch.randn(1, 6, 8)
    idx, sc = s.score(1, q, torch.ones(1, 4, dtype=torch.bool), 1, 2, 3, "max")
    assert sc.dtype == torch.float32 and idx[0, :, 2].eq(-1).all()           # 2 blocks scored, K=3
    # the scores are those of the same summaries widened to fp32
    wide = BlockSummaries(2, 1, 4, 2, 8, torch.float32, cpu, select_ops(cpu, torch.float32, impl))
    wide.kmin.copy_(s.kmin.float()), wide.kmax.copy_(s.kmax.float())
    idx32, sc32 = wide.score(1, q, torch.ones(1, 4, dtype=torch.bool), 1, 2, 3, "max")
    assert torch.equal(idx, idx32) and torch.equal(sc, sc32)


def test_a_step_on_a_later_thread_computes_with_the_engines_threads(tiny_dir):
    """A server steps its engine on a loop thread started after the engine; the lookahead copy
    worker's single OpenMP thread must not become that thread's compute team (libgomp hands a
    count set on one thread to threads started later: served lookahead prefill ran on one core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = Engine.from_dir(tiny_dir, **SMALL, top_k=6)
        seen = []
        run = engine.runner.run

        def spy(work, **kw):
            seen.append(torch.get_num_threads())
            return run(work, **kw)
        engine.runner.run = spy
        t = threading.Thread(target=lambda: engine.generate(prompts(40, seed=5), SamplingParams(max_tokens=2)))
        t.start()
        t.join()
        engine.close()
        assert seen and set(seen) == {2}
    finally:
        torch.set_num_threads(before)
