"""Per-step metadata shared by the model runner and the attention backends (cf. nano-vllm's Context).

A step is a flat batch of T token rows made of `StepItem`s: a prefill chunk or one decode token of a
sequence. Built once per step by the runner (as lists, then tensors moved to the device in one
go) and never changed after: every layer's attention only reads it.
"""
from __future__ import annotations

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
