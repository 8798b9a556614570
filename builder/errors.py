"""Typed errors the builder raises for anything a user can cause.

Every error is one line: what is wrong (naming the field or file) and how to fix it. The CLI prints
`error: <message>` and exits 2; nothing deep inside the builder prints a stack trace at a user.
"""
from __future__ import annotations

from typing import Any

from runtime.errors import LookaheadError


class BuildError(LookaheadError):
    """The build cannot proceed: bad option, bad source checkpoint, or a failed verification.

    Parameters
    ----------
    problem : what is wrong, e.g. "no such file or directory".
    field : the BuildConfig field at fault ("model", "output", ...), if any.
    value : the value the user gave for `field`.
    fix : what to do instead; printed in parentheses.
    """

    def __init__(self, problem: str, *, field: str | None = None, value: Any = None, fix: str = ""):
        self.problem, self.field, self.value, self.fix = problem, field, value, fix
        super().__init__(self.format(field))

    def format(self, label: str | None) -> str:
        """The one-line message, with the field shown as `label` (the CLI passes '--model')."""
        head = "" if label is None else (f"{label} {self.value}: " if self.value is not None else f"{label}: ")
        msg = head + self.problem + (f" ({self.fix})" if self.fix else "")
        return " ".join(msg.split())  # one line, even when a wrapped library message had newlines


class SourceError(BuildError):
    """The source checkpoint is missing, unsupported, corrupt, or disagrees with its config."""


class OutputError(BuildError):
    """The engine dir cannot be written (exists without --force, unwritable parent)."""


class VerifyError(BuildError):
    """The built engine does not reproduce the source model within tolerance."""
