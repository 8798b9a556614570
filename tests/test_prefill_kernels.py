"""plugins/cpu's prefill kernels (prefill_attention.c, gemm.c) against their plain-torch references
on fresh random inputs, within plugins/CONTRACTS.md's tolerances ("Prefill attention", "Prefill
GEMMs"): odd lengths, GQA groups, chunk boundaries, L = n and L > n, scattered and large block
ids, every K/V storage dtype, both ISA paths (AVX512_BF16 where this CPU has it, and the AVX2
fallback on every machine); and the properties the runtime relies on (a row's output does not
depend on the chunking or the other rows of a call)."""
from __future__ import annotations

import pytest
import torch

from plugins import cpu
from plugins import reference as ref
from plugins.cpu import loader, prefill

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"plugins.cpu: {loader.unavailable_reason()}")

ISAS = ["auto", "avx2"]
BF16 = pytest.mark.skipif(not prefill.bf16_dot_products(), reason="this CPU has no AVX512_BF16 (the GEMM's units)")
VNNI = pytest.mark.skipif(not prefill.int8_dot_products(), reason="this CPU has no AVX512_VNNI (the W8A8 GEMM's units)")
# prefill attention: |out - fp64 reference| <= ATOL * max|V| (bf16 inputs: 2^-9 relative each)
ATOL = 2e-2


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def pool_case(n, L, H, KVH, D, bs, dtype=torch.float32, seed=0, extra_blocks=7, scatter=True, big=False):
    """q [n, H, D], one pool layer k/v [KVH, NB, bs, D] in `dtype`, the sequence's block table."""
    g = _gen(seed)
    need = -(-L // bs)
    nb = need + extra_blocks
    k = torch.randn(KVH, nb, bs, D, generator=g).to(dtype)
    v = torch.randn(KVH, nb, bs, D, generator=g).to(dtype)
    table = torch.randperm(nb, generator=g)[:need].tolist() if scatter else list(range(need))
    if big:                      # block ids past 2**20: a table that indexes a large pool
        pad = 1 << 20
        # the blocks below the table's are left unwritten (never touched, so never paged in: GBs
        # of zeros cost ~25 s here); a kernel that read one would read garbage and fail the check
        big_k, big_v = (torch.empty(KVH, pad + nb, bs, D, dtype=dtype) for _ in range(2))
        big_k[:, pad:], big_v[:, pad:] = k, v
        k, v = big_k, big_v
        table = [b + pad for b in table]
    q = torch.randn(n, H, D, generator=g)
    return q, k, v, table


def check_attention(q, k, v, table, L, isa):
    D = q.shape[-1]
    out = prefill.prefill_attention(q, k, v, table, L, D ** -0.5, isa)
    assert out is not None
    want = ref.prefill_attention_ref(q, k.float(), v.float(), table, L, D ** -0.5)
    read = v[:, table[: -(-L // v.shape[2])]]           # the blocks a context of L reads (no others)
    torch.testing.assert_close(out, want, atol=ATOL * float(read.float().abs().max()), rtol=0)
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n,L", [(1, 1), (5, 5), (17, 17), (64, 64), (65, 65), (100, 300), (3, 130), (129, 129),
                                 (200, 777), (1, 1000)])
def test_prefill_attention_matches_reference(isa, n, L):
    q, k, v, table = pool_case(n, L, H=9, KVH=3, D=64, bs=16, seed=n * 1000 + L)
    check_attention(q, k, v, table, L, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("H,KVH,D,bs", [(8, 8, 64, 16), (32, 4, 128, 16), (4, 1, 16, 4), (14, 2, 64, 32),
                                        (6, 2, 48, 8), (30, 1, 32, 16)])
def test_prefill_attention_gqa_and_shapes(isa, H, KVH, D, bs):
    q, k, v, table = pool_case(37, 211, H, KVH, D, bs, seed=H * 7 + D)
    check_attention(q, k, v, table, 211, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_attention_reads_16_bit_pools(isa, dtype):
    q, k, v, table = pool_case(70, 333, 9, 3, 64, 16, dtype=dtype, seed=3)
    check_attention(q, k, v, table, 333, isa)


def test_prefill_attention_large_block_ids():
    q, k, v, table = pool_case(20, 100, 4, 2, 16, 16, seed=4, big=True)
    assert max(table) >= 1 << 20
    for isa in ISAS:
        check_attention(q, k, v, table, 100, isa)


@pytest.mark.parametrize("isa", ISAS)
def test_prefill_attention_row_does_not_depend_on_the_chunking(isa):
    """A row's output is the same bits whether its prompt ran as one chunk or several (key tiles at
    fixed positions, no dependence on the other rows of a call)."""
    L = 700
    q, k, v, table = pool_case(L, L, 9, 3, 64, 16, seed=5)
    whole = prefill.prefill_attention(q, k, v, table, L, 0.125, isa)
    for bounds in ([0, 100, 333, 700], [0, 1, 2, 64, 65, 700], [0, 699, 700]):
        parts = [prefill.prefill_attention(q[a:b], k, v, table, b, 0.125, isa) for a, b in zip(bounds, bounds[1:])]
        assert torch.equal(torch.cat(parts), whole), bounds


def test_both_isa_paths_agree():
    q, k, v, table = pool_case(90, 400, 9, 3, 64, 16, seed=6)
    a = prefill.prefill_attention(q, k, v, table, 400, 0.125, "auto")
    b = prefill.prefill_attention(q, k, v, table, 400, 0.125, "avx2")
    torch.testing.assert_close(a, b, atol=1e-3, rtol=0)


def test_prefill_attention_refuses_what_it_does_not_read():
    q, k, v, table = pool_case(4, 40, 4, 2, 16, 16, seed=7)
    assert prefill.prefill_attention(q, k, v, table[:1], 40, 0.25) is None           # table too short
    assert prefill.prefill_attention(q, k, v, [table[0], 10 ** 6, *table[2:]], 40, 0.25) is None   # id out of range
    assert prefill.prefill_attention(q[:, :3], k, v, table, 40, 0.25) is None        # H % KVH
    assert prefill.prefill_attention(q.double(), k, v, table, 40, 0.25) is None      # q dtype
    assert prefill.prefill_attention(q, k, v, table, 3, 0.25) is None                # n > L
    qq, kk, vv, tt = pool_case(4, 40, 4, 2, 24, 16, seed=8)                           # D % 16
    assert prefill.prefill_attention(qq, kk, vv, tt, 40, 0.25) is None
    # the table's entry falls back to the torch formulation there, within the same tolerance
    out = prefill.prefill_attention_op(qq, kk, vv, tt, 40, 24 ** -0.5)
    torch.testing.assert_close(out, ref.prefill_attention_ref(qq, kk, vv, tt, 40, 24 ** -0.5),
                               atol=ATOL * float(vv.abs().max()), rtol=0)


def test_prefill_attention_torch_formulation_matches_reference():
    q, k, v, table = pool_case(33, 150, 6, 2, 32, 8, dtype=torch.float16, seed=9)
    out = prefill.prefill_attention_torch(q, k, v, table, 150, 32 ** -0.5)
    torch.testing.assert_close(out, ref.prefill_attention_ref(q, k.float(), v.float(), table, 150, 32 ** -0.5),
                               atol=ATOL * float(v.float().abs().max()), rtol=0)


def test_the_reference_is_the_fp32_attention_it_replaces():
    """The reference itself (fp64) equals runtime.attention_dense.prefill_attention (fp32 SDPA)."""
    from runtime.attention_dense import prefill_attention
    q, k, v, table = pool_case(30, 90, 6, 2, 16, 16, seed=10)
    kc = k[:, table].reshape(2, -1, 16)[:, :90]
    vc = v[:, table].reshape(2, -1, 16)[:, :90]
    torch.testing.assert_close(ref.prefill_attention_ref(q, k, v, table, 90, 0.25), prefill_attention(q, kc, vc),
                               atol=1e-5, rtol=1e-5)


# ---- GEMMs ----------------------------------------------------------------------------------------

SHAPES = [(1, 576, 960), (7, 576, 960), (513, 576, 3072), (100, 1536, 576), (33, 64, 70), (5, 10, 3), (2, 17, 65)]


@BF16
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_linear_bf16_matches_reference(M, K, N):
    g = _gen(M * 31 + N)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / K ** 0.5, torch.randn(N, generator=g)
    for bias in (None, b):
        want = ref.linear_bf16_ref(x, w, bias)
        torch.testing.assert_close(prefill.linear_bf16(x, w, bias), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(prefill.linear_bf16_torch(x, w, bias), want, atol=1e-5, rtol=1e-5)
    # strided rows, and a row alone gives the same bits as inside a bigger call
    xs = torch.randn(M, K + 3, generator=g)[:, 1:K + 1]
    torch.testing.assert_close(prefill.linear_bf16(xs, w), ref.linear_bf16_ref(xs, w), atol=1e-5, rtol=1e-5)
    whole = prefill.linear_bf16(x, w, b)
    assert torch.equal(prefill.linear_bf16(x[-1:], w, b), whole[-1:])


@BF16
def test_linear_bf16_repacks_a_weight_changed_in_place():
    g = _gen(11)
    x, w = torch.randn(9, 64, generator=g), torch.randn(32, 64, generator=g)
    prefill.linear_bf16(x, w)
    w.mul_(2)
    torch.testing.assert_close(prefill.linear_bf16(x, w), ref.linear_bf16_ref(x, w), atol=1e-5, rtol=1e-5)


@VNNI
@pytest.mark.parametrize("M,K,N", SHAPES[:5])
@pytest.mark.parametrize("G", [64, 16, 0])
def test_linear_w8a8_matches_reference(M, K, N, G):
    G = G or K
    if K % G:
        pytest.skip("G does not divide K")
    g = _gen(M * 7 + K + G)
    x = torch.randn(M, K, generator=g) * 3
    w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    s = torch.rand(N, K // G, generator=g) * 0.01 + 1e-4
    if G == K:
        s = s[:, 0].contiguous()                    # one scale per output channel: [N]
    b = torch.randn(N, generator=g)
    for bias in (None, b):
        want = ref.linear_w8a8_ref(x, w, s, bias)
        tol = 2e-6 * float(want.abs().max())
        torch.testing.assert_close(prefill.linear_w8a8(x, w, s, bias), want, atol=tol, rtol=0)
        torch.testing.assert_close(prefill.linear_w8a8_torch(x, w, s, bias), want, atol=4 * tol, rtol=0)
    assert torch.equal(prefill.linear_w8a8(x[-1:], w, s, b), prefill.linear_w8a8(x, w, s, b)[-1:])


@VNNI
@pytest.mark.parametrize("G", [64, 16, 576])
def test_activation_quantization_is_exactly_the_reference(G):
    g = _gen(G)
    x = torch.randn(37, 576, generator=g) * torch.logspace(-3, 2, 576)           # outlier channels
    x[3, :G] = 0                                                                  # an all-zero group
    x[5, 7] = 1e30
    q, s = prefill.quantize_rows(x, G)
    qr, sr = ref.quantize_rows_ref(x, G)
    assert torch.equal(q, qr) and torch.equal(s, sr)
    assert s[3, 0] == 1 and (q[3, :G] == 0).all()


@VNNI
def test_linear_w8a8_large_values_do_not_overflow():
    """int32 sums of a whole group at the extremes (127 x 255 x G) stay exact."""
    N, K = 64, 1536
    x = torch.full((3, K), 5.0)
    w = torch.full((N, K), 127, dtype=torch.int8)
    s = torch.full((N, K // 64), 1e-3)
    torch.testing.assert_close(prefill.linear_w8a8(x, w, s), ref.linear_w8a8_ref(x, w, s), atol=1e-3, rtol=1e-6)


def test_w8a8_falls_back_where_the_kernel_does_not_apply():
    g = _gen(12)
    x = torch.randn(4, 24, generator=g)
    w = torch.randint(-127, 128, (8, 24), generator=g, dtype=torch.int8)
    s = torch.rand(8, 4, generator=g) * 0.01                                      # G = 6: not a multiple of 4
    assert not prefill.w8a8_supported(x, w, s)
    torch.testing.assert_close(prefill.linear_w8a8(x, w, s), ref.linear_w8a8_ref(x, w, s), atol=1e-5, rtol=1e-5)
