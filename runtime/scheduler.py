"""Continuous batching with chunked prefill and admission by memory.

Each step decodes one token for every running sequence whose prompt is in the cache, and spends
up to `prefill_chunk` tokens on prompts, so running streams keep flowing while new ones join.
A sequence is admitted only when the pool can reserve every block it may ever need; until then
it waits in a bounded queue. One that can never fit is rejected by `check_fits` at once, and so is
one whose `n` choices could never all be taken, even by an idle engine (its batch slots and pool,
then `max_queue` waiting): a retry could not help it.

Prefix caching (runtime/prefix_cache.py): at admission the prompt's full blocks are looked up by
name; the cached prefix is shared (no block reserved for it, `num_cached` starts past it) and only
the rest is prefilled. At least the prompt's last token is always computed: its logits are the
first token's. Cached blocks that no sequence holds count as room (they are evicted, oldest first,
when needed). A prompt whose next block a running prefill is computing right now waits for it
(e.g. the `n` choices of one request: one prefill, then n sequences on its blocks). After each
step, `name_full_blocks` names the blocks a sequence has filled.

Admission control (`check_queue`) counts what would really wait: of the requests waiting, those
still in the engine's inbox and the new one, in arrival order, the ones the next admission can
start (a free batch slot and every block they need) do not wait, the rest do.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable

from .block_manager import blocks_needed
from .errors import CapacityError
from .prefix_cache import PrefixCache, chain_hashes
from .sequence import Sequence, SeqStatus


class QueueFullError(CapacityError):
    """The waiting queue is full: the caller should retry later (Triton's UNAVAILABLE)."""


class Scheduler:
    def __init__(self, allocator: PrefixCache, block_size: int, max_batch_size: int,
                 max_model_len: int, prefill_chunk: int, max_queue: int = 256, name_decoded: bool = True):
        """allocator: the pool's blocks and their names. name_decoded: blocks filled by decoding
        are named too (dense mode, whose decode computes K/V as prefill does); else only blocks
        of the prompt (sparse and lookahead decode attend to a selection: their K/V are not
        what a prefill of the same tokens would store)."""
        self.allocator, self.block_size, self.name_decoded = allocator, block_size, name_decoded
        self.max_batch_size, self.max_model_len = max_batch_size, max_model_len
        self.prefill_chunk, self.max_queue = prefill_chunk, max_queue
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._deferred_long = False       # the last step ran only short prompt tails

    def check_fits(self, seq: Sequence) -> None:
        """Raise CapacityError when `seq` could never run on this engine."""
        if seq.max_len > self.max_model_len:
            raise CapacityError(
                f"prompt ({len(seq.prompt_ids)} tokens) + max_tokens ({seq.params.max_tokens}) = "
                f"{seq.max_len} exceeds the engine's max_model_len {self.max_model_len}; "
                "shorten the prompt or lower max_tokens", field="max_tokens")
        need = blocks_needed(seq.max_len, self.block_size)
        if need > self.allocator.num_blocks:
            raise CapacityError(f"the request needs {need} KV blocks but the host pool has "
                                f"{self.allocator.num_blocks}; lower max_tokens or enlarge the pool",
                                field="max_tokens")
        most = self.most_held(seq)
        if seq.params.n > most:
            raise CapacityError(f"{seq.params.n} choices can never be held at once: this engine runs "
                                f"{most - self.max_queue} sequences of this length at a time and queues "
                                f"{self.max_queue} more", field="n",
                                fix=f"send n <= {most}, or lower max_tokens")

    def most_held(self, seq: Sequence) -> int:
        """The most sequences of `seq`'s size the engine can ever take at once: those an idle
        engine starts (batch slots, its whole pool) plus `max_queue` waiting. `check_queue` refuses
        a request of more choices on an idle engine too, every time: a retry cannot help."""
        return self.max_queue + _admissible([self._need(seq)] * self.max_batch_size, self.max_batch_size,
                                            self.allocator.num_blocks)

    def check_queue(self, pending: int | Iterable[Sequence] = 0, seq: Sequence | None = None) -> None:
        """Raise QueueFullError when one more request would leave more than `max_queue` waiting.

        `pending`: the requests accepted but not yet `add`ed (the engine's inbox), in arrival order,
        or just their number; `seq`: the new request, when known. A request whose block need is
        unknown (a bare count, or `seq=None`) is taken to need one block: then only batch slots
        limit what the next admission can start.

        Called from request threads without the step loop's lock. It reads a snapshot: the waiting
        deque copied in one C call (atomic under the GIL), then the running count and free blocks,
        each one atomic read. A sequence admitted between those reads is seen in both places (one
        slot fewer) or in neither; a batch the step loop has taken from the inbox but not yet added
        is missed. Either way the bound shifts by the requests that moved meanwhile, not more."""
        queued = self.num_queued_after(pending, seq)
        if queued > self.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests waiting for a batch "
                                 "slot or KV blocks); retry later")

    def num_queued_after(self, pending: int | Iterable[Sequence] = 0, seq: Sequence | None = None) -> int:
        """How many requests would wait after the next admission if `pending` and then one more
        request (`seq`, or one of unknown size) joined the queue (see `check_queue`)."""
        waiting = self.waiting.copy()
        needs = [self._need(s) for s in waiting]
        needs += [1] * pending if isinstance(pending, int) else [self._need(s) for s in pending]
        needs.append(1 if seq is None else self._need(seq))
        return len(needs) - _admissible(needs, self.max_batch_size - len(self.running), self.allocator.num_free)

    def _need(self, seq: Sequence) -> int:
        return blocks_needed(seq.max_len, self.block_size)

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            hit = self._match(seq)
            if self._prefilling_next(seq, len(hit)):
                break                      # its next block is being computed: share it when named
            need = self._need(seq) - len(hit)
            reclaimed = sum(b in self.allocator.reclaimable for b in hit)   # taken by `share` below
            if need > self.allocator.num_free - reclaimed:
                break                      # FIFO: later requests do not overtake a waiting one
            self.waiting.popleft()
            self.allocator.share(hit)
            seq.block_table = hit + self.allocator.allocate(need)
            seq.num_cached = seq.num_prefix_hit = len(hit) * self.block_size
            seq.num_named = len(hit)
            self.allocator.note_lookup(len(seq.prompt_ids), seq.num_prefix_hit)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _match(self, seq: Sequence) -> list[int]:
        """The cached blocks the prompt starts with; the block of its last token is never among
        them (that token is computed for its logits)."""
        if not self._reads_cache(seq):
            return []
        usable = (len(seq.prompt_ids) - 1) // self.block_size
        self._extend_hashes(seq, usable)
        return self.allocator.match(seq.block_hashes[:usable])

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        """Name the sequence's first `num_blocks` blocks (those not named yet; tokens known)."""
        known = len(seq.block_hashes)
        if known < num_blocks:
            tokens = seq.all_token_ids[known * self.block_size: num_blocks * self.block_size]
            parent = seq.block_hashes[-1] if known else None
            seq.block_hashes += chain_hashes(tokens, self.block_size, self.allocator.identity, parent=parent)

    def _reads_cache(self, seq: Sequence) -> bool:
        """Whether the prompt may start from cached blocks: not when its prompt log-probabilities
        are asked for, which need every prompt row computed (its blocks are still named and kept)."""
        return self.allocator.enabled and seq.params.prompt_logprobs is None

    def _prefilling_next(self, seq: Sequence, num_hit: int) -> bool:
        """Is a running prefill computing the block after the cached prefix right now?"""
        usable = (len(seq.prompt_ids) - 1) // self.block_size
        if not self._reads_cache(seq) or num_hit >= usable:
            return False
        nxt = seq.block_hashes[num_hit]
        return any(s.in_prefill and nxt in s.block_hashes[s.num_named:] for s in self.running)

    def name_full_blocks(self, seq: Sequence) -> list[tuple[int, int]]:
        """After a step: name the blocks `seq` has filled since the last call. Returns (logical
        block, block id) of those named now (a name already cached keeps its own block)."""
        if not self.allocator.enabled:
            return []
        limit = seq.num_cached if self.name_decoded else min(seq.num_cached, len(seq.prompt_ids))
        full = limit // self.block_size
        if full <= seq.num_named:
            return []
        self._extend_hashes(seq, full)
        first, bs = seq.num_named, self.block_size
        ids = seq.block_table[first:full]
        named = self.allocator.register(ids, seq.block_hashes[first:full],
                                        seq.block_hashes[first - 1] if first else None,
                                        seq.all_token_ids[first * bs: full * bs])
        seq.num_named = full
        logical = {b: first + i for i, b in enumerate(ids)}
        return [(logical[b], b) for b in named]

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Work for one step: (sequence, number of new tokens to run).

        The prefill budget goes to the prompts with the fewest tokens left first (a prompt whose
        prefix was cached has a few; a fresh document thousands), so a cache hit's first token
        does not wait for another document's whole prefill. A step where some prompt has a short
        tail (<= prefill_chunk / 8 tokens left) while the prompts left do not fit one step runs
        only the short tails, so its first token costs a short step, not a full chunk; the long
        prefills resume the next step, and never wait two steps in a row. Prompts that fit one
        step together run together, as before."""
        self._admit()
        work = [(s, 1) for s in self.running if not s.in_prefill]
        left = sorted(((len(s.prompt_ids) - s.num_cached, i, s) for i, s in enumerate(self.running)
                       if s.in_prefill), key=lambda t: t[:2])
        short = max(1, self.prefill_chunk // 8)
        if (left and left[0][0] <= short < left[-1][0] and not self._deferred_long
                and sum(t[0] for t in left) > self.prefill_chunk):
            left = [t for t in left if t[0] <= short]
            self._deferred_long = True
        else:
            self._deferred_long = False
        budget = self.prefill_chunk
        for n_left, _, s in left:
            if budget <= 0:
                break
            n = min(budget, n_left)
            work.append((s, n))
            budget -= n
        return work

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.allocator.free(seq.block_table)
            seq.block_table = []
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED


def _admissible(needs: list[int], slots: int, free: int) -> int:
    """How many of the requests (their block needs, in arrival order) the next admission starts
    with `slots` batch slots and `free` blocks: FIFO, as `Scheduler._admit`, so the first that
    cannot start stops it."""
    admitted = 0
    for need in needs:
        if slots <= 0 or need > free:
            break
        slots, free, admitted = slots - 1, free - need, admitted + 1
    return admitted
