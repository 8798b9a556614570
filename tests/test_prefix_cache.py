"""Prefix caching over the host KV pool (runtime/prefix_cache.py): the bookkeeping with exact block
ids, and on tiny engines in every mode: a hit changes no token, n choices cost one prefill,
logprobs, eviction under pressure with nothing in use evicted and no block leaked."""
from __future__ import annotations

import pytest
import torch

from runtime.block_manager import BlockAllocator
from runtime.engine import Engine
from runtime.errors import ConfigError, RequestError
from runtime.prefix_cache import BlockRemoved, BlockStored, PrefixCache, chain_hashes
from runtime.sampling import SamplingParams
from runtime.internals import Internals
from tiny_engine import SMALL_LOOKAHEAD, make_tiny_engine, random_prompts

BS = 4


def cache(num_blocks: int = 8, enabled: bool = True) -> tuple[PrefixCache, list]:
    events: list = []
    c = PrefixCache(BlockAllocator(num_blocks), BS, b"tiny", enabled)
    c.events.subscribe(events.append)
    return c, events


# ---- bookkeeping -------------------------------------------------------------------------------
def test_named_blocks_are_shared_then_reclaimable_then_evicted_oldest_first():
    c, events = cache(6)
    tokens = list(range(12))
    h = chain_hashes(tokens, BS, c.identity)
    a = c.allocate(4)
    assert a == [0, 1, 2, 3]
    assert c.register(a[:3], h, None, tokens) == [0, 1, 2]
    assert events == [BlockStored(h, None, tokens, BS)]
    assert c.match(h) == [0, 1, 2] and c.match(h[:2] + [123]) == [0, 1]
    assert c.match(chain_hashes([7] + tokens[1:], BS, c.identity)) == []      # another first block
    c.share([0, 1])                                                  # a second sequence's prefix
    assert c.refs == {0: 2, 1: 2, 2: 1, 3: 1}
    c.free(a)                                                        # the first sequence ends
    assert (c.refs, list(c.reclaimable)) == ({0: 1, 1: 1}, [2])      # block 3 had no name: free
    assert c.num_free == 4 and c.num_unnamed_free == 3 and c.num_reclaimable == 1
    c.free([0, 1])                               # walked from the end: 1 is older than 0
    assert list(c.reclaimable) == [2, 1, 0] and c.num_free == 6
    # room is taken from the free list first, then from the oldest cached blocks: a chain's tail
    assert c.allocate(3) == [3, 4, 5] and events[1:] == []
    assert c.allocate(2) == [2, 1]
    assert events[1:] == [BlockRemoved([h[2], h[1]])]
    assert c.match(h) == [0] and c.counters.evictions == 2        # what stays is still a prefix
    with pytest.raises(MemoryError):
        c.allocate(2)                                                # block 0 is the only one left


def test_a_block_in_use_is_never_evicted_and_double_free_is_refused():
    c, _ = cache(3)
    ids = c.allocate(2)
    c.register(ids, chain_hashes(list(range(8)), BS, c.identity), None, list(range(8)))
    assert c.allocate(1) == [2]
    assert not c.can_allocate(1)                 # both named blocks are held: nothing to evict
    c.free(ids)
    c.free([2])
    with pytest.raises(ValueError, match="double free"):
        c.free([2])


def test_a_name_already_cached_keeps_its_block_and_events_name_runs():
    c, events = cache(8)
    tokens = list(range(16))
    h = chain_hashes(tokens, BS, c.identity)
    first = c.allocate(2)
    c.register(first, h[:2], None, tokens[:8])
    second = c.allocate(4)                       # the same prompt computed again, all four blocks
    assert c.register(second, h, None, tokens) == second[2:]
    assert c.match(h) == first + second[2:]
    assert events[-1] == BlockStored(h[2:], h[1], tokens[8:], BS)


def test_disabled_cache_names_nothing():
    c, events = cache(4, enabled=False)
    ids = c.allocate(2)
    h = chain_hashes(list(range(8)), BS, c.identity)
    assert c.register(ids, h, None, list(range(8))) == [] and c.match(h) == []
    c.free(ids)
    assert c.num_unnamed_free == 4 and events == []


def test_hashes_cover_the_engine_identity_and_every_token():
    tokens = list(range(32))
    a = chain_hashes(tokens, BS, b"weights=1 kv_dtype=float32")
    assert a == chain_hashes(tokens, BS, b"weights=1 kv_dtype=float32")
    assert set(a).isdisjoint(chain_hashes(tokens, BS, b"weights=1 kv_dtype=float16"))
    changed = tokens.copy()
    changed[1] = 99
    b = chain_hashes(changed, BS, b"weights=1 kv_dtype=float32")
    assert set(a).isdisjoint(b)                  # one token changes its block and every later one
    assert all(0 <= x < 1 << 64 for x in a)


# ---- engines -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("tiny_prefix"), seed=1)


MODES = {
    "dense": dict(mode="dense", block_size=BS),
    "sparse": dict(mode="sparse", block_size=BS, top_k=4),
    "resident-urgent": dict(SMALL_LOOKAHEAD, top_k=4),
    "resident-drop": dict(SMALL_LOOKAHEAD, top_k=4, miss_policy="drop"),
    "pingpong": dict(SMALL_LOOKAHEAD, top_k=4, residency="pingpong"),
    "sparse-ondemand": dict(SMALL_LOOKAHEAD, top_k=4, draft="none"),
}
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_a_cache_hit_changes_no_token_in_any_mode(tiny_dir, mode, kv_dtype):
    """A document asked about four times: the later questions hit its blocks. Questions of 1-9
    tokens: with the shortest, the prompt's last window lies in the cached blocks, which lookahead
    must restore to the device tier (debug_checks verifies the slots before every attention)."""
    cfg = dict(MODES[mode], kv_dtype=kv_dtype)
    on = Engine.from_dir(tiny_dir, internals=Internals(debug_checks=True), **cfg)
    off = Engine.from_dir(tiny_dir, prefix_caching=False, **cfg)
    doc = random_prompts(70, seed=3)[0]
    try:
        for q in random_prompts(9, 1, 2, 3, seed=4):
            hit, plain = on.generate([doc + q], GREEDY)[0], off.generate([doc + q], GREEDY)[0]
            assert hit.token_ids == plain.token_ids
        assert hit.cached_tokens == 68 and plain.cached_tokens == 0          # (70 + 3 - 1) // 4 blocks
        s = on.stats()
        assert s["prefix_cache_hits"] == 3 * 68 and s["prefix_cache_queries"] == 79 + 71 + 72 + 73
        assert on.counters["prompt_tokens"] == 79 + 3 + 4 + 5                # what prefill computed
        assert off.stats()["prefix_cache_hit_rate"] == 0 and off.stats()["cached_blocks"] == 0
    finally:
        on.close(), off.close()


def test_prefix_caching_false_turns_it_off_and_a_wrong_value_names_the_field(tiny_dir):
    eng = Engine.from_dir(tiny_dir, prefix_caching=False)
    assert not eng.allocator.enabled
    with pytest.raises(ConfigError, match="prefix_caching"):
        Engine.from_dir(tiny_dir, prefix_caching="yes")


@pytest.mark.parametrize("field, value", [("n", 0), ("n", 17), ("n", True), ("logprobs", -1),
                                          ("logprobs", 21), ("logprobs", 1.5)])
def test_bad_n_and_logprobs_name_the_field(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("mode", ["dense", "resident-urgent"])
def test_n_choices_cost_one_prefill(tiny_dir, mode):
    eng = Engine.from_dir(tiny_dir, max_batch_size=4, prefill_chunk=16, **MODES[mode])
    p = random_prompts(61, seed=5)[0]
    four = eng.generate([p], SamplingParams(max_tokens=6, ignore_eos=True, n=4))
    assert [c.index for c in four] == [0, 1, 2, 3]
    # one prefill of 61 tokens; each other choice computes its prompt's last block (61 = 15 * 4 + 1)
    assert eng.counters["prompt_tokens"] == 61 + 3 * 1
    assert [c.cached_tokens for c in four] == [0, 60, 60, 60]
    alone = Engine.from_dir(tiny_dir, prefix_caching=False, **MODES[mode]).generate([p], GREEDY)[0]
    assert all(c.token_ids == alone.token_ids[:6] for c in four)           # greedy: n equal choices


def test_seeded_choices_are_the_requests_with_seed_plus_index(tiny_dir):
    eng = Engine.from_dir(tiny_dir, max_batch_size=3)
    p = random_prompts(30, seed=6)[0]
    params = dict(max_tokens=8, ignore_eos=True, temperature=1.0)
    three = eng.generate([p], SamplingParams(**params, seed=7, n=3))
    singles = [Engine.from_dir(tiny_dir, prefix_caching=False).generate([p], SamplingParams(**params, seed=7 + i))[0]
               for i in range(3)]
    assert [c.token_ids for c in three] == [c.token_ids for c in singles]
    assert len({tuple(c.token_ids) for c in three}) > 1                        # they differ


def test_stream_and_abort_cover_every_choice(tiny_dir):
    eng = Engine.from_dir(tiny_dir, max_batch_size=4)
    outs = list(eng.stream(random_prompts(20, seed=8)[0], SamplingParams(max_tokens=3, ignore_eos=True, n=2)))
    assert sorted({o.index for o in outs}) == [0, 1]
    assert [o.request_finished for o in outs].count(True) == 1 and outs[-1].request_finished
    rid = eng.add_request(random_prompts(20, seed=9)[0], SamplingParams(max_tokens=50, n=3))
    eng.step()
    eng.abort(rid)
    ended = [o for o in eng.step() if o.request_id == rid]
    assert sorted(o.index for o in ended) == [0, 1, 2] and all(o.finish_reason == "abort" for o in ended)
    assert eng.allocator.num_free == eng.allocator.num_blocks and not eng._seqs


@pytest.mark.parametrize("mode", ["dense", "resident-urgent"])
def test_logprobs_are_the_models_log_softmax(tiny_dir, mode):
    eng = Engine.from_dir(tiny_dir, **MODES[mode], prefill_precision="float32")   # the fp32 reference's
    p = random_prompts(25, seed=10)[0]
    out = eng.generate([p], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3))[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    ids, model = list(p), eng.model
    for tok, lp in zip(out.token_ids, out.logprobs):
        with torch.inference_mode():
            logp = torch.log_softmax(_dense_logits(model, ids), -1)
        top = torch.topk(logp, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist() and lp.top[0][0] == tok      # greedy: the top one
        assert lp.logprob == pytest.approx(logp[tok].item(), abs=1e-4)
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        ids.append(tok)
    assert eng.generate([p], SamplingParams(max_tokens=2))[0].logprobs is None      # not asked: none


def _dense_logits(model, ids: list[int]) -> torch.Tensor:
    """The last position's logits of a full causal forward (no cache), fp32."""
    from runtime.attention_ref import CausalAttention
    h = model(torch.tensor(ids), torch.arange(len(ids)), CausalAttention())
    return model.logits(h[-1:])[0].float()


@pytest.mark.parametrize("mode", ["dense", "resident-urgent", "sparse"])
def test_stress_half_the_pool_many_documents_concurrent(tiny_dir, mode):
    """Six documents x three questions, interleaved, four at a time, in a pool half the size the
    workload would like cached: evictions happen; every output equals its uncached output; after
    every step no block a sequence holds is reclaimable or shared unnamed, and no block a sequence
    will write is shared; when the load ends every block is free again."""
    docs = random_prompts(*[40 + 6 * d for d in range(6)], seed=11)
    qs = random_prompts(5, 7, 3, seed=12)
    order = torch.randperm(18, generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [docs[i % 6] + qs[i // 6] for i in order]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = Engine.from_dir(tiny_dir, prefix_caching=False, max_batch_size=4, **MODES[mode]).generate(prompts, params)
    eng = Engine.from_dir(tiny_dir, max_batch_size=4, num_host_blocks=72, **MODES[mode])
    c = eng.allocator
    rids = [eng.add_request(p, params) for p in prompts]
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        held: dict[int, int] = {}
        for seq in eng.scheduler.running:
            for b in seq.block_table:
                held[b] = held.get(b, 0) + 1
                assert b not in c.reclaimable
            for b in seq.block_table[seq.num_cached // BS:]:        # blocks it will still write
                assert b not in c.name_of and c.refs[b] == 1
        assert all(c.refs[b] == n for b, n in held.items())
        assert all(b in c.name_of for b, n in held.items() if n > 1)    # only named blocks are shared
    assert [got[r] for r in rids] == [w.token_ids for w in want]
    s = eng.stats()
    assert s["prefix_cache_evictions"] > 0 and s["prefix_cache_hits"] > 0
    assert c.num_free == c.num_blocks and not c.refs
    assert c.num_reclaimable == c.num_cached                      # everything cached is reclaimable now


def test_cached_state_is_not_reused_across_engines_with_other_weights_or_settings(tiny_dir, tmp_path):
    """The names cover the weights, the dtypes and the block size: an engine reloaded with any of
    them changed names the same tokens differently, so nothing of the old one's could match."""
    tokens = random_prompts(40, seed=13)[0]
    base = Engine.from_dir(tiny_dir, block_size=BS)
    other_weights = Engine.from_dir(make_tiny_engine(tmp_path / "w2", seed=2), block_size=BS)
    names = {name: chain_hashes(tokens, BS, e.allocator.identity)
             for name, e in [("base", base), ("weights", other_weights),
                             ("kv_dtype", Engine.from_dir(tiny_dir, block_size=BS, kv_dtype="float16")),
                             ("mode", Engine.from_dir(tiny_dir, block_size=BS, mode="sparse"))]}
    for name, hashes in names.items():
        if name != "base":
            assert set(hashes).isdisjoint(names["base"]), name
    assert names["base"] == chain_hashes(tokens, BS, Engine.from_dir(tiny_dir, block_size=BS).allocator.identity)
    # and a weight swap in place empties the cache
    base.generate([tokens], GREEDY)
    assert base.allocator.num_cached > 0
    base.model.weights_version += 1
    base.step()
    assert base.allocator.num_cached == 0


def test_dense_names_decoded_blocks_so_a_next_turn_reuses_the_reply(tiny_dir):
    """Dense decode writes a generated token's K/V as prefill would: a next turn that extends
    prompt + reply hits the reply's blocks too; lookahead names only prompt blocks."""
    p = random_prompts(21, seed=14)[0]
    for mode, extra in [("dense", 12), ("resident-urgent", 0)]:
        eng = Engine.from_dir(tiny_dir, **MODES[mode])
        first = eng.generate([p], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        nxt = p + first.token_ids + [5, 6, 7]
        hit = eng.generate([nxt], GREEDY)[0]
        assert hit.cached_tokens == 20 + extra       # dense: (21 + 11 stored) // 4 = 8 blocks; else 21 // 4
        plain = Engine.from_dir(tiny_dir, prefix_caching=False, **MODES[mode]).generate([nxt], GREEDY)[0]
        assert hit.token_ids == plain.token_ids


def test_a_cache_hits_tail_runs_before_a_long_prefill_in_a_short_step(tiny_dir):
    """A long fresh prompt is prefilling (chunks of 48) when a question about a cached document
    arrives: the question's few uncached tokens run first, in a step of their own (no long chunk
    in it), so its first token comes while the long prompt still prefills; the long prompt loses
    that one step only; every output equals its run alone."""
    doc, long_doc = random_prompts(60, 160, seed=21)
    q1, q2 = random_prompts(3, 5, seed=22)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    alone = Engine.from_dir(tiny_dir, prefix_caching=False, **MODES["dense"])
    want = [w.token_ids for w in alone.generate([long_doc, doc + q2], params)]
    eng = Engine.from_dir(tiny_dir, prefill_chunk=48, **MODES["dense"])   # short: <= 6 left
    eng.generate([doc + q1], params)                                   # the document is cached
    r_long = eng.add_request(long_doc, params)
    eng.step()                                                         # the long prompt's first chunk
    r_hit = eng.add_request(doc + q2, params)
    got: dict[str, list[int]] = {}
    first: dict[str, int] = {}
    long_done: list[int] = []                  # the long prompt's computed tokens after each step
    step = 0
    while eng.has_unfinished():
        outs = eng.step()
        step += 1
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.new_token_ids:
                first.setdefault(o.request_id, step)
        seq = next((s for s in eng.scheduler.running if s.request_id == r_long), None)
        long_done.append(len(long_doc) if seq is None else min(seq.num_cached, len(seq.prompt_ids)))
    assert [got[r_long], got[r_hit]] == want
    assert first[r_hit] == 1                     # the hit's tail (5 tokens) ran in the first step after it came
    assert long_done[0] == 48                    # ... a step with no long chunk in it
    assert long_done[1] == 96                    # the long prompt resumed at once
    assert first[r_long] == 4                    # 48 + 48 + 16 more after the deferred step
