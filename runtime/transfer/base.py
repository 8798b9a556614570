"""The transfer engine's interface: a `CopyJob` (what to move), a `Ticket` (when it has landed) and
the `TransferEngine` every implementation derives from (runtime/transfer/__init__.py)."""
from __future__ import annotations

import abc
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
