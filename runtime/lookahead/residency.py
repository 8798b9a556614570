"""The residency manager: what each lane's device working set holds, and the copies that fill it.

`ResidencyManager` decides: it records each layer's prediction, admits blocks through its
`SlotTable` (capped eviction), seeds a lane's first working set from its prompt, serves the
real query's misses by the miss policy (`urgent`: fetch them all before attention; `drop`: only
on a lane's first decode step and on pre-decoding steps), and hands `CopyJob`s to the transfer
engine, which alone moves the bytes: `apply` takes a decode layer's `LayerResult`, whichever
implementation made it, and `_queue` is the one place background copies are submitted. What
differs between the residencies (when copies are made, into which buffer, and whether stored rows
are written through) is its policy object (`ResidentPolicy`, `PingPongPolicy`, at the end of this
module): one per residency, no branches here; a policy answers with copies, never submits them.

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

import plugins
from plugins.plan import admit_per_head

from ..config import LookaheadConfig
from ..device import to_device
from ..kv_pool import KVPool
from ..observe import Observers
from ..ops import Ops
from ..transfer import CopyJob, Ticket, TransferEngine
from .device_tier import DeviceTier, num_buffers
from .metrics import LookaheadMetrics
from .step_plan import DecodePart, StepPlan


@dataclass
class Admission:
    """Blocks to copy in: slot `slots[i]` of (lanes[i], heads[i]) receives logical block `blocks[i]`.

    valid None: every entry is an admission (the CPU kernel's exact lists). Otherwise a fixed-
    capacity list: only entries with valid[i] are admissions; the others name block 0 and a
    (lane, head, slot) no valid entry of the list names, and are skipped by the copy, which reads
    nothing for them (`lookahead::copy_blocks`).
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
                 device: torch.device = torch.device("cpu"), kernel=None, fixed=None):
        """kernel: the kernel table's `plan_slots`, exact lists (None: `plan_torch`); fixed: its
        `plan_slots_fixed`, what `plan_torch` runs (default: the op's torch implementation)."""
        shape = (num_buffers, num_lanes, num_kv_heads, top_k)
        self.top_k, self.max_blocks, self.device, self.kernel = top_k, max_blocks, device, kernel
        self.fixed = fixed if fixed is not None else plugins.direct.plan_slots
        self._ids: dict[tuple, object] = {}        # lane and entry ids of fixed-capacity lists
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

    def plan(self, buf: int, lanes: torch.Tensor, want: torch.Tensor, scores: torch.Tensor,
             cap: int, step: int, most: int | None = None) -> Admission:
        """Admit up to `cap` missing wanted blocks per (lane, head), best score first, each
        into the slot of a least-recently-selected block that is not wanted (empty slots first).
        `lanes`: a tensor of lane ids, or a slice of consecutive lanes (start set, step 1).
        `most`: at most this many distinct blocks were ever candidates of these lanes (bounds
        `high`; default K).

        want: [B, KVH, K'] (-1 = padding, K' <= K); scores: [B, KVH, NS] the blocks' scores (a
        wanted block's priority; NS > every wanted block). Updates the table in place.
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
                              scores.gather(-1, want.clamp(min=0)), cap, step)
            adm = Admission(*out) if out is not None else None
        if adm is None:
            adm = self.plan_torch(buf, lanes, want, scores, cap, step)
        if len(adm):
            self.high[buf] = self.grown(buf, min(cap, want.shape[-1]), self.top_k if most is None else most)
        return adm

    def grown(self, buf: int, per_head: int, most: int) -> int:
        """`high[buf]` after a plan that admits up to `per_head` blocks per (lane, head) of lanes
        with at most `most` distinct candidates (see `high`)."""
        return max(self.high[buf], min(self.top_k, self.high[buf] + min(per_head, self.top_k), most))

    def plan_torch(self, buf: int, lanes: torch.Tensor, want: torch.Tensor, scores: torch.Tensor,
                   cap: int, step: int) -> Admission:
        """`plan` as one `lookahead::plan_slots` op (`fixed`; one kernel on a GPU), with no host
        read: the admissions as a fixed-capacity list of B x KVH x min(cap, K') entries in (lane,
        head, rank) order, `valid` marking the real ones."""
        lane_ids = self._lane_ids(lanes, want.shape[0])
        slots, blocks, valid = self.fixed(*self._buffer(buf), lane_ids, want, scores, cap, step)
        shape = (*want.shape[:2], admit_per_head(cap, want.shape[-1], self.top_k))
        return Admission(*self._entry_ids(lanes, lane_ids, shape), slots, blocks, valid)

    def _buffer(self, buf: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Buffer `buf`'s block, last_used and slot_of (views made once: the tables are never
        reallocated, only written)."""
        key = ("buffer", buf)
        if key not in self._ids:
            self._ids[key] = (self.block[buf], self.last_used[buf], self.slot_of[buf])
        return self._ids[key]

    def _lane_ids(self, lanes, n: int) -> torch.Tensor:
        """The lane ids of `lanes` (a slice of consecutive lanes: made once per (start, n))."""
        if not isinstance(lanes, slice):
            return lanes
        key = ("lanes", lanes.start, n)
        if key not in self._ids:
            self._ids[key] = torch.arange(lanes.start, lanes.start + n, device=self.device)
        return self._ids[key]

    def _entry_ids(self, lanes, lane_ids: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """The lane and head of each entry of a [B, KVH, kc] list, flat (a decode step's, for a
        slice of lanes, made once per shape: constants, as a captured graph wants them)."""
        key = ("entries", lanes.start, *shape) if isinstance(lanes, slice) else None
        if key in self._ids:
            return self._ids[key]
        heads = torch.arange(shape[1], device=self.device)[None, :, None].expand(shape).reshape(-1)
        ids = lane_ids[:, None, None].expand(shape).reshape(-1), heads
        if key is not None:
            self._ids[key] = ids
        return ids


ALL_LANES = object()        # a miss policy's answer: fetch the misses of every lane


class UrgentMisses:
    """urgent: every miss of the real query is fetched before attention."""

    def fetch(self, mgr: "ResidencyManager", layer: int, d: DecodePart):
        """The lanes whose misses layer `layer` fetches now: ALL_LANES, None (none), or a bool
        [num_lanes] device mask over lanes 0..num_lanes-1 (the host decides whether to fetch,
        the device which lanes)."""
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
        return mgr.seeded[layer, : d.num_lanes] | d.predecode

    def fetched(self, mgr: "ResidencyManager", layer: int, d: DecodePart) -> None:
        mgr.seeded[layer, d.lane_ix] = False
        for lane in d.lane_list:
            mgr.seeded_host[layer][lane] = False


MISS_POLICIES = {"urgent": UrgentMisses(), "drop": DropMisses()}


@dataclass
class LayerResult:
    """What one decode layer's attention did, whichever ran it (the torch layer or the C layer,
    runtime/lookahead/attention.py), for `ResidencyManager.apply`. The real query's true top-K
    and its hits are [num_lanes, KVH, K] views of the step's buffers (the metrics read them all
    at the end of the step); the prediction itself is in `ResidencyManager.pred`."""

    true: torch.Tensor                # [num_lanes, KVH, K] the real query's top-K (-1 padded)
    resident: torch.Tensor            # [num_lanes, KVH, K] of those, held before any fetch
    fetched: bool                     # the miss policy fetched this layer's misses
    urgent: Admission | None          # the blocks copied before attention (the step waited)
    predicted: Admission | None       # the prediction's admissions: copies for the next step
    out: torch.Tensor | None = None   # the rows it wrote (the caller's buffer, or its own)


@dataclass
class Copy:
    """A copy a residency policy asks for: `job` for layer `layer` (its attention waits for it);
    `counted`: its blocks count as prefetched (admissions, restored blocks; not the sink and
    window units a ping-pong refill re-copies every step)."""

    layer: int
    job: CopyJob
    counted: bool = True


class ResidencyManager:
    def __init__(self, cfg: LookaheadConfig, policy, num_layers: int, num_lanes: int, num_kv_heads: int,
                 max_blocks: int, pool: KVPool, tier: DeviceTier, transfer: TransferEngine,
                 metrics: LookaheadMetrics, observers: Observers, device: torch.device, ops: Ops):
        """policy: `ResidentPolicy` or `PingPongPolicy` (`make_policy`); pool: the host tier; ops:
        the engine's kernel table (the slot plan's kernel; its copy kernel goes to the transfer
        engine, which runs every job)."""
        self.cfg, self.policy, self.tier, self.transfer = cfg, policy, tier, transfer
        self.metrics, self.observers, self.max_blocks = metrics, observers, max_blocks
        self.misses = MISS_POLICIES[cfg.miss_policy]
        self.slots = SlotTable(policy.num_buffers, num_lanes, num_kv_heads, cfg.top_k, max_blocks, device,
                               ops.plan_slots, ops.plan_slots_fixed)
        transfer.use_kernel(ops.copy_blocks)
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

    def restore(self, lane: int, logical: list[int]) -> None:
        """A prefix-cache hit: what of the lane's cached blocks `logical` the policy keeps on the device."""
        self._queue(self.policy.restore(self, lane, logical))

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
            self._queue(self.policy.begin_step(self, d))     # pingpong: the first refills

    def take_tickets(self, layer: int) -> list[Ticket]:
        """The copies layer `layer` must wait for before it reads its buffer (and only those)."""
        return self.tickets.pop(layer, [])

    def fetch_urgent(self, layer: int, buf: int, lanes, want: torch.Tensor, scores: torch.Tensor) -> Admission:
        """Admit the blocks of `want` [lanes, KVH, K] missing from `buf` and copy them on the
        urgent queue, waiting for them; the admission (counted by `apply`)."""
        adm = self.slots.plan(buf, lanes, want, scores, self.cfg.top_k, self.step_idx, most=self.most)
        if len(adm):
            self.transfer.wait(self.send(self.job(layer, buf, adm), urgent=True))
        return adm

    def predict(self, layer: int, lanes, idx: torch.Tensor, scores: torch.Tensor, cap: int) -> Admission | None:
        """The working set of layer `layer` at the next step: idx [lanes, KVH, K] (scores [.., nb]);
        the policy's admissions (at most `cap` new blocks per head), or None (it refills later)."""
        self.pred[layer, lanes] = idx
        self.has_pred[layer, lanes] = True
        return self.policy.on_predict(self, layer, lanes, idx, scores, cap)

    def seed(self, layer: int, lane: int, lanes: torch.Tensor, idx: torch.Tensor, scores: torch.Tensor,
             context_len: int | None = None) -> None:
        """A completed prompt's first working set, predicted by its last token's query (uncapped);
        `context_len`: that query's (its candidates bound the slots it fills)."""
        if context_len is not None:
            self.note_context(context_len)
        else:
            self.most = self.slots.top_k
        adm = self.predict(layer, lanes, idx, scores, cap=self.cfg.top_k)
        if adm is not None and len(adm):
            self._queue([Copy(layer, self.job(layer, self.buffer_of(layer), adm))])
        self.seeded[layer, lane] = True
        self.seeded_host[layer][lane] = True

    def apply(self, layer: int, d: DecodePart, r: LayerResult) -> None:
        """A decode layer's result, whichever implementation made it: what the miss policy keeps
        of its fetch (drop: the seed flags), the urgent blocks in the metrics, the prediction's
        copies queued for the next step, and the policy's copies after the layer (pingpong's
        refill of the buffer just released)."""
        if r.fetched:
            self.misses.fetched(self, layer, d)
        if r.urgent is not None and len(r.urgent):
            self.metrics.add_blocks(True, r.urgent.lanes, r.urgent.valid)
        copies = self.policy.after_layer(self, layer, d)
        if r.predicted is not None and len(r.predicted):
            copies = [Copy(layer, self.job(layer, self.buffer_of(layer), r.predicted)), *copies]
        self._queue(copies)

    def job(self, layer: int, buf: int, adm: Admission) -> CopyJob:
        """Admitted blocks -> one copy job (host pool of `layer` -> the selected slots of `buf`,
        addressed from the first selected slot); a fixed-capacity admission's invalid entries
        travel as the job's `valid` mask (their source block is whatever block 0 of the lane is,
        -1 included: a copy reads nothing for them)."""
        return CopyJob(*self.pool_views[layer], *self.tier.selected_views[buf],
                       (self.lane_blocks[adm.lanes, adm.blocks], adm.heads), (adm.lanes, adm.heads, adm.slots),
                       tag=(self.step_idx, layer), valid=adm.valid)

    def _queue(self, copies: list[Copy]) -> None:
        """The only place background copies are submitted: each counted, sent, and its ticket
        filed under the layer that waits for it."""
        for c in copies:
            if c.counted:
                self.metrics.add_blocks(False, c.job.dst_index[0], c.job.valid)
            self.tickets.setdefault(c.layer, []).append(self.send(c.job))

    def send(self, job: CopyJob, urgent: bool = False) -> Ticket:
        if self.observers:
            self.observers.copy(job, urgent)
        return self.transfer.submit(job, urgent=urgent)


# ---- the residency policies -----------------------------------------------------------------------
# When the working set is copied in, into which buffer, and whether stored rows are written
# through: one object per `residency`. The manager calls it at fixed points of the step and it
# never branches on the residency; it answers with copies (`Copy`, `Admission`), which only the
# manager submits.
#
#     hook                     resident                           pingpong (lead = prefetch_lead)
#     buffer_of(l)             l                                  l % lead
#     begin_step -> copies     -                                  refill layers 0 .. lead-1
#     on_predict -> admission  capped admission                   - (the prediction waits for the refill)
#     after_layer -> copies    -                                  refill layer l + lead into l's buffer
#     store (end of step)      write sink/window rows through     - (re-copied at every refill)
#     restore -> copies        copy the cached sink/window in     - (re-copied at every refill)

def make_policy(cfg: LookaheadConfig, num_layers: int):
    if cfg.residency == "pingpong":
        return PingPongPolicy(num_layers, num_buffers(cfg, num_layers))
    return ResidentPolicy(num_layers)


class ResidentPolicy:
    """OasisKV: a buffer per layer, kept across steps; each prediction admits at most `cap` new
    blocks per (lane, KV head), copied in for that layer of the next step."""

    def __init__(self, num_layers: int):
        self.num_buffers = num_layers

    def buffer_of(self, layer: int) -> int:
        return layer

    def begin_step(self, mgr: ResidencyManager, d: DecodePart) -> list[Copy]:
        return []

    def on_predict(self, mgr: ResidencyManager, layer: int, lanes, idx: torch.Tensor, scores: torch.Tensor,
                   cap: int) -> Admission:
        return mgr.slots.plan(layer, lanes, idx, scores, cap, mgr.step_idx, most=mgr.most)

    def after_layer(self, mgr: ResidencyManager, layer: int, d: DecodePart) -> list[Copy]:
        return []

    def store(self, tier: DeviceTier, layers: slice, ks: torch.Tensor, vs: torch.Tensor, p: StepPlan) -> None:
        """The device copies of sink/window blocks stay current: stored rows are written through."""
        w = p.write_through
        tier.write_through(layers, ks[:, w], vs[:, w], p.real_lanes[w], p.real_logical[w], p.batch.slot_offsets[w])

    def restore(self, mgr: ResidencyManager, lane: int, logical: list[int]) -> list[Copy]:
        """A prefix-cache hit: the lane's sink/window blocks that its prefill will not store
        (`logical`, already in the host pool) are copied into their slots, every layer; the
        lane's first decode step waits for them (prefetched blocks in the metrics: they are
        bytes moved host to device)."""
        if not logical:
            return []
        kvh, lay = mgr.tier.kvh, mgr.tier.layout
        n = len(logical) * kvh
        host = [mgr.lane_host_block(lane, b) for b in logical for _ in range(kvh)]
        heads = list(range(kvh)) * len(logical)
        slots = [lay.device_slot(b) for b in logical for _ in range(kvh)]
        host, heads, slots, lanes = to_device(mgr.tier.k.device, *(torch.tensor(t, dtype=torch.long)
                                                                  for t in (host, heads, slots, [lane] * n)))
        return [Copy(layer, CopyJob(*mgr.pool_views[layer], *mgr.tier.views[layer], (host, heads), (lanes, heads, slots),
                                    tag=(mgr.step_idx, layer, "restore")))
                for layer in range(self.num_buffers)]


class PingPongPolicy:
    """DualDecoder: `lead` layer buffers; layer l reads buffer l % lead, which is refilled with
    layer l + lead's whole sparse set (sink, window, the full predicted set, no cap) as soon as
    layer l's attention is done."""

    def __init__(self, num_layers: int, lead: int):
        self.num_layers, self.lead, self.num_buffers = num_layers, lead, lead
        self._fixed: tuple[torch.Tensor, torch.Tensor] | None = None    # this step's sink/window units

    def buffer_of(self, layer: int) -> int:
        return layer % self.lead

    def begin_step(self, mgr: ResidencyManager, d: DecodePart) -> list[Copy]:
        self._fixed = self._fixed_units(mgr, d)
        return [c for layer in range(self.lead) for c in self.refill(mgr, layer, d)]

    def on_predict(self, mgr: ResidencyManager, layer: int, lanes, idx: torch.Tensor, scores: torch.Tensor,
                   cap: int) -> None:
        return None

    def after_layer(self, mgr: ResidencyManager, layer: int, d: DecodePart) -> list[Copy]:
        if layer + self.lead < self.num_layers:
            return self.refill(mgr, layer + self.lead, d)            # this buffer is free again
        return []

    def store(self, tier: DeviceTier, layers: slice, ks: torch.Tensor, vs: torch.Tensor, p: StepPlan) -> None:
        pass

    def restore(self, mgr: ResidencyManager, lane: int, logical: list[int]) -> list[Copy]:
        return []

    @staticmethod
    def _fixed_units(mgr: ResidencyManager, d: DecodePart) -> tuple[torch.Tensor, torch.Tensor]:
        """(lanes, heads, slots, logical blocks) [4, n] of every lane's sink and window blocks, and
        their host blocks: the same for every layer of the step. From the plan's `fixed` (one entry
        per (lane, block), built on the host with the plan), one per KV head here, on the device."""
        kvh = mgr.tier.kvh
        lanes, slots, blocks = d.fixed.unbind(0)
        n = lanes.shape[0]
        heads = torch.arange(kvh, device=d.fixed.device).repeat(n)
        per_head = [t[:, None].expand(n, kvh).reshape(-1) for t in (lanes, slots, blocks)]
        ix = torch.stack([per_head[0], heads, per_head[1], per_head[2]])
        return ix, mgr.lane_blocks[ix[0], ix[3]]                         # logical -> host block ids

    def refill(self, mgr: ResidencyManager, layer: int, d: DecodePart) -> list[Copy]:
        """Layer `layer`'s sink, window and whole predicted set, copied into its buffer."""
        buf = self.buffer_of(layer)
        ix, host = self._fixed
        fixed = CopyJob(*mgr.pool_views[layer], *mgr.tier.views[buf], (host, ix[1]), (ix[0], ix[1], ix[2]),
                        tag=(mgr.step_idx, layer, "fixed"))
        want = mgr.pred[layer, d.lanes]                                  # [B, KVH, K]
        mgr.slots.assign(buf, d.lanes, want, mgr.step_idx)
        # the whole set as a fixed-capacity list: entry (b, h, j) is slot j, valid where it holds
        # a block (no host read of how many do)
        shape = want.shape
        dev = want.device
        adm = Admission(d.lanes[:, None, None].expand(shape).reshape(-1),
                        torch.arange(shape[1], device=dev)[None, :, None].expand(shape).reshape(-1),
                        torch.arange(shape[2], device=dev)[None, None, :].expand(shape).reshape(-1),
                        want.clamp(min=0).reshape(-1), (want >= 0).reshape(-1))
        return [Copy(layer, fixed, counted=False), Copy(layer, mgr.job(layer, buf, adm))]
