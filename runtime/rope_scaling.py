"""What a model's `rope_scaling` may say: the RoPE scalings the runtime computes exactly
(transformers' `rope_type`s default, linear, llama3 and yarn), every field typed and range-checked.

    check_rope_scaling({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})

A failure is a `ConfigError` naming `rope_scaling.<field>` and the fix; `ModelConfig` calls it, so
a config.json (builder/hf_config.py) and an engine.yaml (runtime/engine_dir.py) are checked alike.
A scaling the runtime does not compute (`dynamic`, `longrope`, ...) or a field it does not read is
refused by name: nothing is ignored. runtime/rope.py computes the tables from what passes here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checks import check, check_bool, check_int, check_real, got

SUPPORTED = ("default", "linear", "llama3", "yarn")
TYPE_KEYS = ("rope_type", "type")          # transformers' name, and its legacy one
# why the others cannot run exactly here
REFUSED = {
    "dynamic": "dynamic NTK rescales every frequency with the sequence's current length, which the "
               "keys already cached at a shorter length do not follow",
    "longrope": "LongRoPE switches its per-dimension factors at the original context length, which the "
                "keys already cached before the switch do not follow",
}


@dataclass(frozen=True)
class Field:
    """One field of a rope type: a number in (lo, hi] ([lo, hi] when not lo_open), an integer in
    [lo, hi], or a bool. An optional number may be null (transformers reads null as absent)."""
    kind: str                 # "real" | "int" | "bool"
    required: bool = False
    lo: float = 0.0
    hi: float = 1e6
    lo_open: bool = True
    fix: str = ""


FACTOR = Field("real", True, 1.0, 1e6, lo_open=False, fix="the context extension factor, at least 1 (e.g. 4.0)")
ORIGINAL = Field("int", True, 1, 1 << 24, fix="the context the model was pretrained at, e.g. 32768")
FIELDS: dict[str, dict[str, Field]] = {
    "default": {},
    "linear": {"factor": FACTOR},
    "llama3": {"factor": FACTOR, "original_max_position_embeddings": ORIGINAL,
               "low_freq_factor": Field("real", True, fix="e.g. 1.0"),
               "high_freq_factor": Field("real", True, fix="greater than low_freq_factor, e.g. 4.0")},
    "yarn": {"factor": FACTOR, "original_max_position_embeddings": ORIGINAL,
             "attention_factor": Field("real", hi=1e3, fix="what cos and sin are multiplied by, or null "
                                                           "(derived from factor and mscale)"),
             "beta_fast": Field("real", fix="rotations, 32 by default"),
             "beta_slow": Field("real", fix="rotations, 1 by default (at most beta_fast)"),
             "mscale": Field("real", hi=1e3, lo_open=False, fix="e.g. 1.0, or null"),
             "mscale_all_dim": Field("real", hi=1e3, lo_open=False, fix="e.g. 1.0, or null"),
             "truncate": Field("bool")},
}


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The scaling's type (`rope_type`, or the legacy `type`; "default" when neither is there):
    ConfigError naming the key for one that is not a string, not supported, or where both keys
    disagree."""
    if not scaling:
        return "default"
    kinds = {key: scaling[key] for key in TYPE_KEYS if key in scaling}
    for key, kind in kinds.items():
        check(isinstance(kind, str), f"rope_scaling.{key}", f"must be a string, got {got(kind)}",
              f"one of {', '.join(SUPPORTED)}")
        check(kind in SUPPORTED, f"rope_scaling.{key}", f"{kind!r} is not supported"
              + (f": {REFUSED[kind]}" if kind in REFUSED else ""), f"supported: {', '.join(SUPPORTED)}")
    if len(set(kinds.values())) > 1:
        check(False, "rope_scaling.type", f"says {kinds['type']!r} but rope_type says {kinds['rope_type']!r}",
              "keep one of them")
    return next(iter(kinds.values()), "default")


def check_rope_scaling(scaling: Any) -> None:
    """`scaling` (a model's rope_scaling, None for none) is one the runtime computes exactly:
    a supported type, only that type's fields, each of its kind and in range."""
    if scaling is None:
        return
    check(isinstance(scaling, dict), "rope_scaling", f"must be a mapping or null, got {got(scaling)}")
    kind = rope_type(scaling)
    fields = FIELDS[kind]
    for key in scaling:
        check(key in TYPE_KEYS or key in fields, f"rope_scaling.{key}", f"is not a field of rope_type {kind}",
              f"{kind} takes {', '.join(fields)}" if fields else f"{kind} takes no fields")
    for name, f in fields.items():
        _check_field(scaling, name, f)
    if kind == "llama3":
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        check(hi > lo, "rope_scaling.high_freq_factor", f"must be greater than low_freq_factor {lo}, got {hi}",
              "e.g. low 1.0, high 4.0")
    if kind == "yarn":
        fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1     # transformers' defaults
        check(fast >= slow, "rope_scaling.beta_slow", f"{slow} is above beta_fast {fast}",
              "beta_fast bounds the extrapolated dimensions, beta_slow the interpolated ones: beta_slow <= beta_fast")


def _check_field(scaling: dict[str, Any], name: str, f: Field) -> None:
    where, v = f"rope_scaling.{name}", scaling.get(name)
    if name not in scaling or (v is None and f.kind == "real" and not f.required):
        check(not f.required, where, "is missing", f.fix)
        return
    if f.kind == "bool":
        check_bool(v, where)
    elif f.kind == "int":
        check_int(v, where, int(f.lo), int(f.hi), f.fix)
    else:
        check_real(v, where, f.lo, f.hi, f.fix, lo_open=f.lo_open)
