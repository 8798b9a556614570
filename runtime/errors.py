"""Typed errors a user can cause. Each names the field at fault and the fix.

Callers (CLI, Triton model, builder) catch `LookaheadError` and print `str(err)`:
one line, no stack trace.
"""
from __future__ import annotations


class LookaheadError(Exception):
    """Base of every error a user can cause."""


class ConfigError(LookaheadError, ValueError):
    """A configuration field holds a bad value."""

    def __init__(self, field: str, problem: str, fix: str = ""):
        self.field, self.problem, self.fix = field, problem, fix
        msg = f"{field}: {problem}"
        super().__init__(msg + (f" ({fix})" if fix else ""))


class EngineDirError(LookaheadError):
    """An engine directory is missing, incomplete, incompatible or tampered with."""


class RequestError(ConfigError):
    """A generation request is invalid; the engine stays up."""


class CapacityError(LookaheadError):
    """A request can never fit this engine's limits (context, memory), or cannot be queued now."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field
