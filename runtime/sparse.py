"""Sparse mode's block selection: top-K sparse attention over the KV cache where it lies.

`mode: sparse` attends each decode query to the keys of its sequence's sink blocks, its recent
window and the `top_k` blocks its query scores highest against the blocks' min/max key summaries
(Quest's upper bound, `group_score` over a GQA group), per layer and KV head: the selection of
lookahead mode's `draft: none` (sparse attention on demand), with no device tier. The cache stays
in the dense pool and attention reads the selected keys in place: the paged kernel never reads a
masked key. It is the mode for a machine where the cache already is in the memory the model
computes from (a CPU), so that copying the selection into a working set would only add bytes.

`BlockSelection` holds one summary per pool block and layer (`kmin`/`kmax` `[L, num_blocks, KVH,
D]`, fp32 over the keys as the pool stores them) and builds a step's key masks:
- `mask(layer, q, starts, lens)`: for B sequences whose blocks are one run each (the dense step's
  batched path and the fused C step, plugins/cpu/decode.c, which does the same per layer): bool
  `[B, KVH, max(lens)]`;
- `mask_for(layer, q, block_table, n)`: one sequence with any block table (the per-item path);
- `update(batch)`: after a step's layers, every row the step stored folds into its block's
  summary (the rows' own blocks are in the window this step, never candidates, so the step's
  selection does not depend on them).
Candidates are the full blocks between the sinks and the window, as in lookahead mode
(`SlotLayout`): the selected set equals that mode's for the same summaries.
"""
from __future__ import annotations

import torch

from .config import LookaheadConfig, ModelConfig
from .kv_pool import KVPool
from .lookahead.device_tier import SlotLayout
from .ops import Ops
from .step import StepBatch

DTYPE = torch.float32
FEW_ROWS = 64       # rows of a step whose summaries are folded for every layer at once


class BlockSelection:
    def __init__(self, mcfg: ModelConfig, cfg: LookaheadConfig, pool: KVPool, ops: Ops):
        self.layout = SlotLayout.from_config(cfg)
        self.top_k, self.group_score, self.ops, self.pool = cfg.top_k, cfg.group_score, ops, pool
        self.block_size = cfg.block_size
        shape = (mcfg.num_layers, pool.num_blocks, mcfg.num_kv_heads, mcfg.head_dim)
        self.kmin = torch.zeros(shape, dtype=DTYPE, device=pool.device)
        self.kmax = torch.zeros(shape, dtype=DTYPE, device=pool.device)
        self.kvh = mcfg.num_kv_heads

    def nbytes(self) -> int:
        return 2 * self.kmin.numel() * self.kmin.element_size()

    # ---- the keys a query sees ----------------------------------------------------------------
    def _visible(self, layer: int, q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, n: int) -> torch.Tensor:
        """q [H, D] of a query with `n` keys (itself included), kmin/kmax [nb, KVH, D] its blocks'
        summaries in logical order -> bool [KVH, n]: sink, window and top-K blocks' keys."""
        lay, bs = self.layout, self.block_size
        nb = kmin.shape[0]
        w0 = lay.window_start(n)
        blocks = torch.zeros(self.kvh, nb, dtype=torch.bool, device=q.device)
        blocks[:, :lay.num_sink] = True
        blocks[:, w0:] = True
        if w0 > lay.num_sink:                       # candidates [S, w0): the full blocks between
            valid = torch.zeros(1, 1, nb, dtype=torch.bool, device=q.device)
            valid[..., lay.num_sink:w0] = True
            idx, _ = self.ops.block_topk(q[None, None].to(DTYPE), kmin[None], kmax[None], valid,
                                         min(self.top_k, nb), self.group_score)   # [1, 1, KVH, k]
            idx = idx[0, 0]                         # ascending, -1 padded (fewer candidates than k)
            picked = idx >= 0
            heads = torch.arange(self.kvh, device=q.device)[:, None].expand_as(idx)
            blocks[heads[picked], idx[picked]] = True
        return blocks.repeat_interleave(bs, dim=1)[:, :n]

    def mask(self, layer: int, q: torch.Tensor, starts: list[int] | None, lens: list[int],
             tables: list[list[int]] | None = None) -> torch.Tensor:
        """q [B, H, D], sequence b's keys the lens[b] tokens from pool block starts[b] on (one run
        each), or with `tables` those of the blocks tables[b] lists -> the paged attention's key
        mask [B, KVH, max(lens)]. A run's summaries are read in place, other tables' gathered."""
        out = torch.zeros(len(lens), self.kvh, max(lens), dtype=torch.bool, device=q.device)
        bs = self.block_size
        for b, n in enumerate(lens):
            nb = -(-n // bs)
            r = starts[b] if tables is None else self.pool.run_start(tables[b], n)
            if r is not None:
                kmin, kmax = self.kmin[layer, r:r + nb], self.kmax[layer, r:r + nb]
            else:
                ids = torch.tensor(tables[b][:nb], dtype=torch.long, device=self.kmin.device)
                kmin, kmax = self.kmin[layer, ids], self.kmax[layer, ids]
            out[b, :, :n] = self._visible(layer, q[b], kmin, kmax, n)
        return out

    def mask_for(self, layer: int, q: torch.Tensor, block_table: list[int], n: int) -> torch.Tensor:
        """One sequence's key mask [KVH, n] for q [H, D], its blocks anywhere in the pool."""
        ids = torch.tensor(block_table[: -(-n // self.block_size)], dtype=torch.long, device=self.kmin.device)
        return self._visible(layer, q, self.kmin[layer, ids], self.kmax[layer, ids], n)

    # ---- the summaries ----------------------------------------------------------------------------
    def update(self, batch: StepBatch) -> None:
        """Fold every row the step stored (all layers, read back from the pool as stored) into its
        block's summary; a row at offset 0 starts its block's."""
        blocks, offsets = batch.slot_blocks, batch.slot_offsets
        T = blocks.numel()
        if T == 0:
            return
        L, flat = self.kmin.shape[0], (-1, self.kvh, self.kmin.shape[-1])
        if T <= FEW_ROWS:           # a decode step: every layer's rows in one call
            keys = self.pool.k[:, :, blocks, offsets]             # [L, KVH, T, D], the stored values
            keys = keys.permute(0, 2, 1, 3).reshape(L * T, self.kvh, -1)
            ids = (torch.arange(L, device=blocks.device)[:, None] * self.pool.num_blocks + blocks).reshape(-1)
            self.ops.update_summaries(self.kmin.view(flat), self.kmax.view(flat), keys.to(DTYPE), ids,
                                      offsets.repeat(L))
            return
        for layer in range(L):      # a prefill: a layer at a time (an 8K x 4 prompt's keys are ~25 MiB a layer)
            keys = self.pool.k[layer][:, blocks, offsets].transpose(0, 1)            # [T, KVH, D]
            self.ops.update_summaries(self.kmin[layer], self.kmax[layer], keys.to(DTYPE), blocks, offsets)
