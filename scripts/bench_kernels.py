#!/usr/bin/env python3
"""The two kernels a CPU decode step spends most of its time in, at decode shapes, against a plain
streaming read of the same bytes (what the bandwidth floor assumes).

    python scripts/bench_kernels.py --threads 1 --json results/bench_kernels.json

1. The weights: M rows (a decode batch; x2 with look-ahead's draft row) through every linear layer
   of the default model's shape (SmolLM2-135M: 30 layers of q/k/v, o, gate/up, down), fp32:
   BLAS (`F.linear`) and plugins/cpu's C kernel (`plugins.cpu.linear`, what the runtime calls
   when it builds). Reported as weight bytes read per second.
2. The attention over a layer's working set (a lane's 3 KV heads, 6 query rows each = 3 query
   heads x (real, draft), K + window + sink slots of 16 tokens), for 30 layers of 4 lanes:
   torch's fused CPU kernel with and without a mask, and plugins/cpu's C kernel (what
   `plugins.lookahead_attention` runs when it builds). Reported as K/V bytes read per second.
The reference is `sum()` over the same tensors. Best of 3 after a warm-up; prints a table.

    python scripts/bench_kernels.py --int8 --threads 2

3. (--int8) Weight-only int8 (what an int8 engine multiplies) at the SmolLM2 shapes, M rows:
   fp32 `F.linear` and `plugins.cpu.linear` on fp32 weights against `plugins.cpu.linear_int8`
   on int8 [N, K] + fp32 scales (per output channel, and per group of 64 inputs as the builder
   writes by default), over enough distinct weights of each shape (>= INT8_SET_BYTES of
   int8) that they come from memory, not the L3. Reported as ms per weight and the GB/s of the
   bytes each reads (fp32: 4 N K; int8: N K + 4 N, grouped N K + 4 N K / 64).
4. (--kv16) `plugins.cpu.attention` (2.'s working sets) and `plugins.cpu.attention_paged` (dense
   decode at batch 1, 2K and 8K tokens, 30 layers) over K/V stored as fp32, fp16 and bf16.
   Reported as ms and the GB/s of the K/V bytes as stored.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from runtime.threads import prepare_threads

prepare_threads()  # first: libgomp reads GOMP_SPINCOUNT once, when torch loads it

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.floor import best_of  # noqa: E402
from plugins import cpu  # noqa: E402

LAYERS, HIDDEN, KV_DIM, INTER = 30, 576, 192, 1536          # SmolLM2-135M
LINEARS = [(HIDDEN, HIDDEN + 2 * KV_DIM), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]


def weights_rows(rows: list[int]) -> list[dict]:
    ws = [torch.randn(o, i) for _ in range(LAYERS) for i, o in LINEARS]
    nbytes = sum(w.nbytes for w in ws)
    out = [{"what": "sum over the weights", "gbps": nbytes / best_of(lambda: [w.sum() for w in ws]) / 1e9}]
    for m in rows:
        xs = {i: torch.randn(m, i) for i, _ in LINEARS}
        s = best_of(lambda: [F.linear(xs[w.shape[1]], w) for w in ws])
        out.append({"what": f"F.linear, {m} row(s)", "gbps": nbytes / s / 1e9, "ms": 1e3 * s})
        if cpu.available():
            s = best_of(lambda: [cpu.linear(xs[w.shape[1]], w) for w in ws])
            out.append({"what": f"plugins.cpu.linear, {m} row(s)", "gbps": nbytes / s / 1e9, "ms": 1e3 * s})
    return out


INT8_SHAPES = [(HIDDEN, 1728), (HIDDEN, 2 * INTER), (INTER, HIDDEN), (HIDDEN, 49152)]   # (K, N); 49152: LM head
INT8_SET_BYTES = 64 << 20
INT8_GROUP = 64     # build_engine.py --group-size's default: an fp32 scale per 64 inputs


def int8_rows(rows: list[int]) -> list[dict]:
    out = []
    for K, N in INT8_SHAPES:
        copies = max(2, -(-INT8_SET_BYTES // (N * K)))
        ws = [torch.randn(N, K) for _ in range(copies)]
        qs = [torch.randint(-127, 128, (N, K), dtype=torch.int8) for _ in range(copies)]
        scales = [torch.rand(N) / 127 for _ in range(copies)]
        groups = [torch.rand(N, K // INT8_GROUP) / 127 for _ in range(copies)]     # what the builder writes
        for m in rows:
            x = torch.randn(m, K)
            cases = {"F.linear fp32": (lambda: [F.linear(x, w) for w in ws], 4 * N * K)}
            if cpu.available():
                cases["cpu.linear fp32"] = (lambda: [cpu.linear(x, w) for w in ws], 4 * N * K)
            cases["cpu.linear_int8"] = (lambda: [cpu.linear_int8(x, q, s) for q, s in zip(qs, scales)], N * K + 4 * N)
            cases[f"cpu.linear_int8 G={INT8_GROUP}"] = (lambda: [cpu.linear_int8(x, q, g) for q, g in zip(qs, groups)],
                                                     N * K + 4 * N * (K // INT8_GROUP))
            for name, (fn, nbytes) in cases.items():
                s = best_of(fn) / copies
                out.append({"what": f"K={K} N={N} M={m} {name}", "ms": 1e3 * s, "gbps": nbytes / s / 1e9})
        ws = qs = scales = groups = None         # free before the next shape's
    return out


def kv16_rows(lanes: int = 4, kv_heads: int = 3, head_dim: int = 64, slots: int = 134, block: int = 16) -> list[dict]:
    out, n = [], slots * block
    if not cpu.available():
        return out
    qs = [torch.randn(lanes, 2, 3 * kv_heads, head_dim) for _ in range(LAYERS)]
    mask = torch.rand(lanes, kv_heads, n) < 0.97
    kx = torch.randn(lanes, kv_heads, 2, head_dim)
    xm = torch.ones(2, 2, dtype=torch.bool).tril().expand(lanes, 2, 2).contiguous()
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        ks = [torch.randn(lanes, kv_heads, n, head_dim).to(dt) for _ in range(LAYERS)]
        vs = [torch.randn(lanes, kv_heads, n, head_dim).to(dt) for _ in range(LAYERS)]
        s = best_of(lambda: [cpu.attention(q, k, v, mask, kx, kx, xm, 0.125) for q, k, v in zip(qs, ks, vs)])
        nbytes = 2 * sum(k.nbytes for k in ks)
        out.append({"what": f"lookahead attention, {str(dt)[6:]} K/V", "ms": 1e3 * s, "gbps": nbytes / s / 1e9})
        ks = vs = None
    for ctx in (2048, 8192):
        q, m = torch.randn(1, 3 * kv_heads, head_dim), cpu.paged_mask([ctx], kv_heads)
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            pools = [(torch.randn(kv_heads, ctx // block + 1, block, head_dim).to(dt),
                      torch.randn(kv_heads, ctx // block + 1, block, head_dim).to(dt)) for _ in range(LAYERS)]
            s = best_of(lambda: [cpu.attention_paged(q, pk, pv, [1], [ctx], 0.125, m) for pk, pv in pools])
            nbytes = 2 * LAYERS * kv_heads * ctx * head_dim * pools[0][0].element_size()
            out.append({"what": f"dense decode b1 {ctx // 1024}K, {str(dt)[6:]} K/V", "ms": 1e3 * s,
                        "gbps": nbytes / s / 1e9})
            pools = None
    return out


def attention_rows(lanes: int = 4, kv_heads: int = 3, q_rows: int = 6, head_dim: int = 64,
                   slots: int = 134, block: int = 16) -> list[dict]:
    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    n = slots * block
    qs = [torch.randn(lanes, kv_heads, q_rows, head_dim) for _ in range(LAYERS)]
    ks = [torch.randn(lanes, kv_heads, n, head_dim) for _ in range(LAYERS)]
    vs = [torch.randn(lanes, kv_heads, n, head_dim) for _ in range(LAYERS)]
    bias = torch.zeros(lanes, kv_heads, 1, n).masked_fill_(torch.rand(lanes, kv_heads, 1, n) > 0.97, float("-inf"))
    nbytes = 2 * sum(k.nbytes for k in ks)
    cases = {"sum over K and V": lambda: [(k.sum(), v.sum()) for k, v in zip(ks, vs)],
             "fused attention, masked": lambda: [fused(q, k, v, 0.0, False, attn_mask=bias, scale=0.125)
                                                 for q, k, v in zip(qs, ks, vs)],
             "fused attention, no mask": lambda: [fused(q, k, v, 0.0, False, scale=0.125)
                                                  for q, k, v in zip(qs, ks, vs)]}
    if cpu.available():       # the op's layout: q [lanes, rows, heads, D], two extra keys (the rows' own)
        q4 = [q.view(lanes, kv_heads, 2, q_rows // 2, head_dim).transpose(1, 2).reshape(lanes, 2, -1, head_dim)
              for q in qs]
        mask = bias[:, :, 0] == 0
        kx = torch.randn(lanes, kv_heads, 2, head_dim)
        xm = torch.ones(2, 2, dtype=torch.bool).tril().expand(lanes, 2, 2).contiguous()
        cases["plugins.cpu attention"] = lambda: [cpu.attention(q, k, v, mask, kx, kx, xm, 0.125)
                                                  for q, k, v in zip(q4, ks, vs)]
    return [{"what": name, "gbps": nbytes / (s := best_of(fn)) / 1e9, "ms": 1e3 * s} for name, fn in cases.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s, as the bench)")
    p.add_argument("--rows", default="1,2,4,8", help="batch rows through the weights (default: %(default)s)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--int8", action="store_true", help="the int8 x fp32 linear table (3. above)")
    p.add_argument("--kv16", action="store_true", help="the 16-bit K/V attention table (4. above)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    int8 = "int8 weight-only linear at the SmolLM2 shapes (ms per weight)"
    ms = [int(m) for m in args.rows.split(",")]
    kv16 = "attention over fp32 / fp16 / bf16 K/V (30 layers)"
    if args.int8 or args.kv16:
        rows = {**({int8: int8_rows(ms)} if args.int8 else {}), **({kv16: kv16_rows()} if args.kv16 else {})}
    else:
        rows = {"linear weights of 30 layers (405 MiB fp32; no embedding / LM head)": weights_rows(ms),
                "attention over one step's working sets (30 layers x 4 lanes, 377 MiB of K/V)": attention_rows()}
    for title, rs in rows.items():
        print(title)
        for r in rs:
            ms = f"{r['ms']:7.1f} ms" if "ms" in r else " " * 10
            print(f"  {r['what']:<32} {ms}  {r['gbps']:5.1f} GB/s" if title not in (int8, kv16) else
                  f"  {r['what']:<44} {r['ms']:8.3f} ms  {r['gbps']:5.1f} GB/s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
