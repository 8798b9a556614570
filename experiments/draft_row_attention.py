#!/usr/bin/env python3
"""Does the draft row's attention set cost the prediction its agreement at long context?

    .venv/bin/python experiments/draft_row_attention.py --engine engines/qwen2.5-coder-0.5b-w8a8 --context 32000

When the draft token is right, the next step's real row is the draft row computed again over its
own top-K, so every difference between the two rows' hidden states, layer after layer, comes from
the set the draft row attends. This run measures how much: one RULER prompt, greedy,
`resident` / `urgent`, the model's own draft, the agreement of the prediction with the next
step's exact top-K (scripts/profile_agreement.py's tap), once per variant on one prefill:
  tier   the draft row attends what the device tier holds (sink, the resident selected blocks,
         the window) plus the step's own rows: the working set the *real* row selected (the
         runtime's `draft_attention` "tier", a GPU engine's default);
  own    the draft row attends its sink, window and *its own* top-K blocks of the layer, read
         from the host pool, plus the step's own rows (`draft_attention` "own", a CPU engine's
         default since this experiment found the cause: runtime/lookahead/attention.py);
  dense  the draft row's attention recomputed over the lane's whole context (the host pool) plus
         the step's own rows: what it would compute with no working set at all (patched here
         over "tier").
The real row and everything stored are the same in every variant; only the prediction (and the
draft token, which the draft row's logits give) can change. The tap's on_scores observer puts the
backend on its torch layer (the C layer computes the same, bit for bit).
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
from runtime.internals import Internals
from runtime.lookahead.attention import LookaheadAttention, lane_rows

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


def patch_dense() -> None:
    """Patch the backend's torch layer so that the draft row attends the whole context."""
    orig_decode, orig_attend = LookaheadAttention._decode_torch, LookaheadAttention._attend
    state = {}

    def decode(self, layer, *args, **kw):
        state["layer"] = layer
        return orig_decode(self, layer, *args, **kw)

    def attend(self, buf, qd, k, v, d):
        o = orig_attend(self, buf, qd, k, v, d)
        if d.rows == 2:
            dense_draft_rows(self, state["layer"], o, qd, k, v, d)
        return o

    LookaheadAttention._decode_torch, LookaheadAttention._attend = decode, attend


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
    orig = (LookaheadAttention._decode_torch, LookaheadAttention._attend)
    for name in a.variants:
        LookaheadAttention._decode_torch, LookaheadAttention._attend = orig
        factory.internals = Internals(draft_attention="own" if name == "own" else "tier")
        if name == "dense":
            patch_dense()
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
