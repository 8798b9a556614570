"""Sampling parameters (validated per request) and the sampler.

Sampling is Gumbel-max with noise keyed by (the request's seed, the position of the token drawn):
`token = argmax(filtered_logits / T + g)`, `g ~ Gumbel(0, 1)` iid per vocabulary entry. That is an
exact draw from the filtered softmax, and every row that draws the token of one position draws on
the same noise. The look-ahead relies on it: the draft row of step s and the real row of step s+1
both draw the token at p+2, so they agree whenever their distributions do (the draft chain stays
in sync under sampling), and dense and lookahead mode emit the same tokens for a given seed.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .device import host_list, to_device
from .errors import RequestError

_M64 = (1 << 64) - 1
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


def _mix(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seed, position): splitmix64's finaliser over both."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) >> 1


def position_noise(seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Gumbel(0, 1) noise [vocab_size] float64, the same for every call with (seed, position), on
    every device: drawn by a CPU generator (a CUDA one draws other numbers), then moved."""
    return to_device(torch.device(device), _host_noise(seed, position, vocab_size))[0]


def _host_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_mix(seed, position))
    u = torch.rand(vocab_size, generator=gen, dtype=torch.float64)
    return -torch.log(-torch.log(u))                                    # u = 0 gives -inf: never drawn


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [vocab] -> logits / temperature with -inf outside the top_k and top_p sets."""
    z = logits.double() / params.temperature
    if 0 < params.top_k < z.shape[-1]:
        kth = torch.topk(z, params.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_z, order = torch.sort(z, descending=True)
        p = torch.softmax(sorted_z, dim=-1)
        drop = torch.cumsum(p, dim=-1) - p > params.top_p   # keep the smallest prefix reaching top_p
        z = z.scatter(0, order, sorted_z.masked_fill(drop, float("-inf")))
    return z


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """The token at `position` from logits [vocab] (float32): argmax when greedy, otherwise a
    Gumbel-max draw on the noise of (seed, position)."""
    return sample_rows(logits[None], [(params, seed, position)])[0]


def sample_rows(logits: torch.Tensor, draws: list[tuple[SamplingParams, int, int]]) -> list[int]:
    """One token per row of logits [N, vocab] (any device), row i drawn as `draws[i]` = (params,
    seed, position) say; the draws run where the logits are (the sampled rows' noise, drawn on
    the host, goes there in one copy), and the N ids come back to the host in one copy: the
    step's one read of the device (runtime/device.py, `to_host`)."""
    if not draws:
        return []
    tokens = torch.argmax(logits, dim=-1)                                  # [N]: the greedy rows
    sampled = [i for i, (params, _, _) in enumerate(draws) if not params.greedy]
    if sampled:
        vocab = logits.shape[-1]
        noise = to_device(logits.device, torch.stack([_host_noise(draws[i][1], draws[i][2], vocab)
                                                      for i in sampled]))[0]
        for row, i in enumerate(sampled):
            z = filtered_logits(logits[i], draws[i][0])
            tokens[i] = torch.argmax(z + noise[row])
    return host_list(tokens, "sampled token ids")


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability under the model (log_softmax of its raw logits, fp32),
    and the `k` most likely tokens there, most likely first: [(token_id, logprob)]."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None           # 1 + how many tokens are more likely (prompt tokens: asked for)


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int], *,
                   ranks: bool = False) -> list[TokenLogprob]:
    """logits [N, vocab] (any device), the token drawn from each row and how many alternatives
    each row wants -> one TokenLogprob per row (one copy to the host for all rows); `ranks`: with
    each token's rank too."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    k = max(ks)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0]
    top_v, top_i = torch.topk(logp, k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    cols = [chosen[:, None].double(), top_v.double(), top_i.double()]
    if ranks:
        cols.append(1 + (logp > chosen[:, None]).sum(1, keepdim=True).double())
    host = host_list(torch.cat(cols, 1), "logprobs")        # one copy: fp64 holds the ids exactly
    out = []
    for row, (tok, want) in enumerate(zip(tokens, ks)):
        vals = host[row]
        top = [(round(vals[1 + k + j]), vals[1 + j]) for j in range(want)]
        out.append(TokenLogprob(tok, vals[0], top, round(vals[1 + 2 * k]) if ranks else None))
    return out


@dataclass
class PendingDraws:
    """Rows a runner leaves to the engine's one sampling pass of the step (the draft and
    pre-decoding rows of lookahead mode): drawn with the emitted rows, `accept` gets their ids."""

    logits: torch.Tensor                                  # [D, vocab]
    draws: list[tuple[SamplingParams, int, int]]          # (params, seed, position) per row
    accept: Callable[[list[int]], None]
