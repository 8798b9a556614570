"""The draft chain stays in sync: pre-decoding, resync after a miss, coupled sampling, prompt lookup."""
from __future__ import annotations

import math

import pytest
import torch

from runtime.draft import DraftChain, DraftSource, DualTokenDraft, PromptLookupDraft, make_draft
from runtime.engine import Engine
from runtime.sampling import SamplingParams, filtered_logits, position_noise, sample
from tiny_engine import SMALL_LOOKAHEAD as SMALL, make_tiny_engine, random_prompts as prompts

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("tiny_chain"), seed=11)


def generate(engine, ps, params=GREEDY):
    outs = engine.generate(ps, params)
    stats = engine.stats()
    engine.close()
    return [o.token_ids for o in outs], outs, stats


# ---- the invariants on the engine ---------------------------------------------------------------
@pytest.mark.parametrize("residency,miss", [("resident", "urgent"), ("resident", "drop"), ("pingpong", "urgent")])
def test_greedy_with_k_covering_every_block_accepts_every_draft_after_the_seed(tiny_dir, residency, miss):
    ps = prompts(150, 61, 97, 33, seed=1)
    dense, _, _ = generate(Engine.from_dir(tiny_dir, block_size=4), ps)
    la, outs, st = generate(Engine.from_dir(tiny_dir, **SMALL, top_k=64, residency=residency, miss_policy=miss), ps)
    assert la == dense
    assert st["draft_accept_rate"] == 1.0 and st["resyncs"] == 0
    for o in outs:                   # one pre-decoding step per sequence, then every draft is right
        assert o.metrics["predecode_steps"] == 1 and o.metrics["draft_accept_rate"] == 1.0
        assert o.metrics["drafts_proposed"] == GREEDY.max_tokens - 2


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.9, 0), (1.0, 20)])
def test_seeded_sampling_emits_the_same_tokens_dense_and_lookahead(tiny_dir, top_p, top_k):
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=top_p, top_k=top_k, seed=1234, ignore_eos=True)
    ps = prompts(140, 75, seed=2)
    dense, _, _ = generate(Engine.from_dir(tiny_dir, block_size=4), ps, params)
    again, _, _ = generate(Engine.from_dir(tiny_dir, block_size=4), ps, params)
    la, _, st = generate(Engine.from_dir(tiny_dir, **SMALL, top_k=64), ps, params)
    assert dense == again == la                     # reproducible, and the same in both modes
    assert st["draft_accept_rate"] == 1.0           # coupled noise: the draft agrees with the real draw
    other, _, _ = generate(Engine.from_dir(tiny_dir, block_size=4), ps,
                           SamplingParams(**{**params.__dict__, "seed": 99}))
    assert other != dense                           # the seed matters: the test can fail


def test_predecoding_stores_nothing_and_emits_nothing(tiny_dir):
    eng = Engine.from_dir(tiny_dir, **SMALL, top_k=3)
    rid = eng.add_request(prompts(90)[0], SamplingParams(max_tokens=8, ignore_eos=True))
    seq = eng._seqs[rid][0]
    while not seq.output_ids:                       # prefill: the first token comes from the prompt
        eng.step()
    cached = seq.num_cached
    outs = eng.step()                               # the pre-decoding step
    assert [o for o in outs if o.request_id == rid] == [] and len(seq.output_ids) == 1
    assert seq.num_cached == cached and eng.stats()["predecode_steps"] == 1
    eng.step()                                      # the first dual step stores and emits
    assert seq.num_cached == cached + 1 and len(seq.output_ids) == 2
    eng.close()


class WrongAt(DraftSource):
    """The model's own draft, except a wrong token at the given draft indices (0-based)."""

    def __init__(self, wrong: set[int]):
        self.wrong, self.n = wrong, 0

    def propose(self, context, model_guess):
        if model_guess is None:
            return None
        i, self.n = self.n, self.n + 1
        return (model_guess + 1) % 256 if i in self.wrong else model_guess


@pytest.mark.parametrize("resync_after,resyncs", [(1, 3), (2, None), (0, 0)])
def test_a_miss_resyncs_the_chain_by_the_configured_rule(tiny_dir, resync_after, resyncs):
    ps = prompts(120, seed=3)
    dense, _, _ = generate(Engine.from_dir(tiny_dir, block_size=4), ps)
    eng = Engine.from_dir(tiny_dir, **SMALL, top_k=64, resync_after=resync_after)
    eng.runner.chain.source = WrongAt({3, 9, 10})   # one lone miss and two in a row
    la, outs, st = generate(eng, ps)
    assert la == dense                              # a wrong draft never changes the tokens
    assert st["resyncs"] == outs[0].metrics["resyncs"]
    if resyncs is None:     # after 2 misses in a row; a lone miss's stale guess may miss again
        assert 1 <= st["resyncs"] <= 3
    else:
        assert st["resyncs"] == resyncs
    assert st["predecode_steps"] == 1 + st["resyncs"]
    if resync_after == 1:                           # after a resync the chain is right again
        assert st["drafts_proposed"] - round(st["draft_accept_rate"] * st["drafts_proposed"]) == 3


# ---- the chain's bookkeeping --------------------------------------------------------------------
def test_draft_chain_judges_counts_and_resyncs():
    chain = DraftChain(DualTokenDraft(), resync_after=2)
    assert chain.next_draft(0, [5, 6]) is None                 # the first step pre-decodes
    chain.set_guess(0, 7)
    assert chain.next_draft(0, [5, 6]) == 7                    # pre-decoding's draw is the draft
    chain.set_guess(0, 8)
    assert chain.next_draft(0, [5, 6, 7]) == 8                 # 7 was right
    chain.set_guess(0, 9)
    assert chain.next_draft(0, [5, 6, 7, 1]) == 9              # a miss: kept (resync_after 2)
    chain.set_guess(0, 10)
    assert chain.next_draft(0, [5, 6, 7, 1, 2]) is None        # a second miss: resync
    assert chain.stats() == {"draft_accept_rate": 1 / 3, "drafts_proposed": 3, "predecode_steps": 2,
                             "resyncs": 1}
    assert chain.release(0)["resyncs"] == 1 and 0 not in chain.chains


def test_draft_rows_draw_at_the_position_their_token_will_hold():
    from types import SimpleNamespace as Seq
    chain = DraftChain(DualTokenDraft(), resync_after=1)
    seqs = [Seq(seq_id=1, params="p", noise_seed=7, num_tokens=5), Seq(seq_id=2, params="q", noise_seed=8, num_tokens=3)]
    assert chain.draws(seqs, [False, True]) == [("p", 7, 6), ("q", 8, 3)]    # a draft row; a pre-decoding row
    assert chain.next_draft(1, [1]) is None and chain.next_draft(2, [2]) is None
    chain.set_guesses([1, 2], [40, 41])
    assert chain.next_draft(1, [1, 2]) == 40 and chain.next_draft(2, [2, 3]) == 41


def test_make_draft_knows_the_config_kinds_only():
    assert make_draft("none") is None
    assert isinstance(make_draft("dual_token"), DualTokenDraft)
    assert isinstance(make_draft("prompt_lookup"), PromptLookupDraft)
    with pytest.raises(ValueError, match="random"):
        make_draft("random")


# ---- prompt lookup --------------------------------------------------------------------------------
def test_prompt_lookup_takes_the_longest_latest_match():
    pl = PromptLookupDraft(max_ngram=3)
    assert pl.propose([1, 2, 3, 9, 1, 2, 3], None) == 9                # 3-gram [1 2 3] -> 9
    assert pl.propose([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], None) == 9       # the 3-gram beats the later 2-gram
    assert pl.propose([4, 5, 4, 6, 4], None) == 6                      # latest occurrence of [4]
    assert pl.propose([1, 2, 3], 42) == 42                             # no match: the model's draw
    assert pl.propose([1, 2, 3], None) is None                         # ... or pre-decoding
    assert PromptLookupDraft(window=3).propose([7, 8, 1, 2, 7], None) is None   # 7..8 is outside the window


def test_prompt_lookup_engine_equals_dense_and_seeds_where_no_ngram_matches(tiny_dir):
    base = prompts(40, seed=4)[0]
    ps = [base * 3]                                 # copy-heavy: n-grams match from the start
    dense, _, _ = generate(Engine.from_dir(tiny_dir, block_size=4), ps)
    la, outs, st = generate(Engine.from_dir(tiny_dir, **SMALL, top_k=64, draft="prompt_lookup"), ps)
    assert la == dense
    assert st["drafts_proposed"] > 0 and 0 <= st["draft_accept_rate"] <= 1
    unique = [list(range(0, 250, 2))]               # no token repeats: no n-gram ever matches
    la2, outs2, st2 = generate(Engine.from_dir(tiny_dir, **SMALL, top_k=64, draft="prompt_lookup"), unique)
    dense2, _, _ = generate(Engine.from_dir(tiny_dir, block_size=4), unique)
    assert la2 == dense2 and outs2[0].metrics["predecode_steps"] >= 1


# ---- the sampler ----------------------------------------------------------------------------------
def test_keyed_gumbel_sampling_is_an_exact_draw():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.7)
    n = 20000
    counts = torch.bincount(torch.tensor([sample(logits, params, 7, pos) for pos in range(n)]), minlength=6)
    p = torch.softmax(logits.double() / 0.7, -1)
    chi2 = float((((counts.double() - n * p) ** 2) / (n * p)).sum())
    assert chi2 < 25.0                               # 5 dof: p < 1e-4 of failing by chance
    assert sample(logits, params, 7, 3) == sample(logits, params, 7, 3)


def test_top_k_and_top_p_sets_are_respected():
    logits = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0, -2.0, -2.5, -4.0])
    for params, allowed in ((SamplingParams(temperature=1.0, top_k=3), {0, 1, 2}),
                            (SamplingParams(temperature=1.0, top_p=0.5), {0, 1})):
        drawn = {sample(logits, params, 3, pos) for pos in range(3000)}
        assert drawn == allowed
        z = filtered_logits(logits, params)
        assert {int(i) for i in torch.isfinite(z).nonzero()} == allowed


def test_position_noise_is_keyed_by_seed_and_position():
    a = position_noise(1, 5, 1000)
    assert torch.equal(a, position_noise(1, 5, 1000))
    assert not torch.equal(a, position_noise(1, 6, 1000)) and not torch.equal(a, position_noise(2, 5, 1000))
    assert abs(float(a[torch.isfinite(a)].mean()) - 0.5772) < 0.1    # Gumbel(0, 1): mean is Euler's gamma


@pytest.mark.parametrize("field,value", [("temperature", math.inf), ("temperature", math.nan),
                                         ("temperature", -0.1), ("seed", 2 ** 70), ("seed", -(2 ** 64)),
                                         ("seed", True), ("top_p", 0.0), ("top_k", -1)])
def test_bad_sampling_values_name_their_field(field, value):
    from runtime.errors import RequestError
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


# ---- top_k beyond max_model_len ------------------------------------------------------------------
def test_top_k_beyond_what_max_model_len_holds_is_clamped(tiny_dir):
    eng = Engine.from_dir(tiny_dir, **SMALL, top_k=100000, max_model_len=512)
    assert eng.config.top_k == 512 // 4
    assert eng.runner.attn.dev_k.shape[-3] == eng.runner.attn.layout.num_slots == 1 + 3 + 128
    toks, _, _ = generate(eng, prompts(100, seed=5), SamplingParams(max_tokens=4, ignore_eos=True))
    dense, _, _ = generate(Engine.from_dir(tiny_dir, block_size=4), prompts(100, seed=5),
                           SamplingParams(max_tokens=4, ignore_eos=True))
    assert toks == dense
