"""Configuration dataclasses: the single source of truth for model shape and lookahead policy.

`ModelConfig` describes the architecture (written by the builder into engine.yaml).
`LookaheadConfig` holds the KV-placement policy with the papers' defaults; engine.yaml carries one,
and a run (or request) may override fields through `LookaheadConfig.replace(**overrides)`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


def _check(cond: bool, field_name: str, problem: str, fix: str = "") -> None:
    if not cond:
        raise ConfigError(field_name, problem, fix)


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family architecture. Shapes: q heads `num_heads`, kv heads `num_kv_heads` (GQA)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check(self.architecture in SUPPORTED_ARCHITECTURES, "architecture",
               f"{self.architecture!r} is not supported",
               f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0, name, f"must be a positive integer, got {v!r}")
        _check(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
               f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")
        _check(self.head_dim % 2 == 0, "head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return cls(**_known_fields(cls, d, "model"))


RESIDENCY = ("resident", "pingpong")
MISS_POLICIES = ("urgent", "drop")
DRAFTS = ("dual_token", "prompt_lookup", "none")
GROUP_SCORES = ("sum", "max")   # none: sparse attention without look-ahead
MODES = ("dense", "lookahead")


@dataclass(frozen=True)
class LookaheadConfig:
    """KV placement policy. Defaults follow OasisKV (block 16, K=128, fetch ratio 0.05) and
    DualDecoder (prefetch lead of 2 layers under ping-pong)."""

    mode: str = "dense"
    block_size: int = 16
    top_k: int = 128               # selected blocks per layer and KV head
    fetch_ratio: float = 0.05      # capped eviction: admit at most ceil(ratio * top_k) blocks/step
    num_sink_blocks: int = 1       # always resident (attention sinks)
    recent_window: int = 64        # tokens, always resident
    residency: str = "resident"
    miss_policy: str = "urgent"
    draft: str = "dual_token"
    group_score: str = "max"       # a GQA group's block score: max over its heads, or sum (DESIGN.md)
    resync_after: int = 1          # draft misses in a row before the chain is re-seeded by
                                   # pre-decoding (1: after every miss; 0: never)
    prefetch_lead: int = 2         # pingpong: layer l+lead is fetched while layer l computes
    prefill_chunk: int = 512       # tokens per prefill chunk
    max_batch_size: int = 8
    max_model_len: int = 8192
    device_budget_bytes: int | None = None  # None: derived from top_k, sink and window

    def __post_init__(self) -> None:
        _check(self.mode in MODES, "mode", f"{self.mode!r} is unknown", f"use one of {MODES}")
        bs = self.block_size
        _check(isinstance(bs, int) and bs > 0 and bs & (bs - 1) == 0, "block_size",
               f"must be a power of two, got {bs!r}", "e.g. 16")
        _check(isinstance(self.top_k, int) and self.top_k > 0, "top_k",
               f"must be a positive number of blocks, got {self.top_k!r}", "the papers use 128")
        _check(0 < self.fetch_ratio <= 1, "fetch_ratio",
               f"must be in (0, 1], got {self.fetch_ratio!r}", "OasisKV uses 0.05")
        _check(self.num_sink_blocks >= 0, "num_sink_blocks", f"must be >= 0, got {self.num_sink_blocks}")
        _check(self.recent_window >= 0, "recent_window", f"must be >= 0, got {self.recent_window}")
        _check(self.residency in RESIDENCY, "residency", f"{self.residency!r} is unknown",
               f"use one of {RESIDENCY}")
        _check(self.miss_policy in MISS_POLICIES, "miss_policy", f"{self.miss_policy!r} is unknown",
               f"use one of {MISS_POLICIES}")
        _check(self.draft in DRAFTS, "draft", f"{self.draft!r} is unknown", f"use one of {DRAFTS}")
        _check(self.group_score in GROUP_SCORES, "group_score", f"{self.group_score!r} is unknown",
               f"use one of {GROUP_SCORES}")
        if self.draft == "none":    # no prediction: only the real query's on-demand fetch fills the set
            _check(self.miss_policy == "urgent", "miss_policy",
                   f"{self.miss_policy!r} with draft 'none' would never fill the working set",
                   "use miss_policy 'urgent' (blocks fetched on demand), or a draft")
            _check(self.residency == "resident", "residency",
                   f"{self.residency!r} refills from predictions, and draft 'none' makes none",
                   "use residency 'resident', or a draft")
        _check(isinstance(self.resync_after, int) and self.resync_after >= 0, "resync_after",
               f"must be an integer >= 0, got {self.resync_after!r}", "1 re-seeds after every miss, 0 never")
        _check(self.prefetch_lead >= 1, "prefetch_lead", f"must be >= 1, got {self.prefetch_lead}")
        _check(self.prefill_chunk > 0, "prefill_chunk", f"must be > 0, got {self.prefill_chunk}")
        _check(self.max_batch_size > 0, "max_batch_size", f"must be > 0, got {self.max_batch_size}")
        _check(self.max_model_len > 0, "max_model_len", f"must be > 0, got {self.max_model_len}")
        if self.device_budget_bytes is not None:
            _check(self.device_budget_bytes > 0, "device_budget_bytes",
                   f"must be > 0, got {self.device_budget_bytes}")

    @property
    def fetch_cap(self) -> int:
        """Blocks admitted per step, layer and KV head under capped eviction (at least one)."""
        return max(1, math.ceil(self.fetch_ratio * self.top_k - 1e-9))

    @property
    def always_resident_tokens(self) -> int:
        return self.num_sink_blocks * self.block_size + self.recent_window

    def replace(self, **overrides: Any) -> "LookaheadConfig":
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(sorted(unknown)[0], "is not a lookahead setting",
                              f"known: {', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LookaheadConfig":
        return cls(**_known_fields(cls, d, "lookahead"))


def _known_fields(cls: type, d: dict[str, Any], section: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ConfigError(f"{section}.{sorted(unknown)[0]}", "is not a known field",
                          f"known: {', '.join(sorted(names))}")
    return dict(d)
