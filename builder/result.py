"""`BuildResult`: what `build()` returns, for every kind of build (checkpoint or random weights)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class BuildResult:
    """What a build produced: the engine dir and its build report (also in build_report.json)."""

    path: Path
    report: dict[str, Any]
