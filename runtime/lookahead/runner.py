"""Lookahead model runner: builds dual-row decode steps (real + draft token per sequence).

One step (`run`): lanes for new sequences, the step's rows (`_rows`, asking the draft chain for
each decoding sequence's draft), the frozen plan (`step_plan.build_plan`), then the forward pass
through the lookahead backend (or the replay of a recorded prefill), and the logits of the rows
that emit; the draft rows' logits wait for the engine's one sampling pass (`take_draws`).
"""
from __future__ import annotations

import functools

import torch

from ..block_manager import LaneAllocator
from ..draft import DraftChain
from ..model import LlamaModel
from ..observe import Observers
from ..prefill_cache import PrefillCache
from ..runner import compile_forward, score_prompt_rows
from ..sampling import PendingDraws
from ..sequence import Sequence
from ..step import Interruptible, StepInterrupted, StepItem
from .attention import LookaheadAttention, StepStats
from .graph import GRAPH_ATTENTION, bound
from .step_plan import StepPlan, StepRows, build_plan


class LookaheadRunner:
    def __init__(self, model: LlamaModel, attn: LookaheadAttention, block_size: int, chain: DraftChain | None,
                 num_lanes: int, prefill_cache: PrefillCache | None = None, observers: Observers | None = None,
                 fused: bool = True, graph: bool = False):
        """chain None: sparse attention without look-ahead (one row per sequence, no prediction).
        fused: a decode-only step runs the model's layers around the attention in C, where the
        model's kernel table has the fused decoder. graph: on the torch table a decode-only step's
        model work runs as one `torch.compile(fullgraph=True)` graph, each layer's lookahead
        attention one opaque op in it (`compile_decode`, runtime/lookahead/graph.py)."""
        self.model, self.attn, self.block_size, self.chain = model, attn, block_size, chain
        self.prefill_cache = prefill_cache
        self.observers = observers if observers is not None else Observers()
        self.lane_ids = LaneAllocator(num_lanes)
        self._draws: PendingDraws | None = None     # this step's draft draws, see take_draws
        self.lanes: dict[int, int] = {}
        self.last_step: StepStats | None = None     # what the backend's last step ran
        self._want_fused = fused
        self._bind_fused()
        self.graph, self.graph_reason = None, "graph=False"     # the compiled decode step, or why not
        if graph:
            self.compile_decode()

    def compile_decode(self, **compile_kwargs) -> str | None:
        """Run the torch table's decode-only steps through `torch.compile(model.forward,
        fullgraph=True, **compile_kwargs)` traced over `graph.GRAPH_ATTENTION` (compiled lazily, at
        the first such step); returns why not where those steps run C (as `DenseRunner`'s)."""
        self.graph, self.graph_reason = compile_forward(self.model, self.attn.ops, self.fused, **compile_kwargs)
        return self.graph_reason

    def _bind_fused(self) -> None:
        """The model's layers around this backend's attention in C, where the model takes it
        (`LlamaModel.fused_decoder`; the host pool's K/V are bound but not used by these calls)."""
        pool = self.attn.pool
        self.fused, self.fused_reason = (self.model.fused_decoder(pool.k, pool.v, self.attn.scale)
                                         if self._want_fused else (None, "fused=False"))
        self._fused_weights = self.model.weights_version

    def _lane(self, seq: Sequence) -> int:
        if seq.seq_id not in self.lanes:
            lane = self.lanes[seq.seq_id] = self.lane_ids.allocate_lane()
            self.attn.attach(lane, seq.block_table, seq.num_prefix_hit, len(seq.prompt_ids))
        return self.lanes[seq.seq_id]

    def named(self, seq: Sequence, named: list[tuple[int, int]]) -> None:
        """The sequence's blocks just named by the prefix cache [(logical, pool block)]: their
        summaries go to the store with them."""
        lane = self.lanes.get(seq.seq_id)
        if lane is not None:
            self.attn.save_named(lane, named)

    def release(self, seq: Sequence) -> None:
        """Free the sequence's lane and file its per-request metrics on it."""
        lane = self.lanes.pop(seq.seq_id, None)
        if lane is not None:
            self.lane_ids.free_lane(lane)
            seq.metrics = self.attn.metrics.take_lane(lane)
        if self.chain is not None:
            seq.metrics.update(self.chain.release(seq.seq_id))

    # ---- one step ---------------------------------------------------------------------------------
    def run(self, work: list[tuple[Sequence, int]], interrupt=None) -> dict[int, torch.Tensor]:
        """Run one step; returns {seq_id: logits [vocab]} for sequences that emit a token (the
        draft rows' draws wait in `take_draws`). interrupt: as `DenseRunner.run` (a prompt-only
        step's check between layers); an interrupted step is finished before `StepInterrupted`
        leaves, so the backend's per-step state stays whole."""
        self._draws = None
        for seq, _ in work:                  # rows in lane order: a full decode batch packs (step_plan)
            self._lane(seq)
        work = sorted(work, key=lambda w: self.lanes[w[0].seq_id])
        rows = self._rows(work)
        cache, num_layers = self.prefill_cache, len(self.model.layers)
        variant = self.attn.prefill_variant
        replay = cache.replay(self.model, work, rows.items, self.attn.pool.dtype, variant) if cache is not None else None
        plan = build_plan(rows, self.attn.layout, self.attn.max_blocks, self.attn.device,
                          store_only=replay is not None)
        if self.observers:
            self.observers.batch(plan.batch)
            self.observers.plan(plan)
        step = self.attn.step(plan)
        if replay is not None:               # the plan says store_only: store and seed, no model
            out = replay.run(step, num_layers)
            self.last_step = step.finish()
            self._advance(work, rows)
            return out
        rec = cache.record(self.model, work, rows.items, self.attn.pool.dtype, variant) if cache is not None else None
        if self._fused_weights != self.model.weights_version:       # load_weights replaced the tensors
            self._bind_fused()
        hidden = None
        if self.fused is not None and rec is None and not plan.prefill and plan.decode is not None:
            # every layer's non-attention stages in one C call each side of the backend's attention
            hidden = self.fused.run_layers(plan.batch.tokens, plan.batch.positions, step.forward)
        if hidden is None and self.graph is not None and rec is None and interrupt is None \
                and not plan.prefill and plan.decode is not None:
            with bound(step):           # each layer's lookahead::attend_layer runs this step's layer
                hidden = self.graph(plan.batch.tokens, plan.batch.positions, GRAPH_ATTENTION)
        if hidden is None:
            backend = rec.wrap(step, num_layers) if rec else step
            try:
                hidden = self.model(plan.batch.tokens, plan.batch.positions,
                                    backend if interrupt is None else Interruptible(backend, interrupt), plan.batch)
            except StepInterrupted:
                self.last_step = step.finish()
                raise
        self.last_step = step.finish()
        if rows.prefill:                     # prompt chunks: their log-probabilities, where asked for
            score_prompt_rows(self.model, hidden, [(seq, it) for (seq, _), it in zip(work, rows.items)])
        self._advance(work, rows)
        out = self._sample_rows(work, rows, plan, hidden)
        if rec:
            rec.finish(out)
        return out

    def _rows(self, work: list[tuple[Sequence, int]]) -> StepRows:
        bs, lay, r = self.block_size, self.attn.layout, StepRows()
        for seq, n in work:
            lane, start, row = self.lanes[seq.seq_id], seq.num_cached, len(r.tokens)
            draft = None
            if not seq.in_prefill and self.chain is not None:
                draft = self.chain.next_draft(seq.seq_id, seq.prompt_ids + seq.output_ids)
            pre = not seq.in_prefill and self.chain is not None and draft is None
            w0 = lay.window_start(start + n)
            for p in range(start, start + n):
                store = None if pre else (lane, seq.block_table[p // bs], p % bs, p // bs < lay.num_sink or p // bs >= w0)
                r.add(seq.token_at(p), p, store)
            r.items.append(StepItem(seq.seq_id, row, 0 if pre else n, start, seq.block_table, prompt=seq.in_prefill))
            if seq.in_prefill:
                r.prefill.append((r.items[-1], lane, start + n == len(seq.prompt_ids)))
                continue
            r.dec_lanes.append(lane), r.dec_real.append(row), r.dec_ctx.append(start + 1)
            r.dec_seqs.append(seq), r.dec_pre.append(pre)
            if self.chain is not None:       # pre-decoding: the current token again, at its own position
                r.dec_draft.append(r.add(seq.token_at(start), start, None) if pre else r.add(draft, start + 1, None))
        return r

    def _advance(self, work: list[tuple[Sequence, int]], r: StepRows) -> None:
        """The cache now holds the step's stored rows (a pre-decoding sequence stored none)."""
        for (seq, n), it in zip(work, r.items):
            seq.num_cached += it.num_tokens

    def _sample_rows(self, work, r: StepRows, plan: StepPlan, hidden: torch.Tensor) -> dict[int, torch.Tensor]:
        """Logits of the rows that emit (prompts that completed, real decode rows that are not
        pre-decoding) -> {seq_id: logits}; the draft and pre-decoding rows' draws -> the chain."""
        emit_rows, emit_seqs = [], []
        for part in plan.prefill:
            if part.completes_prompt:
                emit_rows.append(part.item.row_start + part.item.num_tokens - 1)
                emit_seqs.append(next(s for s, _ in work if s.seq_id == part.item.seq_id))
        for seq, row, pre in zip(r.dec_seqs, r.dec_real, r.dec_pre):
            if not pre:
                emit_rows.append(row), emit_seqs.append(seq)
        if not emit_rows and not r.dec_draft:
            return {}
        # the plan's index of these rows (built on the host with the rest of the plan, moved once)
        assert plan.sample_rows.shape[0] == len(emit_rows) + len(r.dec_draft)
        logits = self.model.logits(hidden[plan.sample_rows])
        if r.dec_draft:     # drawn by the engine with the emitted rows: one copy of ids per step
            seqs = r.dec_seqs
            self._draws = PendingDraws(logits[len(emit_rows):], self.chain.draws(seqs, r.dec_pre),
                                       functools.partial(self.chain.set_guesses, [s.seq_id for s in seqs]))
        return {seq.seq_id: logits[i] for i, seq in enumerate(emit_seqs)}

    def take_draws(self) -> PendingDraws | None:
        """The last step's draft draws, for the engine's sampling pass (once; None if none)."""
        draws, self._draws = self._draws, None
        return draws

    def stats(self) -> dict:
        a, tr = self.attn, self.attn.transfer
        m = a.metrics.summary()
        chain = self.chain.stats() if self.chain is not None else {}
        return {
            "h2d_bytes": tr.h2d_bytes,
            "device_resident_bytes": a.working_set_bytes_per_lane() * len(self.lanes),
            "device_bytes_per_seq": a.working_set_bytes_per_lane(),
            "device_summary_bytes_per_seq": a.device_bytes_per_lane() - a.working_set_bytes_per_lane(),
            "prefetch_hit_rate": m["prefetch_hit_rate"],
            "urgent_blocks": m["urgent_blocks"],
            "prefetched_blocks": m["prefetched_blocks"],
            "transfer_wait_s": tr.wait_s,
            "agreement_mean": m["agreement_mean"],
            "agreement_per_layer": m["agreement_per_layer"],
            "draft_accept_rate": chain.get("draft_accept_rate"),
            "drafts_proposed": chain.get("drafts_proposed", 0),
            "predecode_steps": chain.get("predecode_steps", 0),
            "resyncs": chain.get("resyncs", 0),
        }
