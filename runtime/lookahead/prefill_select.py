"""Block-sparse prefill: a long prompt's later chunks attend to the blocks their queries point at, not to all.

Dense causal attention over a 30K prompt is ~40 TFLOP on Qwen2.5-0.5B, minutes on a 2-core CPU. The look-ahead
already keeps what a sparse choice needs: every full block's min/max key summary, per layer and KV head, up to
date before a chunk's attention runs (the chunk's rows are stored first). So, with `prefill_top_k` > 0, a chunk
whose context reaches past its local window attends to

- the sink blocks,
- the `prefill_top_k` candidate blocks that a sample of its rows (`SCORE_ROWS`, spread over the chunk, its last
  row included) scores highest against the summaries (Quest's upper bound, the group score of the decode's
  selection), per KV head, the union over the heads,
- the `prefill_window` tokens before the chunk (from a block boundary) and the chunk itself, causally,

as one block table for the prefill kernel: the selected blocks lie wholly before the window, so every row sees
them whole, and the causal mask over the window and the chunk is the kernel's own. A chunk whose candidates are
no more than `prefill_top_k` attends densely (bit for bit the dense prefill).

`select` returns (block table, virtual context length) for the kernel, or None for a dense chunk.
"""
from __future__ import annotations

import torch

from ..config import LookaheadConfig
from .device_tier import SlotLayout
from .summaries import BlockSummaries

SCORE_ROWS = 32            # query rows per chunk that score the summaries (spread evenly, the last included)


class PrefillSelection:
    def __init__(self, cfg: LookaheadConfig, summaries: BlockSummaries):
        self.top_k, self.window, self.group_score = cfg.prefill_top_k, cfg.prefill_window, cfg.group_score
        self.bs, self.num_sink = cfg.block_size, SlotLayout.from_config(cfg).num_sink
        self.summaries = summaries
        self.chunks = self.dense_chunks = 0          # chunks that went sparse / stayed dense (stats)

    def select(self, layer: int, lane: int, q: torch.Tensor, block_table: list[int],
               context_len: int) -> tuple[list[int], int] | None:
        """q [n, H, D]: the chunk's queries, its rows the last n of `context_len` tokens -> (the pool blocks to
        attend, in order, and the length the kernel sees), or None when the chunk attends densely."""
        n, bs = q.shape[0], self.bs
        w0 = max(self.num_sink, (context_len - n - self.window) // bs)     # first block of the local window
        if w0 - self.num_sink <= self.top_k:
            if layer == 0:
                self.dense_chunks += 1
            return None
        picked = self._pick(layer, lane, q, w0)
        if layer == 0:
            self.chunks += 1
        last = -(-context_len // bs)
        table = [block_table[b] for b in range(self.num_sink)] + [block_table[b] for b in picked] + \
            list(block_table[w0:last])
        return table, (self.num_sink + len(picked)) * bs + context_len - w0 * bs

    def _pick(self, layer: int, lane: int, q: torch.Tensor, w0: int) -> list[int]:
        """The union over KV heads of each head's top-K candidate blocks in [num_sink, w0), by the upper bound
        of a sample of the chunk's rows (the max over the rows), ascending."""
        n = q.shape[0]
        rows = torch.linspace(n - 1, 0, min(SCORE_ROWS, n)).round().long().unique()
        s = self.summaries
        kmin, kmax = (t[layer].view(-1, s.max_blocks, s.kvh, s.hd)[lane, self.num_sink:w0].float()    # widened: exact
                      for t in (s.kmin, s.kmax))
        qs = q[rows].float().view(len(rows), s.kvh, -1, s.hd)                          # [R, KVH, G, D]
        # Quest's bound sum_d max(q_d min_d, q_d max_d) as two products: q+ . max + q- . min
        bound = torch.einsum("rgjd,bgd->gjrb", qs.clamp(min=0), kmax) + \
            torch.einsum("rgjd,bgd->gjrb", qs.clamp(max=0), kmin)                     # [KVH, G, R, nc]
        score = bound.amax(dim=2)                                                       # [KVH, G, nc]
        score = score.amax(dim=1) if self.group_score == "max" else score.sum(dim=1)    # [KVH, nc]
        top = score.topk(self.top_k, dim=-1).indices                                   # [KVH, K]
        return (torch.unique(top) + self.num_sink).tolist()
