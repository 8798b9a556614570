"""Prefix caching over the host KV pool: a KV block outlives its request.

The host pool is the cache. A full block is named by a chained hash: its parent block's hash, its
token ids, and the engine's identity (everything that changes a block's K/V: the model's weights
checksum, dtype, kv_dtype, block size, mode). Equal names mean equal bytes, so a prompt that starts
with named blocks shares them and prefills only the rest. Blocks are reference counted; a named
block whose last sequence ended stays cached (reclaimable) until the pool needs the room, and is
then evicted in LRU order. A block in use (refcount > 0) is never evicted, and a shared block is
never written: only full blocks are named, and a sequence writes only past its cached prefix.

`PrefixCache` is the scheduler's one view of the pool's blocks (plain ints, tested with exact ids):

    can_allocate(n) / allocate(n)   free blocks first, then the least recently used cached ones
    free(ids)                       drop one reference each; named blocks become reclaimable
    match(hashes)                   the longest cached prefix of a prompt's block hashes
    share(ids)                      take a reference on matched blocks (before allocating the rest)
    register(...)                   name a sequence's newly full block (after the step that filled it)

With `enabled=False` nothing is named or matched, and the pool behaves as a plain free list.
Every change of what is cached is published as a `BlockStored` / `BlockRemoved` event on
`events` (Dynamo's KV-aware router follows them).
"""
from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .block_manager import BlockAllocator


# ---- events --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one sequence were named, in order. token_ids: the blocks' tokens
    concatenated (block_size per block); parent_hash: the block before the first (None at the start)."""

    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """These named blocks were evicted from the cache."""

    block_hashes: list[int]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The cache was emptied (`PrefixCache.clear`)."""


class KVEvents:
    """Subscribers to the cache's events. `emit` runs on the engine's step thread: a subscriber
    must be quick (e.g. put the event on a queue)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribers: list[Callable] = []

    def subscribe(self, fn: Callable) -> Callable:
        with self._lock:
            self._subscribers.append(fn)
        return fn

    def unsubscribe(self, fn: Callable) -> None:
        with self._lock:
            self._subscribers.remove(fn)

    def emit(self, event) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for fn in subscribers:
            fn(event)


# ---- names ---------------------------------------------------------------------------------------
def engine_identity(**parts) -> bytes:
    """The bytes every block hash of an engine covers: `parts` (weights checksum, dtype, kv_dtype,
    block size, mode, ...) in a fixed order. Two engines share a block name only if all are equal."""
    return repr(sorted(parts.items())).encode()


def block_hash(parent: int | None, token_ids: Sequence[int], identity: bytes) -> int:
    """The name of one full block: an unsigned 64-bit hash of (parent's name, token ids, identity)."""
    h = hashlib.blake2b(digest_size=8, key=hashlib.blake2b(identity, digest_size=32).digest())
    h.update(b"\x00" if parent is None else b"\x01" + struct.pack("<Q", parent))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def chain_hashes(token_ids: Sequence[int], block_size: int, identity: bytes, num_blocks: int | None = None,
                 parent: int | None = None) -> list[int]:
    """Names of the first `num_blocks` full blocks of `token_ids` (all full blocks by default)."""
    n = len(token_ids) // block_size if num_blocks is None else num_blocks
    hashes = []
    for b in range(n):
        parent = block_hash(parent, token_ids[b * block_size:(b + 1) * block_size], identity)
        hashes.append(parent)
    return hashes


# ---- the bookkeeping -----------------------------------------------------------------------------
@dataclass
class CacheCounters:
    queries: int = 0          # prompt tokens looked up
    hits: int = 0             # of those, tokens served from the cache
    evictions: int = 0        # named blocks evicted for room

    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


@dataclass
class PrefixCache:
    allocator: BlockAllocator
    block_size: int
    identity: bytes = b""
    enabled: bool = True
    events: KVEvents = field(default_factory=KVEvents)

    def __post_init__(self) -> None:
        self.refs: dict[int, int] = {}                   # block id -> references (every allocated block)
        self.block_of: dict[int, int] = {}               # name -> block id
        self.name_of: dict[int, int] = {}                # block id -> name
        self.reclaimable: OrderedDict[int, None] = OrderedDict()   # named, refcount 0: oldest first
        self.counters = CacheCounters()

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds: never used or freed (`num_unnamed_free`), plus the cached ones
        nobody holds (`num_reclaimable`), which allocation takes when it must."""
        return self.allocator.num_free + len(self.reclaimable)

    @property
    def num_unnamed_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_reclaimable(self) -> int:
        """Cached blocks no sequence holds: allocatable, at the price of their cached content."""
        return len(self.reclaimable)

    @property
    def num_cached(self) -> int:
        """Named blocks, in use or reclaimable."""
        return len(self.block_of)

    # ---- allocation -------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """`n` blocks, each with one reference: free ones first (lowest ids, so a sequence's blocks
        tend to form one run), then the least recently used cached ones, whose names are dropped."""
        if not self.can_allocate(n):
            raise MemoryError(f"asked for {n} blocks, {self.num_free} free")
        fresh = min(n, self.allocator.num_free)
        ids = self.allocator.allocate(fresh)
        evicted = []
        while len(ids) < n:
            block, _ = self.reclaimable.popitem(last=False)
            evicted.append(self.name_of.pop(block))
            del self.block_of[evicted[-1]]
            ids.append(block)
        for block in ids:
            self.refs[block] = 1
        if evicted:
            self.counters.evictions += len(evicted)
            self.events.emit(BlockRemoved(evicted))
        return ids

    def free(self, ids: Sequence[int]) -> None:
        """Drop one reference from each block; a block nobody holds is reclaimable if it has a
        name (most recently used last), else back on the free list. `ids` is a sequence's block
        table, walked from its end: its last blocks become the oldest, so eviction takes a chain
        from its tail and what stays cached is still a prefix (evicting a head first would leave
        its descendants unreachable, here and in a KV-aware router's tree)."""
        plain = []
        for block in reversed(ids):
            refs = self.refs.get(block, 0)
            if refs <= 0:
                raise ValueError(f"block {block} is not allocated (double free?)")
            if refs > 1:
                self.refs[block] = refs - 1
                continue
            del self.refs[block]
            if block in self.name_of:
                self.reclaimable[block] = None
            else:
                plain.append(block)
        self.allocator.free(plain)

    # ---- matching ---------------------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest prefix of `hashes` that is cached (no references taken)."""
        if not self.enabled:
            return []
        ids = []
        for h in hashes:
            block = self.block_of.get(h)
            if block is None:
                break
            ids.append(block)
        return ids

    def share(self, ids: Sequence[int]) -> None:
        """Take a reference on each matched block (reclaimable ones are in use again)."""
        for block in ids:
            if block in self.refs:
                self.refs[block] += 1
            else:
                self.reclaimable.pop(block)
                self.refs[block] = 1

    def note_lookup(self, num_tokens: int, num_hit: int) -> None:
        self.counters.queries += num_tokens
        self.counters.hits += num_hit

    def register(self, block_ids: Sequence[int], hashes: Sequence[int], parent: int | None,
                 token_ids: Sequence[int]) -> list[int]:
        """Name a sequence's consecutive newly full blocks (`hashes[i]` for `block_ids[i]`, after
        `parent`); token_ids: their tokens, concatenated. A name already cached keeps its block
        (this one stays the sequence's own, unnamed). Returns the blocks named now."""
        if not self.enabled:
            return []
        named, run, bs = [], [], self.block_size
        for i, (block, h) in enumerate(zip(block_ids, hashes)):
            if h in self.block_of or block in self.name_of:
                self._emit_stored(run, hashes, parent, token_ids)
                run = []
                continue
            self.block_of[h], self.name_of[block] = block, h
            named.append(block)
            run.append(i)
        self._emit_stored(run, hashes, parent, token_ids)
        return named

    def _emit_stored(self, run: list[int], hashes: Sequence[int], parent: int | None,
                     token_ids: Sequence[int]) -> None:
        """One event for a run of consecutive newly named blocks (indices into `hashes`)."""
        if not run:
            return
        bs, first = self.block_size, run[0]
        self.events.emit(BlockStored([hashes[i] for i in run], parent if first == 0 else hashes[first - 1],
                                     list(token_ids[first * bs:(run[-1] + 1) * bs]), bs))

    def clear(self) -> None:
        """Forget every name; reclaimable blocks go back on the free list (blocks in use stay theirs)."""
        self.allocator.free(list(self.reclaimable))
        self.reclaimable.clear()
        self.block_of.clear()
        self.name_of.clear()
        self.events.emit(AllBlocksCleared())

    def stats(self) -> dict:
        c = self.counters
        return {"prefix_cache_queries": c.queries, "prefix_cache_hits": c.hits,
                "prefix_cache_hit_rate": c.hit_rate(), "cached_blocks": self.num_cached,
                "cached_free_blocks": self.num_reclaimable, "prefix_cache_evictions": c.evictions}
