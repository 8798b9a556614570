"""The typed field checks configurations share: each failure is a `ConfigError` naming the field,
what is wrong and the fix (runtime/config.py's dataclasses, runtime/rope_scaling.py's fields)."""
from __future__ import annotations

import math
from typing import Any

from .errors import ConfigError


def check(cond: bool, field_name: str, problem: str, fix: str = "") -> None:
    if not cond:
        raise ConfigError(field_name, problem, fix)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)       # True is an int to Python, not to us


def got(v: Any) -> str:
    return f"{v!r} (a {type(v).__name__})" if not isinstance(v, (int, float)) or isinstance(v, bool) else repr(v)


def check_int(v: Any, field_name: str, lo: int, hi: int, fix: str = "") -> None:
    """`v` is a real int (not a bool, not a string) in [lo, hi]. The upper bounds are generous but
    finite: a shape field of 10^8 would otherwise build 10^8 modules or allocate for minutes."""
    if not is_int(v):
        hint = "write it without quotes" if isinstance(v, str) and v.strip().lstrip("-").isdigit() else fix
        raise ConfigError(field_name, f"must be an integer in [{lo}, {hi}], got {got(v)}", hint)
    check(lo <= v <= hi, field_name, f"must be in [{lo}, {hi}], got {v}", fix)


def check_real(v: Any, field_name: str, lo: float, hi: float, fix: str = "", lo_open: bool = True) -> None:
    """`v` is a finite int or float in (lo, hi] (or [lo, hi] when not lo_open)."""
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
        hint = ("write a number without quotes; YAML reads 1e-5 as a string, 1.0e-5 as a number"
                if isinstance(v, str) else fix)
        raise ConfigError(field_name, f"must be a finite number, got {got(v)}", hint)
    ok = (lo < v if lo_open else lo <= v) and v <= hi
    check(ok, field_name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}", fix)


def check_bool(v: Any, field_name: str) -> None:
    check(isinstance(v, bool), field_name, f"must be true or false, got {got(v)}", "write true or false, without quotes")
