"""A lookahead decode layer in one C call (the kernel table's `lookahead_layer`), and its accounting.

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
- which lanes' misses are fetched is the miss policy's answer (`ResidencyManager.misses`, the
  object the Python path asks), and so is what it keeps of the fetch (drop's seed flags).
Everything equals the Python path's bit for bit (tests/test_fused_lookahead.py). That path stays
the reference and runs wherever this does not apply (decided once, in `make`: another device,
residency or kernel table, debug checks, an engine built with `fused=False`; and per step: a
step with prefill rows or inactive lanes, an observer of scores or copies).
"""
from __future__ import annotations

import torch

from .residency import ALL_LANES, Admission
from .step_plan import DecodePart


class FusedLayer:
    def __init__(self, attn, layer):
        self.attn, self.layer = attn, layer
        self.rows = 1 if attn.cfg.draft == "none" else 2
        self.fetch_cap = attn.cfg.fetch_cap
        self.steps = 0          # steps whose decode layers ran here

    @classmethod
    def make(cls, attn) -> tuple["FusedLayer | None", str | None]:
        """(the fused layer for this backend, None), or (None, why not)."""
        cfg, bind = attn.cfg, attn.ops.lookahead_layer
        if bind is None or attn.device.type != "cpu":
            return None, f"ops {attn.ops.name or 'custom'} on {attn.device.type}"
        if attn.debug_checks:
            return None, "debug checks"
        if cfg.residency != "resident":
            return None, f"residency {cfg.residency}"
        layer = bind(*cls._tensors(attn), heads=attn.num_heads, sel_start=attn.layout.selected_start,
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
        return (d.packed and d.rows == self.rows and not a.plan.prefill
                and not (a.observers and (a.observers.wants("on_scores") or a.observers.wants("on_copy"))))

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
        self._fetch_all = torch.ones(n, dtype=torch.bool)
        self._fetch_none = torch.zeros(n, dtype=torch.bool)

    def decode(self, layer: int, buf: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               d: DecodePart) -> None:
        """Layer `layer` of the step's lanes (q [n*R, H, D], k, v [n*R, KVH, D], out like q)."""
        a, res = self.attn, self.attn.residency
        slots, top_k, n = res.slots, a.cfg.top_k, d.num_lanes
        # what ResidencyManager.serve_misses notes before anything changes (with the draft row:
        # without it there is no prediction to score, and end_step adds the hits at once)
        if self.rows == 2:
            pred, has = res.pred[layer, :n].clone(), res.has_pred[layer, :n].all()
        lanes = res.misses.fetch(res, layer, d)                          # the miss policy's answer
        fetch = (self._fetch_all if lanes is ALL_LANES else self._fetch_none if lanes is None
                 else lanes.contiguous())
        nb = min(max(d.context_lens) // a.layout.block_size + 1, a.summaries.max_blocks)
        high, grown = slots.high[buf], slots.grown(buf, top_k, res.most)     # the urgent plan's bound
        o = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
        r = self.layer.run(layer, buf, q.contiguous(), k.contiguous(), v.contiguous(), o, self._cand, self._extra,
                           fetch, nb, min(top_k, nb), res.step_idx, high, grown, a.scale, self._true[layer],
                           self._resident[layer], self._urgent, self.fetch_cap, self._pred_adm)
        if o is not out:
            out.copy_(o)
        if self.rows == 2:
            a.metrics.note_layer(layer, pred, has, self._true[layer], self._resident[layer])
        if lanes is not None:
            res.misses.fetched(res, layer, d)
        if r.admitted:
            slots.high[buf] = grown
            a.transfer.account_inline(r.admitted, urgent=True, seconds=r.copy_s,
                                      unit_bytes=2 * a.layout.block_size * a.hd * a.pool.k.element_size())
            self._urgent_total += r.admitted
        if r.predicted:     # the resident policy's on_predict, after SlotTable.plan admitted them
            slots.high[buf] = slots.grown(buf, self.fetch_cap, res.most)
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
