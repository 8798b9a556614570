"""bench.op_count counts what a decode step dispatches on the torch table (issue 42, item 6)."""
from __future__ import annotations

import json

import pytest
import torch

from bench import op_count


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("op_count")
    return {n: op_count.engine_dir(root, n) for n in (1, 2)}


def test_counter_counts_views_apart():
    with op_count.OpCounter() as c:
        x = torch.ones(4, 4)
        y = x.view(16)[2:]               # two views
        (y + 1).sum()                    # two ops
    assert c.views == 2 and c.non_view == c.total - 2 >= 3      # ones, add, sum
    assert c.by_op["add"] == 1 and c.by_op["sum"] == 1


def test_more_layers_more_ops(engines):
    one, two = (op_count.count_step(engines[n], "dense", 2, warm=1, steps=1) for n in (1, 2))
    assert two.total > one.total and two.non_view > one.non_view
    # every layer projects q/k/v, o, gate/up and down: at least 4 matrix products a layer
    assert sum(two.by_op[op] - one.by_op.get(op, 0) for op in ("linear", "mm", "addmm")) >= 4


def test_main_writes_json(engines, tmp_path, capsys):
    out = tmp_path / "ops.json"
    op_count.main(["--layers", "1", "2", "--target-layers", "4", "--cases", "dense:1", "--warm", "1",
                   "--steps", "1", "--engines", str(engines[1].parent), "--json", str(out)])
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["case"] == "dense b1" and row["total_per_layer"] > row["non_view_per_layer"] > 0
    assert row["total_4l"] == round(row["total_1l"] + 3 * row["total_per_layer"])
    assert "dense b1" in capsys.readouterr().out


def test_dense_ops_per_layer_are_flat_in_the_batch(engines):
    """The torch table's dense decode step attends to every sequence in one batch of ops: a layer
    costs the same ops at batch 1 and 4 (the per-sequence loop grew 5 non-view ops a sequence)."""
    per_layer = {}
    for batch in (1, 4):
        one, two = (op_count.count_step(engines[n], "dense", batch, warm=1, steps=1) for n in (1, 2))
        per_layer[batch] = (two.total - one.total, two.non_view - one.non_view)
    assert per_layer[1] == per_layer[4]
    assert per_layer[4][1] <= 30


def test_dispatcher_counts_each_lookahead_op_once(engines):
    """--dispatcher: the lookahead ops through torch.ops.lookahead (a CUDA engine's torch table),
    one op each a layer, where the CPU torch table's direct calls count their inner ops."""
    direct, dispatched = (op_count.count_step(engines[1], "lookahead", 2, warm=1, steps=1, dispatcher=d)
                          for d in (False, True))
    assert dispatched.by_op["lookahead_attention"] == 1 and "lookahead_attention" not in direct.by_op
    assert dispatched.by_op["block_topk"] >= 1
    assert direct.non_view > dispatched.non_view


def test_lookahead_step_on_a_gpus_table_is_within_half_again_of_dense(engines):
    """Issue 42's target at these shapes: a lookahead layer (b5, its ops through the dispatcher as
    a CUDA engine calls them) dispatches at most 1.5x a dense layer's ops, its slot plans and copy
    jobs one op each (they were ~40 and ~10 apiece)."""
    per_layer, counts = {}, {}
    for mode in ("dense", "lookahead"):
        one, two = (op_count.count_step(engines[n], mode, 5, warm=2, steps=1, dispatcher=mode == "lookahead")
                    for n in (1, 2))
        per_layer[mode] = two.total - one.total
        counts[mode] = (one, two)
    one, two = counts["lookahead"]
    assert two.by_op["plan_slots"] - one.by_op["plan_slots"] == 2           # urgent and predicted
    assert two.by_op["copy_blocks"] >= 2 and "scatter_" not in two.by_op and "argsort" not in two.by_op
    assert per_layer["lookahead"] <= 1.5 * per_layer["dense"], per_layer
