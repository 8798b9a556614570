"""The residency policies: when the working set is copied in, into which buffer, and whether stored
rows are written through. One object per `residency`; the residency manager calls it at fixed
points of the step (runtime/lookahead/residency.py) and it never branches on the residency.

    hook                     resident                           pingpong (lead = prefetch_lead)
    buffer_of(l)             l                                  l % lead
    begin_step               -                                  refill layers 0 .. lead-1
    on_predict               capped admission, copies queued    - (the prediction waits for the refill)
    after_layer(l)           -                                  refill layer l + lead into l's buffer
    store (end of step)      write sink/window rows through     - (re-copied at every refill)
    restore (cache hit)      copy the cached sink/window in     - (re-copied at every refill)
"""
from __future__ import annotations

import torch

from ..config import LookaheadConfig
from ..device import to_device
from ..transfer import CopyJob
from .device_tier import DeviceTier
from .layout import num_buffers
from .residency import Admission
from .step_plan import DecodePart, StepPlan


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

    def begin_step(self, mgr, d: DecodePart) -> None:
        pass

    def on_predict(self, mgr, layer: int, lanes, idx: torch.Tensor, scores: torch.Tensor, cap: int) -> None:
        prio = scores.gather(-1, idx.clamp(min=0))
        adm = mgr.slots.plan(layer, lanes, idx, prio, cap, mgr.step_idx, most=mgr.most)
        if len(adm):
            mgr.tickets.setdefault(layer, []).append(mgr.submit(layer, layer, adm))

    def after_layer(self, mgr, layer: int, d: DecodePart) -> None:
        pass

    def store(self, tier: DeviceTier, layers: slice, ks: torch.Tensor, vs: torch.Tensor, p: StepPlan) -> None:
        """The device copies of sink/window blocks stay current: stored rows are written through."""
        w = p.write_through
        tier.write_through(layers, ks[:, w], vs[:, w], p.real_lanes[w], p.real_logical[w], p.batch.slot_offsets[w])

    def restore(self, mgr, lane: int, logical: list[int]) -> None:
        """A prefix-cache hit: the lane's sink/window blocks that its prefill will not store
        (`logical`, already in the host pool) are copied into their slots, every layer, by the
        transfer engine; the lane's first decode step waits for them (prefetched blocks in the
        metrics: they are bytes moved host to device)."""
        if not logical:
            return
        kvh, lay = mgr.tier.kvh, mgr.tier.layout
        n = len(logical) * kvh
        host = [mgr.lane_host_block(lane, b) for b in logical for _ in range(kvh)]
        heads = list(range(kvh)) * len(logical)
        slots = [lay.device_slot(b) for b in logical for _ in range(kvh)]
        host, heads, slots, lanes = to_device(mgr.tier.k.device, *(torch.tensor(t, dtype=torch.long)
                                                                  for t in (host, heads, slots, [lane] * n)))
        for layer in range(self.num_buffers):
            job = CopyJob(*mgr.pool_views[layer], *mgr.tier.views[layer], (host, heads), (lanes, heads, slots),
                          tag=(mgr.step_idx, layer, "restore"))
            mgr.metrics.add_blocks(False, lanes)
            mgr.tickets.setdefault(layer, []).append(mgr.send(job))


class PingPongPolicy:
    """DualDecoder: `lead` layer buffers; layer l reads buffer l % lead, which is refilled with
    layer l + lead's whole sparse set (sink, window, the full predicted set, no cap) as soon as
    layer l's attention is done."""

    def __init__(self, num_layers: int, lead: int):
        self.num_layers, self.lead, self.num_buffers = num_layers, lead, lead
        self._fixed: tuple[torch.Tensor, torch.Tensor] | None = None    # this step's sink/window units

    def buffer_of(self, layer: int) -> int:
        return layer % self.lead

    def begin_step(self, mgr, d: DecodePart) -> None:
        self._fixed = self._fixed_units(mgr, d)
        for layer in range(self.lead):
            self.refill(mgr, layer, d)

    def on_predict(self, mgr, layer: int, lanes, idx: torch.Tensor, scores: torch.Tensor, cap: int) -> None:
        pass

    def after_layer(self, mgr, layer: int, d: DecodePart) -> None:
        if layer + self.lead < self.num_layers:
            self.refill(mgr, layer + self.lead, d)            # this buffer is free again

    def store(self, tier: DeviceTier, layers: slice, ks: torch.Tensor, vs: torch.Tensor, p: StepPlan) -> None:
        pass

    def restore(self, mgr, lane: int, logical: list[int]) -> None:
        pass

    @staticmethod
    def _fixed_units(mgr, d: DecodePart) -> tuple[torch.Tensor, torch.Tensor]:
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

    def refill(self, mgr, layer: int, d: DecodePart) -> None:
        """Copy layer `layer`'s sink, window and whole predicted set into its buffer."""
        buf = self.buffer_of(layer)
        ix, host = self._fixed
        fixed_job = CopyJob(*mgr.pool_views[layer], *mgr.tier.views[buf], (host, ix[1]), (ix[0], ix[1], ix[2]),
                            tag=(mgr.step_idx, layer, "fixed"))
        mgr.tickets[layer] = [mgr.send(fixed_job)]
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
        mgr.tickets[layer].append(mgr.submit(layer, buf, adm))
