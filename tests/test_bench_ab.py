"""scripts/bench_ab.py: the ABBA order and the summary (no bench is run)."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("bench_ab", Path(__file__).parents[1] / "scripts" / "bench_ab.py")
bench_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_ab)


def test_order_alternates_abba_with_equal_runs_per_commit():
    assert bench_ab.order(2) == [0, 1, 1, 0]
    assert bench_ab.order(3) == [0, 1, 1, 0, 0, 1]
    assert bench_ab.order(3).count(0) == 3


def _doc(tps):
    return {"rows": [{"context": 8192, "batch": 4, "impl": "dense", "decode_tokens_per_s": tps}]}


def test_summary_medians_spread_and_verdict():
    table = bench_ab.summarise({0: [_doc(10.0), _doc(11.0)], 1: [_doc(10.5), _doc(10.6)]})
    (r,) = table
    assert r["old_median"] == 10.5 and abs(r["new_median"] - 10.55) < 1e-9
    assert abs(r["old_spread"] - 0.1) < 1e-9
    assert r["within_spread"]
    (slow,) = bench_ab.summarise({0: [_doc(10.0), _doc(10.1)], 1: [_doc(8.0), _doc(8.05)]})
    assert not slow["within_spread"] and slow["new_over_old"] < 0.81
