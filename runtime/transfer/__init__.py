"""The transfer engine: the only code that moves KV bytes between tiers.

The residency manager decides *what* moves and hands over `CopyJob`s; the engine moves the bytes in
the background and signals a `Ticket` per job. Compute waits only on the ticket of the layer it is
about to read (`wait`), never on everything. Urgent jobs jump the queue.

Modules: `base` (CopyJob, Ticket, TransferEngine), `thread` (ThreadTransferEngine: CPU, one worker
thread; SyncTransferEngine: inline) and `cuda` (CudaTransferEngine: two prioritised CUDA streams
through cuda-python, imported only when asked for), with the same interface and tests; `link`
(LinkTransferEngine, `"link:GBPS,US"`: the inner engine's copies, each landed when a modeled link
of that bandwidth and per-job latency would have delivered it: the CPU's measure of overlap) and
`overlap` (`hidden_share`). `cuda`, `thread` and `link` import `base`; nothing imports this
package's `__init__` but its users.
"""
from __future__ import annotations

from .base import CopyJob, Ticket, TransferEngine
from .link import LinkTransferEngine, make_link_engine
from .thread import SyncTransferEngine, ThreadTransferEngine

__all__ = ["CopyJob", "Ticket", "TransferEngine", "SyncTransferEngine", "ThreadTransferEngine",
           "LinkTransferEngine", "make_transfer_engine"]


def make_transfer_engine(kind: str = "thread") -> TransferEngine:
    """By kind: "thread", "sync", "cuda", or "link:GBPS,US" (a ConfigError naming `transfer` when
    that spec is malformed)."""
    if isinstance(kind, str) and kind.startswith("link"):
        return make_link_engine(kind)
    if kind == "thread":
        return ThreadTransferEngine()
    if kind == "sync":
        return SyncTransferEngine()
    if kind == "cuda":
        from .cuda import CudaTransferEngine   # lazy: needs cuda-python and a GPU
        return CudaTransferEngine()
    raise ValueError(f"transfer engine {kind!r} is unknown (use 'thread', 'sync', 'cuda' or 'link:GBPS,US')")
