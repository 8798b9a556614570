"""How many compute threads a step runs with: the engine's count, or fewer when fewer are faster.

An engine's kernels split every step over its OpenMP threads, one a core. When something else wants
one of those cores (a server's frontend, a tokenizer, another tenant), the thread that shares it is
descheduled inside every parallel region and the others wait for it at each region's end: measured
on 2 cores with one busy process, a 4-stream decode step went from 30 to 126 ms on 2 threads (4.2x)
while 1 thread took 46 ms, its quiet time; a 4K prefill 15-17 -> 34 s against 28 s on one.

`ThreadTuner` measures instead of guessing. It keeps the recent costs of each step kind ("decode":
seconds a step, at one batch size; "prefill": seconds a unit of work, `prefill_units`: a prompt
token's projections plus its attention over the keys before it) at the count in use, and runs
a few steps at another candidate (the engine's count, one fewer, half) when
- at the engine's count: once its first `RECENT` steps are in (a core busy from the start), then
  when the steps got `TRIGGER` slower than at the last check (the signature of a core getting busy;
  a context that grows slowly moves the mark with it), or `max_interval` steps passed;
- at fewer threads, `base_interval` steps passed (doubled by every check that keeps the choice), to
  take a core back once it is free.
The medians of the two sides decide, and a candidate is kept only if faster by `margin`. A quiet
machine so pays one check at the start and one in `max_interval` steps.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

RECENT = 8              # the steps at the count in use whose median a candidate is held against
TRIGGER = 0.3           # at the engine's count, steps this much slower than at the last check start one
EXPLORE = {"decode": 3, "prefill": 1}      # steps at a candidate per check (decode: the first, after
                                           # the team's resize, is not counted)
BASE_INTERVAL = {"decode": 16, "prefill": 4}     # steps at fewer threads before the first check back
MAX_INTERVAL = {"decode": 512, "prefill": 64}    # the longest between checks


def attention_ratio(cfg) -> float:
    """What one cached key adds to a prompt token's cost, as a share of the token's projections:
    attention's 4 * heads * head_dim FLOPs a key (q.k and p.v) over the projections' 2 * (their
    weights' elements), per layer (a ModelConfig)."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    weights = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h
    return 4 * cfg.num_heads * cfg.head_dim / (2 * weights)


def prefill_units(chunks, ratio: float) -> float:
    """A prompt step's work in tokens at no context: each chunk of n tokens after position p is n
    tokens of projections plus attention over p + (n - 1) / 2 keys each on average. A chunk late
    in a long prompt then costs what its work says, and the tuner compares like with like (per
    token, a 16K prompt's last chunk costs ~3x its first: seen as a slowdown, it set off a check,
    a chunk on fewer threads, every few chunks)."""
    return sum(n * (1.0 + ratio * (p + (n - 1) / 2)) for p, n in chunks)


def candidates(max_threads: int) -> tuple[int, ...]:
    """The counts worth trying: all of the engine's cores, one fewer (one core busy), half."""
    return tuple(dict.fromkeys(n for n in (max_threads, max_threads - 1, max_threads // 2) if n >= 1))


@dataclass
class _Kind:
    current: int
    interval: int
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))   # seconds a unit at `current`
    mark: float | None = None       # the median at the last check (or the first full window)
    since_check: int = 0
    trying: int | None = None       # the candidate being measured
    tried: list[float] = field(default_factory=list)
    next_candidate: int = 0
    shape: object = None            # what the costs were measured at (decode: the step's rows)
    checked: bool = False           # a check has run


class ThreadTuner:
    """`threads(kind)` before a step, `record(kind, threads, seconds, units, shape)` after it."""

    def __init__(self, max_threads: int, *, enabled: bool = True, margin: float = 0.1,
                 base_interval: dict[str, int] | None = None, max_interval: dict[str, int] | None = None):
        self.max_threads, self.margin, self.enabled = max_threads, margin, enabled
        self.base_interval = {**BASE_INTERVAL, **(base_interval or {})}
        self.max_interval = {**MAX_INTERVAL, **(max_interval or {})}
        self.candidates = candidates(max_threads)
        self.kinds: dict[str, _Kind] = {}
        self.switches = 0
        self.checks = 0             # steps begun at another count to measure it

    def _kind(self, kind: str) -> _Kind:
        if kind not in self.kinds:
            self.kinds[kind] = _Kind(self.max_threads, self.base_interval[kind])
        return self.kinds[kind]

    def threads(self, kind: str) -> int:
        """The count the next step of `kind` runs with."""
        if not self.enabled or len(self.candidates) == 1:
            return self.max_threads
        k = self._kind(kind)
        if k.trying is None and self._due(kind, k):
            others = [c for c in self.candidates if c != k.current]
            k.trying, k.tried = others[k.next_candidate % len(others)], []
            k.next_candidate += 1
            self.checks += 1
        return k.trying if k.trying is not None else k.current

    def _due(self, kind: str, k: _Kind) -> bool:
        if len(k.recent) < 2:
            return False
        if k.since_check >= self.max_interval[kind]:
            return True
        if k.current != self.max_threads:
            return k.since_check >= k.interval
        if len(k.recent) < RECENT:
            return False
        if not k.checked:          # once, at the first full window: a core busy from the start
            return True
        now = statistics.median(k.recent)
        if k.mark is None:
            k.mark = now
        return now > k.mark * (1 + TRIGGER)

    def record(self, kind: str, threads: int, seconds: float, units: float = 1.0, shape: object = None) -> None:
        """A step of `kind` ran `units` (decode: 1 a step; prefill: its prompt tokens) in `seconds`;
        `shape`: what else sets its cost (decode: the rows), costs of another shape are dropped."""
        if not self.enabled or units <= 0 or len(self.candidates) == 1:
            return
        k, per = self._kind(kind), seconds / units
        if shape != k.shape:        # a step of another size: compare only like with like
            k.shape, k.trying, k.mark = shape, None, None
            k.recent.clear()
        if k.trying is not None and threads == k.trying:
            k.tried.append(per)
            if len(k.tried) >= EXPLORE[kind]:
                self._decide(kind, k, statistics.median(k.tried[1:] or k.tried))
            return
        if threads == k.current:
            k.recent.append(per)
            k.since_check += 1

    def _decide(self, kind: str, k: _Kind, measured: float) -> None:
        cand, k.trying, k.since_check, k.checked = k.trying, None, 0, True
        here = statistics.median(k.recent)
        if measured < here * (1 - self.margin):
            k.current, k.interval, k.mark = cand, self.base_interval[kind], None
            k.recent.clear()
            self.switches += 1
        else:
            k.interval, k.mark = min(2 * k.interval, self.max_interval[kind]), here

    def stats(self) -> dict[str, int]:
        """The counts in use by kind, how often they changed, and how many checks ran (Engine.stats())."""
        return {**{f"threads_{name}": k.current for name, k in self.kinds.items()}, "thread_switches": self.switches,
                "thread_checks": self.checks}
