"""Kernels bound to the weights at load (runtime/projections.py, plugins/cpu/ops.py and prefill.py): the packed
copies exist before the first prompt and are what the memory plan counts; a step calls no
argument-checking wrapper; a weight or pool the C kernel does not take runs the torch formulation
and says so (WARNING, `stats()["kernel_fallbacks"]`), never silently; each bound kernel equals its
reference on fresh random inputs."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from plugins import cpu
from plugins import reference as ref
from plugins.cpu import abi, loader, prefill
from plugins.cpu import ops as cpu_ops
from runtime.config import ModelConfig
from runtime.engine import Engine
from runtime.model import LlamaModel
from runtime.ops import select_ops
from runtime.sampling import SamplingParams
from runtime.ops import POOL_ENTRIES
from runtime.projections import MODE_POOL_OPS, Projections
from runtime.internals import Internals
from test_fused_decode import make_int8_engine
from test_prefill_kernels import ATOL, pool_case
from tiny_engine import SMALL_LOOKAHEAD, TINY, make_tiny_engine, random_prompts

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"plugins.cpu: {loader.unavailable_reason()}")
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("proj")
    return {"fp32": make_tiny_engine(root / "fp32", seed=5, head_dim=32),
            "int8": make_int8_engine(root / "int8", seed=6, attention_bias=True),
            # wo's 60 outputs are not a multiple of 8: linear.c's packed layout does not take it
            "odd": make_tiny_engine(root / "odd", seed=7, hidden_size=60, head_dim=16)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- bound at load -------------------------------------------------------------------------------
def test_packed_copies_are_made_at_load_and_counted_by_the_plan(dirs):
    # float32 prompts, named: `auto` resolves on the host (bf16 where it has AVX512_BF16, below)
    eng = Engine.from_dir(dirs["fp32"], block_size=4, prefill_precision="float32")
    proj = eng.model.projections
    assert proj is not None and eng.stats()["steps"] == 0                # no prompt has run
    assert proj.nbytes > 0 and proj.nbytes == eng.memory_plan.packed_weights + eng.memory_plan.prefill_weights
    assert set(proj.kernels()) == {"decode c/linear_packed", "prefill c/linear_packed", "norm c/rmsnorm"}
    assert proj.kernels()["norm c/rmsnorm"] == 2 * eng.manifest.model.num_layers + 1
    assert eng.describe()["kernels"]["projections"] == proj.kernels()
    assert eng.stats()["kernel_fallbacks"] == []


@pytest.mark.skipif(not prefill.bf16_dot_products(), reason="this CPU has no AVX512_BF16 (or the AVX-512 library "
                    "did not build): bf16 prompts bind their torch formulation, tests/test_engine_spec.py")
def test_bf16_prompts_bind_the_bf16_gemm_and_its_copy_at_load(dirs):
    """A bf16-prompt engine on a CPU with the units: every layer projection's prompt rows run the bf16
    GEMM on a bf16 copy made at load and counted (the LM head's one prompt row keeps the fp32 kernel)."""
    eng = Engine.from_dir(dirs["fp32"], block_size=4, prefill_precision="bfloat16")
    proj, plan = eng.model.projections, eng.memory_plan
    assert eng.stats()["steps"] == 0 and plan.prefill_weights > 0
    assert proj.nbytes == plan.packed_weights + plan.prefill_weights
    assert proj.kernels()["prefill c/gemm_bf16"] == 4 * eng.manifest.model.num_layers
    assert eng.stats()["kernel_fallbacks"] == []


def test_an_int8_engine_binds_its_int8_kernel(dirs):
    eng = Engine.from_dir(dirs["int8"], block_size=4)
    kernels = eng.model.projections.kernels()
    assert kernels["decode c/linear_int8"] == 4 * eng.manifest.model.num_layers + 1      # and the tied head
    assert eng.stats()["kernel_fallbacks"] == []


@pytest.mark.parametrize("which,mode", [("fp32", "dense"), ("fp32", "lookahead"), ("int8", "dense"),
                                        ("int8", "lookahead"), ("fp32", "sparse")])
def test_a_step_calls_no_argument_checking_wrapper(dirs, monkeypatch, which, mode):
    """The checked wrappers (cpu.linear, cpu.linear_int8, prefill.prefill_attention, the decode
    attentions' and block top-K's `*_supported`) look up these helpers on every call; a bound kernel
    only when it binds, at load. Python layers (fused=False) run every projection, prompt and decode
    rows, and the pool-side ops the mode calls."""
    over = (SMALL_LOOKAHEAD if mode == "lookahead" else dict(block_size=4, mode="sparse", top_k=2)
            if mode == "sparse" else dict(block_size=4))
    eng = Engine.from_dir(dirs[which], internals=Internals(fused=False), **over)
    want = eng.generate(random_prompts(21, 9, seed=1), GREEDY)

    def refuse(*a, **k):
        raise AssertionError("a per-call eligibility check ran in a step")
    eng = Engine.from_dir(dirs[which], internals=Internals(fused=False), **over)           # binds (and checks) here
    # nor does the model reach its table's projection and norm entries after load: their bound kernels run
    eng.model.__dict__["ops"] = replace(eng.model.ops, **dict.fromkeys(
        ("linear", "rms_norm", "prefill_linear", "decode_linear"), refuse))
    for mod, name in ((cpu_ops, "packed_weight"), (cpu_ops, "int8_kernel_group"), (prefill, "prefill_attention"),
                      (cpu_ops, "attention_supported"), (cpu_ops, "block_topk_supported")):
        monkeypatch.setattr(mod, name, refuse)
    # the pool-side entries the mode calls are bound ones, not the checked functions of the table
    for name in MODE_POOL_OPS[eng.config.mode]:
        assert getattr(eng.ops, name) is not POOL_ENTRIES[name], name
    got = eng.generate(random_prompts(21, 9, seed=1), GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    # the control: the checked wrapper does look them up (so this test can fail)
    w = eng.model.layers[0].wqkv.weight
    with pytest.raises(AssertionError, match="eligibility"):
        (cpu.linear(torch.randn(2, 64), w) if isinstance(w, torch.Tensor)
         else cpu.linear_int8(torch.randn(2, 64), w.qweight, w.scale))


# ---- misfits are said, not silent -------------------------------------------------------------------
@pytest.mark.parametrize("which,why", [("odd", "N = 60 is not a multiple of 8")])
def test_a_weight_the_kernel_does_not_take_is_warned_and_counted(dirs, caplog, which, why):
    with caplog.at_level(logging.WARNING, logger="runtime.engine"):
        eng = Engine.from_dir(dirs[which], block_size=4)
    fallbacks = eng.stats()["kernel_fallbacks"]
    assert any(why in f for f in fallbacks), fallbacks
    assert any(why in r.getMessage() for r in caplog.records)
    assert eng.describe()["kernel_fallbacks"] == fallbacks
    # and it still runs, equal to the torch table's tokens
    torch_eng = Engine.from_dir(dirs[which], block_size=4, internals=Internals(impl="torch"))
    prompts = random_prompts(13, 30, seed=2, vocab=eng.manifest.model.vocab_size)
    got = [c.token_ids for c in eng.generate(prompts, GREEDY)]
    assert got == [c.token_ids for c in torch_eng.generate(prompts, GREEDY)]


def test_an_int8_group_the_kernel_does_not_read_falls_back_with_its_reason():
    """The builder makes groups of multiples of 8; a hand-made dir with groups of 4 loads, and its
    weights run the torch formulation, saying why."""
    g = _gen(4)
    q = torch.randint(-127, 128, (16, 32), generator=g, dtype=torch.int8)
    s, x = torch.rand(16, 8, generator=g) * 0.01, torch.randn(3, 32, generator=g)
    kern = cpu_ops.bind_linear_int8(q, s)
    assert kern.fallback == "a group of 4 inputs is not a multiple of 8" and kern.impl == "torch/linear_int8"
    torch.testing.assert_close(kern(x), ref.linear_int8_ref(x, q, s, None), atol=1e-5, rtol=1e-5)


def test_a_pool_the_prompt_kernel_does_not_take_is_warned():
    k = torch.zeros(2, 5, 4, 8)                                   # head_dim 8: not a multiple of 16
    kern = prefill.bind_prefill_attention(k, k.clone(), 4)
    assert kern.fallback and "head_dim 8" in kern.fallback and kern.fn is prefill.prefill_attention_torch
    from runtime.projections import bind_pool_kernels
    ops = select_ops(torch.device("cpu"), torch.float32, prefill="bfloat16", impl="c")
    pool_k = torch.zeros(1, 2, 5, 4, 8)
    bound_ops, why = bind_pool_kernels(ops, pool_k[0], pool_k[0].clone(), 4)
    assert why[0].startswith("prompt attention runs the torch formulation: head_dim 8")
    assert bound_ops.prefill_attention is prefill.prefill_attention_torch
    # and every other pool-side kernel the mode calls says the same of itself
    assert [w.split(" runs")[0] for w in why] == ["prompt attention", "lookahead decode attention"]
    dense_ops, why = bind_pool_kernels(ops, pool_k[0], pool_k[0].clone(), 4, "dense")
    assert dense_ops.paged_attention is None and why[1].startswith("dense decode attention runs the torch")
    # a 16-bit model's queries: its decode attentions run in torch, said (the kernels read fp32 rows)
    pool = torch.zeros(1, 2, 5, 4, 32)
    bf16_ops, why = bind_pool_kernels(ops, pool[0], pool[0].clone(), 4, "dense", torch.bfloat16)
    assert bf16_ops.paged_attention is None and why == ["dense decode attention runs the torch formulation: "
                                                        "bfloat16 queries (the kernel reads float32)"]
    torch_table = select_ops(torch.device("cpu"), torch.float32, impl="torch")
    assert bind_pool_kernels(torch_table, pool[0], pool[0].clone(), 4) == (torch_table, [])   # left as it is


# ---- the pool-side kernels, bound to a layout ---------------------------------------------------
def _paged_reference(q, k, v, tables, lens, scale):
    """Dense decode attention of each sequence over its blocks, in plain torch (fp32)."""
    H, (kvh, _, bs, D) = q.shape[1], k.shape
    out = []
    for b, (t, n) in enumerate(zip(tables, lens)):
        ks = k[:, t].reshape(kvh, -1, D)[:, :n].float().repeat_interleave(H // kvh, 0)
        vs = v[:, t].reshape(kvh, -1, D)[:, :n].float().repeat_interleave(H // kvh, 0)
        w = torch.softmax((ks @ q[b][:, :, None]).squeeze(-1) * scale, -1)
        out.append((w[:, None] @ vs).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bound_paged_attention_matches_reference_and_checks_its_arguments(kv_dtype):
    g = _gen(21)
    kvh, nb, bs, D, H = 2, 12, 4, 32, 6
    pool_k, pool_v = (torch.randn(1, kvh, nb, bs, D, generator=g).to(kv_dtype) for _ in range(2))
    kern = cpu_ops.bind_paged_attention(pool_k, pool_v, H)
    assert kern.fallback is None and kern.impl == "c/attention_paged"
    lens = [9, 16, 3]
    perm = torch.randperm(nb, generator=g).tolist()
    tables = [perm[0:3], perm[3:7], perm[7:8]]               # paged, not runs
    q = torch.randn(3, H, D, generator=g)
    got = kern(q, pool_k[0], pool_v[0], None, lens, 0.3, None, tables)
    want = _paged_reference(q, pool_k[0], pool_v[0], tables, lens, 0.3)
    torch.testing.assert_close(got, want, atol=2e-5 if kv_dtype == torch.float32 else 1e-2, rtol=0)
    runs = kern(q, pool_k[0], pool_v[0], [0, 3, 7], lens, 0.3)      # one run of blocks each
    torch.testing.assert_close(runs, _paged_reference(q, pool_k[0], pool_v[0], [[0, 1, 2], [3, 4, 5, 6], [7]], lens,
                                                      0.3), atol=2e-5 if kv_dtype == torch.float32 else 1e-2, rtol=0)
    with pytest.raises(abi.KernelIndexError):                 # an id past the pool: read unchecked by the kernel
        kern(q, pool_k[0], pool_v[0], None, lens, 0.3, None, [[0, 1, nb], *tables[1:]])
    with pytest.raises(abi.KernelIndexError):                 # a run past the layer
        kern(q, pool_k[0], pool_v[0], [0, 3, nb - 1], [9, 16, 5], 0.3)
    with pytest.raises(ValueError, match="q is"):
        kern(q[:, :4], pool_k[0], pool_v[0], [0, 3, 7], lens, 0.3)


def test_bound_lookahead_attention_matches_the_torch_formulation():
    from plugins.attention import _lookahead_attention_impl
    g = _gen(22)
    B, R, H, kvh, N, E, D = 2, 2, 6, 2, 20, 2, 32
    kern = cpu_ops.bind_lookahead_attention(torch.device("cpu"), torch.float16, D, H, kvh, R)
    assert kern.fallback is None and kern.impl == "c/lookahead_attention"
    q = torch.randn(B, R, H, D, generator=g)
    k, v = (torch.randn(B, kvh, N, D, generator=g).half() for _ in range(2))
    kx, vx = (torch.randn(B, kvh, E, D, generator=g) for _ in range(2))
    mask = torch.rand(B, kvh, N, generator=g) < 0.7
    extra = torch.tensor([[True, False], [True, True]])[None].expand(B, R, E).contiguous()
    got = kern(q, k, v, mask, kx, vx, extra, 0.2)
    want = _lookahead_attention_impl(q, k, v, mask, kx, vx, extra, 0.2)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="k, v is"):         # another KV dtype than the bound tier's
        kern(q, k.float(), v.float(), mask, kx, vx, extra, 0.2)
    assert cpu_ops.bind_lookahead_attention(torch.device("cpu"), torch.float16, D, 64, 1, 2).fallback == \
        "128 query rows per KV head (the kernel takes 64)"


@pytest.mark.parametrize("group_score", ["sum", "max"])
def test_bound_block_topk_matches_the_torch_formulation(group_score):
    from plugins.topk import _block_topk_impl
    g = _gen(23)
    B, R, H, kvh, nb, D, k = 2, 2, 6, 2, 30, 16, 7
    kern = cpu_ops.bind_block_topk(torch.device("cpu"), D, H, kvh)
    assert kern.fallback is None and kern.impl == "c/block_topk"
    q = torch.randn(B, R, H, D, generator=g)
    kmin = torch.randn(B, nb, kvh, D, generator=g)
    kmax = kmin + torch.rand(B, nb, kvh, D, generator=g)
    valid = torch.rand(B, R, nb, generator=g) < 0.8
    idx, scores = kern(q, kmin, kmax, valid, k, group_score)
    want_idx, want_scores = _block_topk_impl(q, kmin, kmax, valid, k, group_score)
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(scores, want_scores, atol=1e-4, rtol=1e-4)
    i3, _ = kern(q[:, 0], kmin, kmax, valid[:, 0], k, group_score)          # one row a sequence: [B, H, D]
    assert torch.equal(i3, want_idx[:, 0])
    with pytest.raises(ValueError, match="k: must be in"):
        kern(q, kmin, kmax, valid, nb + 1, group_score)
    with pytest.raises(ValueError, match="kmin, kmax is"):
        kern(q, kmin.transpose(1, 2), kmax.transpose(1, 2), valid, k, group_score)


@pytest.mark.parametrize("key_dtype", [torch.float32, torch.float16])
def test_bound_update_summaries_matches_the_torch_formulation(key_dtype):
    from plugins.summaries import _update_summaries_impl
    g = _gen(24)
    nb, kvh, D, T = 10, 2, 16, 25
    kern = cpu_ops.bind_update_summaries(torch.device("cpu"), D, kvh)
    assert kern.fallback is None and kern.impl == "c/update_summaries"
    kmin, kmax = torch.randn(nb, kvh, D, generator=g), torch.randn(nb, kvh, D, generator=g)
    keys = torch.randn(T, kvh, D, generator=g).to(key_dtype)
    ids, offs = torch.randint(0, nb, (T,), generator=g), torch.randint(0, 4, (T,), generator=g)
    a, b = kmin.clone(), kmax.clone()
    kern(a, b, keys, ids, offs)
    c, d = kmin.clone(), kmax.clone()
    _update_summaries_impl(c, d, keys, ids, offs)
    assert torch.equal(a, c) and torch.equal(b, d)
    with pytest.raises(ValueError, match="block_ids"):
        kern(a, b, keys, torch.full((T,), nb), offs)
    assert torch.equal(a, c)                                   # nothing changed


# ---- each bound kernel against its reference ----------------------------------------------------
@pytest.mark.parametrize("M", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_bound_linear_matches_f_linear(M, bias):
    g = _gen(M * 10 + bias)
    w, x = torch.randn(48, 72, generator=g), torch.randn(M, 72, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    kern = cpu_ops.bind_linear(w, b)
    assert kern.impl == "c/linear_packed" and kern.fallback is None and kern.nbytes == w.numel() * 4
    torch.testing.assert_close(kern(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_bound_linear_repacks_a_weight_edited_in_place():
    g = _gen(3)
    w, x = torch.randn(16, 24, generator=g), torch.randn(3, 24, generator=g)
    kern = cpu_ops.bind_linear(w)
    kern(x)
    w.mul_(-2.0)                                                   # after binding
    torch.testing.assert_close(kern(x), F.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("M", [1, 7, 16, 17])
@pytest.mark.parametrize("group", [0, 8, 32])
def test_bound_linear_int8_matches_reference(M, group):
    g = _gen(M + group)
    N, K = 40, 64
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    s = (torch.rand(N, generator=g) if group == 0 else torch.rand(N, K // group, generator=g)) * 0.01 + 1e-3
    b, x = torch.randn(N, generator=g), torch.randn(M, K, generator=g)
    kern = cpu_ops.bind_linear_int8(q, s, b)
    assert kern.impl == "c/linear_int8" and kern.fallback is None
    torch.testing.assert_close(kern(x), ref.linear_int8_ref(x, q, s, b), atol=1e-4, rtol=1e-4)


def test_bound_prefill_attention_matches_reference_and_checks_the_table():
    q, k, v, table = pool_case(37, 211, 6, 2, 32, 8, dtype=torch.float16, seed=11)
    kern = prefill.bind_prefill_attention(k[None], v[None], 6)
    assert kern.fallback is None and kern.impl.startswith("c/prefill_attention")
    out = kern(q, k, v, table, 211, 32 ** -0.5)
    want = ref.prefill_attention_ref(q, k.float(), v.float(), table, 211, 32 ** -0.5)
    torch.testing.assert_close(out, want, atol=ATOL * float(v.float().abs().max()), rtol=0)
    with pytest.raises(abi.KernelIndexError, match="block table"):
        kern(q, k, v, [table[0], 10 ** 6, *table[2:]], 211, 32 ** -0.5)
    with pytest.raises(abi.KernelIndexError):
        kern(q, k, v, table[:3], 211, 32 ** -0.5)


@pytest.mark.skipif(prefill.bf16_dot_products(), reason="this CPU has AVX512_BF16: the kernel binds")
def test_without_the_units_the_bf16_binder_says_so_once():
    """Here (no AVX512_BF16) the bf16 prompt projections run the torch formulation: the binder says
    why, and the projections leave it to the table's one line (ops.kernel_fallbacks)."""
    kern = prefill.bind_linear_bf16(torch.randn(16, 32))
    assert kern.fallback.startswith(cpu_ops.NO_UNITS) and kern.impl == "torch/linear_bf16"
    cfg = ModelConfig(**{**TINY, "head_dim": 32})
    model = LlamaModel.random(cfg, seed=1).with_ops(select_ops(torch.device("cpu"), torch.float32, prefill="bfloat16"))
    assert model.projections.kernels()["prefill torch/linear_bf16"] == 4 * cfg.num_layers
    assert model.projections.fallbacks == []


def test_projections_follow_the_weights():
    """Loading weights, moving the model and a twin with another table each bind anew."""
    cfg = ModelConfig(**{**TINY, "head_dim": 32})
    model = LlamaModel.random(cfg, seed=2)
    first = model.projections
    assert isinstance(first, Projections) and first.ops_name == "c/cpu"
    model.load_weights({k: v.clone() for k, v in model.state_dict().items()})
    assert model.projections is not first
    twin = model.with_ops(select_ops(torch.device("cpu"), torch.float32, impl="torch"))
    assert twin.projections.ops_name == "torch/cpu" and model.projections.ops_name == "c/cpu"
    assert set(twin.projections.kernels()) == {"decode linear", "prefill linear", "norm torch_rms_norm"}
