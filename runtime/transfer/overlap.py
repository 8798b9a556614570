"""How much of the copy time a pipeline hid behind compute (the "satisfied" / copy-replay method).

Three wall times of the same work:

- ``real_s``: the run as it is, copies overlapped with compute;
- ``satisfied_s``: the same compute with every copy already satisfied (no copy waited on);
- ``copy_alone_s``: the same copies through the same transfer path with no compute.

``real - satisfied`` is the copy time that stayed exposed; the hidden share is the rest of the
copy time, as a fraction of it: ``1 - (real - satisfied) / copy_alone``, clamped to [0, 1] (noise
can push it a little past either end). Undefined (NaN) when there is no copy time to hide or an
input is missing; ``share_or_none`` turns that into ``None`` for JSON.
"""
from __future__ import annotations

import math
from typing import Optional

__all__ = ["hidden_share", "share_or_none"]


def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def hidden_share(real_s: Optional[float], satisfied_s: Optional[float],
                 copy_alone_s: Optional[float]) -> float:
    """1 - (real - satisfied) / copy_alone, clamped to [0, 1]; NaN where undefined.

    Undefined: any input None or not finite, or ``copy_alone_s <= 0`` (nothing to hide).
    """
    if not (_finite(real_s) and _finite(satisfied_s) and _finite(copy_alone_s)):
        return math.nan
    if copy_alone_s <= 0:
        return math.nan
    share = 1.0 - (float(real_s) - float(satisfied_s)) / float(copy_alone_s)
    return min(1.0, max(0.0, share))


def share_or_none(share: Optional[float]) -> Optional[float]:
    """A share for JSON: ``None`` where it is undefined (NaN is not valid JSON)."""
    return share if _finite(share) else None
