"""Rotary position embeddings (HF "rotate_half" convention) with the scalings the runtime accepts
(runtime/rope_scaling.py checks them): the frequencies and the factor cos and sin are multiplied by,
as transformers' `ROPE_INIT_FUNCTIONS` compute them. Every path reads these tables (the torch
layers, the fused C decode step), so a scaling needs nothing beyond them."""
from __future__ import annotations

import math
from typing import Any

import torch

from .rope_scaling import check_rope_scaling, rope_type


def rope_parameters(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] fp32, attention factor) for `scaling` (checked here:
    ConfigError naming a bad field). The attention factor multiplies cos and sin (YaRN's; 1.0
    for the others)."""
    check_rope_scaling(scaling)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = rope_type(scaling)
    if kind == "default":
        return inv.float(), 1.0
    if kind == "linear":
        return (inv / float(scaling["factor"])).float(), 1.0
    if kind == "llama3":
        return _llama3(inv, scaling).float(), 1.0
    return _yarn(inv, head_dim, theta, scaling).float(), yarn_attention_factor(scaling)


def _llama3(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """transformers' `_compute_llama3_parameters`: long wavelengths divided by `factor`, short ones
    kept, a smooth blend between `original / low_freq_factor` and `original / high_freq_factor`."""
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - lo) / (hi - lo)
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


def _yarn(inv: torch.Tensor, dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """transformers' `_compute_yarn_parameters`: dimensions that turn more than `beta_fast` times
    over the original context keep their frequency, those under `beta_slow` are divided by
    `factor`, a linear ramp between (its ends floored / ceiled unless `truncate` is false)."""
    factor, old_len = float(s["factor"]), s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001               # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv / factor * (1 - extrapolation) + inv * extrapolation


def yarn_attention_factor(s: dict[str, Any]) -> float:
    """YaRN's factor on cos and sin: `attention_factor`, else 0.1 ln(factor) + 1 (as the ratio of
    that with `mscale` over that with `mscale_all_dim` when both are set and non-zero)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor, mscale, mscale_all_dim = float(s["factor"]), s.get("mscale"), s.get("mscale_all_dim")

    def get_mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    if mscale and mscale_all_dim:
        return float(get_mscale(mscale) / get_mscale(mscale_all_dim))
    return get_mscale()


class RotaryEmbedding:
    """Precomputed cos/sin tables [max_positions, head_dim] (the attention factor applied);
    `apply` rotates q or k in place of a copy. `max_positions`: the positions an engine can run
    (its max_model_len), not the model's max_position_embeddings."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, dtype: torch.dtype, device: torch.device | str = "cpu"):
        inv, self.attention_factor = rope_parameters(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv.to(device))
        emb = torch.cat([freqs, freqs], dim=-1)                       # [P, D]
        self.cos = (emb.cos() * self.attention_factor).to(dtype)
        self.sin = (emb.sin() * self.attention_factor).to(dtype)
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
