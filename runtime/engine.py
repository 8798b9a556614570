"""The engine API: load an engine dir, accept requests from any thread, step, stream, generate.

    engine = Engine.from_dir("engines/default")
    for out in engine.stream("Hello", SamplingParams(max_tokens=16)):
        print(out.delta_text, end="")

`add_request` and `abort` are thread-safe (they post to an inbox the step loop drains), so a server
can run `step()` in one background thread and accept requests from others.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .attention_dense import DenseAttention
from .sparse import BlockSelection
from .block_manager import BlockAllocator, blocks_needed
from .device import resolve_device
from .engine_dir import load_manifest
from .internals import Internals, refuse_knobs_as_settings
from .errors import RequestError
from .kv_pool import KVPool
from .model import LlamaModel, load_model
from .observe import Observer, Observers
from .ops import kernel_fallbacks
from .projections import bind_pool_kernels
from .prefill_cache import PrefillCache
from .prefix_cache import KVEvents, PrefixCache, engine_identity
from .runner import DenseRunner
from .sampling import SamplingParams, TokenLogprob, sample_rows, token_logprobs
from .scheduler import Scheduler
from .spec import DTYPES, EngineSpec, clamp_top_k, resolve_spec  # noqa: F401  (clamp_top_k, DTYPES: their old home)
from .sequence import Sequence, SeqStatus
from .step import StepInterrupted
from .thread_tuner import ThreadTuner, attention_ratio, prefill_units
from .threads import spin_setting
from .transfer import TransferEngine, make_transfer_engine
from .tokenizer import IncrementalDetokenizer, TextTokenizer

log = logging.getLogger(__name__)

_warned = {"spin": False}     # the default-spin warning: once a process
INTERRUPT_POLL_S = 0.1   # how often a prompt-only step asks `step(interrupt=...)` between its layers


@dataclass
class RequestOutput:
    """What one step did for one choice of a request. `finished`: this choice ended;
    `request_finished`: the request's last choice ended (the same when n == 1)."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    index: int = 0                          # the choice (0 .. n-1)
    num_cached_tokens: int = 0              # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprob] | None = None    # one per new token, when the request asked
    request_finished: bool = False
    # params.prompt_logprobs: [None, one TokenLogprob (with its rank) per later prompt token], on
    # the choice's first output
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    ttft_s: float
    total_s: float
    metrics: dict[str, Any] = field(default_factory=dict)
    index: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None     # params.prompt_logprobs, as RequestOutput's

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.total_s - self.ttft_s
        return (len(self.token_ids) - 1) / decode_s if decode_s > 0 and len(self.token_ids) > 1 else 0.0


class Engine:
    def __init__(self, spec: EngineSpec, model: LlamaModel, tokenizer: TextTokenizer, max_queue: int = 256,
                 transfer: str | TransferEngine | None = None, prefill_cache: PrefillCache | None = None,
                 fused: bool = True, graph: bool = False, adaptive_threads: bool = True,
                 draft_attention: str | None = None):
        """The engine `spec` describes (`resolve_spec`: everything decided before this runs) over
        `model`, which it runs where the model lives with the spec's kernel table (the model's own,
        its prefill and decode entries at the spec's precisions); everything else it makes lives there
        too: the dense KV pool, or the lookahead device tier, its summaries and bookkeeping (the
        lookahead host pool stays in host memory, pinned when the device is a GPU).

        transfer: the lookahead copy engine, by kind ("thread", "sync", "cuda"; default "cuda"
        on a GPU, else "thread") or an instance (tests: one that records what it moves).
        prefill_cache: shared by engines over the same `model`, a prompt prefilled by one is
        replayed by the others (runtime/prefill_cache.py), e.g. one prompt under several modes.
        fused: a decode step may run as the kernel table's fused C step or layer (False: the
        model's Python layers, the reference, every step). graph: a decode step on the torch table
        runs as one `torch.compile(fullgraph=True)` graph (`DenseRunner.compile_decode`; lookahead:
        each layer's attention one op in it, `LookaheadRunner.compile_decode`;
        `describe()["decode_graph"]` says why not where it does not apply). adaptive_threads: a step
        may run on fewer threads than the engine's while measured steps say fewer are faster (another
        process on a core; runtime/thread_tuner.py); False: always the engine's count.
        draft_attention: what a lookahead step's draft row attends ("own", "tier"; None: by device,
        runtime/lookahead/attention.py `resolve_draft_attention`)."""
        manifest, config = spec.manifest, spec.config
        model = model.with_ops(spec.table(model.ops)).with_positions(spec.max_model_len)   # RoPE for every position
        # the compute threads every step runs with, whichever thread calls `step`: the count of the
        # thread that builds the engine (a thread started later may inherit another default: a
        # lookahead engine's copy worker runs single-threaded, and OpenMP hands that to new threads)
        self.threads = torch.get_num_threads()
        # fewer threads for a step while fewer are faster (a busy core: runtime/thread_tuner.py); not
        # for a GPU's steps, nor a compiled graph's (torch.compile guards on the thread count)
        self._adaptive = adaptive_threads
        self.tuner = ThreadTuner(self.threads, enabled=adaptive_threads and model.device.type == "cpu" and not graph)
        self._attention_ratio = attention_ratio(spec.manifest.model)
        self.spec, self.max_model_len = spec, spec.max_model_len
        self.device, self.ops, self.debug_checks, self.fused = model.device, model.ops, spec.debug_checks, fused
        self.graph, self._draft_attention = graph, draft_attention
        self.manifest, self.model, self.tokenizer, self.config = manifest, model, tokenizer, config
        self.prefill_cache = prefill_cache
        self.eos_ids = manifest.model.eos_token_ids
        self.memory_plan = spec.memory_plan           # checked against the host by resolve_spec
        self.pool = self._make_pool(spec.memory_plan.num_host_blocks, DTYPES[config.kv_dtype])   # the KV storage dtype
        # the pool-side kernels (prompt and decode attention, block selection, summaries) bound to
        # the pool's layout, once; with the weights' kernels (bound at load: model.projections),
        # every kernel this engine runs is decided by now
        self.ops, pool_why = bind_pool_kernels(self.ops, self.pool.k, self.pool.v, manifest.model.num_heads,
                                               config.mode, spec.dtype)
        self.kernel_fallbacks = kernel_fallbacks(model.ops) + model.projections.fallbacks + pool_why
        for why in self.kernel_fallbacks:
            log.warning("%s", why)
        # the pool's blocks and their names (runtime/prefix_cache.py): `allocator.events` are
        # the cache's KV events
        n_blocks, bs = spec.memory_plan.num_host_blocks, config.block_size
        self.allocator = PrefixCache(BlockAllocator(n_blocks), bs, self._identity(), config.prefix_caching)
        self.scheduler = Scheduler(self.allocator, bs, config.max_batch_size, self.max_model_len,
                                   config.prefill_chunk, max_queue, name_decoded=config.mode == "dense")
        self._weights_version = model.weights_version
        self.observers = Observers()          # runtime/observe.py: registered with `observe`
        self.runner = self._make_runner(transfer)
        self._ids = itertools.count()
        self._inbox: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._seqs: dict[str, list[Sequence]] = {}    # request id -> its choices
        self.counters = {"steps": 0, "prompt_tokens": 0, "output_tokens": 0, "finished_requests": 0,
                         "aborted_requests": 0, "step_seconds": 0.0, "decode_steps": 0, "decode_step_seconds": 0.0,
                         "interrupted_steps": 0}

    def _identity(self) -> bytes:
        """What the names of this engine's KV blocks cover: anything that changes a block's bytes
        (the weights, their shapes and RoPE, the dtypes, the block size, and the mode, whose
        decode writes the K/V of generated tokens)."""
        m = self.manifest
        weights = m.files.get("weights.safetensors") or repr(m.random_weights)
        return engine_identity(weights=weights, model=repr(m.model.to_dict()), dtype=m.dtype,
                               kv_dtype=self.config.kv_dtype, block_size=self.config.block_size,
                               mode=self.config.mode, quantization=repr(m.quantization),
                               prefill=self.config.prefill_precision)

    @property
    def kv_events(self) -> KVEvents:
        """The prefix cache's events (blocks stored / removed); `kv_events.subscribe(fn)`."""
        return self.allocator.events

    def _make_pool(self, num_blocks: int, dtype: torch.dtype) -> KVPool:
        """Dense: the whole cache on the device. Lookahead: the host tier (pinned for a GPU); the
        device tier follows its dtype. `dtype`: `kv_dtype`, whatever the weights' dtype."""
        mcfg, bs = self.manifest.model, self.config.block_size
        if self.config.mode in ("dense", "sparse"):
            return KVPool(mcfg, num_blocks, bs, dtype=dtype, device=self.device)
        return KVPool(mcfg, num_blocks, bs, dtype=dtype, pin_memory=self.device.type == "cuda")

    def _make_runner(self, transfer: str | TransferEngine | None):
        mcfg, cfg = self.manifest.model, self.config
        if cfg.mode in ("dense", "sparse"):
            selection = BlockSelection(mcfg, cfg, self.pool, self.ops) if cfg.mode == "sparse" else None
            return DenseRunner(self.model, DenseAttention(self.pool, mcfg.head_dim ** -0.5, self.ops, selection),
                               cfg.block_size, self.prefill_cache, self.observers, fused=self.fused,
                               graph=self.graph)
        from .draft import DraftChain, make_draft
        from .lookahead.attention import LookaheadAttention
        from .lookahead.runner import LookaheadRunner
        if not isinstance(transfer, TransferEngine):
            transfer = make_transfer_engine(transfer or ("cuda" if self.device.type == "cuda" else "thread"))
        # device_budget_bytes was checked with the memory plan (lookahead/budget.py), before any
        # allocation
        attn = LookaheadAttention(mcfg, cfg, self.pool, cfg.max_batch_size,
                                  blocks_needed(self.max_model_len, cfg.block_size), transfer, self.device,
                                  self.ops, self.debug_checks, self.observers, fused=self.fused,
                                  draft_attention=self._draft_attention)
        source = make_draft(cfg.draft)
        chain = DraftChain(source, cfg.resync_after) if source is not None else None
        return LookaheadRunner(self.model, attn, cfg.block_size, chain, cfg.max_batch_size, self.prefill_cache,
                               self.observers, fused=self.fused, graph=self.graph)

    def observe(self, observer: Observer) -> Observer:
        """Register an `Observer` (runtime/observe.py): its hooks see this engine's step batches,
        plans, block scores, copy jobs and emitted logits from the next step on. Returns it;
        `observers.remove(observer)` unregisters it."""
        return self.observers.add(observer)

    def sibling(self, prefill_cache: PrefillCache | None = None, *, num_host_blocks: int | None = None,
                allow_unverified_precision: bool = False, internals: Internals | None = None,
                **overrides: Any) -> "Engine":
        """A new engine over this one's loaded model (no second weight load) with its own KV pool,
        `overrides` applied to this engine's settings (a setting its mode does not read is refused);
        engines sharing a `prefill_cache` replay each other's prompts. internals: its
        `runtime.internals.Internals` (default: this engine's fused, impl and debug checks, and a
        copy engine of its own; `impl` and `ops` are the model's and cannot change)."""
        refuse_knobs_as_settings(overrides, "Engine.sibling")
        mine = internals or Internals(impl=self.spec.impl, fused=self.fused, debug_checks=self.debug_checks,
                                      draft_attention=self._draft_attention)
        spec = resolve_spec(self.manifest, self.device, overrides, base=self.config, impl=self.spec.impl,
                            debug_checks=mine.debug_checks, num_host_blocks=num_host_blocks, weights=False,
                            allow_unverified_precision=allow_unverified_precision or bool(self.spec.unverified))
        return Engine(spec, self.model, self.tokenizer, transfer=mine.transfer, prefill_cache=prefill_cache,
                      fused=mine.fused, graph=self.graph, adaptive_threads=self._adaptive,
                      draft_attention=mine.draft_attention)

    def close(self) -> None:
        """Stop background workers (the transfer engine's thread)."""
        attn = getattr(self.runner, "attn", None)
        if attn is not None and hasattr(attn, "transfer"):
            attn.transfer.close()

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path, *, device: str | torch.device | None = None, verify_checksums: bool = True,
                 num_host_blocks: int | None = None, max_queue: int = 256, graph: bool = False,
                 adaptive_threads: bool = True, allow_unverified_precision: bool = False,
                 internals: Internals | None = None, **overrides: Any) -> "Engine":
        """Load an engine dir (refusing an incomplete, incompatible or tampered one).

        device: where the engine runs (None: CUDA when torch has a GPU, else CPU); a device that
        is not there is a ConfigError naming `device`. `overrides` replace settings of engine.yaml's
        (e.g. mode="lookahead", top_k=64); a setting the mode does not read, or a precision the build
        did not verify (unless allow_unverified_precision), is a ConfigError naming it.
        adaptive_threads, graph: as `Engine`'s (a benchmark that wants a fixed thread count passes
        adaptive_threads=False). internals: the kernel table, fused or Python layers, debug checks
        and copy engine of tests and benchmarks (`runtime.internals.Internals`; not settings).
        """
        refuse_knobs_as_settings(overrides, "Engine.from_dir")
        internals = internals or Internals()
        impl, ops, debug_checks = internals.impl, internals.ops, internals.debug_checks
        device = resolve_device(device)
        manifest = load_manifest(path, verify_checksums=verify_checksums)
        # everything decided once, before the weights are read: what the host cannot hold, a setting
        # the mode ignores and an unverified precision are refused here
        spec = resolve_spec(manifest, device, overrides, impl=impl, ops=ops, debug_checks=debug_checks,
                            num_host_blocks=num_host_blocks, allow_unverified_precision=allow_unverified_precision)
        # the tokenizer first (fast): ids past the vocabulary, or a chat template that cannot render,
        # are refused before the weights are read
        tokenizer = TextTokenizer.from_engine(manifest)
        # weights.safetensors read onto `device`, or a random_weights recipe generated there
        model = load_model(manifest, device, spec.table(ops), spec.dtype, max_positions=spec.max_model_len)
        engine = cls(spec, model, tokenizer, max_queue, internals.transfer, fused=internals.fused, graph=graph,
                     adaptive_threads=adaptive_threads, draft_attention=internals.draft_attention)
        info = engine.describe()
        if info["openmp_spin"].startswith("default") and not _warned["spin"]:
            _warned["spin"] = True
            log.warning("OpenMP spin: %s; another busy thread or process then slows every step", info["openmp_spin"])
        log.info("engine %s: mode %s, prompt rows %s (%s), decode rows %s, kernels %s, fused decode %s, in torch: %d",
                 info["name"], info["settings"]["mode"], spec.prefill, spec.why["prefill"], spec.decode,
                 info["kernels"]["table"] or "torch", info["fused_decode"], len(info["kernel_fallbacks"]))
        return engine

    # ---- requests (thread-safe) ---------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and enqueue a request; raises RequestError/CapacityError for bad ones at once."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt", "is empty", "send at least one character")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("prompt", "has no tokens", "send a non-empty prompt")
        if any(t < 0 or t >= self.manifest.model.vocab_size for t in ids):
            raise RequestError("prompt", "holds token ids outside the vocabulary",
                               f"ids must be in [0, {self.manifest.model.vocab_size})")
        rid = request_id or f"req-{next(self._ids)}"
        seqs = [Sequence(next(self._ids), rid, ids, params, IncrementalDetokenizer(self.tokenizer), index=i)
                for i in range(params.n)]
        self.scheduler.check_fits(seqs[0])
        with self._lock:
            if rid in self._seqs:
                raise RequestError("request_id", f"{rid!r} is already running", "use a unique id")
            pending = [s for k, s in self._inbox if k == "add"]
            self.scheduler.check_queue(pending=pending + seqs[1:], seq=seqs[0])
            self._seqs[rid] = seqs
            self._inbox += [("add", seq) for seq in seqs]
        return rid

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        outs = []
        for kind, arg in inbox:
            if kind == "add":
                self.scheduler.add(arg)        # fits and queue room were checked in add_request
            else:
                for seq in list(self._seqs.get(arg, ())):
                    if seq.status != SeqStatus.FINISHED:
                        seq.finish_reason = "abort"
                        outs.append(self._finish(seq))
        return outs

    # ---- the step loop ------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        with self._lock:
            pending = bool(self._inbox)
        return pending or self.scheduler.has_unfinished()

    @torch.inference_mode()
    def step(self, interrupt: Callable[[list[str]], bool] | None = None) -> list[RequestOutput]:
        """Run one scheduler step; returns the outputs of every request that progressed or ended.

        A step of prompt chunks only (a prefill, up to `prefill_chunk` tokens: seconds on a CPU)
        stops between two layers once every request in it is aborted, by `abort` from another
        thread or by `interrupt(request_ids)` answering True (asked at most every
        `INTERRUPT_POLL_S`: a server's loop thread polls its clients so); its rows are dropped
        and its requests end as aborted in the outputs returned."""
        outs = self._drain_inbox()
        if self._weights_version != self.model.weights_version:      # load_weights: no name holds
            self.allocator.clear()
            self._weights_version = self.model.weights_version
        work = self.scheduler.schedule()
        if not work:
            return outs
        t0 = time.perf_counter()
        prompt_tokens = sum(n for s, n in work if s.in_prefill)
        kind = "prefill" if prompt_tokens else "decode"
        # a prompt step's work: its tokens' projections and their attention over the keys before them
        units = prefill_units(((s.num_cached, n) for s, n in work if s.in_prefill), self._attention_ratio) \
            if prompt_tokens else 1
        threads = self.tuner.threads(kind)       # the engine's count, or fewer while fewer are faster
        if torch.get_num_threads() != threads:   # (a step on another thread: a server's loop thread)
            torch.set_num_threads(threads)
        try:
            logits = self.runner.run(work, interrupt=self._interrupt_check(work, interrupt))
        except StepInterrupted:
            self.counters["interrupted_steps"] += 1
            for rid in {s.request_id for s, _ in work}:
                self.abort(rid)
            return outs + self._drain_inbox()
        self.counters["prompt_tokens"] += prompt_tokens
        for seq, _ in work:                 # the blocks this step filled get their names
            named = self.scheduler.name_full_blocks(seq)
            if named:
                self.runner.named(seq, named)
        if self.observers:
            self.observers.step_end(logits)
        self.counters["steps"] += 1
        self.counters["output_tokens"] += len(logits)
        emitting = [seq for seq, _ in work if seq.seq_id in logits]
        tokens, logprobs = self._sample(emitting, logits)
        for seq, token, lp in zip(emitting, tokens, logprobs):
            seq.append_token(token, self.eos_ids)
            lps = None if lp is None else [lp]
            if seq.finish_reason:
                outs.append(self._finish(seq, lps))
            else:
                outs.append(self._output(seq, [seq.output_ids[-1]], lps))
        took = time.perf_counter() - t0
        self.tuner.record(kind, threads, took, units, None if prompt_tokens else len(work))
        self.counters["step_seconds"] += took
        if not prompt_tokens:               # decode rows only: what one served token costs
            self.counters["decode_steps"] += 1
            self.counters["decode_step_seconds"] += took
        return outs

    def _interrupt_check(self, work: list[tuple[Sequence, int]],
                         interrupt: Callable[[list[str]], bool] | None) -> Callable[[], bool] | None:
        """The check a prompt-only step makes between layers (None for a step with decode rows:
        one of those is milliseconds): whether every request of the step is aborted."""
        if not all(seq.in_prefill for seq, _ in work):
            return None
        rids = sorted({seq.request_id for seq, _ in work})
        asked = [time.perf_counter()]

        def check() -> bool:
            with self._lock:
                aborting = {arg for kind, arg in self._inbox if kind == "abort"}
            if aborting.issuperset(rids):
                return True
            now = time.perf_counter()
            if interrupt is None or now - asked[0] < INTERRUPT_POLL_S:
                return False
            asked[0] = now
            return bool(interrupt(rids))
        return check

    def _sample(self, emitting: list[Sequence],
                logits: dict[int, torch.Tensor]) -> tuple[list[int], list[TokenLogprob | None]]:
        """The step's tokens, drawn where the logits are, with the runner's pending draws (the
        draft rows) in the same pass: one device-to-host copy of ids per step; and the
        log-probabilities of the sequences that asked for them (None for the others)."""
        rows = [logits[s.seq_id] for s in emitting]
        draws = [(s.params, s.noise_seed, s.num_tokens) for s in emitting]
        pending = self.runner.take_draws()
        if pending is not None:
            rows.append(pending.logits)
            draws += pending.draws
        if not draws:
            return [], []
        tokens = sample_rows(torch.cat([r.view(-1, r.shape[-1]) for r in rows]), draws)
        if pending is not None:             # before any sequence finishes and frees its chain
            pending.accept(tokens[len(emitting):])
        tokens = tokens[: len(emitting)]
        want = [i for i, s in enumerate(emitting) if s.params.logprobs is not None]
        logprobs: list[TokenLogprob | None] = [None] * len(emitting)
        if want:
            found = token_logprobs(torch.stack([rows[i] for i in want]), [tokens[i] for i in want],
                                   [emitting[i].params.logprobs for i in want])
            for i, lp in zip(want, found):
                logprobs[i] = lp
        return tokens, logprobs

    def _output(self, seq: Sequence, new_ids: list[int], logprobs: list[TokenLogprob] | None = None,
                request_finished: bool = False) -> RequestOutput:
        first = bool(new_ids) and len(seq.output_ids) == len(new_ids)
        return RequestOutput(seq.request_id, new_ids, seq.take_delta(), seq.finish_reason is not None,
                             seq.finish_reason, len(seq.prompt_ids), len(seq.output_ids), seq.index,
                             seq.num_prefix_hit, logprobs, request_finished,
                             seq.prompt_logprobs if first else None)

    def _finish(self, seq: Sequence, logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        self.runner.release(seq)
        self.scheduler.finish(seq)
        self.counters["aborted_requests" if seq.finish_reason == "abort" else "finished_requests"] += 1
        with self._lock:
            choices = self._seqs.get(seq.request_id, [])
            last = all(s.status == SeqStatus.FINISHED for s in choices)
            if last:
                self._seqs.pop(seq.request_id, None)
        new = seq.output_ids[-1:] if seq.finish_reason != "abort" else []
        return self._output(seq, new, logprobs if new else None, request_finished=last)

    def stats(self) -> dict[str, Any]:
        """Gauges and cumulative counters for monitoring (Triton's metrics endpoint reads these).

        Keys: num_waiting, num_running, free_blocks, steps, prompt_tokens, output_tokens,
        finished_requests, aborted_requests, plus the transfer/residency metrics of lookahead mode
        (h2d_bytes, device_resident_bytes, prefetch_hit_rate, urgent_blocks, transfer_wait_s), and
        kernel_fallbacks: the chosen precisions this CPU runs in torch instead of its kernels.
        """
        return {"num_waiting": len(self.scheduler.waiting), "num_running": len(self.scheduler.running),
                "free_blocks": self.allocator.num_free, **self.counters, **self.allocator.stats(),
                **self.runner.stats(), **self.tuner.stats(), "kernel_fallbacks": list(self.kernel_fallbacks)}

    def describe(self) -> dict[str, Any]:
        """What this engine resolved to on this machine, in one place: the model, the settings that
        shape a step, the precision of prompt and decode rows, the kernel table and the C libraries
        behind it, whether a decode step runs fused (or why not), what runs in torch instead of a
        kernel, and the memory plan (bytes; an engine from `from_dir` counts its weights, one built
        over a loaded model its own parts only). `python -m runtime info` prints it."""
        from plugins.cpu import loader

        m, c = self.manifest.model, self.config
        return {
            "engine": str(self.manifest.path), "name": self.manifest.name,
            "model": {"architecture": m.architecture, "layers": m.num_layers, "heads": m.num_heads,
                      "kv_heads": m.num_kv_heads, "head_dim": m.head_dim, "vocab": m.vocab_size,
                      "weights": self.manifest.dtype,
                      "int8_group": self.spec.int8_group if self.spec.quantized else None},
            "device": str(self.device), "threads": self.threads,
            "adaptive_threads": (f"on: a step may run on {', '.join(map(str, self.tuner.candidates[1:]))} while faster"
                                 if self.tuner.enabled and len(self.tuner.candidates) > 1 else "off"),
            "openmp_spin": spin_setting(),
            "max_model_len": self.max_model_len,
            "settings": {"mode": c.mode, "kv_dtype": c.kv_dtype, "block_size": c.block_size, "top_k": c.top_k,
                         "residency": c.residency, "miss_policy": c.miss_policy, "max_batch_size": c.max_batch_size,
                         "prefill_chunk": c.prefill_chunk, "prefix_caching": c.prefix_caching},
            "precision": self.spec.precision_record(),
            "kernels": {"table": self.ops.name, "projections": self.model.projections.kernels(),
                        "base_library": loader.unavailable_reason() or "loaded",
                        "avx512_library": loader.avx512_unavailable_reason() or "loaded"},
            "fused_decode": getattr(self.runner, "fused_reason", None) or "yes",
            "decode_graph": self.runner.graph_reason or "yes",
            "draft_attention": (f"{self.runner.attn.draft_attention}: {self.runner.attn.draft_attention_reason}"
                                if c.mode == "lookahead" and c.draft != "none"
                                else "no draft row"),
            "kernel_fallbacks": list(self.kernel_fallbacks),
            "memory_plan_bytes": {**self.memory_plan.components(), "total": self.memory_plan.total},
        }

    # ---- conveniences -------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[Completion]:
        """Run prompts to completion together (continuous batching); results in prompt order."""
        t0 = time.perf_counter()
        rids = [self.add_request(p, params) for p in prompts]
        seqs = {rid: self._seqs[rid] for rid in rids}
        done: dict[tuple[str, int], float] = {}
        logprobs: dict[tuple[str, int], list[TokenLogprob]] = {}
        total = sum(len(s) for s in seqs.values())
        while len(done) < total:
            for out in self.step():
                if out.logprobs is not None:
                    logprobs.setdefault((out.request_id, out.index), []).extend(out.logprobs)
                if out.finished:
                    done[out.request_id, out.index] = time.perf_counter()
        return [self._completion(s, t0, done[r, s.index], logprobs.get((r, s.index)))
                for r in rids for s in seqs[r]]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Generate one request, yielding its outputs as they come (drives the step loop itself;
        with n > 1 the choices' outputs interleave, `index` tells them apart)."""
        rid = self.add_request(prompt, params)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.request_finished:
                        return

    def _completion(self, seq: Sequence, t0: float, t_end: float,
                    logprobs: list[TokenLogprob] | None = None) -> Completion:
        ttft = (seq.first_token_time or t_end) - t0
        return Completion(seq.request_id, seq.text, list(seq.output_ids), seq.finish_reason,
                          len(seq.prompt_ids), ttft, t_end - t0, dict(seq.metrics), seq.index,
                          seq.num_prefix_hit, logprobs, seq.prompt_logprobs)
