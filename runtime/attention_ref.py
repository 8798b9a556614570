"""The simplest attention backend: causal self-attention over one sequence's T tokens, no cache.

Used to verify weights (builder) and as the reference the cached backends are tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class CausalAttention:
    """Full causal attention within the current forward call (one sequence, positions 0..T-1)."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, KVH, D] -> [T, H, D]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(0, 1)
