"""Observation hooks: what a profiler, a bench or a test reads of a running engine.

    class Tap(Observer):
        def on_scores(self, layer, rows, lanes, idx, scores):
            ...                                     # e.g. clone scores[lanes[0]]
    engine.observe(Tap())

Register an `Observer` (override only the methods you need: the others do nothing) with
`Engine.observe`. The engine, its runner and the lookahead backend call the registered
observers in registration order, synchronously, on the step loop's thread; with none registered
each call site costs one truth test of an empty list. Observers only read: the tensors they are
handed are the engine's own (clone what you keep) and the plan is frozen. The hooks and where
they fire are in docs/ARCHITECTURE.md ("Observation").
"""
from __future__ import annotations

from typing import Any

import torch


class Observer:
    """The hooks, in the order one step calls them. Every method is a no-op here."""

    def on_batch(self, batch) -> None:
        """A step's rows (`runtime.step.StepBatch`), before the model runs, in both modes.
        `batch.store_only`: the step replays a recorded prefill and the model does not run."""

    def on_plan(self, plan) -> None:
        """Lookahead mode: the step's frozen `StepPlan` (runtime/lookahead/step_plan.py), before
        the first layer."""

    def on_queries(self, layer: int, rows: tuple[str, ...], lanes: list[int], q: torch.Tensor) -> None:
        """Lookahead mode, a decode step in the torch layer: layer `layer`'s queries `q` [n, R, H, D] (post-RoPE;
        dim 0 the lane, dim 1 named by `rows`, as in `on_scores`), just before they score the block summaries
        (this step's own keys are not in the host pool yet)."""

    def on_scores(self, layer: int, rows: tuple[str, ...], lanes: list[int], idx: torch.Tensor,
                  scores: torch.Tensor) -> None:
        """Lookahead mode: one read of layer `layer`'s block summaries. `idx` [n, R, KVH, top_k]
        holds the top-K logical blocks (-1: none), `scores` [n, R, KVH, NB] the group scores of
        the first NB logical blocks (-inf: not a candidate). Dim 0 is the lane; `lanes` lists
        the lanes the call is about (the other entries are inactive lanes or padding). `rows`
        names dim 1: ("real", "draft") in a decode step (the real query's true set, the draft's
        prediction for the next step), ("real",) without look-ahead, ("seed",) for the last
        prompt token of a completed prefill (the first working set)."""

    def on_copy(self, job, urgent: bool) -> None:
        """Lookahead mode: a `CopyJob` (host pool -> device tier) handed to the transfer engine,
        just before `submit`. `urgent`: the step waits for it (a miss fetched before attention).
        `job.tag` is (step, layer) or (step, layer, "fixed") for ping-pong's sink/window refill.
        `job.valid`: None (every entry is copied), or the mask of a fixed-capacity list's real
        entries (lists made on the device without reading their length: count `valid`, not the
        entries)."""

    def on_step_end(self, logits: dict[int, torch.Tensor]) -> None:
        """After the forward pass, before sampling: {seq_id: logits [vocab]} of the sequences that
        emit a token this step (the logits they are sampled from)."""


class Observers(list):
    """The registered observers (a list: False when empty, so call sites test it before
    building arguments, with no Python call)."""

    def add(self, observer: Observer) -> Observer:
        if not isinstance(observer, Observer):
            raise TypeError(f"observe: expected a runtime.observe.Observer, got {type(observer).__name__}")
        self.append(observer)
        return observer

    def wants(self, hook: str) -> bool:
        """Whether a registered observer overrides `hook` (e.g. "on_scores"): a fused path that
        cannot call it must leave the step to the path that does."""
        base = getattr(Observer, hook)
        return any(getattr(type(o), hook) is not base for o in self)

    def batch(self, batch) -> None:
        for o in self:
            o.on_batch(batch)

    def plan(self, plan) -> None:
        for o in self:
            o.on_plan(plan)

    def queries(self, layer: int, rows: tuple[str, ...], lanes: list[int], q: torch.Tensor) -> None:
        for o in self:
            o.on_queries(layer, rows, lanes, q)

    def scores(self, layer: int, rows: tuple[str, ...], lanes: list[int], idx: torch.Tensor,
               scores: torch.Tensor) -> None:
        for o in self:
            o.on_scores(layer, rows, lanes, idx, scores)

    def copy(self, job, urgent: bool) -> None:
        for o in self:
            o.on_copy(job, urgent)

    def step_end(self, logits: dict[int, Any]) -> None:
        for o in self:
            o.on_step_end(logits)
