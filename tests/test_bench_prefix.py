"""scripts/bench_prefix.py on a tiny random-weights engine: the JSON's fields, and caching on computes
fewer prefill tokens than off (no timed assertions)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_engine import make_tiny_engine

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_prefix.py"


def _essays_installed() -> bool:
    from bench import longctx_data
    try:
        longctx_data.load_essays()
        return True
    except ModuleNotFoundError:
        return False


def test_help():
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--concurrency" in r.stdout


@pytest.mark.skipif(not _essays_installed(), reason="no essays installed (make data)")
def test_tiny_run(tmp_path):
    eng = make_tiny_engine(tmp_path / "tiny")
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--engine", str(eng), "--docs", "2", "--questions", "3",
                        "--doc-tokens", "96,160", "--concurrency", "2", "--max-tokens", "4",
                        "--second-doc-tokens", "128", "--turns", "3", "--turn-tokens", "40", "--reply-tokens", "6",
                        "--n-doc-tokens", "64", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "document QA" in r.stdout
    rep = json.loads(out.read_text())
    for k in ("engine", "commit", "loadavg_start", "loadavg_end", "workload", "dqa", "second", "multiturn", "n"):
        assert k in rep
    off, on = rep["dqa"]["off"], rep["dqa"]["on"]
    for s in (off, on):
        for f in ("ttft_p50_s", "ttft_p90_s", "output_tokens_per_s", "hit_rate", "prefill_tokens_computed",
                  "prompt_tokens_total", "n_requests"):
            assert f in s
        assert s["n_requests"] == 6
    assert off["prompt_tokens_total"] == on["prompt_tokens_total"]
    for s in (off, on):                     # 2 documents: 2 first questions, 4 later ones
        assert s["ttft_first_p50_s"] > 0 and s["ttft_later_p50_s"] > 0
    assert off["prefill_tokens_computed"] == off["prompt_tokens_total"]
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert off["hit_rate"] == 0 and on["hit_rate"] > 0
    assert rep["second"]["on"]["questions"][1]["cached_tokens"] > 0
    turns = rep["multiturn"]["on"]["turns"]
    assert len(turns) == 3 and all("prefix_vs_prev_prompt" in t for t in turns[1:])
    assert sum(t["prefill_tokens_computed"] for t in turns) < sum(
        t["prefill_tokens_computed"] for t in rep["multiturn"]["off"]["turns"])
    assert rep["n"]["on"]["n4"]["choices"] == 4
    assert rep["n"]["on"]["n4"]["prefill_tokens_computed"] < rep["n"]["off"]["n4"]["prefill_tokens_computed"]


@pytest.mark.skipif(not _essays_installed(), reason="no essays installed (make data)")
def test_served_url_runs_the_same_prompts_and_compares_the_answers(tmp_path):
    """--served-url: the DQA prompts go to an OpenAI server too (a fake here, answering ' w0 w1 ...'),
    reported as the `served` row with its first/later TTFTs and its answers against the in-process ones."""
    from test_prefix_serve import FakeServer

    eng = make_tiny_engine(tmp_path / "tiny")
    out = tmp_path / "o.json"
    fake = FakeServer()
    try:
        r = subprocess.run([sys.executable, str(SCRIPT), "--engine", str(eng), "--workloads", "dqa", "--settings", "on",
                            "--docs", "2", "--questions", "2", "--doc-tokens", "96", "--concurrency", "2",
                            "--max-tokens", "3", "--served-url", fake.url + "/v1", "--json", str(out)],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    finally:
        fake.close()
    assert r.returncode == 0, r.stderr[-3000:]
    sv = json.loads(out.read_text())["dqa"]["served"]
    assert sv["n_requests"] == 4 and len(fake.bodies) == 4 and fake.bodies[0]["model"] == "lookahead_llm"
    assert sv["ttft_first_p50_s"] is not None and sv["ttft_later_p50_s"] is not None
    assert sv["same_answers"]["compared"] == 4             # a random tiny model does not say " w0 w1 w2"
    assert sv["same_answers"]["equal"] == 0 and "served (ours)" in r.stdout


@pytest.mark.skipif(not _essays_installed(), reason="no essays installed (make data)")
def test_dynamo_long_documents_asks_every_document_at_once_twice(monkeypatch, tmp_path, capsys):
    """--dynamo-long against a fake OpenAI server in place of the Dynamo deployment: round one asks a
    question on each document at once (the server sees all four in flight), round two a second
    question on each; each document's second / first TTFT; a request that fails is recorded with
    its document and the round goes on."""
    import argparse
    from contextlib import contextmanager

    import bench.prefix_serve as ps
    from script_loader import load_script
    from test_prefix_serve import FakeServer

    from runtime.engine import Engine

    bp = load_script("scripts/bench_prefix.py")
    tok = Engine.from_dir(make_tiny_engine(tmp_path / "tiny"), num_host_blocks=64).tokenizer
    fake = FakeServer(hold=4)
    started = []

    @contextmanager
    def deployment(engine, workers, router, blocks, extra=None):
        started.append((workers, router, blocks, extra))
        yield argparse.Namespace(url=fake.url)

    real_complete, asked = ps.complete, []

    def complete(url, model, prompt, max_tokens, extra=None, timeout=900.0):
        asked.append(timeout)
        if len(asked) == 6:                                 # the second round's second request
            raise ps.ServerError("boom")
        return real_complete(url, model, prompt, max_tokens, extra, timeout)

    monkeypatch.setattr(ps, "DynamoDeployment", deployment)
    monkeypatch.setattr(ps, "complete", complete)
    args = argparse.Namespace(engine="e", dynamo_long_docs=4, dynamo_long_tokens=80, seed=0, max_tokens=3,
                              dynamo_worker_arg=["--mode", "lookahead"], request_timeout=1234.0)
    try:
        out = bp.run_dynamo_long(args, tok)
    finally:
        fake.close()
    assert started == [(1, "kv", int(4 * (80 + 256) / 16) + 64, ["--mode", "lookahead"])]
    assert fake.peak >= 4 and asked == [1234.0] * 8
    first, later = out["rounds"]
    assert [len(r["requests"]) for r in out["rounds"]] == [4, 4] and first["question"] != later["question"]
    assert out["errors"] == 1 and sum("error" in r for r in later["requests"]) == 1
    assert len(out["later_over_first"]) == 3 and out["later_over_first_max"] == max(out["later_over_first"])
    assert all(r["prompt_tokens"] > 0 for r in first["requests"])
    bp.print_report({"engine": "e", "commit": None, "loadavg_start": None, "loadavg_end": None, "dynamo_long": out})
    table = capsys.readouterr().out
    assert "4 x 80 tokens" in table and "errors 1" in table and "error: ServerError: boom" in table
