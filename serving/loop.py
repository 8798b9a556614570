"""The serving step loop: one background thread drives `Engine.step()` and routes each output.

    loop = EngineLoop(engine, on_stats=exporter.update)
    loop.start()
    rid = loop.submit(prompt, params, sink)     # from any thread; raises RequestError/CapacityError
    ...
    loop.stop()

The thread sleeps on a condition variable while the engine has nothing to do (no busy spin) and is
woken by `submit`. Every `cancel_poll_s` it asks each live request's sink whether its client has
cancelled and aborts those in the engine, which frees their KV blocks at the next step. A long
prefill step asks too, between its layers (`Engine.step(interrupt=...)`): one whose every request
was cancelled stops there instead of at the end of its chunk.

Tokenizing. `tokenizers`' `encode` holds the GIL throughout (~0.6 s a MB of text here), which
stalls the step-loop thread and every stream with it. A prompt of more than `inline_tokenize_chars`
characters is therefore tokenized on a second thread ("tokenizer"), one prompt at a time, with
`encode_batch`, which releases the GIL; `submit` returns at once and the request joins the engine
when its ids are ready. Errors found then (the prompt is too long, the queue is full) go to the
sink's `on_reject(error)`. Short prompts are tokenized in `submit`, as the engine does, and their
errors are raised there.

Errors name the runtime's fields (`prompt`, `max_tokens`, ...), as the engine's do: the loop serves
every front end, and each maps them to its request's names (serving/fields.py).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Protocol

from runtime.engine import Engine, RequestOutput
from runtime.errors import LookaheadError, RequestError
from runtime.sampling import SamplingParams

log = logging.getLogger(__name__)


class RequestSink(Protocol):
    """Where one request's outputs go. Called on the loop thread (or the tokenizer thread, for a
    long prompt's outputs before it joins the engine). Optional: `on_reject(error)`, the typed error
    of a request refused after `submit` returned (see the module docstring); without it
    `on_error(str(error))` is called."""

    def on_output(self, out: RequestOutput) -> None:
        """Every output of the request; the last has `finished` set (`finish_reason` "abort" if cancelled)."""

    def on_error(self, message: str) -> None:
        """The request ends without a final output (engine failure, server shutdown)."""

    def is_cancelled(self) -> bool:
        """Whether the client gave up (polled every `cancel_poll_s`)."""


class EngineLoop:
    def __init__(self, engine: Engine, *, on_stats: Callable[[dict[str, Any]], None] | None = None,
                 stats_interval_s: float = 0.5, cancel_poll_s: float = 0.2, rate_window_s: float = 5.0,
                 name: str = "lookahead", inline_tokenize_chars: int = 8192):
        self.engine = engine
        self.on_stats, self.stats_interval_s, self.cancel_poll_s = on_stats, stats_interval_s, cancel_poll_s
        self.inline_tokenize_chars = inline_tokenize_chars
        self._cv = threading.Condition()
        self._sinks: dict[str, RequestSink] = {}
        self._tokenizing: dict[str, RequestSink] = {}      # long prompts on the tokenizer thread
        self._tok_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._tok_thread: threading.Thread | None = None
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
        """Enqueue a request whose outputs go to `sink`; raises the engine's typed errors at once,
        except for a long prompt, which is tokenized off this thread (see the module docstring)."""
        rid = f"{self._name}-{next(self._ids)}"
        if isinstance(prompt, str) and len(prompt) > self.inline_tokenize_chars:
            with self._cv:
                if self._stopping:
                    raise RuntimeError("the engine loop is stopping")
                self._tokenizing[rid] = sink
                if self._tok_thread is None:
                    self._tok_thread = threading.Thread(target=self._tokenize_loop, daemon=True,
                                                        name=f"{self._name}-tokenizer")
                    self._tok_thread.start()
            self._tok_queue.put((rid, prompt, params, sink))
            return rid
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
            return len(self._sinks) + len(self._tokenizing)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still live get `on_error` (the server is going away)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._tok_queue.put(None)             # a tokenizer thread still tokenizing is left behind (daemon)
        with self._cv:
            sinks = list(self._sinks.values()) + list(self._tokenizing.values())
            self._sinks, self._tokenizing = {}, {}
        for sink in sinks:
            _call(sink.on_error, "the server is shutting down")

    # ---- the tokenizer thread ------------------------------------------------------------------
    def _tokenize_loop(self) -> None:
        while (item := self._tok_queue.get()) is not None:
            rid, prompt, params, sink = item
            try:
                ids = encode_releasing_gil(self.engine.tokenizer, prompt)
                self._admit_tokenized(rid, ids, params, sink)
            except LookaheadError as e:
                self._reject(rid, sink, e)
            except Exception as e:            # a bug: answer this request, keep serving
                log.exception("tokenizing a request failed")
                self._reject(rid, sink, None, f"internal error while tokenizing the prompt: {e}")
            with self._cv:                    # wake the loop: new work, or a gauge to republish
                self._stats_dirty = True
                self._cv.notify()

    def _admit_tokenized(self, rid: str, ids: list[int], params: SamplingParams, sink: RequestSink) -> None:
        limit = self.engine.max_model_len
        if len(ids) + params.max_tokens > limit:     # the engine's check, before its O(n) id checks
            raise RequestError("prompt", f"is {len(ids)} tokens: with max_tokens {params.max_tokens} that "
                               f"exceeds the engine's max_model_len {limit}", "shorten the prompt or lower max_tokens")
        with self._cv:
            if self._tokenizing.pop(rid, None) is None:
                return                        # stop() has failed it already
            if _cancelled(sink):
                cancelled = True
            else:
                cancelled = False
                self._sinks[rid] = sink
        if cancelled:                         # the client left while its prompt was tokenized
            _call(sink.on_output, aborted_output(rid, len(ids)))
            return
        self.engine.add_request(ids, params, request_id=rid)   # an error: _reject unregisters the sink

    def _reject(self, rid: str, sink: RequestSink, error: LookaheadError | None, message: str = "") -> None:
        with self._cv:
            live = self._tokenizing.pop(rid, None) is not None or self._sinks.pop(rid, None) is not None
        if not live:
            return                            # stop() has answered it already
        on_reject = getattr(sink, "on_reject", None)
        if error is not None and on_reject is not None:
            _call(on_reject, error)
        else:
            _call(sink.on_error, message or str(error))

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
            outs = self.engine.step(interrupt=self._all_cancelled)
        except Exception:                 # a bug, not a bad request: fail what is running, keep serving
            log.exception("engine step failed")
            self._fail_all("internal error in the engine step (see the server log)")
            return
        self._stats_dirty = True
        for out in outs:
            self._route(out)

    def _route(self, out: RequestOutput) -> None:
        done = request_finished(out)             # with n > 1, `finished` ends one choice only
        with self._cv:
            sink = self._sinks.pop(out.request_id, None) if done else self._sinks.get(out.request_id)
        if done:
            self._aborting.discard(out.request_id)
        if sink is None:
            return
        if not _call(sink.on_output, out) and not done:
            self._abort(out.request_id)          # the client cannot be reached: free its blocks

    def _poll_cancelled(self) -> None:
        with self._cv:
            live = list(self._sinks.items())
        for rid, sink in live:
            if rid not in self._aborting and sink.is_cancelled():
                self._abort(rid)

    def _all_cancelled(self, rids: list[str]) -> bool:
        """Asked by a long prompt-only step between its layers (`Engine.step`): whether every
        request in it was cancelled by its client, so the step stops mid-chunk."""
        with self._cv:
            sinks = [self._sinks.get(rid) for rid in rids]
        return all(sink is not None and _cancelled(sink) for sink in sinks)

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
        stats["total_blocks"] = self.engine.allocator.num_blocks
        with self._cv:
            stats["num_tokenizing"] = len(self._tokenizing)
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


def encode_releasing_gil(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer.encode(text)`, letting other Python threads run meanwhile.

    `tokenizers.Tokenizer.encode` holds the GIL for the whole call; `encode_batch` releases it.
    `tokenizer` is a runtime TextTokenizer (its `_tok` is the `tokenizers.Tokenizer`, encoded as
    TextTokenizer.encode does: no special tokens added); anything else falls back to `.encode`."""
    backend = getattr(tokenizer, "_tok", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return tokenizer.encode(text)
    return backend.encode_batch([text], add_special_tokens=False)[0].ids


def request_finished(out: RequestOutput) -> bool:
    """Whether `out` ends its request: the last choice's final output (`finished` ends one choice
    of an n > 1 request; a runtime without `request_finished` has one choice per request)."""
    return bool(out.finished and getattr(out, "request_finished", True))


def aborted_output(rid: str, num_prompt_tokens: int) -> RequestOutput:
    """The final output of a request cancelled before it reached the engine."""
    out = RequestOutput(rid, [], "", True, "abort", num_prompt_tokens, 0)
    if hasattr(out, "request_finished"):
        out.request_finished = True
    return out


def _cancelled(sink: RequestSink) -> bool:
    try:
        return bool(sink.is_cancelled())
    except Exception:
        return False


def _call(fn: Callable[..., Any], *args: Any) -> bool:
    """Call a sink/stats callback; a failing client must not take the loop down."""
    try:
        fn(*args)
        return True
    except Exception:
        log.exception("serving callback %s failed", getattr(fn, "__qualname__", fn))
        return False
