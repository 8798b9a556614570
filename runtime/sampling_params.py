"""The per-request sampling parameters and their validation, without torch.

`runtime.sampling` (the sampler) re-exports them; this module stands alone so that what only checks a
request (the HTTP front's /generate validation, serving/request.py) does not load torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import RequestError

MAX_N = 16                  # choices per request
MAX_LOGPROBS = 20           # alternatives per token (OpenAI's top_logprobs bound)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1                        # choices of one prompt: one prefill, n sequences on its blocks
    logprobs: int | None = None       # None: off; k: each output token's log-probability and its k
                                      # most likely alternatives (of the model's raw logits)
    prompt_logprobs: int | None = None    # None: off; k: the same for every prompt token after the
                                          # first (OpenAI completions' `echo`); the prompt is then
                                          # computed in full, never taken from the prefix cache

    def __post_init__(self) -> None:
        def bad(name: str, problem: str, fix: str) -> None:
            raise RequestError(name, problem, fix)
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}", "e.g. 64")
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not math.isfinite(self.temperature) or self.temperature < 0):
            bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}", "0 means greedy")
        if (not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool)
                or not 0 < self.top_p <= 1):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}", "1.0 disables nucleus sampling")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0, got {self.top_k!r}", "0 disables top-k")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not INT64_MIN <= self.seed <= INT64_MAX):
            bad("seed", f"must be a 64-bit signed integer, got {self.seed!r}", "or omit it")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}", "1 returns one choice")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or null, got {self.logprobs!r}",
                "0 returns the chosen tokens' log-probabilities, k also the k most likely alternatives")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
                or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or null, got {self.prompt_logprobs!r}",
                "0 returns each prompt token's log-probability, k also the k most likely alternatives")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", f"must be a list of non-empty strings, got {self.stop!r}", "e.g. ['\\n\\n']")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
