"""Lookahead metrics: prediction agreement per layer, prefetch hits, urgent fetches, bytes, stalls."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LookaheadMetrics:
    num_layers: int
    agree_sum: list[float] = field(default_factory=list)    # per layer: sum of |pred ∩ true| / |true|
    agree_cnt: list[int] = field(default_factory=list)
    true_blocks: int = 0             # blocks in the real query's top-K, summed over steps/layers/heads
    hit_blocks: int = 0              # ... of which were resident before any urgent fetch
    urgent_blocks: int = 0
    prefetched_blocks: int = 0

    def __post_init__(self) -> None:
        self.agree_sum = [0.0] * self.num_layers
        self.agree_cnt = [0] * self.num_layers

    def record_layer(self, layer: int, pred: torch.Tensor | None, true: torch.Tensor,
                     resident: torch.Tensor) -> None:
        """pred, true: [B, KVH, K] logical blocks (-1 pad); resident: bool [B, KVH, K] for `true`."""
        valid = true >= 0
        n_true = valid.sum(-1)                                                 # [B, KVH]
        self.true_blocks += int(n_true.sum())
        self.hit_blocks += int((resident & valid).sum())
        if pred is None:
            return
        both = ((true[..., :, None] == pred[..., None, :]) & (pred >= 0)[..., None, :]).any(-1) & valid
        rows = n_true > 0
        if rows.any():
            frac = both.sum(-1)[rows].float() / n_true[rows].float()
            self.agree_sum[layer] += float(frac.sum())
            self.agree_cnt[layer] += int(rows.sum())

    def per_layer_agreement(self) -> list[float | None]:
        return [s / c if c else None for s, c in zip(self.agree_sum, self.agree_cnt)]

    def summary(self) -> dict:
        per = [a for a in self.per_layer_agreement() if a is not None]
        return {
            "agreement_mean": sum(per) / len(per) if per else None,
            "agreement_per_layer": self.per_layer_agreement(),
            "prefetch_hit_rate": self.hit_blocks / self.true_blocks if self.true_blocks else None,
            "urgent_blocks": self.urgent_blocks,
            "prefetched_blocks": self.prefetched_blocks,
        }
