"""`lookahead::block_topk`: Quest upper-bound block scores and the head-wise top-K per KV head."""
from __future__ import annotations

import torch

from ._common import FLOAT_DTYPES, check_same, check_shape, check_tensor, define_op, fail


def _group_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """q [B, H, D], kmin/kmax [B, NB, KVH, D] -> fp32 group scores [B, KVH, NB].

    With kmin <= kmax, max(q_d*kmin_d, q_d*kmax_d) = relu(q_d)*kmax_d + min(q_d, 0)*kmin_d, which
    is linear in q: a GQA group's heads fold into one weight pair per KV head before touching the
    summaries. Reading the summaries is the whole cost, so each is read once, in its native
    layout, by one bmm of its (block, head) rows against all KV heads' weights, keeping the
    matching head (the diagonal); KVH-fold arithmetic is free next to the memory traffic, and
    unlike a broadcast multiply it allocates no summary-sized temporary.
    """
    B, H, D = q.shape
    num_blocks, num_kv_heads = kmin.shape[1], kmin.shape[2]
    qf = q.float().reshape(B, num_kv_heads, H // num_kv_heads, D)
    w_max = qf.clamp_min(0).sum(2).transpose(1, 2)                              # [B, D, KVH]
    w_min = qf.clamp_max(0).sum(2).transpose(1, 2)
    rows = (B, num_blocks * num_kv_heads, D)
    scores = torch.bmm(kmax.float().reshape(rows), w_max).baddbmm_(kmin.float().reshape(rows), w_min)
    scores = scores.view(B, num_blocks, num_kv_heads, num_kv_heads).diagonal(dim1=2, dim2=3)
    return scores.transpose(1, 2).contiguous()                                   # [B, KVH, NB]


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
                     k: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, num_blocks, num_kv_heads, _ = kmin.shape
    # Masked after scoring: an empty block's +-inf summary may score NaN; the fill overwrites it.
    scores = _group_scores(q, kmin, kmax).masked_fill_(~valid.unsqueeze(1), float("-inf"))

    top = torch.topk(_rank_keys(scores), k, dim=-1, sorted=False).values
    top = (num_blocks - 1) - (top & 0xFFFFFFFF)                         # block ids [B, KVH, k]
    # Valid blocks score finitely and rank first; what else was picked is padding (k > #valid).
    picked_valid = torch.gather(valid.unsqueeze(1).expand(B, num_kv_heads, num_blocks), -1, top)
    top = torch.sort(top.masked_fill(~picked_valid, num_blocks), dim=-1).values  # padding last
    return top.masked_fill(top == num_blocks, -1), scores


def _block_topk_fake(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, valid: torch.Tensor,
                     k: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, num_blocks, num_kv_heads, _ = kmin.shape
    return (q.new_empty((B, num_kv_heads, k), dtype=torch.int64),
            q.new_empty((B, num_kv_heads, num_blocks), dtype=torch.float32))


define_op("block_topk", _block_topk_impl, _block_topk_fake)


def block_topk(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, valid: torch.Tensor,
               k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Score blocks by the Quest upper bound and select the top ``k`` per KV head.

    For query head h and block n, ``s_h(n) = sum_d max(q[h,d]*kmin[n,d], q[h,d]*kmax[n,d])``
    (fp32), an upper bound of ``q_h . key`` over the block's keys. A KV head's score is the sum
    over the query heads of its GQA group (``h // (H // KVH) == kv_head``).

    Parameters
    ----------
    q : Tensor, [B, H, D], float32/float16/bfloat16
        One query per sequence (e.g. the draft row), post-RoPE.
    kmin, kmax : Tensor, [B, NB, KVH, D], dtype of ``q``
        Per-block coordinate-wise min / max of the post-RoPE keys; ``kmin <= kmax`` on valid blocks.
    valid : Tensor, [B, NB], bool
        Blocks that hold at least one key; the others score ``-inf`` and are never selected.
    k : int
        Blocks to select per (sequence, KV head), ``1 <= k <= NB``.

    Returns
    -------
    indices : Tensor, [B, KVH, k], int64
        The selected block ids, ascending; where fewer than ``k`` blocks are valid, the row's
        tail is ``-1``. Ties in score go to the lower block id.
    scores : Tensor, [B, KVH, NB], float32
        The group scores, ``-inf`` on invalid blocks.
    """
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("kmin", kmin, 4, FLOAT_DTYPES)
    check_same("kmin", kmin, "q", q)
    check_same("kmax", kmax, "kmin", kmin)
    check_shape("kmax", kmax, kmin.shape, "[B, NB, KVH, D] like kmin")
    B, H, D = q.shape
    num_blocks, num_kv_heads = kmin.shape[1], kmin.shape[2]
    if kmin.shape[0] != B or kmin.shape[3] != D:
        fail("kmin", f"expected [B={B}, NB, KVH, D={D}] to match q, got {tuple(kmin.shape)}")
    if H % num_kv_heads:
        fail("kmin", f"num_kv_heads={num_kv_heads} (dim 2) does not divide q's num_heads={H}")
    check_tensor("valid", valid, 2, torch.bool)
    check_shape("valid", valid, (B, num_blocks), "[B, NB]")
    if valid.device != q.device:
        fail("valid", f"device {valid.device} differs from q's {q.device}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= num_blocks:
        fail("k", f"must be an int in [1, NB={num_blocks}], got {k!r}")
    return torch.ops.lookahead.block_topk(q, kmin, kmax, valid, k)
