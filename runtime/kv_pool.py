"""The host KV pool: the full cache of every sequence, paged in blocks, one tensor per layer.

Layout per layer: k, v `[num_kv_heads, num_blocks, block_size, head_dim]` (head-major).
- One KV head's block is contiguous, so the lookahead path moves (block, head) units as they are.
- A sequence whose blocks form one run (the usual case: admission reserves all its blocks at
  once) is read for dense attention as a view `[KVH, tokens, D]`, without copying its cache.
`by_block(layer)` gives the `[num_blocks, KVH, bs, D]` view the ops' contracts use.

Dense mode allocates the pool on the engine's device; lookahead mode keeps it on the host
(pinned when the device tier is on a GPU, so the transfer engine's copies read it directly).
Writes take rows and indices from any device and land them in the pool's.

The storage dtype (`LookaheadConfig.kv_dtype`: float32, float16 or bfloat16) is the pool's own,
whatever the model computes in: writes round the rows into it, and attention reads the stored
values and computes in fp32 (`attention_dense`, the lookahead ops). At float32 nothing is cast.
"""
from __future__ import annotations

import torch

from .config import ModelConfig
from .device import HOST_SYNCS, to_host


class KVPool:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 pin_memory: bool = False):
        shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.v = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.num_blocks, self.block_size = num_blocks, block_size
        self._staged: list[tuple] = []      # write_layers(..., blocking=False) not landed yet (settle)
        self.num_kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype of K and V."""
        return self.k.dtype

    def _here(self, k: torch.Tensor, v: torch.Tensor, *index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows written from the device tier into a host pool: rounded into the storage dtype where
        they are, then one blocking copy each, through runtime.device's seam (both no-ops when
        they already match)."""
        self.settle()
        here = self.k.device

        def move(t: torch.Tensor) -> torch.Tensor:
            if t.device == here:
                return t
            return to_host(t, "store (blocking)") if here.type == "cpu" else t.to(here)
        return (move(k.to(self.k.dtype)), move(v.to(self.k.dtype)), *(move(t) for t in index))

    def _stage(self, layers: slice, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor,
               offsets: torch.Tensor) -> None:
        """`write_layers` without a host sync: rows on a GPU are rounded there, copied down into
        pinned memory asynchronously on the current stream, and scattered into the pool by
        `settle`, after the copy's event (the indices are host tensors already)."""
        rows = []
        for t in (k, v):
            host = torch.empty(t.shape, dtype=self.k.dtype, pin_memory=True)
            host.copy_(t.to(self.k.dtype), non_blocking=True)
            rows.append(host)
        done = torch.cuda.Event()
        done.record()
        self.__dict__.setdefault("_staged", []).append((done, layers, rows[0], rows[1], block_ids, offsets))

    def settle(self) -> None:
        """Land every staged write (`write_layers(..., blocking=False)`) in the pool. Each waits for
        its copy's event; a wait that would block is a host sync, counted as one."""
        staged, self._staged = getattr(self, "_staged", []), []
        for done, layers, k, v, block_ids, offsets in staged:
            if not done.query():
                HOST_SYNCS.note("store (staged rows still landing)")
                done.synchronize()
            self.k[layers, :, block_ids, offsets] = k.permute(0, 2, 1, 3)
            self.v[layers, :, block_ids, offsets] = v.permute(0, 2, 1, 3)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K plus V, all KV heads, one layer."""
        return 2 * self.num_kv_heads * self.block_size * self.head_dim * self.k.element_size()

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
              block_ids: torch.Tensor, offsets: torch.Tensor) -> None:
        """k, v: [T, KVH, D] (any float dtype); block_ids, offsets: [T] int64 -> stored at those
        slots, in the pool's dtype."""
        k, v, block_ids, offsets = self._here(k, v, block_ids, offsets)
        self.k[layer_idx, :, block_ids, offsets] = k.transpose(0, 1)
        self.v[layer_idx, :, block_ids, offsets] = v.transpose(0, 1)

    def write_layers(self, layers: slice, k: torch.Tensor, v: torch.Tensor,
                     block_ids: torch.Tensor, offsets: torch.Tensor, blocking: bool = True) -> None:
        """Several layers in one copy: k, v [L', T, KVH, D] for layers `layers` (a slice).
        blocking=False: rows from a GPU into a host pool land at `settle` (no host sync here);
        the index tensors must then be host tensors."""
        if not blocking and k.is_cuda and self.k.device.type == "cpu":
            assert block_ids.device.type == "cpu" and offsets.device.type == "cpu", "staged writes take host indices"
            self._stage(layers, k, v, block_ids, offsets)
            return
        k, v, block_ids, offsets = self._here(k, v, block_ids, offsets)
        self.k[layers, :, block_ids, offsets] = k.permute(0, 2, 1, 3)
        self.v[layers, :, block_ids, offsets] = v.permute(0, 2, 1, 3)

    def by_block(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of one layer as `[num_blocks, KVH, bs, D]` views (the ops' pool layout)."""
        return self.k[layer_idx].transpose(0, 1), self.v[layer_idx].transpose(0, 1)

    def run_start(self, block_table: list[int], length: int) -> int | None:
        """The first block of the sequence's first `length` tokens if their blocks form one run of
        consecutive ids (then they lie in one piece per head), else None."""
        n = -(-length // self.block_size)
        ids = block_table[:n]
        return ids[0] if ids and ids[-1] - ids[0] == n - 1 and ids == list(range(ids[0], ids[0] + n)) else None

    def read(self, layer_idx: int, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` tokens of a sequence as k, v `[KVH, length, D]`, in the storage dtype.

        A contiguous run of block ids is a view (no copy); otherwise blocks are gathered once.
        """
        self.settle()
        n = -(-length // self.block_size)
        ids = block_table[:n]
        kl, vl = self.k[layer_idx], self.v[layer_idx]
        if (first := self.run_start(block_table, length)) is not None:
            kb, vb = kl[:, first:first + n], vl[:, first:first + n]
        else:
            idx = torch.tensor(ids, dtype=torch.long, device=kl.device)
            kb, vb = kl.index_select(1, idx), vl.index_select(1, idx)
        shape = (self.num_kv_heads, n * self.block_size, self.head_dim)   # [KVH, n, bs, D] -> tokens
        return kb.reshape(shape)[:, :length], vb.reshape(shape)[:, :length]
