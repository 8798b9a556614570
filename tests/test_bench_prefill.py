"""bench/prefill.py (`python -m bench.prefill`): its FLOP count, its dry run, and one real run on a
tiny random engine (no peers) whose JSON has a row per engine x precision x mode x context."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.prefill import prefill_flops
from runtime.config import ModelConfig

from tiny_engine import TINY, make_tiny_engine

ROOT = Path(__file__).resolve().parents[1]


def test_flops_count_projections_and_causal_attention():
    m = ModelConfig(**TINY)
    f = prefill_flops(m, 10)
    h, q, kv, i = m.hidden_size, m.q_size, m.kv_size, m.intermediate_size
    assert f["gemm"] == 2 * 10 * (h * (q + 2 * kv) + q * h + 3 * h * i) * m.num_layers
    assert f["attention"] == 4 * 55 * m.num_heads * m.head_dim * m.num_layers       # 1 + 2 + ... + 10 keys
    assert f["total"] == f["gemm"] + f["attention"]


@pytest.mark.slow
def test_a_run_on_a_tiny_engine_writes_every_row(tmp_path):
    eng = make_tiny_engine(tmp_path / "tiny", seed=2, head_dim=32, num_heads=4, num_kv_heads=2)
    out = tmp_path / "bp.json"
    args = [sys.executable, "-m", "bench.prefill", "--engines", str(eng), "--contexts", "64,96",
            "--modes", "dense,lookahead,lookahead@prefill_top_k=1+prefill_window=16", "--precisions",
            "float32,bfloat16", "--peers", "", "--threads", "1",
            "--json", str(out), "--plot", str(tmp_path / "bp.png")]
    dry = subprocess.run(args + ["--dry-run"], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "context 96: 95 prompt tokens" in dry.stdout and not out.exists()
    subprocess.run(args, capture_output=True, text=True, cwd=ROOT, check=True)
    rows = json.loads(out.read_text())["rows"]
    got = {(r["context"], r["mode"], r["precision"]) for r in rows}
    modes = ("dense", "lookahead", "lookahead@prefill_top_k=1+prefill_window=16")
    assert got == {(c, m, p) for c in (64, 96) for m in modes for p in ("float32", "bfloat16")}
    # a block-sparse prefill claims no FLOP rate (it skips part of the attention the count holds)
    assert all((r["gflops"] is None) == ("@" in r["mode"]) for r in rows)
    assert all(r["ttft_s"] > 0 and r["prompt_tokens"] == r["context"] - 1 for r in rows)


def test_a_mode_takes_settings():
    """'lookahead@prefill_top_k=128+prefill_window=1024': block-sparse prefill beside the dense one."""
    from bench.prefill import mode_fields
    assert mode_fields("lookahead@prefill_top_k=128+prefill_window=1024") == (
        "lookahead", {"prefill_top_k": 128, "prefill_window": 1024})
    assert mode_fields("dense") == ("dense", {})
    assert mode_fields("lookahead@miss_policy=drop") == ("lookahead", {"miss_policy": "drop"})


def test_llama_cpp_runs_the_gguf_the_engine_was_built_from(tmp_path, monkeypatch):
    """The llama.cpp rows time the engine's own source GGUF (engine.yaml `source`), not the default model's."""
    import argparse

    from bench import llama_cpp, prefill

    gguf = tmp_path / "Long-Model.gguf"
    gguf.write_bytes(b"GGUF")
    eng = tmp_path / "eng"
    eng.mkdir()
    (eng / "engine.yaml").write_text(f"source:\n  kind: gguf\n  path: {gguf}\n")
    seen = []

    def fake_run_peer(configs, contexts, batches, gen, threads, prefill_threads=None, source=None, **kw):
        seen.append(source)
        return [{"context": c, "batch": 1, "impl": cfg.label, "error": "not run"} for cfg in configs for c in contexts]

    monkeypatch.setattr(llama_cpp, "run_peer", fake_run_peer)
    a = argparse.Namespace(llama_configs="Q8_0/f16", engines=[str(eng)], threads=2)
    rows = prefill.llama_rows(a, [(64, 63, {"total": 1.0})], {"int8": 1.0, "float32": 1.0})
    assert seen == [gguf, gguf]                              # flash attention off, then on
    assert [r["impl"] for r in rows] == ["llama.cpp Q8_0/f16 fa off", "llama.cpp Q8_0/f16 fa on"]


def test_vllm_gets_a_32k_prompt_on_stdin(tmp_path):
    """The vLLM peer's script reads its prompts from stdin: 32K token ids as one argument passed the
    kernel's 128 KiB limit (E2BIG). A stand-in python that echoes what the script would read."""
    from bench.prefill import run_vllm
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n" + f'exec {sys.executable} -c \'import json,sys; a=json.loads(sys.stdin.read()); '
                    'print("VLLM_RESULT " + json.dumps({len(p): 1.5 for p in a["prompts"]}))\'\n')
    fake.chmod(0o755)
    got = run_vllm(str(fake), tmp_path, [list(range(32767))], [1, 2], 32768, 60, 1)
    assert got == {32767: 1.5}
