"""The simplest attention backend: causal self-attention over one sequence's T tokens, no cache.

Used to verify weights (builder) and as the reference the cached backends are tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class CausalAttention:
    """Full causal attention within the current forward call (one sequence, positions 0..T-1).

    kv_dtype: the reference for a cache stored in that dtype (`LookaheadConfig.kv_dtype`): K and V
    are rounded into it and attention computes in fp32 over the rounded values. None: K/V as given.
    """

    def __init__(self, kv_dtype: torch.dtype | None = None):
        self.kv_dtype = kv_dtype

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, KVH, D] -> [T, H, D]
        if self.kv_dtype is not None:
            out = self._attend(q.float(), k.to(self.kv_dtype).float(), v.to(self.kv_dtype).float())
            return out.to(q.dtype)
        return self._attend(q, k, v)

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(0, 1)


class CachedCausalAttention:
    """Causal attention with a per-layer K/V cache: one sequence whose positions arrive in order,
    one chunk (or one token) per forward call. Memory: the cached K/V plus one chunk's scores."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer_idx in self.k:
            k, v = torch.cat([self.k[layer_idx], k]), torch.cat([self.v[layer_idx], v])
        self.k[layer_idx], self.v[layer_idx] = k, v
        T, S = q.shape[0], k.shape[0]
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)          # query i sees keys <= S - T + i
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1)


class PrefillKernelAttention:
    """Causal attention of one sequence's T tokens through a kernel table's `prefill_attention`
    (its K/V as a one-block pool, positions 0..T-1): what an engine's prompt rows compute, for a
    check outside an engine (the builder's verification of the prefill precision)."""

    def __init__(self, prefill_attention):
        self.prefill_attention = prefill_attention

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T, _, D = q.shape
        pool_k, pool_v = (t.transpose(0, 1).unsqueeze(1).contiguous() for t in (k, v))   # [KVH, 1, T, D]
        return self.prefill_attention(q.contiguous(), pool_k, pool_v, [0], T, D ** -0.5).to(q.dtype)
