"""Run the built engine and the source model (transformers) on fixed prompts and compare.

The reference is transformers' own model for the source dir in fp32; the engine is
`runtime.model.LlamaModel` loaded from the weights file just written, with full causal attention
over positions 0..T-1 (`runtime.attention_ref.CausalAttention`). Per prompt we record the largest
|logit difference|, the fraction of positions whose argmax agrees, and timings; then each model
greedily extends the prompt by `GREEDY_TOKENS` tokens (recomputing the full forward each step).

Tolerances (`TOLERANCES`), scaled by the prompt's largest |reference logit| (at least 1):

* float32: |Δlogit| <= 1e-3 · scale. A correct conversion differs from transformers only by fp32
  reassociation (fused q|k|v and gate|up matmuls, another attention kernel): ~1e-6 relative per op,
  growing with depth to ~1e-5 of the scale over 30 layers. A real layout bug (a swapped head, a
  missed permutation, q|k order) moves logits by O(scale). 1e-3 sits two orders from each.
  Greedy tokens must match (a divergence is tolerated only where the reference's top two logits
  are within that tolerance, i.e. a genuine tie).
* bfloat16: weights and activations round to 8 mantissa bits (~4e-3 relative per op), so logits
  drift by a few percent of the scale. We require argmax agreement >= 0.9 and |Δlogit| <= 0.15 ·
  scale (measured on SmolLM2: 1.3 at a scale of 37, agreement 98%), which still catches any layout
  bug; greedy generation is not compared.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from runtime.attention_ref import CausalAttention
from runtime.config import ModelConfig
from runtime.engine_dir import TOKENIZER_DIR, WEIGHTS
from runtime.model import LlamaModel

from .errors import SourceError, VerifyError
from .quiet import quiet_transformers

PROMPTS = (
    "The capital of France is Paris, the capital of Germany is Berlin, and the capital of Italy is Rome. "
    "Every one of these cities is known for",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"\n"
    "    a, b = 0, 1\n    for _ in range(n):\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "who had never once left home. One winter morning",
)
GREEDY_TOKENS = 8
MAX_PROMPT_TOKENS = 64


@dataclass(frozen=True)
class Tolerance:
    rel_logit: float              # max |Δlogit| <= rel_logit * max(1, max |reference logit|)
    min_argmax_agreement: float   # over all prompt positions
    greedy_must_match: bool


TOLERANCES = {"float32": Tolerance(1e-3, 0.0, True), "bfloat16": Tolerance(0.15, 0.9, False)}


def verify(source_dir: Path, engine_dir: Path, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    """Compare the engine being built in `engine_dir` with transformers on `source_dir`.

    Returns the report section; raises VerifyError (with the numbers) beyond tolerance.
    """
    from transformers import AutoTokenizer

    tol = TOLERANCES[dtype]
    t0 = time.perf_counter()
    ref = _load_reference(source_dir)
    ours = _load_engine(engine_dir, cfg, getattr(torch, dtype))
    load_s = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(engine_dir / TOKENIZER_DIR)
    limit = min(MAX_PROMPT_TOKENS, cfg.max_position_embeddings - GREEDY_TOKENS)
    prompts = [_compare(ref, ours, _ids(tok, p, limit), tol) for p in PROMPTS]
    report = {
        "reference": f"transformers {type(ref).__name__} float32",
        "engine_dtype": dtype,
        "tolerance": asdict(tol),
        "load_s": round(load_s, 3),
        "max_abs_logit_diff": max(p["max_abs_logit_diff"] for p in prompts),
        "argmax_agreement": sum(p["argmax_agreement"] * p["num_tokens"] for p in prompts)
        / sum(p["num_tokens"] for p in prompts),
        "greedy_match": all(p["greedy"]["match"] in ("exact", "tie") for p in prompts)
        if tol.greedy_must_match else None,
        "prompts": prompts,
    }
    _enforce(report, tol)
    report["passed"] = True
    return report


def _load_reference(source_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        with quiet_transformers():
            return AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    except Exception as e:  # the source was readable for us; say why transformers is not happy
        raise SourceError(f"{source_dir}: transformers cannot load the source model for verification "
                          f"({e.__class__.__name__}: {str(e).splitlines()[0][:160]})",
                          fix="pass --no-verify to skip verification") from None


def _load_engine(engine_dir: Path, cfg: ModelConfig, dtype: torch.dtype) -> LlamaModel:
    model = LlamaModel(cfg, dtype=dtype)
    model.load_weights(load_file(str(engine_dir / WEIGHTS)))
    return model.eval()


def _ids(tok: Any, text: str, limit: int) -> torch.Tensor:
    ids = tok(text)["input_ids"][:limit]
    if not ids:
        raise VerifyError(f"the tokenizer turns the verification prompt {text[:30]!r}... into no tokens",
                          fix="check the tokenizer, or pass --no-verify")
    return torch.tensor(ids, dtype=torch.long)  # [T]


@torch.inference_mode()
def _ref_logits(ref: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return ref(input_ids=ids[None]).logits[0].float()                     # [T, V]


@torch.inference_mode()
def _our_logits(model: LlamaModel, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
    hidden = model(ids, torch.arange(ids.shape[0]), CausalAttention())    # [T, hidden]
    return model.logits(hidden[-1:] if last_only else hidden)             # [T or 1, V]


def _compare(ref: torch.nn.Module, ours: LlamaModel, ids: torch.Tensor, tol: Tolerance) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = _ref_logits(ref, ids)
    t1 = time.perf_counter()
    o = _our_logits(ours, ids)
    t2 = time.perf_counter()
    scale = max(1.0, r.abs().max().item())
    return {
        "num_tokens": int(ids.shape[0]),
        "max_abs_logit": round(scale, 4),
        "max_abs_logit_diff": (o - r).abs().max().item(),
        "logit_tolerance": tol.rel_logit * scale,
        "argmax_agreement": (o.argmax(-1) == r.argmax(-1)).float().mean().item(),
        "reference_forward_s": round(t1 - t0, 4),
        "engine_forward_s": round(t2 - t1, 4),
        # bf16 greedy paths may legitimately part at near-ties, and bf16 matmuls are slow on CPU:
        # the 2 x 8 extra forwards per prompt are spent only where a match is required.
        "greedy": _greedy(ref, ours, ids, tol.rel_logit * scale) if tol.greedy_must_match else {"match": "skipped"},
    }


def _greedy(ref: torch.nn.Module, ours: LlamaModel, ids: torch.Tensor, tie: float) -> dict[str, Any]:
    """Extend `ids` greedily with each model; `match` is "exact", "tie" or "differs"."""
    ref_ids, our_ids, match = ids, ids, "exact"
    for step in range(GREEDY_TOKENS):
        r = _ref_logits(ref, ref_ids)[-1]
        r_tok, o_tok = r.argmax(), _our_logits(ours, our_ids, last_only=True)[-1].argmax()
        ref_ids, our_ids = torch.cat([ref_ids, r_tok[None]]), torch.cat([our_ids, o_tok[None]])
        if match == "exact" and r_tok != o_tok:
            # After a divergence the two continuations see different contexts: no longer comparable.
            match = "tie" if (r[r_tok] - r[o_tok]).item() <= tie else "differs"
    n = ids.shape[0]
    return {"reference": ref_ids[n:].tolist(), "engine": our_ids[n:].tolist(), "match": match}


def _enforce(report: dict[str, Any], tol: Tolerance) -> None:
    for i, p in enumerate(report["prompts"]):
        if p["max_abs_logit_diff"] > p["logit_tolerance"]:
            raise VerifyError(f"verification failed: prompt {i}: max |Δlogit| {p['max_abs_logit_diff']:.3g} "
                              f"exceeds {p['logit_tolerance']:.3g} ({report['engine_dtype']})",
                              fix="the engine does not reproduce the source model; nothing was written")
        if tol.greedy_must_match and p["greedy"]["match"] == "differs":
            raise VerifyError(f"verification failed: prompt {i}: greedy tokens differ "
                              f"(reference {p['greedy']['reference']}, engine {p['greedy']['engine']})",
                              fix="the engine does not reproduce the source model; nothing was written")
    if report["argmax_agreement"] < tol.min_argmax_agreement:
        raise VerifyError(f"verification failed: argmax agreement {report['argmax_agreement']:.3f} "
                          f"< {tol.min_argmax_agreement}", fix="nothing was written")
