"""Dense runtime on a tiny random model: cache, chunked prefill, batching and sampling are exact."""
from __future__ import annotations

import pytest
import torch

from runtime.attention_ref import CausalAttention
from runtime.engine import Engine
from runtime.errors import CapacityError, RequestError
from runtime.sampling import SamplingParams
from runtime.internals import Internals
from tiny_engine import make_tiny_engine


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("tiny"), seed=1)


def reference_greedy(model, prompt_ids: list[int], n: int, kv_dtype: torch.dtype | None = None) -> list[int]:
    """Greedy decode by recomputing the full causal forward each step (no cache); kv_dtype: K/V
    rounded into it, as a cache stored in that dtype holds them."""
    ids = list(prompt_ids)
    for _ in range(n):
        t = torch.tensor(ids)
        h = model(t, torch.arange(len(ids)), CausalAttention(kv_dtype))
        ids.append(int(model.logits(h[-1:])[0].argmax()))
    return ids[len(prompt_ids):]


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("chunk", [3, 16, 512])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16"])
def test_cached_greedy_equals_full_recompute(tiny_dir, chunk, kv_dtype):
    """At every KV storage dtype: the reference rounds K/V the same way (fp32: not at all)."""
    eng = Engine.from_dir(tiny_dir, prefill_chunk=chunk, block_size=4, kv_dtype=kv_dtype)
    p = prompt(0, 37)
    out = eng.generate([p], GREEDY)[0]
    rounding = None if kv_dtype == "float32" else getattr(torch, kv_dtype)
    with torch.inference_mode():
        assert out.token_ids == reference_greedy(eng.model, p, 12, rounding)


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_batched_sequences_of_different_lengths_match_alone(tiny_dir, impl):
    """torch: the decode items attend in one batch padded to the longest (paged_decode_attention)."""
    prompts = [prompt(s, n) for s, n in [(1, 5), (2, 40), (3, 17), (4, 64)]]
    alone = [Engine.from_dir(tiny_dir, max_batch_size=1, internals=Internals(impl=impl)).generate([p], GREEDY)[0].token_ids
             for p in prompts]
    together = Engine.from_dir(tiny_dir, max_batch_size=4, prefill_chunk=24, internals=Internals(impl=impl)).generate(prompts, GREEDY)
    assert [c.token_ids for c in together] == alone


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_chunked_prefill_logits_equal_one_shot(tiny_dir, kv_dtype):
    """fp16 too: a one-shot prefill attends over its rows as the pool stores them, like a chunk's
    over the pool."""
    p = prompt(5, 50)
    logits = []
    for chunk in (7, 50):
        eng = Engine.from_dir(tiny_dir, prefill_chunk=chunk, kv_dtype=kv_dtype)
        seq_logits = {}
        orig = eng.runner.run
        def spy(work, orig=orig, **kw):
            out = orig(work, **kw)
            seq_logits.update(out)
            return out
        eng.runner.run = spy
        eng.generate([p], SamplingParams(max_tokens=1))
        logits.append(next(iter(seq_logits.values())))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_noncontiguous_block_tables_read_correctly(tiny_dir, impl):
    """Interleave admissions so block runs are fragmented; results must not change."""
    eng = Engine.from_dir(tiny_dir, max_batch_size=4, block_size=4, num_host_blocks=64, internals=Internals(impl=impl))
    eng.allocator.allocate(3)                   # holes at the front of the free list
    hole = eng.allocator.allocate(2)
    eng.allocator.allocate(1)
    eng.allocator.free(hole)
    p = prompt(7, 30)
    out = eng.generate([p], GREEDY)[0]
    with torch.inference_mode():
        assert out.token_ids == reference_greedy(eng.model, p, 12)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sparse", [False, True])
def test_torch_table_attends_the_decode_items_in_one_batch(kv_dtype, sparse):
    """The torch table's dense step (no paged kernel): the decode items of ragged contexts, their
    blocks in a run or scattered, beside a prompt chunk, attend in one batch of ops, padded to the
    longest (no loop over them); each equals its sequence's own attention over the pool (what the
    per-sequence path computed), sparse mode's selected keys too; fresh random inputs."""
    from runtime.attention_dense import DenseAttention, decode_attention, prefill_attention
    from runtime.config import LookaheadConfig, ModelConfig
    from runtime.kv_pool import KVPool
    from runtime.ops import select_ops
    from runtime.sparse import BlockSelection
    from runtime.step import StepBatch, StepItem

    g = torch.Generator().manual_seed(61)
    cfg = ModelConfig(architecture="llama", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    bs = 4
    pool = KVPool(cfg, num_blocks=64, block_size=bs, dtype=kv_dtype)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g)), pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    items = [StepItem(0, 0, 1, 36, list(range(2, 12))),            # decode at 37 tokens, blocks 2..11
             StepItem(1, 1, 1, 12, [50, 40, 41, 44]),               # decode, scattered blocks, a full last block
             StepItem(2, 2, 3, 8, [30, 31, 32]),                    # a prompt chunk at 8..10
             StepItem(3, 5, 1, 4, [20, 21, 22]),                    # decode at 5 tokens (a table longer than it)
             StepItem(4, 6, 1, 0, [60])]                            # a one-token prompt: attends as a decode row
    batch = StepBatch.build(items, [0] * 7, bs)
    q, k, v = (torch.randn(7, h, 16, generator=g) for h in (6, 2, 2))
    ops = select_ops(torch.device("cpu"), torch.float32, impl="torch")
    assert ops.paged_attention is None
    sel = None
    if sparse:
        sel = BlockSelection(cfg, LookaheadConfig(mode="sparse", block_size=bs, top_k=2, recent_window=8,
                                                  num_sink_blocks=1), pool, ops)
        a, b = torch.randn(sel.kmin.shape, generator=g), torch.randn(sel.kmin.shape, generator=g)
        sel.kmin.copy_(torch.minimum(a, b)), sel.kmax.copy_(torch.maximum(a, b))
    calls = []

    def one_batch(q, k, v, *args):              # the batched kernel, its calls noted
        calls.append(q.shape[0])
        return paged(q, k, v, *args)
    import runtime.attention_dense as dense
    paged = dense.paged_decode_attention
    try:
        dense.paged_decode_attention = one_batch
        out = DenseAttention(pool, 0.25, ops, sel).step(batch).forward(1, q, k, v)
    finally:
        dense.paged_decode_attention = paged
    assert calls == [4]                         # the four one-token items, once
    for it in items:
        rows = slice(it.row_start, it.row_start + it.num_tokens)
        kc, vc = pool.read(1, it.block_table, it.context_len)
        if it.num_tokens == 1:
            m = None if sel is None else sel.mask_for(1, q[rows][0], it.block_table, it.context_len)
            expected = decode_attention(q[rows][0], kc, vc, 0.25, m)[None]
        else:
            expected = prefill_attention(q[rows], kc, vc)
        torch.testing.assert_close(out[rows], expected, atol=2e-6, rtol=1e-5)


def test_seeded_sampling_is_reproducible_and_varies_with_seed(tiny_dir):
    eng = Engine.from_dir(tiny_dir)
    p = prompt(9, 12)
    run = lambda seed: eng.generate([p], SamplingParams(max_tokens=16, temperature=1.0, seed=seed,
                                                        ignore_eos=True))[0].token_ids
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_top_k_one_and_tiny_top_p_are_greedy(tiny_dir):
    eng = Engine.from_dir(tiny_dir)
    p = prompt(11, 9)
    greedy = eng.generate([p], GREEDY)[0].token_ids
    k1 = SamplingParams(max_tokens=12, temperature=0.8, top_k=1, seed=0, ignore_eos=True)
    p0 = SamplingParams(max_tokens=12, temperature=0.8, top_p=1e-6, seed=0, ignore_eos=True)
    assert eng.generate([p], k1)[0].token_ids == greedy
    assert eng.generate([p], p0)[0].token_ids == greedy


def test_stream_deltas_concatenate_to_text_and_stop_string_cuts(tiny_dir):
    eng = Engine.from_dir(tiny_dir)
    full = eng.generate(["abc"], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert len(full.text) > 4
    stop = full.text[3:5]
    outs = list(eng.stream("abc", SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop])))
    text = "".join(o.delta_text for o in outs)
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert text == full.text[:full.text.find(stop)]
    assert stop not in text


def test_eos_and_max_tokens_finish(tiny_dir):
    eng = Engine.from_dir(tiny_dir)
    out = eng.generate(["hello"], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    first = out.token_ids[0]
    eng.eos_ids = (first,)
    out = eng.generate(["hello"], SamplingParams(max_tokens=5))[0]
    assert out.finish_reason == "stop" and out.token_ids == [first] and out.text == ""


def test_step_timers_split_decode_steps_from_prompt_steps(tiny_dir):
    """stats' step_seconds / decode_steps / decode_step_seconds: a prompt chunk's step counts in
    the total only; every step after the prompts is a decode step."""
    eng = Engine.from_dir(tiny_dir, prefill_chunk=16)
    eng.generate([prompt(3, 40)], SamplingParams(max_tokens=6, ignore_eos=True))
    st = eng.stats()
    # 40 prompt tokens in 16-token chunks: 3 prompt steps, the last of which emits the first token
    assert st["steps"] == 3 + 5 and st["decode_steps"] == 5
    assert 0 < st["decode_step_seconds"] < st["step_seconds"]


def test_abort_frees_blocks(tiny_dir):
    eng = Engine.from_dir(tiny_dir, num_host_blocks=32)
    free0 = eng.allocator.num_free
    rid = eng.add_request("hello there", SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.allocator.num_free < free0
    eng.abort(rid)
    outs = eng.step()
    assert any(o.request_id == rid and o.finish_reason == "abort" for o in outs)
    assert eng.allocator.num_free == free0 and not eng.has_unfinished()


def test_requests_that_cannot_fit_are_rejected_at_once(tiny_dir):
    eng = Engine.from_dir(tiny_dir, max_model_len=64)
    with pytest.raises(CapacityError, match="max_model_len"):
        eng.add_request("x" * 60, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="^prompt"):
        eng.add_request("", SamplingParams())


def test_admission_waits_for_memory_instead_of_failing(tiny_dir):
    # Pool holds exactly one request's reservation: the second waits, then runs.
    eng = Engine.from_dir(tiny_dir, block_size=16, num_host_blocks=2, max_batch_size=4)
    outs = eng.generate(["a" * 10, "b" * 10], SamplingParams(max_tokens=20, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [20, 20]
    assert eng.allocator.num_free == 2


@pytest.mark.parametrize("field,kwargs", [
    ("max_tokens", dict(max_tokens=0)), ("temperature", dict(temperature=-1.0)),
    ("top_p", dict(top_p=0.0)), ("top_p", dict(top_p=1.5)), ("top_k", dict(top_k=-2)),
    ("stop", dict(stop=[""])), ("seed", dict(seed="x")),
])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(RequestError, match=f"^{field}"):
        SamplingParams(**kwargs)
