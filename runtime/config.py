"""Configuration dataclasses: the single source of truth for model shape and lookahead policy.

`ModelConfig` describes the architecture (written by the builder into engine.yaml).
`LookaheadConfig` holds the KV-placement policy with the papers' defaults; engine.yaml carries one,
and a run (or request) may override fields through `LookaheadConfig.replace(**overrides)`.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any

from .checks import check, check_bool, check_int, check_real, got, is_int
from .errors import ConfigError
from .rope_scaling import check_rope_scaling

# qwen3: the Llama block with an RMSNorm over each head of q and of k before RoPE (`qk_norm`)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3")
QK_NORM_ARCHITECTURES = ("qwen3",)


# Upper bounds of ModelConfig's shape fields: several times the largest open Llama-family models.
MODEL_LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18,
                "num_layers": 1024, "num_heads": 1024, "num_kv_heads": 1024, "head_dim": 1024,
                "max_position_embeddings": 1 << 24}


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
        check(self.architecture in SUPPORTED_ARCHITECTURES, "architecture",
               f"{self.architecture!r} is not supported",
               f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        for name, hi in MODEL_LIMITS.items():
            check_int(getattr(self, name), name, 1, hi, "rebuild the engine from the model's config.json")
        check(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
               f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")
        check(self.head_dim % 2 == 0, "head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
        check_real(self.rms_norm_eps, "rms_norm_eps", 0.0, 1.0, "e.g. 1.0e-5")
        check_real(self.rope_theta, "rope_theta", 0.0, 1e12, "e.g. 10000.0")
        check_rope_scaling(self.rope_scaling)
        for name in ("tie_word_embeddings", "attention_bias"):
            v = getattr(self, name)
            check(isinstance(v, bool), name, f"must be true or false, got {got(v)}")
        if self.bos_token_id is not None:
            check_int(self.bos_token_id, "bos_token_id", 0, self.vocab_size - 1)
        eos = self.eos_token_ids
        check(isinstance(eos, (list, tuple)) and all(is_int(t) and 0 <= t < self.vocab_size for t in eos),
               "eos_token_ids", f"must be a list of token ids in [0, {self.vocab_size}), got {eos!r}")
        object.__setattr__(self, "eos_token_ids", tuple(eos))

    @property
    def qk_norm(self) -> bool:
        """Each head of q and of k is RMS-normalised (weights `q_norm`, `k_norm` [head_dim]) between
        the projection and RoPE."""
        return self.architecture in QK_NORM_ARCHITECTURES

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
MODES = ("dense", "lookahead", "sparse")   # sparse: top-K attention in place (runtime/sparse.py)
KV_DTYPES = ("float32", "float16", "bfloat16")   # KV storage: host pool, device tier, dense pool
# what a prompt's rows compute in (runtime/ops.py resolve_prefill): auto picks the machine's fastest
# accurate one; float32 is the reference (torch's GEMMs and attention)
PREFILL_PRECISIONS = ("auto", "float32", "bfloat16", "int8")
DECODE_PRECISIONS = ("float32", "int8")


@dataclass(frozen=True)
class LookaheadConfig:
    """KV placement policy. Defaults follow OasisKV (block 16, K=128) and DualDecoder (prefetch
    lead of 2 layers under ping-pong), except the fetch ratio: OasisKV's 0.05 admits 7 blocks per
    step, layer and head, and with the draft chain in sync (prediction ~0.99 right at 8K) that cap,
    not the prediction, held the prefetch hit rate to 0.87; 0.2 gives ~0.96 (docs/RESULTS.md)."""

    mode: str = "dense"            # dense | lookahead (device tier + look-ahead) | sparse (top-K in place)
    block_size: int = 16
    top_k: int = 128               # selected blocks per layer and KV head
    fetch_ratio: float = 0.2       # capped eviction under drop: admit at most ceil(ratio * top_k) blocks/step
    num_sink_blocks: int = 1       # always resident (attention sinks)
    recent_window: int = 64        # tokens, always resident
    residency: str = "resident"
    miss_policy: str = "urgent"
    draft: str = "dual_token"
    group_score: str = "max"       # a GQA group's block score: max over its heads, or sum (the original design)
    resync_after: int = 1          # draft misses in a row before the chain is re-seeded by
                                   # pre-decoding (1: after every miss; 0: never)
    prefetch_lead: int = 2         # pingpong: layer l+lead is fetched while layer l computes
    prefill_chunk: int = 512       # tokens per prefill chunk
    prefill_top_k: int = 0         # lookahead: a prompt chunk attends to its sink, the top-K blocks its rows
                                   # select, the prefill_window before it and itself (0: dense prefill)
    prefill_window: int = 1024     # tokens before a chunk that it attends to densely when prefill_top_k > 0
    max_batch_size: int = 8
    max_model_len: int = 8192
    device_budget_bytes: int | None = None  # None: derived from top_k, sink and window
    kv_dtype: str | None = None    # how K/V are stored (host pool, device tier, dense pool): float32,
                                   # float16 or bfloat16 (half the bytes; attention reads them in fp32).
                                   # None: the weights' dtype (float32 for an fp32 engine)
    prefix_caching: bool = True    # full KV blocks outlive their request in the host pool, named by a
                                   # chained hash of their tokens; a prompt that starts with cached
                                   # blocks prefills only the rest (runtime/prefix_cache.py)
    prefill_precision: str = "auto"  # a prompt's GEMMs and attention: float32 | bfloat16 (bf16 dot
                                   # products, fp32 sums) | int8 (int8 engines: int8 activations x
                                   # int8 weights) | auto (the fastest this machine and engine have:
                                   # docs/SETTINGS.md)
    decode_precision: str = "float32"  # an int8 engine's decode rows: float32 activations against the
                                   # int8 weights (weight-only: what the builder verified) | int8 (the
                                   # activations quantized per row and 64 inputs too: W8A8, the int8
                                   # prompt kernel; 1.5x faster at 1 row, 3x at 8: docs/SETTINGS.md)

    def __post_init__(self) -> None:
        check(self.mode in MODES, "mode", f"{self.mode!r} is unknown", f"use one of {MODES}")
        bs = self.block_size
        check_int(bs, "block_size", 1, 4096, "e.g. 16")
        check(bs & (bs - 1) == 0, "block_size", f"must be a power of two, got {bs!r}", "e.g. 16")
        check_int(self.top_k, "top_k", 1, 1 << 20, "a number of blocks; the papers use 128")
        check_real(self.fetch_ratio, "fetch_ratio", 0.0, 1.0, "0.2 by default; OasisKV uses 0.05")
        check_int(self.num_sink_blocks, "num_sink_blocks", 0, 1 << 16, "e.g. 1")
        check_int(self.recent_window, "recent_window", 0, 1 << 24, "a number of tokens, e.g. 64")
        check(self.residency in RESIDENCY, "residency", f"{self.residency!r} is unknown",
               f"use one of {RESIDENCY}")
        check(self.miss_policy in MISS_POLICIES, "miss_policy", f"{self.miss_policy!r} is unknown",
               f"use one of {MISS_POLICIES}")
        check(self.draft in DRAFTS, "draft", f"{self.draft!r} is unknown", f"use one of {DRAFTS}")
        check(self.group_score in GROUP_SCORES, "group_score", f"{self.group_score!r} is unknown",
               f"use one of {GROUP_SCORES}")
        if self.draft == "none":    # no prediction: only the real query's on-demand fetch fills the set
            check(self.miss_policy == "urgent", "miss_policy",
                   f"{self.miss_policy!r} with draft 'none' would never fill the working set",
                   "use miss_policy 'urgent' (blocks fetched on demand), or a draft")
            check(self.residency == "resident", "residency",
                   f"{self.residency!r} refills from predictions, and draft 'none' makes none",
                   "use residency 'resident', or a draft")
        check_int(self.resync_after, "resync_after", 0, 1 << 30, "1 re-seeds after every miss, 0 never")
        check_int(self.prefetch_lead, "prefetch_lead", 1, 1024, "e.g. 2")
        check_int(self.prefill_chunk, "prefill_chunk", 1, 1 << 20, "e.g. 512")
        check_int(self.prefill_top_k, "prefill_top_k", 0, 1 << 20, "a number of blocks, e.g. 256; 0 for dense")
        check_int(self.prefill_window, "prefill_window", 0, 1 << 24, "a number of tokens, e.g. 1024")
        check_int(self.max_batch_size, "max_batch_size", 1, 4096, "e.g. 8")
        check_int(self.max_model_len, "max_model_len", 1, 1 << 24, "e.g. 8192")
        if self.device_budget_bytes is not None:
            check_int(self.device_budget_bytes, "device_budget_bytes", 1, 1 << 50, "a number of bytes, or null")
        if self.kv_dtype is not None:
            check(isinstance(self.kv_dtype, str) and self.kv_dtype in KV_DTYPES, "kv_dtype",
                   f"{self.kv_dtype!r} is not a KV storage dtype" if isinstance(self.kv_dtype, str)
                   else f"must be a dtype name, got {got(self.kv_dtype)}", f"use one of {', '.join(KV_DTYPES)}")
        check(isinstance(self.prefill_precision, str) and self.prefill_precision in PREFILL_PRECISIONS,
               "prefill_precision", f"{self.prefill_precision!r} is not a prefill precision",
               f"use one of {', '.join(PREFILL_PRECISIONS)}")
        check(isinstance(self.decode_precision, str) and self.decode_precision in DECODE_PRECISIONS,
               "decode_precision", f"{self.decode_precision!r} is not a decode precision",
               f"use one of {', '.join(DECODE_PRECISIONS)}")
        check(isinstance(self.prefix_caching, bool), "prefix_caching",
               f"must be true or false, got {got(self.prefix_caching)}", "write true or false, without quotes")

    @property
    def fetch_cap(self) -> int:
        """Blocks admitted per step, layer and KV head under capped eviction (at least one)."""
        return max(1, math.ceil(self.fetch_ratio * self.top_k - 1e-9))

    @property
    def prediction_cap(self) -> int:
        """A prediction's admissions per step, layer and KV head: `fetch_cap` under `drop`, whose misses are
        tolerated (capped eviction bounds the copies); under `urgent` every predicted block (K). There every
        miss is fetched on the critical path anyway, so a cap below the true set's churn (about 30 % a step
        at 16K on Qwen2.5-0.5B) moves the blocks it holds back in front of attention and adds misses: measured
        at 4K on SmolLM2, K = 32, a cap of 7 gave a hit rate of 0.910 and 2.8x the urgent blocks of no cap
        (0.967, the agreement)."""
        return self.fetch_cap if self.miss_policy == "drop" else self.top_k

    def with_kv_dtype(self, weights_dtype: str) -> "LookaheadConfig":
        """This config with `kv_dtype` set for an engine of `weights_dtype`: unset, the KV is stored
        in the weights' dtype. Lookahead's ops take K/V in the queries' dtype, or float16/bfloat16
        under float32 queries (plugins/CONTRACTS.md); dense attention upcasts any pairing."""
        cfg = self if self.kv_dtype is not None else dataclasses.replace(self, kv_dtype=weights_dtype)
        check(cfg.mode != "lookahead" or weights_dtype == "float32" or cfg.kv_dtype == weights_dtype, "kv_dtype",
               f"{cfg.kv_dtype} under {weights_dtype} weights is not supported in lookahead mode",
               f"use kv_dtype {weights_dtype}, or an fp32 engine")
        return cfg

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


@dataclass(frozen=True)
class BuildPrecision:
    """engine.yaml's `precision:` section, written by the builder: the precision of an engine's prompt
    rows (`prefill`: `prefill_precision` auto resolved on the build host, `host`) and decode rows, and
    the precisions the build verified against the source model (None: the build skipped verification,
    --no-verify). `runtime/spec.py` runs `prefill` for auto and refuses an unverified precision."""

    prefill: str
    decode: str = "float32"
    verified_prefill: tuple[str, ...] | None = ("float32",)
    verified_decode: tuple[str, ...] | None = ("float32",)
    host: str = ""

    def __post_init__(self) -> None:
        resolved = tuple(p for p in PREFILL_PRECISIONS if p != "auto")
        check(self.prefill in resolved, "precision.prefill", f"{self.prefill!r} is not a resolved prefill precision",
              f"one of {', '.join(resolved)}; rebuild the engine")
        check(self.decode in DECODE_PRECISIONS, "precision.decode", f"{self.decode!r} is not a decode precision",
              f"one of {', '.join(DECODE_PRECISIONS)}; rebuild the engine")
        for name, known in (("verified_prefill", resolved), ("verified_decode", DECODE_PRECISIONS)):
            v = getattr(self, name)
            if v is not None:
                check(isinstance(v, (list, tuple)) and all(isinstance(p, str) and p in known for p in v),
                      f"precision.{name}", f"must be a list of {', '.join(known)} or null, got {got(v)}",
                      "rebuild the engine")
                object.__setattr__(self, name, tuple(v))
        check(isinstance(self.host, str) and len(self.host) <= 256, "precision.host", "must be a short string",
              "rebuild the engine")

    def verifies(self, what: str, precision: str) -> bool:
        """Whether the build verified `what` ("prefill" / "decode") rows at `precision` (any, when it
        skipped verification: nothing to hold a run to)."""
        verified = getattr(self, f"verified_{what}")
        return verified is None or precision in verified

    def verified_summary(self) -> str:
        if self.verified_prefill is None:
            return "nothing: built with --no-verify"
        return f"prefill {', '.join(self.verified_prefill)}; decode {', '.join(self.verified_decode or ())}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BuildPrecision":
        return cls(**_known_fields(cls, d, "precision"))


def check_known_keys(d: dict[Any, Any], names: "set[str] | tuple[str, ...]", prefix: str = "") -> None:
    """Every key of `d` is one of `names`; else a ConfigError naming the first unknown key (with
    `prefix`, e.g. "model."), the closest known name, and the known ones."""
    unknown = sorted(map(str, set(d) - set(names)))
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"{prefix}{unknown[0][:80]}", "is not a known field",
                          f"{hint}known: {', '.join(sorted(names))}")


def _known_fields(cls: type, d: dict[str, Any], section: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ConfigError(section, f"must be a mapping of fields, got {got(d)}", "rebuild the engine")
    names = {f.name for f in dataclasses.fields(cls)}
    check_known_keys(d, names, f"{section}.")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for name in required:
        if name not in d:
            raise ConfigError(f"{section}.{name}", "is missing", "rebuild the engine")
    return dict(d)
