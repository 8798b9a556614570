"""Lookahead metrics: prediction agreement per layer, prefetch hits, urgent fetches, bytes, stalls."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LookaheadMetrics:
    """Engine-wide tallies, plus per-lane tallies that become a request's metrics when it ends.

    Tallies stay tensors, so recording a layer costs a few small ops and no host round trip.
    """

    num_layers: int
    num_lanes: int = 1
    urgent_blocks: int = 0
    prefetched_blocks: int = 0
    device: torch.device = torch.device("cpu")     # where the tallies live: beside what they count

    def __post_init__(self) -> None:
        f64 = dict(dtype=torch.float64, device=self.device)
        # per layer: sum of |pred ∩ true| / |true| over (lane, head), and the count of such rows
        self.layer = torch.zeros(self.num_layers, 2, **f64)
        # blocks in the real query's top-K over steps/layers/heads, and those resident before any
        # urgent fetch
        self.blocks = torch.zeros(2, **f64)
        # per lane: true blocks, hits, agreement sum, agreement count, urgent, prefetched
        self.lane = torch.zeros(self.num_lanes, 6, **f64)
        self._counts: list[tuple[int, torch.Tensor]] = []     # count_blocks calls not yet added
        self._layers: list[tuple] = []                          # this step's note_layer calls

    # ---- one step: layers noted as they run, tallied once at the end ---------------------------
    def begin_step(self) -> None:
        self._layers = []                   # a step that failed midway leaves no half tally

    def note_layer(self, layer: int, pred: torch.Tensor, has_pred: torch.Tensor, true: torch.Tensor,
                   resident: torch.Tensor) -> None:
        """One decode layer's prediction (as made at the last step: pass a copy), its real query's
        true top-K and which of those were resident before any fetch; see `record_step`."""
        self._layers.append((layer, pred, has_pred, true, resident))

    def end_step(self, lanes) -> None:
        """The step's noted layers at once (lanes: the decoding lanes, a tensor or a slice)."""
        self.flush()
        rec, self._layers = self._layers, []
        if rec:
            layers, pred, has, true, res = zip(*rec)
            self.record_step(list(layers), lanes, torch.stack(pred), torch.stack(has), torch.stack(true),
                             torch.stack(res))

    def add_blocks(self, urgent: bool, lanes: torch.Tensor) -> None:
        """Blocks admitted for copying, one per entry of `lanes`: fetched urgently or prefetched."""
        if urgent:
            self.urgent_blocks += lanes.numel()
        else:
            self.prefetched_blocks += lanes.numel()
        self.count_blocks(4 if urgent else 5, lanes)

    def count_blocks(self, column: int, lanes: torch.Tensor) -> None:
        """Add one per entry of `lanes` to a per-lane column (4: urgent, 5: prefetched). Added at
        `flush` (the end of a step, or before a lane is read): one bincount per step, not per layer."""
        self._counts.append((column, lanes))

    def flush(self) -> None:
        counts, self._counts = self._counts, []
        for column in (4, 5):
            lanes = [ln for c, ln in counts if c == column]
            if lanes:
                self.lane[:, column] += torch.bincount(torch.cat(lanes), minlength=self.num_lanes).double()

    def take_lane(self, lane: int) -> dict:
        """A finished request's metrics; resets the lane for its next sequence."""
        self.flush()
        true, hit, a_sum, a_cnt, urgent, pre = self.lane[lane].tolist()
        self.lane[lane] = 0
        return {"prefetch_hit_rate": hit / true if true else None,
                "agreement_mean": a_sum / a_cnt if a_cnt else None,
                "urgent_blocks": int(urgent), "prefetched_blocks": int(pre)}

    def record_step(self, layers: list[int], lanes, pred: torch.Tensor, has_pred: torch.Tensor,
                    true: torch.Tensor, resident: torch.Tensor) -> None:
        """The layers of one step at once: lanes [B] (or a slice); pred, true [L, B, KVH, K] logical
        blocks (-1 pad); resident [L, B, KVH, K] bool, for `true`; has_pred [L] bool (False: the
        layer had no prediction yet, its agreement is not counted)."""
        valid = true >= 0
        n_true = valid.sum(-1).double()                                        # [L, B, KVH]
        hits = (resident & valid).sum(-1).double()
        self.blocks += torch.stack([n_true.sum(), hits.sum()])
        self.lane[lanes, :2] += torch.stack([n_true.sum((0, 2)), hits.sum((0, 2))], -1)
        # membership through a per-(layer, lane, head) bitmap of the predicted blocks (column 0 = "-1")
        width = int(torch.maximum(true.max(), pred.max())) + 2
        in_pred = torch.zeros(*pred.shape[:-1], width, dtype=torch.bool, device=pred.device).scatter_(-1, pred + 1, True)
        in_pred[..., 0] = False
        both = in_pred.gather(-1, true + 1) & valid
        rows = (n_true > 0) & has_pred[:, None, None]
        frac = torch.where(rows, both.sum(-1).double() / n_true.clamp(min=1), 0.0)   # [L, B, KVH]
        self.layer[layers] += torch.stack([frac.sum((1, 2)), rows.sum((1, 2)).double()], -1)
        self.lane[lanes, 2:4] += torch.stack([frac.sum((0, 2)), rows.sum((0, 2)).double()], -1)

    def per_layer_agreement(self) -> list[float | None]:
        return [s / c if c else None for s, c in self.layer.tolist()]

    def summary(self) -> dict:
        per = [a for a in self.per_layer_agreement() if a is not None]
        true, hit = self.blocks.tolist()
        return {
            "agreement_mean": sum(per) / len(per) if per else None,
            "agreement_per_layer": self.per_layer_agreement(),
            "prefetch_hit_rate": hit / true if true else None,
            "urgent_blocks": self.urgent_blocks,
            "prefetched_blocks": self.prefetched_blocks,
        }
