#!/usr/bin/env python
"""What a sparse decode step's attention costs where the KV lies, against dense, on this CPU.

    .venv/bin/python experiments/attention_sparsity.py --engine engines/int8 --context 8192 --batch 4 --threads 2 \\
        --json build/attention_sparsity.json

Times, per step and per layer, the kernels a sparse step could run in place of the device tier's
copies, over a KV pool shaped like the engine's: every layer its own K/V and summaries (its KV
heads, head_dim, block size, kv_dtype; random values, which do not change the kernels' work), one
step = one call per layer, so that each layer's bytes come from memory as in a real step (one
layer called again and again would be served from the cache):
- `attention_paged` (the dense step's kernel) with every key visible;
- the same kernel with the keys of a top-K selection visible (sink + `top_k` blocks + the recent
  window, the engine's lookahead geometry): masked keys are never read, so this is the attention
  of top-K sparse attention over the host pool, with no copy into a working set;
- `block_topk` over the sequences' block summaries (fp32 kmin/kmax), the selection itself.
Rounds of the three alternate (`--rounds`); medians are reported. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from plugins import cpu
from plugins.cpu import ops
from runtime.engine_dir import load_manifest
from runtime.lookahead.device_tier import SlotLayout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/int8", help="engine dir whose shapes to use (default: %(default)s)")
    p.add_argument("--context", type=int, default=8192, help="keys per sequence (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="sequences (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default: %(default)s)")
    p.add_argument("--calls", type=int, default=5, help="steps (a call per layer each) per round (default: %(default)s)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not cpu.available():
        p.error("the CPU kernels are not available here")
    torch.set_num_threads(args.threads)
    man = load_manifest(Path(args.engine))
    m, la = man.model, man.lookahead
    kv_dtype = getattr(torch, la.kv_dtype or "float32")
    lay = SlotLayout.from_config(la)
    B, KVH, H, D, bs, N = args.batch, m.num_kv_heads, m.num_heads, m.head_dim, la.block_size, args.context
    nb = -(-N // bs)
    g = torch.Generator().manual_seed(0)
    L = m.num_layers
    k = [torch.randn(KVH, B * nb, bs, D, generator=g).to(kv_dtype) for _ in range(L)]
    v = [torch.randn(KVH, B * nb, bs, D, generator=g).to(kv_dtype) for _ in range(L)]
    q = torch.randn(B, H, D, generator=g)
    starts, lens = [b * nb for b in range(B)], [N] * B
    full = ops.paged_mask(lens, KVH)
    sparse = torch.zeros_like(full)
    w0, cands = lay.window_start(N), lay.num_candidates(N)
    top_k = min(la.top_k, cands)
    for b in range(B):
        for h in range(KVH):
            blocks = torch.zeros(nb, dtype=torch.bool)
            blocks[:lay.num_sink] = True
            blocks[w0:] = True
            blocks[lay.num_sink + torch.randperm(cands, generator=g)[:top_k]] = True
            sparse[b, h] = blocks.repeat_interleave(bs)[:N]
    kmin = [torch.randn(B, nb, KVH, D, generator=g) for _ in range(L)]
    kmax = [t + torch.rand(B, nb, KVH, D, generator=g) for t in kmin]
    valid = torch.zeros(B, 1, nb, dtype=torch.bool)
    valid[:, :, lay.num_sink:w0] = True

    def timed(fn) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        return (time.perf_counter() - t0) / args.calls * 1e3

    def step(fn):
        return lambda: [fn(layer) for layer in range(L)]
    cases = {"dense attention (every key)":
             step(lambda i: ops.attention_paged(q, k[i], v[i], starts, lens, D ** -0.5, full)),
             f"sparse attention in place (sink + {top_k} blocks + window)":
             step(lambda i: ops.attention_paged(q, k[i], v[i], starts, lens, D ** -0.5, sparse)),
             "block_topk (the selection)":
             step(lambda i: ops.block_topk(q[:, None], kmin[i], kmax[i], valid, top_k, la.group_score))}
    if ops.attention_paged(q, k[0], v[0], starts, lens, D ** -0.5, full) is None:
        p.error(f"the paged attention kernel does not take this engine's shapes (head_dim {D}, heads {H}/{KVH})")
    times: dict[str, list[float]] = {c: [] for c in cases}
    for r in range(args.rounds):
        for name in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
            times[name].append(timed(cases[name]))
    visible = float(sparse.float().mean())
    rows = [{"kernel": c, "ms_per_step": statistics.median(t), "ms_per_layer": statistics.median(t) / L,
             "rounds_ms_per_step": [round(x, 4) for x in t]} for c, t in times.items()]
    print(f"{args.engine}: {L} layers, {H}/{KVH} heads, head_dim {D}, block {bs}, {kv_dtype}; "
          f"context {N} x batch {B}, {args.threads} threads; visible keys in the sparse mask {visible:.1%}")
    print(f"{'kernel':<58} {'ms/layer':>9} {'ms/step':>9}")
    for r in rows:
        print(f"{r['kernel']:<58} {r['ms_per_layer']:>9.3f} {r['ms_per_step']:>9.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"engine": args.engine, "context": N, "batch": B,
                                               "threads": args.threads, "visible_fraction": visible,
                                               "top_k": top_k, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
