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

from .device import to_device
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


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                           hide: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense decode attention of B sequences, one row each, in one batch of ops (the torch
    table's: no loop over the sequences, the same ops whatever B).

    q: [B, H, D]; k, v: one layer of the KV pool, [KVH, num_blocks, bs, D]; table: [B, nb] int64,
    sequence b's blocks in order, padded to the batch's longest with any valid id; hide: bool
    [B, KVH or 1, nb * bs], the gathered keys a sequence does not see (past its length; sparse
    mode's unselected ones) -> [B, H, D] in q's dtype. K and V are gathered once for the batch
    (one index_select each, KV-head-major, so no GQA repeat); the math is `decode_attention`'s
    (logits in fp32, a half-precision cache read in fp32), over the padded keys, whose weights
    are zero. Every sequence must see at least one key."""
    B, H, D = q.shape
    kvh, bs = k.shape[0], k.shape[2]
    nb = table.shape[1]
    G, L = H // kvh, nb * bs
    ids = table.reshape(-1)
    kb = k.index_select(1, ids).view(kvh * B, L, D)         # [KVH * B, L, D]: head-major, batch inside
    vb = v.index_select(1, ids).view(kvh * B, L, D)
    qg = q
    if kb.dtype != q.dtype:                                  # the stored values, upcast: fp32 math
        qg, kb, vb = q.float(), kb.float(), vb.float()
    qg = qg.view(B, kvh, G, D).transpose(0, 1).reshape(kvh * B, G, D)
    logits = (qg @ kb.transpose(1, 2)).float() * scale      # [KVH * B, G, L]
    logits = logits.view(kvh, B, G, L).masked_fill_(hide.transpose(0, 1).unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(vb.dtype).view(kvh * B, G, L)
    out = (probs @ vb).view(kvh, B, G, D).transpose(0, 1).reshape(B, H, D)
    return out.to(q.dtype)


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


class PaddedDecode:
    """A step of decode rows only, its dense attention held as tensors: each layer stores its rows
    and attends with `paged_decode_attention` over the step's padded block tables. What the torch
    table's `DenseStep` runs for such a step, and what a compiled graph of the step traces
    (`DenseRunner.compile_decode`): nothing in `forward` reads a Python value made from the step's
    data, so the model's work of the step is one graph (0 breaks)."""

    def __init__(self, pool: KVPool, scale: float, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                 table: torch.Tensor, hide: torch.Tensor):
        self.pool, self.scale = pool, scale
        self.slot_blocks, self.slot_offsets, self.table, self.hide = slot_blocks, slot_offsets, table, hide

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer_idx, k, v, self.slot_blocks, self.slot_offsets)
        return paged_decode_attention(q, self.pool.k[layer_idx], self.pool.v[layer_idx], self.table, self.hide,
                                      self.scale)


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
        self._batched: tuple | None = None   # the same for the torch table, see _batched_decode
        self._padded: PaddedDecode | None | bool = False     # see padded (False: not worked out yet)

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

    def _batched_decode(self) -> tuple:
        """The torch table's batch of the step's decode items (a table without a paged kernel):
        (rows: a slice when they are rows 0..B-1, else indices; table [B, nb]; hide [B, 1, nb * bs];
        the block tables; the lengths; the row set; whether they are every row of the step, in
        order), for `paged_decode_attention` once a layer; rows is None when there are none. Built
        on the host once a step, moved in one copy."""
        if self._batched is not None:
            return self._batched
        items = [it for it in self.batch.items if it.num_tokens == 1 and not self._prefill_kernel(it)]
        if not items:
            self._batched = (None, None, None, [], [], frozenset(), False)
            return self._batched
        bs = self.pool.block_size
        lens = [it.context_len for it in items]
        tables = [it.block_table for it in items]
        nb = max(-(-n // bs) for n in lens)
        table = torch.zeros(len(items), nb, dtype=torch.long)          # padding reads block 0, hidden
        for b, (t, n) in enumerate(zip(tables, lens)):
            table[b, : -(-n // bs)] = torch.tensor(t[: -(-n // bs)], dtype=torch.long)
        hide = (torch.arange(nb * bs)[None] >= torch.tensor(lens)[:, None]).unsqueeze(1)   # [B, 1, nb * bs]
        rows = [it.row_start for it in items]
        every = rows == list(range(len(rows))) and len(rows) == self.batch.tokens.shape[0]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            index = slice(rows[0], rows[0] + len(rows))
            table, hide = to_device(self.pool.device, table, hide)
        else:
            table, hide, index = to_device(self.pool.device, table, hide, torch.tensor(rows, dtype=torch.long))
        self._batched = (index, table, hide, tables, lens, frozenset(rows), every)
        return self._batched

    def padded(self) -> PaddedDecode | None:
        """This step as a `PaddedDecode` when the torch table runs it (no paged kernel) and it is
        decode rows only, one per item in item order, outside sparse mode (whose selection is
        worked out per sequence); else None."""
        if self._padded is False:
            self._padded = None
            if self.ops.paged_attention is None and self.selection is None and not self.batch.store_only:
                rows, table, hide, _, _, _, every = self._batched_decode()
                if every:
                    b = self.batch
                    self._padded = PaddedDecode(self.pool, self.scale, b.slot_blocks, b.slot_offsets, table, hide)
        return self._padded

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
        if (padded := self.padded()) is not None:   # a decode step on the torch table
            return padded.forward(layer_idx, q, k, v)
        b = self.batch
        self.pool.write(layer_idx, k, v, b.slot_blocks, b.slot_offsets)
        sel = self.selection
        if self.ops.paged_attention is None:          # the torch table: the decode items in one batch
            rows, table, hide, tables, lens, done, _ = self._batched_decode()
            out = torch.empty_like(q)
            if rows is not None:
                if sel is not None:     # the selection's key mask [B, KVH, max(lens)], padded
                    m = sel.mask(layer_idx, q[rows], None, lens, tables)
                    hide = ~F.pad(m, (0, hide.shape[-1] - m.shape[-1]))
                out[rows] = paged_decode_attention(q[rows], self.pool.k[layer_idx], self.pool.v[layer_idx], table,
                                                   hide, self.scale)
        else:
            out = torch.empty_like(q)
            rows, tables, lens, mask, done = self._paged_decode()
            if rows is not None:
                if sel is not None:     # the step's summaries: every selected block is a full one
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
