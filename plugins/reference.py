"""Plain-torch references for the lookahead ops: obvious loops and explicit masks, for clarity.

Every implementation (the torch one in this package, the CUDA kernels, the TensorRT plugins) is
tested against these on fresh random inputs with the dtype-keyed tolerances below. They are slow
by design; never call them on a hot path.
"""
from __future__ import annotations

import torch

# (atol, rtol) per input dtype for floating outputs, as FlashInfer's tests key them.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.5e-2, 1.5e-2),
}


def block_gather_ref(src: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """src [NB, KVH, bs, D], block_ids [KVH, n] -> out [KVH, n, bs, D]: out[h, i] = src[block_ids[h, i], h],
    zeros where block_ids[h, i] is -1 (nothing read)."""
    num_kv_heads, n = block_ids.shape
    out = src.new_empty((num_kv_heads, n, src.shape[2], src.shape[3]))
    for h in range(num_kv_heads):
        for i in range(n):
            b = int(block_ids[h, i])
            out[h, i] = 0 if b == -1 else src[b, h]
    return out


def block_topk_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, valid: torch.Tensor,
                   k: int, group_score: str = "sum") -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, D], kmin/kmax [B, NB, KVH, D], valid [B, NB] -> (indices [B, KVH, k], scores [B, KVH, NB]).

    A KV head's score is the sum (group_score "sum") or the max ("max") of its query heads' scores.

    q [B, R, H, D] with valid [B, R, NB]: each row r on its own -> [B, R, KVH, k], [B, R, KVH, NB].
    """
    if q.dim() == 4:
        outs = [block_topk_ref(q[:, r], kmin, kmax, valid[:, r], k, group_score) for r in range(q.shape[1])]
        return torch.stack([o[0] for o in outs], 1), torch.stack([o[1] for o in outs], 1)
    B, H, _ = q.shape
    num_blocks, num_kv_heads = kmin.shape[1], kmin.shape[2]
    group = H // num_kv_heads
    scores = torch.full((B, num_kv_heads, num_blocks), float("-inf"), device=q.device)
    indices = torch.full((B, num_kv_heads, k), -1, dtype=torch.int64, device=q.device)
    for b in range(B):
        for g in range(num_kv_heads):
            for n in range(num_blocks):
                if not valid[b, n]:
                    continue
                lo, hi = kmin[b, n, g].float(), kmax[b, n, g].float()
                head_scores = [torch.maximum(q[b, h].float() * lo, q[b, h].float() * hi).sum()
                               for h in range(H) if h // group == g]
                scores[b, g, n] = (sum(head_scores) if group_score == "sum"
                                   else torch.stack(head_scores).max())
            ranked = sorted((n for n in range(num_blocks) if valid[b, n]),
                            key=lambda n: (-float(scores[b, g, n]), n))    # ties: lower id first
            chosen = sorted(ranked[:k])
            indices[b, g, :len(chosen)] = torch.tensor(chosen, dtype=torch.int64, device=q.device)
    return indices, scores


def update_summaries_ref(kmin: torch.Tensor, kmax: torch.Tensor, keys: torch.Tensor,
                         block_ids: torch.Tensor, block_offsets: torch.Tensor) -> None:
    """Token by token, in place: offset 0 resets the block's summary to the key, else min/max.

    keys may be narrower than the summaries (float16 / bfloat16 keys, float32 summaries): each
    key is widened first, which is exact, so the summaries are exact too."""
    for t in range(keys.shape[0]):
        b, key = int(block_ids[t]), keys[t].to(kmin.dtype)
        if int(block_offsets[t]) == 0:
            kmin[b] = key
            kmax[b] = key
        else:
            kmin[b] = torch.minimum(kmin[b], key)
            kmax[b] = torch.maximum(kmax[b], key)


def plan_slot_rule(held: list[int], last: list[int], want: list[int], prio: list[float], cap: int, step: int):
    """The slot plan of one (lane, KV head), as `plan_slots` states it: returns (held', last',
    [(slot, block)] in rank order). Wanted held slots are stamped `step`; the missing wanted
    blocks, best priority first (ties: request order), go into the slots not wanted, least
    recently selected first (ties: the lower slot; empty slots are last used -1)."""
    held, last = list(held), list(last)
    wanted = {b for b in want if b >= 0}
    for s, b in enumerate(held):
        if b >= 0 and b in wanted:
            last[s] = step
    missing = [j for j, b in enumerate(want) if b >= 0 and b not in held]
    missing.sort(key=lambda j: -prio[j])
    free = [s for s in range(len(held)) if not (held[s] >= 0 and held[s] in wanted)]
    free.sort(key=lambda s: last[s])
    admitted = []
    for j, s in zip(missing[:cap], free):
        held[s], last[s] = want[j], step
        admitted.append((s, want[j]))
    return held, last, admitted


def plan_slots_ref(block: torch.Tensor, last_used: torch.Tensor, slot_of: torch.Tensor, lanes: torch.Tensor,
                   want: torch.Tensor, scores: torch.Tensor, cap: int, step: int) -> list[tuple[int, int, int, int]]:
    """`plan_slots` by `plan_slot_rule` (a wanted block's priority: its score), in place (the
    inverse map rebuilt from the table); returns the admissions as (row of lanes, head, slot,
    block), in (row, head, rank) order."""
    out = []
    for i, lane in enumerate(lanes.tolist()):
        for h in range(block.shape[1]):
            row = want[i, h].tolist()
            prio = [float(scores[i, h, b]) if b >= 0 else 0.0 for b in row]
            held, last, adm = plan_slot_rule(block[lane, h].tolist(), last_used[lane, h].tolist(), row, prio, cap,
                                             step)
            block[lane, h] = torch.tensor(held)
            last_used[lane, h] = torch.tensor(last)
            slot_of[lane, h] = -1
            for s, b in enumerate(held):
                if b >= 0:
                    slot_of[lane, h, b] = s
            out += [(i, h, s, b) for s, b in adm]
    return out


def lookahead_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_mask: torch.Tensor,
                            k_extra: torch.Tensor, v_extra: torch.Tensor, extra_mask: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """q [B, R, H, D], k/v [B, KVH, N, D], k_extra/v_extra [B, KVH, E, D] -> out [B, R, H, D].

    Per (b, r, h): collect the visible keys, softmax in fp32; no visible key -> zeros.
    K/V (and the extras) may be stored narrower than a float32 q (float16 / bfloat16): every
    key and value is widened to fp32 first.
    """
    B, R, H, D = q.shape
    num_kv_heads = k.shape[1]
    group = H // num_kv_heads
    out = torch.zeros((B, R, H, D), dtype=torch.float32, device=q.device)
    for b in range(B):
        for r in range(R):
            for h in range(H):
                g = h // group
                keys = torch.cat([k[b, g][kv_mask[b, g]].float(), k_extra[b, g][extra_mask[b, r]].float()])
                values = torch.cat([v[b, g][kv_mask[b, g]].float(), v_extra[b, g][extra_mask[b, r]].float()])
                if keys.shape[0] == 0:
                    continue                                  # defined behaviour: zeros
                weights = torch.softmax(keys @ q[b, r, h].float() * scale, dim=0)
                out[b, r, h] = weights @ values
    return out.to(q.dtype)


def linear_int8_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only int8 linear: x [M, K] fp32, qweight [N, K] int8, scale fp32 [N] (per output
    channel) or [N, K // G] (per group of G consecutive inputs), bias [N] | None -> [M, N] fp32
    = x @ W.T + bias, W[n, k] = qweight[n, k] * scale[n, k // G] (G = K per output channel)."""
    N, K = qweight.shape
    s = scale.to(torch.float64).reshape(N, -1)                             # [N, K // G]
    assert K % s.shape[1] == 0, f"scale {list(scale.shape)} does not divide K = {K} into groups"
    w = qweight.to(torch.float64) * s.repeat_interleave(K // s.shape[1], dim=1)
    y = x.to(torch.float64) @ w.T
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(torch.float32)


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (nearest even) and widened back to fp32: what the prefill kernels compute with."""
    return x.to(torch.bfloat16).float()


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: list[int],
                          context_len: int, scale: float) -> torch.Tensor:
    """Causal attention of n new rows over a sequence's first `context_len` keys in one pool layer:
    q [n, H, D], k/v [KVH, NB, bs, D], block_table (ceil(L / bs) blocks) -> [n, H, D] fp32, row i
    at position L - n + i seeing keys 0 .. L - n + i; the keys gathered by the table, the mask
    explicit, in float64."""
    n, H, D = q.shape
    kvh, _, bs, _ = k.shape
    L, G = context_len, H // kvh
    blocks = torch.as_tensor(block_table[: -(-L // bs)], dtype=torch.long)
    kc = k[:, blocks].reshape(kvh, -1, D)[:, :L].double()
    vc = v[:, blocks].reshape(kvh, -1, D)[:, :L].double()
    out = torch.empty(n, H, D, dtype=torch.float64)
    pos = torch.arange(L - n, L)
    mask = torch.arange(L)[None, :] <= pos[:, None]                          # [n, L]
    for h in range(H):
        s = (q[:, h].double() @ kc[h // G].T) * scale
        out[:, h] = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ vc[h // G]
    return out.float()


def linear_bf16_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 prefill GEMM's math: x [M, K] and weight [N, K] rounded to bf16, products and sums
    in float64 -> [M, N] fp32 (+ bias)."""
    y = bf16_round(x).double() @ bf16_round(weight).double().T
    return (y if bias is None else y + bias.double()).float()


def quantize_rows_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (q [M, K] int8, s [M, K // group] fp32): per row and group of `group`
    inputs, s = max|x| / 127 (1 for an all-zero group), q = round-half-even(x / s)."""
    M, K = x.shape
    xg = x.view(M, K // group, group)
    amax = xg.abs().amax(-1)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(xg / s[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(M, K), s


def linear_w8a8_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The int8 prefill GEMM's math: x quantized per row and group of G (`quantize_rows_ref`, G the
    weight's group: K // scale.shape[1]), the group's integer dot products scaled by both scales,
    summed in float64 -> [M, N] fp32 (+ bias). qweight [N, K] int8, scale [N] or [N, K // G]."""
    M, K = x.shape
    N = qweight.shape[0]
    scale = scale.reshape(N, -1)                                             # [N] -> [N, 1]: G = K
    G = K // scale.shape[1]
    q, s = quantize_rows_ref(x, G)
    dots = torch.einsum("mgk,ngk->mng", q.view(M, -1, G).double(), qweight.view(N, -1, G).double())  # exact ints
    y = (dots * s.double()[:, None, :] * scale.double()[None]).sum(-1)
    return (y if bias is None else y + bias.double()).float()
