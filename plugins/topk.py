"""`lookahead::block_topk`: Quest upper-bound block scores and the head-wise top-K per KV head."""
from __future__ import annotations

import torch

from ._common import FLOAT_DTYPES, check_same, check_shape, check_tensor, define_op, fail


GROUP_SCORES = ("sum", "max")
NARROW_SUMMARY_DTYPES = (torch.float16, torch.bfloat16)   # summaries in the KV storage dtype, fp32 queries      # how a GQA group's query heads combine into a KV head's score


def _group_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, group_score: str) -> torch.Tensor:
    """q [B, R, H, D], kmin/kmax [B, NB, KVH, D] -> fp32 group scores [B, R, KVH, NB].

    With kmin <= kmax, max(q_d*kmin_d, q_d*kmax_d) = relu(q_d)*kmax_d + min(q_d, 0)*kmin_d, which
    is linear in q. "sum": a GQA group's heads fold into one weight pair per KV head before
    touching the summaries; "max": each head keeps its own pair and the group takes the largest
    head score. Reading the summaries is the whole cost, so each is read once, in its native
    layout, by one bmm of all rows' and heads' weights ([R*KVH*G', D], the small side first: BLAS
    runs that shape several times faster than the transposed one) against its (block, head)
    columns, keeping the matching KV head (the diagonal); the extra arithmetic is free next to
    the memory traffic, and unlike a broadcast multiply it allocates no summary-sized temporary.
    R query rows per sequence (e.g. the real and the draft token) share that one read.
    """
    B, R, H, D = q.shape
    num_blocks, num_kv_heads = kmin.shape[1], kmin.shape[2]
    qf = q.float().reshape(B, R, num_kv_heads, H // num_kv_heads, D)
    w_max, w_min = qf.clamp_min(0), qf.clamp_max(0)                              # [B, R, KVH, G, D]
    if group_score == "sum":
        w_max, w_min = w_max.sum(3, keepdim=True), w_min.sum(3, keepdim=True)  # G' = 1
    g = w_max.shape[3]
    cols = (B, num_blocks * num_kv_heads, D)
    scores = torch.bmm(w_max.reshape(B, -1, D), kmax.float().reshape(cols).transpose(1, 2))
    scores = scores.baddbmm_(w_min.reshape(B, -1, D), kmin.float().reshape(cols).transpose(1, 2))
    scores = scores.view(B, R, num_kv_heads, g, num_blocks, num_kv_heads).diagonal(dim1=2, dim2=5)
    scores = scores[:, :, 0] if g == 1 else scores.amax(2)                       # [B, R, NB, KVH]
    return scores.permute(0, 1, 3, 2).contiguous()                               # [B, R, KVH, NB]


def _rank_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores [..., NB] -> distinct int64 keys ordered by (score desc, block id asc).

    torch.topk leaves the order of equal values unspecified; folding the block id into the key
    makes every key distinct, so topk is exact (and much cheaper than a stable full sort).
    """
    num_blocks = scores.shape[-1]
    # +0.0 turns -0.0 into +0.0: they compare equal as floats but not as bit patterns.
    bits = (scores + 0.0).view(torch.int32).to(torch.int64)
    # IEEE-754 bits order positive floats like ints; negative ones in reverse: flip their
    # magnitude bits so the int order is the float order across the whole line, -inf lowest.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    tiebreak = (num_blocks - 1) - torch.arange(num_blocks, device=scores.device)  # lower id wins
    return (ordered << 32) | tiebreak


def _block_topk_impl(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, valid: torch.Tensor,
                     k: int, group_score: str = "sum") -> tuple[torch.Tensor, torch.Tensor]:
    B, num_blocks, num_kv_heads, _ = kmin.shape
    rows = q.dim() == 4                          # [B, R, H, D]: R query rows per sequence
    q4, v3 = (q, valid) if rows else (q.unsqueeze(1), valid.unsqueeze(1))
    R = q4.shape[1]
    # Masked after scoring: an empty block's +-inf summary may score NaN; the fill overwrites it.
    scores = _group_scores(q4, kmin, kmax, group_score).masked_fill_(~v3.unsqueeze(2), float("-inf"))
    scores = scores.view(B * R, num_kv_heads, num_blocks)
    v2 = v3.reshape(B * R, num_blocks)

    top = torch.topk(_rank_keys(scores), k, dim=-1, sorted=False).values
    top = (num_blocks - 1) - (top & 0xFFFFFFFF)                         # block ids [B*R, KVH, k]
    # Valid blocks score finitely and rank first; what else was picked is padding (k > #valid).
    picked_valid = torch.gather(v2.unsqueeze(1).expand(B * R, num_kv_heads, num_blocks), -1, top)
    top = torch.sort(top.masked_fill(~picked_valid, num_blocks), dim=-1).values  # padding last
    top = top.masked_fill(top == num_blocks, -1)
    if rows:
        return top.view(B, R, num_kv_heads, k), scores.view(B, R, num_kv_heads, num_blocks)
    return top, scores


def _block_topk_fake(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, valid: torch.Tensor,
                     k: int, group_score: str = "sum") -> tuple[torch.Tensor, torch.Tensor]:
    B, num_blocks, num_kv_heads, _ = kmin.shape
    lead = tuple(q.shape[:-2])                   # (B,) or (B, R)
    return (q.new_empty((*lead, num_kv_heads, k), dtype=torch.int64),
            q.new_empty((*lead, num_kv_heads, num_blocks), dtype=torch.float32))


define_op("block_topk", _block_topk_impl, _block_topk_fake)


def block_topk(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, valid: torch.Tensor,
               k: int, group_score: str = "sum", *, impl=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Score blocks by the Quest upper bound and select the top ``k`` per KV head.

    For query head h and block n, ``s_h(n) = sum_d max(q[h,d]*kmin[n,d], q[h,d]*kmax[n,d])``
    (fp32), an upper bound of ``q_h . key`` over the block's keys. A KV head's score combines the
    query heads of its GQA group (``h // (H // KVH) == kv_head``): their sum (``group_score="sum"``,
    the original design's rule) or their maximum (``"max"``: a block one head needs is not outvoted by the
    group's other heads).

    Parameters
    ----------
    q : Tensor, [B, H, D] or [B, R, H, D], float32/float16/bfloat16
        One query per sequence (e.g. the draft row), post-RoPE; or R query rows per sequence (the
        real and the draft token of a decode step), scored in one read of the summaries.
    kmin, kmax : Tensor, [B, NB, KVH, D], dtype of ``q``, or float16 / bfloat16 with a float32 ``q``
        Per-block coordinate-wise min / max of the post-RoPE keys; ``kmin <= kmax`` on valid blocks.
        Kept in the KV cache's storage dtype, they are values of it (a min or max of keys), and the
        scores widen them exactly.
    valid : Tensor, [B, NB] (or [B, R, NB] with 4-D q), bool
        Blocks that hold at least one key; the others score ``-inf`` and are never selected.
    k : int
        Blocks to select per (sequence, KV head), ``1 <= k <= NB``.
    group_score : str
        ``"sum"`` or ``"max"`` over the GQA group's query heads.
    impl : callable, optional
        What runs the checked arguments (an engine's kernel table entry); default the dispatcher.

    Returns
    -------
    indices : Tensor, [B, KVH, k] (or [B, R, KVH, k]), int64
        The selected block ids, ascending; where fewer than ``k`` blocks are valid, the row's
        tail is ``-1``. Ties in score go to the lower block id.
    scores : Tensor, [B, KVH, NB] (or [B, R, KVH, NB]), float32
        The group scores, ``-inf`` on invalid blocks.
    """
    check_tensor("q", q, q.dim() if isinstance(q, torch.Tensor) and q.dim() in (3, 4) else 3, FLOAT_DTYPES)
    check_tensor("kmin", kmin, 4, FLOAT_DTYPES)
    if not (q.dtype == torch.float32 and kmin.dtype in NARROW_SUMMARY_DTYPES):
        check_same("kmin", kmin, "q", q)
    elif kmin.device != q.device:
        fail("kmin", f"device {kmin.device} differs from q's {q.device}")
    check_same("kmax", kmax, "kmin", kmin)
    check_shape("kmax", kmax, kmin.shape, "[B, NB, KVH, D] like kmin")
    B, H, D = q.shape[0], q.shape[-2], q.shape[-1]
    lead = tuple(q.shape[:-2])                   # (B,) or (B, R)
    num_blocks, num_kv_heads = kmin.shape[1], kmin.shape[2]
    if kmin.shape[0] != B or kmin.shape[3] != D:
        fail("kmin", f"expected [B={B}, NB, KVH, D={D}] to match q, got {tuple(kmin.shape)}")
    if H % num_kv_heads:
        fail("kmin", f"num_kv_heads={num_kv_heads} (dim 2) does not divide q's num_heads={H}")
    check_tensor("valid", valid, len(lead) + 1, torch.bool)
    check_shape("valid", valid, (*lead, num_blocks), "[B, NB]" if len(lead) == 1 else "[B, R, NB]")
    if valid.device != q.device:
        fail("valid", f"device {valid.device} differs from q's {q.device}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= num_blocks:
        fail("k", f"must be an int in [1, NB={num_blocks}], got {k!r}")
    if group_score not in GROUP_SCORES:
        fail("group_score", f"{group_score!r} is unknown: use one of {GROUP_SCORES}")
    return (impl or torch.ops.lookahead.block_topk)(q, kmin, kmax, valid, k, group_score)
