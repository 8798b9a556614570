"""A modeled host->device link: copies as another engine makes them, landed when a link would have.

On CPU the host pool and the device tier are both RAM, so a copy "lands" as soon as the memcpy
is done and the pipeline's overlap is never tested. `LinkTransferEngine` (`transfer="link:GBPS,US"`,
e.g. "link:4,10": 4 GB/s, 10 us a job) puts a link of a given bandwidth and latency between them:

- the copy itself runs as before, on the inner engine (default `ThreadTransferEngine`: background
  copies on its worker thread, urgent ones inline in the caller), so the device tier's bytes are
  exactly the thread engine's;
- a job's ticket is done only when both the copy is done and the modeled link has delivered it.
  The link is one resource that carries one job at a time, each for `latency + bytes / bandwidth`
  (GB/s = 1e9 bytes/s). Background jobs go in submit order:
  ``delivery = max(submit time, the previous job's delivery) + latency + bytes / bandwidth``;
- urgent jobs jump the queue, as on the thread engine (where they overtake every queued
  background copy) and the CUDA engine (a higher-priority stream): an urgent job starts when the
  job on the link at its submit time (and any earlier urgent job) is delivered, before every
  background job that had not started; those are pushed back by its duration. The link is not
  preemptive: the job already on it finishes first;
- `wait` blocks on the inner ticket (the memcpy), then *sleeps* until the delivery time: a
  wait, not a spin, so the modeled transfer costs no core. The real clock lowers the waiting
  thread's timer slack (Linux `PR_SET_TIMERSLACK`, 1 us) so that a sleep overshoots by ~10 us
  rather than ~60 us; what it still overshoots is summed in `overshoot_s`.

Copies made outside the engine and only reported to it (`account_inline`: the C lookahead layer's
urgent copy, made inside its C call) occupy the link too: submitted `seconds` before the report
(when the inline memcpy began, as far as the engine can tell), and, when urgent, the caller
sleeps until the link has delivered them. The C call attends right after its copy, so the sleep
comes after that layer's attention rather than before it; the step's total is the same. Where a
background job was on the link at the time, the inline job's start is taken from the report's
time minus `seconds`, later than the true start by the call's work after the copy, so such a
wait can be short by that much (at most one layer's attention and admission).

Accounting (the same fields as every engine):
- `h2d_bytes`, `jobs`, `urgent_jobs`: counted at submit, as `TransferEngine._account` does;
- `wait_s`: the stall: the inner engine's (the urgent memcpy made inline, a wait on the worker's
  memcpy) plus the time slept here for the link;
- `transfer_s`: the link's busy time, the sum of `latency + bytes / bandwidth` over the jobs
  scheduled (the analogue of the CUDA engine's copy-stream time);
- `overshoot_s`: the part of `wait_s` that a sleep overshot its delivery time by.

The clock is injectable (`clock=`: an object with `now()` and `sleep(seconds)`) so that tests
check the schedule to the nanosecond; `set_link` changes the bandwidth and latency of the jobs
scheduled from then on (a bench sweeps them on one engine). This is a model of a link, not a
measurement of one: it has no DMA engine, no contention with the device's own memory traffic,
and no pinned-memory effects.
"""
from __future__ import annotations

import ctypes
import math
import sys
import threading
import time
from dataclasses import dataclass

from ..errors import ConfigError
from .base import CopyJob, Ticket, TransferEngine

PREFIX = "link:"
SPEC = "link:GBPS,US"        # e.g. link:4,10 (4 GB/s, 10 microseconds a job)


def parse_link_spec(spec: str) -> tuple[float, float]:
    """'link:GBPS,US' -> (GB/s, microseconds); a malformed spec is a ConfigError naming `transfer`."""
    fix = f"use transfer='{SPEC}', e.g. 'link:4,10' (4 GB/s, 10 us a job; GBPS > 0, may be inf; US >= 0)"
    if not isinstance(spec, str) or not spec.startswith(PREFIX):
        raise ConfigError("transfer", f"{spec!r} is not a link spec", fix)
    parts = spec[len(PREFIX):].split(",")
    if len(parts) != 2:
        raise ConfigError("transfer", f"{spec!r} needs a bandwidth and a latency", fix)
    try:
        gbps, latency_us = (float(p) for p in parts)
    except ValueError:
        raise ConfigError("transfer", f"{spec!r}: bandwidth and latency must be numbers", fix) from None
    _check(gbps, latency_us, spec, fix)
    return gbps, latency_us


def _check(gbps: float, latency_us: float, what: str, fix: str) -> None:
    if math.isnan(gbps) or gbps <= 0:
        raise ConfigError("transfer", f"{what!r}: the bandwidth must be > 0 GB/s (got {gbps})", fix)
    if not math.isfinite(latency_us) or latency_us < 0:
        raise ConfigError("transfer", f"{what!r}: the latency must be a finite number of us >= 0 (got {latency_us})",
                          fix)


class MonotonicClock:
    """perf_counter and a real sleep (with a 1 us timer slack in each thread that sleeps)."""

    _local = threading.local()

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        if not getattr(self._local, "slack", False):
            self._local.slack = True
            if sys.platform.startswith("linux"):
                try:
                    ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)     # PR_SET_TIMERSLACK, 1000 ns
                except (OSError, AttributeError):
                    pass
        time.sleep(seconds)


@dataclass
class LinkTicket(Ticket):
    """A ticket that is done once its copy is (`inner`, None for a link-only transfer) and the
    link has delivered it (`deliver_at`, on the engine's clock; only ever moves later)."""

    inner: Ticket | None = None
    deliver_at: float = 0.0
    clock: object = None

    def done(self) -> bool:
        return ((self.inner is None or self.inner.done()) and self._done.is_set()
                and self.clock.now() >= self.deliver_at)


@dataclass
class _Slot:
    submit: float
    dur: float
    urgent: bool
    ticket: LinkTicket
    start: float = 0.0
    end: float = 0.0


class LinkTransferEngine(TransferEngine):
    """The inner engine's copies, each landed when a link of `gbps` GB/s and `latency_us` per job
    would have delivered it (see the module docstring for the schedule and the accounting)."""

    def __init__(self, gbps: float, latency_us: float, inner: TransferEngine | None = None, clock=None):
        self._own_wait_s = 0.0
        self.inner = inner if inner is not None else _thread_engine()
        super().__init__()
        self.clock = clock if clock is not None else MonotonicClock()
        self._lock = threading.Lock()
        self._sched: list[_Slot] = []      # not yet delivered (as of the last scheduling), link order
        self._free_at = -math.inf          # delivery of the last job scheduled
        self._done_end = -math.inf         # delivery of the last job pruned from _sched
        self.transfer_s = 0.0
        self.overshoot_s = 0.0
        self.link_jobs = 0
        self.set_link(gbps, latency_us)

    # ---- the link ---------------------------------------------------------------------------------------
    def set_link(self, gbps: float, latency_us: float) -> None:
        """Bandwidth (GB/s, may be inf) and latency (us) of the jobs scheduled from now on."""
        _check(float(gbps), float(latency_us), f"link:{gbps},{latency_us}", "bandwidth > 0, latency >= 0")
        self.gbps, self.latency_us = float(gbps), float(latency_us)

    @property
    def spec(self) -> str:
        return f"{PREFIX}{self.gbps:g},{self.latency_us:g}"

    def duration(self, nbytes: int) -> float:
        """Seconds the link is busy with a job of `nbytes`."""
        return self.latency_us * 1e-6 + nbytes / (self.gbps * 1e9)

    def _schedule(self, ticket: LinkTicket, nbytes: int, urgent: bool, submit: float, now: float) -> None:
        """Place a job on the link (lock held); `now` bounds which jobs have started."""
        while self._sched and self._sched[0].end <= now:           # delivered: out of the way
            self._done_end = max(self._done_end, self._sched.pop(0).end)
        slot = _Slot(submit, self.duration(nbytes), urgent, ticket)
        self.transfer_s += slot.dur
        self.link_jobs += 1
        i = len(self._sched)
        if urgent:                     # before every background job that has not started by `now`
            i = next((j for j, s in enumerate(self._sched) if not s.urgent and s.start > now), i)
        self._sched.insert(i, slot)
        prev = self._sched[i - 1].end if i else self._done_end
        for s in self._sched[i:]:      # the new job, and those it pushed back
            s.start = max(s.submit, prev)
            s.end = prev = s.start + s.dur
            s.ticket.deliver_at = s.end
        self._free_at = prev

    def occupy(self, nbytes: int, urgent: bool = False, submitted: float | None = None) -> LinkTicket:
        """A transfer of `nbytes` over the link with no copy behind it (one made elsewhere, or a
        replay of the link alone); `submitted`: when it was handed to the link (default now).
        Not counted as a job or as bytes: `account_inline` and `submit` count."""
        now = self.clock.now()
        ticket = LinkTicket(nbytes, urgent, inner=None, deliver_at=now, clock=self.clock)
        ticket._done.set()
        if nbytes > 0:
            with self._lock:
                self._schedule(ticket, nbytes, urgent, now if submitted is None else min(submitted, now), now)
        return ticket

    # ---- the interface ------------------------------------------------------------------------------------
    def submit(self, job: CopyJob, urgent: bool = False) -> Ticket:
        now = self.clock.now()
        counted = self._account(job, urgent)
        nbytes = int(job.units_moved()) * job.unit_bytes if job.num_units else 0
        ticket = LinkTicket(counted.job_bytes, urgent, deliver_at=now, clock=self.clock)
        if nbytes:
            with self._lock:
                self._schedule(ticket, nbytes, urgent, now, now)
        # the copy as the inner engine makes it (urgent: inline, now); its stall is the inner's
        ticket.inner = self.inner.submit(job, urgent)
        ticket._done.set()
        return ticket

    def wait(self, ticket: Ticket | None) -> None:
        if not isinstance(ticket, LinkTicket):
            self.inner.wait(ticket)
            return
        if ticket.inner is not None:
            self.inner.wait(ticket.inner)          # the memcpy (raises its error)
        self._sleep_until_delivered(ticket)

    def _sleep_until_delivered(self, ticket: LinkTicket) -> None:
        t0 = now = self.clock.now()
        slept = False
        while True:
            with self._lock:
                due = ticket.deliver_at            # moves only later (an urgent job went first)
            if now >= due:
                break
            self.clock.sleep(due - now)
            slept = True
            now = self.clock.now()
        if slept:
            self._own_wait_s += now - t0
            self.overshoot_s += now - due

    def account_inline(self, units: int, urgent: bool, seconds: float, unit_bytes: int) -> None:
        """A copy the caller made inline (module docstring): counted as by every engine, then
        put on the link as submitted `seconds` ago; an urgent one is waited for here."""
        super().account_inline(units, urgent, seconds, unit_bytes)
        nbytes = units * unit_bytes
        if nbytes <= 0:
            return
        ticket = self.occupy(nbytes, urgent, submitted=self.clock.now() - max(0.0, seconds))
        if urgent:
            self._sleep_until_delivered(ticket)

    # ---- accounting ---------------------------------------------------------------------------------------
    @property
    def wait_s(self) -> float:
        return self.inner.wait_s + self._own_wait_s

    @wait_s.setter
    def wait_s(self, value: float) -> None:       # base class: `self.wait_s = 0.0`, `+= seconds`
        self._own_wait_s = value - self.inner.wait_s

    @property
    def free_at(self) -> float:
        """The delivery time of the last job scheduled (-inf before the first)."""
        return self._free_at

    def close(self) -> None:
        self.inner.close()


def _thread_engine() -> TransferEngine:
    from .thread import ThreadTransferEngine
    return ThreadTransferEngine()


def make_link_engine(spec: str, inner: TransferEngine | None = None, clock=None) -> LinkTransferEngine:
    gbps, latency_us = parse_link_spec(spec)
    return LinkTransferEngine(gbps, latency_us, inner=inner, clock=clock)
