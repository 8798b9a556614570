"""Lookahead attention backend: the per-layer data flow of docs/ARCHITECTURE.md ("One decode step").

For layer l of a decode step:
  1. keep the real rows' K/V for the end of the step (step 6): this step they are extra keys;
  2. wait for layer l's working set (its ticket only); score the real and the draft query in one
     read of the summaries; under `urgent`, fetch the missing blocks of the real query's true
     top-K on the urgent queue;
  3. dual-row sparse attention over sink + selected + window, plus the rows' own K/V (the real
     row sees itself, the draft row sees the real row and itself);
  4. the draft query's top-K is the prediction for layer l of the next step;
  5. hand it to the residency manager, which admits up to `fetch_cap` blocks per head and queues
     the copies (resident), or remember it for the ping-pong refill of that layer (pingpong).
  6. after the last layer (`end_step`): store every layer's real rows at once (host pool,
     window write-through, block summaries) and tally the step's metrics. Nothing reads them
     sooner: a block being written is in the window, never a top-K candidate.
Prefill rows use dense attention over the host pool, store their K/V at once, and seed the first
working set. `draft none`: one row per sequence, no step 4/5 (sparse attention on demand).
"""
from __future__ import annotations

import torch

from ..attention_dense import prefill_attention
from ..config import LookaheadConfig, ModelConfig
from ..kv_pool import KVPool
from ..ops import Ops
from ..transfer import CopyJob, Ticket, TransferEngine
from .layout import SlotLayout, num_buffers
from .metrics import LookaheadMetrics
from .residency import Admission, SlotTable
from .step_plan import DecodePart, StepPlan, candidate_mask


class LookaheadAttention:
    def __init__(self, mcfg: ModelConfig, cfg: LookaheadConfig, pool: KVPool, num_lanes: int,
                 max_blocks: int, transfer: TransferEngine, device: torch.device, ops: Ops,
                 debug_checks: bool = False):
        """pool: the host tier (the whole cache); the device tier, the summaries and the
        bookkeeping are allocated on `device`. ops: the engine's op implementations (this module
        builds every shape itself, so they may be the unchecked ones). debug_checks: verify the
        slots' contents before every attention (tests)."""
        self.cfg, self.pool, self.transfer, self.device, self.ops = cfg, pool, transfer, device, ops
        self.layout = lay = SlotLayout.from_config(cfg)
        self.num_layers, self.kvh, self.hd = mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim
        self.scale = mcfg.head_dim ** -0.5
        self.pingpong = cfg.residency == "pingpong"
        self.num_buffers = num_buffers(cfg, mcfg.num_layers)     # pingpong: the prefetch lead
        self.max_blocks = max_blocks
        on = dict(dtype=pool.k.dtype, device=device)
        shape = (self.num_buffers, num_lanes, self.kvh, lay.num_slots, lay.block_size, self.hd)
        self.dev_k = torch.zeros(shape, **on)          # the device tier's KV working set
        self.dev_v = torch.zeros(shape, **on)
        sshape = (mcfg.num_layers, num_lanes * max_blocks, self.kvh, self.hd)
        self.kmin = torch.zeros(sshape, **on)           # summaries, by (lane, logical block)
        self.kmax = torch.zeros(sshape, **on)
        self.slots = SlotTable(self.num_buffers, num_lanes, self.kvh, cfg.top_k, max_blocks, device)
        # views made once: a layer's host pool by block, a buffer's K/V as [lanes, KVH, tokens, D]
        self._pool_views = [pool.by_block(layer) for layer in range(self.num_layers)]
        tokens = (num_lanes, self.kvh, lay.num_slots * lay.block_size, self.hd)
        self._dev_views = [(self.dev_k[b], self.dev_v[b]) for b in range(self.num_buffers)]
        self._dev_tokens = [(self.dev_k[b].view(tokens), self.dev_v[b].view(tokens)) for b in range(self.num_buffers)]
        # attention's key mask by slot and token: sink/window rows set once per step (begin_step),
        # the selected rows per layer from the slot table
        long, bool_ = dict(dtype=torch.long, device=device), dict(dtype=torch.bool, device=device)
        self._mask = torch.zeros(num_lanes, self.kvh, lay.num_slots, lay.block_size, **bool_)
        self.pred = torch.full((mcfg.num_layers, num_lanes, self.kvh, cfg.top_k), -1, **long)
        self.has_pred = torch.zeros(mcfg.num_layers, num_lanes, **bool_)
        self.seeded = torch.zeros(mcfg.num_layers, num_lanes, **bool_)  # pred is the seed's
        self.lane_blocks = torch.full((num_lanes, max_blocks), -1, **long)  # logical -> host block
        self.tickets: dict[int, list[Ticket]] = {}             # layer -> copies it must wait for
        self.metrics = LookaheadMetrics(mcfg.num_layers, num_lanes, device=device)
        self.step_idx = 0
        self.plan: StepPlan | None = None
        self.debug_checks = debug_checks
        self.store_only = False             # a replayed prefill (prefill_cache): store and seed only
        self._step_metrics: list[tuple] = []
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []   # decode rows, stored at end_step

    # ---- lanes ----------------------------------------------------------------------------------
    def attach(self, lane: int, block_table: list[int]) -> None:
        self.lane_blocks[lane] = -1
        self.lane_blocks[lane, : len(block_table)] = torch.tensor(block_table[: self.max_blocks], device=self.device)
        self.slots.reset_lane(lane)
        self.pred[:, lane] = -1
        self.has_pred[:, lane] = False
        self.seeded[:, lane] = False

    def buffer_of(self, layer: int) -> int:
        """The device-tier buffer layer `layer` reads (pingpong: one of `prefetch_lead`)."""
        return layer % self.num_buffers if self.pingpong else layer

    def working_set_bytes_per_lane(self) -> int:
        """KV working-set bytes one sequence holds in the device tier (dev_k + dev_v)."""
        per_buffer = self.dev_k[0, 0].numel() * self.dev_k.element_size() * 2
        return per_buffer * self.num_buffers

    def summary_bytes(self, context_len: int) -> int:
        """Block summaries (kmin + kmax) of a `context_len`-token sequence, all layers."""
        nb = -(-context_len // self.layout.block_size)
        return 2 * self.num_layers * nb * self.kvh * self.hd * self.kmin.element_size()

    def device_bytes_per_lane(self) -> int:
        """Device bytes one sequence holds (the budgeted quantity, `device_budget_bytes`): its
        working set and its summaries, sized for `max_blocks`, whatever its context."""
        return self.working_set_bytes_per_lane() + self.summary_bytes(self.max_blocks * self.layout.block_size)

    # ---- the step ---------------------------------------------------------------------------------
    def begin_step(self, plan: StepPlan) -> None:
        self.plan = plan
        self.step_idx += 1
        self._step_metrics = []             # a step that failed midway leaves no half tally
        self._pending = []
        if plan.decode is not None:
            d, lay = plan.decode, self.layout
            self._mask[: d.num_lanes, :, : lay.selected_start] = d.base_mask.view(d.num_lanes, 1, lay.selected_start,
                                                                                  lay.block_size)
        if self.pingpong and plan.decode is not None:
            for layer in range(self.num_buffers):
                self._refill(layer, plan.decode)

    def end_step(self) -> None:
        """After the last layer: store a decode step's K/V and tally its metrics, all layers at once."""
        pending, self._pending = self._pending, []
        if pending and pending[0][0].shape[0]:      # a step of pre-decoding lanes only stores nothing
            ks, vs = zip(*pending)
            self._store(slice(0, len(pending)), torch.stack(ks), torch.stack(vs))
        self.metrics.flush()
        rec, self._step_metrics = self._step_metrics, []
        if rec:
            layers, pred, has, true, res = zip(*rec)
            self.metrics.record_step(list(layers), self.plan.decode.lane_ix, torch.stack(pred),
                                     torch.stack(has), torch.stack(true), torch.stack(res))

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
            it = part.item
            rows = slice(it.row_start, it.row_start + it.num_tokens)
            if not self.store_only:         # a replayed prefill only stores and seeds
                kc, vc = ((k[rows].transpose(0, 1), v[rows].transpose(0, 1)) if it.start_pos == 0
                          else self._read_prefix(layer, it))
                out[rows] = prefill_attention(q[rows], kc, vc)
            if part.completes_prompt:
                self._seed(layer, part.lane, q[it.row_start + it.num_tokens - 1], it.context_len)
        if p.decode is not None:
            self._decode(layer, q, k, v, out, p.decode)
        return out

    # ---- pieces -------------------------------------------------------------------------------------
    def _read_prefix(self, layer: int, it) -> tuple[torch.Tensor, torch.Tensor]:
        """A later prefill chunk's keys and values so far, [KVH, context, D], from the host pool
        onto the device (a view, no copy, when both are the host)."""
        kc, vc = self.pool.read(layer, it.block_table, it.context_len)
        return kc.to(self.device, non_blocking=True), vc.to(self.device, non_blocking=True)

    def _store(self, layers: slice, ks: torch.Tensor, vs: torch.Tensor) -> None:
        """The step's real rows of `layers`, ks/vs [L', T_real, KVH, D]: into the host pool, the
        block summaries and (resident) the device copies of sink/window blocks."""
        p = self.plan
        n_layers, T = ks.shape[0], ks.shape[1]
        self.pool.write_layers(layers, ks, vs, p.pool_blocks, p.pool_offsets)
        # the layers' summaries as one [L' * lanes * max_blocks, KVH, D] table
        per_layer = self.kmin.shape[1]
        ids = p.real_lanes * self.max_blocks + p.real_logical
        if n_layers > 1:
            ids = (torch.arange(n_layers, device=self.device)[:, None] * per_layer + ids).reshape(-1)
        flat = (-1, self.kvh, self.hd)
        self.ops.update_summaries(self.kmin[layers].view(flat), self.kmax[layers].view(flat),
                                   ks.reshape(n_layers * T, self.kvh, self.hd), ids,
                                   p.batch.slot_offsets.repeat(n_layers))
        if not self.pingpong:      # the device copies of sink/window blocks stay current
            w, lay = p.write_through, self.layout
            logical = p.real_logical[w]
            slot = torch.where(logical < lay.num_sink, logical, lay.num_sink + logical % lay.num_window)
            # advanced indices on dims 1, 3, 4 around a slice: the indexed view is [T_w, L', KVH, D]
            self.dev_k[layers, p.real_lanes[w], :, slot, p.batch.slot_offsets[w]] = ks[:, w].transpose(0, 1)
            self.dev_v[layers, p.real_lanes[w], :, slot, p.batch.slot_offsets[w]] = vs[:, w].transpose(0, 1)

    def _score(self, layer: int, q: torch.Tensor, valid: torch.Tensor, n: int, num_blocks: int):
        """q [n, (R,) H, D] for lanes [0, n) -> (top-K logical blocks [n, (R,) KVH, K], scores
        [n, (R,) KVH, nb]); valid [n, (R,) max_blocks].

        Only the first `num_blocks` logical blocks (those any lane's context reaches) are scored.
        """
        nb = min(num_blocks, self.max_blocks)
        kmin = self.kmin[layer].view(-1, self.max_blocks, self.kvh, self.hd)[:n, :nb]
        kmax = self.kmax[layer].view(-1, self.max_blocks, self.kvh, self.hd)[:n, :nb]
        k_sel = min(self.cfg.top_k, nb)
        idx, scores = self.ops.block_topk(q, kmin, kmax, valid[..., :nb], k_sel, self.cfg.group_score)
        if k_sel < self.cfg.top_k:
            idx = torch.nn.functional.pad(idx, (0, self.cfg.top_k - k_sel), value=-1)
        return idx, scores

    def _copy_job(self, layer: int, buf: int, adm: Admission) -> CopyJob:
        host = self.lane_blocks[adm.lanes, adm.blocks]
        return CopyJob(*self._pool_views[layer], *self._dev_views[buf],
                       (host, adm.heads), (adm.lanes, adm.heads, adm.slots + self.layout.selected_start),
                       tag=(self.step_idx, layer))

    def _seed(self, layer: int, lane: int, q_last: torch.Tensor, context_len: int) -> None:
        """Pre-decoding: the last prompt token's query picks the first working set (uncapped)."""
        valid = candidate_mask(self.layout, context_len + 1, self.max_blocks)         # host
        pad_valid = torch.zeros(lane + 1, self.max_blocks, dtype=torch.bool)
        pad_valid[lane] = valid
        lanes, pad_valid = (t.to(self.device, non_blocking=True) for t in (torch.tensor([lane]), pad_valid))
        pad_q = torch.zeros(lane + 1, *q_last.shape, dtype=q_last.dtype, device=self.device)
        pad_q[lane] = q_last
        idx, scores = self._score(layer, pad_q, pad_valid, lane + 1, context_len // self.layout.block_size + 1)
        idx, scores = idx[lanes], scores[lanes]
        self._predict(layer, lanes, idx, scores, cap=self.cfg.top_k)
        self.seeded[layer, lane] = True

    def _predict(self, layer: int, lanes: torch.Tensor, idx: torch.Tensor, scores: torch.Tensor, cap: int):
        """Record the prediction for layer `layer` of the next step; resident: queue its copies now."""
        self.pred[layer, lanes] = idx
        self.has_pred[layer, lanes] = True
        if self.pingpong:
            return
        prio = scores.gather(-1, idx.clamp(min=0))
        adm = self.slots.plan(layer, lanes, idx, prio, cap, self.step_idx)
        if len(adm):
            self.metrics.prefetched_blocks += len(adm)
            self.metrics.count_blocks(5, adm.lanes)
            self.tickets.setdefault(layer, []).append(self.transfer.submit(self._copy_job(layer, layer, adm)))

    def _fetch_urgent(self, layer: int, buf: int, lanes, want: torch.Tensor, scores: torch.Tensor) -> None:
        """Copy the blocks of `want` [lanes, KVH, K] missing from `buf` on the urgent queue, and wait."""
        prio = scores.gather(-1, want.clamp(min=0))
        adm = self.slots.plan(buf, lanes, want, prio, self.cfg.top_k, self.step_idx)
        if len(adm):
            self.metrics.urgent_blocks += len(adm)
            self.metrics.count_blocks(4, adm.lanes)
            self.transfer.wait(self.transfer.submit(self._copy_job(layer, buf, adm), urgent=True))

    def _refill(self, layer: int, d: DecodePart) -> None:
        """Ping-pong: copy layer `layer`'s whole sparse set (sink, window, predicted) into its buffer."""
        lay, buf = self.layout, self.buffer_of(layer)
        lanes, heads, slots, blocks = [], [], [], []
        for lane, c in zip(d.lane_list, d.context_lens):
            # the host holds c - 1 tokens of this layer; this step's token is written through later
            last = (c - 2) // lay.block_size
            fixed = list(range(min(lay.num_sink, last + 1))) + list(range(lay.window_start(c), last + 1))
            for b in dict.fromkeys(fixed):
                for h in range(self.kvh):
                    lanes.append(lane), heads.append(h), slots.append(lay.device_slot(b)), blocks.append(b)
        ix = torch.tensor([lanes, heads, slots, blocks], dtype=torch.long).to(self.device, non_blocking=True)
        host = self.lane_blocks[ix[0], ix[3]]                               # logical -> host block ids
        fixed_job = CopyJob(*self._pool_views[layer], *self._dev_views[buf], (host, ix[1]),
                            (ix[0], ix[1], ix[2]), tag=(self.step_idx, layer, "fixed"))
        self.tickets[layer] = [self.transfer.submit(fixed_job)]
        want = self.pred[layer, d.lanes]                                    # [B, KVH, K]
        self.slots.assign(buf, d.lanes, want, self.step_idx)
        b_i, h_i, j_i = (want >= 0).nonzero(as_tuple=True)
        adm = Admission(d.lanes[b_i], h_i, j_i, want[b_i, h_i, j_i])
        self.metrics.prefetched_blocks += len(adm)
        self.metrics.count_blocks(5, adm.lanes)
        self.tickets[layer].append(self.transfer.submit(self._copy_job(layer, buf, adm)))

    def _decode(self, layer: int, q, k, v, out, d: DecodePart) -> None:
        """One layer of the decode lanes: wait, score, fetch misses, attend, predict, refill."""
        buf = self.buffer_of(layer)
        for ticket in self.tickets.pop(layer, []):
            self.transfer.wait(ticket)
        L = d.lane_ix                       # the decoding lanes (a slice in a packed step)
        qd = self._lane_rows(q, d)                                           # [n, R, H, D]
        # One read of the summaries scores both rows: the real query's true top-K (for `urgent`,
        # and for the agreement metric) and the draft's prediction for the next step (used below).
        # Without look-ahead (R = 1) only the real query is scored, and fetched on demand.
        nb = max(d.context_lens) // self.layout.block_size + 1  # covers this and the next step
        idx2, scores2 = self._score(layer, qd, d.cand_masks, d.num_lanes, nb)
        self._serve_misses(layer, buf, d, idx2[:, 0], scores2[:, 0])
        if self.debug_checks:
            check_integrity(self, layer, d)
        o = self._attend(buf, qd, k, v, d)
        if d.packed:
            out.view(d.num_lanes, d.rows, *out.shape[1:]).copy_(o)
        else:
            out[d.real_rows] = o[d.lanes, 0]
            if d.rows == 2:
                out[d.draft_rows] = o[d.lanes, 1]
        if d.rows == 2:     # look ahead: the draft query predicts the next step's top-K here
            self._predict(layer, L, idx2[L, 1], scores2[L, 1], cap=self.cfg.fetch_cap)
        if self.pingpong and layer + self.num_buffers < self.num_layers:
            self._refill(layer + self.num_buffers, d)            # this buffer is free again

    @staticmethod
    def _lane_rows(x: torch.Tensor, d: DecodePart, contiguous: bool = True) -> torch.Tensor:
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

    def _serve_misses(self, layer: int, buf: int, d: DecodePart, true_idx: torch.Tensor,
                      true_scores: torch.Tensor) -> None:
        """Tally the real query's hits, then fetch its misses as the miss policy says."""
        L = d.lane_ix
        t_idx = true_idx[L]
        resident = self.slots.resident(buf, L, t_idx)
        # metrics: kept per layer, tallied once per step (end_step); pred is about to be replaced
        has = self.has_pred[layer, L].all() if d.rows == 2 else self.has_pred.new_zeros(())  # none to score
        self._step_metrics.append((layer, self.pred[layer, L].clone(), has, t_idx, resident))
        if self.cfg.miss_policy == "urgent":
            self._fetch_urgent(layer, buf, L, t_idx, true_scores[L])
        elif (first := self.seeded[layer, L] | d.predecode[L]).any():
            # drop tolerates a draft's misses, but a lane's first decode step was predicted by the
            # seed (the last prompt token's query), and a pre-decoding step by a draft known to be
            # wrong: fetch those steps' misses (the next step's real row is then served exactly)
            self._fetch_urgent(layer, buf, d.lanes[first], t_idx[first], true_scores[L][first])
            self.seeded[layer, L] = False

    def _attend(self, buf: int, qd: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: DecodePart) -> torch.Tensor:
        """Both rows over the device tier (sink, occupied selected slots, window) plus this step's
        own rows as extra keys -> [n, R, H, D]."""
        lay, n = self.layout, d.num_lanes
        # [n, KVH, NS * bs, D] is a view, no gather. Selected slots past `high` are empty in every
        # lane: left out, not masked (at a short context most of the K slots are, and the torch
        # path reads every slot it is given)
        used, S = self.slots.high[buf], lay.selected_start
        sel = self.slots.block[buf, :n, :, :used] >= 0                             # [n, KVH, used]
        if not d.packed:                    # a packed step's lanes all decode
            sel &= d.lane_active[:, None, None]
        self._mask[:n, :, S: S + used] = sel[..., None]
        n_keys = (S + used) * lay.block_size
        mask = self._mask[:n].view(n, self.kvh, -1)[:, :, :n_keys]
        kb, vb = (t[:n, :, :n_keys] for t in self._dev_tokens[buf])
        # this step's own rows are extra keys (the device tier does not hold them yet, see
        # forward): the real row sees itself; the draft row sees the real row and itself
        kx, vx = (self._lane_rows(t, d, contiguous=False).transpose(1, 2) for t in (k, v))   # [n, KVH, R, D]
        return self.ops.lookahead_attention(qd, kb, vb, mask, kx, vx, d.extra_mask, self.scale)


def check_integrity(attn: LookaheadAttention, layer: int, d: DecodePart) -> None:
    """Debug check: every device slot attention is about to read holds what the tables say.

    Selected slots must equal their host blocks; sink/window slots must equal the host tokens that
    the mask exposes. Raises AssertionError naming the first mismatch.
    """
    lay, buf = attn.layout, attn.buffer_of(layer)
    bs = lay.block_size
    held = attn.slots.block[buf, d.lanes]                                      # [B, KVH, K]
    b_i, h_i, j_i = (held >= 0).nonzero(as_tuple=True)
    host = attn.lane_blocks[d.lanes[b_i], held[b_i, h_i, j_i]]
    for dev, pool in zip((attn.dev_k, attn.dev_v), attn.pool.by_block(layer)):
        got = dev[buf, d.lanes[b_i], h_i, lay.selected_start + j_i].cpu()      # compared on the host
        bad = (got != pool[host.cpu(), h_i.cpu()]).flatten(1).any(-1).nonzero()
        assert bad.numel() == 0, f"layer {layer}: selected slot {int(j_i[bad[0]])} of lane " \
                                 f"{int(d.lanes[b_i[bad[0]]])} does not hold its block"
    for lane, c in zip(d.lane_list, d.context_lens):
        for h in range(attn.kvh):
            mask = d.base_mask[lane].view(lay.selected_start, bs)
            for slot in range(lay.selected_start):
                n = int(mask[slot].sum())
                if n == 0:
                    continue
                blk = slot if slot < lay.num_sink else next(
                    b for b in range(lay.window_start(c), (c - 1) // bs + 1) if lay.device_slot(b) == slot)
                host = int(attn.lane_blocks[lane, blk])
                assert torch.equal(attn.dev_k[buf, lane, h, slot, :n].cpu(), attn.pool.k[layer, h, host, :n]), \
                    f"layer {layer} lane {lane} head {h}: window/sink slot {slot} is stale"
