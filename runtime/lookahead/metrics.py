"""Lookahead metrics: prediction agreement per layer, prefetch hits, urgent fetches, bytes, stalls."""
from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from enum import IntEnum

import torch

from ..device import host_list, to_device


class Col(IntEnum):
    """The columns of the per-lane tallies (`LookaheadMetrics.lane`, a request's `RequestMetrics`)."""
    TRUE = 0            # blocks in the real query's top-K
    HITS = 1            # of those, resident before any urgent fetch
    AGREE_SUM = 2       # sum of |pred ∩ true| / |true| over (layer, head) rows with a prediction
    AGREE_COUNT = 3     # the count of such rows
    URGENT = 4          # blocks fetched urgently
    PREFETCHED = 5      # blocks prefetched


HITS = slice(Col.TRUE, Col.HITS + 1)
AGREEMENT = slice(Col.AGREE_SUM, Col.AGREE_COUNT + 1)


@dataclass
class LookaheadMetrics:
    """Engine-wide tallies, plus per-lane tallies that become a request's metrics when it ends.

    Tallies stay tensors where they are counted, so recording a layer or a step costs a few small
    ops and no host round trip; they are read (through runtime.device's seam) only when asked for:
    `summary`, `per_layer_agreement`, `take_lane` (a request's metrics, when it ends).
    """

    num_layers: int
    num_lanes: int = 1
    device: torch.device = torch.device("cpu")     # where the tallies live: beside what they count

    def __post_init__(self) -> None:
        f64 = dict(dtype=torch.float64, device=self.device)
        # per layer: sum of |pred ∩ true| / |true| over (lane, head), and the count of such rows
        self.layer = torch.zeros(self.num_layers, 2, **f64)
        # blocks in the real query's top-K over steps/layers/heads, and those resident before any
        # urgent fetch
        self.blocks = torch.zeros(2, **f64)
        self.lane = torch.zeros(self.num_lanes, len(Col), **f64)        # per lane, by `Col`
        self._counts: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []   # count_blocks calls not yet added
        # blocks admitted for copying, (urgent, prefetched): exact counts on the host, plus those
        # of fixed-capacity lists, counted where the lists are
        self._blocks_host = [0, 0]
        self._blocks_dev: torch.Tensor | None = None

    @property
    def urgent_blocks(self) -> int:
        return self._block_totals()[0]

    @property
    def prefetched_blocks(self) -> int:
        return self._block_totals()[1]

    def _block_totals(self) -> list[int]:
        self.flush()
        if self._blocks_dev is not None:
            for i, n in enumerate(host_list(self._blocks_dev, "metrics (urgent/prefetched blocks)")):
                self._blocks_host[i] += n
            self._blocks_dev = None
        return list(self._blocks_host)

    # ---- one step: tallied once, at its end (LookaheadStep.finish) ------------------------------
    def add_blocks(self, urgent: bool, lanes: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Blocks admitted for copying, one per entry of `lanes` (where `valid`, for a fixed-capacity
        list): fetched urgently or prefetched."""
        if valid is None:
            self._blocks_host[0 if urgent else 1] += lanes.numel()
        # a fixed-capacity list's count is added where it is, at `flush` (one sum a step, not a layer)
        self.count_blocks(Col.URGENT if urgent else Col.PREFETCHED, lanes, valid)

    def add_hits(self, lanes, true: torch.Tensor, resident: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The true blocks and hits of a step's layers: lanes [B] (or a slice); true [L, B, KVH,
        K] logical blocks (-1 pad), resident [L, B, KVH, K] bool. All that `record_step` tallies
        when no layer has a prediction (a `draft none` step is tallied by this alone).
        Returns (valid, n_true) for the agreement."""
        valid = true >= 0
        n_true = valid.sum(-1).double()                                        # [L, B, KVH]
        hits = (resident & valid).sum(-1).double()
        self.blocks += torch.stack([n_true.sum(), hits.sum()])
        self.lane[lanes, HITS] += torch.stack([n_true.sum((0, 2)), hits.sum((0, 2))], -1)
        return valid, n_true

    def count_blocks(self, column: Col, lanes: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add one per entry of `lanes` (where `valid`) to a per-lane column (URGENT, PREFETCHED). Added at `flush` (the end of a step, or before a lane is read): one
        accumulation per column and step, not per layer."""
        self._counts.append((column, lanes, valid))

    def flush(self) -> None:
        """The counts of the step so far: per lane, and the fixed-capacity lists' engine totals."""
        counts, self._counts = self._counts, []
        for column in (Col.URGENT, Col.PREFETCHED):
            rec = [(ln, v) for c, ln, v in counts if c == column]
            if not rec:
                continue
            lanes = torch.cat([ln for ln, _ in rec])
            taken = torch.cat([torch.ones_like(ln, dtype=torch.bool) if v is None else v for ln, v in rec])
            self.lane.index_put_((lanes, torch.full_like(lanes, column)), taken.to(self.lane.dtype), accumulate=True)
            if any(v is not None for _, v in rec):
                fixed = taken if all(v is not None for _, v in rec) else torch.cat([v for _, v in rec if v is not None])
                if self._blocks_dev is None:
                    self._blocks_dev = torch.zeros(2, dtype=torch.long, device=fixed.device)
                self._blocks_dev[column - Col.URGENT] += fixed.sum()

    def take_lane(self, lane: int) -> "RequestMetrics":
        """A finished request's metrics (read from the device when first looked at); resets the
        lane for its next sequence."""
        self.flush()
        row = self.lane[lane].clone()
        self.lane[lane] = 0
        return RequestMetrics(row)

    def record_step(self, layers: list[int], lanes, pred: torch.Tensor, has_pred: torch.Tensor,
                    true: torch.Tensor, resident: torch.Tensor) -> None:
        """The layers of one step at once: lanes [B] (or a slice); pred, true [L, B, KVH, K] logical
        blocks (-1 pad); resident [L, B, KVH, K] bool, for `true`; has_pred [L] bool (False: the
        layer had no prediction yet, its agreement is not counted)."""
        valid, n_true = self.add_hits(lanes, true, resident)
        # membership by binary search in the sorted prediction (fixed shapes, no host read)
        ranked = pred.sort(-1).values
        at = torch.searchsorted(ranked, true.contiguous()).clamp(max=ranked.shape[-1] - 1)
        both = (ranked.gather(-1, at) == true) & valid
        rows = (n_true > 0) & has_pred[:, None, None]
        frac = torch.where(rows, both.sum(-1).double() / n_true.clamp(min=1), 0.0)   # [L, B, KVH]
        # the layers as a slice (a decode step notes them all, in order) or a tensor where the
        # tallies are: a Python list would index a device tensor through a synchronous upload
        at = (slice(layers[0], layers[-1] + 1) if layers == list(range(layers[0], layers[-1] + 1))
              else to_device(self.layer.device, torch.tensor(layers, dtype=torch.long))[0])
        self.layer[at] += torch.stack([frac.sum((1, 2)), rows.sum((1, 2)).double()], -1)
        self.lane[lanes, AGREEMENT] += torch.stack([frac.sum((0, 2)), rows.sum((0, 2)).double()], -1)

    def per_layer_agreement(self) -> list[float | None]:
        return [s / c if c else None for s, c in host_list(self.layer, "metrics (agreement per layer)")]

    def summary(self) -> dict:
        per = [a for a in self.per_layer_agreement() if a is not None]
        true, hit = host_list(self.blocks, "metrics (hits)")
        return {
            "agreement_mean": sum(per) / len(per) if per else None,
            "agreement_per_layer": self.per_layer_agreement(),
            "prefetch_hit_rate": hit / true if true else None,
            "urgent_blocks": self.urgent_blocks,
            "prefetched_blocks": self.prefetched_blocks,
        }


class RequestMetrics(MutableMapping):
    """A finished request's metrics: its lane's tallies, kept where they were counted and read
    (through runtime.device's seam) the first time they are looked at, not when the request
    ends. Keys: prefetch_hit_rate, agreement_mean, urgent_blocks, prefetched_blocks, plus what
    is set on it (the draft chain's counts)."""

    def __init__(self, row: torch.Tensor):
        self._row: torch.Tensor | None = row      # [len(Col)]
        self._items: dict = {}

    def _read(self) -> dict:
        if self._row is not None:
            row = host_list(self._row, "metrics (a request's, when read)")
            true, hit, a_sum, a_cnt, urgent, pre = (row[c] for c in Col)
            self._row = None
            self._items = {"prefetch_hit_rate": hit / true if true else None,
                           "agreement_mean": a_sum / a_cnt if a_cnt else None,
                           "urgent_blocks": round(urgent), "prefetched_blocks": round(pre), **self._items}
        return self._items

    def __getitem__(self, key):
        return self._read()[key]

    def __setitem__(self, key, value) -> None:
        self._items[key] = value               # kept over the lane's values when they are read

    def __delitem__(self, key) -> None:
        del self._read()[key]

    def __iter__(self):
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())

    def __repr__(self) -> str:
        return repr(self._read())
