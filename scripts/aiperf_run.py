#!/usr/bin/env python3
"""Load-test a served engine with aiperf (NVIDIA's LLM load generator, genai-perf's successor), offline.

    scripts/aiperf_run.py --target openai --url http://127.0.0.1:8000 --dry-run    # print the command
    scripts/aiperf_run.py --target triton --url http://127.0.0.1:8000              # run it, print the summary
    scripts/aiperf_run.py --target both --openai-url http://127.0.0.1:8100 --triton-url http://127.0.0.1:8000

Targets:
- `openai`: the OpenAI endpoint (the Dynamo frontend: deploy/dynamo_launch.py), streaming
  chat (`--endpoint-type chat --streaming`);
- `triton`: Triton's HTTP `/v2/models/lookahead_llm/generate_stream`, through aiperf's template
  endpoint: a Jinja payload template (written to the artifact dir) renders each request as the
  model's JSON inputs, and `text_output` is read from each SSE event.

Both send the same workload: `--concurrency` requests in flight, `--request-count` in all, `--isl`
prompt tokens and exactly `--osl` output tokens (EOS ignored unless --no-ignore-eos), counted with
the engine's own tokenizer: a local dir holding its tokenizer.json, tokenizer_config.json and a
config.json (aiperf has no network here; `--tokenizer builtin` would download a file and fail).
`HF_HUB_OFFLINE` is removed from aiperf's environment: with it set, aiperf takes a local path for
a hub repo id and refuses it.

aiperf is heavy (~1.2 GB: transformers, datasets) and is not a project dependency: install it in
its own venv (`python3.11 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0`,
~100 s) and pass `--aiperf .venv-aiperf/bin/aiperf` (the default looks there, then on PATH).
Each run writes `profile_export_aiperf.json` under its artifact dir; the summary printed at the end
(TTFT, ITL, request latency, output tokens/s, requests/s, errors) is read from it.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from runtime.threads import prepare_threads

prepare_threads()  # first: libgomp reads GOMP_SPINCOUNT once, when torch loads it (runtime/threads.py)

ROOT = Path(__file__).resolve().parents[1]

TRITON_MODEL = "lookahead_llm"
EXPORT = "profile_export_aiperf.json"
# aiperf's template endpoint renders this with jinja2 (autoescape on: `tojson` output is safe) from
# `text` (the prompt), `max_tokens` (--osl) and `stream`; keys that are not model inputs
# (ignore_eos) reach the model as request parameters, which serving/request.py reads.
TRITON_TEMPLATE = ('{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens|tojson }}, '
                   '"stream": true, "exclude_input_in_output": true, "ignore_eos": IGNORE_EOS}')
SUMMARY_METRICS = (("time_to_first_token", "TTFT"), ("inter_token_latency", "ITL"),
                   ("request_latency", "request latency"), ("output_token_throughput", "output tokens/s"),
                   ("request_throughput", "requests/s"), ("request_count", "requests"),
                   ("error_request_count", "errors"))


def default_aiperf() -> str:
    local = ROOT / ".venv-aiperf" / "bin" / "aiperf"
    return str(local) if local.exists() else (shutil.which("aiperf") or "aiperf")


def triton_template(ignore_eos: bool = True) -> str:
    return TRITON_TEMPLATE.replace("IGNORE_EOS", "true" if ignore_eos else "false")


def _common(aiperf: str, url: str, model: str, tokenizer: str | Path, artifact_dir: str | Path, *,
            concurrency: int, request_count: int, isl: int, osl: int, seed: int) -> list[str]:
    return [aiperf, "profile", "--model", model, "--url", url, "--concurrency", str(concurrency),
            "--request-count", str(request_count), "--isl", str(isl), "--osl", str(osl),
            "--tokenizer", str(tokenizer), "--random-seed", str(seed), "--ui", "none",
            "--artifact-dir", str(artifact_dir)]


def openai_command(aiperf: str, url: str, model: str, tokenizer: str | Path, artifact_dir: str | Path, *,
                   concurrency: int = 8, request_count: int = 32, isl: int = 200, osl: int = 24, seed: int = 0,
                   ignore_eos: bool = True) -> list[str]:
    """aiperf against an OpenAI endpoint (base URL without /v1), streaming chat."""
    cmd = _common(aiperf, url, model, tokenizer, artifact_dir, concurrency=concurrency,
                  request_count=request_count, isl=isl, osl=osl, seed=seed)
    cmd += ["--endpoint-type", "chat", "--streaming"]
    if ignore_eos:
        cmd += ["--extra-inputs", "ignore_eos:true"]
    return cmd


def triton_command(aiperf: str, url: str, tokenizer: str | Path, artifact_dir: str | Path, template_file: str | Path, *,
                   model: str = TRITON_MODEL, concurrency: int = 8, request_count: int = 32, isl: int = 200,
                   osl: int = 24, seed: int = 0) -> list[str]:
    """aiperf against Triton's HTTP generate_stream through the template endpoint."""
    cmd = _common(aiperf, url, model, tokenizer, artifact_dir, concurrency=concurrency,
                  request_count=request_count, isl=isl, osl=osl, seed=seed)
    # resolved: aiperf reads the template only from a path without symlinked components (else it
    # takes the path itself for an inline template)
    extra = json.dumps({"payload_template": str(Path(template_file).resolve()), "response_field": "text_output"})
    return cmd + ["--endpoint-type", "template", "--custom-endpoint", f"/v2/models/{model}/generate_stream",
                  "--extra-inputs", extra, "--streaming"]


def aiperf_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.pop("HF_HUB_OFFLINE", None)
    return env


def write_tokenizer_dir(engine_dir: str | Path, out_dir: str | Path) -> Path:
    """The engine's tokenizer as a local HF-style dir (what the Dynamo frontend reads too)."""
    from serving.dynamo_worker import make_model_dir
    return make_model_dir(engine_dir, out_dir)


def summarize(artifact_dir: str | Path) -> dict[str, dict]:
    """{metric: {unit, avg, p50, p99}} from aiperf's JSON export under `artifact_dir` (searched)."""
    found = sorted(Path(artifact_dir).rglob(EXPORT), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no {EXPORT} under {artifact_dir}")
    doc = json.loads(found[-1].read_text())
    out = {}
    for key, _ in SUMMARY_METRICS:
        m = doc.get(key)
        if isinstance(m, dict):
            out[key] = {k: m.get(k) for k in ("unit", "avg", "p50", "p99")}
    if "error_request_count" not in out and isinstance(doc.get("error_summary"), list):
        # aiperf exports no error count when nothing failed: count the summary's entries
        n = sum(int(e.get("count", 1)) for e in doc["error_summary"] if isinstance(e, dict))
        out["error_request_count"] = {"unit": "requests", "avg": n, "p50": None, "p99": None}
    return out


def print_summary(rows: dict[str, dict[str, dict]]) -> None:
    names = list(rows)
    print(f"{'metric':<24}" + "".join(f"{n:>26}" for n in names))
    for key, label in SUMMARY_METRICS:
        cells = []
        for n in names:
            m = rows[n].get(key)
            if not m or m.get("avg") is None:
                cells.append(f"{'-':>26}")
                continue
            if m.get("p50") is not None:
                cells.append(f"{m['avg']:>9.1f} (p50 {m['p50']:.1f} p99 {m['p99']:.1f})".rjust(26))
            else:
                cells.append(f"{m['avg']:>26.2f}")
        unit = next((rows[n][key]["unit"] for n in names if rows[n].get(key)), "")
        print(f"{label + (f' [{unit}]' if unit else ''):<24}" + "".join(cells))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=("openai", "triton", "both"), default="both")
    p.add_argument("--url", help="the base URL of the one target (http://host:port)")
    p.add_argument("--openai-url", default="http://127.0.0.1:8100", help="with --target both")
    p.add_argument("--triton-url", default="http://127.0.0.1:8000", help="with --target both (Triton's HTTP port)")
    p.add_argument("--model", default="lookahead_llm", help="the OpenAI model id (the Triton model is lookahead_llm)")
    p.add_argument("--engine", default="engines/default", help="its tokenizer counts tokens")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--request-count", type=int, default=32)
    p.add_argument("--isl", type=int, default=200, help="prompt tokens")
    p.add_argument("--osl", type=int, default=24, help="output tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--artifact-dir", default="results/aiperf", help="one subdir per target")
    p.add_argument("--aiperf", default=None, help="the aiperf executable (default: .venv-aiperf/bin/aiperf, PATH)")
    p.add_argument("--json", help="write the summaries here")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--with-load-test", metavar="GRPC", nargs="?", const="127.0.0.1:8001",
                   help="then run our own load test (scripts/load_test.py) on the same workload against "
                        "each target (Triton over this gRPC address) and print both side by side")
    return p


def our_load_test(args: argparse.Namespace, target: str, url: str) -> dict[str, dict]:
    """scripts/load_test.py's served summary for the aiperf workload, in aiperf's metric names."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "load.json"
        where = ["--openai-url", url] if target == "openai" else ["--url", url]
        subprocess.run([sys.executable, str(ROOT / "scripts" / "load_test.py"), *where, "--engine", args.engine,
                        "--concurrency", str(args.concurrency), "--num-requests", str(args.request_count),
                        "--prompt-len", str(args.isl), "--prompt-len-std", "0", "--max-tokens", str(args.osl),
                        "--seed", str(args.seed), "--no-progress", "--json", str(out)]
                       + ([] if args.ignore_eos else ["--no-ignore-eos"]))   # its exit status: errors, still summarized
        r = json.loads(out.read_text())["results"]["served"]
    pct = lambda d, unit: {"unit": unit, "avg": d.get("mean", d.get("p50")), "p50": d["p50"], "p99": d["p99"]}  # noqa: E731
    return {"time_to_first_token": pct(r["ttft_ms"], "ms"), "inter_token_latency": pct(r["itl_ms"], "ms"),
            "request_latency": {"unit": "ms", "avg": None, "p50": r["e2e_ms"]["p50"], "p99": r["e2e_ms"]["p99"]},
            "output_token_throughput": {"unit": "tokens/sec", "avg": r["output_tokens_per_s"]},
            "request_throughput": {"unit": "requests/sec", "avg": r["requests_per_s"]},
            "request_count": {"unit": "requests", "avg": r["completed"]},
            "error_request_count": {"unit": "requests", "avg": r["errors"]}}


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    aiperf = args.aiperf or default_aiperf()
    art = Path(args.artifact_dir)
    tok = art / "tokenizer"
    kw = dict(concurrency=args.concurrency, request_count=args.request_count, isl=args.isl, osl=args.osl,
              seed=args.seed)
    targets = ["openai", "triton"] if args.target == "both" else [args.target]
    out = {}
    for t in targets:
        url = args.url if args.target != "both" and args.url else \
            (args.openai_url if t == "openai" else args.triton_url)
        if t == "openai":
            out[t] = openai_command(aiperf, url, args.model, tok, art / "openai", ignore_eos=args.ignore_eos, **kw)
        else:
            out[t] = triton_command(aiperf, url, tok, art / "triton", art / "triton_template.json.j2", **kw)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cmds = commands(args)
    art = Path(args.artifact_dir)
    if args.dry_run:
        for name, cmd in cmds.items():
            print(f"# {name}\n{shlex.join(cmd)}")
        if "triton" in cmds:
            print(f"# {art / 'triton_template.json.j2'}:\n{triton_template(args.ignore_eos)}")
        return 0
    exe = cmds[next(iter(cmds))][0]
    if not (Path(exe).exists() or shutil.which(exe)):
        print(f"aiperf_run: error: aiperf not found ({exe}): python3.11 -m venv .venv-aiperf && "
              ".venv-aiperf/bin/pip install aiperf==0.13.0, or pass --aiperf", file=sys.stderr)
        return 2
    art.mkdir(parents=True, exist_ok=True)
    write_tokenizer_dir(args.engine, art / "tokenizer")
    (art / "triton_template.json.j2").write_text(triton_template(args.ignore_eos))
    rows, rc = {}, 0
    for name, cmd in cmds.items():
        print(f"aiperf_run: {name}: {shlex.join(cmd)}", flush=True)
        r = subprocess.run(cmd, env=aiperf_env())
        if r.returncode != 0:
            print(f"aiperf_run: {name}: aiperf exited with {r.returncode}", file=sys.stderr)
            rc = 1
            continue
        rows[name] = summarize(art / name)
    if args.with_load_test:
        for name in list(rows):
            url = args.url if args.target != "both" and args.url else args.openai_url
            rows[f"{name} (ours)"] = our_load_test(args, name, url if name == "openai" else args.with_load_test)
    if rows:
        print_summary(rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
