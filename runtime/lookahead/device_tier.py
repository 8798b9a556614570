"""The device tier: every lane's bounded KV working set, the views attention and copies use, the
write-through of sink/window rows, and attention's key mask.

    k, v  [buffers, lanes, KVH, S + Wb + K, block_size, D]   (slots: `SlotLayout`, below)

A buffer is a layer (`resident`) or one of `prefetch_lead` ping-pong buffers. Bytes arrive here
from the host pool only through the transfer engine (copy jobs into `views`); the only other
writes are this step's own rows (`write_through`), which are already on the device.

`SlotLayout`: the geometry of one lane's working set, per layer and KV head (plain ints).
Slots (each one block of `block_size` tokens):

    [0, S)            sink blocks 0..S-1 (attention sinks, always resident)
    [S, S + Wb)       recent-window ring: logical block b >= S lives in slot S + b % Wb
    [S + Wb, NS)      the selected working set: K slots, filled by prediction

Candidates for top-K are the full blocks between the sinks and the window.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import LookaheadConfig

if TYPE_CHECKING:
    from .step_plan import DecodePart


class DeviceTier:
    def __init__(self, layout: SlotLayout, num_buffers: int, num_lanes: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        """dtype: the KV storage dtype (the host pool's)."""
        self.layout, self.num_buffers, self.kvh = layout, num_buffers, num_kv_heads
        shape = (num_buffers, num_lanes, num_kv_heads, layout.num_slots, layout.block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # views made once: a buffer as copy jobs address it, and as attention reads it
        # ([lanes, KVH, tokens, D]: all slots' tokens in a row, no gather)
        tokens = (num_lanes, num_kv_heads, layout.num_slots * layout.block_size, head_dim)
        self.views = [(self.k[b], self.v[b]) for b in range(num_buffers)]
        # the selected slots alone (slot j of a view is selected slot j): what admissions address
        S = layout.selected_start
        self.selected_views = [(k[:, :, S:], v[:, :, S:]) for k, v in self.views]
        self._tokens = [(self.k[b].view(tokens), self.v[b].view(tokens)) for b in range(num_buffers)]
        # attention's key mask by slot and token: sink/window rows set once per step
        # (`set_window_mask`), the selected rows per layer from the slot table (`keys`)
        self.mask = torch.zeros(num_lanes, num_kv_heads, layout.num_slots, layout.block_size, dtype=torch.bool,
                                device=device)

    def bytes_per_lane(self) -> int:
        """KV working-set bytes one lane holds (k + v, every buffer)."""
        return self.k[0, 0].numel() * self.k.element_size() * 2 * self.num_buffers

    def set_window_mask(self, d: DecodePart) -> None:
        """The step's visible sink/window tokens (the same in every layer)."""
        lay = self.layout
        self.mask[: d.num_lanes, :, : lay.selected_start] = d.base_mask.view(d.num_lanes, 1, lay.selected_start,
                                                                             lay.block_size)

    def write_through(self, layers: slice, ks: torch.Tensor, vs: torch.Tensor, lanes: torch.Tensor,
                      logical: torch.Tensor, offsets: torch.Tensor) -> None:
        """Stored rows ks/vs [L', T_w, KVH, D] of sink/window blocks into their device slots, so
        the device copies of those blocks stay current (buffer = layer)."""
        lay = self.layout
        slot = torch.where(logical < lay.num_sink, logical, lay.num_sink + logical % lay.num_window)
        # advanced indices on dims 1, 3, 4 around a slice: the indexed view is [T_w, L', KVH, D]
        self.k[layers, lanes, :, slot, offsets] = ks.transpose(0, 1).to(self.k.dtype)
        self.v[layers, lanes, :, slot, offsets] = vs.transpose(0, 1).to(self.v.dtype)

    def keys(self, buf: int, n: int, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Buffer `buf` as attention reads it for lanes [0, n): (k, v [n, KVH, tokens, D], mask
        [n, KVH, tokens]) over the sink, the window and the first `used` selected slots, where
        selected [n, KVH, used] says which of those hold a block. Slots past `used` are empty in
        every lane: left out, not masked."""
        S, used, bs = self.layout.selected_start, selected.shape[-1], self.layout.block_size
        self.mask[:n, :, S: S + used] = selected[..., None]
        n_keys = (S + used) * bs
        mask = self.mask[:n].view(n, self.kvh, -1)[:, :, :n_keys]
        kb, vb = (t[:n, :, :n_keys] for t in self._tokens[buf])
        return kb, vb, mask


@dataclass(frozen=True)
class SlotLayout:
    block_size: int
    num_sink: int        # S
    num_window: int      # Wb
    top_k: int           # K

    @classmethod
    def from_config(cls, cfg: LookaheadConfig) -> "SlotLayout":
        wb = -(-cfg.recent_window // cfg.block_size) + 1 if cfg.recent_window > 0 else 1
        return cls(cfg.block_size, cfg.num_sink_blocks, wb, cfg.top_k)

    @property
    def num_slots(self) -> int:
        return self.num_sink + self.num_window + self.top_k

    @property
    def selected_start(self) -> int:
        return self.num_sink + self.num_window

    def window_start(self, context_len: int) -> int:
        """First logical block of the recent window for a sequence of `context_len` tokens."""
        last = (context_len - 1) // self.block_size
        return max(self.num_sink, last - self.num_window + 1)

    def fixed_blocks(self, last: int, window_of: int) -> list[int]:
        """The sink blocks and the recent window of a `window_of`-token sequence, up to logical
        block `last`, each once, ascending: the blocks the tier holds whatever is selected."""
        sink = range(min(self.num_sink, last + 1))
        return list(dict.fromkeys([*sink, *range(self.window_start(window_of), last + 1)]))

    def num_candidates(self, context_len: int) -> int:
        return max(0, self.window_start(context_len) - self.num_sink)

    def device_slot(self, logical_block: int) -> int:
        """Where a sink or window block lives (write-through target)."""
        if logical_block < self.num_sink:
            return logical_block
        return self.num_sink + logical_block % self.num_window


def num_buffers(cfg: LookaheadConfig, num_layers: int) -> int:
    """Device-tier buffers: one per layer (resident), or `prefetch_lead` (pingpong: layer l uses
    buffer l % lead, and layer l + lead is refilled into it once layer l is done)."""
    return min(cfg.prefetch_lead, num_layers) if cfg.residency == "pingpong" else num_layers
