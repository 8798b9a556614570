"""torch-facing wrappers of the prefill kernels: prefill_attention.c (causal attention of a prompt
chunk over the paged pool, bf16 dot products) and gemm.c (many-row GEMMs: bf16, and int8 weights
times int8 activations). gemm.c and prefill attention's AVX512_BF16 tiles are the AVX-512 library's
(loader.py): where it did not build, the GEMMs run their torch formulations and prefill attention
its AVX2 path (the base library's).

Each checks what its kernel reads and returns None where it does not take the arguments (the
caller's torch path runs). All follow torch's intra-op thread count.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..reference import bf16_round, quantize_rows_ref
from .abi import W8A8_MAX_GROUP, Status, raise_for
from .ops import (KV_DTYPES, NO_UNITS, Kernel, _threads, bias_fits, dequantize_int8,
                  int8_group_size, loaded, loaded_avx512, traced, weight_misfit)

ISAS = ("auto", "avx2")     # prefill attention's paths: the best this CPU has, or AVX2 + FMA


def bf16_dot_products() -> bool:
    """Whether this CPU has the bf16 dot-product instructions (AVX512_BF16) the kernels use (and
    the AVX-512 library built)."""
    lib = loaded_avx512()
    return lib is not None and bool(lib.lkv_gemm_supported() & 1)


def int8_dot_products() -> bool:
    """Whether this CPU has the int8 dot-product instructions (AVX512_VNNI) the W8A8 GEMM uses (and
    the AVX-512 library built)."""
    lib = loaded_avx512()
    return lib is not None and bool(lib.lkv_gemm_supported() & 2)


def _cached(t: torch.Tensor, attr: str, key: tuple, make):
    """make() cached on tensor t under attr, rebuilt when t changes in place (its version counter)
    or `key` changes."""
    cached = getattr(t, attr, None)
    key = (t._version, t.data_ptr(), *key)
    if cached is None or cached[0] != key:
        cached = (key, make())
        setattr(t, attr, cached)
    return cached[1]


def packed_bf16(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] fp32 in lkv_gemm_bf16's panels (bf16 pairs, N padded to 64), cached on the
    tensor: half the fp32 bytes, made once per weight."""
    def make():
        N, K = weight.shape
        out = torch.empty((N + 63) // 64 * ((K + 1) // 2) * 64, dtype=torch.int32)
        w = weight.detach().contiguous()
        loaded_avx512().lkv_pack_bf16(w.data_ptr(), K, N, K, out.data_ptr(), torch.get_num_threads())
        return out
    return _cached(weight, "_lkv_bf16", (), make)


def packed_bf16_int8(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An int8 weight's dequantized values (`dequantize_int8`) in lkv_gemm_bf16's panels, cached on
    qweight (the fp32 dequantized copy is transient)."""
    def make():
        w = dequantize_int8(qweight, scale)
        N, K = w.shape
        out = torch.empty((N + 63) // 64 * ((K + 1) // 2) * 64, dtype=torch.int32)
        loaded_avx512().lkv_pack_bf16(w.data_ptr(), K, N, K, out.data_ptr(), torch.get_num_threads())
        return out
    return _cached(qweight, "_lkv_bf16", (scale.data_ptr(), scale._version), make)


def packed_bytes_bf16(n: int, k: int) -> int:
    """Bytes of `packed_bf16` of an [n, k] weight (the memory plan counts them)."""
    return (n + 63) // 64 * ((k + 1) // 2) * 64 * 4


def linear_bf16_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 GEMM's numerics in torch (machines without the kernel): x and the weight rounded to
    bf16, an fp32 GEMM over the rounded values."""
    return F.linear(bf16_round(x), bf16_round(weight), bias)


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ weight [N, K].T + bias with x and weight rounded to bf16, fp32 sums and output
    (contract: `plugins.reference.linear_bf16_ref`): one C call (gemm.c, AVX512_BF16) for fp32 CPU
    tensors, else `linear_bf16_torch`."""
    if not _bf16_takes(x, weight, weight.dtype == torch.float32, bias):
        return linear_bf16_torch(x, weight, bias)
    return _gemm_bf16(x, packed_bf16(weight), weight.shape[0], bias)


def linear_bf16_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_bf16` of an int8 weight's dequantized values (an int8 engine's bfloat16 prefill)."""
    if not _bf16_takes(x, qweight, qweight.dtype == torch.int8, bias):
        return linear_bf16_torch(x, dequantize_int8(qweight, scale), bias)
    return _gemm_bf16(x, packed_bf16_int8(qweight, scale), qweight.shape[0], bias)


def _bf16_takes(x: torch.Tensor, weight: torch.Tensor, weight_dtype_ok: bool, bias: torch.Tensor | None) -> bool:
    return (bf16_dot_products() and x.dim() == 2 and weight.dim() == 2
            and x.shape[1] == weight.shape[1] and x.dtype == torch.float32 and weight_dtype_ok
            and x.device.type == "cpu" and weight.device.type == "cpu" and x.shape[0] > 0
            and (bias is None or (bias.dtype == torch.float32 and bias.shape == (weight.shape[0],)))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def _gemm_bf16(x: torch.Tensor, packed: torch.Tensor, N: int, bias: torch.Tensor | None) -> torch.Tensor:
    lib = loaded_avx512()
    if x.stride(1) != 1:
        x = x.contiguous()
    M, K = x.shape
    y = torch.empty(M, N, dtype=torch.float32)
    with traced("linear_bf16"):
        rc = lib.lkv_gemm_bf16(x.data_ptr(), x.stride(0), M, K, packed.data_ptr(), N,
                               bias.contiguous().data_ptr() if bias is not None else None, y.data_ptr(), N,
                               torch.get_num_threads())
    if rc != 0:
        raise_for(rc, "linear_bf16")
    return y


def packed_w8a8(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(quads, scales, offset sums) of an int8 weight in lkv_gemm_w8a8's panels, cached on qweight."""
    def make():
        N, K = qweight.shape
        G = int8_group_size(qweight, scale)
        panels, ng = (N + 31) // 32, K // G
        wq = torch.empty(panels * (K // 4) * 32, dtype=torch.int32)
        wsc = torch.empty(panels * ng * 32, dtype=torch.float32)
        wsum = torch.empty(panels * ng * 32, dtype=torch.int32)
        w, s = qweight.contiguous(), scale.reshape(N, ng).contiguous()
        loaded_avx512().lkv_pack_w8a8(w.data_ptr(), s.data_ptr(), N, K, G, wq.data_ptr(), wsc.data_ptr(),
                                      wsum.data_ptr(), torch.get_num_threads())
        return wq, wsc, wsum
    return _cached(qweight, "_lkv_w8a8", (scale.data_ptr(), scale._version), make)


def packed_bytes_w8a8(n: int, k: int, group: int) -> int:
    """Bytes of `packed_w8a8` of an [n, k] int8 weight with groups of `group` inputs."""
    panels = (n + 31) // 32
    return panels * 32 * (k + 2 * 4 * (k // group))


def quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The W8A8 GEMM's activation quantization (lkv_quantize_rows), for tests: x [M, K] fp32 ->
    (q [M, K] int8, s [M, K // group] fp32), as `plugins.reference.quantize_rows_ref`. A typed
    abi.KernelError where the kernel refuses (UnsupportedISA on a CPU without AVX512_VNNI)."""
    x = x.contiguous()
    M, K = x.shape
    xq = torch.empty(M, K, dtype=torch.uint8)
    s = torch.empty(M, K // group, dtype=torch.float32)
    rc = loaded_avx512().lkv_quantize_rows(x.data_ptr(), K, M, K, group, xq.data_ptr(), s.data_ptr(),
                                           torch.get_num_threads())
    if rc != 0:
        raise_for(rc, "quantize_rows")
    return (xq.to(torch.int16) - 128).to(torch.int8), s


def w8a8_supported(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `linear_w8a8` runs these in one C call: fp32 CPU rows, an int8 [N, K] weight whose
    group G (int8_group_size) is a multiple of 4 dividing K and at most abi.W8A8_MAX_GROUP (G
    products a group sum in int32), on a CPU with AVX512_VNNI."""
    if not int8_dot_products() or x.dim() != 2 or qweight.dim() != 2:
        return False
    N, K = qweight.shape
    try:
        G = int8_group_size(qweight, scale)
    except ValueError:
        return False
    return (x.shape[1] == K and x.shape[0] > 0 and x.dtype == torch.float32 and qweight.dtype == torch.int8
            and scale.dtype == torch.float32 and G % 4 == 0 and K % G == 0 and G <= W8A8_MAX_GROUP
            and all(t.device.type == "cpu" for t in (x, qweight, scale))
            and not (torch.is_grad_enabled() and x.requires_grad))


def linear_w8a8_torch(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 numerics in torch (machines without the kernel): x quantized per row and group as
    the kernel does, dequantized, times the dequantized weight in fp32."""
    N, K = qweight.shape
    G = int8_group_size(qweight, scale)
    q, s = quantize_rows_ref(x, G)
    xd = (q.view(x.shape[0], -1, G).float() * s[..., None]).view(x.shape)
    return F.linear(xd, dequantize_int8(qweight, scale), bias)


def linear_w8a8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32, quantized to int8 per row and group of the weight's G inputs, times the int8
    weight (qweight [N, K], scale [N] or [N, K // G]) in integer dot products, scaled into fp32, +
    bias (contract: `plugins.reference.linear_w8a8_ref`): one C call (gemm.c, AVX512_VNNI) where
    `w8a8_supported`, else `linear_w8a8_torch`."""
    if not w8a8_supported(x, qweight, scale) or (bias is not None and (bias.dtype != torch.float32
                                                                      or bias.shape != (qweight.shape[0],))):
        return linear_w8a8_torch(x, qweight, scale, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    (M, K), N = x.shape, qweight.shape[0]
    G = int8_group_size(qweight, scale)
    wq, wsc, wsum = packed_w8a8(qweight, scale)
    y = torch.empty(M, N, dtype=torch.float32)
    with traced("linear_w8a8"):
        rc = loaded_avx512().lkv_gemm_w8a8(x.data_ptr(), x.stride(0), M, K, G, wq.data_ptr(), wsc.data_ptr(),
                                    wsum.data_ptr(), N, bias.contiguous().data_ptr() if bias is not None else None,
                                    y.data_ptr(), N, torch.get_num_threads())
    if rc != 0:
        raise_for(rc, "linear_w8a8")
    return y


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: list[int] | torch.Tensor,
                      context_len: int, scale: float, isa: str = "auto") -> torch.Tensor | None:
    """Causal attention of n new rows over a sequence's first `context_len` keys, read where they
    lie in one layer of the KV pool (contract: plugins/CONTRACTS.md, "Prefill attention").

    q [n, H, D] fp32, row i at position context_len - n + i; k, v [KVH, NB, bs, D] (one layer of
    the pool, contiguous, fp32 / fp16 / bf16); block_table: the sequence's blocks, in order (at
    least ceil(context_len / bs)) -> [n, H, D] fp32, or None where the kernel does not take these
    arguments. isa: "auto" (AVX512_BF16 where the CPU has it and the AVX-512 library built) or
    "avx2" (the fallback's path, the base library's)."""
    lib = loaded()
    if lib is None or q.dim() != 3 or k.dim() != 4 or isa not in ISAS:
        return None
    n, H, D = q.shape
    kvh, nb, bs, _ = k.shape
    need = -(-context_len // bs) if bs > 0 else 0
    if not (0 < n <= context_len and kvh > 0 and H % kvh == 0 and D % 16 == 0 and 0 < D <= 512
            and k.shape[3] == D and v.shape == k.shape and q.dtype == torch.float32
            and k.dtype in KV_DTYPES and v.dtype == k.dtype
            and all(t.device.type == "cpu" for t in (q, k, v)) and k.is_contiguous() and v.is_contiguous()
            and q.stride(2) == 1 and q.stride(1) == D and len(block_table) >= need
            and not (torch.is_grad_enabled() and q.requires_grad)):
        return None
    table = torch.as_tensor(block_table[:need], dtype=torch.int64)
    if need and (int(table.min()) < 0 or int(table.max()) >= nb):
        return None
    table = table.contiguous()
    out = torch.empty(n, H, D, dtype=torch.float32)
    # the AVX-512 library's tiles (None where it did not build or the CPU lacks AVX512_BF16: AVX2)
    wide = loaded_avx512() if isa == "auto" else None
    tiles = wide.lkv_prefill_bf16_tiles() if wide is not None else None
    with traced("prefill_attention"):
        rc = lib.lkv_prefill_attention(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), nb * bs * D,
                                       table.data_ptr(), bs, context_len, n, H, kvh, D, float(scale), out.data_ptr(),
                                       H * D, torch.get_num_threads(), KV_DTYPES[k.dtype], tiles)
    if rc != 0:
        raise_for(rc, "prefill_attention")
    return out


def prefill_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: list[int] | torch.Tensor,
                            context_len: int, scale: float) -> torch.Tensor:
    """`prefill_attention`'s numerics in torch (where the kernel does not take the arguments): the
    sequence's keys gathered by its table, q, K and V rounded to bf16, fp32 softmax (SDPA)."""
    n, H, D = q.shape
    kvh, _, bs, _ = k.shape
    L = context_len
    blocks = torch.as_tensor(list(block_table[: -(-L // bs)]), dtype=torch.long, device=k.device)
    kc, vc = (bf16_round(t[:, blocks].reshape(kvh, -1, D)[:, :L].float())[None] for t in (k, v))
    qh = bf16_round(q.float()).transpose(0, 1)[None]                          # [1, H, n, D]
    mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(diagonal=L - n)
    out = F.scaled_dot_product_attention(qh, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).to(q.dtype)


def prefill_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: list[int] | torch.Tensor,
                         context_len: int, scale: float) -> torch.Tensor:
    """The kernel table's bf16 prefill attention: one C call where `prefill_attention` takes the
    arguments, else `prefill_attention_torch`."""
    out = prefill_attention(q, k, v, block_table, context_len, scale)
    return out if out is not None else prefill_attention_torch(q, k, v, block_table, context_len, scale)


# ---- the prefill kernels bound at load (see ops.py, "kernels bound to one weight at load") ---------

def _bound_gemm_bf16(packed_of: Callable[[], torch.Tensor], version: Callable[[], object], N: int,
                     bias: torch.Tensor | None) -> tuple[Callable, dict]:
    lib = loaded_avx512()
    state = {"packed": packed_of(), "version": version()}
    bias_ptr = bias.contiguous().data_ptr() if bias is not None else None

    def fn(x: torch.Tensor) -> torch.Tensor:
        if version() != state["version"]:
            state["packed"], state["version"] = packed_of(), version()
        x = x if x.stride(1) == 1 else x.contiguous()
        M, K = x.shape
        y = torch.empty(M, N, dtype=torch.float32)
        with traced("linear_bf16"):
            rc = lib.lkv_gemm_bf16(x.data_ptr(), x.stride(0), M, K, state["packed"].data_ptr(), N, bias_ptr,
                                   y.data_ptr(), N, _threads())
        if rc != 0:
            raise_for(rc, "linear_bf16")
        return y
    return fn, state


def bind_linear_bf16(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Kernel:
    """A prompt's fp32 projection in bf16 dot products (gemm.c, AVX512_BF16) on its bf16 panels,
    packed now; the torch formulation (`linear_bf16_torch`, the same roundings) on a CPU
    without the units."""
    torch_fn = lambda x: linear_bf16_torch(x, weight, bias)      # noqa: E731
    why = (NO_UNITS + "AVX512_BF16 (or the AVX-512 library did not build)" if not bf16_dot_products()
           else weight_misfit(weight, torch.float32)
           or (None if bias_fits(bias, weight.shape[0]) else "a bias the kernel cannot read"))
    if why:
        return Kernel(torch_fn, "torch/linear_bf16", why)
    fn, state = _bound_gemm_bf16(lambda: packed_bf16(weight), lambda: weight._version, weight.shape[0], bias)
    return Kernel(fn, "c/gemm_bf16", None, (state["packed"],))


def bind_linear_bf16_int8(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> Kernel:
    """`bind_linear_bf16` of an int8 weight's dequantized values (its panels made now)."""
    torch_fn = lambda x: linear_bf16_torch(x, dequantize_int8(qweight, scale), bias)   # noqa: E731
    why = (NO_UNITS + "AVX512_BF16 (or the AVX-512 library did not build)" if not bf16_dot_products()
           else weight_misfit(qweight, torch.int8)
           or (None if bias_fits(bias, qweight.shape[0]) else "a bias the kernel cannot read"))
    if why:
        return Kernel(torch_fn, "torch/linear_bf16", why)
    fn, state = _bound_gemm_bf16(lambda: packed_bf16_int8(qweight, scale),
                                 lambda: (qweight._version, scale._version), qweight.shape[0], bias)
    return Kernel(fn, "c/gemm_bf16", None, (state["packed"],))


def bind_linear_w8a8(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> Kernel:
    """An int8 weight times int8 activations (gemm.c, AVX512_VNNI) on its W8A8 panels, packed now;
    the torch formulation (`linear_w8a8_torch`, the same roundings) where the CPU lacks the
    units or the weight's group is not a multiple of 4 up to abi.W8A8_MAX_GROUP."""
    torch_fn = lambda x: linear_w8a8_torch(x, qweight, scale, bias)     # noqa: E731
    why = None
    if not int8_dot_products():
        why = NO_UNITS + "AVX512_VNNI (or the AVX-512 library did not build)"
    else:
        why = weight_misfit(qweight, torch.int8) or (None if bias_fits(bias, qweight.shape[0])
                                                     else "a bias the kernel cannot read")
        if why is None:
            G = int8_group_size(qweight, scale)
            if not (G % 4 == 0 and qweight.shape[1] % G == 0 and G <= W8A8_MAX_GROUP):
                why = f"a group of {G} inputs (the kernel reads multiples of 4 up to {W8A8_MAX_GROUP})"
    if why:
        return Kernel(torch_fn, "torch/linear_w8a8", why)
    lib, (N, K) = loaded_avx512(), qweight.shape
    G = int8_group_size(qweight, scale)
    state = {"packed": packed_w8a8(qweight, scale), "version": (qweight._version, scale._version)}
    bias_ptr = bias.contiguous().data_ptr() if bias is not None else None

    def fn(x: torch.Tensor) -> torch.Tensor:
        if (qweight._version, scale._version) != state["version"]:
            state["packed"], state["version"] = packed_w8a8(qweight, scale), (qweight._version, scale._version)
        x = x if x.stride(1) == 1 else x.contiguous()
        M = x.shape[0]
        wq, wsc, wsum = state["packed"]
        y = torch.empty(M, N, dtype=torch.float32)
        with traced("linear_w8a8"):
            rc = lib.lkv_gemm_w8a8(x.data_ptr(), x.stride(0), M, K, G, wq.data_ptr(), wsc.data_ptr(), wsum.data_ptr(),
                                   N, bias_ptr, y.data_ptr(), N, _threads())
        if rc != 0:
            raise_for(rc, "linear_w8a8")
        return y
    return Kernel(fn, "c/gemm_w8a8", None, tuple(state["packed"]))


def bind_prefill_attention(pool_k: torch.Tensor, pool_v: torch.Tensor, num_heads: int) -> Kernel:
    """A prompt chunk's causal attention over this KV pool ([L, KVH, NB, bs, D] K and V, one layer
    a call): prefill_attention.c, checked against the pool's layout now; per call the block table
    is cut to the context and its ids range-checked (KernelIndexError: the kernel reads them
    unchecked). Falls back to `prefill_attention_torch` (the same bf16
    roundings) where the kernel does not take the layout."""
    torch_fn = prefill_attention_torch
    lib = loaded()
    kvh, nb, bs, D = pool_k.shape[-4:]
    why = ("the C kernels did not build" if lib is None
           else None if pool_k.device.type == "cpu" else f"a pool on {pool_k.device.type}")
    why = why or (None if pool_k.dtype in KV_DTYPES and pool_v.dtype == pool_k.dtype
                  else f"KV dtype {pool_k.dtype} (the kernel reads {', '.join(map(str, KV_DTYPES))})")
    why = why or (None if D % 16 == 0 and 0 < D <= 512 else f"head_dim {D} (the kernel reads multiples of 16 up to 512)")
    why = why or (None if kvh > 0 and num_heads % kvh == 0 else f"{num_heads} heads over {kvh} KV heads")
    why = why or (None if pool_k.is_contiguous() and pool_v.is_contiguous() and pool_v.shape == pool_k.shape
                  else "a non-contiguous pool")
    if why:
        return Kernel(torch_fn, "torch/prefill_attention", why)
    wide = loaded_avx512()
    tiles = wide.lkv_prefill_bf16_tiles() if wide is not None else None
    code, f = KV_DTYPES[pool_k.dtype], lib.lkv_prefill_attention

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table, context_len: int,
           scale: float) -> torch.Tensor:
        n, H, _ = q.shape
        q = q if q.is_contiguous() else q.contiguous()
        need = -(-context_len // bs)
        table = torch.as_tensor(block_table[:need], dtype=torch.int64).contiguous()
        if table.numel() < need or (need and (int(table.min()) < 0 or int(table.max()) >= nb)):
            raise_for(Status.RANGE, "prefill_attention", f"a block table of {table.numel()} ids in [0, {nb}) "
                      f"for {context_len} positions of {bs}")    # the kernel reads the ids unchecked
        out = torch.empty(n, H, D, dtype=torch.float32)
        with traced("prefill_attention"):
            rc = f(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), nb * bs * D, table.data_ptr(), bs,
                   context_len, n, H, kvh, D, float(scale), out.data_ptr(), H * D, _threads(), code, tiles)
        if rc != 0:
            raise_for(rc, "prefill_attention")
        return out
    return Kernel(fn, "c/prefill_attention" + ("+bf16_tiles" if tiles else ""))
