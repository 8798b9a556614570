#!/usr/bin/env python3
"""Does the draft row's sparse attention cost the prediction its agreement at long context?

    .venv/bin/python experiments/draft_row_attention.py --engine engines/qwen2.5-coder-0.5b-w8a8 --context 32000

The draft row of a lookahead step attends what the device tier holds (sink, the resident selected
blocks, the window) plus the step's own rows: the working set the *real* row selected, not the one
the next step's real row will select. When the draft token is right, the next step's real row is
the draft row computed again over its own top-K, so every difference between the two rows' hidden
states, layer after layer, comes from that attention set. This run measures how much: one RULER
prompt, greedy, `resident` / `urgent`, the model's own draft, the agreement of the prediction with
the next step's exact top-K (scripts/profile_agreement.py's tap), once per variant on one prefill:
  tier   the runtime as it is;
  dense  the draft row's attention recomputed over the lane's whole context (the host pool) plus
         the step's own rows: what the draft row would compute with no working set at all;
  own    the draft row's attention over sink + window + *its own* top-K blocks of the layer (read
         from the host pool) plus the step's own rows: what the next step's real row attends when
         the draft token and the prediction are right (under `urgent` the selected slots hold
         exactly the real query's top-K), so the draft row computes that row ahead.
The real row and everything stored are the same in every variant; only the prediction (and the draft token,
which the draft row's logits give) can change. The C lookahead layer does not run here: the tap's
on_scores observer puts the backend on its torch layer, which this run patches.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.runs import EngineFactory
from runtime.lookahead.attention import LookaheadAttention, lane_rows
from runtime.lookahead.summaries import BlockSummaries

ROOT = Path(__file__).resolve().parents[1]


def _load_profile_agreement():
    spec = importlib.util.spec_from_file_location("profile_agreement", ROOT / "scripts" / "profile_agreement.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dense_draft_rows(attn: LookaheadAttention, layer: int, o, qd, k, v, d) -> None:
    """Overwrite the draft rows of `o` [n, 2, H, D] with attention over each active lane's whole
    stored context (host pool, layer `layer`) plus the step's real and draft rows."""
    pool, bs = attn.pool, attn.layout.block_size
    k_rows, v_rows = lane_rows(k, d), lane_rows(v, d)                # [n, 2, KVH, D]
    for i, (lane, c) in enumerate(zip(d.lane_list, d.context_lens)):
        if not bool(d.lane_active[i]) or bool(d.predecode[i]):
            continue
        stored = c - 1                                               # this step's real token is not stored yet
        nblk = math.ceil(stored / bs)
        blocks = attn.residency.lane_blocks[lane, :nblk]
        keys = pool.k[layer][:, blocks].reshape(pool.k.shape[1], -1, pool.k.shape[-1])[:, :stored]
        vals = pool.v[layer][:, blocks].reshape(pool.v.shape[1], -1, pool.v.shape[-1])[:, :stored]
        keys = torch.cat([keys.float(), k_rows[i].transpose(0, 1).float()], dim=1)   # + real, draft
        vals = torch.cat([vals.float(), v_rows[i].transpose(0, 1).float()], dim=1)
        q = qd[i, 1].float().unsqueeze(1)                            # [H, 1, D]
        out = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), vals.unsqueeze(0),
                                             scale=attn.scale, enable_gqa=True)[0, :, 0]
        o[i, 1] = out.to(o.dtype)


def own_draft_rows(attn: LookaheadAttention, layer: int, idx, o, qd, k, v, d) -> None:
    """Overwrite the draft rows of `o` with attention over sink + window + the draft query's own
    top-K (`idx` [n, 2, KVH, K] logical blocks, -1 padded) of the lane, per KV head, plus the step's
    real and draft rows."""
    pool, layout = attn.pool, attn.layout
    bs, kvh = layout.block_size, pool.k.shape[1]
    group = qd.shape[2] // kvh
    k_rows, v_rows = lane_rows(k, d), lane_rows(v, d)                # [n, 2, KVH, D]
    for i, (lane, c) in enumerate(zip(d.lane_list, d.context_lens)):
        if not bool(d.lane_active[i]) or bool(d.predecode[i]):
            continue
        stored = c - 1
        last = (stored - 1) // bs
        fixed = list(range(min(layout.num_sink, last + 1))) + list(range(layout.window_start(c + 1), last + 1))
        for h in range(kvh):
            own = [b for b in idx[i, 1, h].tolist() if b >= 0]
            logical = torch.tensor(sorted(set(fixed) | set(own)), dtype=torch.long)
            host = attn.residency.lane_blocks[lane, logical]
            keys = pool.k[layer, h, host].reshape(-1, pool.k.shape[-1]).float()        # [nb * bs, D]
            vals = pool.v[layer, h, host].reshape(-1, pool.v.shape[-1]).float()
            pos = (logical[:, None] * bs + torch.arange(bs)).reshape(-1)
            keep = pos < stored
            keys = torch.cat([keys[keep], k_rows[i, :, h].float()])                     # + real, draft
            vals = torch.cat([vals[keep], v_rows[i, :, h].float()])
            q = qd[i, 1, h * group:(h + 1) * group].float()                              # [group, D]
            w = torch.softmax(q @ keys.T * attn.scale, dim=-1)
            o[i, 1, h * group:(h + 1) * group] = (w @ vals).to(o.dtype)


def patch_draft(kind: str) -> None:
    """Patch the backend's torch layer so that the draft row attends `kind` ("dense" or "own")."""
    orig_decode, orig_attend = LookaheadAttention._decode_torch, LookaheadAttention._attend
    orig_score = BlockSummaries.score
    state = {}

    def decode(self, layer, *args, **kw):
        state["layer"] = layer
        return orig_decode(self, layer, *args, **kw)

    def score(self, *args, **kw):
        state["idx"], scores = orig_score(self, *args, **kw)
        return state["idx"], scores

    def attend(self, buf, qd, k, v, d):
        o = orig_attend(self, buf, qd, k, v, d)
        if d.rows == 2 and kind == "dense":
            dense_draft_rows(self, state["layer"], o, qd, k, v, d)
        elif d.rows == 2:
            own_draft_rows(self, state["layer"], state["idx"], o, qd, k, v, d)
        return o

    LookaheadAttention._decode_torch, LookaheadAttention._attend = decode, attend
    BlockSummaries.score = score


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default=str(ROOT / "engines/default"))
    p.add_argument("--context", type=int, default=32000)
    p.add_argument("--source", default="ruler", choices=("ruler", "essay", "multiturn"))
    p.add_argument("--top-k", type=int, default=128)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=["tier", "own", "dense"], choices=("tier", "own", "dense"))
    p.add_argument("--json", default="results/draft_row_attention.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    pa = _load_profile_agreement()
    factory = EngineFactory(a.engine, a.context + a.steps + 64)
    prompt = pa.make_prompts(a.source, a.context, 1, factory, factory.tokenizer.apply_chat_template, 0, a.steps)[0]
    ks = (a.top_k,)
    out = {}
    orig = (LookaheadAttention._decode_torch, LookaheadAttention._attend, BlockSummaries.score)
    for name in a.variants:
        LookaheadAttention._decode_torch, LookaheadAttention._attend, BlockSummaries.score = orig
        if name != "tier":
            patch_draft(name)
        with torch.inference_mode():
            r = pa.run_draft(factory, prompt, "dual_token", a.top_k, a.steps, ks, None, 0)
        per_layer = [x[0] for x in r["agreement_per_layer"] if x and x[0] is not None]
        out[name] = {"agreement_mean": sum(per_layer) / len(per_layer), "agreement_worst_layer": min(per_layer),
                     "agreement_per_layer": per_layer, "agreement_when_draft_hit": r["agreement_when_draft_hit"],
                     "draft_accept_rate": r["draft_accept_rate"], "prompt_tokens": r["prompt_tokens"],
                     "runtime": r["runtime"], "output_ids": r["output_ids"], "time_s": r["time_s"]}
        print(f"{name:>6}: agreement {out[name]['agreement_mean']:.4f} [worst layer "
              f"{out[name]['agreement_worst_layer']:.3f}], when the draft was right "
              f"{r['agreement_when_draft_hit']}, accept {r['draft_accept_rate']}, "
              f"prompt {r['prompt_tokens']} tokens ({r['time_s']:.0f} s)", flush=True)
    same = len({tuple(r["output_ids"]) for r in out.values()}) == 1
    print(f"real tokens the same in every run: {same}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"args": vars(a), "runs": out, "same_output": same}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
