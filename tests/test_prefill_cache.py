"""A prompt prefilled by one engine is replayed by another over the same model: same outputs, bit for bit."""
from __future__ import annotations

import pytest
import torch

from runtime.engine import Engine
from runtime.observe import Observer
from runtime.prefill_cache import PrefillCache
from runtime.sampling import SamplingParams
from runtime.internals import Internals
from test_lookahead import SMALL, prompts, run
from tiny_engine import make_tiny_engine

SP = SamplingParams(max_tokens=12, ignore_eos=True)
MODES = {
    "dense": dict(block_size=4),
    "resident-urgent": dict(SMALL, top_k=6),
    "resident-drop-max": dict(SMALL, top_k=6, miss_policy="drop", group_score="max"),
    "pingpong-drop": dict(SMALL, top_k=6, residency="pingpong", miss_policy="drop"),
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("tiny_pc"), seed=11)


def sibling(base: Engine, cache: PrefillCache | None, **overrides) -> Engine:
    """An engine over `base`'s model object (what shares a cache), with its own config."""
    return base.sibling(cache, **overrides)


class ModelRows(Observer):
    """Token rows the model runs on, per step (a replayed step's batch is store_only: no model)."""

    def __init__(self):
        self.rows: list[int] = []

    def on_batch(self, batch):
        if not batch.store_only:
            self.rows.append(len(batch.tokens))


def count_rows(engine: Engine) -> list[int]:
    """Token rows the model's forward sees, per step that runs it."""
    return engine.observe(ModelRows()).rows


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("chunk", [512, 40])      # one prefill step; several chunks, mixed with decodes
def test_replayed_prefill_decodes_exactly_like_a_real_one(tiny_dir, mode, chunk):
    ps = prompts(150, 61, 97, seed=12)
    base = Engine.from_dir(tiny_dir, internals=Internals(debug_checks=True))      # its siblings check their slots too
    ref, ref_logits = run(sibling(base, None, **MODES[mode], prefill_chunk=chunk), ps, SP)

    cache = PrefillCache(max_prompts=3)
    run(sibling(base, cache, **MODES["dense"], prefill_chunk=chunk), ps, SP)        # records
    assert cache.misses == 3 and cache.hits == 0
    eng = sibling(base, cache, **MODES[mode], prefill_chunk=chunk)
    rows = count_rows(eng)
    got, got_logits = run(eng, ps, SP)
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for a, b in zip(got_logits, ref_logits):
        assert torch.equal(a, b)
    if chunk == 512:    # all three prompts fit one step: replayed, the model never ran a prompt row
        assert cache.hits == 3 and max(rows) <= 2 * len(ps)
    else:               # a chunk that shares its step with a decode runs the model (not recorded twice)
        assert cache.hits >= 1 and cache.misses == 3


def test_other_model_objects_and_evicted_prompts_miss(tiny_dir):
    ps = prompts(80, 90, seed=13)
    cache = PrefillCache(max_prompts=1)
    a = sibling(Engine.from_dir(tiny_dir), cache, block_size=4)
    run(a, ps, SP)                                  # both recorded; the second evicts the first
    b = sibling(Engine.from_dir(tiny_dir), cache, block_size=4)     # same weights, another object
    run(b, ps[1:], SP)
    assert cache.hits == 0
    c = sibling(a, cache, block_size=4)
    run(c, ps[:1], SP)                              # evicted: recorded again
    assert cache.hits == 0 and cache.misses == 4
    run(sibling(a, cache, block_size=4), ps[:1], SP)
    assert cache.hits == 1
    with pytest.raises(ValueError, match="max_prompts"):
        PrefillCache(0)


@pytest.mark.parametrize("mode", ["dense", "resident-urgent"])
def test_another_kv_dtype_misses_and_decodes_like_its_own_prefill(tiny_dir, mode):
    """An fp16-KV engine attends over rounded keys in its prefill: it must not replay an fp32
    engine's recorded prefill (whose logits it would emit), and the reverse."""
    ps = prompts(40, seed=17)
    base = Engine.from_dir(tiny_dir)
    cache = PrefillCache(max_prompts=2)
    run(sibling(base, cache, **MODES[mode]), ps, SP)                              # fp32 records
    half = sibling(base, cache, **MODES[mode], kv_dtype="float16")
    got, got_logits = run(half, ps, SP)
    assert cache.hits == 0 and cache.misses == 2
    ref, ref_logits = run(sibling(base, None, **MODES[mode], kv_dtype="float16"), ps, SP)
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    assert all(torch.equal(a, b) for a, b in zip(got_logits, ref_logits))
    run(sibling(base, cache, **MODES[mode], kv_dtype="float16"), ps, SP)          # fp16 now replays fp16's
    assert cache.hits == 1
