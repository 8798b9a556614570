"""Prompt log-probabilities (SamplingParams.prompt_logprobs, OpenAI completions' `echo`): every prompt
token after the first gets log_softmax of the row before it, as a full causal forward computes it,
whatever the chunking, the mode, the prefix cache or a prefill cache. The engines here prefill in
float32 (the reference's precision); bf16 and W8A8 prompts score within their own rounding."""
from __future__ import annotations

import pytest
import torch

from runtime.attention_ref import CausalAttention
from runtime.engine import Engine
from runtime.errors import RequestError
from runtime.prefill_cache import PrefillCache
from runtime.sampling import SamplingParams
from tiny_engine import SMALL_LOOKAHEAD, make_tiny_engine, random_prompts


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("tiny_plp"), seed=5)


def reference(engine: Engine, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab] log-probabilities of positions 1.. from one causal forward, no cache."""
    model = engine.model
    h = model(torch.tensor(ids), torch.arange(len(ids)), CausalAttention())
    return torch.log_softmax(model.logits(h[:-1]).float(), dim=-1)


def check(got, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert got[0] is None and len(got) == len(ids)
    for pos in range(1, len(ids)):
        t, row = got[pos], ref[pos - 1]
        assert t.token_id == ids[pos]
        assert t.logprob == pytest.approx(float(row[ids[pos]]), abs=2e-4)
        assert t.rank == 1 + int((row > row[ids[pos]] + 1e-6).sum())
        top_v, top_i = torch.topk(row, k)
        assert [i for i, _ in t.top] == top_i.tolist()
        assert [v for _, v in t.top] == pytest.approx(top_v.tolist(), abs=2e-4)


@pytest.mark.parametrize("chunk", [512, 16])         # one prefill step; several chunks
@pytest.mark.parametrize("mode", ["dense", "lookahead"])
def test_prompt_logprobs_equal_a_full_causal_forward(tiny_dir, chunk, mode):
    overrides = dict(SMALL_LOOKAHEAD, top_k=6) if mode == "lookahead" else {}
    eng = Engine.from_dir(tiny_dir, prefill_chunk=chunk, prefill_precision="float32", **overrides)
    ids = random_prompts(45, seed=3)[0]
    out = eng.generate([ids], SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=3))[0]
    check(out.prompt_logprobs, ids, reference(eng, ids), 3)
    plain = eng.generate([ids], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert plain.prompt_logprobs is None and plain.token_ids == out.token_ids


def test_a_cached_prompt_is_computed_again_and_still_cached_for_others(tiny_dir):
    eng = Engine.from_dir(tiny_dir, block_size=4, prefill_chunk=16, prefill_precision="float32")
    ids = random_prompts(40, seed=4)[0]
    eng.generate([ids], SamplingParams(max_tokens=2, ignore_eos=True))                 # cached now
    out = eng.generate([ids], SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=0))[0]
    assert out.cached_tokens == 0
    check(out.prompt_logprobs, ids, reference(eng, ids), 0)
    again = eng.generate([ids], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert again.cached_tokens > 0                 # the scored prompt's blocks are named as usual


def test_a_recorded_prefill_is_not_replayed_for_a_scored_prompt(tiny_dir):
    base = Engine.from_dir(tiny_dir, prefill_precision="float32")
    cache = PrefillCache(max_prompts=2)
    ids = random_prompts(30, seed=6)[0]
    base.sibling(cache, block_size=4).generate([ids], SamplingParams(max_tokens=2, ignore_eos=True))
    eng = base.sibling(cache, block_size=4)
    out = eng.generate([ids], SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1))[0]
    check(out.prompt_logprobs, ids, reference(eng, ids), 1)


def test_streamed_outputs_carry_them_once_and_n_choices_each(tiny_dir):
    eng = Engine.from_dir(tiny_dir, prefill_chunk=8, prefill_precision="float32")
    ids = random_prompts(20, seed=7)[0]
    outs = list(eng.stream(ids, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1, n=2,
                                               temperature=1.0, seed=1)))
    carried = [o for o in outs if o.prompt_logprobs is not None]
    assert sorted(o.index for o in carried) == [0, 1]
    assert all(o.num_output_tokens == 1 for o in carried)
    for o in carried:
        check(o.prompt_logprobs, ids, reference(eng, ids), 1)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "2"])
def test_bad_values_name_the_field(bad):
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
