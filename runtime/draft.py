"""Draft sources: where the look-ahead token of each decode step comes from.

The draft token d is run at position p + 1 beside the real token t at p, in the same forward pass;
its query predicts which KV blocks step p + 1 will read. A better guess of the next token gives a
better prediction; a wrong one costs only speed (and bounded accuracy under `drop`).
"""
from __future__ import annotations

import abc


class DraftSource(abc.ABC):
    """Called by the lookahead runner once per decode step and sequence."""

    @abc.abstractmethod
    def propose(self, context: list[int], model_guess: int | None) -> int:
        """The token after `context` (whose last token is this step's real token).

        `model_guess` is the argmax of the previous step's draft row (DualDecoder's own
        speculative token), or None on the first decode step.
        """


class DualTokenDraft(DraftSource):
    """DualDecoder: the model's own prediction from the draft row of the previous step."""

    def propose(self, context: list[int], model_guess: int | None) -> int:
        return model_guess if model_guess is not None else context[-1]


class PromptLookupDraft(DraftSource):
    """n-gram lookup in the context (good on copy-heavy tasks); falls back to the model's guess."""

    def __init__(self, max_ngram: int = 3, window: int = 4096):
        self.max_ngram, self.window = max_ngram, window

    def propose(self, context: list[int], model_guess: int | None) -> int:
        ctx = context[-self.window:]
        for n in range(min(self.max_ngram, len(ctx) - 1), 0, -1):
            tail = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):     # latest earlier occurrence first
                if ctx[start:start + n] == tail:
                    return ctx[start + n]
        return DualTokenDraft().propose(context, model_guess)


class RandomDraft(DraftSource):
    """An adversarial draft (uniform random tokens): for tests and the profiler's contrast."""

    def __init__(self, vocab_size: int, seed: int = 0):
        import random
        self.vocab_size, self.rng = vocab_size, random.Random(seed)

    def propose(self, context: list[int], model_guess: int | None) -> int:
        return self.rng.randrange(self.vocab_size)


def make_draft(kind: str, vocab_size: int) -> DraftSource | None:
    """None for 'none': sparse attention without look-ahead (no draft row at all)."""
    if kind == "none":
        return None
    if kind == "dual_token":
        return DualTokenDraft()
    if kind == "prompt_lookup":
        return PromptLookupDraft()
    if kind == "random":
        return RandomDraft(vocab_size)
    raise ValueError(f"draft {kind!r} is unknown")
