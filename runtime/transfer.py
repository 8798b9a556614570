"""The transfer engine: the only code that moves KV bytes between tiers.

The residency manager decides *what* moves and hands over `CopyJob`s; the engine moves the bytes in
the background and signals a `Ticket` per job. Compute waits only on the ticket of the layer it is
about to read (`wait`), never on everything. Urgent jobs jump the queue.

Implementations: `ThreadTransferEngine` (CPU: one worker thread; torch copies release the GIL) and
the cuda-python engine for GPUs (plugins/cuda), with the same interface and tests.
"""
from __future__ import annotations

import abc
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from plugins.cpu import bookkeeping


@dataclass
class CopyJob:
    """`dst[dst_index] = src[src_index]` for K and V alike (advanced indexing, one vectorised copy).

    src_*: host pool of one layer as `[num_blocks, KVH, bs, D]` (a view of the head-major pool),
           src_index = (block_ids [n], heads [n]);
    dst_*: a device buffer `[lanes, KVH, slots, bs, D]`, dst_index = (lanes [n], heads [n], slots [n]).
    """

    src_k: torch.Tensor
    src_v: torch.Tensor
    dst_k: torch.Tensor
    dst_v: torch.Tensor
    src_index: tuple[torch.Tensor, ...]
    dst_index: tuple[torch.Tensor, ...]
    tag: tuple = ()                      # (step, layer, kind) for tracing

    @property
    def num_units(self) -> int:
        return int(self.src_index[0].numel())

    @property
    def nbytes(self) -> int:
        unit = self.src_k.shape[2] * self.src_k.shape[3] * self.src_k.element_size()   # one (block, head) of K
        return 2 * unit * self.num_units

    def execute(self) -> None:
        """One memcpy per unit on CPU (plugins/cpu/residency.c, no gathered temporary), else indexing."""
        if self.num_units and not bookkeeping.copy_blocks(self.src_k, self.src_v, self.dst_k, self.dst_v,
                                                          self.src_index, self.dst_index):
            self.dst_k[self.dst_index] = self.src_k[self.src_index]
            self.dst_v[self.dst_index] = self.src_v[self.src_index]


@dataclass
class Ticket:
    job_bytes: int
    urgent: bool
    _done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()


class TransferEngine(abc.ABC):
    """Moves bytes host -> device tier. Called by the lookahead attention backend only."""

    def __init__(self) -> None:
        self.h2d_bytes = 0
        self.jobs = 0
        self.urgent_jobs = 0
        self.wait_s = 0.0

    @abc.abstractmethod
    def submit(self, job: CopyJob, urgent: bool = False) -> Ticket:
        """Queue a copy; returns at once. Urgent copies run before any queued background copy."""

    def wait(self, ticket: Ticket | None) -> None:
        """Block the caller until `ticket`'s copy has landed (time accounted as stall)."""
        if ticket is None or ticket.done():
            if ticket is not None and ticket.error:
                raise ticket.error
            return
        t0 = time.perf_counter()
        ticket._done.wait()
        self.wait_s += time.perf_counter() - t0
        if ticket.error:
            raise ticket.error

    def _account(self, job: CopyJob, urgent: bool) -> Ticket:
        self.h2d_bytes += job.nbytes
        self.jobs += 1
        self.urgent_jobs += int(urgent)
        return Ticket(job.nbytes, urgent)

    def close(self) -> None:
        pass


class SyncTransferEngine(TransferEngine):
    """Copies inline at submit: deterministic, for tests and for isolating overlap effects."""

    def submit(self, job: CopyJob, urgent: bool = False) -> Ticket:
        t = self._account(job, urgent)
        job.execute()
        t._done.set()
        return t


class ThreadTransferEngine(TransferEngine):
    """A background worker thread drains the queue of background copies in order; urgent copies
    run at once in the submitting thread (which waits for them anyway)."""

    def __init__(self) -> None:
        super().__init__()
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._worker = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._worker.start()

    def submit(self, job: CopyJob, urgent: bool = False) -> Ticket:
        t = self._account(job, urgent)
        if job.num_units == 0:
            t._done.set()
            return t
        if urgent:
            # The caller waits for an urgent copy at once, so it runs here: it still overtakes
            # every queued background copy, without a hand-off to the worker and back (two thread
            # wake-ups and GIL transfers, longer than the copy itself). Its time is stall time.
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    job.execute()
            except BaseException as e:   # surfaced at wait, as for background copies
                t.error = e
            self.wait_s += time.perf_counter() - t0
            t._done.set()
            return t
        self._q.put((1, next(self._order), job, t))
        return t

    def _run(self) -> None:
        # One OpenMP thread for the copies (small, memory-bound gathers): a team of its own would
        # put more threads than cores next to the compute thread's team. Per-thread setting: the
        # compute thread keeps its own count.
        torch.set_num_threads(1)
        while True:
            _, _, job, ticket = self._q.get()
            if job is None:
                return
            try:
                with torch.inference_mode():
                    job.execute()
            except BaseException as e:   # surfaced to the waiting compute thread
                ticket.error = e
            ticket._done.set()

    def close(self) -> None:
        if self._worker.is_alive():
            self._q.put((2, next(self._order), None, None))
            self._worker.join(timeout=5)


def make_transfer_engine(kind: str = "thread") -> TransferEngine:
    if kind == "thread":
        return ThreadTransferEngine()
    if kind == "sync":
        return SyncTransferEngine()
    if kind == "cuda":
        from .transfer_cuda import CudaTransferEngine   # lazy: needs cuda-python and a GPU
        return CudaTransferEngine()
    raise ValueError(f"transfer engine {kind!r} is unknown (use 'thread', 'sync' or 'cuda')")
