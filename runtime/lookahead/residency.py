"""The residency manager: what each lane's device working set holds, and the copies that fill it.

`ResidencyManager` decides: it records each layer's prediction, admits blocks through its
`SlotTable` (capped eviction), seeds a lane's first working set from its prompt, serves the
real query's misses by the miss policy (`urgent`: fetch them all before attention; `drop`: only
on a lane's first decode step and on pre-decoding steps), and hands `CopyJob`s to the transfer
engine, which alone moves the bytes. What differs between the residencies (when copies are made,
into which buffer, and whether stored rows are written through) is its policy object
(runtime/lookahead/policies.py): one per residency, no branches here.

`SlotTable` is the bookkeeping it decides with: which logical block each selected device slot
holds (small int tensors, no KV bytes). Shapes: `[num_buffers, lanes, KVH, K]`; a buffer is a
layer (resident) or a ping-pong buffer. The tables live on the engine's device, beside the slots
they describe. An inverse map (logical block -> slot) makes membership a gather instead of a
K x K' compare.

Nothing here reads the device on the host (runtime/device.py, `to_host`). What the host decides
with it keeps itself: which (layer, lane) still has the seed's prediction (`seeded_host`), a
bound on the occupied selected slots (`SlotTable.high`), and the plan's own host values. Off
the CPU kernel, admissions are fixed-capacity lists (B x KVH x cap entries, a validity mask)
that the copy job and the transfer engines skip where invalid.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import LookaheadConfig
from ..device import to_device
from ..kv_pool import KVPool
from ..observe import Observers
from ..ops import Ops
from ..transfer import CopyJob, Ticket, TransferEngine
from .device_tier import DeviceTier
from .metrics import LookaheadMetrics
from .step_plan import DecodePart


@dataclass
class Admission:
    """Blocks to copy in: slot `slots[i]` of (lanes[i], heads[i]) receives logical block `blocks[i]`.

    valid None: every entry is an admission (the CPU kernel's exact lists). Otherwise a fixed-
    capacity list: only entries with valid[i] are admissions; the others name block 0 and a
    (lane, head, slot) no valid entry of the list names, and are skipped by the copy (whose
    source block they name is -1: `submit`).
    """

    lanes: torch.Tensor
    heads: torch.Tensor
    slots: torch.Tensor
    blocks: torch.Tensor
    valid: torch.Tensor | None = None

    def __len__(self) -> int:
        """Entries listed (an upper bound of the admissions when `valid` is set): a shape, not a read."""
        return self.lanes.numel()


class SlotTable:
    def __init__(self, num_buffers: int, num_lanes: int, num_kv_heads: int, top_k: int, max_blocks: int,
                 device: torch.device = torch.device("cpu"), kernel=None):
        """kernel: the kernel table's `plan_slots` (None: `plan_torch`)."""
        shape = (num_buffers, num_lanes, num_kv_heads, top_k)
        self.top_k, self.max_blocks, self.device, self.kernel = top_k, max_blocks, device, kernel
        self.block = torch.full(shape, -1, dtype=torch.long, device=device)
        self.last_used = torch.full(shape, -1, dtype=torch.long, device=device)
        # slot_of[..., b] = slot holding logical block b, or -1; column max_blocks stands for "no
        # block" (-1 entries of a request) and stays -1
        self.slot_of = torch.full((num_buffers, num_lanes, num_kv_heads, max_blocks + 1), -1, dtype=torch.long,
                                  device=device)
        # per buffer: every selected slot at or past high[buf] is empty in every lane (a bound that
        # only grows: attention leaves those slots out without looking at the table). It is kept
        # on the host from what the host knows, never read from the table: slots fill from the
        # lowest empty one (empty slots are the first victims, in slot order), so a plan that
        # admits at most `cap` blocks per (lane, head) raises every lane's occupancy by at most
        # `cap`, and no lane holds more distinct blocks than were ever candidates (`most`)
        self.high = [0] * num_buffers

    def reset_lane(self, lane: int) -> None:
        self.block[:, lane] = -1
        self.last_used[:, lane] = -1
        self.slot_of[:, lane] = -1

    def _col(self, blocks: torch.Tensor) -> torch.Tensor:
        return torch.where(blocks >= 0, blocks, self.max_blocks)

    def resident(self, buf: int, lanes: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """blocks [B, KVH, n] (-1 = none) -> bool [B, KVH, n]: is the block in a selected slot?"""
        return self.slot_of[buf, lanes].gather(-1, self._col(blocks)) >= 0

    def assign(self, buf: int, lanes: torch.Tensor, blocks: torch.Tensor, step: int) -> None:
        """Ping-pong refill: slot j of each (lane, head) now holds blocks[..., j]."""
        self.block[buf, lanes] = blocks
        self.high[buf] = max(self.high[buf], blocks.shape[-1])
        self.last_used[buf, lanes] = torch.where(blocks >= 0, step, -1)
        inv = torch.full_like(self.slot_of[buf, lanes], -1)
        slots = torch.arange(blocks.shape[-1], device=self.device).expand_as(blocks)
        inv.scatter_(-1, self._col(blocks), torch.where(blocks >= 0, slots, -1))
        inv[..., self.max_blocks] = -1
        self.slot_of[buf, lanes] = inv

    def plan(self, buf: int, lanes: torch.Tensor, want: torch.Tensor, priority: torch.Tensor,
             cap: int, step: int, most: int | None = None) -> Admission:
        """Admit up to `cap` missing wanted blocks per (lane, head), best `priority` first, each
        into the slot of a least-recently-selected block that is not wanted (empty slots first).
        `lanes`: a tensor of lane ids, or a slice of consecutive lanes (start set, step 1).
        `most`: at most this many distinct blocks were ever candidates of these lanes (bounds
        `high`; default K).

        want, priority: [B, KVH, K'] (want -1 = padding, K' <= K). Updates the table in place.
        With a `kernel` (a C table's `plan_slots`) this runs as one C call (exact lists); else
        `plan_torch`, the same rule in torch ops with fixed-capacity output (its reference in the
        tests).
        """
        adm = None
        if self.kernel is not None:
            lane_ids = (torch.arange(lanes.start, lanes.start + want.shape[0], device=self.device)
                        if isinstance(lanes, slice)
                        else lanes)
            out = self.kernel(self.block[buf], self.last_used[buf], self.slot_of[buf], lane_ids, want,
                              priority, cap, step)
            adm = Admission(*out) if out is not None else None
        if adm is None:
            adm = self.plan_torch(buf, lanes, want, priority, cap, step)
        if len(adm):
            self.high[buf] = self.grown(buf, min(cap, want.shape[-1]), self.top_k if most is None else most)
        return adm

    def grown(self, buf: int, per_head: int, most: int) -> int:
        """`high[buf]` after a plan that admits up to `per_head` blocks per (lane, head) of lanes
        with at most `most` distinct candidates (see `high`)."""
        return max(self.high[buf], min(self.top_k, self.high[buf] + min(per_head, self.top_k), most))

    def plan_torch(self, buf: int, lanes: torch.Tensor, want: torch.Tensor, priority: torch.Tensor,
                   cap: int, step: int) -> Admission:
        """`plan` in torch ops, with no host read: the admissions as a fixed-capacity list of
        B x KVH x min(cap, K') entries in (lane, head, rank) order, `valid` marking the real ones."""
        held = self.block[buf, lanes]                                           # [B, KVH, K]
        last = self.last_used[buf, lanes]
        inv = self.slot_of[buf, lanes]
        valid = want >= 0
        where = inv.gather(-1, self._col(want))                                 # [B, KVH, K'] slot or -1
        missing = valid & (where < 0)
        # slots holding a wanted block: scatter into a spare column K for the not-held ones
        slot_wanted = torch.zeros(*held.shape[:-1], self.top_k + 1, dtype=torch.bool, device=self.device)
        slot_wanted.scatter_(-1, torch.where(where >= 0, where, self.top_k), True)
        slot_wanted = slot_wanted[..., : self.top_k]
        last = torch.where(slot_wanted, step, last)
        victims = torch.argsort(torch.where(slot_wanted, torch.iinfo(torch.long).max, last), dim=-1,
                                stable=True)
        order = torch.argsort(torch.where(missing, -priority, float("inf")), dim=-1, stable=True)
        kc = max(0, min(cap, want.shape[-1], self.top_k))                       # entries per (lane, head)
        n_admit = missing.sum(-1).clamp(max=cap)                                # [B, KVH]
        take = torch.arange(kc, device=self.device) < n_admit[..., None]        # [B, KVH, kc]
        # rank j goes into victim j: distinct slots per (lane, head), so the untaken entries name
        # slots no admission writes (the copy skips them)
        slots = victims[..., :kc]
        blocks = torch.where(take, want.gather(-1, order[..., :kc]), 0)
        evicted = held.gather(-1, slots)
        no_block = torch.full_like(slots, self.max_blocks)                      # the spare column
        inv.scatter_(-1, torch.where(take, self._col(evicted), no_block), -1)
        inv.scatter_(-1, torch.where(take, blocks, no_block), torch.where(take, slots, -1))
        inv[..., self.max_blocks] = -1
        held.scatter_(-1, slots, torch.where(take, blocks, evicted))
        last.scatter_(-1, slots, torch.where(take, step, last.gather(-1, slots)))
        self.last_used[buf, lanes] = last
        if not isinstance(lanes, slice):     # a slice indexes views: held and inv were updated in place
            self.block[buf, lanes] = held
            self.slot_of[buf, lanes] = inv
        B, kvh = want.shape[0], want.shape[1]
        lane_ids = (torch.arange(lanes.start, lanes.start + B, device=self.device) if isinstance(lanes, slice)
                    else lanes)
        shape = (B, kvh, kc)
        return Admission(lane_ids[:, None, None].expand(shape).reshape(-1),
                         torch.arange(kvh, device=self.device)[None, :, None].expand(shape).reshape(-1),
                         slots.reshape(-1), blocks.reshape(-1), take.reshape(-1))


ALL_LANES = object()        # a miss policy's answer: fetch the misses of every lane


class UrgentMisses:
    """urgent: every miss of the real query is fetched before attention."""

    def fetch(self, mgr: "ResidencyManager", layer: int, d: DecodePart):
        """The lanes whose misses layer `layer` fetches now: ALL_LANES, None (none), or a bool
        [num_lanes] device mask (the host decides whether to fetch, the device which lanes)."""
        return ALL_LANES

    def fetched(self, mgr: "ResidencyManager", layer: int, d: DecodePart) -> None:
        """After the fetch: what the policy keeps of it."""


class DropMisses(UrgentMisses):
    """drop tolerates a draft's misses, but a lane's first decode step was predicted by the seed
    (the last prompt token's query), and a pre-decoding step by a draft known to be wrong: those
    steps' misses are fetched (the next step's real row is then served exactly)."""

    def fetch(self, mgr: "ResidencyManager", layer: int, d: DecodePart):
        if not any(mgr.seeded_host[layer][lane] or pre for lane, pre in zip(d.lane_list, d.predecode_list)):
            return None
        return mgr.seeded[layer, d.lane_ix] | d.predecode[d.lane_ix]

    def fetched(self, mgr: "ResidencyManager", layer: int, d: DecodePart) -> None:
        mgr.seeded[layer, d.lane_ix] = False
        for lane in d.lane_list:
            mgr.seeded_host[layer][lane] = False


MISS_POLICIES = {"urgent": UrgentMisses(), "drop": DropMisses()}


class ResidencyManager:
    def __init__(self, cfg: LookaheadConfig, policy, num_layers: int, num_lanes: int, num_kv_heads: int,
                 max_blocks: int, pool: KVPool, tier: DeviceTier, transfer: TransferEngine,
                 metrics: LookaheadMetrics, observers: Observers, device: torch.device, ops: Ops):
        """policy: `ResidentPolicy` or `PingPongPolicy` (policies.make_policy); pool: the host tier;
        ops: the engine's kernel table (the slot plan's and the copy jobs' kernels)."""
        self.cfg, self.policy, self.tier, self.transfer = cfg, policy, tier, transfer
        self.metrics, self.observers, self.max_blocks = metrics, observers, max_blocks
        self.misses = MISS_POLICIES[cfg.miss_policy]
        self.slots = SlotTable(policy.num_buffers, num_lanes, num_kv_heads, cfg.top_k, max_blocks, device,
                               ops.plan_slots)
        self.copy_kernel = ops.copy_blocks
        long, bool_ = dict(dtype=torch.long, device=device), dict(dtype=torch.bool, device=device)
        self.pred = torch.full((num_layers, num_lanes, num_kv_heads, cfg.top_k), -1, **long)  # next step's sets
        self.has_pred = torch.zeros(num_layers, num_lanes, **bool_)
        self.seeded = torch.zeros(num_layers, num_lanes, **bool_)        # pred is the seed's
        self.seeded_host = [[False] * num_lanes for _ in range(num_layers)]   # the same, kept by the host
        self.lane_blocks = torch.full((num_lanes, max_blocks), -1, **long)  # logical -> host block
        self.tickets: dict[int, list[Ticket]] = {}                        # layer -> copies it must wait for
        self._tables: dict[int, list[int]] = {}                           # lane -> its block table (host)
        self.pool_views = [pool.by_block(layer) for layer in range(num_layers)]   # copy-job sources
        self.step_idx = 0
        self.layout = tier.layout
        self.most = 0          # the most candidate blocks any lane has had (bounds SlotTable.high)

    def attach(self, lane: int, block_table: list[int]) -> None:
        """A new sequence on `lane`: its block table, an empty working set, no prediction."""
        table = torch.full((self.max_blocks,), -1, dtype=torch.long)
        table[: len(block_table)] = torch.tensor(block_table[: self.max_blocks], dtype=torch.long)
        self.lane_blocks[lane] = to_device(self.lane_blocks.device, table)[0]     # built on the host, moved once
        self._tables[lane] = list(block_table)
        self.slots.reset_lane(lane)
        self.pred[:, lane] = -1
        self.has_pred[:, lane] = False
        self.seeded[:, lane] = False
        for row in self.seeded_host:
            row[lane] = False

    def lane_host_block(self, lane: int, logical: int) -> int:
        """The host pool block of a lane's logical block (the block table the lane was attached with)."""
        return self._tables[lane][logical]

    def note_context(self, context_len: int) -> None:
        """A query at `context_len` tokens picks among its candidates: raise the bound `most`."""
        self.most = max(self.most, min(self.slots.top_k, self.layout.num_candidates(context_len)))

    def buffer_of(self, layer: int) -> int:
        return self.policy.buffer_of(layer)

    def begin_step(self, step_idx: int, d: DecodePart | None) -> None:
        self.step_idx = step_idx
        if d is not None:
            self.note_context(max(d.context_lens) + 1)      # the draft row's context, the largest
            self.policy.begin_step(self, d)

    def take_tickets(self, layer: int) -> list[Ticket]:
        """The copies layer `layer` must wait for before it reads its buffer (and only those)."""
        return self.tickets.pop(layer, [])

    def serve_misses(self, layer: int, buf: int, d: DecodePart, true_idx: torch.Tensor,
                     true_scores: torch.Tensor) -> None:
        """Note the real query's hits (metrics), then fetch its misses as the miss policy says.
        true_idx [num_lanes, KVH, K], true_scores [num_lanes, KVH, nb]."""
        L = d.lane_ix
        t_idx = true_idx[L]
        resident = self.slots.resident(buf, L, t_idx)
        has = self.has_pred[layer, L].all() if d.rows == 2 else self.has_pred.new_zeros(())   # none to score
        self.metrics.note_layer(layer, self.pred[layer, L].clone(), has, t_idx, resident)  # pred is replaced below
        fetch = self.misses.fetch(self, layer, d)
        if fetch is not None:
            want = t_idx if fetch is ALL_LANES else torch.where(fetch[:, None, None], t_idx, -1)
            self.fetch_urgent(layer, buf, L, want, true_scores[L])
            self.misses.fetched(self, layer, d)

    def fetch_urgent(self, layer: int, buf: int, lanes, want: torch.Tensor, scores: torch.Tensor) -> None:
        """Copy the blocks of `want` [lanes, KVH, K] missing from `buf` on the urgent queue, and wait."""
        prio = scores.gather(-1, want.clamp(min=0))
        adm = self.slots.plan(buf, lanes, want, prio, self.cfg.top_k, self.step_idx, most=self.most)
        if len(adm):
            self.transfer.wait(self.submit(layer, buf, adm, urgent=True))

    def predict(self, layer: int, lanes, idx: torch.Tensor, scores: torch.Tensor, cap: int) -> None:
        """The working set of layer `layer` at the next step: idx [lanes, KVH, K] (scores [.., nb]);
        the policy admits (at most `cap` new blocks per head) and queues copies, or waits to refill."""
        self.pred[layer, lanes] = idx
        self.has_pred[layer, lanes] = True
        self.policy.on_predict(self, layer, lanes, idx, scores, cap)

    def seed(self, layer: int, lane: int, lanes: torch.Tensor, idx: torch.Tensor, scores: torch.Tensor,
             context_len: int | None = None) -> None:
        """A completed prompt's first working set, predicted by its last token's query (uncapped);
        `context_len`: that query's (its candidates bound the slots it fills)."""
        if context_len is not None:
            self.note_context(context_len)
        else:
            self.most = self.slots.top_k
        self.predict(layer, lanes, idx, scores, cap=self.cfg.top_k)
        self.seeded[layer, lane] = True
        self.seeded_host[layer][lane] = True

    def after_layer(self, layer: int, d: DecodePart) -> None:
        self.policy.after_layer(self, layer, d)

    def submit(self, layer: int, buf: int, adm: Admission, urgent: bool = False) -> Ticket:
        """Admitted blocks -> one copy job (host pool of `layer` -> selected slots of `buf`); a
        fixed-capacity admission's invalid entries travel as the job's `valid` mask."""
        self.metrics.add_blocks(urgent, adm.lanes, adm.valid)
        host, src_heads = self.lane_blocks[adm.lanes, adm.blocks], adm.heads
        if adm.valid is not None:       # an untaken entry names block -1: gathered as nothing, not copied
            host = torch.where(adm.valid, host, -1)
        job = CopyJob(*self.pool_views[layer], *self.tier.views[buf], (host, src_heads),
                      (adm.lanes, adm.heads, adm.slots + self.tier.layout.selected_start), tag=(self.step_idx, layer),
                      valid=adm.valid)
        return self.send(job, urgent)

    def send(self, job: CopyJob, urgent: bool = False) -> Ticket:
        job.kernel = self.copy_kernel
        if self.observers:
            self.observers.copy(job, urgent)
        return self.transfer.submit(job, urgent=urgent)
