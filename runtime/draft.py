"""Draft sources and the draft chain: where the look-ahead token of each decode step comes from.

The draft token d is run at position p + 1 beside the real token t at p, in the same forward pass;
its query predicts which KV blocks step p + 1 will read. The prediction is near-perfect when d is
the token the model emits after t, and no better than a random token's otherwise.

The chain must stay *in sync*: the draft row of step s reads d_s and draws the token after it,
which becomes d_{s+1}; that is the right guess only if d_s was right. So a sequence's first decode
step is a **pre-decoding** step (DualDecoder §5.2): its current token runs once as a row whose
K/V is not stored and whose output is not emitted, and that row's draw is the first draft. After
`resync_after` draft misses in a row the chain is seeded again the same way (a step in which the
sequence emits nothing), instead of going on from a row that read a wrong token.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass


class DraftSource(abc.ABC):
    """Called by the draft chain once per decode step and sequence."""

    @abc.abstractmethod
    def propose(self, context: list[int], model_guess: int | None) -> int | None:
        """The token after `context` (whose last token is this step's real token), or None to
        pre-decode this step.

        `model_guess` is the model's own draw for that token (from the previous step's draft row,
        or a pre-decoding row), or None when the chain has none it can trust.
        """


class DualTokenDraft(DraftSource):
    """DualDecoder: the model's own draw from the previous step's draft (or pre-decoding) row."""

    def propose(self, context: list[int], model_guess: int | None) -> int | None:
        return model_guess


class PromptLookupDraft(DraftSource):
    """n-gram lookup in the context (good on copy-heavy tasks); where no n-gram matches, the
    model's own draw (and pre-decoding when the chain has none)."""

    def __init__(self, max_ngram: int = 3, window: int = 4096):
        self.max_ngram, self.window = max_ngram, window

    def propose(self, context: list[int], model_guess: int | None) -> int | None:
        ctx = context[-self.window:]
        for n in range(min(self.max_ngram, len(ctx) - 1), 0, -1):
            tail = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):     # latest earlier occurrence first
                if ctx[start:start + n] == tail:
                    return ctx[start + n]
        return model_guess


class RandomDraft(DraftSource):
    """An adversarial draft (uniform random tokens): for tests and the profiler's contrast."""

    def __init__(self, vocab_size: int, seed: int = 0):
        import random
        self.vocab_size, self.rng = vocab_size, random.Random(seed)

    def propose(self, context: list[int], model_guess: int | None) -> int:
        return self.rng.randrange(self.vocab_size)


def make_draft(kind: str) -> DraftSource | None:
    """None for 'none': sparse attention without look-ahead (no draft row at all)."""
    kinds = {"none": None, "dual_token": DualTokenDraft, "prompt_lookup": PromptLookupDraft}
    if kind not in kinds:
        raise ValueError(f"draft {kind!r} is unknown")
    return kinds[kind]() if kinds[kind] else None


@dataclass
class ChainState:
    """One sequence's draft chain."""

    guess: int | None = None        # the model's draw for the token after the next real token
    last_draft: int | None = None   # the draft run at the last step (None after pre-decoding)
    misses: int = 0                 # draft misses in a row
    accepted: int = 0
    proposed: int = 0
    predecodes: int = 0             # pre-decoding steps: the seed plus the resyncs
    resyncs: int = 0


class DraftChain:
    """Per-sequence draft bookkeeping: what each step's draft row runs, accept counts, resyncs.

    The lookahead runner calls `next_draft` when it builds a step (None: the sequence pre-decodes
    this step), `draws` for the draft rows' sampling, and `set_guesses` with their draws. All the
    chain's state (guess, last draft, misses, accept counts) lives here, none in the runner.
    """

    def __init__(self, source: DraftSource, resync_after: int):
        self.source, self.resync_after = source, resync_after
        self.chains: dict[int, ChainState] = {}
        self.accepted = self.proposed = self.resyncs = self.predecodes = 0

    def next_draft(self, seq_id: int, context: list[int]) -> int | None:
        """The draft token for the step whose real token is `context[-1]`, or None to pre-decode."""
        st = self.chains.setdefault(seq_id, ChainState())
        if st.last_draft is not None:             # judge the last step's draft by this real token
            hit = st.last_draft == context[-1]
            st.proposed += 1
            st.accepted += hit
            self.proposed += 1
            self.accepted += hit
            st.misses = 0 if hit else st.misses + 1
        stale = st.misses > 0 and 0 < self.resync_after <= st.misses
        d = self.source.propose(context, None if stale else st.guess)
        st.last_draft = d
        if d is None:                             # pre-decode: seed (first step) or resync
            st.predecodes += 1
            self.predecodes += 1
            if st.proposed:
                st.resyncs += 1
                self.resyncs += 1
            st.misses, st.guess = 0, None
        return d

    def set_guess(self, seq_id: int, token: int) -> None:
        self.chains[seq_id].guess = token

    def set_guesses(self, seq_ids: list[int], tokens: list[int]) -> None:
        """The draws of a step's draft (or pre-decoding) rows, one per sequence, in `draws` order."""
        for seq_id, token in zip(seq_ids, tokens):
            self.chains[seq_id].guess = token

    @staticmethod
    def draws(seqs: list, predecode: list[bool]) -> list[tuple]:
        """(params, noise seed, position) of each sequence's draft-row draw. A draft row draws the
        token after next (`num_tokens + 1`); a pre-decoding row, which is the next step's real row
        computed ahead, the next one (`num_tokens`): each on the noise of its position, as the real
        row that will draw it (runtime/sampling.py), so the two agree whenever their logits do."""
        return [(seq.params, seq.noise_seed, seq.num_tokens + (0 if pre else 1)) for seq, pre in zip(seqs, predecode)]

    def release(self, seq_id: int) -> dict:
        """A finished sequence's draft metrics; forgets its chain."""
        st = self.chains.pop(seq_id, ChainState())
        return {"draft_accept_rate": st.accepted / st.proposed if st.proposed else None,
                "drafts_proposed": st.proposed, "predecode_steps": st.predecodes, "resyncs": st.resyncs}

    def stats(self) -> dict:
        return {"draft_accept_rate": self.accepted / self.proposed if self.proposed else None,
                "drafts_proposed": self.proposed, "predecode_steps": self.predecodes, "resyncs": self.resyncs}
