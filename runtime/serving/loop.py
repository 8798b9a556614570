"""The serving step loop: one background thread drives `Engine.step()` and routes each output.

    loop = EngineLoop(engine, on_stats=exporter.update)
    loop.start()
    rid = loop.submit(prompt, params, sink)     # from any thread; raises RequestError/CapacityError
    ...
    loop.stop()

The thread sleeps on a condition variable while the engine has nothing to do (no busy spin) and is
woken by `submit`. Every `cancel_poll_s` it asks each live request's sink whether its client has
cancelled and aborts those in the engine, which frees their KV blocks at the next step.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Protocol

from ..engine import Engine, RequestOutput
from ..sampling import SamplingParams

log = logging.getLogger(__name__)


class RequestSink(Protocol):
    """Where one request's outputs go. All three are called on the loop thread."""

    def on_output(self, out: RequestOutput) -> None:
        """Every output of the request; the last has `finished` set (`finish_reason` "abort" if cancelled)."""

    def on_error(self, message: str) -> None:
        """The request ends without a final output (engine failure, server shutdown)."""

    def is_cancelled(self) -> bool:
        """Whether the client gave up (polled every `cancel_poll_s`)."""


class EngineLoop:
    def __init__(self, engine: Engine, *, on_stats: Callable[[dict[str, Any]], None] | None = None,
                 stats_interval_s: float = 0.5, cancel_poll_s: float = 0.2, rate_window_s: float = 5.0,
                 name: str = "lookahead"):
        self.engine = engine
        self.on_stats, self.stats_interval_s, self.cancel_poll_s = on_stats, stats_interval_s, cancel_poll_s
        self._cv = threading.Condition()
        self._sinks: dict[str, RequestSink] = {}
        self._aborting: set[str] = set()
        self._stopping = False
        self._ids = itertools.count()
        self._name = name
        self._rate = _RateWindow(rate_window_s)
        self._stats_dirty = True
        self._thread = threading.Thread(target=self._run, name=f"{name}-engine-loop", daemon=True)

    # ---- any thread -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt: str | list[int], params: SamplingParams, sink: RequestSink) -> str:
        """Enqueue a request whose outputs go to `sink`; raises the engine's typed errors at once."""
        rid = f"{self._name}-{next(self._ids)}"
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine loop is stopping")
            self._sinks[rid] = sink          # registered first: the loop may emit output right away
        try:
            self.engine.add_request(prompt, params, request_id=rid)
        except BaseException:
            with self._cv:
                self._sinks.pop(rid, None)
            raise
        with self._cv:
            self._cv.notify()
        return rid

    def num_live(self) -> int:
        with self._cv:
            return len(self._sinks)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still live get `on_error` (the server is going away)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._cv:
            sinks, self._sinks = list(self._sinks.values()), {}
        for sink in sinks:
            _call(sink.on_error, "the server is shutting down")

    # ---- the loop thread ------------------------------------------------------------------------
    def _run(self) -> None:
        last_poll = last_stats = time.monotonic()
        while not self._stopping:
            if not self.engine.has_unfinished():
                self._sleep()
                continue
            self._step()
            now = time.monotonic()
            if now - last_poll >= self.cancel_poll_s:
                self._poll_cancelled()
                last_poll = now
            if now - last_stats >= self.stats_interval_s:
                self._publish_stats()
                last_stats = now

    def _sleep(self) -> None:
        """Idle: publish the settled stats, then wait for `submit` or `stop`; while the tokens/s
        gauge is still decaying, wake every stats interval to publish it (never a busy spin)."""
        published = self._publish_stats()          # outside the lock: metric updates are IPC
        with self._cv:
            if not self._stopping and not self.engine.has_unfinished():
                self._cv.wait(self.stats_interval_s if published and self._rate.active() else None)

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception:                 # a bug, not a bad request: fail what is running, keep serving
            log.exception("engine step failed")
            self._fail_all("internal error in the engine step (see the server log)")
            return
        self._stats_dirty = True
        for out in outs:
            self._route(out)

    def _route(self, out: RequestOutput) -> None:
        with self._cv:
            sink = self._sinks.pop(out.request_id) if out.finished else self._sinks.get(out.request_id)
        if out.finished:
            self._aborting.discard(out.request_id)
        if sink is None:
            return
        if not _call(sink.on_output, out) and not out.finished:
            self._abort(out.request_id)          # the client cannot be reached: free its blocks

    def _poll_cancelled(self) -> None:
        with self._cv:
            live = list(self._sinks.items())
        for rid, sink in live:
            if rid not in self._aborting and sink.is_cancelled():
                self._abort(rid)

    def _abort(self, rid: str) -> None:
        self._aborting.add(rid)
        self.engine.abort(rid)

    def _fail_all(self, message: str) -> None:
        with self._cv:
            sinks, self._sinks = dict(self._sinks), {}
        for rid, sink in sinks.items():
            self.engine.abort(rid)
            _call(sink.on_error, message)

    def _publish_stats(self) -> bool:
        """Send a stats snapshot to `on_stats` if anything changed; returns whether it did."""
        if self.on_stats is None or self._stopping or not (self._stats_dirty or self._rate.active()):
            return False        # stopping: the server is unloading, and a metric update is IPC to it
        self._stats_dirty = False
        stats = self.engine.stats()
        stats["tokens_per_s"] = self._rate.update(stats["output_tokens"])
        _call(self.on_stats, stats)
        return True


class _RateWindow:
    """Output tokens per second over the last `window_s` seconds of (time, cumulative count) samples."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()
        self.rate = 0.0

    def update(self, count: int) -> float:
        now = time.monotonic()
        self._samples.append((now, count))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        (t0, c0) = self._samples[0]
        self.rate = (count - c0) / (now - t0) if now > t0 else 0.0
        return self.rate

    def active(self) -> bool:
        """Still decaying towards zero after the engine went idle."""
        return self.rate > 0


def _call(fn: Callable[..., Any], *args: Any) -> bool:
    """Call a sink/stats callback; a failing client must not take the loop down."""
    try:
        fn(*args)
        return True
    except Exception:
        log.exception("serving callback %s failed", getattr(fn, "__qualname__", fn))
        return False
