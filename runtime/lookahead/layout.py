"""Geometry of one lane's device working set, per layer and KV head (plain ints).

Slots (each one block of `block_size` tokens):

    [0, S)            sink blocks 0..S-1 (attention sinks, always resident)
    [S, S + Wb)       recent-window ring: logical block b >= S lives in slot S + b % Wb
    [S + Wb, NS)      the selected working set: K slots, filled by prediction

Candidates for top-K are the full blocks between the sinks and the window.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import LookaheadConfig


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
