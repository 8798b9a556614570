"""The device tier: every lane's bounded KV working set, the views attention and copies use, the
write-through of sink/window rows, and attention's key mask.

    k, v  [buffers, lanes, KVH, S + Wb + K, block_size, D]   (slots: runtime/lookahead/layout.py)

A buffer is a layer (`resident`) or one of `prefetch_lead` ping-pong buffers. Bytes arrive here
from the host pool only through the transfer engine (copy jobs into `views`); the only other
writes are this step's own rows (`write_through`), which are already on the device.
"""
from __future__ import annotations

import torch

from .layout import SlotLayout
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
