#!/usr/bin/env python3
"""RULER accuracy: dense vs lookahead (each residency x miss policy) on the same prompts.

    python scripts/eval_accuracy.py --engine engines/default --contexts 2048 4096 --samples 2

Tasks come from RULER's packaged generators (bench/longctx_data.py): single-key, multi-key and
multi-value needles in Paul Graham essays, variable tracking, SQuAD and HotpotQA QA. Every mode
decodes greedily from the same prompt; RULER's scorer (substring match of the expected values)
grades the output. Per-task accuracy and its paired delta vs dense are printed last and written
as JSON.

Resumable: each (sample, mode) result is appended to `--jsonl` as soon as it is done, and a
restart with the same settings skips what is there. Prefill dominates the cost, so all modes of
a sample run back to back, on engines that share one loaded model and its prefill: the first
mode prefills the prompt, the others replay it (runtime/prefill_cache.py), so a record's time_s
and ttft_s include the prefill only for the first mode of its sample.

When K covers every candidate block of a prompt (e.g. 2K context at K=128), lookahead attends
to the whole context and equals dense by construction (the first invariant of docs/ARCHITECTURE.md, a test);
those runs are skipped and reported as trivial unless --run-trivial.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

from runtime.threads import prepare_threads

prepare_threads()  # first: libgomp reads GOMP_SPINCOUNT once, when torch loads it (runtime/threads.py)

from bench import longctx_data as data
from bench.runs import (EngineFactory, add_run_args, append_record, engine_policy, machine_info, mode_overrides,
                        set_threads)

ROOT = Path(__file__).resolve().parents[1]

ALL_MODES = ("dense", "resident:urgent", "resident:drop", "pingpong:urgent", "pingpong:drop")
# Answer lengths: a 7-digit number is ~9 tokens here (digits are single tokens); four of them
# ~40; five 5-letter variable names ~20; QA answers are a few words. Greedy stops at EOS first.
MAX_NEW_TOKENS = {"niah_single": 16, "niah_multikey": 16, "niah_multivalue": 48, "vt": 30,
                  "qa_squad": 24, "qa_hotpot": 24}
STAT_KEYS = ("agreement_mean", "prefetch_hit_rate", "draft_accept_rate", "urgent_blocks", "h2d_bytes")


# ---- engines ----------------------------------------------------------------------------------
def num_candidates(cfg, context_len: int) -> int:
    """Blocks the top-K chooses from at `context_len` tokens (full blocks between sink and window)."""
    from runtime.lookahead.device_tier import SlotLayout
    return SlotLayout.from_config(cfg).num_candidates(context_len)


# ---- one sample, one mode ---------------------------------------------------------------------
def run_one(factory: EngineFactory, sample: data.Sample, mode: str, top_k: int, max_new: int) -> dict:
    from runtime.sampling import SamplingParams
    eng = factory.make(**mode_overrides(mode, top_k))
    try:
        t0 = time.perf_counter()
        out = eng.generate([sample.prompt], SamplingParams(max_tokens=max_new))[0]
        stats = eng.stats()
    finally:
        eng.close()
    return {"output": out.text, "score": data.score(out.text, sample.answers, sample.metric),
            "prompt_tokens": out.num_prompt_tokens, "output_tokens": len(out.token_ids),
            "time_s": round(time.perf_counter() - t0, 2), "ttft_s": round(out.ttft_s, 2),
            "stats": {k: stats.get(k) for k in STAT_KEYS}}


# ---- results file -----------------------------------------------------------------------------
def settings_key(args: argparse.Namespace) -> str:
    """What makes two records comparable: a restart with other settings does not reuse them."""
    s = {"engine": str(Path(args.engine).resolve()), "top_k": args.top_k, "template": args.template,
         "seed": args.seed, "max_new": args.max_new_tokens, "policy": engine_policy(args.engine)}
    return hashlib.sha1(json.dumps(s, sort_keys=True).encode()).hexdigest()[:12]


def record_key(task: str, context: int, index: int, mode: str) -> str:
    return f"{task}|{context}|{index}|{mode}"


def load_records(path: Path, settings: str) -> dict[str, dict]:
    recs: dict[str, dict] = {}
    if not path.is_file():
        return recs
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:       # a line cut by an interruption
            continue
        if r.get("settings") == settings:
            recs[record_key(r["task"], r["context"], r["index"], r["mode"])] = r
    return recs


# ---- summary ----------------------------------------------------------------------------------
def summarize(recs: list[dict], modes: list[str]) -> dict:
    """Per (context, task, mode): n, accuracy, paired delta vs dense; per (context, mode): means."""
    by_cell: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in recs:
        by_cell[(r["context"], r["task"], r["mode"])][r["index"]] = r
    out: dict[str, Any] = {"cells": [], "means": []}
    contexts = sorted({r["context"] for r in recs})
    tasks = list(dict.fromkeys(r["task"] for r in recs))
    for ctx in contexts:
        per_mode: dict[str, list[float]] = defaultdict(list)
        per_mode_delta: dict[str, list[float]] = defaultdict(list)
        for task in tasks:
            dense = by_cell.get((ctx, task, "dense"), {})
            for mode in modes:
                cell = by_cell.get((ctx, task, mode), {})
                run = {i: r for i, r in cell.items() if not r.get("trivial")}
                trivial = len(cell) - len(run)
                if not cell:
                    continue
                row = {"context": ctx, "task": task, "mode": mode, "n": len(run), "n_trivial": trivial,
                       "accuracy": 100 * mean(r["score"] for r in run.values()) if run else None,
                       "candidates": sorted({r["candidates"] for r in cell.values()})}
                paired = [i for i in run if i in dense]
                if mode != "dense" and paired:
                    row["delta_vs_dense"] = 100 * mean(run[i]["score"] - dense[i]["score"] for i in paired)
                    row["n_paired"] = len(paired)
                for k in ("agreement_mean", "prefetch_hit_rate", "draft_accept_rate"):
                    vals = [r["stats"][k] for r in run.values() if r["stats"].get(k) is not None]
                    row[k] = mean(vals) if vals else None
                out["cells"].append(row)
                if row["accuracy"] is not None:
                    per_mode[mode].append(row["accuracy"])
                if "delta_vs_dense" in row:
                    per_mode_delta[mode].append(row["delta_vs_dense"])
        for mode in modes:
            if per_mode.get(mode):
                out["means"].append({"context": ctx, "mode": mode, "accuracy": mean(per_mode[mode]),
                                     "num_tasks": len(per_mode[mode]),
                                     "delta_vs_dense": mean(per_mode_delta[mode]) if per_mode_delta.get(mode) else None,
                                     "worst_task_delta": min(per_mode_delta[mode]) if per_mode_delta.get(mode) else None})
    return out


def format_table(summary: dict, modes: list[str]) -> str:
    """Per context: one row per task, one column per mode: 'accuracy (delta vs dense)'."""
    lines = []
    cells = {(c["context"], c["task"], c["mode"]): c for c in summary["cells"]}
    for ctx in sorted({c["context"] for c in summary["cells"]}):
        tasks = list(dict.fromkeys(c["task"] for c in summary["cells"] if c["context"] == ctx))
        lines.append(f"\ncontext {ctx}: accuracy % (delta vs dense, same samples); "
                     "'=dense' = K covers every block (trivial, not run)")
        widths = [max(18, len(m) + 2) for m in modes]
        lines.append(f"{'task':<16}{'n':>3}  " + "".join(f"{m:>{w}}" for m, w in zip(modes, widths)))
        for task in tasks + ["mean"]:
            vals = []
            n = ""
            for m in modes:
                if task == "mean":
                    mm = next((x for x in summary["means"] if x["context"] == ctx and x["mode"] == m), None)
                    c = {"accuracy": mm["accuracy"], "delta_vs_dense": mm["delta_vs_dense"], "n": 1} if mm else None
                else:
                    c = cells.get((ctx, task, m))
                    if c and m == "dense":
                        n = str(c["n"])
                if c is None:
                    vals.append("-")
                elif c["accuracy"] is None:
                    vals.append("=dense" if c.get("n_trivial") else "-")
                elif m == "dense" or c.get("delta_vs_dense") is None:
                    vals.append(f"{c['accuracy']:.1f}")
                else:
                    vals.append(f"{c['accuracy']:.1f} ({c['delta_vs_dense']:+.1f})")
            lines.append(f"{task:<16}{n:>3}  " + "".join(f"{v:>{w}}" for v, w in zip(vals, widths)))
        stat_rows = [(m, cells) for m in modes if m != "dense"]
        for m, _ in stat_rows:
            agg = [c for (cx, _t, mm), c in cells.items() if cx == ctx and mm == m and c["n"]]
            if not agg:
                continue
            fmt = lambda k: (f"{mean(c[k] for c in agg if c[k] is not None):.3f}"  # noqa: E731
                             if any(c[k] is not None for c in agg) else "-")
            lines.append(f"  {m:<16} agreement {fmt('agreement_mean')}  prefetch hit "
                         f"{fmt('prefetch_hit_rate')}  draft accept {fmt('draft_accept_rate')}")
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", default=str(ROOT / "engines" / "default"), help="engine dir")
    p.add_argument("--tasks", nargs="+", default=list(data.RULER_TASKS), choices=list(data.RULER_TASKS))
    p.add_argument("--contexts", nargs="+", type=int, default=[2048, 4096],
                   help="RULER lengths (prompt + RULER's answer budget), e.g. 2048 4096 8192")
    p.add_argument("--samples", type=int, default=2, help="samples per task and context")
    p.add_argument("--modes", nargs="+", default=list(ALL_MODES),
                   help="dense and/or RESIDENCY:MISS_POLICY (resident|pingpong : urgent|drop), optionally "
                        "with config fields: resident:drop@group_score=max,top_k=64")
    p.add_argument("--top-k", type=int, default=128, help="lookahead blocks per layer and KV head")
    p.add_argument("--template", choices=("chat", "base"), default="chat",
                   help="chat: the engine's chat template around RULER's task, the answer prefix "
                        "opening the assistant turn; base: RULER's plain template")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="override the per-task answer budget " + json.dumps(MAX_NEW_TOKENS))
    p.add_argument("--run-trivial", action="store_true",
                   help="also run lookahead where K covers every block (equal to dense by construction)")
    add_run_args(p, "accuracy", "per-sample", "summarize what --jsonl holds for these settings")
    args = p.parse_args(argv)
    if "dense" not in args.modes:
        args.modes = ["dense"] + args.modes     # deltas are paired against dense
    bad = [m for m in args.modes if m.partition("@")[0] != "dense" and m.partition("@")[0].partition(":")[0::2] not in
           {(r, x) for r in ("resident", "pingpong") for x in ("urgent", "drop")}]
    if bad:
        p.error(f"unknown mode {bad[0]!r}: use dense or RESIDENCY:MISS_POLICY, e.g. resident:urgent")
    from runtime.config import LookaheadConfig
    for m in args.modes:
        try:
            LookaheadConfig().replace(**mode_overrides(m, args.top_k))
        except ValueError as e:             # ConfigError names the field and the fix
            p.error(f"mode {m!r}: {e}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    set_threads(args.threads)
    if not data.ruler_available() and not args.report_only:
        sys.exit(f"RULER's generators are missing: {data.RULER_PIP}")
    settings = settings_key(args)
    jsonl, out_json = Path(args.jsonl), Path(args.json)
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    done = load_records(jsonl, settings)
    if not args.report_only:
        run_missing(args, settings, jsonl, done)
    recs = [r for k, r in done.items() if k.split("|")[0] in args.tasks and k.split("|")[3] in args.modes
            and r["context"] in args.contexts and r["index"] < args.samples]
    summary = summarize(recs, args.modes)
    result = {"settings": {**{k: v for k, v in vars(args).items() if k not in ("jsonl", "json")},
                           "key": settings},
              "machine": machine_info(), "summary": summary, "records": recs}
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1))
    print(format_table(summary, args.modes))
    print(f"\nper-sample results: {jsonl}  summary: {out_json}")
    return result


def run_missing(args: argparse.Namespace, settings: str, jsonl: Path, done: dict[str, dict]) -> None:
    """Run every (sample, mode) of the settings that `done` lacks, appending each to `jsonl`."""
    from tqdm import tqdm
    factory = EngineFactory(args.engine, max(args.contexts) + 64)
    wrap = factory.tokenizer.apply_chat_template if args.template == "chat" else None
    total = len(args.tasks) * len(args.contexts) * args.samples * len(args.modes)
    bar = tqdm(total=total, desc="accuracy", unit="run", dynamic_ncols=True)
    bar.update(sum(1 for k in done if k.split("|")[0] in args.tasks and k.split("|")[3] in args.modes
                   and int(k.split("|")[1]) in args.contexts and int(k.split("|")[2]) < args.samples))
    for ctx in args.contexts:
        for task in args.tasks:
            keys = [record_key(task, ctx, i, m) for i in range(args.samples) for m in args.modes]
            if all(k in done for k in keys):
                continue
            bar.set_postfix_str(f"{task}@{ctx}: generating prompts")
            samples = data.ruler_samples(task, ctx, args.samples, factory.count_tokens, wrap, args.seed)
            max_new = args.max_new_tokens or MAX_NEW_TOKENS[task]
            for s in samples:
                sha = hashlib.sha1(s.prompt.encode()).hexdigest()[:12]
                n_prompt = factory.count_tokens(s.prompt)
                for mode in args.modes:
                    key = record_key(task, ctx, s.index, mode)
                    if key in done:
                        if done[key]["prompt_sha"] != sha:
                            tqdm.write(f"warning: {key}: the prompt changed since it was recorded")
                        continue
                    cfg = factory.base.manifest.lookahead.replace(**mode_overrides(mode, args.top_k))
                    cand = num_candidates(cfg, n_prompt + max_new)
                    rec = {"settings": settings, "task": task, "context": ctx, "index": s.index,
                           "mode": mode, "prompt_sha": sha, "answers": s.answers, "metric": s.metric,
                           "candidates": cand, "top_k": cfg.top_k}
                    if cfg.mode != "dense" and cfg.top_k >= cand and not args.run_trivial:
                        rec.update(trivial=True, prompt_tokens=n_prompt)
                    else:
                        bar.set_postfix_str(f"{task}@{ctx} #{s.index} {mode}")
                        rec.update(trivial=False, **run_one(factory, s, mode, args.top_k, max_new))
                    append_record(jsonl, rec)
                    done[key] = rec
                    bar.update(1)
    bar.close()


if __name__ == "__main__":
    main()
