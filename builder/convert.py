"""Hugging Face tensor names -> the runtime layout of `runtime.engine_dir.WEIGHT_LAYOUT`.

Per layer, q/k/v become one `wqkv` (rows q | k | v, heads in Hugging Face order: the runtime's RoPE
uses the same rotate-half convention, so no permutation is needed) and gate/up become one `w13`
(rows gate | up); qwen3's per-head `q_norm` / `k_norm` weights are kept as they are. Everything is
checked against the shapes the config implies *before* fusing, so a config that disagrees with its
weights is reported by tensor name instead of as a failed `cat`.
"""
from __future__ import annotations

import torch

from runtime.config import ModelConfig
from runtime.engine_dir import expected_shapes

from .errors import BuildError, SourceError

Shape = tuple[int, ...]
# Tensors a checkpoint may carry that the runtime recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    """Every Hugging Face tensor the conversion reads, with the shape `cfg` implies."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes: dict[str, Shape] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def check_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, where: str) -> None:
    """Raise SourceError for a missing, mis-shaped, non-float or unexpected tensor."""
    expected = hf_shapes(cfg)
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise SourceError(f"{where}: tensor {missing[0]} is missing{more}",
                          fix=f"the checkpoint is incomplete or not a {cfg.architecture} model")
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise SourceError(f"{where}: {name} has shape {list(got)} but the config implies {list(shape)} "
                              f"({_dims(cfg)})", fix="config.json disagrees with the weights")
        if not tensors[name].is_floating_point():
            raise SourceError(f"{where}: {name} has dtype {tensors[name].dtype}",
                              fix="quantized checkpoints are not supported; pass float weights or a GGUF")
    known = set(expected) | ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    unexpected = sorted(n for n in tensors if n not in known and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise SourceError(f"{where}: unexpected tensor {unexpected[0]}",
                          fix="this model variant is not supported by the runtime")


def convert(tensors: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype,
            where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Checked Hugging Face state dict -> runtime state dict in `dtype` (contiguous tensors).

    A tied checkpoint's `lm_head.weight`, if present, is dropped: the runtime reads the embedding.
    """
    check_tensors(tensors, cfg, where)
    out = {"embed_tokens.weight": tensors["model.embed_tokens.weight"], "norm.weight": tensors["model.norm.weight"]}
    for i in range(cfg.num_layers):
        out.update(_layer(tensors, i, cfg))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = tensors["lm_head.weight"]
    out = {k: v.to(dtype).contiguous() for k, v in out.items()}
    _check_layout(out, cfg)
    return out


def _layer(t: dict[str, torch.Tensor], i: int, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    hf, rt = f"model.layers.{i}.", f"layers.{i}."
    attn = [t[hf + f"self_attn.{p}_proj.weight"] for p in "qkv"]
    layer = {
        rt + "attn_norm.weight": t[hf + "input_layernorm.weight"],
        rt + "wqkv.weight": torch.cat(attn, dim=0),                          # [q + 2kv, h]
        rt + "wo.weight": t[hf + "self_attn.o_proj.weight"],
        rt + "mlp_norm.weight": t[hf + "post_attention_layernorm.weight"],
        rt + "w13.weight": torch.cat([t[hf + "mlp.gate_proj.weight"], t[hf + "mlp.up_proj.weight"]], dim=0),
        rt + "w2.weight": t[hf + "mlp.down_proj.weight"],
    }
    if cfg.attention_bias:
        layer[rt + "wqkv.bias"] = torch.cat([t[hf + f"self_attn.{p}_proj.bias"] for p in "qkv"])
    if cfg.qk_norm:                                      # qwen3: one RMSNorm weight [head_dim] each
        layer[rt + "q_norm.weight"], layer[rt + "k_norm.weight"] = (t[hf + f"self_attn.{p}_norm.weight"] for p in "qk")
    return layer


def _check_layout(out: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """The runtime's own contract; a failure here is a builder bug, not a user error."""
    want = expected_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in out.items()}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))
        raise BuildError(f"internal: converted weights do not match runtime layout at {diff[0]}",
                         fix="please report this builder bug")


def _dims(cfg: ModelConfig) -> str:
    return (f"vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}, "
            f"intermediate_size={cfg.intermediate_size}, heads={cfg.num_heads}/{cfg.num_kv_heads} "
            f"x head_dim={cfg.head_dim}")
