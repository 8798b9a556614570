"""Dense paged attention: every step attends to the whole cached context of each sequence."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins import cpu

from .kv_pool import KVPool
from .step import StepBatch


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row per head without repeating K/V across the GQA group.

    q: [H, D]; k, v: [KVH, L, D] -> [H, D]. fp32 on CPU: plugins/cpu's C kernel (one pass over
    K and V, ~2x torch's matmuls here) where it builds and takes the layout.
    """
    kvh = k.shape[0]
    if q.device.type == "cpu" and cpu.available():
        q4, k4, v4 = q[None, None], k.unsqueeze(0), v.unsqueeze(0)
        none = k4[:, :, :0]                                       # no extra keys
        if cpu.attention_supported(q4, k4, v4, none, none):
            every = torch.ones(1, kvh, k.shape[1], dtype=torch.bool)
            return cpu.attention(q4, k4, v4, every, none, none, torch.zeros(1, 1, 0, dtype=torch.bool), scale)[0, 0]
    qg = q.view(kvh, -1, q.shape[-1])                       # [KVH, G, D]
    probs = torch.softmax((qg @ k.transpose(1, 2)).float() * scale, dim=-1).to(v.dtype)
    return (probs @ v).view(q.shape)                         # [KVH, G, D] -> [H, D]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of n new rows over L = prefix + n cached keys.

    q: [n, H, D]; k, v: [KVH, L, D] -> [n, H, D]
    """
    n, L = q.shape[0], k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)                      # [1, H, n, D]
    kh, vh = k.unsqueeze(0), v.unsqueeze(0)
    if n == L:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:  # row i sits at position L - n + i and sees keys 0..L - n + i
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(diagonal=L - n)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


class DenseAttention:
    """AttentionBackend over a KVPool. Set `batch` before each forward."""

    def __init__(self, pool: KVPool, scale: float):
        self.pool, self.scale = pool, scale
        self.batch: StepBatch | None = None
        self.store_only = False     # a replayed prefill (prefill_cache): store K/V, skip attention

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        self.pool.write(layer_idx, k, v, b.slot_blocks, b.slot_offsets)
        out = torch.empty_like(q)
        if self.store_only:
            return out
        for it in b.items:
            rows = slice(it.row_start, it.row_start + it.num_tokens)
            if it.start_pos == 0:       # whole sequence is in this chunk: no need to read the pool
                kc, vc = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            else:
                kc, vc = self.pool.read(layer_idx, it.block_table, it.context_len)
            if it.num_tokens == 1:
                out[rows] = decode_attention(q[rows][0], kc, vc, self.scale).unsqueeze(0)
            else:
                out[rows] = prefill_attention(q[rows], kc, vc)
        return out
