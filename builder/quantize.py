"""Weight-only int8 quantization of a runtime-layout state dict (`--quantize int8`).

Every projection (`wqkv`, `wo`, `w13`, `w2`), the embedding (tied: its scales also serve the logits
projection, the largest single weight) and an untied `lm_head` become, per group of G consecutive
inputs of each output channel (`--group-size G`, DEFAULT_GROUP_SIZE; 0: one group of all K)

    qweight[n, k]     = round(W[n, k] / scale[n, k // G]) in [-127, 127]      (int8)
    scale[n, k // G]  = max over the group of |W[n, k]| / 127                (float32)

symmetric, no zero point: W[n, k] ~= qweight[n, k] * scale[n, k // G], |error| <= the scale / 2 per
element. Scales: [N, K // G], or [N] for G = 0 (per output channel, as engines built before groups).
A zero group gets scale 0 and stays exactly zero. At G = 64, fp32 scales cost what llama.cpp's Q8_0
(32 int8 values and one fp16 scale) does: 1.0625 bytes a weight. Norms and biases stay float32.
The layout of the result is `runtime.engine_dir.expected_tensors(cfg, "float32", section)`.
"""
from __future__ import annotations

from typing import Any

import torch

from plugins.cpu.ops import dequantize_int8  # noqa: F401  (re-exported: W as the runtime computes it)
from runtime.config import ModelConfig
from runtime.engine_dir import QUANT_SCHEME, QUANTIZABLE, expected_shapes, expected_tensors

from .errors import BuildError

QMAX = 127              # symmetric: -128 is never used, so negation is exact
SCHEMES = ("int8",)
DEFAULT_GROUP_SIZE = 64     # at 8K context per-channel scales lost a RULER needle that G = 64 keeps
GROUP_MULTIPLE = 8          # linear_int8.c reads eight weights at a time, all of one group


def quantize_int8(w: torch.Tensor, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (qweight [N, K] int8, scale float32): [N] per output channel
    (group_size 0), else [N, K // group_size], one per group of group_size consecutive inputs."""
    if w.dim() != 2:
        raise ValueError(f"quantize_int8 takes a 2-D weight, got shape {list(w.shape)}")
    N, K = w.shape
    if group_size < 0 or (group_size and K % group_size):
        raise ValueError(f"group_size {group_size} does not divide K = {K} (0: per output channel)")
    G = group_size or max(K, 1)
    w32 = w.detach().float().reshape(N, K // G, G)
    scale = w32.abs().amax(dim=2) / QMAX                                   # [N, K // G]
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))[:, :, None]
    q = torch.round(w32 / divisor).clamp_(-QMAX, QMAX).to(torch.int8).reshape(N, K)
    return q.contiguous(), (scale if group_size else scale.reshape(N)).contiguous()


def quantized_roles(cfg: ModelConfig) -> list[str]:
    """What `--quantize int8` quantizes: every role of engine_dir.QUANTIZABLE the model has."""
    return [r for r in QUANTIZABLE if r != "lm_head" or not cfg.tie_word_embeddings]


def check_group_size(group_size: Any, cfg: ModelConfig | None = None) -> None:
    """BuildError (field `group_size`) unless group_size is 0 or a positive multiple of
    GROUP_MULTIPLE that divides the inputs (K) of every weight `cfg` quantizes."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 0 \
            or group_size % GROUP_MULTIPLE:
        raise BuildError(f"must be 0 (one scale per output channel) or a positive multiple of {GROUP_MULTIPLE}",
                         field="group_size", value=group_size, fix=f"e.g. {DEFAULT_GROUP_SIZE}")
    if cfg is None or group_size == 0:
        return
    roles = quantized_roles(cfg)
    for name, shape in expected_shapes(cfg).items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in roles and shape[1] % group_size:
            raise BuildError(f"does not divide the {shape[1]} inputs of {name}", field="group_size", value=group_size,
                             fix=f"use a common divisor of the quantized weights' inputs that is a multiple of "
                                 f"{GROUP_MULTIPLE}, or 0 for one scale per output channel")


def quantize_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, scheme: str = "int8",
                     group_size: int = DEFAULT_GROUP_SIZE) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """fp32 runtime-layout state dict -> (int8 state dict, engine.yaml `quantization:` section).

    The section holds the scheme's fields (engine_dir.QUANT_SCHEME), the scale layout (granularity,
    group_size: 0 per output channel), the roles quantized, what stays float32, and the bytes of
    the quantized weights before and after.
    """
    if scheme not in SCHEMES:
        raise BuildError("is not a supported quantization", field="quantize", value=scheme,
                         fix=f"use one of: {', '.join(SCHEMES)}")
    check_group_size(group_size, cfg)
    roles = quantized_roles(cfg)
    out: dict[str, torch.Tensor] = {}
    before = after = 0
    for name, w in weights.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in roles:
            q, s = quantize_int8(w, group_size)
            out[module + ".qweight"], out[module + ".scale"] = q, s
            before += w.numel() * 4
            after += q.numel() + s.numel() * 4
        else:
            out[name] = w.float().contiguous()
    section = {**QUANT_SCHEME, "granularity": "per_group" if group_size else "per_output_channel",
               "group_size": group_size, "quantized": roles,
               "float32": "norms and biases" if cfg.attention_bias else "norms",
               "quantized_bytes": {"float32": before, "int8": after}}
    if cfg.tie_word_embeddings:
        section["tied_lm_head"] = "the logits use embed_tokens' qweight and scales"
    want = {k: v[0] for k, v in expected_tensors(cfg, "float32", section).items()}
    got = {k: tuple(v.shape) for k, v in out.items()}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))
        raise BuildError(f"internal: quantized weights do not match the int8 layout at {diff[0]}",
                         fix="this is a builder bug; please report it")
    return out, section
