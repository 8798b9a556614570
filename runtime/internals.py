"""How an engine runs inside: knobs for tests, benchmarks and debugging, kept out of the settings.

    from runtime.internals import Internals
    Engine.from_dir(path, internals=Internals(impl="torch", fused=False))

None of these changes what an engine computes beyond the kernels' documented tolerances, and a
deployment never sets them: the settings (engine.yaml, `Engine.from_dir(**overrides)`, the CLI
flags) are docs/SETTINGS.md's. Passing one of these names as a setting is a TypeError that says
where it went.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .ops import IMPLS

KNOBS = ("impl", "ops", "fused", "debug_checks", "transfer", "draft_attention")


@dataclass(frozen=True)
class Internals:
    """impl: the kernel table ("auto", "c", "torch", "checked": runtime/ops.py; "auto" is "checked"
    with debug_checks); ops: a kernel table of the caller's (a test's recording table; default the
    spec's); fused: a decode step may run as the table's fused C step or layer (False: the model's
    Python layers, the reference); debug_checks: lookahead's slot-integrity check before every
    decode attention, and the checked table; transfer: the lookahead copy engine, by kind ("thread",
    "sync", "cuda") or an instance (default by device); draft_attention: what a lookahead step's
    draft row attends, "own" or "tier" (default by device: runtime/lookahead/attention.py
    `resolve_draft_attention`). `sibling` keeps the engine's fused, impl and draft_attention
    unless given its own."""

    impl: str = "auto"
    ops: Any = None
    fused: bool = True
    debug_checks: bool = False
    transfer: Any = None
    draft_attention: str | None = None

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl: one of {IMPLS}, got {self.impl!r}")


def refuse_knobs_as_settings(overrides: dict, where: str) -> None:
    """TypeError where `overrides` (settings) holds an implementation knob, naming its new place."""
    moved = [k for k in KNOBS if k in overrides]
    if moved:
        args = ", ".join(f"{k}={overrides[k]!r}" for k in moved)
        raise TypeError(f"{where}: {', '.join(moved)} {'is' if len(moved) == 1 else 'are'} not "
                        f"{'a setting' if len(moved) == 1 else 'settings'}: pass "
                        f"internals=runtime.internals.Internals({args})")
