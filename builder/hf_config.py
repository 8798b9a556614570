"""Hugging Face config.json (+ generation_config.json) -> `runtime.config.ModelConfig`.

Reads the plain JSON (not a transformers config object) so that both the transformers 4.x layout
(`rope_theta` + `rope_scaling`) and the 5.x layout (`rope_parameters`) are understood, and so that
every variant the runtime cannot run exactly is refused here, at build time, with its name.
Defaults for absent keys are transformers' own defaults for that architecture.
"""
from __future__ import annotations

from typing import Any

from runtime.config import SUPPORTED_ARCHITECTURES, ModelConfig
from runtime.errors import ConfigError
from runtime.rope_scaling import TYPE_KEYS

from .errors import SourceError

# transformers' defaults for keys a config.json may omit (LlamaConfig, Qwen2Config, MistralConfig,
# Qwen3Config; head_dim: hidden_size // heads unless named here).
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "mistral": 4096 * 32, "qwen3": 32768}
_DEFAULT_HEAD_DIM = {"qwen3": 128}
_MISTRAL_DEFAULT_SLIDING_WINDOW = 4096
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def model_config_from_hf(cfg: dict[str, Any], generation: dict[str, Any] | None = None,
                         where: str = "config.json") -> ModelConfig:
    """Translate and validate a Hugging Face causal-LM config.

    Parameters
    ----------
    cfg : parsed config.json.
    generation : parsed generation_config.json, if the checkpoint has one (more eos ids live there).
    where : how to name the config in error messages.

    Raises
    ------
    SourceError
        Unsupported architecture or variant, missing keys, or values the runtime rejects.
    """
    arch = _architecture(cfg, where)
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise SourceError(f"{where} has no {missing[0]!r}", fix="the checkpoint's config is incomplete")
    _refuse_unsupported_variants(cfg, arch, where)
    heads = cfg["num_attention_heads"]
    theta, scaling = _rope(cfg, where)
    fields = dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or _DEFAULT_HEAD_DIM.get(arch) or _div(cfg["hidden_size"], heads),
        max_position_embeddings=cfg.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[arch],
        rms_norm_eps=_number(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases (and no o_proj bias); the others' attention_bias is refused above.
        attention_bias=arch == "qwen2",
        bos_token_id=_first(cfg.get("bos_token_id"), (generation or {}).get("bos_token_id")),
        eos_token_ids=_eos_ids(cfg, generation),
    )
    try:
        return ModelConfig(**fields)           # every field typed and range-checked, rope_scaling's too
    except ConfigError as e:
        raise SourceError(f"{where}: {e}") from None


def _architecture(cfg: dict[str, Any], where: str) -> str:
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SourceError(f"{where}: architecture {arch!r} is not supported",
                          fix=f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _refuse_unsupported_variants(cfg: dict[str, Any], arch: str, where: str) -> None:
    """Variants whose math our single Llama definition does not implement."""
    def refuse(problem: str) -> None:
        raise SourceError(f"{where}: {arch} {problem}", fix="only the plain Llama-family block is supported")

    if cfg.get("hidden_act", "silu") != "silu":
        refuse(f"with hidden_act={cfg['hidden_act']!r} (not SwiGLU)")
    if cfg.get("mlp_bias"):
        refuse("with mlp_bias=true")
    if arch != "qwen2" and cfg.get("attention_bias"):
        refuse("with attention_bias=true (o_proj bias)")
    if arch == "mistral":
        window = cfg.get("sliding_window", _MISTRAL_DEFAULT_SLIDING_WINDOW)
        max_pos = cfg.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[arch]
        if window is not None and window < max_pos:
            refuse(f"with sliding_window={window} < max_position_embeddings={max_pos}")
    if arch in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        refuse("with use_sliding_window=true")
    layer_types = cfg.get("layer_types") or []
    other = [t for t in layer_types if t != "full_attention"] if isinstance(layer_types, list) else [layer_types]
    if other:
        refuse(f"with layer_types holding {other[0]!r} (every layer must be full_attention)")
    params = cfg.get("rope_parameters")
    rotary = params.get("partial_rotary_factor", 1.0) if isinstance(params, dict) else 1.0
    if cfg.get("partial_rotary_factor", 1.0) != 1.0 or rotary != 1.0:
        refuse("with partial rotary embeddings")


def _rope(cfg: dict[str, Any], where: str) -> tuple[Any, dict[str, Any] | None]:
    """(theta, scaling or None) from either config layout; scaling keeps its own keys (ModelConfig
    checks them: runtime/rope_scaling.py). A plain default scaling is None."""
    params = cfg.get("rope_parameters")
    if params:  # transformers >= 5: theta and scaling share one dict
        if not isinstance(params, dict):
            raise SourceError(f"{where}: rope_parameters must be a mapping, got {params!r}")
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    else:
        theta, scaling = cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
        if not scaling:
            return _number(theta), None
        if not isinstance(scaling, dict):
            raise SourceError(f"{where}: rope_scaling must be a mapping or null, got {scaling!r}")
    plain = all(k in TYPE_KEYS for k in scaling) and all(scaling[k] == "default" for k in scaling)
    return _number(theta), None if plain else dict(scaling)


def _number(v: Any) -> Any:
    """A JSON number as a float; anything else as it is, for ModelConfig to refuse by name."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def _div(a: Any, b: Any) -> Any:
    """a // b for the integers a config.json should hold; else `a`, for ModelConfig to refuse."""
    return a // b if all(isinstance(x, int) and not isinstance(x, bool) for x in (a, b)) and b > 0 else a


def _first(*values: Any) -> int | None:
    for v in values:
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return None


def _eos_ids(cfg: dict[str, Any], generation: dict[str, Any] | None) -> tuple[int, ...]:
    """Union of config.json's and generation_config.json's eos ids, in order of appearance."""
    ids: list[int] = []
    for v in (cfg.get("eos_token_id"), (generation or {}).get("eos_token_id")):
        for t in (v if isinstance(v, list) else [v]):
            if t is not None and int(t) not in ids:
                ids.append(int(t))
    return tuple(ids)
