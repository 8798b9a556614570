"""Kernel-vs-reference checks for the CUDA kernels, shared by tests and `bench/gpu_kernels.py`.

Every check draws fresh random inputs (never zeros) on the GPU, poisons each output first (NaN
for floats, -7 for ids) so an element the kernel never writes fails, calls the extension entry
points that ``torch.ops.lookahead`` dispatches to, and compares with ``plugins.reference`` under
its dtype-keyed tolerances. ``large=True`` cases put the touched data past 2^31 elements
(4-8 GB of GPU memory each) to catch 32-bit index overflow. Needs a CUDA device.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from plugins import reference
from plugins.cuda.loader import load_extension
from plugins.reference import TOLERANCES

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LARGE = 2**31 + 2**20                      # elements: past every int32 offset


@dataclass(frozen=True)
class Target:
    """Where checks run: a device and an object with the extension's entry points.

    The default is the CUDA extension on the current GPU; tests of the checks themselves pass
    a CPU device and torch-implemented entry points.
    """
    device: str
    ext: object


def cuda_target() -> Target:
    return Target("cuda", load_extension())


@dataclass(frozen=True)
class Check:
    op: str
    dtype: str
    case: str
    ok: bool
    max_abs_err: float
    detail: str = ""


def _compare(op: str, dtype: torch.dtype, case: str, actual: torch.Tensor, expected: torch.Tensor,
             exact: bool = False, tol_dtype: torch.dtype | None = None) -> Check:
    name = str(dtype).removeprefix("torch.")
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    if a.shape != e.shape:
        return Check(op, name, case, False, float("inf"), f"shape {tuple(a.shape)} != {tuple(e.shape)}")
    atol, rtol = (0.0, 0.0) if exact else TOLERANCES[tol_dtype or dtype]
    unwritten = int((torch.isnan(a) & ~torch.isnan(e)).sum())    # poison left over
    same = a == e                                                # equal infinities included
    err = torch.where(same, 0.0, (a - e).abs())
    ok = unwritten == 0 and bool((same | (err <= atol + rtol * e.abs())).all())
    max_err = float(err.nan_to_num(float("inf")).max()) if err.numel() else 0.0
    return Check(op, name, case, ok, max_err, f"{unwritten} elements left NaN (unwritten?)" if unwritten else "")


def _gen(seed: int, device: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(shape, dtype, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=gen.device, dtype=torch.float32).to(dtype)


# --- block_gather ---------------------------------------------------------------------------

def check_block_gather(dtype: torch.dtype, case: str, target: Target | None = None, seed: int = 0) -> Check:
    """case: "device" | "host" (pinned src) | "unaligned" (src at a 1-element offset) | "large"."""
    target = target or cuda_target()
    gen = _gen(seed, target.device)
    num_kv_heads, block_size, head_dim, n = 4, 16, 64, 48
    per_block = num_kv_heads * block_size * head_dim
    num_blocks = LARGE // per_block + 2 if case == "large" else 96
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    if case == "large":   # fill only the blocks read, all past 2^31 elements but one
        src = torch.empty(shape, dtype=dtype, device=gen.device)
        ids = torch.randint(num_blocks - 64, num_blocks, (num_kv_heads, n), generator=gen, device=gen.device)
        ids[:, 0] = 3
        used = ids.unique()
        src[used] = _randn((used.numel(), *shape[1:]), dtype, gen)
    else:
        src = _randn(shape, dtype, gen)
        if case == "unaligned":
            flat = torch.empty(src.numel() + 1, dtype=dtype, device=gen.device)
            flat[1:] = src.flatten()
            src = flat[1:].view(shape)
        elif case == "host":
            src = src.cpu().pin_memory() if torch.cuda.is_available() else src.cpu()
        ids = torch.randint(0, num_blocks, (num_kv_heads, n), generator=gen, device=gen.device)
    out = torch.full((num_kv_heads, n, block_size, head_dim), float("nan"), dtype=dtype, device=gen.device)
    target.ext.block_gather_out(src, ids, out)
    expected = reference.block_gather_ref(src, ids.to(src.device))
    return _compare("block_gather", dtype, case, out, expected, exact=True)


# --- block_topk -----------------------------------------------------------------------------

def _summaries(shape, dtype, gen, integer: bool) -> tuple[torch.Tensor, torch.Tensor]:
    draw = ((lambda: torch.randint(-2, 3, shape, generator=gen, device=gen.device, dtype=dtype)) if integer
            else (lambda: _randn(shape, dtype, gen)))
    a, b = draw(), draw()
    return torch.minimum(a, b), torch.maximum(a, b)


def _topk_from_scores(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """The contract's selection from given scores: stable (ties to the lower id), ascending, -1 padded."""
    num_blocks = scores.shape[-1]
    top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    top = top.masked_fill(torch.arange(k, device=scores.device) >= valid.sum(-1).view(-1, 1, 1), num_blocks)
    top = torch.sort(top, dim=-1).values
    return top.masked_fill(top == num_blocks, -1)


def _scores_chunked(q, kmin, kmax, valid, group_score: str = "sum", chunk: int = 1 << 15) -> torch.Tensor:
    """Vectorised reference scores, in chunks of blocks (the large case does not fit at once)."""
    B, H, D = q.shape
    num_blocks, num_kv_heads = kmin.shape[1], kmin.shape[2]
    qg = q.float().view(B, 1, num_kv_heads, H // num_kv_heads, D)
    parts = []
    for s in range(0, num_blocks, chunk):
        lo, hi = kmin[:, s:s + chunk].float().unsqueeze(3), kmax[:, s:s + chunk].float().unsqueeze(3)
        per_head = torch.maximum(qg * lo, qg * hi).sum(4)                  # [B, chunk, KVH, G]
        parts.append(per_head.sum(3) if group_score == "sum" else per_head.amax(3))
    scores = torch.cat(parts, 1).transpose(1, 2)
    return scores.masked_fill(~valid.unsqueeze(1), float("-inf"))


def _run_topk(ext, q, kmin, kmax, valid, k, group_score) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, D] or [B, R, H, D] (valid [B, NB] or [B, R, NB]): the extension takes R rows per
    sequence flat, in one launch."""
    B, num_blocks, num_kv_heads, _ = kmin.shape
    lead = tuple(q.shape[:-2])
    rows = q.reshape(-1, *q.shape[-2:])
    indices = torch.full((rows.shape[0], num_kv_heads, k), -7, dtype=torch.int64, device=q.device)
    scores = torch.full((rows.shape[0], num_kv_heads, num_blocks), float("nan"), device=q.device)
    ext.block_topk_out(rows, kmin, kmax, valid.reshape(-1, num_blocks), k, group_score == "max", indices, scores)
    return indices.view(*lead, num_kv_heads, k), scores.view(*lead, num_kv_heads, num_blocks)


def check_block_topk(dtype: torch.dtype, case: str, target: Target | None = None, seed: int = 0) -> list[Check]:
    """case: "integer" (exact scores, many ties) | "ties" (every block scores the same) | "random"
    | "rows" (a decode step's two query rows per sequence, each with its own valid blocks, one
    launch) | "large" (2^31+ summary elements); a "_max" suffix scores a GQA group by its best head."""
    target = target or cuda_target()
    group_score = "max" if case.endswith("_max") else "sum"
    case = case.removesuffix("_max")
    gen = _gen(seed, target.device)
    if case == "large":
        B, H, num_kv_heads, D, num_blocks, k = 1, 32, 8, 128, LARGE // (8 * 128) + 1, 128
    else:
        B, H, num_kv_heads, D, num_blocks, k = 3, 6, 2, 64, 300, 32
    exact = case != "random"   # small integers: every sum is exact in fp32, in any order
    lead = (B, 2) if case == "rows" else (B,)
    q = (torch.randint(-1, 2, (*lead, H, D), generator=gen, device=gen.device, dtype=dtype) if exact
         else _randn((*lead, H, D), dtype, gen))
    kmin, kmax = _summaries((B, num_blocks, num_kv_heads, D), dtype, gen, integer=exact)
    if case == "ties":
        kmin.fill_(1.0)
        kmax.fill_(1.0)
    valid = torch.rand((*lead, num_blocks), generator=gen, device=gen.device) < 0.8
    if B > 1:                              # the last sequence has fewer valid blocks than k: a -1 tail
        valid[-1] = False
        valid[-1, ..., :5] = True
    indices, scores = _run_topk(target.ext, q, kmin, kmax, valid, k, group_score)
    if case == "large":
        exp_scores = _scores_chunked(q, kmin, kmax, valid, group_score)
        exp_indices = _topk_from_scores(exp_scores, valid, k)
    elif exact:
        exp_indices, exp_scores = reference.block_topk_ref(q.cpu(), kmin.cpu(), kmax.cpu(), valid.cpu(), k,
                                                           group_score)
    else:   # float sums differ in the last bits: indices must follow the kernel's own scores
        _, exp_scores = reference.block_topk_ref(q.cpu(), kmin.cpu(), kmax.cpu(), valid.cpu(), k, group_score)
        exp_indices = _topk_from_scores(scores, valid, k)
    # Scores are fp32 sums whatever the input dtype: fp32 tolerance.
    case = case + ("_max" if group_score == "max" else "")
    score_check = _compare("block_topk.scores", dtype, case, scores, exp_scores, exact=exact,
                           tol_dtype=torch.float32)
    index_check = _compare("block_topk.indices", dtype, case, indices, exp_indices, exact=True)
    return [score_check, index_check]


# --- update_summaries -----------------------------------------------------------------------

def _summary_tokens(case: str, num_blocks: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids and offsets of one call: runs, a mid-block start, a reused block, a late repeat."""
    if case == "decode":
        ids = torch.randperm(num_blocks, generator=gen, device=gen.device)[:8]
        offsets = torch.randint(0, 16, (8,), generator=gen, device=gen.device)
        offsets[:2] = 0
        return ids, offsets
    if case == "large":   # the last blocks: their summaries start past 2^31 elements
        blocks = num_blocks - 1 - torch.arange(5, device=gen.device)
    else:
        blocks = torch.randperm(num_blocks, generator=gen, device=gen.device)[:5]
    b = [int(x) for x in blocks]
    pairs = ([(b[0], o) for o in range(9, 16)]                    # continues an existing block
             + [(b[1], o) for o in range(16)] + [(b[2], o) for o in range(5)]
             + [(b[3], o) for o in range(3, 7)] + [(b[3], o) for o in range(0, 3)]   # reset mid-call
             + [(b[4], 2)] + [(b[1], 0), (b[1], 1)] + [(b[2], 5)])                    # later repeats
    ids = torch.tensor([p[0] for p in pairs], device=gen.device)
    offsets = torch.tensor([p[1] for p in pairs], device=gen.device)
    return ids, offsets


def check_update_summaries(dtype: torch.dtype, case: str, target: Target | None = None, seed: int = 0) -> Check:
    """case: "prefill" (runs, resets, repeats) | "decode" (one token per block) | "large"."""
    target = target or cuda_target()
    gen = _gen(seed, target.device)
    num_kv_heads, D = (8, 128) if case == "large" else (2, 64)
    num_blocks = LARGE // (num_kv_heads * D) + 1 if case == "large" else 64
    ids, offsets = _summary_tokens(case, num_blocks, gen)
    keys = _randn((ids.numel(), num_kv_heads, D), dtype, gen)
    if case == "large":     # only the touched blocks (and two NaN sentinels) hold defined values
        kmin = torch.empty((num_blocks, num_kv_heads, D), dtype=dtype, device=gen.device)
        kmax = torch.empty_like(kmin)
        touched = ids.unique()
        sentinels = torch.tensor([0, int(touched.min()) - 1], device=gen.device)
        for t in (kmin, kmax):
            t[touched] = _randn((touched.numel(), num_kv_heads, D), dtype, gen)
            t[sentinels] = float("nan")
        exp_min, exp_max = kmin[touched].clone(), kmax[touched].clone()
        slot = torch.searchsorted(touched, ids)
        reference.update_summaries_ref(exp_min, exp_max, keys, slot, offsets)
        target.ext.update_summaries(kmin, kmax, keys, ids, offsets)
        got = torch.stack([kmin[touched], kmax[touched]])
        check = _compare("update_summaries", dtype, case, got, torch.stack([exp_min, exp_max]), exact=True)
        kept = bool(torch.isnan(kmin[sentinels]).all() and torch.isnan(kmax[sentinels]).all())
        if not kept:
            return Check(check.op, check.dtype, case, False, check.max_abs_err, "wrote an untouched block")
        return check
    kmin, kmax = _summaries((num_blocks, num_kv_heads, D), dtype, gen, integer=False)
    exp_min, exp_max = kmin.clone(), kmax.clone()
    reference.update_summaries_ref(exp_min, exp_max, keys, ids, offsets)
    target.ext.update_summaries(kmin, kmax, keys, ids, offsets)
    return _compare("update_summaries", dtype, case, torch.stack([kmin, kmax]), torch.stack([exp_min, exp_max]),
                    exact=True)


# --- lookahead_attention --------------------------------------------------------------------

ATTENTION_CASES = {
    # name: (B, R, H, KVH, N, E, D)
    "smollm2": (2, 2, 9, 3, 1000, 2, 64),     # GQA group 3: 6 queries per KV head
    "llama8b": (2, 2, 32, 8, 300, 2, 128),    # N not a multiple of the 32-key tile
    "group16": (1, 2, 32, 2, 700, 2, 256),    # 32 queries per KV head: two query chunks
    "long": (1, 2, 8, 2, 8192, 2, 128),       # many key splits, merged by combine_kernel
    "short": (4, 2, 8, 2, 100, 2, 64),        # one split: the kernel writes the output itself
    "large": (1, 2, 32, 8, LARGE // (8 * 128) + 1, 2, 128),
}


def _attention_inputs(case: str, dtype: torch.dtype, gen) -> dict:
    B, R, H, num_kv_heads, N, E, D = ATTENTION_CASES[case]
    extra_mask = torch.ones((B, R, E), dtype=torch.bool, device=gen.device)
    extra_mask[:, 0, 1:] = False            # the real row does not see the draft row
    if case == "large":     # a sparse selection at both ends; the rest is never written
        kv_mask = torch.zeros((B, num_kv_heads, N), dtype=torch.bool, device=gen.device)
        kv_mask[..., :64] = True
        kv_mask[..., -2048:] = True
        k = torch.empty((B, num_kv_heads, N, D), dtype=dtype, device=gen.device)
        v = torch.empty_like(k)
        for t in (k, v):
            t[..., :64, :] = _randn((B, num_kv_heads, 64, D), dtype, gen)
            t[..., -2048:, :] = _randn((B, num_kv_heads, 2048, D), dtype, gen)
    else:
        kv_mask = torch.rand((B, num_kv_heads, N), generator=gen, device=gen.device) < 0.7
        if B > 1:
            kv_mask[1] = False              # sequence 1, row 0 sees no key at all: zeros
            extra_mask[1, 0] = False
        k, v = _randn((B, num_kv_heads, N, D), dtype, gen), _randn((B, num_kv_heads, N, D), dtype, gen)
        # Hidden keys hold NaN: a kernel that lets them into P @ V fails.
        k.masked_fill_(~kv_mask.unsqueeze(-1), float("nan"))
        v.masked_fill_(~kv_mask.unsqueeze(-1), float("nan"))
    extra_shape = (B, num_kv_heads, E, D)
    return dict(q=_randn((B, R, H, D), dtype, gen), k=k, v=v, kv_mask=kv_mask, k_extra=_randn(extra_shape, dtype, gen),
                v_extra=_randn(extra_shape, dtype, gen), extra_mask=extra_mask, scale=D ** -0.5)


def check_lookahead_attention(dtype: torch.dtype, case: str, target: Target | None = None, seed: int = 0) -> Check:
    target = target or cuda_target()
    args = _attention_inputs(case, dtype, _gen(seed, target.device))
    out = torch.full_like(args["q"], float("nan"))
    target.ext.lookahead_attention_out(*args.values(), out)
    expected = reference.lookahead_attention_ref(**args)
    return _compare("lookahead_attention", dtype, case, out, expected)


# --- copy_blocks ----------------------------------------------------------------------------

def check_copy_blocks(dtype: torch.dtype, case: str, target: Target | None = None, seed: int = 0) -> Check:
    """case: "device" | "host" (a pinned, head-major pool: the runtime's) | "large" (source
    blocks past 2^31 elements). A fixed-capacity job: a third of the entries skipped (some naming
    block -1); every destination slot is poisoned first, and the skipped ones must keep it."""
    target = target or cuda_target()
    gen = _gen(seed, target.device)
    kvh, block_size, head_dim, lanes, slots, n = 4, 16, 64, 3, 24, 40
    per_block = kvh * block_size * head_dim
    num_blocks = LARGE // per_block + 2 if case == "large" else 96
    if case == "host":                                        # [KVH, NB, bs, D] viewed as [NB, KVH, bs, D]
        src_k, src_v = (_randn((kvh, num_blocks, block_size, head_dim), dtype, gen).transpose(0, 1) for _ in range(2))
    elif case == "large":                                     # only the blocks read are filled
        src_k, src_v = (torch.empty((num_blocks, kvh, block_size, head_dim), dtype=dtype, device=gen.device)
                        for _ in range(2))
    else:
        src_k, src_v = (_randn((num_blocks, kvh, block_size, head_dim), dtype, gen) for _ in range(2))
    low = num_blocks - 64 if case == "large" else 0
    blocks = torch.randint(low, num_blocks, (n,), generator=gen, device=gen.device)
    if case == "large":
        used = blocks.unique()
        for t in (src_k, src_v):
            t[used] = _randn((used.numel(), kvh, block_size, head_dim), dtype, gen)
    dest = torch.randperm(lanes * kvh * slots, generator=gen, device=gen.device)[:n]     # distinct
    lane_ix, dst_heads, slot_ix = dest // (kvh * slots), dest // slots % kvh, dest % slots
    src_heads = torch.randint(0, kvh, (n,), generator=gen, device=gen.device)
    valid = torch.rand(n, generator=gen, device=gen.device) < 0.67
    blocks = torch.where(valid | (torch.arange(n, device=gen.device) % 2 == 0), blocks, -1)
    if case == "host" and torch.cuda.is_available():
        src_k, src_v = (t.cpu().pin_memory() for t in (src_k, src_v))
    elif case == "host":
        src_k, src_v = src_k.cpu(), src_v.cpu()
    dst_k, dst_v = (torch.full((lanes, kvh, slots, block_size, head_dim), float("nan"), dtype=dtype,
                               device=gen.device) for _ in range(2))
    target.ext.copy_blocks(src_k, src_v, dst_k, dst_v, blocks, src_heads, lane_ix, dst_heads, slot_ix, valid)
    want_k, want_v = (torch.full_like(dst_k, float("nan")) for _ in range(2))
    for i in valid.nonzero().flatten().tolist():
        b, sh = int(blocks[i]), int(src_heads[i])
        want_k[lane_ix[i], dst_heads[i], slot_ix[i]] = src_k[b, sh].to(want_k.device)
        want_v[lane_ix[i], dst_heads[i], slot_ix[i]] = src_v[b, sh].to(want_v.device)
    got, want = torch.stack([dst_k, dst_v]).nan_to_num(7.0), torch.stack([want_k, want_v]).nan_to_num(7.0)
    return _compare("copy_blocks", dtype, case, got, want, exact=True)


# --- plan_slots -----------------------------------------------------------------------------

def _plan_requests(held: torch.Tensor, top_k: int, max_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """want [B, KVH, top_k]: per (lane, head), ~70 % of its held blocks kept, fresh distinct
    blocks after them, the last 3 entries padding (-1), as a short context's top-K has."""
    want = torch.full(held.shape, -1, dtype=torch.long)
    for i in range(held.shape[0]):
        for h in range(held.shape[1]):
            kept = [b for b in held[i, h].tolist() if b >= 0 and torch.rand(1, generator=gen).item() < 0.7]
            fresh = [b for b in torch.randperm(max_blocks, generator=gen).tolist() if b not in kept]
            row = (kept + fresh)[: top_k - 3]
            want[i, h, : len(row)] = torch.tensor(row)[torch.randperm(len(row), generator=gen)]
    return want


def check_plan_slots(dtype: torch.dtype, case: str, target: Target | None = None, seed: int = 0) -> Check:
    """case: "decode" (a capped plan of 5 of 8 lanes) | "seed" (every lane, cap = K). Five plans
    in a row on the same tables; each one's lists and tables must equal the reference's
    admissions (`plugins.reference.plan_slots_ref`) and the torch implementation's lists (every
    rank, taken or not), exactly. The op has no float data: `dtype` only names the run."""
    from plugins.plan import _plan_slots_impl

    target = target or cuda_target()
    gen = torch.Generator().manual_seed(seed)                 # drawn on the host: the reference runs there
    lanes_total, kvh, top_k, max_blocks = 8, 4, 64, 512
    table = (torch.full((lanes_total, kvh, top_k), -1, dtype=torch.long),
             torch.full((lanes_total, kvh, top_k), -1, dtype=torch.long),
             torch.full((lanes_total, kvh, max_blocks + 1), -1, dtype=torch.long))
    ref_table, impl_table = [t.clone() for t in table], [t.clone() for t in table]
    dev_table = [t.to(target.device) for t in table]
    bad = []
    for step in range(1, 6):
        lanes = torch.randperm(lanes_total, generator=gen)[: 5 if case == "decode" else lanes_total]
        want = _plan_requests(ref_table[0][lanes], top_k, max_blocks, gen)
        scores = torch.randint(0, 6, (*want.shape[:2], max_blocks), generator=gen).float()   # ties on purpose
        cap = 13 if case == "decode" else top_k
        n = lanes.numel() * kvh * cap
        got = [torch.full((n,), -7, dtype=torch.long, device=target.device) for _ in range(2)]
        got.append(torch.zeros(n, dtype=torch.bool, device=target.device))
        target.ext.plan_slots_out(*dev_table, lanes.to(target.device), want.to(target.device),
                                  scores.to(target.device), cap, step, *got)
        got = [t.cpu() for t in got]
        expected = _plan_slots_impl(*impl_table, lanes, want, scores, cap, step)
        admitted = reference.plan_slots_ref(*ref_table, lanes, want, scores, cap, step)
        slots, blocks, valid = (t.tolist() for t in got)
        taken = [(i // (kvh * cap), i // cap % kvh, slots[i], blocks[i]) for i in range(n) if valid[i]]
        if taken != admitted:
            bad.append(f"step {step}: admissions differ from the reference")
        if not all(torch.equal(g, e) for g, e in zip(got, expected)):
            bad.append(f"step {step}: lists differ from the torch implementation")
        if not all(torch.equal(d.cpu(), r) for d, r in zip(dev_table, ref_table)):
            bad.append(f"step {step}: tables differ from the reference")
    return Check("plan_slots", str(dtype).removeprefix("torch."), case, not bad, 0.0 if not bad else float("inf"),
                 "; ".join(bad))


# --- all of them ----------------------------------------------------------------------------

SMALL_CASES = {
    check_block_gather: ("device", "host", "unaligned"),
    check_block_topk: ("integer", "ties", "random", "integer_max", "random_max", "rows", "rows_max"),
    check_update_summaries: ("prefill", "decode"),
    check_lookahead_attention: ("smollm2", "llama8b", "group16", "long", "short"),
    check_plan_slots: ("decode", "seed"),
    check_copy_blocks: ("device", "host"),
}
# ops without a case past 2^31 elements: the reason (the large sets leave them out)
NO_LARGE_CASE = {
    check_plan_slots: "its tables are int64: 2^31 elements are 16 GB a table; every offset is computed in int64",
}
LARGE_CASES = tuple(fn for fn in SMALL_CASES if fn not in NO_LARGE_CASE)


def run_checks(large: bool = True, target: Target | None = None) -> Iterator[Check]:
    """Every (op, dtype, case), large cases (bf16, 4-16 GB each) last. An exception in a check
    is reported as a failed Check, so one broken kernel does not hide the others."""
    target = target or cuda_target()
    plan = [(fn, dtype, case) for dtype in DTYPES for fn, cases in SMALL_CASES.items() for case in cases]
    if large:
        plan += [(fn, torch.bfloat16, "large") for fn in LARGE_CASES]
    for fn, dtype, case in plan:
        try:
            result = fn(dtype, case, target)
        except Exception as e:  # noqa: BLE001 - reported, not swallowed
            result = Check(fn.__name__.removeprefix("check_"), str(dtype).removeprefix("torch."), case, False,
                           float("nan"), f"{type(e).__name__}: {e}")
        finally:
            if target.device != "cpu":
                torch.cuda.empty_cache()  # the large cases need their gigabytes back
        yield from (result if isinstance(result, list) else [result])
