"""A lookahead decode layer in one C call (plugins/cpu/lookahead_layer.py), and its accounting.

Under the resident policy on CPU (sparse-ondemand, lookahead-resident, lookahead-drop), a packed
decode step's layer runs as one kernel call instead of the backend's ~40-60 torch ops around
five to seven: score both rows, note the real row's hits, admit and copy the misses its miss
policy fetches, attend, and (with the draft row) record and admit the prediction. Around the
call this keeps what the Python path does as it goes, from the call's outputs:
- the metrics get the same `note_layer` inputs (the true set and what of it was held, written
  by the call into this step's buffers), and the urgent blocks per lane at the end of the step;
- the transfer engine counts the urgent copy (bytes, a job, its seconds as stall); the
  prediction's admissions go to `ResidencyManager.submit` as a background job, as before;
- the slot table's `high` grows as `SlotTable.plan` grows it;
- drop's first-step fetch, and its seed flags, as `ResidencyManager.serve_misses` has them.
Everything equals the Python path's bit for bit (tests/test_fused_lookahead.py). That path stays
the reference and runs wherever this does not apply: another device or residency, a step with
prefill rows or inactive lanes, debug checks, an observer of scores or copies, or
LOOKAHEAD_FUSED_DECODE=0.
"""
from __future__ import annotations

import os

import torch

from plugins.cpu.lookahead_layer import LookaheadLayer

from ..model import FUSED_ENV
from .residency import Admission
from .step_plan import DecodePart


class FusedLayer:
    def __init__(self, attn, layer: LookaheadLayer):
        self.attn, self.layer = attn, layer
        self.rows = 1 if attn.cfg.draft == "none" else 2
        self.steps = 0          # steps whose decode layers ran here

    @classmethod
    def make(cls, attn) -> tuple["FusedLayer | None", str | None]:
        """(the fused layer for this backend, None), or (None, why not)."""
        cfg = attn.cfg
        if os.environ.get(FUSED_ENV, "1") == "0":
            return None, f"{FUSED_ENV}=0"
        if attn.device.type != "cpu":
            return None, f"device {attn.device.type}"
        if cfg.residency != "resident" or cfg.miss_policy not in ("urgent", "drop"):
            return None, f"residency {cfg.residency}, miss policy {cfg.miss_policy}"
        layer = LookaheadLayer.bind(*cls._tensors(attn), heads=attn.num_heads, sel_start=attn.layout.selected_start,
                                    group_max=cfg.group_score == "max")
        if layer is None:
            return None, "the C kernels or the tensors' layouts"
        return cls(attn, layer), None

    @staticmethod
    def _tensors(a) -> tuple[torch.Tensor, ...]:
        res, slots = a.residency, a.residency.slots
        return (a.summaries.kmin, a.summaries.kmax, a.pool.k, a.pool.v, a.tier.k, a.tier.v, a.tier.mask,
                slots.block, slots.last_used, slots.slot_of, res.lane_blocks, res.pred, res.has_pred)

    def takes(self, d: DecodePart) -> bool:
        """Whether this step's decode layers run here (checked once a step)."""
        a = self.attn
        return (d.packed and d.rows == self.rows and not a.debug_checks and not a.plan.prefill
                and not (a.observers and (a.observers.wants("on_scores") or a.observers.wants("on_copy")))
                and self.layer.bound_to(*self._tensors(a)))

    def begin_step(self, d: DecodePart) -> None:
        a, n = self.attn, d.num_lanes
        K, kvh = a.cfg.top_k, a.kvh
        self.steps += 1
        self._true = torch.empty(a.num_layers, n, kvh, K, dtype=torch.int64)     # note_layer's, per layer
        self._resident = torch.empty(a.num_layers, n, kvh, K, dtype=torch.bool)
        self._urgent = torch.zeros(n, dtype=torch.int64)
        self._urgent_total = 0
        self._pred_adm = torch.empty(4, n * kvh * K, dtype=torch.int64)
        self._extra = d.extra_mask.contiguous()       # may be an expanded view
        self._cand = d.cand_masks if d.cand_masks.stride(-1) == 1 else d.cand_masks.contiguous()
        self._fetch_all = torch.full((n,), a.cfg.miss_policy == "urgent", dtype=torch.bool)

    def decode(self, layer: int, buf: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               d: DecodePart) -> None:
        """Layer `layer` of the step's lanes (q [n*R, H, D], k, v [n*R, KVH, D], out like q)."""
        a, res = self.attn, self.attn.residency
        slots, top_k, n = res.slots, a.cfg.top_k, d.num_lanes
        # what ResidencyManager.serve_misses notes before anything changes (with the draft row:
        # without it there is no prediction to score, and end_step adds the hits at once)
        if self.rows == 2:
            pred, has = res.pred[layer, :n].clone(), res.has_pred[layer, :n].all()
        fetch, reseeded = self._fetch_all, False
        if a.cfg.miss_policy == "drop" and any(res.seeded_host[layer][lane] or pre
                                               for lane, pre in zip(d.lane_list, d.predecode_list)):
            fetch, reseeded = (res.seeded[layer, :n] | d.predecode[:n]).contiguous(), True
        nb = min(max(d.context_lens) // a.layout.block_size + 1, a.summaries.max_blocks)
        high = slots.high[buf]
        grown = max(high, min(top_k, high + top_k, res.most))           # SlotTable.plan's bound, cap K
        o = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
        r = self.layer.run(layer, buf, q.contiguous(), k.contiguous(), v.contiguous(), o, self._cand, self._extra,
                           fetch, nb, min(top_k, nb), res.step_idx, high, grown, a.scale, self._true[layer],
                           self._resident[layer], self._urgent, a.cfg.fetch_cap, self._pred_adm)
        if o is not out:
            out.copy_(o)
        if self.rows == 2:
            a.metrics.note_layer(layer, pred, has, self._true[layer], self._resident[layer])
        if reseeded:
            res.seeded[layer, :n] = False
            for lane in d.lane_list:
                res.seeded_host[layer][lane] = False
        if r.admitted:
            slots.high[buf] = grown
            a.transfer.account_inline(r.admitted, urgent=True, seconds=r.copy_s,
                                      unit_bytes=2 * a.layout.block_size * a.hd * a.pool.k.element_size())
            self._urgent_total += r.admitted
        if r.predicted:     # the resident policy's on_predict, after SlotTable.plan admitted them
            h = slots.high[buf]
            slots.high[buf] = max(h, min(top_k, h + min(a.cfg.fetch_cap, top_k), res.most))
            adm = Admission(*self._pred_adm.view(4, -1)[:, :r.predicted].clone().unbind(0))
            res.tickets.setdefault(layer, []).append(res.submit(layer, layer, adm))

    def end_step(self) -> None:
        """The step's urgent blocks per lane into the metrics (what add_blocks gave the Python
        path), and without the draft row its true blocks and hits (what note_layer gave it: with
        no prediction, record_step adds nothing else)."""
        m = self.attn.metrics
        if self.rows == 1:
            m.add_hits(slice(0, self._true.shape[1]), self._true, self._resident)
        m.add_urgent(self._urgent, self._urgent_total)
