"""One Llama-family model definition (llama, qwen2, mistral without sliding window).

Attention is delegated: every layer calls `attn.forward(layer_idx, q, k, v)` on the step's
`AttentionBackend`, which stores K/V and computes attention the way the current mode wants
(dense paged, or lookahead sparse). The model never sees a cache.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from plugins.cpu import rms_norm

from .config import ModelConfig
from .ops import Ops, select_ops
from .rope import RotaryEmbedding


class AttentionBackend(Protocol):
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] (post-RoPE) -> out [T, H, D]."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return rms_norm(x, self.weight, self.eps)      # one C call (plugins.cpu) or F.rms_norm
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.wqkv = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.wo = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                attn: AttentionBackend, rope_tables: tuple[torch.Tensor, torch.Tensor] | None,
                ops: Ops) -> torch.Tensor:
        c, linear = self.cfg, ops.linear
        T = x.shape[0]
        qkv = linear(self.attn_norm(x), self.wqkv.weight, self.wqkv.bias)  # [T, q + 2kv]
        # q and k are adjacent in qkv: one rotation covers both heads' sets (half the small ops)
        qk = rope.apply(qkv[:, : c.q_size + c.kv_size].view(T, c.num_heads + c.num_kv_heads, c.head_dim),
                        positions, rope_tables)
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads:]                    # [T, H, D], [T, KVH, D]
        v = qkv[:, c.q_size + c.kv_size:].reshape(T, c.num_kv_heads, c.head_dim)
        o = attn.forward(self.layer_idx, q, k, v)                           # [T, H, D]
        x = x + linear(o.reshape(T, c.q_size), self.wo.weight)
        gate, up = linear(self.mlp_norm(x), self.w13.weight).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, self.w2.weight)


class LlamaModel(nn.Module):
    """tokens [T] + positions [T] -> hidden [T, hidden]; `logits(hidden)` -> [N, vocab].

    `device` is where the RoPE tables (and, unless `empty`, the parameters) are made; `ops` the
    implementations its projections call (default: `select_ops(device, dtype)`).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 empty: bool = False, ops: Ops | None = None):
        super().__init__()
        self.cfg = cfg
        self.ops = ops or select_ops(torch.device(device), dtype)
        # empty=True: parameters on the meta device (no init cost); load_weights assigns real ones
        with torch.device("meta" if empty else device):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = (None if cfg.tie_word_embeddings
                            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        if not empty:
            self.to(device=device, dtype=dtype)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                    cfg.rope_scaling, dtype, device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        tables = self.rope.tables(positions)
        for layer in self.layers:
            x = layer(x, positions, self.rope, attn, tables, self.ops)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.ops.linear(hidden, w).float()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load runtime-layout tensors (see engine_dir.WEIGHT_LAYOUT); strict on names and shapes.
        The parameters take the tensors' device (load them where the model runs)."""
        self.load_state_dict(tensors, strict=True, assign=True)

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> "LlamaModel":
        """A model with small random weights, for unit tests and GPU timing in a real shape."""
        g = torch.Generator().manual_seed(seed)
        m = cls(cfg, dtype=dtype)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
        return m
