"""Reuse one prompt's prefill across engines that share a model (e.g. the modes of an accuracy eval).

Prefill is the same computation in every mode: dense causal attention over the prompt. What
differs is what the attention backend keeps of the prompt's K/V (dense: the host pool; lookahead:
the pool, the block summaries, the device window, the seeded working set). A `PrefillCache`
records, for a whole prompt, what every layer's attention received (the post-RoPE K/V rows and
the last row's query) and the last row's logits. A later engine prefilling the same prompt on
the same model object hands those inputs to its own backend, in a step whose plan the runner built
with `store_only` (`StepBatch.store_only`): the backend stores them exactly as in a real prefill,
and the model's matmuls and the prefill attention are skipped. The decode that follows is
bit-identical to an uncached run (a test).

A step replays only when every item in it is a prefill chunk of a recorded prompt; anything else
runs the model (and records the prompts it starts). Keyed by the model object and the prompt's
token ids; the `max_prompts` most recent are kept (an 8K prompt of SmolLM2-135M is ~380 MB).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .sequence import Sequence
from .step import StepItem


@dataclass
class _Entry:
    k: torch.Tensor | None = None        # [L, P, KVH, D] post-RoPE keys of every prompt token
    v: torch.Tensor | None = None
    q_last: torch.Tensor | None = None   # [L, H, D] the last prompt token's query
    logits: torch.Tensor | None = None   # [vocab] the last prompt token's logits: complete when set
    filled: int = 0                      # prompt rows recorded so far (chunks arrive in order)


class PrefillCache:
    def __init__(self, max_prompts: int = 1):
        if max_prompts < 1:
            raise ValueError(f"max_prompts: must be >= 1, got {max_prompts}")
        self.max_prompts = max_prompts
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.hits = self.misses = 0     # prompts replayed / recorded

    @staticmethod
    def _key(model, seq: Sequence, kv_dtype, variant: str) -> tuple:
        # the KV storage dtype too: a prefill under fp16 KV attends over rounded keys, so its
        # logits are not an fp32 engine's (and the reverse); the prefill precision (siblings
        # at another one compute with a twin of the model: the same layers, another kernel table);
        # and the attention's variant (a block-sparse prefill attends to fewer keys than a dense one)
        ops = getattr(model, "ops", None)
        return (id(getattr(model, "layers", model)), getattr(ops, "prefill", "float32"), str(kv_dtype), variant,
                tuple(seq.prompt_ids))

    def replay(self, model, work: list[tuple[Sequence, int]], items: list[StepItem],
               kv_dtype: torch.dtype | None = None, variant: str = "dense") -> "Replay | None":
        """The step's replay when every item is a prefill chunk of a prompt recorded by an engine
        over the same model and KV storage dtype, else None."""
        if not work or not all(seq.in_prefill for seq, _ in work):
            return None
        if any(seq.params.prompt_logprobs is not None for seq, _ in work):
            return None                # a replay computes no hidden states to score the prompt with
        entries = [self._entries.get(self._key(model, seq, kv_dtype, variant)) for seq, _ in work]
        if any(e is None or e.logits is None for e in entries):
            return None
        for (seq, _), it in zip(work, items):
            self._entries.move_to_end(self._key(model, seq, kv_dtype, variant))
            self.hits += it.start_pos == 0
        return Replay(list(zip(work, items, entries)))

    def record(self, model, work: list[tuple[Sequence, int]], items: list[StepItem],
               kv_dtype: torch.dtype | None = None, variant: str = "dense") -> "Recording | None":
        """What this step should record: the prefill chunks that start or continue a prompt."""
        rec = []
        for (seq, n), it in zip(work, items):
            if not seq.in_prefill:
                continue
            key = self._key(model, seq, kv_dtype, variant)
            entry = self._entries.get(key)
            if it.start_pos == 0 and (entry is None or entry.logits is None):
                entry = self._entries[key] = _Entry()         # a new prompt (or a restarted one)
                self.misses += 1
                while len(self._entries) > self.max_prompts:
                    self._entries.popitem(last=False)
            if entry is not None and entry.logits is None and entry.filled == it.start_pos:
                rec.append((seq, it, entry))
        return Recording(rec) if rec else None


class Replay:
    """Feeds the recorded per-layer inputs of a step's prefill chunks to the backend."""

    def __init__(self, parts: list[tuple[tuple[Sequence, int], StepItem, _Entry]]):
        self.parts = parts

    def run(self, attn, num_layers: int) -> dict[int, torch.Tensor]:
        """Hand every layer's recorded K/V to `attn`, the backend of a step whose plan the runner
        built with `store_only` (it stores and seeds, attends to nothing); {seq_id: logits} of
        the sequences whose prompt completes this step."""
        e0 = self.parts[0][2]
        T = sum(it.num_tokens for _, it, _ in self.parts)
        q = e0.q_last.new_zeros(T, *e0.q_last.shape[1:])
        for layer in range(num_layers):
            ks, vs = [], []
            for (seq, _), it, e in self.parts:
                rows = slice(it.start_pos, it.start_pos + it.num_tokens)
                ks.append(e.k[layer, rows])
                vs.append(e.v[layer, rows])
                if it.context_len == len(seq.prompt_ids):
                    q[it.row_start + it.num_tokens - 1] = e.q_last[layer]
            attn.forward(layer, q, torch.cat(ks), torch.cat(vs))
        return {seq.seq_id: e.logits for (seq, _), it, e in self.parts
                if it.context_len == len(seq.prompt_ids)}


class Recording:
    """Wraps the step's attention backend to copy what each layer receives for the recorded chunks."""

    def __init__(self, parts: list[tuple[Sequence, StepItem, _Entry]]):
        self.parts = parts
        self._attn, self._num_layers = None, 0

    def wrap(self, attn, num_layers: int) -> "Recording":
        """This recording as the step's backend, in front of `attn`."""
        self._attn, self._num_layers = attn, num_layers
        return self

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for seq, it, e in self.parts:
            if e.k is None:
                P, L = len(seq.prompt_ids), self._num_layers
                e.k = k.new_empty(L, P, *k.shape[1:])
                e.v = v.new_empty(L, P, *v.shape[1:])
                e.q_last = q.new_empty(L, *q.shape[1:])
            rows = slice(it.row_start, it.row_start + it.num_tokens)
            e.k[layer, it.start_pos:it.context_len] = k[rows]
            e.v[layer, it.start_pos:it.context_len] = v[rows]
            if it.context_len == len(seq.prompt_ids):
                e.q_last[layer] = q[it.row_start + it.num_tokens - 1]
        return self._attn.forward(layer, q, k, v)

    def finish(self, logits: dict[int, torch.Tensor]) -> None:
        """After the step: the chunks are recorded; a completed prompt keeps its logits."""
        for seq, it, e in self.parts:
            e.filled = it.context_len
            if it.context_len == len(seq.prompt_ids):
                e.logits = logits[seq.seq_id].clone()
