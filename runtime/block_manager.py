"""Block bookkeeping: plain ints, no tensors (tested with exact block ids).

The host KV pool is `num_blocks` blocks of `block_size` tokens. A sequence reserves, at admission,
every block it can ever need (prompt + max_tokens), so a running sequence never runs out of memory
and its blocks are usually one contiguous run (the free list hands out the lowest ids first).
"""
from __future__ import annotations

import heapq


class BlockAllocator:
    """Free list of block ids. Called by the scheduler (`can_allocate`/`allocate`/`free`)."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))   # a min-heap: lowest ids first keeps runs contiguous
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise MemoryError(f"asked for {n} blocks, {len(self._free)} free")
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise ValueError(f"block {i} is not allocated (double free?)")
            self._used.remove(i)
            heapq.heappush(self._free, i)


class LaneAllocator(BlockAllocator):
    """The lookahead backend's lanes (a sequence's rows in the device tier's buffers), lowest first:
    the lanes a step computes over stay a small range. Called by the lookahead runner."""

    def allocate_lane(self) -> int:
        return self.allocate(1)[0]

    def free_lane(self, lane: int) -> None:
        self.free([lane])


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)

