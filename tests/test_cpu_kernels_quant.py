"""plugins/cpu's reduced-precision paths against the references on fresh random inputs: the
weight-only int8 linear (linear_int8.c, with a scale per output channel or per group of inputs,
and its chunked-dequantization fallback), attention over fp16 / bf16 K/V (attention.c, both
entries, and the torch paths of plugins/attention.py), and fp16 / bf16 keys folded into fp32
block summaries."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import plugins
from plugins import attention as attention_mod
from plugins import cpu
from plugins import reference as ref
from plugins.attention import _attention_math
from plugins.cpu import loader, ops

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"plugins.cpu: {loader.unavailable_reason()}")

HALF = [torch.float16, torch.bfloat16]
# int8 linear: fp32 sums of K products against the fp64 reference (outputs ~ sqrt(K) here)
INT8_TOL = dict(atol=1e-4, rtol=1e-5)
# attention over 16-bit K/V: the fp32 math on the widened values, so fp32's tolerance (as
# tests/test_cpu_kernels.py), against a reference that widens the same stored values
ATT_TOL = dict(atol=2e-5, rtol=1e-5)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _int8_inputs(g, M, N, K):
    x = torch.randn(M, K, generator=g)
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)      # -128 included
    scale = (torch.rand(N, generator=g) + 0.5) / 127
    bias = torch.randn(N, generator=g)
    return x, q, scale, bias


def _no_torch_path(monkeypatch):
    """Fail if linear_int8 leaves the C kernel for its torch path."""
    def fail(*a, **kw):
        raise AssertionError("linear_int8 took the torch path")
    monkeypatch.setattr(ops, "_linear_int8_torch", fail)


# ---------------------------------------------------------------- int8 x fp32 linear

@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 16])
@pytest.mark.parametrize("n_out,n_in", [(1728, 576), (577, 100), (1, 8), (6, 3), (13, 31), (40, 70), (49, 1536),
                                        (9, 33)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_int8_kernel_matches_reference(rows, n_out, n_in, threads, monkeypatch):
    g = _gen(rows * 1000 + n_out + n_in)
    _check_kernel_against_reference(*_int8_inputs(g, rows, n_out, n_in), threads, monkeypatch)


def _check_kernel_against_reference(x, q, scale, bias, threads, monkeypatch):
    """The C kernel (the torch path barred), with and without a bias, against linear_int8_ref."""
    torch.set_num_threads(threads)
    _no_torch_path(monkeypatch)
    for b in (None, bias):
        y = cpu.linear_int8(x, q, scale, b)
        assert y.shape == (x.shape[0], q.shape[0]) and y.dtype == torch.float32
        torch.testing.assert_close(y, ref.linear_int8_ref(x, q, scale, b), **INT8_TOL)


def test_linear_int8_kernel_rows_do_not_depend_on_the_batch_or_threads(monkeypatch):
    # every output's sum runs in one order whatever M, the tile shape or the thread split
    # (linear_int8.c): a row alone gives the same bits as in any batch
    _check_rows_independent(*_int8_inputs(_gen(7), 16, 203, 200), monkeypatch)


def _check_rows_independent(x, q, scale, bias, monkeypatch):
    """Each of x's 16 rows alone gives the bits it gives in the first m rows, at 1-3 threads."""
    _no_torch_path(monkeypatch)
    torch.set_num_threads(1)
    alone = torch.cat([cpu.linear_int8(x[i:i + 1], q, scale, bias) for i in range(16)])
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        for m in (2, 3, 4, 5, 9, 16):
            assert torch.equal(cpu.linear_int8(x[:m], q, scale, bias), alone[:m]), (threads, m)


def test_linear_int8_takes_strided_inputs(monkeypatch):
    g = _gen(8)
    x, q, scale, bias = _int8_inputs(g, 3, 48, 64)
    expected = ref.linear_int8_ref(x, q, scale, bias)
    _no_torch_path(monkeypatch)
    xs = torch.randn(3, 80, generator=g)
    xs[:, 5:69] = x
    qt = q.t().contiguous().t()                                   # [N, K] with strides (1, N)
    torch.testing.assert_close(cpu.linear_int8(xs[:, 5:69], qt, scale[None].expand(2, -1)[0], bias),
                               expected, **INT8_TOL)


@pytest.mark.parametrize("rows", [17, 40, 130])
@pytest.mark.parametrize("n_out,n_in", [(50, 24), (3072, 576), (7, 9)])
def test_linear_int8_many_rows_dequantize_in_chunks(rows, n_out, n_in, monkeypatch):
    # above MAX_INT8_ROWS: the weight dequantized a chunk at a time into F.linear; a small chunk
    # here, so that the chunks (and a short last one) are exercised
    g = _gen(rows + n_out)
    x, q, scale, bias = _int8_inputs(g, rows, n_out, n_in)
    monkeypatch.setattr(ops, "DEQUANT_CHUNK_BYTES", 4 * n_in * 16)                    # 16 rows a chunk
    for b in (None, bias):
        torch.testing.assert_close(cpu.linear_int8(x, q, scale, b), ref.linear_int8_ref(x, q, scale, b),
                                   **INT8_TOL)


def test_linear_int8_falls_back_where_the_kernel_does_not_apply():
    g = _gen(9)
    x, q, scale, bias = _int8_inputs(g, 2, 40, 24)
    x3 = torch.randn(2, 3, 24, generator=g)                                            # 3-D
    torch.testing.assert_close(cpu.linear_int8(x3, q, scale, bias),
                               ref.linear_int8_ref(x3.reshape(6, 24), q, scale, bias).reshape(2, 3, 40), **INT8_TOL)
    torch.testing.assert_close(cpu.linear_int8(x, q, scale.double(), bias),            # fp64 scale
                               ref.linear_int8_ref(x, q, scale, bias), **INT8_TOL)
    xg = x.clone().requires_grad_(True)
    cpu.linear_int8(xg, q, scale).sum().backward()                                      # autograd intact
    torch.testing.assert_close(xg.grad, (q.float() * scale[:, None]).sum(0).expand(2, -1), **INT8_TOL)
    with pytest.raises(RuntimeError):
        cpu.linear_int8(torch.randn(2, 23), q, scale)                                   # torch's shape error


# ---------------------------------------------------------------- int8 x fp32 linear, a scale per group

def _grouped_inputs(g, M, N, K, G):
    x, q, _, bias = _int8_inputs(g, M, N, K)
    scale = (torch.rand(N, K // G, generator=g) + 0.5) / 127 * torch.rand(N, 1, generator=g).add(0.1) * 4
    return x, q, scale, bias


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("n_out,n_in,group", [(576, 576, 64), (960, 576, 32), (577, 1536, 64), (13, 64, 32),
                                              (1, 64, 8), (6, 128, 64), (40, 96, 32), (49, 1536, 1536),
                                              (3072, 576, 576)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_int8_grouped_kernel_matches_reference(rows, n_out, n_in, group, threads, monkeypatch):
    g = _gen(rows * 1000 + n_out + n_in + group)
    _check_kernel_against_reference(*_grouped_inputs(g, rows, n_out, n_in, group), threads, monkeypatch)


def test_linear_int8_one_group_of_k_is_the_per_channel_kernel(monkeypatch):
    # scale [N, 1] (G = K) runs the per-channel code path: the same bits as scale [N]
    g = _gen(3)
    x, q, scale, bias = _int8_inputs(g, 5, 70, 100)                 # K % 8 != 0: the tail too
    _no_torch_path(monkeypatch)
    assert torch.equal(cpu.linear_int8(x, q, scale[:, None], bias), cpu.linear_int8(x, q, scale, bias))


def test_linear_int8_grouped_rows_do_not_depend_on_the_batch_or_threads(monkeypatch):
    _check_rows_independent(*_grouped_inputs(_gen(17), 16, 203, 256, 64), monkeypatch)


def test_linear_int8_grouped_large_output_index(monkeypatch):
    # the tied LM head's shape: offsets n * K and n * (K / G) past 2^24 elements
    g = _gen(23)
    x, q, scale, _ = _grouped_inputs(g, 2, 49152, 576, 64)
    _no_torch_path(monkeypatch)
    y = cpu.linear_int8(x, q, scale)
    tail = slice(49152 - 300, 49152)
    torch.testing.assert_close(y[:, tail], ref.linear_int8_ref(x, q[tail], scale[tail]), **INT8_TOL)
    torch.testing.assert_close(y[:, :300], ref.linear_int8_ref(x, q[:300], scale[:300]), **INT8_TOL)


@pytest.mark.parametrize("rows", [3, 17, 40])
@pytest.mark.parametrize("n_out,n_in,group", [(50, 48, 16), (3072, 576, 64), (7, 36, 12), (9, 36, 4)])
def test_linear_int8_grouped_many_rows_and_odd_groups(rows, n_out, n_in, group, monkeypatch):
    # above MAX_INT8_ROWS: the torch path (chunks of 16 rows here); and at any row count for a
    # group the kernel does not take (not a multiple of 8: eight weights would straddle groups)
    g = _gen(rows + n_out + group)
    x, q, scale, bias = _grouped_inputs(g, rows, n_out, n_in, group)
    monkeypatch.setattr(ops, "DEQUANT_CHUNK_BYTES", 4 * n_in * 16)
    if group % 8:
        assert ops.int8_kernel_group(q, scale) is None
    for b in (None, bias):
        torch.testing.assert_close(cpu.linear_int8(x, q, scale, b), ref.linear_int8_ref(x, q, scale, b), **INT8_TOL)
    torch.testing.assert_close(ops.dequantize_int8(q, scale), q.float() * scale.repeat_interleave(group, 1), rtol=0,
                               atol=0)


def test_linear_int8_refuses_a_scale_of_no_layout():
    g = _gen(31)
    x, q, _, _ = _int8_inputs(g, 2, 40, 96)
    for bad in ((40, 5), (40, 192), (39,), (39, 3), (40, 3, 32), (40, 0)):
        for m in (2, 20):                                  # the kernel's rows and the torch path's
            with pytest.raises(ValueError, match=r"^scale: expected \[N\] or \[N, K // G\]"):
                cpu.linear_int8(torch.randn(m, 96, generator=g), q, torch.ones(bad))


# ---------------------------------------------------------------- fp16 / bf16 K/V attention

def _device_tier(g, B, KVH, slots, D, used, dtype):
    """K/V as the runtime passes them, stored in `dtype`: a [:B, :, :used] view of a larger buffer."""
    k = torch.randn(B + 1, KVH, slots, D, generator=g).to(dtype)
    v = torch.randn(B + 1, KVH, slots, D, generator=g).to(dtype)
    return k[:B, :, :used], v[:B, :, :used]


def _attention_args(seed, B, R, H, KVH, D, used, E, dtype, extra_dtype):
    g = _gen(seed)
    q = torch.randn(B, R, H, D, generator=g)
    k, v = _device_tier(g, B, KVH, used + 16, D, used, dtype)
    kv_mask = torch.rand(B, KVH, used, generator=g) < 0.5
    kv_mask[0, 0] = False                                     # a head that selected nothing
    qkv = torch.randn(B * R, 3 * KVH * D + 5, generator=g).to(extra_dtype)
    kx = qkv[:, :KVH * D].reshape(B, R, KVH, D)[:, :E].transpose(1, 2)
    vx = qkv[:, 2 * KVH * D + 5:].reshape(B, R, KVH, D)[:, :E].transpose(1, 2)
    extra_mask = torch.ones(R, E, dtype=torch.bool).tril().expand(B, R, E).contiguous()
    if E:
        extra_mask[-1, 0] = False
    return q, k, v, kv_mask, kx, vx, extra_mask, D ** -0.5


def _widened(args):
    """The same call with every K/V tensor widened to fp32 (what the 16-bit paths must equal)."""
    q, k, v, kv_mask, kx, vx, extra_mask, scale = args
    return q, k.float(), v.float(), kv_mask, kx.float(), vx.float(), extra_mask, scale


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("extras", ["fp32", "kv"])
@pytest.mark.parametrize("B,R,H,KVH,D,used,E", [(4, 2, 9, 3, 64, 300, 2), (2, 1, 32, 8, 128, 77, 1),
                                                 (1, 2, 4, 4, 32, 9, 2), (3, 2, 64, 2, 64, 40, 0)])
def test_attention_16bit_kv_matches_reference(dtype, extras, B, R, H, KVH, D, used, E):
    args = _attention_args(B * 100 + used, B, R, H, KVH, D, used, E, dtype,
                           torch.float32 if extras == "fp32" else dtype)
    q, k, v, kv_mask, kx, vx, extra_mask, scale = args
    assert cpu.attention_supported(q, k, v, kx, vx, kv_mask, extra_mask)
    out = cpu.attention(*args)
    assert out.dtype == torch.float32
    expected = ref.lookahead_attention_ref(*args)
    torch.testing.assert_close(out, expected, **ATT_TOL)
    # widening happens at the load: the same bits as the fp32 kernel on the widened values
    assert torch.equal(out, cpu.attention(*_widened(args)))
    torch.testing.assert_close(plugins.lookahead_attention(*args), expected, **ATT_TOL)   # the op, checked


@pytest.mark.parametrize("dtype", HALF)
def test_attention_torch_paths_take_16bit_kv(dtype):
    # the torch table's op (torch's flash attention where it has one) and the plain matmuls it
    # falls back to widen the stored K/V and agree with the reference; so does the C table's
    # entry where the kernel does not take the shape (D % 32 != 0 below)
    for shape in ((3, 2, 9, 3, 64, 50, 2), (2, 2, 4, 2, 16, 20, 1)):
        args = _attention_args(sum(shape), *shape, dtype, torch.float32)
        expected = ref.lookahead_attention_ref(*args)
        torch.testing.assert_close(attention_mod._lookahead_attention_impl(*args), expected, **ATT_TOL)
        torch.testing.assert_close(_attention_math(*args), expected, **ATT_TOL)
        torch.testing.assert_close(plugins.lookahead_attention(*args), expected, **ATT_TOL)
        torch.testing.assert_close(cpu.ops.lookahead_attention_op(*args), expected, **ATT_TOL)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("case", ["random", "first range empty", "nothing visible"])
def test_attention_16bit_kv_split_over_key_ranges(dtype, threads, case):
    g = _gen(threads * 10 + len(case))
    B, R, H, KVH, D, N, E = 1, 2, 9, 3, 64, 1500, 2
    q = torch.randn(B, R, H, D, generator=g)
    k, v = _device_tier(g, B, KVH, N + 16, D, N, dtype)
    kv_mask = torch.rand(B, KVH, N, generator=g) < 0.7
    kx, vx = torch.randn(B, KVH, E, D, generator=g), torch.randn(B, KVH, E, D, generator=g)
    extra_mask = torch.ones(B, R, E, dtype=torch.bool).tril()
    if case == "first range empty":
        kv_mask[..., :800] = False
    elif case == "nothing visible":
        kv_mask[:], extra_mask[:] = False, False
    args = (q, k, v, kv_mask, kx, vx, extra_mask, D ** -0.5)
    torch.set_num_threads(threads)
    out = cpu.attention(*args)
    torch.testing.assert_close(out, _attention_math(*_widened(args)), **ATT_TOL)
    assert torch.equal(out, cpu.attention(*_widened(args)))
    if case == "nothing visible":
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_paged_16bit_pool_matches_torch(dtype, threads):
    g = _gen(60 + threads)
    KVH, H, D, bs, nb = 3, 9, 64, 16, 90
    pool_k = torch.randn(KVH, nb, bs, D, generator=g).to(dtype)
    pool_v = torch.randn(KVH, nb, bs, D, generator=g).to(dtype)
    starts, lens = [3, 40, 0, 70], [600, 17, 1, 320]
    q = torch.randn(len(lens), H, D, generator=g)
    torch.set_num_threads(threads)
    out = cpu.attention_paged(q, pool_k, pool_v, starts, lens, D ** -0.5)
    assert out.dtype == torch.float32
    assert torch.equal(out, cpu.attention_paged(q, pool_k.float(), pool_v.float(), starts, lens, D ** -0.5))
    for b, (s, n) in enumerate(zip(starts, lens)):
        k = pool_k[:, s:].reshape(KVH, -1, D)[:, :n].float()
        v = pool_v[:, s:].reshape(KVH, -1, D)[:, :n].float()
        expected = F.scaled_dot_product_attention(q[b][None, :, None], k[None], v[None], scale=D ** -0.5,
                                                  enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[b], expected, **ATT_TOL)
    assert cpu.attention_paged(q, pool_k, pool_v.float(), starts, lens, 0.125) is None     # K, V differ
    assert cpu.attention_paged(q.half(), pool_k, pool_v, starts, lens, 0.125) is None       # q not fp32


def test_attention_16bit_kv_unsupported_combinations_go_to_torch():
    g = _gen(12)
    q = torch.randn(2, 2, 6, 64, generator=g)
    k16 = torch.randn(2, 3, 20, 64, generator=g).half()
    x32 = torch.randn(2, 3, 2, 64, generator=g)
    assert cpu.attention_supported(q, k16, k16, x32, x32)                                   # fp32 extras
    assert cpu.attention_supported(q, k16, k16, x32.half(), x32.half())                     # extras as K
    assert not cpu.attention_supported(q, k16, k16.bfloat16(), x32, x32)                 # K and V differ
    assert not cpu.attention_supported(q, k16, k16, x32.bfloat16(), x32.bfloat16())       # extras neither
    assert not cpu.attention_supported(q.half(), k16, k16, x32.half(), x32.half())        # q not fp32
    assert not cpu.attention_supported(q, k16.double(), k16.double(), x32, x32)


def test_lookahead_attention_wrapper_takes_16bit_storage_under_fp32_q_only():
    args = list(_attention_args(5, 2, 2, 6, 2, 32, 12, 2, torch.float16, torch.float32))
    plugins.lookahead_attention(*args)                                                   # mixed: accepted
    q, k, v = args[:3]
    for bad, arg in (((q.half(), k.float(), v.float()), "k"),          # 32-bit K/V under a 16-bit q
                     ((q, k, v.float()), "k"),                        # K and V stored differently
                     ((q, k.float(), v), "v"),
                     ((q, k, v.bfloat16()), "v"),
                     ((q.bfloat16(), k, v), "k")):                     # fp16 under a bf16 q
        with pytest.raises(ValueError, match=rf"^{arg}: "):
            plugins.lookahead_attention(*bad, *args[3:])
    with pytest.raises(ValueError, match=r"^k_extra: "):
        plugins.lookahead_attention(*args[:4], args[4].bfloat16(), args[5].bfloat16(), *args[6:])


# ---------------------------------------------------------------- summaries from 16-bit keys

@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("T", [1, 8, 40])
def test_update_summaries_folds_16bit_keys_exactly(dtype, T):
    # fp32 summaries, keys as a 16-bit cache stores them: widening is exact, so the result is the
    # reference's bit for bit and the same as folding the widened keys
    g = _gen(T)
    num_blocks, KVH, D = 64, 3, 16
    kmin = torch.randn(num_blocks, KVH, D, generator=g)
    kmax = kmin + torch.randn(num_blocks, KVH, D, generator=g).abs()
    keys = torch.randn(T, KVH, D, generator=g).to(dtype)
    if T == 8:                                                 # one key per block (a decode step)
        ids = torch.randperm(num_blocks, generator=g)[:T]
    else:                                                      # many per block, resets among them (prefill)
        ids = torch.randint(0, 5, (T,), generator=g)
    offsets = torch.randint(0, 3, (T,), generator=g)
    expected = kmin.clone(), kmax.clone()
    ref.update_summaries_ref(*expected, keys, ids, offsets)
    widened = kmin.clone(), kmax.clone()
    plugins.update_summaries(*widened, keys.float(), ids, offsets)
    for fn in (plugins.update_summaries, plugins.direct.update_summaries, torch.ops.lookahead.update_summaries):
        got = kmin.clone(), kmax.clone()
        fn(*got, keys, ids, offsets)
        assert got[0].dtype == torch.float32
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert torch.equal(got[0], widened[0]) and torch.equal(got[1], widened[1])
    assert not torch.equal(expected[0], kmin)                  # it wrote


def test_update_summaries_rejects_narrowing_keys():
    s16 = torch.randn(4, 1, 8).half()
    with pytest.raises(ValueError, match=r"^keys: "):          # fp32 keys into fp16 summaries would round
        plugins.update_summaries(s16, s16.clone(), torch.randn(1, 1, 8), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"^keys: "):
        plugins.update_summaries(s16.bfloat16(), s16.bfloat16(), torch.randn(1, 1, 8).half(), torch.tensor([0]),
                                 torch.tensor([0]))


# ---------------------------------------------------------------- loader

def test_loader_requires_f16c():
    assert "f16c" in loader.refusal("x86_64", {"avx2", "fma"})
    assert loader.refusal("x86_64", {"avx2", "fma", "f16c"}) is None
    assert "aarch64" in loader.refusal("aarch64", {"avx2", "fma", "f16c"})
    assert "-mf16c" in loader.FLAGS
