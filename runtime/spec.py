"""The engine spec: what one engine runs, resolved once, before anything is allocated.

    spec = resolve_spec(load_manifest("engines/default"), overrides={"mode": "lookahead"})
    print(spec.prefill, spec.decode, spec.why["prefill"])

`resolve_spec` turns (engine.yaml, the caller's overrides, the host) into a frozen `EngineSpec`: the
settings with every cross-field rule applied (kv_dtype, top_k clamped to the context, a setting the
mode does not read refused), the precision of prompt rows and of decode rows and why, the kernel table
behind them, and the memory plan. `Engine.from_dir`, `Engine.sibling` and `Engine(...)` consume it and
decide nothing of their own; `Engine.describe()` (and `python -m runtime info`) prints it.

Precision is a property of the build: engine.yaml's `precision:` section records what the builder
resolved (`auto` on the build host) and verified against the source model. `prefill_precision: auto`
runs the build's choice on every host; a precision the build did not verify is refused with a
ConfigError naming `allow_unverified_precision` (`--allow-unverified-precision`). An engine dir
written before builds recorded it resolves `auto` on this host, as before, with a WARNING for a real
model (tests' hand-written random engines resolve silently).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .block_manager import blocks_needed
from .config import LookaheadConfig
from .engine_dir import Manifest, group_size
from .errors import ConfigError
from .memory_plan import DTYPE_BYTES, MemoryPlan, check_memory, plan_memory
from .ops import IMPLS, Ops, c_applies, resolve_decode, resolve_prefill, select_ops

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Which modes read each setting (the rest govern every mode): one set in a mode that ignores it is refused.
SELECTION = ("sparse", "lookahead")
GOVERNS = {**dict.fromkeys(("top_k", "num_sink_blocks", "recent_window", "group_score"), SELECTION),
           **dict.fromkeys(("fetch_ratio", "residency", "miss_policy", "draft", "resync_after", "prefetch_lead",
                            "prefill_top_k", "prefill_window", "device_budget_bytes"), ("lookahead",))}

# What a user chooses in each mode; every other setting is tuning, whose default fits the seeds'
# operating point (docs/SETTINGS.md lists both, the CLI's --help shows them in two groups)
ESSENTIAL = ("mode", "max_model_len", "max_batch_size", "kv_dtype", "top_k", "residency", "miss_policy", "draft")


def essential_settings(mode: str) -> tuple[str, ...]:
    """The settings a user must know to run `mode` (the rest are tuning with working defaults)."""
    return tuple(k for k in ESSENTIAL if mode in GOVERNS.get(k, (mode,)))


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine decided at load, and why. `config` is the effective one: every field
    resolved (kv_dtype set, top_k clamped, prefill/decode precision resolved)."""

    manifest: Manifest
    device: torch.device
    config: LookaheadConfig
    max_model_len: int
    impl: str                       # the kernel table asked for (runtime/ops.py IMPLS)
    debug_checks: bool
    memory_plan: MemoryPlan
    why: dict[str, str] = field(default_factory=dict)     # prefill / decode: where each precision came from
    unverified: tuple[str, ...] = ()                      # precisions run that the build did not verify

    @property
    def prefill(self) -> str:
        return self.config.prefill_precision

    @property
    def decode(self) -> str:
        return self.config.decode_precision

    @property
    def quantized(self) -> bool:
        return self.manifest.quantization is not None

    @property
    def int8_group(self) -> int:
        """An int8 engine's inputs per weight scale (0: one per output channel); 0 for others."""
        return group_size(self.manifest.quantization) if self.quantized else 0

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.manifest.dtype]

    def table(self, base: Ops | None = None) -> Ops:
        """The kernel table of this spec: `base` (a loaded model's, or a caller's) with its prefill
        and decode entries at this spec's precisions, or a fresh `select_ops` table."""
        if base is None:
            ops = select_ops(self.device, self.dtype, self.impl, quantized=self.quantized, prefill=self.prefill)
        elif base.prefill != self.prefill:
            ops = base.with_prefill(self.prefill, self.quantized)
        else:
            ops = base
        return ops if ops.decode == self.decode else ops.with_decode(self.decode)

    def precision_record(self) -> dict[str, Any]:
        """The precision section of `Engine.describe()`."""
        build = self.manifest.precision
        return {"prefill": self.prefill, "decode": self.decode, **{f"{k}_from": v for k, v in self.why.items()},
                "verified_by_build": None if build is None else build.verified_summary(),
                "unverified": list(self.unverified)}


def resolve_spec(manifest: Manifest, device: torch.device, overrides: Mapping[str, Any] | None = None, *,
                 base: LookaheadConfig | None = None, impl: str = "auto", ops: Ops | None = None,
                 debug_checks: bool = False, num_host_blocks: int | None = None, weights: bool = True,
                 allow_unverified_precision: bool = False) -> EngineSpec:
    """The spec of an engine over `manifest` on `device` with `overrides` applied to `base` (default:
    engine.yaml's settings; a sibling's: its parent's effective config). ops: a caller's kernel table
    (tests), whose prefill precision then stands. weights: the plan counts the weights (False: a
    sibling over an already loaded model). Raises ConfigError naming the field for anything the
    engine cannot run, before anything is allocated."""
    if impl not in IMPLS:
        raise ConfigError("impl", f"{impl!r} is not a kernel table", f"use one of {', '.join(IMPLS)}")
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    # a launcher's settings travel as one mapping of CLI flags: the permission may ride in it
    allow_unverified_precision = bool(overrides.pop("allow_unverified_precision", allow_unverified_precision))
    config = (base or manifest.lookahead).replace(**overrides).with_kv_dtype(manifest.dtype)
    _check_governed(config.mode, overrides)
    max_model_len = min(config.max_model_len, manifest.model.max_position_embeddings)
    config = clamp_top_k(config, max_model_len)
    impl = "checked" if debug_checks and impl == "auto" else impl
    prefill, decode, why, unverified = _precision(manifest, config, device, impl, ops, allow_unverified_precision)
    config = config.replace(prefill_precision=prefill, decode_precision=decode)
    q = manifest.quantization or {}
    saving = q.get("quantized_bytes", {}).get("float32", 0) - q.get("quantized_bytes", {}).get("int8", 0)
    plan = plan_memory(manifest.model, config, num_host_blocks, DTYPE_BYTES[manifest.dtype], max_model_len,
                       weights=weights, packed_weights=False if q else None, device_type=device.type,
                       weight_saving=max(0, saving), prefill=prefill,
                       int8_group=group_size(q) if q else None, decode=decode)
    check_memory(plan)          # what the host cannot hold is refused here, before anything is allocated
    return EngineSpec(manifest, device, config, max_model_len, impl, debug_checks, plan, why, unverified)


def settings_for(mode: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The part of `settings` that `mode` reads (a sweep that runs several modes with one set of
    settings passes each mode its own share; anything else set in a mode is refused)."""
    return {k: v for k, v in settings.items() if mode in GOVERNS.get(k, (mode,))}


def _check_governed(mode: str, overrides: Mapping[str, Any]) -> None:
    for name in overrides:
        modes = GOVERNS.get(name)
        if modes is not None and mode not in modes:
            raise ConfigError(name, f"is a {' and '.join(modes)} setting: mode {mode} does not read it",
                              f"drop it, or run mode {modes[-1]}")


def _precision(manifest: Manifest, config: LookaheadConfig, device: torch.device, impl: str, ops: Ops | None,
               allow_unverified: bool) -> tuple[str, str, dict[str, str], tuple[str, ...]]:
    """(prefill, decode, why, the precisions run that the build did not verify)."""
    build, quantized, dtype = manifest.precision, manifest.quantization is not None, DTYPES[manifest.dtype]
    group = group_size(manifest.quantization) if quantized else 0
    asked = config.prefill_precision
    if ops is not None:                                    # a caller's table: its precision stands
        prefill, why_prefill = ops.prefill, "the caller's kernel table"
    elif asked != "auto":
        prefill, why_prefill = resolve_prefill(asked, device, dtype, quantized, impl, group), "set"
    elif build is not None:
        prefill = build.prefill
        if prefill != "float32" and (impl == "torch" or c_applies(device) is not None):
            prefill, why_prefill = "float32", f"auto: the {impl} kernel table on {device.type} prefills in float32"
        else:
            why_prefill = f"auto: the build's ({build.host or 'its host'})"
    else:
        prefill = resolve_prefill("auto", device, dtype, quantized, impl, group)
        why_prefill = "auto: resolved on this host"
        if build is None and manifest.random_weights is None and manifest.source.get("kind") in ("hf_dir", "gguf"):
            log.warning("%s: engine.yaml records no build precision (built before builds pinned it): "
                        "prefill_precision auto resolved on this host to %s; rebuild the engine to pin it",
                        manifest.path, prefill)
            why_prefill += " (engine.yaml records none: rebuild to pin it)"
    decode = resolve_decode(config.decode_precision, quantized, group)
    why = {"prefill": why_prefill, "decode": "set" if config.decode_precision != "float32" else "default"}
    unverified = tuple(f"{what}_precision {p}" for what, p, ok in
                       (("prefill", prefill, build is None or build.verifies("prefill", prefill)),
                        ("decode", decode, build is None or build.verifies("decode", decode))) if not ok)
    if unverified and not allow_unverified:
        what, p = unverified[0].split()
        raise ConfigError(what, f"{p} was not verified when this engine was built (verified: "
                          f"{build.verified_summary()})",
                          f"rebuild with --{what.replace('_', '-')} {p} to verify it, or accept it unverified with "
                          "allow_unverified_precision=True (--allow-unverified-precision)")
    for item in unverified:
        log.warning("%s: %s runs unverified (allow_unverified_precision)", manifest.path, item)
    return prefill, decode, why, unverified


def clamp_top_k(cfg: LookaheadConfig, max_model_len: int) -> LookaheadConfig:
    """top_k beyond the blocks a sequence of `max_model_len` tokens has selects nothing more (K
    already covers every block): clamp it, so the device tier is not sized for blocks no context
    reaches (`--top-k 100000` asked for 295 GB)."""
    most = blocks_needed(max_model_len, cfg.block_size)
    if cfg.top_k <= most:
        return cfg
    log.info("top_k %d exceeds the %d blocks of max_model_len %d: using %d", cfg.top_k, most, max_model_len, most)
    return cfg.replace(top_k=most)
