"""Continuous batching with chunked prefill and admission by memory.

Each step decodes one token for every running sequence whose prompt is in the cache, and spends
up to `prefill_chunk` tokens on prompts, so running streams keep flowing while new ones join.
A sequence is admitted only when the allocator can reserve every block it may ever need; until then
it waits in a bounded queue. One that can never fit is rejected by `check_fits` at once.
"""
from __future__ import annotations

from collections import deque

from .block_manager import BlockAllocator, blocks_needed
from .errors import CapacityError
from .sequence import Sequence, SeqStatus


class QueueFullError(CapacityError):
    """The waiting queue is full: the caller should retry later (HTTP 429-like)."""


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch_size: int,
                 max_model_len: int, prefill_chunk: int, max_queue: int = 256):
        self.allocator, self.block_size = allocator, block_size
        self.max_batch_size, self.max_model_len = max_batch_size, max_model_len
        self.prefill_chunk, self.max_queue = prefill_chunk, max_queue
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def check_fits(self, seq: Sequence) -> None:
        """Raise CapacityError when `seq` could never run on this engine."""
        if seq.max_len > self.max_model_len:
            raise CapacityError(
                f"prompt ({len(seq.prompt_ids)} tokens) + max_tokens ({seq.params.max_tokens}) = "
                f"{seq.max_len} exceeds the engine's max_model_len {self.max_model_len}; "
                "shorten the prompt or lower max_tokens", field="max_tokens")
        need = blocks_needed(seq.max_len, self.block_size)
        if need > self.allocator.num_blocks:
            raise CapacityError(f"the request needs {need} KV blocks but the host pool has "
                                f"{self.allocator.num_blocks}; lower max_tokens or enlarge the pool",
                                field="max_tokens")

    def check_queue(self, pending: int = 0) -> None:
        """Raise QueueFullError when `pending` more requests would overflow the waiting queue.

        Called from request threads without the step loop's lock: len() of a deque is atomic in
        CPython and an off-by-one here only shifts the bound by a request."""
        if len(self.waiting) + pending >= self.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests); retry later")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            need = blocks_needed(seq.max_len, self.block_size)
            if not self.allocator.can_allocate(need):
                break                      # FIFO: later requests do not overtake a waiting one
            self.waiting.popleft()
            seq.block_table = self.allocator.allocate(need)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Work for one step: (sequence, number of new tokens to run)."""
        self._admit()
        work = [(s, 1) for s in self.running if not s.in_prefill]
        budget = self.prefill_chunk
        for s in self.running:
            if s.in_prefill and budget > 0:
                n = min(budget, len(s.prompt_ids) - s.num_cached)
                work.append((s, n))
                budget -= n
        return work

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.allocator.free(seq.block_table)
            seq.block_table = []
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
