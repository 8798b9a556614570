"""The torch table's dense decode step as one graph: `torch.compile(model.forward, fullgraph=True)`
over `PaddedDecode` (issue 42, item 6.3). On a 2-layer random model with ragged prompts: the compiled
steps give the eager steps' logits and tokens, bit for bit with the aot_eager backend (the graph
dynamo captures and AOT functionalizes, what inductor or CUDA graphs would receive, without a C++
compile on 2 cores), with 0 graph breaks (fullgraph raises on one) and a bounded number of compiles
as the contexts grow."""
from __future__ import annotations

import sys

import pytest
import torch

from runtime.engine import Engine
from runtime.sampling import SamplingParams
from runtime.internals import Internals
from tiny_engine import QWEN3_YARN, make_tiny_engine, random_prompts


def _compile_unavailable() -> str | None:
    from torch._dynamo.eval_frame import check_if_dynamo_supported
    try:
        check_if_dynamo_supported()
    except RuntimeError as e:
        return (f"torch.compile is unavailable with torch {torch.__version__} on Python "
                f"{sys.version_info.major}.{sys.version_info.minor}: {e}")
    return None


pytestmark = pytest.mark.skipif(_compile_unavailable() is not None, reason=str(_compile_unavailable()))

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("graph"), seed=7)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """qwen3's q/k head norms with YaRN RoPE: the layer's other branch."""
    return make_tiny_engine(tmp_path_factory.mktemp("graph_qwen3"), seed=8, **QWEN3_YARN)


def _logged(engine: Engine) -> list[dict]:
    """Every step's {seq_id: logits}, recorded from the runner."""
    steps, run = [], engine.runner.run

    def spy(work, **kw):
        out = run(work, **kw)
        steps.append({k: v.clone() for k, v in out.items()})
        return out
    engine.runner.run = spy
    return steps


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_decode_step_equals_eager(tiny_dir, qwen3_dir, arch):
    import torch._dynamo as dynamo

    path = tiny_dir if arch == "llama" else qwen3_dir
    dynamo.reset()
    dynamo.utils.counters.clear()
    prompts = random_prompts(9, 22, 14, seed=3)
    # one prefill step; one thread count (as Engine(graph=True) keeps: torch.compile guards on it)
    kw = dict(internals=Internals(impl="torch", fused=False), block_size=4, max_batch_size=3, prefill_chunk=64,
              adaptive_threads=False)
    eager = Engine.from_dir(path, **kw)
    graph = Engine.from_dir(path, **kw)
    assert graph.runner.compile_decode(backend="aot_eager") is None
    compiled, calls = graph.runner.graph, []
    graph.runner.graph = lambda *a: calls.append(a[0].shape[0]) or compiled(*a)
    logs = [_logged(e) for e in (eager, graph)]
    outs = [e.generate(prompts, GREEDY) for e in (eager, graph)]
    assert [c.token_ids for c in outs[0]] == [c.token_ids for c in outs[1]]
    assert calls == [3] * (GREEDY.max_tokens - 1)                   # every decode step ran the graph
    assert len(logs[0]) == len(logs[1])
    for a, b in zip(*logs):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k])
    assert not dynamo.utils.counters["graph_break"]
    # the first shape, then the longest context's block count goes dynamic: not a compile a step
    assert 1 <= dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_compile_decode_refuses_where_kernels_run_the_step(tiny_dir):
    from plugins import cpu

    sparse = Engine.from_dir(tiny_dir, internals=Internals(impl="torch", fused=False), mode="sparse", block_size=4)
    assert sparse.runner.compile_decode() == "sparse mode selects per sequence" and sparse.runner.graph is None
    if cpu.available():
        c = Engine.from_dir(tiny_dir)
        assert "run a decode step in their kernels" in c.runner.compile_decode() and c.runner.graph is None


def test_the_engine_switch_and_its_report(tiny_dir):
    eng = Engine.from_dir(tiny_dir, internals=Internals(impl="torch", fused=False), graph=True, block_size=4)
    assert eng.runner.graph is not None and eng.describe()["decode_graph"] == "yes"
    assert eng.sibling(mode="sparse").describe()["decode_graph"] == "sparse mode selects per sequence"
    assert Engine.from_dir(tiny_dir, block_size=4).describe()["decode_graph"] == "graph=False"


LOOKAHEAD_MODES = {
    "resident-urgent": dict(residency="resident", miss_policy="urgent"),
    "pingpong": dict(residency="pingpong", miss_policy="urgent"),
    "sparse-ondemand": dict(residency="resident", miss_policy="urgent", draft="none"),
}


@pytest.mark.parametrize("mode", list(LOOKAHEAD_MODES))
def test_compiled_lookahead_step_equals_eager(tiny_dir, mode):
    """A lookahead decode step on the torch table as one fullgraph graph, each layer's lookahead
    attention the opaque `lookahead::attend_layer` op (runtime/lookahead/graph.py): every decode
    step runs the graph, 0 graph breaks, and logits, tokens and the backend's own record (hits,
    urgent blocks, agreement, bytes moved) equal the eager steps'. K = 2 blocks of contexts up to 36
    tokens (9 blocks): most blocks are outside the working set, so the misses and copies run."""
    import torch._dynamo as dynamo

    dynamo.reset()
    dynamo.utils.counters.clear()
    prompts = random_prompts(21, 30, 14, seed=5)
    kw = dict(internals=Internals(impl="torch", fused=False, transfer="sync"), mode="lookahead", block_size=4,
              recent_window=8, num_sink_blocks=1, top_k=2, max_batch_size=3, prefill_chunk=128,
              adaptive_threads=False, **LOOKAHEAD_MODES[mode])
    eager = Engine.from_dir(tiny_dir, **kw)
    graph = Engine.from_dir(tiny_dir, **kw)
    assert graph.runner.compile_decode(backend="aot_eager") is None and graph.describe()["decode_graph"] == "yes"
    compiled, calls = graph.runner.graph, []
    graph.runner.graph = lambda *a: calls.append(a[0].shape[0]) or compiled(*a)
    logs = [_logged(e) for e in (eager, graph)]
    outs = [e.generate(prompts, GREEDY) for e in (eager, graph)]
    assert [c.token_ids for c in outs[0]] == [c.token_ids for c in outs[1]]
    # every step after the one prefill step (all decode-only) ran the graph; a lane leaves when its
    # sequence ends, which a rejected draft's pre-decoding step puts off: the batch then shrinks
    rows = 3 if mode == "sparse-ondemand" else 6                     # a draft row beside each real one
    assert len(calls) == len(logs[1]) - 1 and calls[0] == rows and calls == sorted(calls, reverse=True)
    assert len(logs[0]) == len(logs[1])
    for a, b in zip(*logs):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k])
    stats = [e.runner.stats() for e in (eager, graph)]
    assert stats[0] == stats[1] and stats[1]["urgent_blocks"] > 0, stats
    assert not dynamo.utils.counters["graph_break"]
    assert 1 <= dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    for e in (eager, graph):
        e.close()


def test_the_attend_layer_op_outside_a_step():
    """The op runs a bound step's layer only; called bare it says where it belongs. It is tagged
    cudagraph_unsafe, so a CUDA graph of the compiled step is captured around it, not through it."""
    import runtime.lookahead.graph  # noqa: F401  (registers the op)
    x = torch.zeros(2, 4, 8)
    with pytest.raises(RuntimeError, match="inside a lookahead step only"):
        torch.ops.lookahead.attend_layer(x, x[:, :2], x[:, :2], 0)
    assert torch.Tag.cudagraph_unsafe in torch.ops.lookahead.attend_layer.default.tags
