"""The host KV pool: the full cache of every sequence, paged in blocks, one tensor per layer.

Layout per layer: k, v `[num_blocks, num_kv_heads, block_size, head_dim]` — one KV head's block is
contiguous, so the lookahead path moves (block, head) units without repacking.
"""
from __future__ import annotations

import torch

from .config import ModelConfig


class KVPool:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 pin_memory: bool = False):
        shape = (cfg.num_layers, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.v = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K plus V, all KV heads, one layer."""
        return 2 * self.num_kv_heads * self.block_size * self.head_dim * self.k.element_size()

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
              block_ids: torch.Tensor, offsets: torch.Tensor) -> None:
        """k, v: [T, KVH, D]; block_ids, offsets: [T] int64 -> stored at those slots."""
        self.k[layer_idx, block_ids, :, offsets] = k
        self.v[layer_idx, block_ids, :, offsets] = v

    def read(self, layer_idx: int, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` tokens of a sequence as k, v `[KVH, length, D]`.

        A contiguous run of block ids is sliced (no gather); otherwise blocks are gathered.
        """
        n = -(-length // self.block_size)
        ids = block_table[:n]
        kl, vl = self.k[layer_idx], self.v[layer_idx]
        if ids[-1] - ids[0] == n - 1 and ids == list(range(ids[0], ids[0] + n)):
            kb, vb = kl[ids[0]:ids[0] + n], vl[ids[0]:ids[0] + n]
        else:
            idx = torch.tensor(ids, dtype=torch.long, device=kl.device)
            kb, vb = kl.index_select(0, idx), vl.index_select(0, idx)
        # [n, KVH, bs, D] -> [KVH, n * bs, D]; the transpose makes one copy of only what is read
        shape = (self.num_kv_heads, n * self.block_size, self.head_dim)
        k = kb.transpose(0, 1).reshape(shape)[:, :length]
        v = vb.transpose(0, 1).reshape(shape)[:, :length]
        return k, v
