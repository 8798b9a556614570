"""Rotary position embeddings (HF "rotate_half" convention) with the scalings the builder accepts."""
from __future__ import annotations

import math
from typing import Any

import torch

from .errors import ConfigError

SUPPORTED_ROPE_SCALING = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (fp32), scaled as `scaling` says."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        lo, hi = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()
    raise ConfigError("rope_scaling.rope_type", f"{kind!r} is not supported",
                      f"supported: {', '.join(SUPPORTED_ROPE_SCALING)}")


class RotaryEmbedding:
    """Precomputed cos/sin tables [max_positions, head_dim]; `apply` rotates q or k in place of a copy."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, dtype: torch.dtype, device: torch.device | str = "cpu"):
        inv = rope_inv_freq(head_dim, theta, scaling).to(device)
        freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)                       # [P, D]
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, D] of `positions` [T]: looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor,
              tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [T, n_heads, D], positions: [T] int64 -> rotated x, same shape. `tables`: this
        step's `tables(positions)`, when the caller has them."""
        cos, sin = tables if tables is not None else self.tables(positions)
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin
