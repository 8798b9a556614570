#!/usr/bin/env python3
"""The reviewers' test: per-layer agreement of the draft-predicted top-K with the real next top-K.

    python scripts/profile_agreement.py --engine engines/default --contexts 2048 4096 8192

At decode step s, layer l, the draft query (token d at p+1) scores every candidate block's
min/max key summary; its top-K is the set prefetched for step s+1. At step s+1 the real query
scores the same candidates; agreement = |predicted ∩ true| / |true|, averaged over KV heads and
steps (exactly `LookaheadMetrics.record_step`, which this script cross-checks at the run's K).
One run gives every K of the sweep: the scores are tapped (the runtime's `on_scores` observation
hook, runtime/observe.py) and re-ranked at each K.

Drafts: `dual_token` (the runtime's default, model-generated), `oracle` (the true next token:
the dual_token run's own continuation replayed; under `urgent` the output does not depend on the
draft, so it is exact) and `random` (uniform tokens).

Trajectories: `production` runs at K=128 under `urgent` (exact sparse attention, the draft row
sees the same bounded working set as in deployment); `full` runs with K >= every block, so the
hidden states are dense attention's (the reviewers' "true next-token query under full attention";
there the oracle's agreement is 1 by construction, a check of the measurement).

Agreement is only informative when the candidate blocks outnumber K: every number is printed with
its candidate count, and points with K >= candidates are flagged trivial (agreement is 1).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from collections import defaultdict
from pathlib import Path
from statistics import mean

from runtime.threads import prepare_threads

prepare_threads()  # first: libgomp reads GOMP_SPINCOUNT once, when torch loads it (runtime/threads.py)

import torch

from bench import longctx_data as data
from bench.runs import (EngineFactory, add_run_args, append_record, engine_policy, machine_info, set_threads,
                        typed_value)
from runtime.draft import DraftSource, DualTokenDraft, RandomDraft
from runtime.observe import Observer

ROOT = Path(__file__).resolve().parents[1]

SWEEP = (16, 32, 64, 128, 256)
DRAFTS = ("dual_token", "oracle", "random", "context_seed")   # context_seed: the chain before pre-decoding
SOURCES = ("ruler", "essay", "multiturn")
PRODUCTION_K = 128
RUN_FIELDS = ("mode", "residency", "miss_policy", "top_k", "resync_after")    # each run sets these itself


# ---- drafts -----------------------------------------------------------------------------------
class LoggingDraft(DraftSource):
    """Wraps a draft source and remembers every proposal as (context length, token)."""

    def __init__(self, inner: DraftSource):
        self.inner, self.log = inner, []

    def propose(self, context: list[int], model_guess: int | None) -> int:
        tok = self.inner.propose(context, model_guess)
        self.log.append((len(context), tok))
        return tok


class OracleDraft(DraftSource):
    """The true next token, replayed from a reference run of the same prompt and settings."""

    def __init__(self, prompt_len: int, continuation: list[int]):
        self.prompt_len, self.continuation = prompt_len, continuation

    def propose(self, context: list[int], model_guess: int | None) -> int:
        k = len(context) - self.prompt_len           # index of the token after `context`
        return self.continuation[k] if k < len(self.continuation) else context[-1]


def make_draft(kind: str, vocab_size: int, prompt_len: int, continuation: list[int] | None,
               seed: int) -> DraftSource:
    if kind == "dual_token":
        return DualTokenDraft()
    if kind == "oracle":
        return OracleDraft(prompt_len, continuation or [])
    if kind == "random":
        return RandomDraft(vocab_size, seed=seed)
    if kind == "context_seed":          # run with resync_after 0: the old chain, exactly
        from bench.speed import ContextSeedDraft
        return ContextSeedDraft()
    raise ValueError(f"draft {kind!r} is unknown; known: {', '.join(DRAFTS)}")


# ---- the measurement --------------------------------------------------------------------------
def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [KVH, NB] (-inf = not a candidate) -> bool [KVH, NB]: the top-k candidates per head,
    ties to the lower block id (as plugins.block_topk)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    n_valid = int(torch.isfinite(scores[0]).sum())
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask.scatter_(-1, order[:, : min(k, n_valid)], True)
    return mask


MARGINS = (8, 32)          # extra predicted blocks: does over-fetching by a few recover the boundary's flips?
EXTRAS = ("reuse", *(f"margin{m}" for m in MARGINS), "mass_true", "mass_pred", "mass_missed", "mass_missed_reuse")


def block_mass(q: torch.Tensor, k: torch.Tensor, scale: float, block_size: int, nb: int) -> torch.Tensor:
    """The exact attention mass per logical block: q [H, D] over keys k [KVH, n, D] (the context before this
    step's own row) -> [KVH, nb], each query head's softmax summed per block, averaged over its GQA group."""
    kvh, n, _ = k.shape
    h = q.shape[0]
    logits = torch.einsum("gjd,gnd->gjn", q.float().view(kvh, h // kvh, -1), k.float()) * scale
    probs = logits.softmax(-1).mean(1)                                           # [KVH, n]
    pad = nb * block_size - n
    if pad < 0:
        probs = probs[:, :nb * block_size]
    else:
        probs = torch.nn.functional.pad(probs, (0, pad))
    return probs.view(kvh, nb, block_size).sum(-1)


class ScoreTap(Observer):
    """Sees every block score the lookahead backend computes for the run's one lane (the
    engine's `on_scores` hook, runtime/observe.py) and turns each pair (prediction made at step
    s, real query at step s+1) into agreement at every K of a sweep.

    Beside it, per K (`extras`, EXTRAS): `reuse`, the agreement of the baseline that reuses the current real
    query's top-K as the next step's prediction; `margin<m>`, the share of the true top-K inside the draft's
    top-(K + m); and, with `pool` (the host KV pool) given, the real query's exact attention mass on the true
    top-K (`mass_true`), on the predicted top-K (`mass_pred`), and on the true blocks the prediction missed
    (`mass_missed`; `mass_missed_reuse` for the reuse baseline)."""

    def __init__(self, ks: tuple[int, ...], pool=None, scale: float = 1.0):
        self.ks = ks
        self.pool, self.scale = pool, scale
        self.pending: dict[int, torch.Tensor] = {}     # layer -> prediction scores [KVH, NB]
        self.prev_real: dict[int, torch.Tensor] = {}   # layer -> the last real query's scores
        self.steps: list[dict[int, list[float]]] = []  # per decode step: layer -> agreement per K
        self.extras: list[dict[int, dict[str, list[float]]]] = []   # per decode step: layer -> name -> per K
        self.candidates: list[int] = []                # per decode step
        self.table: list[int] = []
        self.context_len = 0
        self.mass: torch.Tensor | None = None          # this layer's real-query block mass [KVH, NB]

    def on_batch(self, batch) -> None:
        if batch.items:
            it = batch.items[0]                        # a pre-decoding row (no stored token) reads them all
            self.table, self.context_len = list(it.block_table), it.context_len + (it.num_tokens == 0)

    def on_queries(self, layer: int, rows: tuple[str, ...], lanes: list[int], q: torch.Tensor) -> None:
        if self.pool is None or "real" not in rows:
            return
        n = self.context_len - 1                       # the pool holds the keys before this step's row
        k, _ = self.pool.read(layer, self.table, n)
        bs = self.pool.block_size
        self.mass = block_mass(q[lanes[0], rows.index("real")], k, self.scale, bs, -(-n // bs) + 1)

    def on_scores(self, layer: int, rows: tuple[str, ...], lanes: list[int], idx: torch.Tensor,
                  scores: torch.Tensor) -> None:
        lane = lanes[0]
        if rows == ("seed",):       # the last prompt token's query seeds the first working set
            self.pending[layer] = scores[lane, 0].clone()
            self.prev_real[layer] = scores[lane, 0].clone()
            return
        real = scores[lane, rows.index("real")]
        self._record(layer, real)                                    # a decode step's real query
        self.prev_real[layer] = real.clone()
        if "draft" in rows:                                          # its prediction for the next
            self.pending[layer] = scores[lane, rows.index("draft")].clone()

    def _record(self, layer: int, true: torch.Tensor) -> None:
        if layer == 0:
            self.steps.append({})
            self.extras.append({})
            self.candidates.append(int(torch.isfinite(true[0]).sum()))
        pred, prev = self.pending.pop(layer, None), self.prev_real.get(layer)
        if pred is None or self.candidates[-1] == 0:
            return
        # the backend scores only the blocks the contexts reach, so the two steps' widths can differ
        width = max(pred.shape[-1], true.shape[-1], prev.shape[-1] if prev is not None else 0)
        pred, true, prev = (None if x is None else
                            torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=float("-inf"))
                            for x in (pred, true, prev))
        mass = None
        if self.mass is not None:
            mass = torch.nn.functional.pad(self.mass, (0, max(0, width - self.mass.shape[-1])))[:, :width]
        row, extra = [], {name: [] for name in EXTRAS}
        share = lambda a, t: float(((a & t).sum(-1).float() / t.sum(-1).float()).mean())  # noqa: E731
        for k in self.ks:
            t, p = top_k_mask(true, k), top_k_mask(pred, k)
            row.append(share(p, t))
            r = top_k_mask(prev, k) if prev is not None else None
            extra["reuse"].append(share(r, t) if r is not None else float("nan"))
            for m in MARGINS:
                extra[f"margin{m}"].append(share(top_k_mask(pred, k + m), t))
            if mass is not None:
                extra["mass_true"].append(float((mass * t).sum(-1).mean()))
                extra["mass_pred"].append(float((mass * p).sum(-1).mean()))
                extra["mass_missed"].append(float((mass * (t & ~p)).sum(-1).mean()))
                extra["mass_missed_reuse"].append(float((mass * (t & ~r)).sum(-1).mean()) if r is not None
                                                  else float("nan"))
        self.steps[-1][layer] = row
        self.extras[-1][layer] = {k: v for k, v in extra.items() if v}


def extras_mean(steps: list[dict[int, dict[str, list[float]]]], num_ks: int) -> dict[str, dict]:
    """name -> {"mean": [per K] over steps and layers, "min_layer": [per K] the worst layer's mean}."""
    out = {}
    for name in EXTRAS:
        by_layer: dict[int, list[list[float]]] = defaultdict(list)
        for s in steps:
            for layer, e in s.items():
                if name in e and not any(math.isnan(v) for v in e[name]):
                    by_layer[layer].append(e[name])
        if not by_layer:
            continue
        layer_means = {l: [mean(v[i] for v in vs) for i in range(num_ks)] for l, vs in by_layer.items()}
        out[name] = {"mean": [mean(lm[i] for lm in layer_means.values()) for i in range(num_ks)],
                     "min_layer": [min(lm[i] for lm in layer_means.values()) for i in range(num_ks)]}
    return out


def run_draft(factory: EngineFactory, prompt: str, draft: str, top_k: int, steps: int, ks: tuple,
              continuation: list[int] | None, seed: int, temperature: float = 0.0, top_p: float = 1.0,
              overrides: dict | None = None) -> dict:
    """One run under `urgent` with the given draft (greedy, or seeded sampling); agreement at
    every K from the tap. `overrides`: other lookahead settings (--set)."""
    from runtime.sampling import SamplingParams
    eng = factory.make(**(overrides or {}), mode="lookahead", residency="resident", miss_policy="urgent", top_k=top_k,
                       **({"resync_after": 0} if draft == "context_seed" else {}))
    ids = eng.tokenizer.encode(prompt)
    logger = LoggingDraft(make_draft(draft, eng.manifest.model.vocab_size, len(ids), continuation, seed))
    eng.runner.chain.source = logger
    tap = eng.observe(ScoreTap(ks, eng.runner.attn.pool, eng.runner.attn.scale))
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=temperature, top_p=top_p, seed=seed)
    try:
        t0 = time.perf_counter()
        out = eng.generate([ids], params)[0]
        stats = eng.stats()
    finally:
        eng.close()
    full = ids + out.token_ids
    # one proposal per decode step: None is a pre-decoding step (the chain's seed, or a resync),
    # whose row is the next step's real row computed ahead
    kinds = ["predecode" if tok is None else "hit" if n < len(full) and tok == full[n] else "miss"
             for n, tok in logger.log]
    hits = [int(k == "hit") for k in kinds if k != "predecode"]
    num_layers = eng.manifest.model.num_layers
    # Step 0 judges the prefill's seed (the last prompt token's query, the same for every
    # draft); step j >= 1 judges the prediction made at step j-1 from proposal j-1.
    drafted = tap.steps[1:]
    hit = [s for j, s in enumerate(drafted) if j < len(kinds) and kinds[j] == "hit"]
    miss = [s for j, s in enumerate(drafted) if j < len(kinds) and kinds[j] == "miss"]
    pre = [s for j, s in enumerate(drafted) if j < len(kinds) and kinds[j] == "predecode"]
    return {"output_ids": out.token_ids, "prompt_tokens": len(ids), "decode_steps": len(tap.steps),
            "candidates_min": min(tap.candidates, default=0), "candidates_max": max(tap.candidates, default=0),
            "agreement_per_layer": per_layer_mean(drafted, num_layers, len(ks)),         # [L][K]
            "agreement_per_layer_with_seed": per_layer_mean(tap.steps, num_layers, len(ks)),
            "seed_agreement": layer_mean(tap.steps[:1], len(ks)),                       # [K]
            "extras": extras_mean(tap.extras[1:], len(ks)),                             # name -> mean/min [K]
            "agreement_when_draft_hit": layer_mean(hit, len(ks)),                       # [K]
            "agreement_when_draft_miss": layer_mean(miss, len(ks)),
            "agreement_after_predecode": layer_mean(pre, len(ks)),
            "draft_hits": hits, "draft_accept_rate": mean(hits) if hits else None,
            "predecode_steps": kinds.count("predecode"),
            "runtime": {k: stats.get(k) for k in ("agreement_mean", "agreement_per_layer", "prefetch_hit_rate",
                                                   "draft_accept_rate", "urgent_blocks", "resyncs")},
            "time_s": round(time.perf_counter() - t0, 2)}


def per_layer_mean(steps: list[dict[int, list[float]]], num_layers: int, num_ks: int) -> list:
    """steps: per step, layer -> agreement per K -> [L][K] means over steps (None: no data)."""
    return [[mean(s[l][i] for s in steps if l in s) if any(l in s for s in steps) else None
             for i in range(num_ks)] for l in range(num_layers)]


def layer_mean(steps: list[dict[int, list[float]]], num_ks: int) -> list | None:
    """Mean over steps and layers, per K (None when no step has data)."""
    vals = [row for s in steps for row in s.values()]
    return [mean(v[i] for v in vals) for i in range(num_ks)] if vals else None


# ---- prompts ----------------------------------------------------------------------------------
def make_prompts(source: str, ctx: int, samples: int, factory: EngineFactory, wrap, seed: int,
                 steps: int) -> list[str]:
    if source == "ruler":      # a single-needle haystack: the model has to find and copy a value
        return [s.prompt for s in data.ruler_samples("niah_single", ctx, samples, factory.count_tokens,
                                                     wrap, seed)]
    if source == "essay":      # long free text and a free-text answer
        essays = data.load_essays()
        room = min(ctx, factory.base.max_model_len - steps - 1)     # the model's 8K limit holds all
        return [data.essay_prompt(room, factory.count_tokens, 7 * i, wrap, essays) for i in range(samples)]
    if source == "multiturn":  # a chat whose context shifts turn by turn (essay parts, short replies)
        essays = data.load_essays()
        room = min(ctx, factory.base.max_model_len - steps - 1)
        render = factory.tokenizer.apply_chat_template
        return [data.conversation_prompt(room, factory.count_tokens, render, 7 * i, essays=essays)
                for i in range(samples)]
    raise ValueError(f"source {source!r} is unknown; known: {', '.join(SOURCES)}")


# ---- summary ----------------------------------------------------------------------------------
def summarize(recs: list[dict], ks: tuple) -> list[dict]:
    """Mean over samples, per (trajectory, source, context, draft): per-layer and mean agreement
    at each K, candidate counts, trivial flags."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in recs:
        groups[(r["trajectory"], r["source"], r["context"], r["draft"])].append(r)
    rows = []
    for (traj, src, ctx, draft), rs in sorted(groups.items()):
        cand = min(r["candidates_min"] for r in rs)
        per_k = []
        for i, k in enumerate(ks):
            layers = [mean(v for v in (r["agreement_per_layer"][l][i] for r in rs) if v is not None)
                      if any(r["agreement_per_layer"][l][i] is not None for r in rs) else None
                      for l in range(len(rs[0]["agreement_per_layer"]))]
            vals = [v for v in layers if v is not None]
            per_k.append({"k": k, "trivial": k >= cand, "mean": mean(vals) if vals else None,
                          "min_layer": min(vals) if vals else None, "per_layer": layers})
        avg = lambda key: (mean(r[key] for r in rs if r[key] is not None)  # noqa: E731
                           if any(r[key] is not None for r in rs) else None)
        avg_k = lambda key: ([mean(r[key][i] for r in rs if r[key] is not None)  # noqa: E731
                              for i in range(len(ks))] if any(r[key] is not None for r in rs) else None)
        extras = {}
        for name in EXTRAS:
            have = [r["extras"][name] for r in rs if name in r.get("extras", {})]
            if have:
                extras[name] = {agg: [mean(h[agg][i] for h in have) for i in range(len(ks))]
                                for agg in ("mean", "min_layer")}
        rows.append({"trajectory": traj, "source": src, "context": ctx, "draft": draft, "samples": len(rs),
                     "extras": extras,
                     "prompt_tokens": [r["prompt_tokens"] for r in rs], "candidates_min": cand,
                     "candidates_max": max(r["candidates_max"] for r in rs),
                     "decode_steps": sum(r["decode_steps"] for r in rs),
                     "draft_accept_rate": avg("draft_accept_rate"),
                     "seed_agreement": avg_k("seed_agreement"),
                     "agreement_when_draft_hit": avg_k("agreement_when_draft_hit"),
                     "agreement_when_draft_miss": avg_k("agreement_when_draft_miss"),
                     "agreement_after_predecode": avg_k("agreement_after_predecode"),
                     "predecode_steps": sum(r.get("predecode_steps", 0) for r in rs),
                     "by_k": per_k})
    return rows


def format_table(rows: list[dict], ks: tuple) -> str:
    lines = ["mean agreement over layers (min layer in brackets); * = trivial (K >= candidate blocks)"]
    head = f"{'trajectory':<11}{'source':<7}{'ctx':>6}{'cand':>6}  {'draft':<11}{'accept':>7}" + \
           "".join(f"{'K=' + str(k):>15}" for k in ks)
    lines.append(head)
    for r in rows:
        cells = []
        for e in r["by_k"]:
            if e["mean"] is None:
                cells.append("-")
            else:
                cells.append(f"{e['mean']:.3f}[{e['min_layer']:.2f}]" + ("*" if e["trivial"] else " "))
        acc = "-" if r["draft_accept_rate"] is None else f"{r['draft_accept_rate']:.2f}"
        lines.append(f"{r['trajectory']:<11}{r['source']:<7}{r['context']:>6}{r['candidates_min']:>6}  "
                     f"{r['draft']:<11}{acc:>7}" + "".join(f"{c:>15}" for c in cells))
    lines.append("\nsplit by whether the draft token was the real next token (predec: the prediction of a "
                 "pre-decoding row; mean over layers):")
    lines.append(f"{'trajectory':<11}{'source':<7}{'ctx':>6}  {'draft':<11}{'':>8}" +
                 "".join(f"{'K=' + str(k):>9}" for k in ks))
    for r in rows:
        for name, key in (("hit", "agreement_when_draft_hit"), ("miss", "agreement_when_draft_miss"),
                          ("predec", "agreement_after_predecode"), ("seed", "seed_agreement")):
            if r.get(key) is None or (name == "seed" and r["draft"] != "dual_token"):
                continue         # the seed (first step) is the same prediction for every draft
            lines.append(f"{r['trajectory']:<11}{r['source']:<7}{r['context']:>6}  {r['draft']:<11}"
                         f"{name:>8}" + "".join(f"{v:>9.3f}" for v in r[key]))
    lines.append("\nbeside the agreement, per K (mean over steps and layers; min layer in brackets): reuse = the "
                 "current real query's top-K reused as the prediction; margin<m> = share of the true top-K inside "
                 "the draft's top-(K+m); mass = the real query's exact attention on the true top-K, on the "
                 "predicted top-K, and on the true blocks the prediction (or reuse) missed")
    lines.append(f"{'trajectory':<11}{'source':<7}{'ctx':>6}  {'draft':<11}{'':>18}" +
                 "".join(f"{'K=' + str(k):>15}" for k in ks))
    for r in rows:
        for name, e in r.get("extras", {}).items():
            lines.append(f"{r['trajectory']:<11}{r['source']:<7}{r['context']:>6}  {r['draft']:<11}{name:>18}" +
                         "".join(f"{m:>9.3f}[{lo:.2f}]" for m, lo in zip(e["mean"], e["min_layer"])))
    return "\n".join(lines)


def plot(rows: list[dict], ks: tuple, path: Path, k_layers: int = PRODUCTION_K) -> list[str]:
    """Per trajectory: agreement vs layer at K=k_layers (one panel per context; a line per draft
    and source) and mean agreement vs K. Returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"dual_token": "tab:blue", "oracle": "tab:green", "random": "tab:red", "context_seed": "tab:gray"}
    styles = {"ruler": "-", "essay": "--", "multiturn": ":"}
    written = []
    for traj in sorted({r["trajectory"] for r in rows}):
        rs = [r for r in rows if r["trajectory"] == traj]
        ctxs = sorted({r["context"] for r in rs})
        fig, axes = plt.subplots(2, len(ctxs), figsize=(4.2 * len(ctxs), 7), squeeze=False)
        for j, ctx in enumerate(ctxs):
            ax, ax2 = axes[0][j], axes[1][j]
            for r in (r for r in rs if r["context"] == ctx):
                label = f"{r['draft']} / {r['source']}"
                kw = dict(color=colors.get(r["draft"]), linestyle=styles.get(r["source"], ":"), linewidth=1.3)
                e = next((e for e in r["by_k"] if e["k"] == k_layers), None)
                if e is not None:
                    layers = [v if v is not None else float("nan") for v in e["per_layer"]]
                    ax.plot(range(len(layers)), layers, label=label, **kw)
                xs = [e["k"] for e in r["by_k"] if e["mean"] is not None]
                ys = [e["mean"] for e in r["by_k"] if e["mean"] is not None]
                ax2.plot(xs, ys, marker="o", markersize=3, label=label, **kw)
            cand = min(r["candidates_min"] for r in rs if r["context"] == ctx)
            trivial = k_layers >= cand
            ax.set_title(f"{ctx} tokens, K={k_layers}, {cand} candidate blocks" + (" (TRIVIAL)" if trivial else ""),
                         fontsize=9)
            if trivial:
                ax.set_facecolor("#eeeeee")
            ax.set_xlabel("layer")
            ax.set_ylim(0.4, 1.01)
            ax2.set_xscale("log", base=2)
            ax2.set_xticks(list(ks), [str(k) for k in ks])
            ax2.axvspan(cand, max(ks) * 1.5, color="#dddddd", zorder=0)
            ax2.set_title(f"{ctx} tokens: mean over layers vs K (grey: K >= {cand}, trivial)", fontsize=9)
            ax2.set_xlabel("K (blocks of 16 tokens)")
            ax2.set_ylim(0.4, 1.01)
        axes[0][0].set_ylabel("agreement (predicted ∩ true) / K")
        axes[1][0].set_ylabel("agreement")
        axes[0][0].legend(fontsize=7, loc="lower left")
        fig.suptitle(f"draft-predicted vs real top-K block agreement ({traj} trajectory, urgent)", fontsize=10)
        fig.tight_layout()
        out = path.with_name(f"{path.stem}_{traj}{path.suffix}")
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=72)
        plt.close(fig)
        written.append(str(out))
    return written


# ---- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", default=str(ROOT / "engines" / "default"), help="engine dir")
    p.add_argument("--contexts", nargs="+", type=int, default=[2048, 4096, 8192],
                   help="context lengths in tokens: a RULER prompt + RULER's answer budget fits it; "
                        "an essay prompt fills it (up to the model's limit minus --steps)")
    p.add_argument("--sources", nargs="+", default=["ruler", "essay"], choices=SOURCES,
                   help="ruler: single-needle essay haystack (RULER); essay: essays + 'summarize'; multiturn: a chat of "
                        "essay parts and short replies, then a question about the first part")
    p.add_argument("--drafts", nargs="+", default=list(DRAFTS[:3]), choices=DRAFTS,
                   help="context_seed: the draft chain as it was seeded before pre-decoding (the 'before')")
    p.add_argument("--trajectories", nargs="+", default=["production"], choices=("production", "full"),
                   help="production: K=128 sparse attention; full: K >= every block (dense attention)")
    p.add_argument("--ks", nargs="+", type=int, default=list(SWEEP), help="the K sweep (blocks)")
    p.add_argument("--production-k", type=int, default=PRODUCTION_K,
                   help="K of the production trajectory's runs (the papers' 128)")
    p.add_argument("--samples", type=int, default=1, help="prompts per source and context")
    p.add_argument("--steps", type=int, default=24, help="decode steps measured per run")
    p.add_argument("--template", choices=("chat", "base"), default="chat")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="a lookahead setting for every run, e.g. --set fetch_ratio=1.0 (repeatable)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: seeded sampling (seed + index)")
    p.add_argument("--top-p", type=float, default=1.0)
    add_run_args(p, "agreement", "per-run", "summarize and plot the runs --jsonl holds for these settings")
    p.add_argument("--plot", default=str(ROOT / "results" / "agreement.png"),
                   help="PNG path; one file per trajectory (<stem>_<trajectory>.png); '' for none")
    args = p.parse_args(argv)
    if "oracle" in args.drafts and "dual_token" not in args.drafts:
        p.error("the oracle replays the dual_token run's continuation: add dual_token to --drafts")
    args.drafts = [d for d in DRAFTS if d in args.drafts]        # dual_token first
    args.ks = sorted(set(args.ks))
    sets = {}
    for item in args.overrides:
        name, eq, value = item.partition("=")
        if not eq or name in RUN_FIELDS:
            p.error(f"--set {item!r}: expected FIELD=VALUE, FIELD a lookahead setting other than {RUN_FIELDS}")
        sets[name] = typed_value(value)
    args.overrides = sets
    return args


def run_k(trajectory: str, ctx: int, steps: int, block_size: int, production_k: int) -> int:
    """The K a run uses: production's, or enough to cover every block (dense attention)."""
    return production_k if trajectory == "production" else math.ceil((ctx + steps + 1) / block_size) + 1


def main(argv: list[str] | None = None) -> dict:
    from tqdm import tqdm
    args = parse_args(argv)
    set_threads(args.threads)
    settings = hashlib.sha1(json.dumps({"engine": str(Path(args.engine).resolve()), "ks": args.ks,
                                        "steps": args.steps, "production_k": args.production_k, "template": args.template,
                                        "seed": args.seed, "policy": engine_policy(args.engine),
                                        "chain": "predecode", "temperature": args.temperature, "top_p": args.top_p,
                                        **({"set": args.overrides} if args.overrides else {})},
                                       sort_keys=True).encode()).hexdigest()[:12]
    jsonl = Path(args.jsonl)
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if jsonl.is_file():
        for line in jsonl.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("settings") == settings:
                done[(r["trajectory"], r["source"], r["context"], r["index"], r["draft"])] = r
    factory = EngineFactory(args.engine, max(args.contexts) + args.steps + 64)
    wrap = factory.tokenizer.apply_chat_template if args.template == "chat" else None
    bs = factory.base.config.block_size
    ks = tuple(args.ks)
    units = [(t, s, c, i, d) for t in args.trajectories for c in args.contexts for s in args.sources
             for i in range(args.samples) for d in args.drafts]          # short contexts first
    if args.report_only:
        units = [u for u in units if u in done]
    bar = tqdm(total=len(units), desc="agreement", unit="run", dynamic_ncols=True)
    bar.update(sum(u in done for u in units))
    prompts: dict[tuple, list[str]] = {}
    for unit in units:
        traj, src, ctx, i, draft = unit
        if unit in done:
            continue
        if (src, ctx) not in prompts:
            bar.set_postfix_str(f"{src}@{ctx}: making prompts")
            prompts[(src, ctx)] = make_prompts(src, ctx, args.samples, factory, wrap, args.seed, args.steps)
        bar.set_postfix_str(f"{traj} {src}@{ctx} #{i} {draft}")
        ref = done.get((traj, src, ctx, i, "dual_token"))
        res = run_draft(factory, prompts[(src, ctx)][i], draft, run_k(traj, ctx, args.steps, bs, args.production_k), args.steps,
                        ks, ref["output_ids"] if ref else None, args.seed + i, args.temperature, args.top_p,
                        args.overrides)
        rec = {"settings": settings, "trajectory": traj, "source": src, "context": ctx, "index": i,
               "draft": draft, "run_top_k": run_k(traj, ctx, args.steps, bs, args.production_k), "ks": list(ks), **res}
        if ref is not None and res["output_ids"] != ref["output_ids"]:
            tqdm.write(f"warning: {unit}: output differs from the dual_token run (expected equal under urgent)")
        append_record(jsonl, rec)
        done[unit] = rec
        bar.update(1)
    bar.close()
    recs = [done[u] for u in units]
    rows = summarize(recs, ks)
    check = crosscheck(recs)
    files = plot(rows, ks, Path(args.plot), args.production_k) if args.plot else []
    result = {"settings": {**{k: v for k, v in vars(args).items() if k not in ("jsonl", "json", "plot")},
                           "key": settings, "block_size": bs},
              "machine": machine_info(), "crosscheck_vs_runtime": check, "summary": rows,
              "plots": files, "records": recs}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(format_table(rows, ks))
    print(f"\ncross-check vs the runtime's own agreement_per_layer at the run's K: max |diff| = "
          f"{check['max_abs_diff']}" + ("" if check["compared"] else " (no run used a K in the sweep)"))
    print(f"per-run results: {jsonl}  summary: {out}" + (f"  plots: {', '.join(files)}" if files else ""))
    return result


def crosscheck(recs: list[dict]) -> dict:
    """Our per-layer agreement at the run's own K must equal the runtime's LookaheadMetrics."""
    diffs = []
    for r in recs:
        if r["run_top_k"] not in r["ks"] or r["runtime"]["agreement_per_layer"] is None:
            continue
        i = r["ks"].index(r["run_top_k"])
        for ours, theirs in zip(r["agreement_per_layer_with_seed"], r["runtime"]["agreement_per_layer"]):
            if ours[i] is not None and theirs is not None:
                diffs.append(abs(ours[i] - theirs))
    return {"compared": len(diffs), "max_abs_diff": max(diffs) if diffs else None}


if __name__ == "__main__":
    main()
