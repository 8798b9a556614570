"""A generation request's state as it moves through the scheduler."""
from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, field

from .sampling import SamplingParams
from .tokenizer import IncrementalDetokenizer


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0                 # tokens whose K/V are in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    text: str = ""                      # output text so far (cut at a stop string)
    emitted: int = 0                    # characters of `text` already streamed
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    noise_seed: int = 0                 # keys the sampling noise (runtime/sampling.py): the request's
                                        # seed, or a random one drawn at arrival
    metrics: dict = field(default_factory=dict)   # filed by the runner when the sequence ends
    index: int = 0                      # which of the request's `n` choices this is
    num_prefix_hit: int = 0             # prompt tokens whose K/V came from the prefix cache
    block_hashes: list[int] = field(default_factory=list)   # names of its full blocks, in order
                                        # (runtime/prefix_cache.py), as far as they are known
    num_named: int = 0                  # full blocks offered to the prefix cache so far
    prompt_logprobs: list | None = None     # params.prompt_logprobs: [None, TokenLogprob per later
                                            # prompt token], filled as the prompt's chunks run

    def __post_init__(self) -> None:
        # choice i of a seeded request draws from seed + i: n samples of one prompt differ, and
        # each is reproducible
        seed = self.params.seed
        self.noise_seed = seed + self.index if seed is not None else secrets.randbits(63)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_len(self) -> int:
        """Most tokens this sequence can ever hold: what admission reserves."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < len(self.prompt_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    def append_token(self, token_id: int, eos_ids: tuple[int, ...]) -> None:
        """Record a sampled token, extend the text, and decide whether the sequence is done."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_ids.append(token_id)
        if token_id in eos_ids and not self.params.ignore_eos:
            self.finish_reason = "stop"
        else:
            self.text += self.detok.push(token_id)
            for s in self.params.stop:
                cut = self.text.find(s, max(0, self.emitted - len(s)))
                if cut >= 0:
                    self.text, self.finish_reason = self.text[:cut], "stop"
                    break
        if self.finish_reason is None and len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = "length"

    def take_delta(self) -> str:
        """New text to stream; keeps back a tail that might still grow into a stop string."""
        hold = 0 if self.finish_reason else max((len(s) - 1 for s in self.params.stop), default=0)
        end = max(self.emitted, len(self.text) - hold)
        delta, self.emitted = self.text[self.emitted:end], end
        return delta
