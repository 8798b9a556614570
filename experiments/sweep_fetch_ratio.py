#!/usr/bin/env python3
"""Prefetch hit rate and on-demand fetches against `fetch_ratio` (capped eviction), on one prompt.

    python experiments/sweep_fetch_ratio.py --context 8192 --ratios 0.05 0.1 0.15 0.2 0.25 --json results/fetch_ratio_8k.json

One RULER single-needle prompt of `--context` tokens is prefilled once; every (miss policy,
fetch ratio) pair decodes `--tokens` greedy tokens from a replay of that prefill
(runtime/prefill_cache.py), K = `--top-k`, `resident`, the model's own draft. Per pair: the
prefetch hit rate (blocks of the real query's top-K resident before any urgent fetch), agreement,
draft accept rate, and urgent / prefetched blocks and H2D bytes per decode step. Prints a table
and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from bench import longctx_data as data
from bench.runs import EngineFactory, set_threads

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default=str(ROOT / "engines" / "default"))
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.1, 0.15, 0.2, 0.25])
    p.add_argument("--miss-policies", nargs="+", default=["urgent", "drop"], choices=["urgent", "drop"])
    p.add_argument("--top-k", type=int, default=128)
    p.add_argument("--tokens", type=int, default=25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=str(ROOT / "results" / "fetch_ratio.json"))
    args = p.parse_args(argv)
    from runtime.sampling import SamplingParams
    set_threads(args.threads)
    factory = EngineFactory(args.engine, args.context + args.tokens + 64)
    prompt = data.ruler_samples("niah_single", args.context, 1, factory.count_tokens,
                                factory.tokenizer.apply_chat_template, 0)[0].prompt
    ids = factory.tokenizer.encode(prompt)
    prefill_steps = math.ceil(len(ids) / factory.base.config.prefill_chunk)
    rows = []
    print(f"{'miss':<7}{'fetch_ratio':>12}{'cap':>5}{'hit':>8}{'agree':>8}{'accept':>8}"
          f"{'urgent/step':>13}{'prefetched/step':>17}{'H2D MiB/step':>14}")
    for miss in args.miss_policies:
        for ratio in args.ratios:
            eng = factory.make(mode="lookahead", residency="resident", miss_policy=miss, top_k=args.top_k,
                               fetch_ratio=ratio)
            t0 = time.perf_counter()
            eng.generate([ids], SamplingParams(max_tokens=args.tokens, ignore_eos=True))
            st = eng.stats()
            eng.close()
            steps = st["steps"] - prefill_steps                  # decode steps only
            row = {"miss_policy": miss, "fetch_ratio": ratio, "fetch_cap": eng.config.prediction_cap,
                   "prefetch_hit_rate": st["prefetch_hit_rate"], "agreement_mean": st["agreement_mean"],
                   "draft_accept_rate": st["draft_accept_rate"], "decode_steps": steps,
                   "urgent_blocks_per_step": st["urgent_blocks"] / steps,
                   "prefetched_blocks_per_step": st["prefetched_blocks"] / steps,
                   "h2d_bytes_per_step": st["h2d_bytes"] / steps, "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            print(f"{miss:<7}{ratio:>12.2f}{row['fetch_cap']:>5}{row['prefetch_hit_rate']:>8.3f}"
                  f"{row['agreement_mean']:>8.3f}{row['draft_accept_rate']:>8.3f}{row['urgent_blocks_per_step']:>13.0f}"
                  f"{row['prefetched_blocks_per_step']:>17.0f}{row['h2d_bytes_per_step'] / 2**20:>14.1f}", flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "prompt_tokens": len(ids), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
