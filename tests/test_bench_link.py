"""bench_decode.py --link-sweep: the modeled-link sweep's helpers (bench/speed.py) and a smoke run on a
tiny random engine (no timing is asserted: only what the sweep must hold whatever the speed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.speed as lib
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
bench_py = load_script("scripts/bench_decode.py")


def test_parse_link_sweep():
    assert lib.parse_link_sweep("0.25, h200,1,4") == [0.25, "h200", 1.0, 4.0]
    for bad in ("", "0", "-1", "x", "inf", "1,,0"):
        with pytest.raises(ValueError):
            lib.parse_link_sweep(bad)
    args = bench_py.parse_args(["--link-sweep", "1,h200", "--link-latency-us", "5", "--link-modes", "dense,lookahead-drop"])
    assert args.link_sweep == [1.0, "h200"] and args.link_latency_us == 5.0
    assert args.link_modes == ["dense", "lookahead-drop"]
    assert bench_py.parse_args([]).link_sweep is None
    for bad in (["--link-sweep", "0"], ["--link-sweep", "1", "--link-modes", "warp"],
                ["--link-sweep", "1", "--link-latency-us", "-1"]):
        with pytest.raises(SystemExit):
            bench_py.parse_args(bad)


def test_h200_equivalent_is_pcie_over_hbm_of_the_measured_ram():
    assert lib.H200_RATIO == pytest.approx(55 / 4800)
    assert 1 / lib.H200_RATIO == pytest.approx(87.3, abs=0.1)
    assert lib.h200_equivalent_gbps(48.0) == pytest.approx(0.55)


def test_phase_plan_times_as_many_real_as_satisfied_steps_in_abba_halves():
    plan = lib.link_phase_plan(16, 2)
    timed = [(p, n) for p, _, n in plan if p is not None]
    assert sum(n for p, n in timed if p == "real") == sum(n for p, n in timed if p == "satisfied") == 16
    assert [p for p, _ in timed] == ["real", "satisfied", "satisfied", "real"]
    # every timed phase runs on its own link, and each switch of link is preceded by an untimed step
    for (p0, l0, _), (p1, l1, _) in zip(plan, plan[1:]):
        assert p1 is None or l1 == p1
        if l0 != l1:
            assert p1 is None
    assert plan[0] == (None, "real", 2)
    odd = lib.link_phase_plan(3, 0)
    assert sum(n for p, _, n in odd if p == "real") == sum(n for p, _, n in odd if p == "satisfied") == 3


def _row(mode, gbps, ms, sat, alone, nbytes=1):
    return {"mode": mode, "link_gbps": gbps, "ms_per_step": ms, "satisfied_ms_per_step": sat,
            "copy_alone_ms_per_step": alone, "copy_alone": {"bytes": nbytes},
            "hidden_share": lib.hidden_share_or_none(ms, sat, alone) if alone is not None else None}


def test_targets_take_the_lowest_link_where_copies_fit_in_the_compute():
    rows = [_row("sparse-ondemand", 1, 90, 40, 60), _row("sparse-ondemand", 4, 50, 40, 15),
            _row("lookahead-drop", 1, 100, 50, 80),           # copies 80 > compute 50
            _row("lookahead-drop", 4, 54, 50, 20),            # the point: hidden 1 - 4/20 = 80 %
            _row("lookahead-drop", 16, 50, 50, 5),
            _row("lookahead-pingpong", 1, 300, 50, 250), _row("lookahead-pingpong", 4, 120, 50, 62),
            _row("lookahead-resident", 1, 40, 40, 0.01, nbytes=0)]
    t = {x["mode"]: x for x in lib.link_targets(rows)}
    assert t["lookahead-drop"]["link_gbps"] == 4 and t["lookahead-drop"]["hidden_share"] == pytest.approx(0.8)
    assert t["lookahead-drop"]["hidden_met"] and not t["lookahead-drop"]["beats_sparse_ondemand"]   # 54 > 50
    assert t["lookahead-pingpong"]["link_gbps"] is None and "no swept link" in t["lookahead-pingpong"]["note"]
    assert t["lookahead-resident"]["link_gbps"] is None and "nothing" in t["lookahead-resident"]["note"]


def test_table_marks_the_h200_point_and_says_it_is_a_model():
    rows = []
    for g in (0.1, 0.5, 2.0):
        for m in ("dense", "sparse-ondemand", "lookahead-drop"):
            r = {"mode": m, "link_gbps": g, "link_over_device": g / 44.0, "ms_per_step": 50.0, "stall_ms_per_step": 1.0,
                 "satisfied_ms_per_step": 49.0, "copy_alone_ms_per_step": None if m == "dense" else 10.0,
                 "link_busy_ms_per_step": None if m == "dense" else 9.0, "exposed_ms_per_step": 1.0,
                 "hidden_share": None if m == "dense" else 0.9, "h2d_bytes_per_step": 2**20,
                 "hidden_share_stall": None if m == "dense" else 0.75, "sleep_overshoot_ms_per_step": 0.5}
            rows.append(r)
    text = lib.format_link_table(rows, h200_gbps=44.0 * lib.H200_RATIO)      # 0.504 GB/s
    marked = [line for line in text.splitlines() if "H200" in line]
    assert len(marked) == 3 and all(line.lstrip().startswith("0.5 ") for line in marked)
    assert "90%" in text and "75%" in text and "1/88" in text and "1.00x" in text
    assert "MODEL" in lib.MODEL_NOTE and "not a GPU measurement" in lib.MODEL_NOTE


def test_link_sweep_smoke_on_a_tiny_engine(tmp_path, monkeypatch, capsys):
    from runtime.config import LookaheadConfig
    from tiny_engine import make_tiny_engine

    path = make_tiny_engine(tmp_path / "tiny", seed=3,
                            lookahead=LookaheadConfig(block_size=4, recent_window=8, num_sink_blocks=1, top_k=3))
    # the RAM bandwidth is measured on 1 GiB tensors: a fixed one here (the sweep's logic, not its speed)
    monkeypatch.setattr(bench_py, "memory_bandwidth", lambda: {"bandwidth_gbps": 40.0, "sum_read_gbps": 40.0,
                                                            "copy_read_write_gbps": 30.0})
    monkeypatch.setattr(bench_py.BandwidthProbe, "sample", lambda self: 40.0)
    out = tmp_path / "link.json"
    rc = bench_py.main(["--engine", str(path), "--contexts", "96", "--batches", "2", "--decode-steps", "2",
                     "--warmup-steps", "1", "--link-sweep", "0.0005,h200", "--link-latency-us", "20",
                     "--json", str(out), "--plot", str(tmp_path / "link.png")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert printed.count("THIS IS A MODEL") == 2 and "<- H200 PCIe:HBM" in printed
    doc = json.loads(out.read_text())
    assert doc["h200_equivalent_gbps"] == pytest.approx(40.0 * lib.H200_RATIO)
    assert doc["links_gbps"] == [0.0005, round(40.0 * lib.H200_RATIO, 3)]
    assert {(r["mode"], r["link_gbps"]) for r in doc["rows"]} == {(m, g) for m in lib.LINK_MODES
                                                                 for g in doc["links_gbps"]}
    slow = {r["mode"]: r for r in doc["rows"] if r["link_gbps"] == 0.0005}
    for mode in lib.LINK_MODES[1:]:
        r = slow[mode]
        assert r["timed_steps"] == 2 and r["h2d_bytes_per_step"] > 0
        # the replay carries exactly the real steps' bytes, and the link's busy time covers them
        assert r["copy_alone"]["bytes"] == r["h2d_bytes_per_step"] * r["timed_steps"]
        assert r["link_busy_ms_per_step"] >= r["h2d_bytes_per_step"] / 0.5e6          # bytes / (0.0005 GB/s), ms
        assert r["copy_alone_ms_per_step"] >= r["copy_alone_link_ms_per_step"] * 0.999
        assert r["hidden_share"] is None or 0.0 <= r["hidden_share"] <= 1.0
        assert r["hidden_share_stall"] is None or 0.0 <= r["hidden_share_stall"] <= 1.0
        assert 0.0 <= r["sleep_overshoot_ms_per_step"] <= r["stall_ms_per_step"]
    # on demand every copy is urgent and waited for: the stall is the link's time, less only the
    # caller's own work between a job's submit and its wait (microseconds against milliseconds here)
    assert slow["sparse-ondemand"]["stall_ms_per_step"] >= slow["sparse-ondemand"]["link_busy_ms_per_step"] * 0.9
    assert slow["dense"]["hidden_share"] is None and slow["dense"]["copy_alone"] is None
    assert {t["mode"] for t in doc["targets"]} == set(lib.LINK_MODES[2:])
    assert (tmp_path / "link.png").exists() or "no plot" in printed
