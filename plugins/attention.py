"""`lookahead::lookahead_attention`: dual-row sparse attention with GQA over gathered KV + fresh rows."""
from __future__ import annotations

import math

import torch

from ._common import FLOAT_DTYPES, check_same, check_shape, check_tensor, define_op, fail


def _row_max(s: torch.Tensor) -> torch.Tensor:
    """amax over the last dim, keepdim; -inf for an empty key set (amax refuses size 0)."""
    if s.shape[-1] == 0:
        return s.new_full((*s.shape[:-1], 1), float("-inf"))
    return s.amax(-1, keepdim=True)


def _attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_mask: torch.Tensor,
                    k_extra: torch.Tensor, v_extra: torch.Tensor, extra_mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """The op in plain matmuls (fallback where torch has no fused CPU attention kernel)."""
    B, R, H, D = q.shape
    num_kv_heads = k.shape[1]
    E = k_extra.shape[2]
    G = H // num_kv_heads
    # Fold the rows and a group's query heads into one query dim per KV head (h = kvh * G + g),
    # so K/V are read once per KV head by a batched matmul, never repeated per query head.
    qg = (q.float() * scale).reshape(B, R, num_kv_heads, G, D).transpose(1, 2)
    qg = qg.reshape(B, num_kv_heads, R * G, D)
    s_kv = qg @ k.float().transpose(-1, -2)                                # [B, KVH, R*G, N]
    s_ex = qg @ k_extra.float().transpose(-1, -2)                          # [B, KVH, R*G, E]
    s_kv.masked_fill_(~kv_mask.unsqueeze(2), float("-inf"))
    ex_visible = extra_mask.reshape(B, 1, R, 1, E).expand(B, 1, R, G, E).reshape(B, 1, R * G, E)
    s_ex.masked_fill_(~ex_visible, float("-inf"))

    # Softmax over both key sets without concatenating them.
    m = torch.maximum(_row_max(s_kv), _row_max(s_ex))
    m = m.masked_fill(m == float("-inf"), 0.0)          # a row with no visible key: exp() gives 0
    p_kv, p_ex = (s_kv - m).exp_(), (s_ex - m).exp_()
    # The max key contributes exp(0) = 1, so a row that sees any key has denom >= 1; clamping at
    # 1 only touches rows that see none, turning 0/0 into the documented zero output.
    denom = (p_kv.sum(-1, keepdim=True) + p_ex.sum(-1, keepdim=True)).clamp_min_(1.0)
    out = (p_kv @ v.float() + p_ex @ v_extra.float()) / denom              # [B, KVH, R*G, D]
    return out.view(B, num_kv_heads, R, G, D).transpose(1, 2).reshape(B, R, H, D).to(q.dtype)


KV_STORAGE_DTYPES = (torch.float16, torch.bfloat16)   # K/V stored narrower than a float32 q
_FUSED = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _lookahead_attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_mask: torch.Tensor,
                              k_extra: torch.Tensor, v_extra: torch.Tensor, extra_mask: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """CPU (plugins.cpu's kernel table entry runs its C kernel in its place where it takes the
    arguments): torch's fused (flash) attention over the gathered
    KV, which also returns each row's log-sum-exp, then the few extra keys merged in by that
    log-sum-exp. K/V are read once, by one fused kernel, with the GQA group's heads and both rows
    folded into the query dim."""
    if _FUSED is None or q.device.type != "cpu" or k.shape[2] == 0:
        return _attention_math(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale)
    if k.dtype != q.dtype:          # fp16 / bf16 K/V storage under fp32 queries: fp32 math, widened copies
        k, v = k.float(), v.float()
    B, R, H, D = q.shape
    num_kv_heads = k.shape[1]
    E = k_extra.shape[2]
    G = H // num_kv_heads
    qg = q.reshape(B, R, num_kv_heads, G, D).transpose(1, 2).reshape(B, num_kv_heads, R * G, D)
    # The fused kernel reads rows with a unit stride in the last dim, whatever the tensor says
    # (a transposed K gave wrong numbers, no error): give it such rows.
    qg, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (qg, k, v))
    bias = torch.zeros(kv_mask.shape, dtype=q.dtype).masked_fill_(~kv_mask, float("-inf")).unsqueeze(2)
    out_kv, lse = _FUSED(qg, k, v, 0.0, False, attn_mask=bias, scale=scale)   # [B,KVH,RG,D], [B,KVH,RG]
    # A (b, kvh) with no visible gathered key gets no weight from that part (the kernel's lse is
    # then meaningless).
    lse = lse.masked_fill(~kv_mask.any(-1, keepdim=True), float("-inf")).unsqueeze(-1)   # [B,KVH,RG,1]
    s_ex = (qg.float() * scale) @ k_extra.float().transpose(-1, -2)                     # [B,KVH,RG,E]
    ex_visible = extra_mask.reshape(B, 1, R, 1, E).expand(B, 1, R, G, E).reshape(B, 1, R * G, E)
    s_ex.masked_fill_(~ex_visible, float("-inf"))
    m = torch.maximum(lse, _row_max(s_ex))
    m = m.masked_fill(m == float("-inf"), 0.0)
    w_kv, p_ex = (lse - m).exp(), (s_ex - m).exp_()
    denom = (w_kv + p_ex.sum(-1, keepdim=True)).clamp_min_(1.0)        # >= 1 unless no key is visible
    out = (out_kv.float() * w_kv + p_ex @ v_extra.float()) / denom       # [B, KVH, R*G, D]
    return out.view(B, num_kv_heads, R, G, D).transpose(1, 2).reshape(B, R, H, D).to(q.dtype)


def _lookahead_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_mask: torch.Tensor,
                              k_extra: torch.Tensor, v_extra: torch.Tensor, extra_mask: torch.Tensor,
                              scale: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


define_op("lookahead_attention", _lookahead_attention_impl, _lookahead_attention_fake)


def lookahead_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_mask: torch.Tensor,
                        k_extra: torch.Tensor, v_extra: torch.Tensor, extra_mask: torch.Tensor,
                        scale: float, *, impl=None) -> torch.Tensor:
    """Sparse attention of R query rows per sequence over gathered KV plus the rows' fresh K/V.

    Row r of sequence b, query head h (KV head ``h // (H // KVH)``) attends to ``k[b, kvh, n]``
    where ``kv_mask[b, kvh, n]`` and to ``k_extra[b, kvh, e]`` where ``extra_mask[b, r, e]``.
    In a decode step R = 2 (row 0 the real token, row 1 the draft token), k/v hold the sink,
    selected blocks and recent window gathered per KV head, and k_extra/v_extra the rows' own
    fresh K/V; the caller's extra_mask lets the draft row see the real row, never the reverse.

    Parameters
    ----------
    q : Tensor, [B, R, H, D], float32/float16/bfloat16
        Post-RoPE queries.
    k, v : Tensor, [B, KVH, N, D], dtype of ``q``, or float16 / bfloat16 under a float32 ``q``
        Gathered keys/values, padded; must be finite everywhere (padding is weighted by zero).
        A narrower storage dtype (the KV cache's) is widened to fp32 for the math: the result
        is what fp32 K/V holding the same values give.
    kv_mask : Tensor, [B, KVH, N], bool
        Which gathered keys are real (shared by all rows).
    k_extra, v_extra : Tensor, [B, KVH, E, D], dtype of ``q`` or of ``k``
        Extra keys/values, e.g. this step's rows.
    extra_mask : Tensor, [B, R, E], bool
        Which extra keys row r sees (shared by all heads).
    scale : float
        Softmax scale, usually ``D ** -0.5``.
    impl : callable, optional
        What runs the checked arguments (an engine's kernel table entry); default the dispatcher.

    Returns
    -------
    Tensor, [B, R, H, D], dtype of ``q``. Softmax is computed in fp32. A (b, r) that sees no
    key at all gets zeros (callers never build one; the output is defined, not NaN).
    """
    check_tensor("q", q, 4, FLOAT_DTYPES)
    B, R, H, D = q.shape
    check_tensor("k", k, 4, FLOAT_DTYPES)
    check_tensor("v", v, 4, FLOAT_DTYPES)
    for arg, t in (("k", k), ("v", v)):
        if t.device != q.device:
            fail(arg, f"device {t.device} differs from q's {q.device}")
    if k.dtype != v.dtype:          # name the one that is not q's dtype (v when neither is)
        bad, other = ("k", "v") if v.dtype == q.dtype else ("v", "k")
        fail(bad, f"dtype {(k if bad == 'k' else v).dtype} differs from {other}'s "
                  f"{(v if bad == 'k' else k).dtype}: K and V are stored alike")
    if k.dtype != q.dtype and not (q.dtype == torch.float32 and k.dtype in KV_STORAGE_DTYPES):
        fail("k", f"dtype {k.dtype}: must be q's {q.dtype}, or float16 / bfloat16 storage under a float32 q")
    num_kv_heads, N = k.shape[1], k.shape[2]
    check_shape("k", k, (B, num_kv_heads, N, D), f"[B={B}, KVH, N, D={D}] to match q")
    if H % num_kv_heads:
        fail("k", f"num_kv_heads={num_kv_heads} (dim 1) does not divide q's num_heads={H}")
    check_shape("v", v, k.shape, "[B, KVH, N, D] like k")
    check_tensor("k_extra", k_extra, 4, FLOAT_DTYPES)
    if k_extra.dtype not in (q.dtype, k.dtype):
        fail("k_extra", f"dtype {k_extra.dtype} is neither q's {q.dtype} nor k's {k.dtype}")
    if k_extra.device != q.device:
        fail("k_extra", f"device {k_extra.device} differs from q's {q.device}")
    E = k_extra.shape[2]
    check_shape("k_extra", k_extra, (B, num_kv_heads, E, D), f"[B={B}, KVH={num_kv_heads}, E, D={D}]")
    check_same("v_extra", v_extra, "k_extra", k_extra)
    check_shape("v_extra", v_extra, k_extra.shape, "[B, KVH, E, D] like k_extra")
    for arg, mask, shape, dims in (("kv_mask", kv_mask, (B, num_kv_heads, N), "[B, KVH, N]"),
                                   ("extra_mask", extra_mask, (B, R, E), "[B, R, E]")):
        check_tensor(arg, mask, 3, torch.bool)
        check_shape(arg, mask, shape, dims)
        if mask.device != q.device:
            fail(arg, f"device {mask.device} differs from q's {q.device}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        fail("scale", f"must be a finite float > 0, got {scale!r}")
    if q.device.type != "cpu" and (k.dtype != q.dtype or k_extra.dtype != q.dtype):
        # the CUDA kernels (plugins/cuda) read every float input as q's dtype: widen a narrower
        # K/V storage to it here (a copy) rather than hand them mixed dtypes
        k, v, k_extra, v_extra = (t.to(q.dtype) for t in (k, v, k_extra, v_extra))
    return (impl or torch.ops.lookahead.lookahead_attention)(q, k, v, kv_mask, k_extra, v_extra, extra_mask,
                                                             float(scale))
