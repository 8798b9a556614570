"""Block summaries: the coordinate-wise min and max of each block's post-RoPE keys, and the
Quest scoring of queries against them.

One table per layer, indexed by (lane, logical block): `[num_layers, lanes * max_blocks, KVH, D]`.
With prefix caching, a cached block's summaries are kept with it (`SummaryStore`, host memory,
indexed by pool block): saved when the block is named, loaded into the lane of a sequence that
shares the block, so a cached prefix is scored without recomputing anything.
Min/max are taken over the keys as the pool stores them (rounded into `kv_dtype`), so a block's
bound covers exactly the keys attention will read. A min or max of such keys is one of them, so the
summaries can be kept in `kv_dtype` itself without rounding anything: half the bytes of fp32 at
fp16 / bf16 KV, scored by widening them exactly. The kernel table decides (`summary_dtype`): a CPU
table keeps them in the KV dtype; a CUDA one in fp32, which its kernels read.
"""
from __future__ import annotations

import torch

from ..device import to_device, to_host
from ..ops import Ops

DTYPE = torch.float32      # the scores' dtype, and the summaries' where the table does not take the KV dtype


# the device types whose kernels read summaries in the KV storage dtype (plugins/cpu's C kernels
# and the torch formulations); plugins/cuda's read fp32 (the memory plan counts by this too)
KV_DTYPE_SUMMARIES = frozenset({"cpu"})


def summary_dtype(kv_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype block summaries are kept in: the KV storage dtype on CPU (exact, half the bytes of
    fp32 at 16-bit KV), fp32 on a GPU (what plugins/cuda's scoring and update kernels read)."""
    return kv_dtype if device.type in KV_DTYPE_SUMMARIES else DTYPE


class BlockSummaries:
    def __init__(self, num_layers: int, num_lanes: int, max_blocks: int, num_kv_heads: int, head_dim: int,
                 kv_dtype: torch.dtype, device: torch.device, ops: Ops):
        """kv_dtype: how the pool stores keys (the summaries bound those values, and are kept in
        `summary_dtype(kv_dtype, device)`)."""
        self.max_blocks, self.kvh, self.hd = max_blocks, num_kv_heads, head_dim
        self.kv_dtype, self.device, self.ops = kv_dtype, device, ops
        self.dtype = summary_dtype(kv_dtype, device)
        shape = (num_layers, num_lanes * max_blocks, num_kv_heads, head_dim)
        self.kmin = torch.zeros(shape, dtype=self.dtype, device=device)
        self.kmax = torch.zeros(shape, dtype=self.dtype, device=device)
        # per layer, by lane: [lanes, max_blocks, KVH, D] views, made once (what scoring reads)
        by_lane = (num_lanes, max_blocks, num_kv_heads, head_dim)
        self._by_lane = [(self.kmin[i].view(by_lane), self.kmax[i].view(by_lane)) for i in range(num_layers)]

    def nbytes(self, num_layers: int, num_blocks: int) -> int:
        """kmin + kmax of `num_blocks` blocks of one lane over `num_layers` layers."""
        return 2 * num_layers * num_blocks * self.kvh * self.hd * self.kmin.element_size()

    def update(self, layers: slice, keys: torch.Tensor, lanes: torch.Tensor, logical: torch.Tensor,
               offsets: torch.Tensor) -> None:
        """Fold the stored rows of `layers` into their blocks: keys [L', T, KVH, D]; lanes,
        logical, offsets [T] (a row at offset 0 starts its block's summary)."""
        n_layers, T = keys.shape[0], keys.shape[1]
        per_layer = self.kmin.shape[1]
        ids = lanes * self.max_blocks + logical
        if n_layers > 1:        # the layers' tables as one [L' * lanes * max_blocks, KVH, D] table
            ids = (torch.arange(n_layers, device=self.device)[:, None] * per_layer + ids).reshape(-1)
        flat = (-1, self.kvh, self.hd)
        stored = keys.reshape(n_layers * T, self.kvh, self.hd).to(self.kv_dtype)   # as the pool stores them
        self.ops.update_summaries(self.kmin[layers].view(flat), self.kmax[layers].view(flat), stored, ids,
                                  offsets.repeat(n_layers))

    def score(self, layer: int, q: torch.Tensor, valid: torch.Tensor, n: int, num_blocks: int, top_k: int,
              group_score: str) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, (R,) H, D] for lanes [0, n) -> (top-K logical blocks [n, (R,) KVH, top_k], -1 padded;
        group scores [n, (R,) KVH, nb], fp32); valid [n, (R,) max_blocks].

        Only the first `num_blocks` logical blocks (those any lane's context reaches) are scored,
        in one read of the summaries for every row.
        """
        nb = min(num_blocks, self.max_blocks)
        kmin, kmax = (t[:n, :nb] for t in self._by_lane[layer])
        k_sel = min(top_k, nb)
        idx, scores = self.ops.block_topk(q.to(DTYPE), kmin, kmax, valid[..., :nb], k_sel, group_score)
        if k_sel < top_k:
            idx = torch.nn.functional.pad(idx, (0, top_k - k_sel), value=-1)
        return idx, scores


class SummaryStore:
    """The summaries of the pool's named blocks: kmin/kmax `[num_layers, num_pool_blocks, KVH, D]`
    in host memory, beside the host pool, in the backend's summary dtype (a block's entry is valid
    while it has its name)."""

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = DTYPE):
        shape = (num_layers, num_blocks, num_kv_heads, head_dim)
        self.kmin = torch.zeros(shape, dtype=dtype)
        self.kmax = torch.zeros(shape, dtype=dtype)

    def save(self, summaries: BlockSummaries, lane: int, logical: list[int], blocks: list[int]) -> None:
        """Lane `lane`'s summaries of its logical blocks -> the store's entries of pool `blocks`."""
        rows, = to_device(summaries.device, torch.tensor(logical, dtype=torch.long) + lane * summaries.max_blocks)
        ids = torch.tensor(blocks, dtype=torch.long)
        for mine, theirs in ((self.kmin, summaries.kmin), (self.kmax, summaries.kmax)):
            mine[:, ids] = to_host(theirs[:, rows], "prefix cache: a named block's summaries")

    def load(self, summaries: BlockSummaries, lane: int, logical: list[int], blocks: list[int]) -> None:
        """The store's entries of pool `blocks` -> lane `lane`'s summaries of its logical blocks."""
        rows = torch.tensor(logical, dtype=torch.long) + lane * summaries.max_blocks
        ids = torch.tensor(blocks, dtype=torch.long)
        rows, = to_device(summaries.device, rows)
        for mine, theirs in ((self.kmin, summaries.kmin), (self.kmax, summaries.kmax)):
            theirs[:, rows] = to_device(summaries.device, mine[:, ids])[0]
