"""transformers' decode paths for scripts/bench_decode.py, all with bench.speed.EngineDecoder's two calls.

    default         one forward over the prompts (default DynamicCache), then one-token forwards
    static-compile  StaticCache sized for prompt + generated tokens, prefill eager, the one-token
                    forward under torch.compile (fullgraph, static shapes): transformers' recipe
                    for compiled decode (docs "LLM inference optimization": static kv-cache and
                    torch.compile). Compiled and warmed up inside prefill(), so no timed step
                    pays for it; compile seconds are kept apart (`compile_s`).
    offloaded       DynamicCache(offloading=True): layers live on the CPU and are prefetched to the
                    GPU one ahead. transformers asserts CUDA for it, so it runs only where
                    torch.cuda.is_available() (the model is copied there); elsewhere the row says so.

A path that cannot run raises NotAvailable from prefill(); the benchmark reports the reason.
"""
from __future__ import annotations

import copy
import signal
import threading
import time

import torch

from bench.speed import Timing

HF_IMPLS = ("default", "static-compile", "offloaded")
OFFLOAD_CPU_REASON = "not available on CPU (transformers' offloaded KV cache needs CUDA)"


class NotAvailable(Exception):
    """This implementation cannot run here; str(e) is the row's text."""


class TransformersDecoder:
    """transformers' own path: one forward over the prompts (default DynamicCache), then a manual
    greedy loop of one-token forwards, so prefill and generate()'s bookkeeping are not timed."""

    name = "transformers"
    device = "cpu"
    compile_s: float | None = None

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]]):
        self.model, self.ids = model, torch.tensor(prompts)            # [B, L]
        self.timing = Timing()
        self.kv_tokens = self.ids.shape[1]   # cache positions a decode step attends over (floor)
        self.forward = model.forward

    def new_cache(self):
        return None                          # the model makes its default DynamicCache

    def sync(self) -> None:
        """Wait for queued device work before reading the clock (a no-op on CPU)."""

    @torch.inference_mode()
    def prefill(self) -> None:
        t0 = time.perf_counter()
        out = self.model(input_ids=self.ids, cache=self.new_cache(), use_cache=True, logits_to_keep=1)
        self.cache, self.next = out.cache, out.logits[:, -1].argmax(-1)                # next: [B]
        self.sync()
        self.timing.prefill_s = time.perf_counter() - t0
        self.timing.tokens = [[t] for t in self.next.tolist()]

    @torch.inference_mode()
    def step(self, timed: bool) -> None:
        t0 = time.perf_counter()
        out = self.forward(input_ids=self.next[:, None], cache=self.cache, use_cache=True)
        self.next = out.logits[:, -1].argmax(-1)
        self.sync()
        self.timing.add(time.perf_counter() - t0, timed, tokens=len(self.timing.tokens))
        for seq, t in zip(self.timing.tokens, self.next.tolist()):
            seq.append(t)

    def close(self) -> None:
        self.cache = None


class StaticCompileDecoder(TransformersDecoder):
    """StaticCache + torch.compile of the one-token forward, compiled afresh for this point's
    shapes (batch, cache length) and warmed up on the real cache, which is then rewound."""

    name = "transformers-static-compile"
    WARM_CALLS = 2                           # the first compiles, the second runs the compiled graph

    def __init__(self, model, prompts, new_tokens: int, compile_timeout_s: float):
        super().__init__(model, prompts)
        self.kv_tokens = self.ids.shape[1] + new_tokens + 1    # attention reads the whole buffer
        self.timeout_s = compile_timeout_s

    def new_cache(self):
        from transformers import StaticCache
        return StaticCache(config=self.model.config, max_cache_len=self.kv_tokens)

    def prefill(self) -> None:
        super().prefill()                   # eager: transformers does not compile prefill either
        torch._dynamo.reset()               # a fresh compile per point: its time is this point's
        mode = "reduce-overhead" if self.ids.device.type == "cuda" else None   # CUDA graphs only
        self.forward = torch.compile(self.model.forward, mode=mode, fullgraph=True, dynamic=False)
        first, t0 = self.next, time.perf_counter()
        try:
            with _deadline(self.timeout_s):
                for _ in range(self.WARM_CALLS):
                    self.step(timed=False)
        except Exception as e:  # noqa: BLE001 - any failure (or the deadline) makes the row "not available"
            self.forward, spent = self.model.forward, time.perf_counter() - t0
            torch._dynamo.reset()
            if isinstance(e, _Deadline) or spent >= self.timeout_s:
                raise NotAvailable(f"not available (torch.compile took over {self.timeout_s:.0f} s on this "
                                   "CPU; --compile-timeout)") from None
            raise NotAvailable(f"not available (torch.compile failed: {e.__class__.__name__}: "
                               f"{str(e).strip().splitlines()[0][:80] if str(e).strip() else ''})") from None
        self.compile_s = time.perf_counter() - t0     # includes WARM_CALLS decode steps (~0.1 s each)
        with torch.inference_mode():                # the cache's tensors are inference tensors
            self.cache.crop(-self.WARM_CALLS)       # rewind: the warm-up tokens are overwritten
        self.next = first
        self.timing.tokens = [seq[:1] for seq in self.timing.tokens]


class OffloadedDecoder(TransformersDecoder):
    """DynamicCache(offloading=True) on a CUDA copy of the model (transformers asserts CUDA)."""

    name = "transformers-offloaded"
    device = "cuda"
    _cuda_models: dict[int, torch.nn.Module] = {}     # one device copy per run, not per point

    def new_cache(self):
        from transformers import DynamicCache
        return DynamicCache(config=self.model.config, offloading=True)

    def sync(self) -> None:
        torch.cuda.synchronize()

    def prefill(self) -> None:
        if not torch.cuda.is_available():
            raise NotAvailable(OFFLOAD_CPU_REASON)
        key = id(self.model)
        if key not in self._cuda_models:
            self._cuda_models[key] = copy.deepcopy(self.model).to("cuda")
        self.model = self._cuda_models[key]
        self.forward, self.ids = self.model.forward, self.ids.to("cuda")
        super().prefill()


HF_NAMES = {"default": TransformersDecoder.name, "static-compile": StaticCompileDecoder.name,
            "offloaded": OffloadedDecoder.name}


def make_hf_decoders(impls: list[str], model, prompts, new_tokens: int, compile_timeout_s: float) -> list:
    """One decoder per --hf-impls entry; `new_tokens` sizes the static cache (decode steps to come)."""
    made = {"default": lambda: TransformersDecoder(model, prompts),
            "static-compile": lambda: StaticCompileDecoder(model, prompts, new_tokens, compile_timeout_s),
            "offloaded": lambda: OffloadedDecoder(model, prompts)}
    return [made[i]() for i in impls]


# ---- a deadline for torch.compile (SIGALRM: main thread only; elsewhere no deadline) ------------
class _Deadline(Exception):
    pass


class _deadline:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.armed = threading.current_thread() is threading.main_thread() and seconds > 0

    def __enter__(self):
        if self.armed:
            def fire(signum, frame):
                raise _Deadline()
            self.old = signal.signal(signal.SIGALRM, fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc):
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)
        return False
