"""Model runner: turns scheduled work into one forward pass and returns the logits to sample from."""
from __future__ import annotations

import torch

from .attention_dense import DenseAttention
from .model import LlamaModel
from .prefill_cache import PrefillCache
from .sequence import Sequence
from .step import StepBatch, StepItem


class DenseRunner:
    """Dense mode: every row attends to its sequence's full cached context."""

    def __init__(self, model: LlamaModel, attn: DenseAttention, block_size: int,
                 prefill_cache: PrefillCache | None = None):
        self.model, self.attn, self.block_size = model, attn, block_size
        self.prefill_cache = prefill_cache

    def release(self, seq: Sequence) -> None:
        """Nothing per sequence to free beyond its blocks (the scheduler frees those)."""

    def take_draws(self) -> None:
        """Dense mode draws only the emitted rows."""
        return None

    def stats(self) -> dict:
        """Dense mode moves no KV between tiers: the whole cache is 'resident'."""
        return {"h2d_bytes": 0, "device_resident_bytes": 0, "prefetch_hit_rate": None,
                "urgent_blocks": 0, "transfer_wait_s": 0.0}

    def run(self, work: list[tuple[Sequence, int]]) -> dict[int, torch.Tensor]:
        """Run one step; returns {seq_id: logits [vocab]} for sequences that sample this step."""
        items, token_ids, row = [], [], 0
        for seq, n in work:
            start = seq.num_cached
            items.append(StepItem(seq.seq_id, row, n, start, seq.block_table))
            token_ids.extend(seq.token_at(p) for p in range(start, start + n))
            row += n
        batch = StepBatch.build(items, token_ids, self.block_size, self.attn.pool.device)
        self.attn.batch = batch
        cache = self.prefill_cache
        if cache is not None and (replay := cache.replay(self.model, work, items)) is not None:
            out = replay.run(self.attn, len(self.model.layers))
            for seq, n in work:
                seq.num_cached += n
            return out
        rec = cache.record(self.model, work, items) if cache is not None else None
        backend = rec.wrap(self.attn, len(self.model.layers)) if rec else self.attn
        hidden = self.model(batch.tokens, batch.positions, backend)               # [T, hidden]
        sampling = [(seq, it) for (seq, n), it in zip(work, items)
                    if it.context_len >= len(seq.prompt_ids)]                     # prompt done
        for seq, n in work:
            seq.num_cached += n
        out = {}
        if sampling:
            last_rows = torch.tensor([it.row_start + it.num_tokens - 1 for _, it in sampling], device=hidden.device)
            logits = self.model.logits(hidden[last_rows])                         # [S, vocab]
            out = {seq.seq_id: logits[i] for i, (seq, _) in enumerate(sampling)}
        if rec:
            rec.finish(out)
        return out
