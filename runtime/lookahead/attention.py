"""Lookahead attention backend: the per-layer data flow of docs/ARCHITECTURE.md ("One decode step").

The backend owns no policy and moves no bytes between tiers. Its parts:
    DeviceTier        device_tier.py  the working set's buffers, views, write-through, key mask
    BlockSummaries    summaries.py    kmin/kmax (fp32), their update and the Quest scoring
    ResidencyManager  residency.py    predictions, capped eviction, seeding, urgent/drop, copy jobs
                                      (its policy, policies.py: resident or pingpong)
    LookaheadMetrics  metrics.py      agreement, hits, urgent/prefetched blocks
    check_integrity   integrity.py    the debug check before every attention

For layer l of a decode step (`_decode`):
  1. keep the real rows' K/V for the end of the step: this step they are extra keys;
  2. wait for layer l's tickets only; score the real and the draft query in one read of the
     summaries; the residency manager serves the real query's misses (urgent/drop);
  3. dual-row sparse attention over sink + selected + window, plus the rows' own K/V (the real
     row sees itself, the draft row sees the real row and itself);
  4. the draft query's top-K is the prediction for layer l of the next step, handed to the
     residency manager (resident: admitted, copies queued now; pingpong: refilled later);
  5. after the last layer (`end_step`): store every layer's real rows at once (host pool, block
     summaries, the policy's write-through) and tally the step's metrics. Nothing reads them
     sooner: a block being written is in the window, never a top-K candidate.
Prefill rows use dense attention over the host pool, store their K/V at once, and seed the first
working set. `draft none`: one row per sequence, no step 4 (sparse attention on demand).
"""
from __future__ import annotations

import torch

from ..attention_dense import prefill_attention
from ..config import LookaheadConfig, ModelConfig
from ..kv_pool import KVPool
from ..observe import Observers
from ..ops import Ops
from ..transfer import TransferEngine
from .device_tier import DeviceTier
from .fused_layer import FusedLayer
from .integrity import check_integrity
from .layout import SlotLayout
from .metrics import LookaheadMetrics
from .policies import make_policy
from .residency import ResidencyManager
from .step_plan import DecodePart, PrefillPart, StepPlan
from .summaries import BlockSummaries, SummaryStore

ROWS = {2: ("real", "draft"), 1: ("real",)}     # the query rows of a decode lane (Observer.on_scores)


class LookaheadAttention:
    def __init__(self, mcfg: ModelConfig, cfg: LookaheadConfig, pool: KVPool, num_lanes: int,
                 max_blocks: int, transfer: TransferEngine, device: torch.device, ops: Ops,
                 debug_checks: bool = False, observers: Observers | None = None, fused: bool = True):
        """pool: the host tier (the whole cache); the device tier, the summaries and the
        bookkeeping are allocated on `device`. ops: the engine's kernel table (this module
        builds every shape itself, so they may be the unchecked ones). debug_checks: verify the
        slots' contents before every attention (tests). observers: the engine's hooks. fused: a
        packed decode layer may run as the table's C lookahead layer (fused_layer.py)."""
        self.cfg, self.pool, self.transfer, self.device, self.ops = cfg, pool, transfer, device, ops
        self.observers = observers if observers is not None else Observers()
        self.layout = SlotLayout.from_config(cfg)
        self.num_layers, self.kvh, self.hd = mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim
        self.num_heads = mcfg.num_heads
        self.scale = mcfg.head_dim ** -0.5
        self.max_blocks, self.debug_checks = max_blocks, debug_checks
        policy = make_policy(cfg, mcfg.num_layers)
        self.tier = DeviceTier(self.layout, policy.num_buffers, num_lanes, self.kvh, self.hd, pool.k.dtype, device)
        self.summaries = BlockSummaries(mcfg.num_layers, num_lanes, max_blocks, self.kvh, self.hd, pool.k.dtype,
                                        device, ops)
        self.metrics = LookaheadMetrics(mcfg.num_layers, num_lanes, device=device)
        self.residency = ResidencyManager(cfg, policy, mcfg.num_layers, num_lanes, self.kvh, max_blocks, pool,
                                          self.tier, transfer, self.metrics, self.observers, device, ops)
        # the summaries of named (cached) blocks, for sequences that share them (prefix caching)
        self.store = (SummaryStore(mcfg.num_layers, pool.num_blocks, self.kvh, self.hd)
                      if cfg.prefix_caching else None)
        self.step_idx = 0
        self.plan: StepPlan | None = None       # the current step's (read only)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []   # decode rows, stored at end_step
        # a decode layer in one C call where it applies (fused_layer.py), decided here
        self.fused_layer, self.fused_layer_reason = FusedLayer.make(self) if fused else (None, "fused=False")
        self._fused: FusedLayer | None = None

    # ---- the parts' tensors and sizes (tests, the memory plan, the bench) ------------------------
    dev_k = property(lambda self: self.tier.k)
    dev_v = property(lambda self: self.tier.v)
    kmin = property(lambda self: self.summaries.kmin)
    kmax = property(lambda self: self.summaries.kmax)
    slots = property(lambda self: self.residency.slots)
    num_buffers = property(lambda self: self.tier.num_buffers)

    def working_set_bytes_per_lane(self) -> int:
        """KV working-set bytes one sequence holds in the device tier (dev_k + dev_v)."""
        return self.tier.bytes_per_lane()

    def summary_bytes(self, context_len: int) -> int:
        """Block summaries (kmin + kmax) of a `context_len`-token sequence, all layers."""
        return self.summaries.nbytes(self.num_layers, -(-context_len // self.layout.block_size))

    def device_bytes_per_lane(self) -> int:
        """Device bytes one sequence holds (the budgeted quantity, `device_budget_bytes`): its
        working set and its summaries, sized for `max_blocks`, whatever its context."""
        return self.working_set_bytes_per_lane() + self.summary_bytes(self.max_blocks * self.layout.block_size)

    # ---- lanes and steps ----------------------------------------------------------------------------
    def attach(self, lane: int, block_table: list[int], num_cached: int = 0, prompt_len: int = 0) -> None:
        """A new sequence on `lane`. num_cached: its prompt's first tokens already in the host pool
        (a prefix-cache hit, whole blocks): their summaries come from the store, and the policy
        restores what of them the device tier keeps (resident: the sink and the blocks of the
        prompt's last window); its prefill computes the rest."""
        self.residency.attach(lane, block_table)
        blocks = num_cached // self.layout.block_size
        if blocks:
            logical = list(range(blocks))
            self.store.load(self.summaries, lane, logical, block_table[:blocks])
            lay = self.layout
            kept = [b for b in logical if b < lay.num_sink or b >= lay.window_start(prompt_len)]
            self.residency.policy.restore(self.residency, lane, kept)

    def save_named(self, lane: int, named: list[tuple[int, int]]) -> None:
        """The lane's newly named blocks [(logical, pool block)] keep their summaries in the store."""
        if self.store is not None and named:
            logical, blocks = zip(*named)
            self.store.save(self.summaries, lane, list(logical), list(blocks))

    def begin_step(self, plan: StepPlan) -> None:
        # the last step's stored rows land in the host pool before anything of this step reads it
        # (on a GPU they were copied down asynchronously; the step's token read-back has waited for
        # that copy already, so this finds it done)
        self.pool.settle()
        self.plan = plan
        self.step_idx += 1
        self._pending = []
        self.metrics.begin_step()
        if plan.decode is not None:
            self.tier.set_window_mask(plan.decode)
        self.residency.begin_step(self.step_idx, plan.decode)     # pingpong: the first refills
        fl = self.fused_layer
        self._fused = fl if fl is not None and plan.decode is not None and fl.takes(plan.decode) else None
        if self._fused is not None:
            self._fused.begin_step(plan.decode)

    def end_step(self) -> None:
        """After the last layer: store a decode step's K/V and tally its metrics, all layers at once."""
        pending, self._pending = self._pending, []
        if pending and pending[0][0].shape[0]:      # a step of pre-decoding lanes only stores nothing
            ks, vs = zip(*pending)
            # no host sync: the host pool gets the rows asynchronously (KVPool.settle, next step)
            self._store(slice(0, len(pending)), torch.stack(ks), torch.stack(vs), blocking=False)
        d = self.plan.decode
        if self._fused is not None:
            self._fused.end_step()
        self.metrics.end_step(d.lane_ix if d is not None else None)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.plan
        kr, vr = k[p.real_ix], v[p.real_ix]
        if p.prefill:       # prefill attention and the seed read them at once
            self._store(slice(layer, layer + 1), kr[None], vr[None])
        else:
            # A decode step's rows are read only as extra keys this step (decode attention) and a
            # block being written is never a candidate (it is in the window): store all layers'
            # rows in one go after the last layer (end_step), not three small copies per layer.
            assert len(self._pending) == layer, "decode layers must run in order, all of them"
            self._pending.append((kr, vr))
        out = torch.empty_like(q)
        for part in p.prefill:
            self._prefill(layer, part, q, k, v, out)
        if p.decode is not None:
            self._decode(layer, q, k, v, out, p.decode)
        return out

    # ---- prefill ------------------------------------------------------------------------------------
    def _prefill(self, layer: int, part: PrefillPart, q, k, v, out) -> None:
        """A prompt chunk: causal attention over the chunk (or the pool's prefix, for later chunks);
        the chunk that completes the prompt seeds the first working set."""
        it = part.item
        rows = slice(it.row_start, it.row_start + it.num_tokens)
        if not self.plan.store_only:         # a replayed prefill only stores and seeds
            if it.start_pos == 0:            # the rows as the pool stores them (a no-op at fp32)
                kc, vc = (t[rows].transpose(0, 1).to(self.pool.k.dtype) for t in (k, v))
            else:                            # from the host pool onto the device (a view on CPU)
                kc, vc = (t.to(self.device, non_blocking=True)
                          for t in self.pool.read(layer, it.block_table, it.context_len))
            out[rows] = prefill_attention(q[rows], kc, vc)
        if part.completes_prompt:
            self._seed(layer, part, q[it.row_start + it.num_tokens - 1])

    def _seed(self, layer: int, part: PrefillPart, q_last: torch.Tensor) -> None:
        """The last prompt token's query picks the lane's first working set (uncapped)."""
        lane = part.lane
        pad_q = torch.zeros(lane + 1, *q_last.shape, dtype=q_last.dtype, device=self.device)
        pad_q[lane] = q_last
        idx, scores = self.summaries.score(layer, pad_q, part.seed_valid, lane + 1,
                                           part.item.context_len // self.layout.block_size + 1,
                                           self.cfg.top_k, self.cfg.group_score)
        if self.observers:
            self.observers.scores(layer, ("seed",), [lane], idx[:, None], scores[:, None])
        lanes = part.seed_lane
        self.residency.seed(layer, lane, lanes, idx[lanes], scores[lanes], context_len=part.item.context_len + 1)

    # ---- decode -------------------------------------------------------------------------------------
    def _decode(self, layer: int, q, k, v, out, d: DecodePart) -> None:
        """One layer of the decode lanes: wait, score, serve misses, attend, predict."""
        res = self.residency
        buf = res.buffer_of(layer)
        for ticket in res.take_tickets(layer):
            self.transfer.wait(ticket)
        if self._fused is not None:                 # the steps below in one C call (fused_layer.py)
            self._fused.decode(layer, buf, q, k, v, out, d)
            res.after_layer(layer, d)
            return
        qd = lane_rows(q, d)                                                  # [n, R, H, D]
        # One read of the summaries scores both rows: the real query's true top-K (for `urgent`,
        # and for the agreement metric) and the draft's prediction for the next step (used below).
        # Without look-ahead (R = 1) only the real query is scored, and fetched on demand.
        nb = max(d.context_lens) // self.layout.block_size + 1  # covers this and the next step
        idx, scores = self.summaries.score(layer, qd, d.cand_masks, d.num_lanes, nb, self.cfg.top_k,
                                           self.cfg.group_score)
        if self.observers:
            self.observers.scores(layer, ROWS[d.rows], list(d.lane_list), idx, scores)
        res.serve_misses(layer, buf, d, idx[:, 0], scores[:, 0])
        if self.debug_checks:
            check_integrity(self.tier, res, self.pool, layer, d)
        o = self._attend(buf, qd, k, v, d)
        if d.packed:
            out.view(d.num_lanes, d.rows, *out.shape[1:]).copy_(o)
        else:
            out[d.real_rows] = o[d.lanes, 0]
            if d.rows == 2:
                out[d.draft_rows] = o[d.lanes, 1]
        if d.rows == 2:     # look ahead: the draft query predicts the next step's top-K here
            res.predict(layer, d.lane_ix, idx[d.lane_ix, 1], scores[d.lane_ix, 1], cap=self.cfg.fetch_cap)
        res.after_layer(layer, d)                       # pingpong: refill the buffer just released

    def _attend(self, buf: int, qd: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: DecodePart) -> torch.Tensor:
        """Both rows over the device tier (sink, occupied selected slots, window) plus this step's
        own rows as extra keys -> [n, R, H, D]."""
        n, slots = d.num_lanes, self.residency.slots
        # selected slots past `high` are empty in every lane: at a short context most of the K
        # slots are, and the torch path reads every slot it is given
        sel = slots.block[buf, :n, :, :slots.high[buf]] >= 0                     # [n, KVH, used]
        if not d.packed:                    # a packed step's lanes all decode
            sel &= d.lane_active[:, None, None]
        kb, vb, mask = self.tier.keys(buf, n, sel)                               # views, no gather
        # this step's own rows are extra keys (the device tier does not hold them yet, see
        # forward): the real row sees itself; the draft row sees the real row and itself
        kx, vx = (lane_rows(t, d, contiguous=False).transpose(1, 2) for t in (k, v))   # [n, KVH, R, D]
        return self.ops.lookahead_attention(qd, kb, vb, mask, kx, vx, d.extra_mask, self.scale)

    # ---- storing ------------------------------------------------------------------------------------
    def _store(self, layers: slice, ks: torch.Tensor, vs: torch.Tensor, blocking: bool = True) -> None:
        """The step's real rows of `layers`, ks/vs [L', T_real, KVH, D]: into the host pool, the
        block summaries and (as the residency policy says) the device sink/window slots.
        blocking: the host pool holds them on return (prefill: later chunks read them at once);
        else they land by `KVPool.settle` (a decode step's rows: nothing reads them this step)."""
        p = self.plan
        self.pool.write_layers(layers, ks, vs, p.pool_blocks, p.pool_offsets, blocking=blocking)
        self.summaries.update(layers, ks, p.real_lanes, p.real_logical, p.batch.slot_offsets)
        self.residency.policy.store(self.tier, layers, ks, vs, p)


def lane_rows(x: torch.Tensor, d: DecodePart, contiguous: bool = True) -> torch.Tensor:
    """The step's rows [T, heads, D] as [n, R, heads, D] by lane: a view when packed (made
    contiguous when asked: scoring and attention read the queries so)."""
    n, R = d.num_lanes, d.rows
    if d.packed:                        # rows already are [lane, (real, draft)]
        rows = x.view(n, R, x.shape[1], x.shape[2])
        return rows.contiguous() if contiguous else rows
    out = x.new_zeros(n, R, x.shape[1], x.shape[2])
    out[d.lanes, 0] = x[d.real_rows]
    if R == 2:
        out[d.lanes, 1] = x[d.draft_rows]
    return out
