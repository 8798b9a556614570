"""load_test's workload and measurements: when requests go out, what their prompts are, what each
one recorded, and the summary statistics (shared by the served and the in-process run)."""
from __future__ import annotations

import math
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

WORDS = ("the of and to in is that for it as with was on be by this are at from or an have not which but "
         "all were when we there can one more has their if will about so out up into some than them could "
         "time only new other would these two may first then do any like now such our over most also made "
         "after where years between long through cache memory block layer token model decode attention "
         "device host transfer budget query key value sparse dense window batch stream server request").split()


# ---- workload ---------------------------------------------------------------------------------------
@dataclass
class Schedule:
    """When request i is sent and when to stop sending: the same for the served and in-process runs."""

    concurrency: int | None
    request_rate: float | None
    num_requests: int | None
    duration_s: float | None
    seed: int = 0

    def __post_init__(self) -> None:
        self._rng, self._arrivals = random.Random(self.seed), [0.0]

    def arrival(self, i: int) -> float:
        """Poisson process: exponential gaps of mean 1/rate; the first request goes at once."""
        while len(self._arrivals) <= i:
            self._arrivals.append(self._arrivals[-1] + self._rng.expovariate(self.request_rate))
        return self._arrivals[i]

    def more(self, i: int, elapsed: float) -> bool:
        return (self.num_requests is None or i < self.num_requests) and \
               (self.duration_s is None or elapsed < self.duration_s)


class Prompts:
    """Prompt i, deterministic in (seed, i); lengths in tokens when a tokenizer is available."""

    def __init__(self, mean: int, std: float, dataset: str | None, tokenizer, seed: int):
        self.mean, self.std, self.tok, self.seed = mean, std, tokenizer, seed
        self.corpus = load_essays() if dataset == "essays" else None
        self.corpus_ids = tokenizer.encode(self.corpus) if (self.corpus and tokenizer) else None

    def length(self, i: int) -> int:
        rng = np.random.default_rng([self.seed, i, 1])
        return max(1, int(round(rng.normal(self.mean, self.std)))) if self.std > 0 else self.mean

    def get(self, i: int) -> str:
        n, rng = self.length(i), random.Random(self.seed * 1_000_003 + i)
        if self.corpus_ids is not None:
            start = rng.randrange(0, max(1, len(self.corpus_ids) - n))
            return self.tok.decode(self.corpus_ids[start:start + n])
        if self.corpus is not None:           # no tokenizer: ~4 characters per token
            start = rng.randrange(0, max(1, len(self.corpus) - 4 * n))
            return self.corpus[start:start + 4 * n]
        text = " ".join(rng.choice(WORDS) for _ in range(n))
        if self.tok is not None:              # trim to n tokens exactly (a word may be several)
            text = self.tok.decode(self.tok.encode(text)[:n])
        return text


def load_essays() -> str:
    """Paul Graham's essays as one document (the loader the accuracy scripts use)."""
    from bench.longctx_data import load_essays as essays
    try:
        return "\n\n".join(essays())
    except ModuleNotFoundError as e:
        sys.exit(f"load_test: --dataset essays: {e}; or use --prompt-len for synthetic prompts")


# ---- measurements -----------------------------------------------------------------------------------
@dataclass
class Record:
    start: float
    token_times: list[tuple[float, int]] = field(default_factory=list)   # (time, tokens in that response)
    end: float | None = None
    num_prompt_tokens: int = 0
    error: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(n for _, n in self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0][0] - self.start if self.token_times else None

    def itls(self) -> list[float]:
        """Gap to each later token; a response carrying k tokens contributes k gaps of dt/k."""
        out, prev = [], self.token_times[0][0] if self.token_times else None
        for t, n in self.token_times[1:]:
            out += [(t - prev) / n] * n
            prev = t
        return out


@dataclass
class Run:
    records: list[Record]
    cpu_s: float | None = None       # engine-side CPU seconds over the measured requests


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by `pid` and its descendants, from /proc (Linux)."""
    stats = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue                                  # the process ended meanwhile
        stats[int(stat.parent.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, ticks
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, (ppid, _) in stats.items() if ppid == parent and p not in tree]
        tree.update(kids)
        frontier += kids
    return sum(stats[p][1] for p in tree if p in stats) / os.sysconf("SC_CLK_TCK")


def concat_runs(runs: list[Run]) -> Run:
    """Several runs of one workload (load_test's rounds) as one: each later run's times shifted to
    start where the previous one ended, so the idle gaps between them (the other side's passes)
    count in neither the wall time nor the throughput-over-time plot; CPU seconds add up."""
    records: list[Record] = []
    end = None
    for run in runs:
        starts = [r.start for r in run.records]
        if not starts:
            continue
        shift = 0.0 if end is None else end - min(starts)
        for r in run.records:
            records.append(Record(r.start + shift, [(t + shift, n) for t, n in r.token_times],
                                  None if r.end is None else r.end + shift, r.num_prompt_tokens, r.error))
        end = max(max((r.end for r in records if r.end is not None), default=-math.inf),
                  max(r.start for r in records))
    cpu = [run.cpu_s for run in runs]
    return Run(records, None if any(c is None for c in cpu) else sum(cpu))


def summarize(records: list[Record], cpu_s: float | None = None) -> dict:
    ok = [r for r in records if r.error is None and r.end is not None]
    t0 = min((r.start for r in records), default=0.0)
    t1 = max((r.end for r in ok), default=t0)
    wall = max(t1 - t0, 1e-9)
    ttft = np.array([r.ttft for r in ok if r.ttft is not None]) * 1e3
    itl = np.array([x for r in ok for x in r.itls()]) * 1e3
    e2e = np.array([r.end - r.start for r in ok]) * 1e3
    pct = lambda a, q: round(float(np.percentile(a, q)), 2) if len(a) else None
    mean = lambda a: round(float(np.mean(a)), 2) if len(a) else None
    tokens = sum(r.num_output_tokens for r in ok)
    errors = [r.error for r in records if r.error is not None]
    return {
        "requests": len(records), "completed": len(ok), "errors": len(errors), "error_examples": errors[:3],
        "wall_s": round(wall, 3), "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(ok) / wall, 3),
        "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99), "mean": mean(ttft)},
        "itl_ms": {"p50": pct(itl, 50), "p99": pct(itl, 99), "mean": mean(itl)},
        "e2e_ms": {"p50": pct(e2e, 50), "p99": pct(e2e, 99)},
        "mean_prompt_tokens": round(float(np.mean([r.num_prompt_tokens for r in ok])), 1) if ok else None,
        # Engine-side CPU per output token: on a shared machine wall-clock rates follow the
        # neighbours' load, this does not (served: the server's processes; in-process: the engine's).
        "cpu_s": None if cpu_s is None else round(cpu_s, 2),
        "cpu_ms_per_output_token": round(1e3 * cpu_s / tokens, 2) if cpu_s is not None and tokens else None,
    }
