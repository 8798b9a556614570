"""Host-side transfer engines: `ThreadTransferEngine` (CPU: one worker thread; torch copies
release the GIL) and `SyncTransferEngine` (inline copies, for tests)."""
from __future__ import annotations

import itertools
import queue
import threading
import time

import torch

from .base import CopyJob, Ticket, TransferEngine


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
        # put more threads than cores next to the compute thread's team. Threads that already run
        # keep their count, but libgomp hands this one to threads started later: Engine.step sets
        # the engine's own count on whatever thread steps it (a server's loop thread).
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
