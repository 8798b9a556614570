"""Model runner: turns scheduled work into one forward pass and returns the logits to sample from."""
from __future__ import annotations

import torch

from .attention_dense import DenseAttention, DenseStep
from .device import to_device
from .kv_pool import KVPool
from .model import LlamaModel
from .observe import Observers
from .prefill_cache import PrefillCache
from .sampling import token_logprobs
from .sequence import Sequence
from .step import Interruptible, StepBatch, StepItem, StepInterrupted

PROMPT_SCORE_ROWS = 256      # prompt rows scored at a time: 256 rows of logits over SmolLM2's vocabulary are 48 MiB


def score_prompt_rows(model: LlamaModel, hidden: torch.Tensor, pairs) -> None:
    """The prompt log-probabilities (`params.prompt_logprobs` = k) of the prompt chunks a step
    computed, appended to `seq.prompt_logprobs`: the row at position p predicts prompt token p + 1
    (the prompt's last row predicts the first output token: sampled, not scored here). The first
    prompt token has no context: its entry is None. `pairs`: (sequence, its StepItem)."""
    for seq, it in pairs:
        k = seq.params.prompt_logprobs
        if k is None or not it.prompt or not it.num_tokens:
            continue
        if it.start_pos == 0:
            seq.prompt_logprobs = [None]
        m = min(it.num_tokens, len(seq.prompt_ids) - 1 - it.start_pos)
        for a in range(0, m, PROMPT_SCORE_ROWS):
            b = min(m, a + PROMPT_SCORE_ROWS)
            logits = model.logits(hidden[it.row_start + a: it.row_start + b])
            targets = seq.prompt_ids[it.start_pos + a + 1: it.start_pos + b + 1]
            seq.prompt_logprobs += token_logprobs(logits, targets, [k] * (b - a), ranks=True)


def compile_forward(model: LlamaModel, ops, fused, why: str | None = None, **compile_kwargs):
    """(`torch.compile(model.forward, fullgraph=True, **compile_kwargs)`, None), or (None, why not)
    where a decode step does not run the model's torch path: a fused C step (`fused`), a table with
    a paged kernel or C kernels, the caller's `why`, or no torch.compile here."""
    if fused is not None or ops.paged_attention is not None or ops.c_kernels:
        why = f"ops {ops.name or 'custom'} run a decode step in their kernels"
    if why is None:
        import torch._dynamo.eval_frame as dynamo
        try:
            dynamo.check_if_dynamo_supported()
        except RuntimeError as e:
            why = f"torch.compile is unavailable here: {e}"
    if why is not None:
        return None, why
    return torch.compile(model.forward, fullgraph=True, **compile_kwargs), None


class DenseRunner:
    """Dense mode: every row attends to its sequence's full cached context.

    A decode step whose items are one token each (`DenseStep.fused_items`) runs as one C call
    (`fused`: the kernel table's fused decoder, bound once here by `LlamaModel.fused_decoder`;
    None, with `fused_reason`, where the model, its table or the pool do not take it, or the
    engine was built with `fused=False`). Every other step, and a step the C path refuses, runs
    the Python path (the model's layers over `DenseStep`), which is the reference.

    On the torch table a decode step's rows attend in one batch of ops (`DenseStep.padded`); with
    `graph` (or `compile_decode`) the model's work of such a step runs as one graph compiled with
    `torch.compile(fullgraph=True)` (the torch path's CUDA-graph candidate: no Python between its
    ops). The first steps compile it (again when the batch or the longest context changes shape,
    after which those dims are dynamic); every other step runs eagerly as before.

    Sparse mode (`attn.selection`, runtime/sparse.py) is the same runner: its decode rows attend to
    their top-K selection in place (the fused step does the selection in C too), and after every
    step the rows it stored fold into their blocks' summaries."""

    def __init__(self, model: LlamaModel, attn: DenseAttention, block_size: int,
                 prefill_cache: PrefillCache | None = None, observers: Observers | None = None,
                 fused: bool = True, graph: bool = False):
        self.model, self.attn, self.block_size = model, attn, block_size
        self.selection = attn.selection           # sparse mode's (runtime/sparse.py), or None
        self.prefill_cache = prefill_cache
        self.observers = observers if observers is not None else Observers()
        self._want_fused = fused
        self._bind_fused()
        self.graph, self.graph_reason = None, "graph=False"     # the compiled decode step, or why not
        if graph:
            self.compile_decode()

    def _bind_fused(self) -> None:
        pool = self.attn.pool
        self.fused, self.fused_reason = (self.model.fused_decoder(pool.k, pool.v, self.attn.scale,
                                                                  selection=self.selection)
                                         if self._want_fused else (None, "fused=False"))
        self._fused_weights = self.model.weights_version

    def compile_decode(self, **compile_kwargs) -> str | None:
        """Run the torch table's decode steps through `torch.compile(model.forward, fullgraph=True,
        **compile_kwargs)` (default backend inductor; compiled lazily, at the first such step).
        Returns why not (and compiles nothing) where those steps do not run the torch path: the C
        table (its paged kernel or fused step), a table with a paged kernel, sparse mode."""
        why = "sparse mode selects per sequence" if self.selection is not None else None
        self.graph, self.graph_reason = compile_forward(self.model, self.attn.ops, self.fused, why, **compile_kwargs)
        return self.graph_reason

    def release(self, seq: Sequence) -> None:
        """Nothing per sequence to free beyond its blocks (the scheduler frees those)."""

    def named(self, seq: Sequence, named: list[tuple[int, int]]) -> None:
        """Nothing to keep beside a named block: its K/V are in the pool, and sparse mode's
        summaries are per pool block already (runtime/sparse.py)."""

    def take_draws(self) -> None:
        """Dense mode draws only the emitted rows."""
        return None

    def stats(self) -> dict:
        """Dense mode moves no KV between tiers: the whole cache is 'resident'."""
        return {"h2d_bytes": 0, "device_resident_bytes": 0, "prefetch_hit_rate": None,
                "urgent_blocks": 0, "transfer_wait_s": 0.0}

    def run(self, work: list[tuple[Sequence, int]], interrupt=None) -> dict[int, torch.Tensor]:
        """Run one step; returns {seq_id: logits [vocab]} for sequences that sample this step.
        interrupt: a prompt-only step's check between layers (`step.Interruptible`); when it says
        so the step raises `StepInterrupted` and nothing of it counts as cached."""
        items, token_ids, row = [], [], 0
        for seq, n in work:
            start = seq.num_cached
            items.append(StepItem(seq.seq_id, row, n, start, seq.block_table, prompt=seq.in_prefill))
            token_ids.extend(seq.token_at(p) for p in range(start, start + n))
            row += n
        cache = self.prefill_cache
        replay = cache.replay(self.model, work, items, self.attn.pool.dtype) if cache is not None else None
        batch = StepBatch.build(items, token_ids, self.block_size, self.attn.pool.device,
                                store_only=replay is not None)
        if self.observers:
            self.observers.batch(batch)
        if replay is not None:
            out = replay.run(StoreRows(self.attn.pool, batch), len(self.model.layers))
            if self.selection is not None:
                self.selection.update(batch)
            for seq, n in work:
                seq.num_cached += n
            return out
        step = self.attn.step(batch)        # this step's backend: the batch is its argument
        rec = cache.record(self.model, work, items, self.attn.pool.dtype) if cache is not None else None
        hidden = self._fused_step(step, batch) if rec is None else None          # [T, hidden] or None
        if hidden is None and rec is None and interrupt is None and self.graph is not None:
            padded = step.padded()      # a decode step on the torch table: the compiled graph
            if padded is not None:
                hidden = self.graph(batch.tokens, batch.positions, padded)
        if hidden is None:
            backend = rec.wrap(step, len(self.model.layers)) if rec else step
            if interrupt is not None:
                backend = Interruptible(backend, interrupt)
            hidden = self.model(batch.tokens, batch.positions, backend, batch)   # [T, hidden]
        if self.selection is not None:            # the step's rows, for the next steps' selection
            self.selection.update(batch)
        score_prompt_rows(self.model, hidden, [(seq, it) for (seq, _), it in zip(work, items)])
        sampling = [(seq, it) for (seq, n), it in zip(work, items)
                    if it.context_len >= len(seq.prompt_ids)]                     # prompt done
        for seq, n in work:
            seq.num_cached += n
        out = {}
        if sampling:
            last_rows = to_device(hidden.device, torch.tensor([it.row_start + it.num_tokens - 1
                                                               for _, it in sampling]))[0]   # no synchronous upload
            logits = self.model.logits(hidden[last_rows])                         # [S, vocab]
            out = {seq.seq_id: logits[i] for i, (seq, _) in enumerate(sampling)}
        if rec:
            rec.finish(out)
        return out

    def _fused_step(self, step, batch: StepBatch) -> torch.Tensor | None:
        """The step's hidden states from the fused C step, or None (the Python path runs)."""
        if self._fused_weights != self.model.weights_version:       # load_weights replaced the tensors
            self._bind_fused()
        if self.fused is None:
            return None
        items = step.fused_items()
        if items is None:
            return None
        tables, lens = items
        return self.fused.run(batch.tokens, batch.positions, batch.slot_blocks, batch.slot_offsets, None, lens, tables)


class StoreRows:
    """The backend of a replayed prefill in dense mode (batch.store_only): each layer's recorded
    K/V go into the pool where the batch says, as DenseAttention stores them; nothing attends."""

    def __init__(self, pool: KVPool, batch: StepBatch):
        self.pool, self.batch = pool, batch

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer_idx, k, v, self.batch.slot_blocks, self.batch.slot_offsets)
        return torch.empty_like(q)
