#!/usr/bin/env python3
"""Cold prefill side by side: how long the first token of a long prompt takes, ours against peers,
with the FLOP count and the share of the machine's measured dot-product rate each one reaches.

    python -m bench.prefill [--engines engines/default,engines/int8] [--contexts 2048,4096,8192]
                             [--modes dense,lookahead] [--precisions auto,float32]
                             [--peers transformers,llama.cpp,vllm] [--llama-configs F32/f32,Q8_0/f16,Q4_1/f16]
                             [--vllm-python PATH] [--threads 2] [--repeats 1]
                             [--json results/bench_prefill.json] [--plot results/bench_prefill.png] [--dry-run]

Per context (prompt = context - 1 tokens, random ids, the same ids for ours and transformers):
* **ours**: each engine x prefill precision x mode, one engine load per engine (siblings share its
  weights), prefix caching off, one request, `max_tokens=1`: the request's TTFT (in-process).
  Every configuration is warmed up first on a short prompt (the kernels' weight copies are made).
* **transformers**: the fp32 model the engine was built from, one forward over the prompt
  (`logits_to_keep=1`, no KV cache kept).
* **llama.cpp** (b11434, built once by `python -m bench.llama_cpp build`): `llama-batched-bench`
  prompt processing time (its T_PP) at the same depth, batch 1, per `--llama-configs` (weights /
  KV type, made with llama-quantize from the GGUF the first engine was built from, else the default
  model's; flash attention off and on), its fastest one marked "best".
* **vLLM CPU** where installed (`--vllm-python`: a python that imports vllm): `LLM.generate` of the
  same token ids, `max_tokens=1`, prefix caching off, bf16, after a short warm-up, in its own
  process; elsewhere the row says it was not run.
Configurations interleave within a context (ours, then the peers); `--repeats N` runs the whole
grid N times, alternating the order, and keeps each row's best.

FLOPs per prompt of T tokens: the projections 2 T P (P: the layers' projection parameters; the LM
head's one row is negligible) and causal attention 4 T (T + 1) / 2 H D per layer (QK and PV). The
machine's rates are measured in the same run on the model's own GEMM shape (512 rows): fp32
`F.linear`, bf16 (our `linear_bf16`, else torch's bf16 `F.linear`) and int8 (`torch._int_mm`);
"of rate" is a row's FLOP/s over the rate of the units its precision uses.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from runtime.threads import prepare_threads

if __name__ == "__main__":  # the benchmark's process: before torch (libgomp reads its spin setting once)
    prepare_threads()

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

from bench import llama_cpp  # noqa: E402
from bench.floor import best_of  # noqa: E402
from bench.prefix_serve import VLLM_BIND_HELP  # noqa: E402
from bench.runs import cpu_model, machine_info  # noqa: E402
from bench.speed import reference_hf_dir  # noqa: E402
from runtime.config import ModelConfig  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.errors import LookaheadError  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402

PEERS = ("transformers", "llama.cpp", "vllm")
WARM_TOKENS = 256
RATE_SHAPE = (512, 576, 1536)       # rows x inputs x outputs: the default model's gate-up shape


# ---- FLOPs and rates -------------------------------------------------------------------------------
def prefill_flops(m: ModelConfig, tokens: int) -> dict[str, float]:
    """FLOPs of one cold prefill of `tokens`: projections and causal attention (QK and PV)."""
    h, q, kv, inter = m.hidden_size, m.q_size, m.kv_size, m.intermediate_size
    params = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h
    gemm = 2.0 * tokens * params * m.num_layers
    attn = 4.0 * tokens * (tokens + 1) / 2 * m.num_heads * m.head_dim * m.num_layers
    return {"gemm": gemm, "attention": attn, "total": gemm + attn}


def machine_rates(shape: tuple[int, int, int] = RATE_SHAPE) -> dict[str, float]:
    """GFLOP/s (GOP/s for int8) of this machine's units on one prefill GEMM shape, this run."""
    import torch.nn.functional as F

    from plugins.cpu import prefill
    M, K, N = shape
    x, w = torch.randn(M, K), torch.randn(N, K) / K ** 0.5
    flops = 2.0 * M * K * N
    rates = {"float32": flops / best_of(lambda: F.linear(x, w), 5) / 1e9}
    xb, wb = x.bfloat16(), w.bfloat16()
    bf16 = flops / best_of(lambda: F.linear(xb, wb), 5) / 1e9
    if prefill.bf16_dot_products():
        bf16 = max(bf16, flops / best_of(lambda: prefill.linear_bf16(x, w), 5) / 1e9)
    rates["bfloat16"] = bf16
    xi, wi = torch.randint(-127, 128, (M, K), dtype=torch.int8), torch.randint(-127, 128, (K, N), dtype=torch.int8)
    try:
        rates["int8"] = flops / best_of(lambda: torch._int_mm(xi, wi), 5) / 1e9
    except RuntimeError:
        rates["int8"] = float("nan")
    return {k: round(v, 1) for k, v in rates.items()}


# ---- ours ------------------------------------------------------------------------------------------
def precisions_of(engine: Engine, asked: list[str]) -> list[str]:
    """The distinct resolved precisions among `asked` that this engine takes ('all': every one)."""
    from runtime.engine import DTYPES
    from runtime.ops import resolve_prefill
    q = engine.manifest.quantization
    names = ["float32", "bfloat16", "int8", "auto"] if asked == ["all"] else asked
    out = []
    for name in names:
        try:
            p = resolve_prefill(name, engine.device, DTYPES[engine.manifest.dtype], q is not None)
        except LookaheadError:
            continue
        out.append(p)
    return list(dict.fromkeys(out))


def mode_fields(mode: str) -> tuple[str, dict]:
    """'MODE[@FIELD=VALUE[+FIELD=VALUE...]]' -> (MODE, settings), e.g.
    'lookahead@prefill_top_k=128+prefill_window=1024' (block-sparse prefill)."""
    name, _, extra = mode.partition("@")
    fields = {}
    for item in filter(None, extra.split("+")):
        key, _, value = item.partition("=")
        fields[key] = int(value) if value.lstrip("-").isdigit() else value
    return name, fields


def ours_configs(args) -> list[dict]:
    return [{"engine": e, "precision": p, "mode": m} for e in args.engines for p in args.precisions for m in args.modes]


def time_ours(engine: Engine, ids: list[int]) -> float:
    out = engine.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    return out.ttft_s


# ---- transformers ----------------------------------------------------------------------------------
def time_transformers(model, ids: list[int]) -> float:
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t0


# ---- vLLM (its own process) ------------------------------------------------------------------------
VLLM_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    a = json.loads(sys.stdin.read())
    llm = LLM(model=a["model"], dtype=a["dtype"], max_model_len=a["max_model_len"], enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=a["warm"])], sp, use_tqdm=False)
    out = {}
    for ids in a["prompts"]:
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
        out[str(len(ids))] = time.perf_counter() - t0
    print("VLLM_RESULT " + json.dumps(out), flush=True)
""")


def vllm_command(python: str, hf_dir: Path, prompts: list[list[int]], warm: list[int], max_model_len: int,
                 dtype: str = "bfloat16") -> tuple[list[str], str]:
    """(argv, stdin): the prompts go on stdin; as an argument a 30K-token prompt's ids passed the
    kernel's 128 KiB limit on one argument (E2BIG)."""
    arg = json.dumps({"model": str(hf_dir), "dtype": dtype, "max_model_len": max_model_len, "prompts": prompts,
                      "warm": warm})
    return [python, "-c", VLLM_SCRIPT], arg


def run_vllm(python: str | None, hf_dir: Path, prompts: list[list[int]], warm: list[int], max_model_len: int,
             timeout: float, threads: int, bind: str = "nobind") -> dict[int, float] | str:
    """{prompt tokens: seconds}, or why vLLM did not run."""
    if not python:
        return "not installed here (pass --vllm-python: a python whose environment has vllm CPU)"
    from bench.prefix_serve import vllm_env
    env = vllm_env(threads, 6, bind)
    try:
        argv, stdin = vllm_command(python, hf_dir, prompts, warm, max_model_len)
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"did not run ({e})"
    for line in done.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return {int(k): v for k, v in json.loads(line[len("VLLM_RESULT "):]).items()}
    tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
    return f"failed (exit {done.returncode}: {tail[:200]})"


# ---- the run ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="engines/default,engines/int8", help="engine dirs, comma-separated")
    p.add_argument("--contexts", default="2048,4096,8192", help="context lengths; the prompt is one token less")
    p.add_argument("--modes", default="dense,lookahead",
                   help="dense,lookahead,sparse, each optionally with settings, MODE@FIELD=VALUE[+FIELD=VALUE]: "
                        "lookahead@prefill_top_k=128+prefill_window=1024 is block-sparse prefill")
    p.add_argument("--precisions", default="auto,float32",
                   help="prefill precisions, comma-separated (auto, float32, bfloat16, int8) or 'all'; each "
                        "engine runs the distinct ones it takes")
    p.add_argument("--peers", default="transformers,llama.cpp,vllm", help=f"comma-separated, of {', '.join(PEERS)}")
    p.add_argument("--llama-configs", default="F32/f32,Q8_0/f16,Q4_1/f16", metavar="W/KV,...",
                   help="llama.cpp weights/KV types (each with flash attention off and on)")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="a python with vllm (CPU) installed")
    p.add_argument("--vllm-bind", default="nobind",
                   help=VLLM_BIND_HELP)
    p.add_argument("--threads", type=int, default=2, help="torch threads (and llama.cpp's -t/-tb)")
    p.add_argument("--repeats", type=int, default=1, help="grid repeats (order alternates); each row keeps its best")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(ROOT / "results" / "bench_prefill.json"))
    p.add_argument("--plot", default=str(ROOT / "results" / "bench_prefill.png"))
    p.add_argument("--dry-run", action="store_true", help="print the plan and the FLOP counts, run nothing")
    a = p.parse_args(argv)
    a.engines = [e for e in a.engines.split(",") if e]
    a.contexts = [int(c) for c in a.contexts.split(",") if c]
    a.modes = [m for m in a.modes.split(",") if m]
    a.precisions = [x for x in a.precisions.split(",") if x]
    a.peers = [x for x in a.peers.split(",") if x]
    bad = [x for x in a.peers if x not in PEERS]
    if bad:
        p.error(f"--peers: unknown {bad}; use {', '.join(PEERS)}")
    if any(c < 2 for c in a.contexts):
        p.error("--contexts: each at least 2")
    return a


def prompt_ids(vocab: int, tokens: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(100, vocab - 1), vocab, (tokens,), generator=g).tolist()


def row(impl: str, ctx: int, tokens: int, seconds: float | None, flops: dict, rate: float | None, **kw) -> dict:
    r = {"impl": impl, "context": ctx, "prompt_tokens": tokens, "ttft_s": seconds, **kw,
         "tflop": round(flops["total"] / 1e12, 3)}
    if seconds:
        r["gflops"] = round(flops["total"] / seconds / 1e9, 1)
        r["of_rate"] = round(r["gflops"] / rate, 3) if rate else None
    return r


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    from runtime.engine_dir import load_manifest
    mcfg = load_manifest(a.engines[0], verify_checksums=False).model
    plan = [(ctx, ctx - 1, prefill_flops(mcfg, ctx - 1)) for ctx in a.contexts]
    print(f"cold prefill, {a.threads} threads; engines {', '.join(a.engines)}; modes {', '.join(a.modes)}; "
          f"precisions {', '.join(a.precisions)}; peers {', '.join(a.peers) or 'none'}")
    cpu = cpu_model()
    print(f"  CPU: {cpu.get('cpu_model')}, dot products: {', '.join(cpu.get('cpu_dot_products') or ['none'])}")
    for ctx, n, f in plan:
        print(f"  context {ctx}: {n} prompt tokens, {f['total'] / 1e12:.2f} TFLOP "
              f"(projections {f['gemm'] / 1e12:.2f}, attention {f['attention'] / 1e12:.2f})")
    if a.dry_run:
        for c in ours_configs(a):
            print(f"  ours: {c['engine']} {c['mode']} prefill_precision={c['precision']}")
        if "llama.cpp" in a.peers:
            for cfg in llama_cpp.parse_configs(a.llama_configs):
                print("  llama.cpp:", " ".join(llama_cpp.batched_bench_command(
                    llama_cpp.binary("llama-batched-bench"), Path("MODEL.gguf"), cfg, a.contexts, [1], 1, a.threads)))
        if "vllm" in a.peers:
            print("  vllm:", f"{a.vllm_python}, threads bound by {a.vllm_bind}" if a.vllm_python
                  else "not installed here (--vllm-python)")
        return 0

    rates = machine_rates()
    print("machine rates (GFLOP/s, this run): " + ", ".join(f"{k} {v}" for k, v in rates.items()), flush=True)
    t_start, load0 = time.time(), os.getloadavg()
    # our engines: one load each, siblings per precision and mode, warmed on a short prompt
    ours = []
    for path in a.engines:
        base = Engine.from_dir(path, prefix_caching=False, max_batch_size=1)
        for p in precisions_of(base, a.precisions):
            for mode in a.modes:
                name, fields = mode_fields(mode)
                try:
                    eng = base.sibling(mode=name, prefill_precision=p, **fields)
                except LookaheadError as e:
                    print(f"  {path} {mode} {p}: {e}")
                    continue
                eng.generate([prompt_ids(mcfg.vocab_size, WARM_TOKENS, 99)], SamplingParams(max_tokens=1))
                ours.append((f"ours {Path(path).name} {mode} {eng.config.prefill_precision}", eng,
                             {"engine": str(path), "mode": mode, "precision": eng.config.prefill_precision}))
    hf = None
    if "transformers" in a.peers:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(reference_hf_dir(a.engines[0]), dtype=torch.float32).eval()
        time_transformers(hf, prompt_ids(mcfg.vocab_size, WARM_TOKENS, 99))
    best: dict[tuple, dict] = {}

    def keep(r: dict) -> None:
        key = (r["impl"], r["context"])
        if r.get("ttft_s") is not None and (key not in best or r["ttft_s"] < best[key]["ttft_s"]):
            best[key] = r
        elif key not in best:
            best[key] = r

    unit_rate = {"float32": rates["float32"], "bfloat16": rates["bfloat16"], "int8": rates["int8"]}
    for rep in range(a.repeats):
        for ctx, n, f in plan:
            ids = prompt_ids(mcfg.vocab_size, n, a.seed + ctx)
            order = ours if rep % 2 == 0 else list(reversed(ours))
            for name, eng, meta in order:
                if n >= eng.max_model_len:
                    keep(row(name, ctx, n, None, f, None, error=f"past max_model_len {eng.max_model_len}", **meta))
                    continue
                s = time_ours(eng, ids)
                if eng.config.mode == "lookahead" and eng.config.prefill_top_k:
                    # block-sparse: it skips attention the dense count holds, so no FLOP rate is claimed
                    keep(row(name, ctx, n, s, f, None, sparse_prefill=True, **meta) | {"gflops": None})
                else:
                    keep(row(name, ctx, n, s, f, unit_rate[meta["precision"]], **meta))
                print(f"  context {ctx}: {name}: {s:.2f} s", flush=True)
            if hf is not None:
                s = time_transformers(hf, ids)
                keep(row("transformers fp32", ctx, n, s, f, rates["float32"], precision="float32"))
                print(f"  context {ctx}: transformers fp32: {s:.2f} s", flush=True)
    rows = list(best.values())
    if "llama.cpp" in a.peers:
        rows += llama_rows(a, plan, rates)
    if "vllm" in a.peers:
        rows += vllm_rows(a, plan, rates, mcfg.vocab_size)
    for ctx, _, _ in plan:
        ref = next((r["ttft_s"] for r in rows if r["context"] == ctx and r["impl"] == "transformers fp32"
                    and r.get("ttft_s")), None)
        llama = [r for r in rows if r["context"] == ctx and r["impl"].startswith("llama.cpp") and r.get("ttft_s")]
        fastest = min(llama, key=lambda r: r["ttft_s"]) if llama else None
        if fastest:
            fastest["best"] = True
        for r in rows:
            if r["context"] == ctx and r.get("ttft_s"):
                r["vs_transformers"] = round(r["ttft_s"] / ref, 3) if ref else None
                r["llama_best_over_this"] = round(fastest["ttft_s"] / r["ttft_s"], 2) if fastest else None
    report = {"machine": machine_info(), "threads": a.threads, "rates_gflops": rates,
              "load_avg_start": load0, "load_avg_end": os.getloadavg(), "started": t_start,
              "flops": {str(ctx): f for ctx, _, f in plan}, "rows": rows}
    print_table(rows)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {a.json}")
    if a.plot:
        plot(rows, a.plot)
    return 0


def llama_rows(a, plan, rates) -> list[dict]:
    configs = llama_cpp.parse_configs(a.llama_configs)
    source = llama_cpp.engine_gguf(a.engines[0])        # the GGUF the engine was built from, else the default's
    rows = []
    for flash in ("off", "on"):
        got = llama_cpp.run_peer(configs, [ctx for ctx, _, _ in plan], [1], 1, a.threads, source=source,
                                 flash=flash)
        for r, (ctx, n, f) in ((r, next(p for p in plan if p[0] == r["context"])) for r in got):
            cfg = r["impl"].removeprefix("llama.cpp ")
            name = f"llama.cpp {cfg} fa {flash}"
            if "error" in r:
                rows.append(row(name, ctx, n, None, f, None, error=r["error"]))
                continue
            unit = "int8" if r["weights"].startswith("Q") else "float32"
            rows.append(row(name, ctx, r["prompt_tokens"], r["prefill_s"], f, rates[unit], precision=r["weights"]))
            print(f"  context {ctx}: {name}: {r['prefill_s']:.2f} s", flush=True)
    return rows


def vllm_rows(a, plan, rates, vocab: int) -> list[dict]:
    prompts = [prompt_ids(vocab, n, a.seed + ctx) for ctx, n, _ in plan]
    got = run_vllm(a.vllm_python, reference_hf_dir(a.engines[0]), prompts, prompt_ids(vocab, WARM_TOKENS, 99),
                   max(a.contexts), 3600, a.threads, a.vllm_bind)
    rows = []
    for ctx, n, f in plan:
        if isinstance(got, str):
            rows.append(row("vLLM CPU bf16", ctx, n, None, f, None, error=got))
        else:
            rows.append(row("vLLM CPU bf16", ctx, n, got.get(n), f, rates["bfloat16"], precision="bfloat16"))
    if isinstance(got, str):
        print(f"  vLLM: {got}")
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'context':>7}  {'implementation':<44} {'TTFT s':>8} {'GFLOP/s':>8} {'of rate':>8} "
          f"{'/ transformers':>14} {'llama.cpp best / this':>22}")
    for r in sorted(rows, key=lambda r: (r["context"], r.get("ttft_s") or float("inf"))):
        if not r.get("ttft_s"):
            print(f"{r['context']:>7}  {r['impl']:<44} {'-':>8}  {r.get('error', '')}")
            continue
        print(f"{r['context']:>7}  {r['impl'] + (' (best)' if r.get('best') else ''):<44} {r['ttft_s']:>8.2f} "
              f"{_gflops(r.get('gflops')):>8} {_pct(r.get('of_rate')):>8} {_num(r.get('vs_transformers')):>14} "
              f"{_num(r.get('llama_best_over_this')):>22}")
    print("of rate: the row's FLOP/s over this machine's measured rate for the units its precision uses "
          "(fp32, bf16, int8 GEMMs on one prefill shape); none for a block-sparse prefill, which skips part of the "
          "attention the count holds")


def _gflops(v):
    return "-" if v is None else f"{v:.0f}"


def _pct(v):
    return "-" if v is None else f"{v:.0%}"


def _num(v):
    return "-" if v is None else f"{v:.2f}x"


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    done = [r for r in rows if r.get("ttft_s")]
    impls = list(dict.fromkeys(r["impl"] for r in sorted(done, key=lambda r: r["ttft_s"])))
    ctxs = sorted({r["context"] for r in done})
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(impls) * len(ctxs) / 2 + 3))
    h = 0.8 / max(1, len(ctxs))
    for j, ctx in enumerate(ctxs):
        vals = {r["impl"]: r["ttft_s"] for r in done if r["context"] == ctx}
        ys = [i + j * h for i in range(len(impls))]
        ax.barh(ys, [vals.get(i, 0) for i in impls], h, label=f"{ctx} tokens")
    ax.set_yticks([i + h * (len(ctxs) - 1) / 2 for i in range(len(impls))], impls, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("cold prefill (TTFT), s, log scale")
    ax.set_title("First token of a long prompt, same CPU, same threads")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
