"""torch-facing wrappers of linear.c, linear_int8.c, attention.c and topk.c: each checks what its
kernel assumes.

The kernel table's C entries (runtime/ops.py) `linear`, `linear_int8`, `rms_norm`, `block_topk_op`
and `lookahead_attention_op` run their kernel where the arguments are what it reads (`*_supported`)
and the torch formulation where not; `attention_paged` returns None there (its caller's torch path
runs). These checked entries serve tests, scripts and the `checked` table: an engine binds each to
its weights or its pool at load (`bind_*` below; runtime/projections.py), and a bound kernel
decides nothing per call. All follow torch's intra-op thread count.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch._C._autograd import _profiler_enabled

from .._common import fail
from ..attention import _lookahead_attention_impl
from ..summaries import _update_summaries_impl
from ..topk import _block_topk_impl
from . import abi
from .abi import raise_for
from .loader import LOADED, avx512_library, library

MAX_LINEAR_ROWS = 16       # above this BLAS's own GEMM is as good (scripts/bench_kernels.py)
MAX_INT8_ROWS = 16         # linear_int8: the C kernel up to here, chunked dequantization + BLAS above
DEQUANT_CHUNK_BYTES = 1 << 20   # fp32 bytes of weight dequantized at a time by linear_int8's torch path
MAX_EXTRA_KEYS = abi.MAX_EXTRA_KEYS     # attention.c keeps an extra key's score on the stack
MAX_GROUP_ROWS = abi.MAX_GROUP_ROWS     # R * H / KVH query rows per KV head, likewise


def available() -> bool:
    return library() is not None


def loaded():
    """The built base library, or None: `library()` without its lock once it has answered (every
    kernel call asks)."""
    return LOADED.get("lib") or library()


def loaded_avx512():
    """The AVX-512 library (prefill GEMMs, W8A8, bf16 prefill attention), or None, as `loaded`."""
    return LOADED.get("avx512") or avx512_library()


def traced(name: str):
    """A torch.profiler range named `lookahead_cpu::<name>` while a profiler runs (the ctypes calls
    are invisible to it otherwise); a no-op context (~0.1 us) when none does."""
    return torch.profiler.record_function(f"lookahead_cpu::{name}") if _profiler_enabled() \
        else contextlib.nullcontext()


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] packed as [N/8, K, 8] for lkv_linear_packed (N % 8 == 0), cached on the
    tensor and rebuilt when it changes in place (its version counter) or is replaced; None if
    the shape does not fit. The cache holds a second copy of every weight used for decoding."""
    if weight.dim() != 2 or weight.shape[0] % 8:
        return None
    cached = getattr(weight, "_lkv_packed", None)
    key = (weight._version, weight.data_ptr())
    if cached is None or cached[0] != key:
        with torch.no_grad():
            packed = weight.detach().reshape(weight.shape[0] // 8, 8, weight.shape[1]).transpose(1, 2).contiguous()
        cached = (key, packed)
        weight._lkv_packed = cached
    return cached[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`; for 2-D fp32 CPU inputs of at most MAX_LINEAR_ROWS rows whose weight packs
    (N % 8 == 0, see `packed_weight`), through the C kernel."""
    lib = loaded()
    if (lib is None or x.dim() != 2 or not 0 < x.shape[0] <= MAX_LINEAR_ROWS or x.dtype != torch.float32
            or weight.dtype != torch.float32 or x.device.type != "cpu" or weight.device.type != "cpu"
            or weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.shape[0] % 8
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (weight.shape[0],)))
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)            # including torch's own shape errors
    x, packed = x.contiguous(), packed_weight(weight)
    (M, K), N = x.shape, weight.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    with traced("linear"):
        lib.lkv_linear_packed(x.data_ptr(), M, K, packed.data_ptr(), N,
                              bias.contiguous().data_ptr() if bias is not None else None, y.data_ptr(),
                              torch.get_num_threads())
    return y


def int8_group_size(qweight: torch.Tensor, scale: torch.Tensor) -> int:
    """G, the inputs per scale of a weight-only int8 matrix: qweight [N, K] with scale [N] (one per
    output channel: G = K) or [N, K // G] (one per group of G consecutive inputs; [N, 1]: G = K).
    ValueError naming `scale` when its shape fits neither."""
    if qweight.dim() != 2:
        raise ValueError(f"qweight: expected [N, K], got shape {list(qweight.shape)}")
    N, K = qweight.shape
    if scale.dim() == 1 and scale.shape[0] == N:
        return K
    if scale.dim() == 2 and scale.shape[0] == N and scale.shape[1] > 0 and K % scale.shape[1] == 0:
        return K // scale.shape[1]
    raise ValueError(f"scale: expected [N] or [N, K // G] with G dividing K for qweight [N, K] = {[N, K]}, "
                     f"got shape {list(scale.shape)}")


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] in `dtype`: W[n, k] = qweight[n, k] * scale[n, k // G] (one rounding; scale as in
    `int8_group_size`). What the torch paths and the int8 modules compute with."""
    G = int8_group_size(qweight, scale)
    w, s = qweight.to(dtype), scale.to(dtype)
    if s.dim() == 1:
        return w * s[:, None]
    return (w.unflatten(1, (s.shape[1], G)) * s[:, :, None]).flatten(1)


def _linear_int8_torch(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """linear_int8 in torch: the weight dequantized to x's dtype, DEQUANT_CHUNK_BYTES of it at a
    time, each chunk through F.linear (BLAS's GEMM: what many rows, a prefill, want), so a big
    weight (the tied LM head) never has a full fp32 copy."""
    N, K = qweight.shape
    G = int8_group_size(qweight, scale)
    chunk = max(8, DEQUANT_CHUNK_BYTES // (4 * max(K, 1)))
    if N <= chunk or (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, dequantize_int8(qweight, scale, x.dtype), bias)
    out = x.new_empty(*x.shape[:-1], N)
    buf = x.new_empty(chunk, K)
    s = scale.to(x.dtype)
    s = s[:, None] if s.dim() == 1 else s[:, :, None]                 # [N, 1] or [N, K // G, 1]
    for n0 in range(0, N, chunk):
        n1 = min(N, n0 + chunk)
        w = buf[:n1 - n0].copy_(qweight[n0:n1])                       # ~1.5x torch.mul(q, s, out=)
        (w if scale.dim() == 1 else w.view(n1 - n0, K // G, G)).mul_(s[n0:n1])
        out[..., n0:n1] = F.linear(x, w, None if bias is None else bias[n0:n1])
    return out


def int8_kernel_group(qweight: torch.Tensor, scale: torch.Tensor) -> int | None:
    """lkv_linear_int8's `group` for these (G; K per output channel), or None where G is not a
    multiple of 8 (the torch path runs); ValueError as `int8_group_size`."""
    G = int8_group_size(qweight, scale)
    return G if G == qweight.shape[1] or G % 8 == 0 else None


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only int8 linear (contract: `plugins.reference.linear_int8_ref`): x [M, K] fp32,
    qweight [N, K] int8, scale fp32 [N] (per output channel) or [N, K // G] (per group of G inputs),
    bias [N] | None -> [M, N] fp32 = x @ dequantize_int8(qweight, scale).T + bias.

    At most MAX_INT8_ROWS rows of fp32 CPU x (and G = K or a multiple of 8): one C call
    (plugins/cpu/linear_int8.c) that reads the int8 weight where it lies (row-major [N, K], no
    packed copy; a non-contiguous one is copied first). Anything else (more rows, other dtypes or
    devices, autograd): the weight dequantized in chunks, through F.linear. A scale whose shape
    fits neither layout: ValueError."""
    lib = loaded()
    group = int8_kernel_group(qweight, scale) if qweight.dim() == 2 else None
    if (lib is None or x.dim() != 2 or not 0 < x.shape[0] <= MAX_INT8_ROWS or x.dtype != torch.float32
            or qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.shape[1] != x.shape[1]
            or scale.dtype != torch.float32 or group is None
            or x.device.type != "cpu" or qweight.device.type != "cpu" or scale.device.type != "cpu"
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (qweight.shape[0],)
                                      or bias.device.type != "cpu"))
            or (torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad
                                             or (bias is not None and bias.requires_grad)))):
        return _linear_int8_torch(x, qweight, scale, bias)       # including torch's own shape errors
    x, qweight, scale = x.contiguous(), qweight.contiguous(), scale.contiguous()
    (M, K), N = x.shape, qweight.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    with traced("linear_int8"):
        lib.lkv_linear_int8(x.data_ptr(), M, K, qweight.data_ptr(), N, scale.data_ptr(), group,
                            bias.contiguous().data_ptr() if bias is not None else None, y.data_ptr(),
                            torch.get_num_threads())
    return y


KV_DTYPES = {torch.float32: abi.KV_F32, torch.float16: abi.KV_F16, torch.bfloat16: abi.KV_BF16}   # lkv_abi.h LKV_KV_*


def attention_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_extra: torch.Tensor,
                        v_extra: torch.Tensor, kv_mask: torch.Tensor | None = None,
                        extra_mask: torch.Tensor | None = None) -> bool:
    """Whether `attention` runs these arguments: on CPU, q fp32, K/V stored as fp32, fp16 or bf16
    (one dtype for both), the extra keys fp32 or K's dtype, D a multiple of 32, K/V rows contiguous
    with one stride pattern for K and V, extra rows contiguous, few extra keys and rows, and every
    shape consistent (the raw `torch.ops.lookahead` entry does not validate: anything else goes to
    the torch path, which raises its own errors, never to a kernel reading out of bounds). The
    masks, when given, must be bool of shape [B, KVH, N] and [B, R, E]."""
    if q.dim() != 4 or k.dim() != 4 or k_extra.dim() != 4:
        return False
    B, R, H, D = q.shape
    kvh, N, E = k.shape[1], k.shape[2], k_extra.shape[2]
    return (loaded() is not None and q.device.type == "cpu" and kvh > 0 and H % kvh == 0
            and q.dtype == torch.float32 and k.dtype in KV_DTYPES and v.dtype == k.dtype
            and all(t.dtype in (torch.float32, k.dtype) for t in (k_extra, v_extra))
            and all(t.device.type == "cpu" for t in (k, v, k_extra, v_extra))
            and k.shape == v.shape == (B, kvh, N, D) and k_extra.shape == v_extra.shape == (B, kvh, E, D)
            and (kv_mask is None or (kv_mask.dtype == torch.bool and kv_mask.shape == (B, kvh, N)))
            and (extra_mask is None or (extra_mask.dtype == torch.bool and extra_mask.shape == (B, R, E)))
            and D % 32 == 0 and E <= MAX_EXTRA_KEYS and R * (H // kvh) <= MAX_GROUP_ROWS and N < 2 ** 31
            and k.stride() == v.stride() and k.stride(3) == 1 and (k.stride(2) == D or N <= 1)
            and k_extra.stride(3) == 1 and v_extra.stride(3) == 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_mask: torch.Tensor, k_extra: torch.Tensor,
              v_extra: torch.Tensor, extra_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """lookahead_attention's math in one C call (shapes as in plugins.attention; the caller has
    checked them and `attention_supported`). fp16 / bf16 K/V are read as they are stored and
    widened in the kernel; 16-bit extra keys (a few rows) are widened here. -> fp32."""
    B, R, H, D = q.shape
    kvh, N, E = k.shape[1], k.shape[2], k_extra.shape[2]
    q = q.contiguous()
    kv_mask, extra_mask = kv_mask.contiguous(), extra_mask.contiguous()
    if k_extra.dtype != torch.float32:
        k_extra = k_extra.float()
    if v_extra.dtype != torch.float32:
        v_extra = v_extra.float()
    out = torch.empty(B, R, H, D, dtype=torch.float32)
    with traced("attention"):
        rc = loaded().lkv_attention(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), kv_mask.data_ptr(),
            k_extra.data_ptr(), *k_extra.stride()[:3], v_extra.data_ptr(), *v_extra.stride()[:3],
            extra_mask.data_ptr(), out.data_ptr(), B, R, H, kvh, N, E, D, float(scale), torch.get_num_threads(),
            KV_DTYPES[k.dtype])
    if rc != 0:
        raise_for(rc, "lookahead_attention")
    return out


def paged_mask(lens: list[int], kvh: int) -> torch.Tensor:
    """The key mask `attention_paged` takes for sequences of `lens` keys: [B, KVH, max(lens)] bool,
    each sequence's first lens[b] keys visible (the same for every layer of a step: build it once)."""
    n = max(lens)
    return (torch.arange(n)[None] < torch.tensor(lens)[:, None])[:, None].expand(len(lens), kvh, n).contiguous()


def attention_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int] | None, lens: list[int],
                    scale: float, mask: torch.Tensor | None = None,
                    tables: list[list[int]] | None = None) -> torch.Tensor | None:
    """Dense decode attention of B sequences in one C call, over their K/V where they lie in one
    layer of the KV pool: q [B, H, D] (one row each), k, v [KVH, num_blocks, block_size, D]
    (contiguous), sequence b's keys the `lens[b]` tokens from block `starts[b]` on (one run of
    blocks), or with `tables` (then `starts` is not read) the `lens[b]` tokens of the blocks
    tables[b] lists, in order (a paged sequence, e.g. one that shares a cached prefix: the same
    sums as a run of those blocks). q fp32; the pool fp32, fp16 or bf16 (read as stored, widened
    in the kernel). `mask`: `paged_mask(lens, KVH)`, when the caller keeps it across layers ->
    [B, H, D] fp32, or None where the kernel does not take these arguments (the caller's
    per-sequence path runs)."""
    if q.dim() != 3 or k.dim() != 4 or loaded() is None:
        return None
    B, H, D = q.shape
    kvh, nb, bs, _ = k.shape
    if tables is not None:
        if len(tables) != len(lens):
            return None
        starts, tables = runs_or_tables(tables, lens, bs)     # every sequence one run: the run entry
        covered = tables is None or all(len(t) * bs >= n and all(0 <= b < nb for b in t[: -(-n // bs)])
                                        for t, n in zip(tables, lens))
        if not covered:
            return None
    if not (len(lens) == B > 0 and kvh > 0 and H % kvh == 0 and H // kvh <= MAX_GROUP_ROWS
            and D % 32 == 0 and k.shape[3] == D and v.shape == k.shape
            and q.dtype == torch.float32 and k.dtype in KV_DTYPES and v.dtype == k.dtype
            and all(t.device.type == "cpu" for t in (q, k, v))
            and k.is_contiguous() and v.is_contiguous() and nb * bs < 1 << 31
            and (tables is not None or (len(starts) == B
                                        and all(0 <= s and 0 < n and s * bs + n <= nb * bs for s, n in zip(starts, lens))))):
        return None
    return _paged_call(loaded(), q, k, v, starts, tables, lens, scale, mask, KV_DTYPES[k.dtype])


def run_of(table: list[int], n: int, bs: int) -> int | None:
    """The first block of a sequence's first `n` tokens when their blocks are one run, else None."""
    need = -(-n // bs)
    ids = table[:need]
    return ids[0] if len(ids) == need > 0 and ids == list(range(ids[0], ids[0] + need)) else None


def runs_or_tables(tables: list[list[int]], lens: list[int], bs: int) -> tuple[list[int] | None, list[list[int]] | None]:
    """(run starts, None) when every sequence's blocks are one run (the kernels' run entry: no
    per-key table lookup), else (None, tables)."""
    starts = [run_of(t, n, bs) for t, n in zip(tables, lens)]
    return (starts, None) if starts and all(s is not None for s in starts) else (None, tables)


def block_tables(tables: list[list[int]], lens: list[int], bs: int) -> torch.Tensor:
    """The blocks holding each sequence's first lens[b] tokens as one [B, max blocks] int64 table
    (-1 past a sequence's own)."""
    width = max(-(-n // bs) for n in lens)
    out = torch.full((len(tables), width), -1, dtype=torch.int64)
    for b, (t, n) in enumerate(zip(tables, lens)):
        used = t[: -(-n // bs)]
        out[b, : len(used)] = torch.tensor(used, dtype=torch.int64)
    return out


def block_topk_supported(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, valid: torch.Tensor,
                         k: int | None = None) -> bool:
    """Whether `block_topk` runs these arguments: on CPU, q fp32, the summaries fp32, fp16 or bf16
    (alike; widened exactly), D a multiple of 8, each sequence's summaries one contiguous
    [NB, KVH, D] run (alike for kmin and kmax), valid rows contiguous, every shape consistent and
    1 <= k <= NB (else the torch path runs and raises its own errors)."""
    if q.dim() != 4 or kmin.dim() != 4 or valid.dim() != 3:
        return False
    B, R, H, D = q.shape
    _, num_blocks, kvh, _ = kmin.shape
    return (loaded() is not None and q.device.type == "cpu" and kvh > 0 and H % kvh == 0
            and q.dtype == torch.float32 and kmin.dtype in KV_DTYPES and kmax.dtype == kmin.dtype
            and all(t.device.type == "cpu" for t in (q, kmin, kmax))
            and kmin.shape == kmax.shape == (B, num_blocks, kvh, D)
            and valid.dtype == torch.bool and valid.shape == (B, R, num_blocks)
            and (k is None or 1 <= k <= num_blocks)
            and D % 8 == 0 and num_blocks < 2 ** 31 and kmin.stride()[1:] == (kvh * D, D, 1)
            and kmax.stride() == kmin.stride() and valid.stride(-1) == 1)


def block_topk(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, valid: torch.Tensor, k: int,
               group_score: str) -> tuple[torch.Tensor, torch.Tensor]:
    """block_topk in one C call; q [B, R, H, D], valid [B, R, NB] (the caller has checked
    `block_topk_supported`)."""
    B, R, H, D = q.shape
    _, num_blocks, kvh, _ = kmin.shape
    q = q.contiguous()
    scores = torch.empty(B, R, kvh, num_blocks, dtype=torch.float32)
    idx = torch.empty(B, R, kvh, k, dtype=torch.int64)
    with traced("block_topk"):
        rc = loaded().lkv_block_topk(
            q.data_ptr(), kmin.data_ptr(), kmax.data_ptr(), kmin.stride(0), valid.data_ptr(), valid.stride(0),
            valid.stride(1), B, R, H, kvh, num_blocks, D, k, int(group_score == "max"), scores.data_ptr(),
            idx.data_ptr(), torch.get_num_threads(), KV_DTYPES[kmin.dtype])
    if rc != 0:
        raise_for(rc, "block_topk", f"k must be in [1, NB={num_blocks}], got {k}" if rc == abi.Status.ARG else None)
    return idx, scores


def block_topk_op(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, valid: torch.Tensor, k: int,
                  group_score: str = "sum") -> tuple[torch.Tensor, torch.Tensor]:
    """`lookahead::block_topk` (plugins/topk.py's contract, q [B, H, D] or [B, R, H, D]): one C call
    where `block_topk_supported`, else the op's torch implementation."""
    rows = q.dim() == 4
    q4, v3 = (q, valid) if rows else (q.unsqueeze(1), valid.unsqueeze(1))
    if not block_topk_supported(q4, kmin, kmax, v3, k):
        return _block_topk_impl(q, kmin, kmax, valid, k, group_score)
    top, scores = block_topk(q4, kmin, kmax, v3, k, group_score)
    return (top, scores) if rows else (top[:, 0], scores[:, 0])


def lookahead_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_mask: torch.Tensor,
                           k_extra: torch.Tensor, v_extra: torch.Tensor, extra_mask: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """`lookahead::lookahead_attention` (plugins/attention.py's contract): one C call where
    `attention_supported`, else the op's torch implementation."""
    if not attention_supported(q, k, v, k_extra, v_extra, kv_mask, extra_mask):
        return _lookahead_attention_impl(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale)
    return attention(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`F.rms_norm(x, weight.shape, weight, eps)`; for 2-D fp32 CPU rows (last dim contiguous,
    N % 8 == 0) in one C call (plugins/cpu/elementwise.c)."""
    lib = loaded()
    if (lib is None or x.dim() != 2 or weight.shape != (x.shape[1],) or x.shape[1] % 8
            or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
            or weight.device.type != "cpu" or x.stride(1) != 1 or not weight.is_contiguous()
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.rms_norm(x, weight.shape, weight, eps)
    (M, N), y = x.shape, torch.empty(x.shape, dtype=torch.float32)
    with traced("rms_norm"):
        lib.lkv_rmsnorm(x.data_ptr(), x.stride(0), weight.data_ptr(), float(eps), y.data_ptr(), N, M, N)
    return y


def update_summaries(kmin: torch.Tensor, kmax: torch.Tensor, keys: torch.Tensor, block_ids: torch.Tensor,
                     block_offsets: torch.Tensor) -> None:
    """`lookahead::update_summaries` (plugins/summaries.py's contract; like `plugins.direct`'s entry,
    no argument checks beyond what keeps the kernel in bounds): one C call (plugins/cpu/summaries.c)
    for contiguous [num_blocks, KVH, D] CPU summaries, fp32 or of the keys' dtype (a min or max of
    keys is one of them: exact), with fp32 / fp16 / bf16 keys [T, KVH, D] and int64 [T] ids and
    offsets, the last three made contiguous first (T rows: cheap). Anything else (other summary or
    key dtypes, another device, non-contiguous summaries, which are written
    in place and cannot be copied, inconsistent shapes, autograd) goes to the torch implementation,
    which raises its own errors. NaN keys propagate as torch.minimum / maximum's do; only the NaN
    bit pattern may differ from torch's (which varies with its vector width). An id outside
    [0, num_blocks): ValueError naming block_ids, nothing changed."""
    lib = loaded()
    T = keys.shape[0] if keys.dim() == 3 else -1
    if (lib is None or kmin.dtype not in (torch.float32, keys.dtype) or kmax.dtype != kmin.dtype
            or keys.dtype not in KV_DTYPES
            or block_ids.dtype != torch.int64 or block_offsets.dtype != torch.int64
            or kmin.dim() != 3 or kmax.shape != kmin.shape or T < 0 or keys.shape[1:] != kmin.shape[1:]
            or block_ids.shape != (T,) or block_offsets.shape != (T,)
            or not (kmin.device.type == kmax.device.type == keys.device.type == block_ids.device.type
                    == block_offsets.device.type == "cpu")
            or not (kmin.is_contiguous() and kmax.is_contiguous())
            or (torch.is_grad_enabled() and (kmin.requires_grad or kmax.requires_grad or keys.requires_grad))):
        return _update_summaries_impl(kmin, kmax, keys, block_ids, block_offsets)
    keys, block_ids, block_offsets = keys.contiguous(), block_ids.contiguous(), block_offsets.contiguous()
    num_blocks, kvh, D = kmin.shape
    with traced("update_summaries"):
        rc = lib.lkv_update_summaries(kmin.data_ptr(), kmax.data_ptr(), keys.data_ptr(), block_ids.data_ptr(),
                                      block_offsets.data_ptr(), T, kvh, D, num_blocks, KV_DTYPES[keys.dtype],
                                      KV_DTYPES[kmin.dtype], torch.get_num_threads())
    if rc == abi.Status.RANGE:
        fail("block_ids", f"values must be in [0, {num_blocks}), got min {int(block_ids.min())}, "
                          f"max {int(block_ids.max())}")
    if rc != 0:
        raise_for(rc, "update_summaries")


# ---- kernels bound to one weight at load ------------------------------------------------------------
# The checks, the packed copy and the choice of kernel happen once, when the weights load
# (runtime/projections.py binds every projection); a bound kernel trusts its caller for the rows
# (2-D fp32 CPU tensors with the weight's K columns, as the model hands them) and checks nothing per
# call. The one choice left per call is by size: more than MAX_LINEAR_ROWS / MAX_INT8_ROWS rows go
# to BLAS, the same contract. Where the kernel does not take the weight, the `Kernel` runs the op's
# torch formulation and says why in `fallback` (runtime/projections.py logs it at WARNING and
# counts it). A packed copy is rebuilt only when its weight changed in place after binding (its
# version counter), so a test that edits weights never reads a stale copy. The prefill kernels'
# binders are prefill.py's.

NO_UNITS = "this CPU has no "      # a fallback for the CPU's units, not the weight's shape


@dataclass
class Kernel:
    """A weight's (or pool's) kernel: call it with the rows. impl: what runs; fallback: why the
    torch formulation runs instead of the C kernel (None: it does not); buffers: the packed copies
    it owns (their bytes are what the memory plan counts)."""

    fn: Callable
    impl: str
    fallback: str | None = None
    buffers: tuple = field(default=())

    def __call__(self, *args):
        return self.fn(*args)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


def _threads() -> int:
    return torch.get_num_threads()


def bias_fits(bias: torch.Tensor | None, n: int) -> bool:
    return bias is None or (bias.dtype == torch.float32 and bias.shape == (n,) and bias.device.type == "cpu")


def weight_misfit(weight: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why a kernel that reads `dtype` [N, K] CPU weights does not take `weight` (None: it does).
    Shape-free, so that one line covers every weight of a model."""
    if weight.dim() != 2 or weight.dtype != dtype or weight.device.type != "cpu":
        return (f"{str(weight.dtype).removeprefix('torch.')} {weight.dim()}-D weights on {weight.device.type} "
                f"(the kernel reads {str(dtype).removeprefix('torch.')} [N, K] on cpu)")
    return None


def bind_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Kernel:
    """fp32 `F.linear` over `weight` [N, K]: lkv_linear_packed (linear.c) on its packed copy, made
    now, for up to MAX_LINEAR_ROWS rows; BLAS above (as fast there). Falls back to F.linear where
    N % 8 != 0 or the library did not build."""
    torch_fn = lambda x: F.linear(x, weight, bias)        # noqa: E731
    lib = loaded()
    why = ("the C kernels did not build" if lib is None else weight_misfit(weight, torch.float32)
           or (f"N = {weight.shape[0]} is not a multiple of 8" if weight.shape[0] % 8 else None)
           or (None if bias_fits(bias, weight.shape[0]) else "a bias the kernel cannot read"))
    if why:
        return Kernel(torch_fn, "F.linear", why)
    N, K = weight.shape
    state = {"packed": packed_weight(weight), "version": weight._version}
    bias_ptr = bias.contiguous().data_ptr() if bias is not None else None
    f = lib.lkv_linear_packed

    def fn(x: torch.Tensor) -> torch.Tensor:
        M = x.shape[0]
        if M > MAX_LINEAR_ROWS or M == 0:
            return F.linear(x, weight, bias)
        if weight._version != state["version"]:          # edited in place since binding: re-pack
            state["packed"], state["version"] = packed_weight(weight), weight._version
        x = x if x.is_contiguous() else x.contiguous()
        y = torch.empty(M, N, dtype=torch.float32)
        with traced("linear"):
            f(x.data_ptr(), M, K, state["packed"].data_ptr(), N, bias_ptr, y.data_ptr(), _threads())
        return y
    return Kernel(fn, "c/linear_packed", None, (state["packed"],))


def bind_linear_int8(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> Kernel:
    """Weight-only int8 linear over (qweight, scale): lkv_linear_int8 (linear_int8.c), which reads
    the int8 weight where it lies, for up to MAX_INT8_ROWS rows; the chunked dequantize + BLAS
    above. Falls back to the torch formulation where the group is not one the kernel reads."""
    torch_fn = lambda x: _linear_int8_torch(x, qweight, scale, bias)     # noqa: E731
    lib = loaded()
    group = int8_kernel_group(qweight, scale)
    why = ("the C kernels did not build" if lib is None else weight_misfit(qweight, torch.int8)
           or (f"a group of {qweight.shape[1] // max(1, scale.numel() // qweight.shape[0])} inputs is not a "
               "multiple of 8" if group is None else None)
           or (None if scale.dtype == torch.float32 and scale.device.type == "cpu" else "a scale that is not fp32 on cpu")
           or (None if bias_fits(bias, qweight.shape[0]) else "a bias the kernel cannot read"))
    if why:
        return Kernel(torch_fn, "torch/linear_int8", why)
    q, s = qweight.contiguous(), scale.contiguous()
    (N, K), bias_ptr, f = q.shape, (bias.contiguous().data_ptr() if bias is not None else None), lib.lkv_linear_int8

    def fn(x: torch.Tensor) -> torch.Tensor:
        M = x.shape[0]
        if M > MAX_INT8_ROWS or M == 0:
            return _linear_int8_torch(x, qweight, scale, bias)
        x = x if x.is_contiguous() else x.contiguous()
        y = torch.empty(M, N, dtype=torch.float32)
        with traced("linear_int8"):
            f(x.data_ptr(), M, K, q.data_ptr(), N, s.data_ptr(), group, bias_ptr, y.data_ptr(), _threads())
        return y
    return Kernel(fn, "c/linear_int8")


def bind_rms_norm(weight: torch.Tensor, eps: float) -> Kernel:
    """`F.rms_norm` over rows with this fp32 weight [N]: lkv_rmsnorm (elementwise.c), checked now
    (N % 8 == 0, fp32 on cpu); per call the rows only need a unit last stride, which every caller's
    rows have (a projection's output, or heads reshaped into rows). Falls back to F.rms_norm."""
    torch_fn = lambda x: F.rms_norm(x, weight.shape, weight, eps)        # noqa: E731
    lib = loaded()
    why = ("the C kernels did not build" if lib is None
           else None if weight.dim() == 1 and weight.dtype == torch.float32 and weight.device.type == "cpu"
           and weight.is_contiguous() else weight_misfit(weight.view(1, -1), torch.float32))
    why = why or (f"N = {weight.shape[0]} is not a multiple of 8" if weight.shape[0] % 8 else None)
    if why:
        return Kernel(torch_fn, "F.rms_norm", why)
    N, f, eps = weight.shape[0], lib.lkv_rmsnorm, float(eps)

    def fn(x: torch.Tensor) -> torch.Tensor:
        x = x if x.stride(1) == 1 else x.contiguous()
        M = x.shape[0]
        y = torch.empty(M, N, dtype=torch.float32)
        with traced("rms_norm"):
            f(x.data_ptr(), x.stride(0), weight.data_ptr(), eps, y.data_ptr(), N, M, N)
        return y
    return Kernel(fn, "c/rmsnorm")


# ---- kernels bound to the engine's KV pool and summaries at load ------------------------------------
# The decode-side ops whose tensors are the engine's own (a layer of the KV pool, the device tier,
# the block summaries): what their kernels need of the layout (the KV dtype, head_dim, heads per KV
# head, query rows per KV head) is checked once, when the engine makes its pool
# (runtime/projections.py `bind_pool_kernels`). Per call a bound kernel only compares the call's
# shapes with the bound layout and range-checks the ids its kernel would read unchecked; a mismatch
# raises (ValueError naming the argument, or KernelIndexError): a caller's bug, never a switch to
# the torch formulation's other roundings. Where the kernel does not take the layout, the `Kernel`
# runs the torch formulation for the engine's whole life and says why (`fallback`).

def pool_misfit(device: torch.device, kv_dtype: torch.dtype | None, head_dim: int, num_heads: int, kv_heads: int,
                rows: int, multiple: int, q_dtype: torch.dtype = torch.float32) -> str | None:
    """Why a pool-side kernel does not take this layout (None: it does): the library, the device,
    the queries' dtype (the model's: the kernels read fp32), the KV dtype (None: fp32 summaries
    only), head_dim a multiple of `multiple`, whole groups of heads per KV head, and `rows` query
    rows of each group within MAX_GROUP_ROWS."""
    if loaded() is None:
        return "the C kernels did not build"
    if device.type != "cpu":
        return f"tensors on {device.type}"
    if q_dtype != torch.float32:
        return f"{str(q_dtype).removeprefix('torch.')} queries (the kernel reads float32)"
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        return f"KV dtype {kv_dtype} (the kernel reads {', '.join(map(str, KV_DTYPES))})"
    if head_dim % multiple:
        return f"head_dim {head_dim} (the kernel reads multiples of {multiple})"
    if kv_heads <= 0 or num_heads % kv_heads:
        return f"{num_heads} heads over {kv_heads} KV heads"
    if rows * (num_heads // kv_heads) > MAX_GROUP_ROWS:
        return f"{rows * (num_heads // kv_heads)} query rows per KV head (the kernel takes {MAX_GROUP_ROWS})"
    return None


def _bad(op: str, arg: str, got, want) -> None:
    raise ValueError(f"{op}: {arg} is {got}, the layout bound at load expects {want}")


def bind_paged_attention(pool_k: torch.Tensor, pool_v: torch.Tensor, num_heads: int,
                         q_dtype: torch.dtype = torch.float32) -> Kernel:
    """Dense decode attention over one layer of this pool ([L, KVH, NB, bs, D] K and V):
    `attention_paged`'s contract and kernels (lkv_attention_paged, _table), the pool's layout
    checked now. Per call: q [B, H, D] fp32 and the layer's shape, and the starts or block tables
    range-checked (KernelIndexError). Where the kernel does not take the pool, `fn` is None: the
    caller's torch path attends (the table's `paged_attention` is None there, as on a torch table)."""
    kvh, nb, bs, D = pool_k.shape[-4:]
    why = pool_misfit(pool_k.device, pool_k.dtype, D, num_heads, kvh, 1, 32, q_dtype)
    why = why or (None if pool_k.is_contiguous() and pool_v.is_contiguous() and pool_v.shape == pool_k.shape
                  and pool_v.dtype == pool_k.dtype else "a non-contiguous pool")
    why = why or (None if nb * bs < 1 << 31 else f"{nb * bs} positions a layer (the kernel indexes int32)")
    if why:
        return Kernel(None, "torch/paged_decode_attention", why)
    H, layer, code, lib = num_heads, tuple(pool_k.shape[1:]), KV_DTYPES[pool_k.dtype], loaded()

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int] | None, lens: list[int],
           scale: float, mask: torch.Tensor | None = None, tables: list[list[int]] | None = None) -> torch.Tensor:
        B = len(lens)
        if q.shape != (B, H, D) or q.dtype != torch.float32:
            _bad("attention_paged", "q", f"{tuple(q.shape)} {q.dtype}", f"({B}, {H}, {D}) torch.float32")
        if tuple(k.shape) != layer or tuple(v.shape) != layer or not (k.is_contiguous() and v.is_contiguous()):
            _bad("attention_paged", "k, v", tuple(k.shape), f"{layer}, one contiguous layer of the pool")
        if tables is not None:
            starts, tables = runs_or_tables(tables, lens, bs)
        if tables is None:
            if len(starts) != B or not all(0 <= s and 0 < n and s * bs + n <= nb * bs for s, n in zip(starts, lens)):
                raise_for(abi.Status.RANGE, "attention_paged", f"runs of {lens} positions from blocks {starts} "
                          f"in a layer of {nb} blocks")
        elif not all(len(t) * bs >= n and all(0 <= b < nb for b in t[: -(-n // bs)]) for t, n in zip(tables, lens)):
            raise_for(abi.Status.RANGE, "attention_paged", f"block tables covering {lens} positions with ids "
                      f"in [0, {nb})")         # the kernel reads the ids unchecked
        return _paged_call(lib, q, k, v, starts, tables, lens, scale, mask, code)
    return Kernel(fn, "c/attention_paged")


def _paged_call(lib, q, k, v, starts, tables, lens, scale, mask, code) -> torch.Tensor:
    """One lkv_attention_paged(_table) call (arguments checked by the caller)."""
    (B, H, D), (kvh, nb, bs, _) = q.shape, k.shape
    if mask is None:
        mask = paged_mask(lens, kvh)
    if mask.shape != (B, kvh, max(lens)) or mask.dtype != torch.bool or not mask.is_contiguous():
        raise ValueError(f"mask: expected paged_mask(lens, {kvh}) of shape {(B, kvh, max(lens))}, "
                         f"got {tuple(mask.shape)} {mask.dtype}")
    q = q if q.is_contiguous() else q.contiguous()
    out = torch.empty(B, H, D, dtype=torch.float32)
    nt = torch.get_num_threads()
    with traced("attention_paged"):
        if tables is None:
            base = torch.tensor([s * bs * D for s in starts], dtype=torch.int64)
            rc = lib.lkv_attention_paged(q.data_ptr(), k.data_ptr(), v.data_ptr(), base.data_ptr(), nb * bs * D,
                                         mask.data_ptr(), out.data_ptr(), B, H, kvh, mask.shape[2], D,
                                         float(scale), nt, code)
        else:
            table = block_tables(tables, lens, bs)
            rc = lib.lkv_attention_paged_table(q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(),
                                               table.shape[1], bs, nb * bs * D, mask.data_ptr(), out.data_ptr(),
                                               B, H, kvh, mask.shape[2], D, float(scale), nt, code)
    if rc != 0:
        raise_for(rc, "attention_paged")
    return out


def bind_lookahead_attention(device: torch.device, kv_dtype: torch.dtype, head_dim: int, num_heads: int,
                             kv_heads: int, rows: int, q_dtype: torch.dtype = torch.float32) -> Kernel:
    """`lookahead::lookahead_attention` over a device tier of `kv_dtype` (lkv_attention), the layout
    checked now for up to `rows` query rows a sequence. Per call: the shapes agree with each other
    and the layout, at most MAX_EXTRA_KEYS extra keys, and the strides the kernel reads (the tier's
    views have them). Falls back to the op's torch formulation where the kernel does not take it."""
    why = pool_misfit(device, kv_dtype, head_dim, num_heads, kv_heads, rows, 32, q_dtype)
    if why:
        return Kernel(_lookahead_attention_impl, "torch/lookahead_attention", why)
    H, D, kvh = num_heads, head_dim, kv_heads

    def fn(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale) -> torch.Tensor:
        if q.dim() != 4 or q.shape[2:] != (H, D) or q.shape[1] > rows or q.dtype != torch.float32:
            _bad("lookahead_attention", "q", f"{tuple(q.shape)} {q.dtype}", f"[B, <= {rows}, {H}, {D}] torch.float32")
        B, R = q.shape[:2]
        N, E = k.shape[2], k_extra.shape[2]
        if k.shape != (B, kvh, N, D) or v.shape != k.shape or k.dtype != kv_dtype or v.dtype != kv_dtype:
            _bad("lookahead_attention", "k, v", f"{tuple(k.shape)} {k.dtype}", f"[{B}, {kvh}, N, {D}] {kv_dtype}")
        if k_extra.shape != (B, kvh, E, D) or v_extra.shape != k_extra.shape or E > MAX_EXTRA_KEYS:
            _bad("lookahead_attention", "k_extra", tuple(k_extra.shape), f"[{B}, {kvh}, <= {MAX_EXTRA_KEYS}, {D}]")
        if kv_mask.shape != (B, kvh, N) or extra_mask.shape != (B, R, E):
            _bad("lookahead_attention", "kv_mask, extra_mask", (tuple(kv_mask.shape), tuple(extra_mask.shape)),
                 ((B, kvh, N), (B, R, E)))
        if not (k.stride() == v.stride() and k.stride(3) == 1 and (k.stride(2) == D or N <= 1)
                and k_extra.stride(3) == 1 and v_extra.stride(3) == 1):
            _bad("lookahead_attention", "k, v strides", (k.stride(), v.stride()), "rows of D contiguous, alike for K and V")
        return attention(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale)
    return Kernel(fn, "c/lookahead_attention")


def bind_block_topk(device: torch.device, head_dim: int, num_heads: int, kv_heads: int) -> Kernel:
    """`lookahead::block_topk` over block summaries of this layout (lkv_block_topk; fp32, fp16 or
    bf16, widened exactly), checked now. Per call (q [B, H, D] or [B, R, H, D]): the summaries one [B, NB, KVH, D] run each (alike
    for kmin and kmax), valid [B, (R,) NB] bool, and 1 <= k <= NB. Falls back to the op's torch
    formulation where the kernel does not take the layout."""
    why = pool_misfit(device, None, head_dim, num_heads, kv_heads, 1, 8)
    if why:
        return Kernel(_block_topk_impl, "torch/block_topk", why)
    H, D, kvh = num_heads, head_dim, kv_heads

    def fn(q, kmin, kmax, valid, k: int, group_score: str = "sum"):
        rows = q.dim() == 4
        q4, v3 = (q, valid) if rows else (q.unsqueeze(1), valid.unsqueeze(1))
        if q4.dim() != 4 or q4.shape[2:] != (H, D) or q.dtype != torch.float32:
            _bad("block_topk", "q", f"{tuple(q.shape)} {q.dtype}", f"[B, (R,) {H}, {D}] torch.float32")
        B, R = q4.shape[:2]
        nb = kmin.shape[1] if kmin.dim() == 4 else -1
        if (kmin.shape != (B, nb, kvh, D) or kmax.shape != kmin.shape or kmin.dtype not in KV_DTYPES
                or kmax.dtype != kmin.dtype or kmin.stride()[1:] != (kvh * D, D, 1) or kmax.stride() != kmin.stride()):
            _bad("block_topk", "kmin, kmax", f"{tuple(kmin.shape)} {kmin.dtype} strides {kmin.stride()}",
                 f"[{B}, NB, {kvh}, {D}] in {list(KV_DTYPES)} (alike), each sequence's [NB, {kvh}, {D}] contiguous")
        if v3.shape != (B, R, nb) or v3.dtype != torch.bool or v3.stride(-1) != 1:
            _bad("block_topk", "valid", f"{tuple(valid.shape)} {valid.dtype}", f"[{B}, (R,) {nb}] torch.bool")
        if not 1 <= k <= nb:
            fail("k", f"must be in [1, NB={nb}], got {k}")
        top, scores = block_topk(q4, kmin, kmax, v3, k, group_score)
        return (top, scores) if rows else (top[:, 0], scores[:, 0])
    return Kernel(fn, "c/block_topk")


def bind_update_summaries(device: torch.device, head_dim: int, kv_heads: int) -> Kernel:
    """`lookahead::update_summaries` into summaries of this layout (lkv_update_summaries), checked
    now. Per call: kmin/kmax [num_blocks, KVH, D] contiguous, fp32 or the keys' dtype (written in
    place), keys [T, KVH, D] fp32 / fp16 / bf16, int64 [T] ids and offsets; an id outside [0, num_blocks):
    ValueError naming block_ids, nothing changed. Falls back to the op's torch formulation where
    the kernel does not take the layout."""
    why = pool_misfit(device, None, head_dim, kv_heads, kv_heads, 1, 1)
    if why:
        return Kernel(_update_summaries_impl, "torch/update_summaries", why)
    D, kvh, lib = head_dim, kv_heads, loaded()

    def fn(kmin, kmax, keys, block_ids, block_offsets) -> None:
        T = keys.shape[0]
        if (kmin.dim() != 3 or kmin.shape[1:] != (kvh, D) or kmax.shape != kmin.shape or kmin.dtype not in KV_DTYPES
                or kmax.dtype != kmin.dtype or not (kmin.is_contiguous() and kmax.is_contiguous())):
            _bad("update_summaries", "kmin, kmax", f"{tuple(kmin.shape)} {kmin.dtype}",
                 f"[num_blocks, {kvh}, {D}] in {list(KV_DTYPES)} (alike), contiguous")
        if keys.shape != (T, kvh, D) or keys.dtype not in KV_DTYPES or kmin.dtype not in (torch.float32, keys.dtype):
            _bad("update_summaries", "keys", f"{tuple(keys.shape)} {keys.dtype}",
                 f"[T, {kvh}, {D}] in {list(KV_DTYPES)}, of the summaries' dtype {kmin.dtype} unless they are fp32")
        if (block_ids.shape != (T,) or block_offsets.shape != (T,) or block_ids.dtype != torch.int64
                or block_offsets.dtype != torch.int64):
            _bad("update_summaries", "block_ids, block_offsets", (tuple(block_ids.shape), tuple(block_offsets.shape)),
                 f"({T},) torch.int64 each")
        keys, ids, offs = keys.contiguous(), block_ids.contiguous(), block_offsets.contiguous()
        num_blocks = kmin.shape[0]
        with traced("update_summaries"):
            rc = lib.lkv_update_summaries(kmin.data_ptr(), kmax.data_ptr(), keys.data_ptr(), ids.data_ptr(),
                                          offs.data_ptr(), T, kvh, D, num_blocks, KV_DTYPES[keys.dtype],
                                          KV_DTYPES[kmin.dtype], torch.get_num_threads())
        if rc == abi.Status.RANGE:
            fail("block_ids", f"values must be in [0, {num_blocks}), got min {int(ids.min())}, max {int(ids.max())}")
        if rc != 0:
            raise_for(rc, "update_summaries")
    return Kernel(fn, "c/update_summaries")
