"""A lookahead decode step's model work as one graph: each layer's lookahead attention is one op.

`torch.compile(model.forward, fullgraph=True)` cannot trace what a lookahead layer decides on the
host: the miss policy, the copy tickets it waits on, the transfer engine's threads or streams, the
metrics. So the compiled forward reaches the backend through one opaque op,
`lookahead::attend_layer(q, k, v, layer) -> out` (`GRAPH_ATTENTION` is the `AttentionBackend`
the graph is traced with). Dynamo sees the op's fake implementation (the output's shape and
dtype: q's); at run time the op runs the step's backend, `LookaheadStep.forward`, which
`LookaheadRunner.run` names for the call (`bound(step)`). Everything around it (embedding, norms,
projections, RoPE, MLP, the final norm) is the graph, with no Python between its ops: on a GPU
what a CUDA graph would capture, in pieces split at this op, as vLLM splits at its attention (the
op is tagged `cudagraph_unsafe`, which is what makes inductor split there).

The op declares no mutated inputs: q, k and v are only read. Its effects live in the backend's
own state (device tier, slot tables, pool, metrics), which nothing in the graph reads, and each
layer's op is ordered after the one before it by data (its q depends on that layer's output).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

_bound = threading.local()          # the step whose layers the op runs, per thread


# cudagraph_unsafe: inductor's graph partition leaves the op out of a CUDA graph and captures the
# pieces between two of them (`torch.compile(mode="reduce-overhead")` on a GPU; never run: no GPU here)
@torch.library.custom_op("lookahead::attend_layer", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def attend_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer `layer`'s lookahead attention of the step `bound` names: q [T, H, D], k and v
    [T, KVH, D] -> out [T, H, D]."""
    step = getattr(_bound, "step", None)
    if step is None:
        raise RuntimeError("lookahead::attend_layer runs inside a lookahead step only: "
                           "LookaheadRunner.run binds the step (graph.bound) around the compiled forward")
    out = step.forward(layer, q, k, v).contiguous()        # the fake's layout: a compiler plans on it
    # an op's output may not alias its inputs (the graph would treat it as a new tensor)
    if any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in (q, k, v)):
        out = out.clone()
    return out


@attend_layer.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


class GraphAttention:
    """The `AttentionBackend` a compiled lookahead forward is traced with: each layer is the op."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.lookahead.attend_layer(q, k, v, layer_idx)


GRAPH_ATTENTION = GraphAttention()


@contextmanager
def bound(step):
    """Within: `lookahead::attend_layer` runs `step`'s layers (on this thread)."""
    before = getattr(_bound, "step", None)
    _bound.step = step
    try:
        yield
    finally:
        _bound.step = before
