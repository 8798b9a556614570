"""The one parser of an HTTP request target at the public port: origin-form only, one path per route.

Every check the front makes (the OpenAI checks, /generate served over gRPC, routing) and the target it
sends upstream use the `Target` this returns, so a check can never see a different path than the
server behind it routes on. A request whose target could route differently there than here is
refused (400) instead of normalised in a way the server behind might not share:

- only origin-form (`/path?query`, RFC 9112 3.2.1): an absolute-form (`http://host/path`),
  authority-form (`host:port`) or asterisk (`*`) target is refused;
- a `#fragment` (never part of a request target) is refused;
- `.` and `..` segments, empty segments (`//`) and a backslash are refused;
- a percent-escape in the path that decodes to a character that routes (an unreserved character,
  `/`, `\\`, `%`), or one that is malformed, is refused; others (`%20`) pass as sent;
- a target with a byte outside printable ASCII is refused.

One trailing slash is dropped (`/v1/completions/` is `/v1/completions`, here and upstream). The
query passes unchanged; nothing routes on it.
"""
from __future__ import annotations

import re
import string
from dataclasses import dataclass

_ROUTING = set(string.ascii_letters + string.digits + "-._~/\\%")   # decoded, these would change the route
_ESCAPE = re.compile(r"%(..)?", re.S)


class TargetError(ValueError):
    """A request target refused (the front answers 400 with this message)."""


@dataclass(frozen=True)
class Target:
    path: str               # normalised: what every check keys on and what goes upstream
    query: str = ""         # after '?', as sent

    def __str__(self) -> str:
        return self.path + (f"?{self.query}" if self.query else "")


def parse_target(target: str) -> Target:
    """The request line's target -> Target, or TargetError naming what is wrong with it."""
    shown = repr(target[:80])
    if not target or any(not 0x21 <= ord(c) <= 0x7E for c in target):
        raise TargetError(f"request target {shown} has a byte outside printable ASCII "
                          f"(percent-encode it)")
    if "#" in target:
        raise TargetError(f"request target {shown} has a #fragment (send the path and query only)")
    if not target.startswith("/"):
        raise TargetError(f"request target {shown} is not origin-form (send the path, e.g. /v2/health/ready, "
                          f"not an absolute URL, host:port or *)")
    path, _, query = target.partition("?")
    _check_path(path, shown)
    if len(path) > 1 and path.endswith("/"):
        path = path[:-1]
    return Target(path, query)


def _check_path(path: str, shown: str) -> None:
    segments = path[1:].split("/")
    if path != "/" and path.endswith("/"):
        segments = segments[:-1]                    # one trailing slash: dropped by the caller
    for seg in segments:
        if seg in (".", "..") or (not seg and path != "/"):
            raise TargetError(f"request target {shown} has an empty, '.' or '..' path segment "
                              f"(send the normalised path)")
    if "\\" in path:
        raise TargetError(f"request target {shown} has a backslash in its path")
    for m in _ESCAPE.finditer(path):
        code = m.group(1)
        if code is None or not all(c in string.hexdigits for c in code):
            raise TargetError(f"request target {shown} has a malformed percent-escape")
        if chr(int(code, 16)) in _ROUTING:
            raise TargetError(f"request target {shown} percent-encodes {chr(int(code, 16))!r} in its path "
                              f"(send the character itself)")
