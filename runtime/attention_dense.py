"""Dense paged attention: every step attends to the whole cached context of each sequence (in
sparse mode, a decode row to the keys its `BlockSelection` selects, read in place: runtime/sparse.py).

K/V come from the KV pool in its storage dtype (`kv_dtype`). Where that differs from the
queries' dtype (a float16/bfloat16 cache under an fp32 model), attention upcasts the stored
values and computes in fp32; at equal dtypes (the fp32 default) nothing is cast.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .kv_pool import KVPool
from .step import StepBatch

from .ops import paged_mask

if TYPE_CHECKING:
    from .ops import Ops
    from .sparse import BlockSelection


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """One query row per head without repeating K/V across the GQA group.

    q: [H, D]; k, v: [KVH, L, D] -> [H, D] in q's dtype. mask: bool [KVH, L], the keys each KV
    head's queries see (sparse mode's selection; None: all; at least one per head). A decode row
    the paged kernel does not take (or a table without it) comes here. K/V stored in another
    dtype than q's (a half-precision cache) are read in fp32.
    """
    kvh = k.shape[0]
    if k.dtype != q.dtype or v.dtype != q.dtype:            # the stored values, upcast: fp32 math
        return decode_attention(q.float(), k.float(), v.float(), scale, mask).to(q.dtype)
    qg = q.view(kvh, -1, q.shape[-1])                       # [KVH, G, D]
    logits = (qg @ k.transpose(1, 2)).float() * scale
    if mask is not None:
        logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(v.dtype)
    return (probs @ v).view(q.shape)                         # [KVH, G, D] -> [H, D]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of n new rows over L = prefix + n cached keys.

    q: [n, H, D]; k, v: [KVH, L, D] -> [n, H, D] in q's dtype; K/V of another dtype than q's (a
    half-precision cache) are read in fp32.
    """
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return prefill_attention(q.float(), k.float(), v.float()).to(q.dtype)
    n, L = q.shape[0], k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)                      # [1, H, n, D]
    kh, vh = k.unsqueeze(0), v.unsqueeze(0)
    if n == L:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:  # row i sits at position L - n + i and sees keys 0..L - n + i
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(diagonal=L - n)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


class DenseAttention:
    """Dense mode's attention over a KVPool. `step(batch)` gives one step's AttentionBackend; the
    batch is an argument, never state set from outside. `selection`: sparse mode's
    (runtime/sparse.py): decode rows attend to their selected keys only, in place. `ops`: the
    engine's kernel table (its decode and paged attention entries)."""

    def __init__(self, pool: KVPool, scale: float, ops: "Ops", selection: "BlockSelection | None" = None):
        self.pool, self.scale, self.ops, self.selection = pool, scale, ops, selection

    def step(self, batch: StepBatch) -> "DenseStep":
        return DenseStep(self.pool, self.scale, batch, self.ops, self.selection)


class DenseStep:
    """One step's dense attention: stores each layer's rows where `batch` says, then attends.
    `fused_items` says whether the runner may run the step as one fused C call instead."""

    def __init__(self, pool: KVPool, scale: float, batch: StepBatch, ops: "Ops",
                 selection: "BlockSelection | None" = None):
        self.pool, self.scale, self.batch, self.ops, self.selection = pool, scale, batch, ops, selection
        self._paged: tuple | None = None     # the step's batched decode items, see _paged_decode

    def _paged_decode(self) -> tuple:
        """(rows, tables, lens, mask, row set) of the step's decode items, for one kernel call a
        layer (the table's `paged_attention`, which shares their (sequence, head) units out over the
        threads; their blocks anywhere in the pool, e.g. a prefix shared with other sequences);
        rows is None when there are none or the table has no paged kernel. Worked out once a step: every layer's
        lengths are the same."""
        if self._paged is not None:
            return self._paged
        rows, tables, lens = [], [], []
        if self.ops.paged_attention is not None:
            for it in self.batch.items:
                if it.num_tokens == 1 and not self._prefill_kernel(it):
                    rows.append(it.row_start), tables.append(it.block_table), lens.append(it.context_len)
        self._paged = ((torch.tensor(rows, dtype=torch.long), tables, lens,
                        paged_mask(lens, self.pool.num_kv_heads), frozenset(rows)) if rows
                       else (None, [], [], None, frozenset()))
        return self._paged

    def _prefill_kernel(self, it) -> bool:
        """Whether item `it` takes the table's prefill attention: a prompt chunk, when the table
        has one (at float32 prompt rows attend as they always did: torch's, or the paged kernel
        for a one-token chunk)."""
        return it.prompt and self.ops.prefill_attention is not None

    def fused_items(self) -> tuple[list[list[int]], list[int]] | None:
        """(each item's block table, its context length) when the fused decode step
        (the table's `fused_decoder`) can run this step in place of the layers' `forward` calls: every
        item one token, item i at row i (what `_paged_decode` sends to one kernel call, for every
        item); else None."""
        if self.batch.store_only or not self.batch.items:
            return None
        tables, lens = [], []
        for i, it in enumerate(self.batch.items):
            if it.num_tokens != 1 or it.row_start != i or self._prefill_kernel(it):
                return None
            tables.append(it.block_table), lens.append(it.context_len)
        return tables, lens

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        self.pool.write(layer_idx, k, v, b.slot_blocks, b.slot_offsets)
        out = torch.empty_like(q)
        rows, tables, lens, mask, done = self._paged_decode()
        sel = self.selection
        if rows is not None:
            if sel is not None:         # the step's summaries: every selected block is a full one
                mask = sel.mask(layer_idx, q[rows], None, lens, tables)
            o = self.ops.paged_attention(q[rows], self.pool.k[layer_idx], self.pool.v[layer_idx], None, lens,
                                    self.scale, mask, tables)
            if o is None:
                done = frozenset()
            else:
                out[rows] = o.to(out.dtype)
        for it in b.items:
            if it.row_start in done:
                continue
            own = slice(it.row_start, it.row_start + it.num_tokens)
            if self._prefill_kernel(it):    # straight from the pool (written above), in the table's precision
                out[own] = self.ops.prefill_attention(q[own], self.pool.k[layer_idx], self.pool.v[layer_idx],
                                                      it.block_table, it.context_len, self.scale).to(out.dtype)
                continue
            if it.start_pos == 0:       # whole sequence is in this chunk: no need to read the pool
                # (the rows as the pool stores them, so a chunking of the prompt sees the same keys)
                kc, vc = (t[own].transpose(0, 1).to(self.pool.dtype) for t in (k, v))
            else:
                kc, vc = self.pool.read(layer_idx, it.block_table, it.context_len)
            if it.num_tokens == 1:
                m = None if sel is None else sel.mask_for(layer_idx, q[own][0], it.block_table, it.context_len)
                out[own] = decode_attention(q[own][0], kc, vc, self.scale, m).unsqueeze(0)
            else:
                out[own] = prefill_attention(q[own], kc, vc)
        return out
