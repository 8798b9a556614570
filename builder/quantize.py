"""Weight-only int8 quantization of a runtime-layout state dict (`--quantize int8`).

Every projection (`wqkv`, `wo`, `w13`, `w2`), the embedding (tied: its per-row scale also serves the
logits projection, the largest single weight) and an untied `lm_head` become

    qweight[n, k] = round(W[n, k] / scale[n]) in [-127, 127]   (int8)
    scale[n]      = max_k |W[n, k]| / 127                       (float32, one per output channel)

symmetric, no zero point: W ~= qweight * scale[:, None], with |error| <= scale[n] / 2 per element.
A zero row gets scale 0 and stays exactly zero. Norms and biases stay float32. The layout of the
result is `runtime.engine_dir.expected_tensors(cfg, "float32", section)`.
"""
from __future__ import annotations

from typing import Any

import torch

from runtime.config import ModelConfig
from runtime.engine_dir import QUANT_SCHEME, QUANTIZABLE, expected_tensors

from .errors import BuildError

QMAX = 127          # symmetric: -128 is never used, so negation is exact
SCHEMES = ("int8",)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (qweight [N, K] int8, scale [N] float32), per output channel."""
    if w.dim() != 2:
        raise ValueError(f"quantize_int8 takes a 2-D weight, got shape {list(w.shape)}")
    w32 = w.detach().float()
    scale = w32.abs().amax(dim=1) / QMAX                                  # [N]
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
    q = torch.round(w32 / divisor).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(qweight [N, K] int8, scale [N]) -> W [N, K] float32."""
    return qweight.float() * scale.float()[:, None]


def quantized_roles(cfg: ModelConfig) -> list[str]:
    """What `--quantize int8` quantizes: every role of engine_dir.QUANTIZABLE the model has."""
    return [r for r in QUANTIZABLE if r != "lm_head" or not cfg.tie_word_embeddings]


def quantize_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig,
                     scheme: str = "int8") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """fp32 runtime-layout state dict -> (int8 state dict, engine.yaml `quantization:` section).

    The section holds the scheme's fields (engine_dir.QUANT_SCHEME), the roles quantized, what stays
    float32, and the bytes of the quantized weights before and after.
    """
    if scheme not in SCHEMES:
        raise BuildError("is not a supported quantization", field="quantize", value=scheme,
                         fix=f"use one of: {', '.join(SCHEMES)}")
    roles = quantized_roles(cfg)
    out: dict[str, torch.Tensor] = {}
    before = after = 0
    for name, w in weights.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in roles:
            q, s = quantize_int8(w)
            out[module + ".qweight"], out[module + ".scale"] = q, s
            before += w.numel() * 4
            after += q.numel() + s.numel() * 4
        else:
            out[name] = w.float().contiguous()
    section = {**QUANT_SCHEME, "quantized": roles,
               "float32": "norms and biases" if cfg.attention_bias else "norms",
               "quantized_bytes": {"float32": before, "int8": after}}
    if cfg.tie_word_embeddings:
        section["tied_lm_head"] = "the logits use embed_tokens' qweight and per-row scale"
    want = {k: v[0] for k, v in expected_tensors(cfg, "float32", section).items()}
    got = {k: tuple(v.shape) for k, v in out.items()}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))
        raise BuildError(f"internal: quantized weights do not match the int8 layout at {diff[0]}",
                         fix="this is a builder bug; please report it")
    return out, section
