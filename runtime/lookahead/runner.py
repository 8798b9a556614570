"""Lookahead model runner: builds dual-row decode steps (real + draft token per sequence)."""
from __future__ import annotations

import torch

from ..draft import DraftSource
from ..model import LlamaModel
from ..prefill_cache import PrefillCache
from ..sequence import Sequence
from ..step import StepBatch, StepItem
from .attention import LookaheadAttention
from .step_plan import PrefillPart, StepPlan, build_decode_part


class LookaheadRunner:
    def __init__(self, model: LlamaModel, attn: LookaheadAttention, block_size: int, draft: DraftSource | None,
                 num_lanes: int, prefill_cache: PrefillCache | None = None):
        """draft None: sparse attention without look-ahead (one row per sequence, no prediction)."""
        self.model, self.attn, self.block_size, self.draft = model, attn, block_size, draft
        self.prefill_cache = prefill_cache
        self.free_lanes = list(range(num_lanes))
        self.lanes: dict[int, int] = {}
        self.guess: dict[int, int] = {}          # seq_id -> argmax of its last draft row
        self.last_draft: dict[int, int] = {}     # seq_id -> draft token run at the last step
        self.draft_hits = self.draft_total = 0
        self.seq_drafts: dict[int, list[int]] = {}     # seq_id -> [accepted, proposed]

    def _lane(self, seq: Sequence) -> int:
        if seq.seq_id not in self.lanes:
            lane = min(self.free_lanes)          # low lanes first: the computed lane range stays small
            self.free_lanes.remove(lane)
            self.lanes[seq.seq_id] = lane
            self.attn.attach(lane, seq.block_table)
        return self.lanes[seq.seq_id]

    def release(self, seq: Sequence) -> None:
        """Free the sequence's lane and file its per-request metrics on it."""
        lane = self.lanes.pop(seq.seq_id, None)
        if lane is not None:
            self.free_lanes.append(lane)
            acc, tot = self.seq_drafts.pop(seq.seq_id, [0, 0])
            seq.metrics = {**self.attn.metrics.take_lane(lane),
                           "draft_accept_rate": acc / tot if tot else None}
        self.guess.pop(seq.seq_id, None)
        self.last_draft.pop(seq.seq_id, None)

    def run(self, work: list[tuple[Sequence, int]]) -> dict[int, torch.Tensor]:
        bs = self.block_size
        for seq, _ in work:                  # rows in lane order: a full decode batch packs (step_plan)
            self._lane(seq)
        work = sorted(work, key=lambda w: self.lanes[w[0].seq_id])
        tokens, positions, items, prefill = [], [], [], []
        real_rows, real_lanes, blocks, offsets, keep = [], [], [], [], []
        dec_lanes, dec_real, dec_draft, dec_ctx, dec_seqs = [], [], [], [], []
        for seq, n in work:
            lane, start, row = self._lane(seq), seq.num_cached, len(tokens)
            w0 = self.attn.layout.window_start(start + n)
            for p in range(start, start + n):
                keep.append(p // bs < self.attn.layout.num_sink or p // bs >= w0)
                real_rows.append(len(tokens))
                real_lanes.append(lane)
                blocks.append(seq.block_table[p // bs])
                offsets.append(p % bs)
                tokens.append(seq.token_at(p))
                positions.append(p)
            item = StepItem(seq.seq_id, row, n, start, seq.block_table)
            items.append(item)
            if seq.in_prefill:
                prefill.append(PrefillPart(item, lane, start + n == len(seq.prompt_ids)))
            else:
                dec_lanes.append(lane), dec_real.append(row), dec_ctx.append(start + 1), dec_seqs.append(seq)
                if self.draft is None:
                    continue
                real = seq.token_at(start)
                prev = self.last_draft.get(seq.seq_id)
                if prev is not None:
                    self.draft_total += 1
                    self.draft_hits += int(prev == real)
                    tally = self.seq_drafts.setdefault(seq.seq_id, [0, 0])
                    tally[0] += int(prev == real)
                    tally[1] += 1
                ctx = seq.prompt_ids + seq.output_ids
                d = self.draft.propose(ctx, self.guess.get(seq.seq_id))
                self.last_draft[seq.seq_id] = d
                dec_draft.append(len(tokens))
                tokens.append(d)
                positions.append(start + 1)
        t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        batch = StepBatch(items, t(tokens), t(positions), t(blocks), t(offsets))
        logical = t(positions)[t(real_rows)] // bs
        decode = (build_decode_part(self.attn.layout, dec_lanes, dec_real, dec_draft, dec_ctx,
                                    self.attn.max_blocks, only_decode=not prefill) if dec_lanes else None)
        plan = StepPlan(batch, t(real_rows), t(real_lanes), logical,
                        slice(None) if all(keep) else torch.tensor(keep, dtype=torch.bool), prefill, decode)
        if decode is not None and decode.packed:
            plan.real_ix = decode.real_ix
        else:
            plan.real_ix = plan.real_rows
        self.attn.begin_step(plan)
        cache, num_layers = self.prefill_cache, len(self.model.layers)
        if cache is not None and (replay := cache.replay(self.model, work, items)) is not None:
            out = replay.run(self.attn, num_layers)
            self.attn.end_step()
            for seq, n in work:
                seq.num_cached += n
            return out
        rec = cache.record(self.model, work, items) if cache is not None else None
        hidden = self.model(batch.tokens, batch.positions, rec.wrap(self.attn, num_layers) if rec else self.attn)
        self.attn.end_step()
        for seq, n in work:
            seq.num_cached += n
        sample_rows, sample_seqs = [], []
        for part in prefill:
            if part.completes_prompt:
                sample_rows.append(part.item.row_start + part.item.num_tokens - 1)
                sample_seqs.append(next(s for s, _ in work if s.seq_id == part.item.seq_id))
        sample_rows += dec_real
        sample_seqs += dec_seqs
        out = {}
        if sample_rows or dec_draft:
            logits = self.model.logits(hidden[t(sample_rows + dec_draft)])
            for i, seq in enumerate(dec_seqs if dec_draft else []):   # the draft row's guess for the step after next
                self.guess[seq.seq_id] = int(logits[len(sample_rows) + i].argmax())
            out = {seq.seq_id: logits[i] for i, seq in enumerate(sample_seqs)}
        if rec:
            rec.finish(out)
        return out

    def stats(self) -> dict:
        a, tr = self.attn, self.attn.transfer
        m = a.metrics.summary()
        return {
            "h2d_bytes": tr.h2d_bytes,
            "device_resident_bytes": a.device_bytes_per_lane() * len(self.lanes),
            "device_bytes_per_seq": a.device_bytes_per_lane(),
            "prefetch_hit_rate": m["prefetch_hit_rate"],
            "urgent_blocks": m["urgent_blocks"],
            "prefetched_blocks": m["prefetched_blocks"],
            "transfer_wait_s": tr.wait_s,
            "agreement_mean": m["agreement_mean"],
            "agreement_per_layer": m["agreement_per_layer"],
            "draft_accept_rate": self.draft_hits / self.draft_total if self.draft_total else None,
        }
