"""The transfer engine's interface: a `CopyJob` (what to move), a `Ticket` (when it has landed) and
the `TransferEngine` every implementation derives from (runtime/transfer/__init__.py)."""
from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import plugins

from ..device import host_list


@dataclass
class CopyJob:
    """`dst[dst_index] = src[src_index]` for K and V alike (advanced indexing, one vectorised copy).

    src_*: host pool of one layer as `[num_blocks, KVH, bs, D]` (a view of the head-major pool),
           src_index = (block_ids [n], heads [n]);
    dst_*: a device buffer `[lanes, KVH, slots, bs, D]`, dst_index = (lanes [n], heads [n], slots [n]).
    valid: None (all n entries are copied), or bool [n]: a fixed-capacity list made on the device
           without reading how many entries are real; the others are skipped. Such a list's
           destinations are distinct, and its skipped entries still name in-range indices (a
           source block of -1 included: nothing is read for them).
    kernel: the copy kernel (the transfer engine's, `TransferEngine.use_kernel`, set at submit),
           or None: the `lookahead::copy_blocks` op's torch implementation.
    """

    src_k: torch.Tensor
    src_v: torch.Tensor
    dst_k: torch.Tensor
    dst_v: torch.Tensor
    src_index: tuple[torch.Tensor, ...]
    dst_index: tuple[torch.Tensor, ...]
    tag: tuple = ()                      # (step, layer, kind) for tracing
    valid: torch.Tensor | None = None
    kernel: Callable | None = None

    @property
    def num_units(self) -> int:
        """Entries listed: the units copied, or at most that many when `valid` is set (a shape)."""
        return self.src_index[0].numel()

    @property
    def unit_bytes(self) -> int:
        """Bytes of one (block, head) unit, K and V."""
        return 2 * self.src_k.shape[2] * self.src_k.shape[3] * self.src_k.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the entries listed (an upper bound of those moved when `valid` is set)."""
        return self.unit_bytes * self.num_units

    def units_moved(self) -> int | torch.Tensor:
        """The units this job copies: an int, or (a fixed-capacity list) a 0-dim tensor where the
        list is, counted there without a host read."""
        return self.num_units if self.valid is None else self.valid.sum()

    def execute(self) -> None:
        """`kernel` (the C table's: one memcpy per unit, no gathered temporary; a torch table's:
        `lookahead::copy_blocks`, one launch on a GPU) where it takes the layout, else the op's
        torch implementation; a fixed-capacity list's skipped entries keep their destination's
        contents."""
        if not self.num_units or (self.kernel is not None and self.kernel(
                self.src_k, self.src_v, self.dst_k, self.dst_v, self.src_index, self.dst_index, self.valid)):
            return
        plugins.direct.copy_blocks(self.src_k, self.src_v, self.dst_k, self.dst_v, *self.src_index,
                                   *self.dst_index, self.valid)


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
        self.kernel: Callable | None = None      # the copy kernel of the jobs (use_kernel)
        self.h2d_bytes = 0
        self.jobs = 0
        self.urgent_jobs = 0
        self.wait_s = 0.0

    # h2d_bytes: counted at submit. A fixed-capacity job's count stays where its list is (its
    # `valid`, a device tensor): the lists are kept by unit size and added up there in one sum
    # per FOLD_LISTS of them (not a few ops per job), and read only when h2d_bytes is (through
    # runtime.device's seam, not per step).
    FOLD_LISTS = 256

    @property
    def h2d_bytes(self) -> int:
        self._fold_lists()
        pending = getattr(self, "_h2d_pending", None)
        if pending is not None:
            self._h2d_host += host_list(pending, "transfer accounting (h2d_bytes)")
            self._h2d_pending = None
        return self._h2d_host

    @h2d_bytes.setter
    def h2d_bytes(self, value: int) -> None:
        self._h2d_host, self._h2d_pending, self._h2d_lists = value, None, {}

    def _fold_lists(self) -> None:
        """The kept lists' units, times their unit bytes, into the device-side count."""
        lists, self._h2d_lists = getattr(self, "_h2d_lists", {}), {}
        for unit_bytes, valids in lists.items():
            moved = torch.cat(valids).sum() * unit_bytes
            self._h2d_pending = moved if self._h2d_pending is None else self._h2d_pending + moved.to(
                self._h2d_pending.device)

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

    def use_kernel(self, kernel: Callable | None) -> None:
        """The copy kernel that runs this engine's jobs (the kernel table's `copy_blocks`, or None:
        torch indexing); set once, by the backend that submits the jobs."""
        self.kernel = kernel

    def inline_kernel(self) -> int | None:
        """The C address of this engine's copy kernel, handed to a C layer that makes its urgent
        copy inline in its own call (plugins/cpu/lookahead_layer.c) and reports it with
        `account_inline`; None where the kernel has no C entry (the copies are submitted)."""
        address = getattr(self.kernel, "c_kernel", None)
        return address() if address is not None else None

    def account_inline(self, units: int, urgent: bool, seconds: float, unit_bytes: int) -> None:
        """A copy made inline with this engine's kernel (`inline_kernel`, in a C layer's call):
        counted as one submitted job of `units` units, and, when urgent, its `seconds` as stall."""
        self._h2d_host += units * unit_bytes
        self.jobs += 1
        self.urgent_jobs += urgent
        if urgent:
            self.wait_s += seconds

    def _account(self, job: CopyJob, urgent: bool) -> Ticket:
        """Count a submitted job; its ticket's `job_bytes` are the bytes it lists (an upper bound
        of those moved for a fixed-capacity list)."""
        if job.kernel is None:
            job.kernel = self.kernel
        if job.valid is None:
            self._h2d_host += job.num_units * job.unit_bytes
        else:
            self._h2d_lists.setdefault(job.unit_bytes, []).append(job.valid)
            if sum(map(len, self._h2d_lists.values())) >= self.FOLD_LISTS:
                self._fold_lists()
        self.jobs += 1
        self.urgent_jobs += urgent
        return Ticket(job.nbytes, urgent)

    def close(self) -> None:
        pass
