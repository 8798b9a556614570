"""One line per build stage with its elapsed seconds: `[3/6] convert          1.2s  detail`."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Sequence

Log = Callable[[str], None]
STAGES = ("resolve source", "load", "convert", "write", "verify", "checksum")


class Stages:
    """Times the build's stages; `seconds` maps each finished stage to its duration. `names`: the
    build's stages in order (default STAGES; a --random-weights build has its own)."""

    def __init__(self, log: Log, names: Sequence[str] = STAGES):
        self.log, self.seconds, self.names = log, {}, tuple(names)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[Callable[[str], None]]:
        """Time stage `name`; the yielded callable adds a detail to its line. Nothing is logged
        for a stage that raises: the error line says what happened."""
        detail: list[str] = []
        t0 = time.perf_counter()
        yield detail.append
        self.seconds[name] = time.perf_counter() - t0
        n = self.names.index(name) + 1
        self.log(f"[{n}/{len(self.names)}] {name:<15}{self.seconds[name]:7.1f}s  {' '.join(detail)}".rstrip())

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def print_line(line: str) -> None:
    print(line, flush=True)
