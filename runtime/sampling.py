"""Sampling parameters (validated per request; runtime/sampling_params.py, re-exported here) and the sampler.

Sampling is Gumbel-max with noise keyed by (the request's seed, the position of the token drawn):
`token = argmax(filtered_logits / T + g)`, `g ~ Gumbel(0, 1)` iid per vocabulary entry. That is an
exact draw from the filtered softmax, and every row that draws the token of one position draws on
the same noise. The look-ahead relies on it: the draft row of step s and the real row of step s+1
both draw the token at p+2, so they agree whenever their distributions do (the draft chain stays
in sync under sampling), and dense and lookahead mode emit the same tokens for a given seed.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .device import host_list, to_device
from .sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_N, SamplingParams  # noqa: F401 (re-exported)

_M64 = (1 << 64) - 1


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
    sampled = [i for i, (params, _, _) in enumerate(draws) if params.temperature != 0]   # not greedy (no call)
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
