"""runtime/thread_tuner.py: a step runs on fewer threads only while measured steps say fewer are
faster (a busy core), and goes back when the core frees up; on a quiet machine it keeps the engine's
count and its checks thin out. Driven by a cost model, not the clock: the tests cannot flake."""
from __future__ import annotations

import pytest
import torch

from runtime.engine import Engine
from runtime.sampling import SamplingParams
from runtime.thread_tuner import EXPLORE, MAX_INTERVAL, RECENT, ThreadTuner, attention_ratio, candidates, prefill_units
from runtime.internals import Internals
from tiny_engine import make_tiny_engine, random_prompts


def drive(tuner: ThreadTuner, cost, steps: int, kind: str = "decode", shape=4) -> list[int]:
    """`steps` steps whose seconds are `cost(threads, step)`; the counts they ran with."""
    used = []
    for i in range(steps):
        n = tuner.threads(kind)
        used.append(n)
        tuner.record(kind, n, cost(n, i), 1, shape)
    return used


def test_the_candidates():
    assert candidates(1) == (1,) and candidates(2) == (2, 1) and candidates(8) == (8, 7, 4)


def test_quiet_keeps_every_thread_and_checks_rarely():
    """Once at the start, then one check a MAX_INTERVAL: ~0.5 % of a quiet machine's steps."""
    tuner = ThreadTuner(2)
    used = drive(tuner, lambda n, i: {2: 0.030, 1: 0.046}[n], 2000)
    assert used[-1] == 2 and tuner.switches == 0
    # one check at the start, then one in 512 steps
    assert 0 < used.count(1) <= EXPLORE["decode"] * (1 + 2000 // MAX_INTERVAL["decode"])
    assert used[RECENT] == 1 and used.count(1) == EXPLORE["decode"] * (1 + 2000 // MAX_INTERVAL["decode"])


def test_a_busy_core_moves_it_to_fewer_and_a_free_one_back():
    tuner = ThreadTuner(2)
    busy = range(100, 400)
    used = drive(tuner, lambda n, i: {2: 0.130 if i in busy else 0.030, 1: 0.046}[n], 1200)
    assert used[99] == 2
    moved = next(i for i in range(100, 1200) if all(n == 1 for n in used[i:i + 10]))
    assert moved <= 100 + RECENT + EXPLORE["decode"]        # as soon as most recent steps are slow
    back = next(i for i in range(400, 1200) if all(n == 2 for n in used[i:i + 20]))
    assert back < 400 + MAX_INTERVAL["decode"] + EXPLORE["decode"] and used[-1] == 2 and tuner.switches == 2


def test_a_slowly_growing_context_moves_the_mark_not_the_threads():
    tuner = ThreadTuner(2)
    used = drive(tuner, lambda n, i: {2: 0.030, 1: 0.046}[n] * (1 + i / 500), 2000)     # 5x slower by the end
    assert tuner.switches == 0 and used.count(1) <= EXPLORE["decode"] * 12


def test_prefill_chunks_take_one_step_a_check():
    tuner = ThreadTuner(2)
    used = drive(tuner, lambda n, i: {2: 2.0 if 20 <= i < 60 else 1.0, 1: 1.4}[n], 100, kind="prefill", shape=None)
    assert used[:RECENT] == [2] * RECENT and used[RECENT] == 1 and used[RECENT + 1:20] == [2] * (19 - RECENT)
    assert used[20 + RECENT // 2 + 2:60].count(1) >= 28 and used[-1] == 2     # checks back: 4, 8, 16 chunks apart


def test_noise_alone_does_not_switch():
    g = torch.Generator().manual_seed(0)
    noise = torch.rand(3000, generator=g).tolist()
    tuner = ThreadTuner(2)
    drive(tuner, lambda n, i: {2: 0.030, 1: 0.046}[n] * (1 + 0.15 * noise[i]), 3000)
    assert tuner.switches == 0


def test_a_step_of_another_size_is_not_compared():
    tuner = ThreadTuner(2, base_interval={"decode": 2})
    # the batch grows every step (and its steps with it): no two steps of one size, so no check
    # compares a longer step with a shorter one
    used = []
    for i in range(200):
        used.append(tuner.threads("decode"))
        tuner.record("decode", used[-1], 0.01 * (i + 1) if used[-1] == 2 else 0.001, 1, shape=i)
    assert tuner.switches == 0 and set(used) == {2}


def test_off_and_one_thread_never_explore():
    for tuner in (ThreadTuner(2, enabled=False), ThreadTuner(1)):
        assert set(drive(tuner, lambda n, i: 1.0 if n > 1 else 0.001, 300)) == {tuner.max_threads}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("tuner"), seed=7)


def test_the_engine_steps_on_the_tuners_count_and_reports_it(tiny_dir, monkeypatch):
    eng = Engine.from_dir(tiny_dir, block_size=4, max_batch_size=2)
    seen = []
    orig = eng.runner.run
    monkeypatch.setattr(eng.runner, "run", lambda *a, **kw: (seen.append(torch.get_num_threads()), orig(*a, **kw))[1])
    monkeypatch.setattr(eng.tuner, "threads", lambda kind: 1)
    eng.generate(random_prompts(9, 7, seed=2), SamplingParams(max_tokens=4, ignore_eos=True))
    assert seen and set(seen) == {1}
    assert {"thread_switches", "threads_decode", "threads_prefill"} <= set(eng.stats())
    assert eng.sibling(mode="sparse").tuner.enabled
    assert not Engine.from_dir(tiny_dir, adaptive_threads=False).tuner.enabled
    # a compiled decode graph keeps one count: torch.compile guards on it (a change recompiles)
    graph = Engine.from_dir(tiny_dir, internals=Internals(impl="torch", fused=False), graph=True)
    assert not graph.tuner.enabled and graph.describe()["adaptive_threads"] == "off"


def test_the_contention_bench_table():
    from bench.contention import table
    rows = [{"load": load, "mode": "dense", "adaptive_threads": a, "decode_ms": ms, "prefill_s": pf,
             "threads_decode": 1 if (a and load == "busy") else 2}
            for load, a, ms, pf in (("quiet", False, 26.0, 15.0), ("quiet", True, 26.5, 15.2),
                                    ("busy", False, 104.0, 34.0), ("busy", True, 40.0, 27.0))]
    lines = table(rows)
    assert lines[0].split()[:4] == ["mode", "adaptive", "load", "decode"]
    busy_on = lines[4].split()
    assert busy_on[:4] == ["dense", "True", "busy", "40.00"] and busy_on[4] == f"{40 / 26.5:.2f}"
    assert busy_on[-1] == "1/-" and lines[3].split()[4] == "4.00"


def test_the_quiet_cost_table():
    from bench.contention import quiet_table
    on, off = [50.0, 52.0, 66.0], [48.0, 53.0, 60.0]
    ratios = [a / b for a, b in zip(on, off)]
    row = {"mode": "lookahead", "on_ms": on, "off_ms": off, "ratios": ratios, "median_ratio": sorted(ratios)[1],
           "checks": [1, 2, 1]}
    lines = quiet_table([row])
    assert lines[0].split()[:2] == ["mode", "pairs"]
    cells = lines[1].split()
    assert cells[:4] == ["lookahead", "3", "52.00", "53.00"]
    assert cells[4] == f"{min(ratios):.2f}-{max(ratios):.2f}" and cells[5] == f"{sorted(ratios)[1]:.3f}"
    assert cells[6] == "2"


@pytest.mark.parametrize("normalised", [True, False])
def test_a_long_prompt_is_not_a_slowdown(tiny_model_config, normalised):
    """A quiet machine's 16K prompt in 512-token chunks: a late chunk costs ~3x a first one per token
    (attention over the keys before it). Measured per unit of work (`prefill_units`) the tuner checks
    once, at the start; per token (as before), the growth reads as a slowdown and sets off a check,
    a chunk on one thread, every few chunks (on the 0.5B model: a 12K prompt 24 % slower)."""
    from runtime.config import ModelConfig
    cfg = ModelConfig(architecture="qwen2", vocab_size=1000, hidden_size=896, intermediate_size=4864, num_layers=24,
                      num_heads=14, num_kv_heads=2, head_dim=64, max_position_embeddings=32768, rope_theta=1e6)
    ratio = attention_ratio(cfg)
    assert 1e-4 < ratio < 1.5e-4                     # a key costs ~1/8,000 of a token's projections
    tuner, used = ThreadTuner(2), []
    for i in range(32):
        chunk = [(512 * i, 512)]
        work = prefill_units(chunk, ratio)
        n = tuner.threads("prefill")
        used.append(n)
        seconds = work * {2: 0.01, 1: 0.019}[n]      # the cost the work says, 1.9x on one thread
        tuner.record("prefill", n, seconds, work if normalised else 512)
    assert used[-1] == 2 and tuner.switches == 0
    if normalised:
        assert tuner.checks == 1 and used.count(1) == 1
    else:
        assert tuner.checks >= 3                     # the defect the units fix
