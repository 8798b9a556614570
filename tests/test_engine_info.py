"""`Engine.describe()` and `python -m runtime info`: what an engine dir resolves to on this machine,
in one place (issue 42, item 1; runtime/spec.py resolves it): the settings, the precisions of prompt and decode
rows, the kernel table and libraries, the fused step or why not, the fallbacks, the memory plan."""
from __future__ import annotations

import json

import pytest

from plugins import cpu
from runtime.cli import main
from runtime.engine import Engine
from runtime.internals import Internals
from tiny_engine import SMALL_LOOKAHEAD, make_tiny_engine


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # head_dim 32: every kernel the modes call takes the layout (16 would be said as a fallback)
    return make_tiny_engine(tmp_path_factory.mktemp("info"), seed=5, head_dim=32)


def test_describe_says_what_the_engine_runs_and_why(tiny_dir):
    eng = Engine.from_dir(tiny_dir, **SMALL_LOOKAHEAD)
    spec = eng.describe()
    assert spec["engine"] == str(tiny_dir) and spec["settings"]["mode"] == "lookahead"
    assert spec["settings"]["block_size"] == 4 and spec["max_model_len"] == eng.max_model_len
    assert spec["precision"] == {"prefill": eng.ops.prefill, "decode": "float32", "prefill_from": eng.spec.why["prefill"],
                                 "decode_from": "default", "verified_by_build": None, "unverified": []}
    plan = spec["memory_plan_bytes"]
    assert plan["weights"] > 0 and plan["host_kv_pool"] > 0 and plan["total"] == sum(
        v for k, v in plan.items() if k != "total")
    if cpu.available():
        assert spec["kernels"]["table"] == eng.ops.name and spec["kernels"]["base_library"] == "loaded"
    runner = eng.runner
    assert spec["fused_decode"] == ("yes" if runner.fused is not None else runner.fused_reason)
    if cpu.available():             # prefill "auto" resolves to what this CPU runs: nothing falls back
        assert spec["kernel_fallbacks"] == [], spec["kernel_fallbacks"]
    torch_table = Engine.from_dir(tiny_dir, internals=Internals(impl="torch")).describe()
    assert torch_table["fused_decode"] != "yes" and torch_table["kernel_fallbacks"] == []


def test_runtime_info_prints_it_as_lines_and_as_json(tiny_dir, capsys):
    assert main(["info", "--engine", str(tiny_dir), "--mode", "sparse", "--top-k", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = dict(line.split(None, 1) for line in lines)
    assert table["settings.mode"] == "sparse" and table["settings.top_k"] == "8"
    assert table["memory_plan.total"].endswith(" MiB") and table["kernel_fallbacks"] == "none"
    assert main(["info", "--engine", str(tiny_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["mode"] == "dense" and {"prefill", "decode"} <= set(doc["precision"])


def test_runtime_info_names_a_bad_setting_in_one_line(tiny_dir, capsys):
    assert main(["info", "--engine", str(tiny_dir), "--mode", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: mode: ") and "\n" not in err
