"""Typed errors a user can cause. Each names the field at fault and the fix.

Callers (CLI, Triton model, builder) catch `LookaheadError` and print `str(err)`:
one line, no stack trace.

Fields are the runtime's own names: `prompt`, the `SamplingParams` fields (`max_tokens`,
`temperature`, `top_p`, `top_k`, `seed`, `stop`, `ignore_eos`), `request_id`, the config fields,
`device`. A front end that calls them something else (Triton's `text_input`, a key inside
`sampling_parameters`) reports the error under its own name with `renamed`
(serving/fields.py holds those tables); the runtime never names a serving field.
"""
from __future__ import annotations


class LookaheadError(Exception):
    """Base of every error a user can cause."""


class _Named:
    """An error whose message is `field: problem (fix)`, or just `problem (fix)` without a field."""

    field: str | None
    problem: str
    fix: str

    def _message(self) -> str:
        msg = f"{self.field}: {self.problem}" if self.field else self.problem
        return msg + (f" ({self.fix})" if self.fix else "")

    def renamed(self, field: str):
        """This error, of the same type with the same problem and fix, naming `field`: how a front
        end reports a runtime field under its request's own name. `self` when nothing changes."""
        if not self.field or field == self.field:
            return self
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.field = field
        new.args = (new._message(),)
        new.__cause__, new.__suppress_context__ = self.__cause__, self.__suppress_context__
        return new


class ConfigError(_Named, LookaheadError, ValueError):
    """A configuration field holds a bad value."""

    def __init__(self, field: str, problem: str, fix: str = ""):
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(self._message())


class EngineDirError(LookaheadError):
    """An engine directory is missing, incomplete, incompatible or tampered with."""


class RequestError(ConfigError):
    """A generation request is invalid; the engine stays up."""


class CapacityError(_Named, LookaheadError):
    """A request can never fit this engine's limits (context, memory), or cannot be queued now.

    With a `field` (the one to change, e.g. `max_tokens`) the message starts with it."""

    def __init__(self, message: str, field: str | None = None, fix: str = ""):
        self.field, self.problem, self.fix = field, message, fix
        super().__init__(self._message())
