"""Lookahead metrics: prediction agreement per layer, prefetch hits, urgent fetches, bytes, stalls."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LookaheadMetrics:
    """Engine-wide tallies, plus per-lane tallies that become a request's metrics when it ends."""

    num_layers: int
    num_lanes: int = 1
    agree_sum: list[float] = field(default_factory=list)    # per layer: sum of |pred ∩ true| / |true|
    agree_cnt: list[int] = field(default_factory=list)
    true_blocks: int = 0             # blocks in the real query's top-K, summed over steps/layers/heads
    hit_blocks: int = 0              # ... of which were resident before any urgent fetch
    urgent_blocks: int = 0
    prefetched_blocks: int = 0

    def __post_init__(self) -> None:
        self.agree_sum = [0.0] * self.num_layers
        self.agree_cnt = [0] * self.num_layers
        # per lane: true blocks, hits, agreement sum, agreement count, urgent, prefetched
        self.lane = torch.zeros(self.num_lanes, 6, dtype=torch.float64)

    def count_blocks(self, column: int, lanes: torch.Tensor) -> None:
        """Add one per entry of `lanes` to a per-lane column (4: urgent, 5: prefetched)."""
        self.lane[:, column] += torch.bincount(lanes, minlength=self.num_lanes).double()

    def take_lane(self, lane: int) -> dict:
        """A finished request's metrics; resets the lane for its next sequence."""
        true, hit, a_sum, a_cnt, urgent, pre = self.lane[lane].tolist()
        self.lane[lane] = 0
        return {"prefetch_hit_rate": hit / true if true else None,
                "agreement_mean": a_sum / a_cnt if a_cnt else None,
                "urgent_blocks": int(urgent), "prefetched_blocks": int(pre)}

    def record_layer(self, layer: int, lanes: torch.Tensor, pred: torch.Tensor | None, true: torch.Tensor,
                     resident: torch.Tensor) -> None:
        """lanes [B]; pred, true: [B, KVH, K] logical blocks (-1 pad); resident: bool, for `true`."""
        valid = true >= 0
        n_true = valid.sum(-1)                                                 # [B, KVH]
        hits = (resident & valid).sum(-1)
        self.true_blocks += int(n_true.sum())
        self.hit_blocks += int(hits.sum())
        self.lane[lanes, 0] += n_true.sum(-1).double()
        self.lane[lanes, 1] += hits.sum(-1).double()
        if pred is None:
            return
        both = ((true[..., :, None] == pred[..., None, :]) & (pred >= 0)[..., None, :]).any(-1) & valid
        rows = n_true > 0
        if rows.any():
            frac = torch.where(rows, both.sum(-1).double() / n_true.clamp(min=1), 0.0)   # [B, KVH]
            self.agree_sum[layer] += float(frac.sum())
            self.agree_cnt[layer] += int(rows.sum())
            self.lane[lanes, 2] += frac.sum(-1)
            self.lane[lanes, 3] += rows.sum(-1).double()

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
