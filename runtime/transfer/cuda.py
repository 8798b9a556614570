"""The CUDA transfer engine: KV block copies on two prioritised CUDA streams, driven by cuda-python.

Same interface and semantics as `ThreadTransferEngine` (runtime/transfer/thread.py); the GPU does the
queueing and the waiting instead of a host thread:

- Two non-blocking streams from `cudaStreamCreateWithPriority`: background copies (`submit(job)`)
  on the lowest priority of `cudaDeviceGetStreamPriorityRange`, urgent copies
  (`submit(job, urgent=True)`) on the highest. An urgent copy never queues behind background
  copies (the thread engine's "urgent first"), and the GPU schedules its blocks first.
- `submit` makes the job's stream wait for the current torch (compute) stream, so the copy sees
  every index and buffer the compute stream produced before the call and never overwrites a slot
  that already-queued compute still reads; it enqueues the copy and records one event per ticket
  (`cudaEventCreateWithFlags(cudaEventDisableTiming)`), and returns at once.
- `wait(ticket)` makes the *current torch stream* wait on that event (`cudaStreamWaitEvent`):
  no host sync, no device-wide sync, and compute queued after it reads the landed bytes. Host
  code that reads the destination on the CPU calls `ticket.synchronize()` first.
  `ticket.done()` is `cudaEventQuery`.
- An error raised while enqueueing a job (a bad index, a failed launch) is kept in the ticket and
  raised by `wait`, as the thread engine does. A job the engine cannot run at all (destination
  not on its GPU, an unpinned host pool) is refused at `submit` with a typed error.

The copy. A job whose source is the host pool is one `lookahead::copy_blocks` launch, K and V
alike: its CUDA kernel reads the pool straight from pinned memory through its device-mapped
address and writes the device slots (no staging copy, no host sync, no temporary;
`plugins/cuda/README.md`). A job whose source is already on the GPU runs `CopyJob.execute()` on
the stream (the same op).

Pinned host memory is required: the copy kernel reads the pool over PCIe and refuses pageable
memory. Allocate the pool pinned (`KVPool(..., pin_memory=True)`), or page-lock an existing one in
place with `pin_pool(pool)` (`cudaHostRegister`: no copy, no power-of-two rounding of torch's
pinned allocator, views stay valid).

Fixed-capacity jobs (`CopyJob.valid`, lists made on the GPU without reading their length): the
kernel reads `valid` itself, and a skipped entry reads and writes nothing (no PCIe traffic),
so nothing is read on the host to skip it.

Accounting. `h2d_bytes`, `jobs` and `urgent_jobs` are counted at submit, as by every engine (a
fixed-capacity job's bytes on the GPU, read when `h2d_bytes` is). With
`timing=True` (the default) two more numbers come from CUDA timing events: `wait_s`, the time the
compute stream stood still at `wait` calls (the stall), and `transfer_s`, the time the copy
streams spent copying. They are folded in when read, and reading them waits for the events
recorded so far (a host sync on those events only). Without timing, `wait_s` stays 0: the host
never blocks in `wait`.

Importing this module needs neither cuda-python nor a GPU. The constructor (and `pin_pool`)
look both up and raise `CudaTransferUnavailable`, naming what is missing and the fix.
"""
from __future__ import annotations

import collections
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import LookaheadError
from .base import CopyJob, Ticket, TransferEngine

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'lookahead-kv[gpu]' (or: pip install cuda-python)"
CPU_HINT = "use internals=Internals(transfer='thread') on a machine without a GPU"


class CudaTransferUnavailable(LookaheadError, RuntimeError):
    """The CUDA transfer engine cannot run here: says what is missing and how to fix it."""

    def __init__(self, problem: str, fix: str):
        self.problem, self.fix = problem, fix
        super().__init__(f"CUDA transfer engine unavailable: {problem} ({fix})")


class UnpinnedPoolError(LookaheadError, ValueError):
    """A copy job reads a host pool that is not page-locked."""


class CudaError(RuntimeError):
    """A CUDA runtime call failed after the engine was set up."""

    def __init__(self, call: str, err: Any):
        self.call, self.code = call, err
        super().__init__(f"{call} failed: {getattr(err, 'name', err)}")


# ---- cuda-python, looked up lazily ----------------------------------------------------------------
def _cuda_runtime():
    """The cuda-python runtime module, or CudaTransferUnavailable saying why it cannot be used."""
    if torch.version.cuda is None:
        raise CudaTransferUnavailable(
            f"torch {torch.__version__} is a CPU build (torch.version.cuda is None)",
            f"install a CUDA build of torch on a GPU machine, or {CPU_HINT}")
    if not torch.cuda.is_available():
        raise CudaTransferUnavailable(
            f"no CUDA device is visible to torch {torch.__version__} (torch.cuda.is_available() is False; "
            "check nvidia-smi and CUDA_VISIBLE_DEVICES)", f"run on a GPU machine, or {CPU_HINT}")
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:                                    # cuda-python < 12.6 kept it at cuda.cudart
            from cuda import cudart  # type: ignore[no-redef]
        except ImportError:
            raise CudaTransferUnavailable("cuda-python is not installed (no module cuda.bindings.runtime)",
                                          INSTALL_HINT) from None
    return cudart


def unavailable_reason() -> str | None:
    """Why `CudaTransferEngine()` would refuse to start here, or None when nothing says so yet.

    Checks the torch build, device visibility and cuda-python without touching the driver; a
    driver too old for torch's CUDA is only found by the constructor.
    """
    try:
        _cuda_runtime()
    except CudaTransferUnavailable as e:
        return str(e)
    return None


def _call(cudart, name: str, *args):
    """Call `cudart.<name>(*args)`; raise CudaError unless it succeeded; return its outputs."""
    err, *out = getattr(cudart, name)(*args)
    if err != cudart.cudaError_t.cudaSuccess:
        raise CudaError(name, err)
    return out[0] if len(out) == 1 else tuple(out)


def _setup_call(cudart, name: str, *args):
    """`_call` for the constructor: a failure means the engine cannot run here."""
    try:
        return _call(cudart, name, *args)
    except CudaError as e:
        raise CudaTransferUnavailable(
            f"{name} failed with {getattr(e.code, 'name', e.code)}",
            f"the NVIDIA driver must support CUDA {torch.version.cuda} (check nvidia-smi), or {CPU_HINT}") from None


def _destroy_event(cudart, event: int) -> None:
    try:
        cudart.cudaEventDestroy(event)
    except Exception:   # interpreter shutdown: the context may be gone already
        pass


# ---- pinned host pools -------------------------------------------------------------------------------
def pin_pool(pool):
    """Page-lock a host KV pool in place (`cudaHostRegister`) so the CUDA engine can read it.

    `pool` is a `runtime.kv_pool.KVPool` (anything with host tensors `k` and `v`). Tensors already
    pinned are left alone. The registration lasts as long as the tensor object (it is undone when
    `pool.k` / `pool.v` are garbage collected); replacing `pool.k` by another tensor drops it.
    Returns `pool`. Raises CudaTransferUnavailable without a GPU, CudaError if registration fails.
    """
    cudart = _cuda_runtime()
    for name in ("k", "v"):
        t = getattr(pool, name)
        if t.device.type != "cpu":
            raise ValueError(f"pool.{name} is on {t.device}: only a host pool is pinned")
        if t.is_pinned():
            continue
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        _call(cudart, "cudaHostRegister", ptr, nbytes, cudart.cudaHostRegisterDefault)
        weakref.finalize(t, cudart.cudaHostUnregister, ptr)
        if not t.is_pinned():
            raise CudaError("cudaHostRegister (the tensor still reads as pageable)", "not pinned")
    return pool


def _check_range(name: str, t: torch.Tensor, high: int, low: int = 0) -> None:
    """Host index tensors are checked before the copy (device ones would cost a sync)."""
    if t.is_cuda or t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low or hi >= high:
        raise IndexError(f"CopyJob.{name} holds ids in [{lo}, {hi}], outside [{low}, {high})")


# ---- tickets and the engine --------------------------------------------------------------------------
@dataclass
class CudaTicket(Ticket):
    """A ticket whose completion is a CUDA event (None: nothing was enqueued, or it failed)."""

    event: int | None = None
    _cudart: Any = None

    def done(self) -> bool:
        if self.event is None:
            return self._done.is_set()
        err, = self._cudart.cudaEventQuery(self.event)
        if err == self._cudart.cudaError_t.cudaSuccess:
            return True
        if err == self._cudart.cudaError_t.cudaErrorNotReady:
            return False
        raise CudaError("cudaEventQuery", err)

    def synchronize(self) -> None:
        """Block the host until the copy has landed (for host reads of the destination)."""
        if self.error:
            raise self.error
        if self.event is not None:
            _call(self._cudart, "cudaEventSynchronize", self.event)


class CudaTransferEngine(TransferEngine):
    """Copies on a low-priority prefetch stream and a high-priority urgent stream (module docstring)."""

    def __init__(self, device: str | torch.device = "cuda", timing: bool = True):
        self._wait_s = 0.0
        super().__init__()
        cudart = _cuda_runtime()
        count = _setup_call(cudart, "cudaGetDeviceCount")
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"device {dev} is not a CUDA device (e.g. 'cuda' or 'cuda:1')")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= count:
            raise CudaTransferUnavailable(f"device cuda:{index} does not exist ({count} visible)",
                                          "pick a visible device")
        _setup_call(cudart, "cudaSetDevice", index)
        self._rt, self.device, self.timing = cudart, torch.device("cuda", index), timing
        self._local = threading.local()
        self._local.device_set = True
        self._lock = threading.RLock()
        least, greatest = _setup_call(cudart, "cudaDeviceGetStreamPriorityRange")
        self.priorities = {"prefetch": int(least), "urgent": int(greatest)}   # lower number = higher priority
        self._handles: dict[str, int] = {}
        self._events: list[int] = []             # engine-owned events, destroyed by close()
        self._free_timing: list[int] = []
        for kind, prio in self.priorities.items():
            self._handles[kind] = int(_setup_call(cudart, "cudaStreamCreateWithPriority",
                                                  cudart.cudaStreamNonBlocking, prio))
        self.prefetch_stream = torch.cuda.ExternalStream(self._handles["prefetch"], device=self.device)
        self.urgent_stream = torch.cuda.ExternalStream(self._handles["urgent"], device=self.device)
        # One reusable event orders each job after the compute stream: a stream wait captures the
        # event's state at call time, so re-recording it for the next job is safe.
        self._order_event = self._new_event(timing=False)
        self._pending_jobs: collections.deque = collections.deque()     # (start, end) timing events
        self._pending_waits: collections.deque = collections.deque()
        self._transfer_s = 0.0
        self._closed = False
        import plugins
        plugins.ensure_cuda_kernels()          # once per process (the engine's select_ops may have already)
        self.copy_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("lookahead::copy_blocks", "CUDA")
        if not self.copy_kernel:
            logger.warning("the copy_blocks CUDA kernel is not registered (see plugins/cuda/README.md): "
                           "host->device copies fall back to a synchronous host gather")

    # ---- accounting read through CUDA timing events ---------------------------------------------------
    @property
    def wait_s(self) -> float:
        """Seconds the compute stream stood still in `wait` (waits for the events recorded so far)."""
        self._fold(block=True)
        return self._wait_s

    @wait_s.setter
    def wait_s(self, value: float) -> None:
        self._wait_s = value

    @property
    def transfer_s(self) -> float:
        """Seconds the copy streams spent copying (waits for the events recorded so far)."""
        self._fold(block=True)
        return self._transfer_s

    def _fold(self, block: bool) -> None:
        """Add the durations of completed timing pairs; with `block`, of all of them."""
        with self._lock:
            for queue_, attr in ((self._pending_jobs, "_transfer_s"), (self._pending_waits, "_wait_s")):
                while queue_:
                    start, end = queue_[0]
                    if block:
                        _call(self._rt, "cudaEventSynchronize", end)
                    else:
                        err, = self._rt.cudaEventQuery(end)
                        if err != self._rt.cudaError_t.cudaSuccess:
                            break
                    ms = _call(self._rt, "cudaEventElapsedTime", start, end)
                    setattr(self, attr, getattr(self, attr) + ms / 1e3)
                    queue_.popleft()
                    self._free_timing += [start, end]

    # ---- events and streams -----------------------------------------------------------------------------
    def _ensure_device(self) -> None:
        """cuda-python's current device is per thread: set it once in each calling thread."""
        if not getattr(self._local, "device_set", False):
            _call(self._rt, "cudaSetDevice", self.device.index)
            self._local.device_set = True

    def _new_event(self, timing: bool) -> int:
        flags = self._rt.cudaEventDefault if timing else self._rt.cudaEventDisableTiming
        ev = int(_call(self._rt, "cudaEventCreateWithFlags", flags))
        if timing:
            self._events.append(ev)
        return ev

    def _timing_event(self, stream: int) -> int:
        ev = self._free_timing.pop() if self._free_timing else self._new_event(timing=True)
        _call(self._rt, "cudaEventRecord", ev, stream)
        return ev

    def _compute_stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    # ---- the interface ----------------------------------------------------------------------------------
    def submit(self, job: CopyJob, urgent: bool = False) -> CudaTicket:
        """Enqueue a copy on the urgent or the prefetch stream, after the compute stream's queued work;
        returns at once."""
        if self._closed:
            raise RuntimeError("CudaTransferEngine.submit after close()")
        if job.num_units:
            self._check_job(job)              # before accounting: a refused job moves no byte
        base = self._account(job, urgent)
        ticket = CudaTicket(base.job_bytes, base.urgent, _cudart=self._rt)
        if job.num_units == 0:
            ticket._done.set()
            return ticket
        kind = "urgent" if urgent else "prefetch"
        handle = self._handles[kind]
        with self._lock, torch.cuda.device(self.device):
            self._ensure_device()
            self._fold(block=False)
            _call(self._rt, "cudaEventRecord", self._order_event, self._compute_stream())
            _call(self._rt, "cudaStreamWaitEvent", handle, self._order_event, 0)
            start = self._timing_event(handle) if self.timing else None
            try:
                with torch.cuda.stream(self.urgent_stream if urgent else self.prefetch_stream):
                    self._copy(job)
            except Exception as e:           # surfaced by wait(), as the thread engine does
                ticket.error = e
                ticket._done.set()
                if start is not None:
                    self._free_timing.append(start)
                return ticket
            if start is not None:
                self._pending_jobs.append((start, self._timing_event(handle)))
            ev = int(_call(self._rt, "cudaEventCreateWithFlags", self._rt.cudaEventDisableTiming))
            weakref.finalize(ticket, _destroy_event, self._rt, ev)
            _call(self._rt, "cudaEventRecord", ev, handle)
            ticket.event = ev
        return ticket

    def wait(self, ticket: Ticket | None) -> None:
        """Make the current torch stream wait until `ticket`'s copy has landed; the host does not block.

        With timing, the time the compute stream stands still here is added to `wait_s`.
        """
        if ticket is None:
            return
        if ticket.error:
            raise ticket.error
        event = getattr(ticket, "event", None)
        if event is None or ticket.done():
            return
        with self._lock, torch.cuda.device(self.device):
            self._ensure_device()
            compute = self._compute_stream()
            start = self._timing_event(compute) if self.timing else None
            _call(self._rt, "cudaStreamWaitEvent", compute, event, 0)
            if start is not None:
                self._pending_waits.append((start, self._timing_event(compute)))

    def close(self) -> None:
        """Finish queued copies, fold the timings, and release the streams and events. Idempotent."""
        if self._closed:
            return
        with self._lock:
            for handle in self._handles.values():
                _call(self._rt, "cudaStreamSynchronize", handle)
            self._fold(block=True)
            self._closed = True
            for ev in (*self._events, self._order_event):
                _destroy_event(self._rt, ev)
            self._events, self._free_timing = [], []
            for handle in self._handles.values():
                self._rt.cudaStreamDestroy(handle)

    # ---- the copy ---------------------------------------------------------------------------------------
    def _check_job(self, job: CopyJob) -> None:
        """Refuse at submit what cannot be copied at all (the other errors land in the ticket)."""
        for name in ("dst_k", "dst_v"):
            t = getattr(job, name)
            if t.device != self.device:
                raise ValueError(f"CopyJob.{name} is on {t.device} but this engine copies to {self.device}: "
                                 "the device tier must be allocated on the GPU")
        src = job.src_k
        if src.device.type == "cpu":
            if not (src.is_pinned() and job.src_v.is_pinned()):
                raise UnpinnedPoolError(
                    "CopyJob.src_k/src_v: the host KV pool is pageable, the gather kernel reads pinned memory "
                    "(allocate it with KVPool(..., pin_memory=True) or call runtime.transfer.cuda.pin_pool(pool))")
        elif src.device != self.device:
            raise ValueError(f"CopyJob.src_k is on {src.device}; this engine copies from the host or {self.device}")

    def _copy(self, job: CopyJob) -> None:
        """`dst[dst_index] = src[src_index]` for K and V, on the current (copy) stream."""
        stream = torch.cuda.current_stream(self.device)
        for t in (*job.src_index, *job.dst_index, *([job.valid] if job.valid is not None else [])):
            if t.is_cuda:        # made on the compute stream: keep its memory until this stream is done
                t.record_stream(stream)
        if job.src_k.is_cuda:
            job.execute()
            return
        blocks, heads = job.src_index
        _check_range("src_index[0] (blocks)", blocks, job.src_k.shape[0], low=-1 if job.valid is not None else 0)
        _check_range("src_index[1] (heads)", heads, job.src_k.shape[1])
        for i, t in enumerate(job.dst_index):
            _check_range(f"dst_index[{i}]", t, job.dst_k.shape[i])
        # mixed-device call (host pool, indices and slots on the GPU): one launch, K and V, whose
        # kernel reads the pinned pool directly; a fixed-capacity list's skipped entries read nothing
        torch.ops.lookahead.copy_blocks(job.src_k, job.src_v, job.dst_k, job.dst_v, *job.src_index, *job.dst_index,
                                        job.valid)
