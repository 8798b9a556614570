"""Lookahead attention backend: the per-layer data flow of docs/ARCHITECTURE.md ("One decode step").

The backend owns no policy and moves no bytes between tiers. Its parts:
    DeviceTier        device_tier.py  the working set's buffers, views, write-through, key mask,
                                      and its slot geometry (SlotLayout)
    BlockSummaries    summaries.py    kmin/kmax (fp32), their update and the Quest scoring
    ResidencyManager  residency.py    predictions, capped eviction, seeding, urgent/drop, copy jobs,
                                      and its policy (resident or pingpong)
    LookaheadMetrics  metrics.py      agreement, hits, urgent/prefetched blocks
    check_integrity   integrity.py    the debug check before every attention

A step is an object: `step = backend.step(plan)`, then `step.forward(layer, q, k, v)` for every
layer in order, then `step.finish()`. The step owns what lives for one step: the decode rows kept
to be stored at its end, the layers' true sets and hits (the metrics' inputs), the prediction as
it stood when the step began. For layer l of a decode step (`LookaheadStep._decode`):
  1. keep the real rows' K/V for the end of the step: this step they are extra keys;
  2. wait for layer l's tickets only; then one implementation, chosen when the backend is built,
     runs the layer and returns a `LayerResult`: the torch layer (`_decode_torch`, the
     reference) or the C layer (`_decode_c`, plugins/cpu/lookahead_layer.c, bit-equal):
     a. score the real and the draft query in one read of the summaries;
     b. the real query's misses that the miss policy fetches are admitted and copied on the
        urgent queue (the C layer copies with the transfer engine's kernel, handed to it);
     c. dual-row sparse attention over sink + selected + window, plus the rows' own K/V (the
        real row sees itself, the draft row sees the real row and itself); under
        `draft_attention` "own" (a CPU engine's default) the draft row attends its sink, window
        and *its own* top-K from the host pool instead, so that a right draft computes the next
        step's real row ahead (`resolve_draft_attention`);
     d. the draft query's top-K is the prediction for layer l of the next step, admitted by the
        residency policy (resident: capped; pingpong: refilled later);
  3. `ResidencyManager.apply(result)`: the seed flags, the urgent blocks in the metrics, the
     prediction's copies queued, the policy's copies after the layer;
  4. after the last layer (`finish`): store every layer's real rows at once (host pool, block
     summaries, the policy's write-through) and tally the step's metrics. Nothing reads them
     sooner: a block being written is in the window, never a top-K candidate.
Prefill rows use dense attention over the host pool, store their K/V at once, and seed the first
working set. `draft none`: one row per sequence, no step d (sparse attention on demand).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention_dense import prefill_attention
from ..config import LookaheadConfig, ModelConfig
from ..kv_pool import KVPool
from ..observe import Observers
from ..ops import Ops
from ..transfer import TransferEngine
from .device_tier import DeviceTier, SlotLayout
from .integrity import check_integrity
from .metrics import LookaheadMetrics
from .residency import ALL_LANES, Admission, LayerResult, ResidencyManager, make_policy
from .step_plan import DecodePart, PrefillPart, StepPlan
from .prefill_select import PrefillSelection
from .summaries import BlockSummaries, SummaryStore

ROWS = {2: ("real", "draft"), 1: ("real",)}     # the query rows of a decode lane (Observer.on_scores)


@dataclass(frozen=True)
class StepStats:
    """What one step of the backend ran (`LookaheadStep.finish`)."""

    decode_layers: int          # decode layers run
    c_layers: int               # of those, by the C layer


class LookaheadAttention:
    def __init__(self, mcfg: ModelConfig, cfg: LookaheadConfig, pool: KVPool, num_lanes: int,
                 max_blocks: int, transfer: TransferEngine, device: torch.device, ops: Ops,
                 debug_checks: bool = False, observers: Observers | None = None, fused: bool = True,
                 draft_attention: str | None = None):
        """pool: the host tier (the whole cache); the device tier, the summaries and the
        bookkeeping are allocated on `device`. ops: the engine's kernel table (this module
        builds every shape itself, so they may be the unchecked ones). debug_checks: verify the
        slots' contents before every attention (tests). observers: the engine's hooks. fused: a
        decode layer runs as the table's C lookahead layer where it applies (`c_layer`).
        draft_attention: what the draft row attends (`resolve_draft_attention`; None: by device)."""
        self.cfg, self.pool, self.transfer, self.device, self.ops = cfg, pool, transfer, device, ops
        self.observers = observers if observers is not None else Observers()
        self.layout = SlotLayout.from_config(cfg)
        self.num_layers, self.kvh, self.hd = mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim
        self.num_heads = mcfg.num_heads
        self.scale = mcfg.head_dim ** -0.5
        self.max_blocks, self.debug_checks = max_blocks, debug_checks
        self.fetch_cap = cfg.prediction_cap     # a prediction's admissions per (lane, head)
        policy = make_policy(cfg, mcfg.num_layers)
        self.tier = DeviceTier(self.layout, policy.num_buffers, num_lanes, self.kvh, self.hd, pool.k.dtype, device)
        self.summaries = BlockSummaries(mcfg.num_layers, num_lanes, max_blocks, self.kvh, self.hd, pool.k.dtype,
                                        device, ops)
        # a long prompt's later chunks attend to their selected blocks (prefill_top_k > 0), else densely
        self.prefill_select = PrefillSelection(cfg, self.summaries) if cfg.prefill_top_k else None
        self.prefill_variant = (f"sparse(top_k={cfg.prefill_top_k},window={cfg.prefill_window},"
                                f"block={cfg.block_size})" if cfg.prefill_top_k else "dense")
        self.metrics = LookaheadMetrics(mcfg.num_layers, num_lanes, device=device)
        self.residency = ResidencyManager(cfg, policy, mcfg.num_layers, num_lanes, self.kvh, max_blocks, pool,
                                          self.tier, transfer, self.metrics, self.observers, device, ops)
        # the summaries of named (cached) blocks, for sequences that share them (prefix caching)
        self.store = (SummaryStore(mcfg.num_layers, pool.num_blocks, self.kvh, self.hd, self.summaries.dtype)
                      if cfg.prefix_caching else None)
        self.step_idx = 0
        # a step's true sets and hits, every layer and lane (written by either layer, read at finish)
        shape = (mcfg.num_layers, num_lanes, self.kvh, cfg.top_k)
        self.true = torch.empty(shape, dtype=torch.long, device=device)
        self.hits = torch.empty(shape, dtype=torch.bool, device=device)
        self.draft_attention, self.draft_attention_reason = resolve_draft_attention(draft_attention, pool, device)
        # the implementation of a decode layer, chosen once: the C layer, or (None) the torch layer
        self.c_layer, self.c_layer_reason = self._bind_c_layer() if fused else (None, "fused=False")

    def _bind_c_layer(self):
        """(the table's C lookahead layer bound to this backend's tensors, None), or (None, why not)."""
        cfg, bind = self.cfg, self.ops.lookahead_layer
        if bind is None or self.device.type != "cpu":
            return None, f"ops {self.ops.name or 'custom'} on {self.device.type}"
        if self.debug_checks:
            return None, "debug checks"
        if cfg.residency != "resident":
            return None, f"residency {cfg.residency}"
        res, slots = self.residency, self.residency.slots
        layer = bind(self.summaries.kmin, self.summaries.kmax, self.pool.k, self.pool.v, self.tier.k, self.tier.v,
                     self.tier.mask, slots.block, slots.last_used, slots.slot_of, res.lane_blocks, res.pred,
                     res.has_pred, heads=self.num_heads, sel_start=self.layout.selected_start,
                     group_max=cfg.group_score == "max", copy=self.transfer.inline_kernel())
        if layer is None:
            return None, "the C kernels, the transfer engine's copy kernel or the tensors' layouts"
        self._unit_bytes = self.pool.block_bytes // self.kvh     # one (block, KV head) of K and V
        return layer, None

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
            self.residency.restore(lane, [b for b in logical if b < lay.num_sink or b >= lay.window_start(prompt_len)])

    def save_named(self, lane: int, named: list[tuple[int, int]]) -> None:
        """The lane's newly named blocks [(logical, pool block)] keep their summaries in the store."""
        if self.store is not None and named:
            logical, blocks = zip(*named)
            self.store.save(self.summaries, lane, list(logical), list(blocks))

    def step(self, plan: StepPlan) -> "LookaheadStep":
        """The step of `plan`: call its `forward` for every layer, in order, then `finish`."""
        return LookaheadStep(self, plan)

    # ---- prefill ------------------------------------------------------------------------------------
    def _prefill(self, layer: int, p: StepPlan, part: PrefillPart, q, k, v, out) -> None:
        """A prompt chunk: causal attention over the chunk (or the pool's prefix, for later chunks);
        the chunk that completes the prompt seeds the first working set."""
        it = part.item
        rows = slice(it.row_start, it.row_start + it.num_tokens)
        table, length = it.block_table, it.context_len
        if self.prefill_select is not None and it.start_pos > 0 and not p.store_only:
            table, length = self.prefill_select.select(layer, part.lane, q[rows], table, length) or (table, length)
        if not p.store_only and self.ops.prefill_attention is not None and self.device.type == "cpu":
            # the table's prefill kernel, straight from the host pool (stored before this call)
            out[rows] = self.ops.prefill_attention(q[rows], self.pool.k[layer], self.pool.v[layer], table,
                                                   length, self.scale).to(out.dtype)
        elif not p.store_only:               # a replayed prefill only stores and seeds
            if it.start_pos == 0:            # the rows as the pool stores them (a no-op at fp32)
                kc, vc = (t[rows].transpose(0, 1).to(self.pool.k.dtype) for t in (k, v))
            else:                            # from the host pool onto the device (a view on CPU)
                kc, vc = (t.to(self.device, non_blocking=True) for t in self.pool.read(layer, table, length))
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

    # ---- decode: the torch layer --------------------------------------------------------------------
    def _decode_torch(self, layer: int, buf: int, q, k, v, out, d: DecodePart) -> LayerResult:
        """One layer of the decode lanes in torch ops and the table's kernels (the reference)."""
        res, n, L = self.residency, d.num_lanes, d.lane_ix
        qd = lane_rows(q, d)                                                  # [n, R, H, D]
        # One read of the summaries scores both rows: the real query's true top-K (for `urgent`,
        # and for the agreement metric) and the draft's prediction for the next step (used below).
        # Without look-ahead (R = 1) only the real query is scored, and fetched on demand.
        nb = max(d.context_lens) // self.layout.block_size + 1  # covers this and the next step
        if self.observers:
            self.observers.queries(layer, ROWS[d.rows], list(d.lane_list), qd)
        idx, scores = self.summaries.score(layer, qd, d.cand_masks, n, nb, self.cfg.top_k, self.cfg.group_score)
        if self.observers:
            self.observers.scores(layer, ROWS[d.rows], list(d.lane_list), idx, scores)
        true, hits = self.true[layer, :n], self.hits[layer, :n]
        true.copy_(idx[:, 0])
        hits.copy_(res.slots.resident(buf, slice(0, n), true))
        fetch, urgent = res.misses.fetch(res, layer, d), None
        if fetch is not None:
            want = true[L] if fetch is ALL_LANES else torch.where(fetch[L][:, None, None], true[L], -1)
            urgent = res.fetch_urgent(layer, buf, L, want, scores[L, 0])
        if self.debug_checks:
            check_integrity(self.tier, res, self.pool, layer, d)
        # both rows over the tier, as the C layer's "tier" call; under "own" the draft rows are then
        # replaced (the C layer runs the real rows alone there: a row's sums do not depend on the
        # other rows of the call, and the torch formulation's do not on the thread count this way)
        o = self._attend(buf, qd, k, v, d)
        if d.rows == 2 and self.draft_attention == "own":
            self._attend_own(layer, o, idx, qd, k, v, d, min(self.cfg.top_k, nb, self.max_blocks))
        if out is None:                 # a packed step's rows are the attention's output as it is
            out = o.reshape(n * d.rows, *o.shape[2:])
        elif d.packed:
            out.view(n, d.rows, *out.shape[1:]).copy_(o)
        else:
            out[d.real_rows] = o[d.lanes, 0]
            if d.rows == 2:
                out[d.draft_rows] = o[d.lanes, 1]
        predicted = None
        if d.rows == 2:     # look ahead: the draft query predicts the next step's top-K here
            predicted = res.predict(layer, L, idx[L, 1], scores[L, 1], cap=self.fetch_cap)
        return LayerResult(true, hits, fetch is not None, urgent, predicted, out)

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

    def _attend_own(self, layer: int, o: torch.Tensor, idx: torch.Tensor, qd: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, d: DecodePart, k_sel: int) -> None:
        """draft_attention "own": replace the draft rows of `o` [n, 2, H, D] with attention over
        each lane's sink and window blocks (`d.draft_fixed`), then the draft query's own top-K
        (`idx` [n, 2, KVH, top_k], its first k_sel columns), gathered from the host pool (the
        lane's first `d.draft_stored` tokens visible), plus this step's own rows as the draft
        row's extra-mask row says. The C layer reads the same blocks in place, in the same order
        (lkv_attention_heads_table): the same sums, bit for bit."""
        n, bs, kvh = d.num_lanes, self.layout.block_size, self.kvh
        logical = torch.cat([d.draft_fixed[:, None, :].expand(n, kvh, -1), idx[:, 1, :, :k_sel]], dim=2)   # [n, KVH, T]
        lane_blocks = self.residency.lane_blocks[:n]
        safe = logical.clamp(0, lane_blocks.shape[1] - 1)
        blocks = torch.where(logical >= 0, lane_blocks.gather(1, safe.view(n, -1)).view(safe.shape), -1)
        ok = (blocks >= 0) & (blocks < self.pool.k.shape[2])
        pos = logical[..., None] * bs + torch.arange(bs, device=logical.device)              # [n, KVH, T, bs]
        mask = (ok[..., None] & (pos < d.draft_stored[:, None, None, None])).view(n, kvh, -1)
        kp, vp = self.pool.k[layer], self.pool.v[layer]                                       # [KVH, NB, bs, D]
        heads = torch.arange(kvh, device=kp.device)[None, :, None]
        ix = torch.where(ok, blocks, 0).to(kp.device)
        kb, vb = (t[heads, ix].view(n, kvh, -1, t.shape[-1]).to(self.device) for t in (kp, vp))
        kx, vx = (lane_rows(t, d, contiguous=False).transpose(1, 2) for t in (k, v))   # [n, KVH, 2, D]
        own = self.ops.lookahead_attention(qd[:, 1:2].contiguous(), kb, vb, mask.to(self.device), kx, vx,
                                           d.extra_mask[:, 1:2].contiguous(), self.scale)
        o[:, 1] = own[:, 0]

    # ---- decode: the C layer ------------------------------------------------------------------------
    def _decode_c(self, layer: int, buf: int, q, k, v, out, d: DecodePart, extra, fetch_all,
                  fetch_none) -> LayerResult:
        """The same layer as `_decode_torch` in one C call (`c_layer`), bit for bit: the lanes'
        rows as [n * R] lane-major rows (a view when packed, gathered otherwise); `extra`: the
        plan's extra-key mask, contiguous; fetch_all/none: [n] bool."""
        res, slots, n, R, K = self.residency, self.residency.slots, d.num_lanes, d.rows, self.cfg.top_k
        lanes = res.misses.fetch(res, layer, d)                          # the miss policy's answer
        fetch = fetch_all if lanes is ALL_LANES else fetch_none if lanes is None else lanes.contiguous()
        nb = min(max(d.context_lens) // self.layout.block_size + 1, self.max_blocks)
        high, grown = slots.high[buf], slots.grown(buf, K, res.most)         # the urgent plan's bound
        if d.packed:
            rows = [t.contiguous() for t in (q, k, v)]
            o = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
        else:
            rows = [lane_rows(t, d).view(n * R, *t.shape[1:]) for t in (q, k, v)]
            o = torch.empty_like(rows[0])
        true, hits = self.true[layer, :n], self.hits[layer, :n]
        # the layer's admission lists: the prediction's stay referenced by their copy jobs until the
        # next step's layer has waited for them, before this layer's next call writes them again
        urgent_adm, pred_adm = self.c_layer.lists[0, layer], self.c_layer.lists[1, layer]
        r = self.c_layer.run(layer, buf, *rows, o, d.cand_masks, extra, fetch, d.lane_active, nb, min(K, nb),
                             res.step_idx, high, grown, self.scale, true, hits, self.fetch_cap, pred_adm,
                             urgent_adm, *((d.draft_fixed, d.draft_stored) if R == 2 and self.draft_attention == "own"
                                           else ()))
        if not d.packed:
            ov = o.view(n, R, *o.shape[1:])
            out[d.real_rows] = ov[d.lanes, 0]
            if R == 2:
                out[d.draft_rows] = ov[d.lanes, 1]
        elif o is not out:
            out.copy_(o)
        urgent = predicted = None
        if r.admitted:              # copied by the C layer with the transfer engine's kernel
            slots.high[buf] = grown
            self.transfer.account_inline(r.admitted, urgent=True, seconds=r.copy_s, unit_bytes=self._unit_bytes)
            urgent = Admission(*urgent_adm[: 4 * true.numel()].view(4, -1)[:, : r.admitted].unbind(0))
        if r.predicted:             # the resident policy's admissions, as `SlotTable.plan` made them
            slots.high[buf] = slots.grown(buf, self.fetch_cap, res.most)
            predicted = Admission(*pred_adm[: 4 * true.numel()].view(4, -1)[:, : r.predicted].unbind(0))
        return LayerResult(true, hits, lanes is not None, urgent, predicted, out)

    # ---- storing ------------------------------------------------------------------------------------
    def _store(self, p: StepPlan, layers: slice, ks: torch.Tensor, vs: torch.Tensor, blocking: bool = True) -> None:
        """The step's real rows of `layers`, ks/vs [L', T_real, KVH, D]: into the host pool, the
        block summaries and (as the residency policy says) the device sink/window slots.
        blocking: the host pool holds them on return (prefill: later chunks read them at once);
        else they land by `KVPool.settle` (a decode step's rows: nothing reads them this step)."""
        self.pool.write_layers(layers, ks, vs, p.pool_blocks, p.pool_offsets, blocking=blocking)
        self.summaries.update(layers, ks, p.real_lanes, p.real_logical, p.batch.slot_offsets)
        self.residency.policy.store(self.tier, layers, ks, vs, p)


DRAFT_ATTENTION = ("own", "tier")


def resolve_draft_attention(choice: str | None, pool: KVPool, device: torch.device) -> tuple[str, str]:
    """What a lookahead step's draft row attends, and why: "own", its own top-K (the blocks it
    predicts for the next step) with its sink and window, read from the host pool, so that when
    the draft token is right it computes the next step's real row ahead and predicts from that
    row's hidden state (agreement 0.960 -> 0.990 at 32K, docs/results/long-context.md); or "tier", the
    device tier the real row attends (the working set the real row selected). None: "own" where
    the host pool is the device's own memory (a CPU engine: reading it costs what reading the
    tier does), "tier" on a GPU, where the predicted blocks are still on their way to the device
    when the draft row needs them (reading them would put the copy on the critical path)."""
    if choice is not None:
        if choice not in DRAFT_ATTENTION:
            raise ValueError(f"draft_attention: one of {DRAFT_ATTENTION} or None, got {choice!r}")
        return choice, "chosen"
    if pool.k.device == device:
        return "own", f"the host pool is in {device.type} memory: the draft row reads its own top-K in place"
    return "tier", f"the host pool is not in {device.type} memory: the draft row attends the working set"


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


class LookaheadStep:
    """One step of the backend (`LookaheadAttention.step`): `forward` per layer, in order, then
    `finish`. It owns what lives for the step: the decode rows to store at its end, the
    prediction and its presence as they stood when it began (the agreement's inputs), and which
    layer implementation runs its decode layers (the backend's C layer, unless an observer of
    queries, scores or copies is registered: those exist only in the torch layer)."""

    def __init__(self, attn: LookaheadAttention, plan: StepPlan):
        # the last step's stored rows land in the host pool before anything of this step reads it
        # (on a GPU they were copied down asynchronously; the step's token read-back has waited for
        # that copy already, so this finds it done)
        attn.pool.settle()
        attn.step_idx += 1
        self.attn, self.plan = attn, plan
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []   # decode rows, stored at finish
        self.layers = self.c_layers = 0
        d = plan.decode
        if d is not None:
            attn.tier.set_window_mask(d)
        attn.residency.begin_step(attn.step_idx, d)
        if d is None:
            return
        obs = attn.observers
        self._c = attn.c_layer if not (obs and (obs.wants("on_scores") or obs.wants("on_queries") or obs.wants("on_copy"))) else None
        res, L = attn.residency, d.lane_ix
        if d.rows == 2:     # a layer's prediction changes only in its own layer: one copy for all
            self._pred, self._has = res.pred[:, L].clone(), res.has_pred[:, L].all(-1)
        if self._c is not None:
            n = d.num_lanes
            self._c_args = (d.extra_mask.contiguous(),      # (an expanded view in the plan)
                            torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a, p = self.attn, self.plan
        kr, vr = k[p.real_ix], v[p.real_ix]
        if p.prefill:       # prefill attention and the seed read them at once
            a._store(p, slice(layer, layer + 1), kr[None], vr[None])
        else:
            # A decode step's rows are read only as extra keys this step (decode attention) and a
            # block being written is never a candidate (it is in the window): store all layers'
            # rows in one go after the last layer (finish), not three small copies per layer.
            assert len(self._pending) == layer, "decode layers must run in order, all of them"
            self._pending.append((kr, vr))
        if not p.prefill and p.decode is not None and p.decode.packed and self._c is None:
            return self._decode(layer, q, k, v, None, p.decode)     # no buffer: the attention's output
        out = torch.empty_like(q)
        for part in p.prefill:
            a._prefill(layer, p, part, q, k, v, out)
        if p.decode is not None:
            self._decode(layer, q, k, v, out, p.decode)
        return out

    def _decode(self, layer: int, q, k, v, out, d: DecodePart) -> torch.Tensor:
        """One layer of the decode lanes: wait for its copies, run it, apply its result. out: the
        layer's output rows, or None (the torch layer of a packed step: its attention's output,
        returned)."""
        a, res = self.attn, self.attn.residency
        buf = res.buffer_of(layer)
        for ticket in res.take_tickets(layer):
            a.transfer.wait(ticket)
        if self._c is not None:
            r = a._decode_c(layer, buf, q, k, v, out, d, *self._c_args)
            self.c_layers += 1
        else:
            r = a._decode_torch(layer, buf, q, k, v, out, d)
        self.layers += 1
        res.apply(layer, d, r)
        return r.out

    def finish(self) -> StepStats:
        """After the last layer: store a decode step's K/V and tally its metrics, all layers at once."""
        a, p, d = self.attn, self.plan, self.plan.decode
        pending, self._pending = self._pending, []
        if pending and pending[0][0].shape[0]:      # a step of pre-decoding lanes only stores nothing
            ks, vs = zip(*pending)
            # no host sync: the host pool gets the rows asynchronously (KVPool.settle, next step)
            a._store(p, slice(0, len(pending)), torch.stack(ks), torch.stack(vs), blocking=False)
        a.metrics.flush()
        if d is not None and self.layers:
            n, L = d.num_lanes, d.lane_ix
            true, hits = a.true[: self.layers, :n][:, L], a.hits[: self.layers, :n][:, L]
            if d.rows == 2:
                a.metrics.record_step(list(range(self.layers)), L, self._pred, self._has, true, hits)
            else:               # no prediction to score: the hits alone
                a.metrics.add_hits(L, true, hits)
        return StepStats(self.layers, self.c_layers)
