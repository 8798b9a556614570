"""Per-step metadata shared by the model runner and the attention backends (cf. nano-vllm's Context).

A step is a flat batch of T token rows made of `StepItem`s: a prefill chunk or one decode token of a
sequence. Built once per step by the runner (as lists, then tensors moved to the device in one
go) and never changed after: every layer's attention only reads it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .device import to_device


@dataclass(frozen=True)
class StepItem:
    seq_id: int
    row_start: int            # first row of this item in the flat batch
    num_tokens: int           # rows of this item that are real tokens (stored in the cache)
    start_pos: int            # position of the first row
    block_table: list[int]
    prompt: bool = False      # a chunk of the prompt (its rows take the prefill kernels), not a decode row

    @property
    def context_len(self) -> int:
        """Tokens in the cache after this step's rows are written."""
        return self.start_pos + self.num_tokens


@dataclass(frozen=True)
class StepBatch:
    items: list[StepItem]
    tokens: torch.Tensor          # [T] int64
    positions: torch.Tensor       # [T] int64
    slot_blocks: torch.Tensor     # [T] int64 block id of each real row
    slot_offsets: torch.Tensor    # [T] int64 offset within that block
    store_only: bool = False      # a replayed prefill (runtime/prefill_cache.py): the backend stores
                                  # the recorded K/V (and seeds), the model does not run

    @functools.cached_property
    def row_kinds(self) -> tuple[slice | torch.Tensor, slice | torch.Tensor] | None:
        """(prompt rows, the other rows) when the step mixes prompt-chunk rows (what the prefill
        kernels compute) with decode rows, each a slice when it is one run, else indices on the
        step's device (built on the host, moved once); None when every row is of one kind."""
        prompt = [r for it in self.items if it.prompt for r in range(it.row_start, it.row_start + it.num_tokens)]
        T = self.tokens.shape[0]
        if not prompt or len(prompt) == T:
            return None
        mark = set(prompt)
        rest = [r for r in range(T) if r not in mark]

        def index(rows: list[int]):
            if rows == list(range(rows[0], rows[0] + len(rows))):
                return slice(rows[0], rows[0] + len(rows))
            return to_device(self.tokens.device, torch.tensor(rows, dtype=torch.long))[0]
        return index(prompt), index(rest)

    @property
    def all_prompt(self) -> bool:
        """Every row of the step is a prompt chunk's (a lookahead draft row belongs to no item)."""
        n = sum(it.num_tokens for it in self.items if it.prompt)
        return n > 0 and n == self.tokens.shape[0]

    @classmethod
    def build(cls, items: list[StepItem], token_ids: list[int], block_size: int,
              device: torch.device = torch.device("cpu"), store_only: bool = False) -> "StepBatch":
        positions, blocks, offsets = [], [], []
        for it in items:
            for p in range(it.start_pos, it.start_pos + it.num_tokens):
                positions.append(p)
                blocks.append(it.block_table[p // block_size])
                offsets.append(p % block_size)
        # one [4, T] host tensor, one copy to the device
        packed = torch.tensor([token_ids, positions, blocks, offsets], dtype=torch.long)
        return cls(items, *to_device(device, packed)[0].unbind(0), store_only=store_only)


class StepInterrupted(Exception):
    """Raised between the layers of a prompt-only step once every request in it was aborted
    (`Engine.step(interrupt=...)`): the step's rows are dropped and its sequences end as aborted,
    so a client that leaves during a long prefill chunk stops it within a layer, not a chunk."""

    def __init__(self, layer: int):
        super().__init__(f"step interrupted before layer {layer}: every request in it was aborted")
        self.layer = layer


class Interruptible:
    """A step's attention backend in front of `attn` that asks `interrupt()` before each layer's
    attention and raises `StepInterrupted` when it says so (the layer's projections are the most
    a late abort computes)."""

    def __init__(self, attn, interrupt):
        self.attn, self.interrupt = attn, interrupt

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.interrupt():
            raise StepInterrupted(layer)
        return self.attn.forward(layer, q, k, v)
