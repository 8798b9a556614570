"""scripts/aiperf_run.py builds aiperf command lines that match aiperf 0.13's flags and our servers' contracts
(aiperf itself is not installed for the tests: its own venv, see the script's docstring)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
aiperf_run = load_script("scripts/aiperf_run.py")


def flag(cmd: list[str], name: str) -> str:
    assert cmd.count(name) == 1, f"{name} appears {cmd.count(name)} times in {cmd}"
    return cmd[cmd.index(name) + 1]


def test_openai_streaming_chat_command():
    cmd = aiperf_run.openai_command("aiperf", "http://127.0.0.1:8100", "lookahead_llm", "tok", "art/openai",
                                    concurrency=8, request_count=32, isl=200, osl=24)
    assert cmd[:2] == ["aiperf", "profile"]
    assert flag(cmd, "--endpoint-type") == "chat" and "--streaming" in cmd
    assert (flag(cmd, "--url"), flag(cmd, "--model"), flag(cmd, "--tokenizer")) == \
        ("http://127.0.0.1:8100", "lookahead_llm", "tok")
    assert (flag(cmd, "--concurrency"), flag(cmd, "--request-count"), flag(cmd, "--isl"), flag(cmd, "--osl")) == \
        ("8", "32", "200", "24")
    assert (flag(cmd, "--ui"), flag(cmd, "--artifact-dir")) == ("none", "art/openai")
    assert flag(cmd, "--extra-inputs") == "ignore_eos:true"          # exactly --osl tokens per request
    no_eos = aiperf_run.openai_command("aiperf", "u", "m", "t", "a", ignore_eos=False)
    assert "--extra-inputs" not in no_eos


def test_triton_template_command(tmp_path):
    template = tmp_path / "t.json.j2"
    cmd = aiperf_run.triton_command("aiperf", "http://127.0.0.1:8000", "tok", "art/triton", template, osl=16)
    assert flag(cmd, "--endpoint-type") == "template" and "--streaming" in cmd
    assert flag(cmd, "--custom-endpoint") == "/v2/models/lookahead_llm/generate_stream"
    extra = json.loads(flag(cmd, "--extra-inputs"))
    assert extra == {"payload_template": str(template.resolve()), "response_field": "text_output"}
    assert flag(cmd, "--osl") == "16"


def test_triton_template_renders_a_request_the_model_accepts():
    """Rendered as aiperf renders it (jinja2, autoescape on), the payload is JSON that
    serving.request.parse_request accepts the way Triton's HTTP endpoint splits it: model
    inputs become tensors, the other keys request parameters."""
    import jinja2

    from serving.request import parse_request

    prompt = 'A "quoted" <tag> & a\nnewline \u00e9'
    rendered = jinja2.Environment(autoescape=True).from_string(aiperf_run.triton_template()).render(
        text=prompt, max_tokens=24, stream=True)
    body = json.loads(rendered)
    inputs = {"text_input": np.array([prompt.encode()], dtype=np.object_),
              "max_tokens": np.array([body["max_tokens"]], dtype=np.int32),
              "stream": np.array([body["stream"]]), "exclude_input_in_output": np.array([True])}
    assert body["text_input"] == prompt
    params = {k: v for k, v in body.items() if k not in inputs}
    req = parse_request(inputs.get, params)
    assert req.prompt == prompt and req.stream and req.params.max_tokens == 24 and req.params.ignore_eos


def test_env_unsets_hf_hub_offline():
    env = aiperf_run.aiperf_env({"HF_HUB_OFFLINE": "1", "PATH": "/bin"})
    assert "HF_HUB_OFFLINE" not in env and env["PATH"] == "/bin"


def test_dry_run_prints_both_commands(capsys):
    assert aiperf_run.main(["--dry-run", "--aiperf", "/nonexistent/aiperf", "--artifact-dir", "out"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("/nonexistent/aiperf profile")]
    assert len(lines) == 2
    assert "--endpoint-type chat" in lines[0] and "--url http://127.0.0.1:8100" in lines[0]
    assert "--endpoint-type template" in lines[1] and "--url http://127.0.0.1:8000" in lines[1]
    assert '"text_input": {{ text|tojson }}' in out


def test_single_target_url_and_missing_aiperf(capsys, tmp_path):
    cmds = aiperf_run.commands(aiperf_run.build_parser().parse_args(
        ["--target", "triton", "--url", "http://127.0.0.1:9", "--aiperf", "x"]))
    assert list(cmds) == ["triton"] and flag(cmds["triton"], "--url") == "http://127.0.0.1:9"
    rc = aiperf_run.main(["--target", "openai", "--aiperf", str(tmp_path / "no-aiperf"),
                          "--artifact-dir", str(tmp_path / "art")])
    assert rc == 2 and "aiperf not found" in capsys.readouterr().err


def test_summary_reads_the_json_export(tmp_path, capsys):
    d = tmp_path / "openai" / "run1"
    d.mkdir(parents=True)
    (d / aiperf_run.EXPORT).write_text(json.dumps({
        "time_to_first_token": {"unit": "ms", "avg": 120.5, "p50": 110.0, "p99": 300.0},
        "inter_token_latency": {"unit": "ms", "avg": 40.0, "p50": 39.0, "p99": 80.0},
        "output_token_throughput": {"unit": "tokens/sec", "avg": 99.5},
        "request_count": {"unit": "requests", "avg": 32.0}, "error_request_count": {"unit": "requests", "avg": 0.0}}))
    s = aiperf_run.summarize(tmp_path / "openai")
    assert s["time_to_first_token"]["p50"] == 110.0 and s["error_request_count"]["avg"] == 0.0
    aiperf_run.print_summary({"openai": s})
    out = capsys.readouterr().out
    assert "TTFT [ms]" in out and "120.5" in out and "99.50" in out
    with pytest.raises(FileNotFoundError):
        aiperf_run.summarize(tmp_path / "nothing")
