"""Run the built engine and the source model (transformers) on fixed prompts and compare.

The reference is transformers' own model for the source dir in fp32; the engine is
`runtime.model.LlamaModel` loaded from the weights file just written, with full causal attention
over positions 0..T-1 (`runtime.attention_ref.CausalAttention`).

Per prompt, transformers greedily extends the prompt by `GREEDY_TOKENS` tokens (with its KV cache),
giving its logits at every position of prompt + continuation. The engine runs one full forward over
that same sequence. We compare logits at every position, and the engine's argmax at each position
against the token transformers chose next. The engine's own greedy generation (recomputing the full
forward each step) equals transformers' exactly when every one of those argmaxes agrees: each step
then sees the same context. So one forward checks what eight would, which matters on a busy 2-core
machine.

Tolerances (`TOLERANCES`), scaled by the prompt's largest |reference logit| (at least 1):

* float32: |Δlogit| <= 1e-3 · scale. A correct conversion differs from transformers only by fp32
  reassociation (fused q|k|v and gate|up matmuls, another attention kernel): ~1e-7 relative per op,
  measured 7e-5 at a scale of 40 on SmolLM2 (30 layers). A real layout bug (a swapped head, a
  missed permutation, q|k order) moves logits by O(scale). 1e-3 sits an order or more from each.
  Greedy tokens must match; a disagreement is tolerated only where transformers' top two logits are
  within that tolerance (a genuine tie that fp32 noise may flip).
* bfloat16: weights and activations round to 8 mantissa bits (~4e-3 relative per op), so logits
  drift by a few percent of the scale (SmolLM2: 1.3 at a scale of 37, argmax agreement 98%). We
  require argmax agreement >= 0.9 and |Δlogit| <= 0.15 · scale, which still catches a layout bug;
  greedy agreement is recorded, not required.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file

from runtime.attention_ref import CausalAttention
from runtime.config import ModelConfig
from runtime.engine_dir import TOKENIZER_DIR, WEIGHTS
from runtime.model import LlamaModel

from .errors import SourceError, VerifyError
from .quiet import quiet_transformers
from .verify_long import LongTolerance, cache_name, check_long

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
    min_argmax_agreement: float   # over all compared positions of all prompts
    greedy_must_match: bool


TOLERANCES = {"float32": Tolerance(1e-3, 0.0, True), "bfloat16": Tolerance(0.15, 0.9, False)}
# the prefill check (`verify_prefill`): a greedy disagreement counts as a near tie below this x the
# largest |logit| (bf16 inputs: ~4e-3 relative per product; measured on SmolLM2: see verify_prefill)
PREFILL_TIE = 0.01


def verify(source_dir: Path, engine_dir: Path, cfg: ModelConfig, dtype: str, long: Any = None,
           log: Callable[[str], None] = lambda line: None, prefill_precision: str = "auto") -> dict[str, Any]:
    """Compare the engine being built in `engine_dir` with transformers on `source_dir`; `long`: the
    long-position check's plan (`verify_long.LongPlan`; None: not asked); prefill_precision: what the
    engine's prompt rows run (`verify_prefill`; auto: what this machine resolves).

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
    runs = [_reference_run(ref, _ids(tok, p, limit)) for p in PROMPTS]
    prompts = [_compare(run, ours, tol) for run in runs]
    positions = sum(p["num_positions"] for p in prompts)
    report = {
        "reference": f"transformers {type(ref).__name__} float32",
        "engine_dtype": dtype,
        "tolerance": asdict(tol),
        "load_s": round(load_s, 3),
        "max_abs_logit_diff": max(p["max_abs_logit_diff"] for p in prompts),
        "argmax_agreement": sum(p["argmax_agreement"] * p["num_positions"] for p in prompts) / positions,
        "greedy_match": all(p["greedy"]["match"] in ("exact", "tie") for p in prompts),
        "prompts": prompts,
    }
    _enforce(report, tol)
    if dtype == "float32":
        report["prefill"] = verify_prefill(runs, ours, quantized=False, precision=prefill_precision)
    if long is not None:
        report["long"] = check_long(ref, ours, tok, long, _long_tolerance(tol), log)
    report["passed"] = True
    return report


def _long_tolerance(tol: Tolerance) -> LongTolerance:
    """The long check's bars for `tol`: fp32 wants every argmax (a near tie aside), as its greedy tokens."""
    if tol.greedy_must_match:
        return LongTolerance(tol.rel_logit, min_agreement=1.0, tie=tol.rel_logit)
    return LongTolerance(tol.rel_logit, min_agreement=tol.min_argmax_agreement, tie=0.0)


@dataclass(frozen=True)
class ReferenceRun:
    """transformers' greedy extension of one prompt: ids [T], seq [T + n], logits [T + n, V]."""
    ids: torch.Tensor
    seq: torch.Tensor
    logits: torch.Tensor
    seconds: float


def _reference_run(ref: torch.nn.Module, ids: torch.Tensor, n: int = GREEDY_TOKENS) -> ReferenceRun:
    t0 = time.perf_counter()
    seq, r = _reference_greedy(ref, ids, n)
    return ReferenceRun(ids, seq, r, time.perf_counter() - t0)


def verify_prefill(runs: list[ReferenceRun], ours: LlamaModel, quantized: bool, precision: str = "auto",
                   tie: float = PREFILL_TIE) -> dict[str, Any]:
    """The prefill precision this machine runs the engine's prompts in (`resolve_prefill`:
    bf16 or int8 dot products) against transformers on the same sequences: every position of
    prompt + continuation computed as a prompt row (stricter than an engine, which decodes the
    continuation in fp32). Greedy must match the reference at every step; a disagreement is
    tolerated only where the reference's top two logits are within `tie` x the largest |logit|
    (a near tie the rounding may flip). Raises VerifyError otherwise; "float32" (a machine
    without the units): nothing more to check, recorded as such."""
    model = prefill_model(ours, quantized, precision)
    if model is None:
        return {"precision": "float32", "checked": False, "why": "the engine prefills in float32: the checks "
                "above cover it"}
    precision = model.ops.prefill
    prompts = []
    for i, run in enumerate(runs):
        o = prefill_logits(model, run.seq)
        scale = max(1.0, run.logits.abs().max().item())
        g = _greedy_match(run.logits, o, run.seq, int(run.ids.shape[0]), tie * scale)
        prompts.append({"max_abs_logit_diff": (o - run.logits).abs().max().item(), "max_abs_logit": round(scale, 4),
                        "argmax_agreement": (o.argmax(-1) == run.logits.argmax(-1)).float().mean().item(),
                        "greedy": g})
        if g["match"] == "differs":
            raise VerifyError(f"verification failed: prompt {i}: greedy tokens differ under {precision} prefill "
                              f"(reference {g['reference']}, engine {g['engine']})",
                              fix=f"serve with prefill_precision: float32, and report the model: its {precision} "
                                  "prompts do not answer as fp32 does; nothing was written")
    return {"precision": precision, "checked": True, "tie": tie,
            "greedy_match": all(p["greedy"]["match"] in ("exact", "tie") for p in prompts),
            "max_abs_logit_diff": max(p["max_abs_logit_diff"] for p in prompts), "prompts": prompts}


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
    model = LlamaModel(cfg, dtype=dtype, max_positions=MAX_PROMPT_TOKENS + GREEDY_TOKENS)   # the positions it runs
    model.load_weights(load_file(str(engine_dir / WEIGHTS)))
    return model.eval()


def _ids(tok: Any, text: str, limit: int) -> torch.Tensor:
    ids = tok(text)["input_ids"][:limit]
    if not ids:
        raise VerifyError(f"the tokenizer turns the verification prompt {text[:30]!r}... into no tokens",
                          fix="check the tokenizer, or pass --no-verify")
    return torch.tensor(ids, dtype=torch.long)  # [T]


@torch.inference_mode()
def _reference_greedy(ref: torch.nn.Module, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers extends `ids` [T] by `n` greedy tokens -> (sequence [T + n], logits [T + n, V])."""
    name = cache_name(ref)
    out = ref(input_ids=ids[None], use_cache=True)
    logits, seq = [out.logits[0]], ids
    for _ in range(n):
        nxt = logits[-1][-1].argmax()
        seq = torch.cat([seq, nxt[None]])
        out = ref(input_ids=nxt.view(1, 1), use_cache=True, **{name: getattr(out, name)})
        logits.append(out.logits[0])
    return seq, torch.cat(logits).float()


@torch.inference_mode()
def _engine_logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    hidden = model(ids, torch.arange(ids.shape[0]), CausalAttention())    # [T, hidden]
    return model.logits(hidden)                                           # [T, V] fp32


def prefill_model(ours: LlamaModel, quantized: bool, precision: str = "auto", int8_group: int = 64) -> LlamaModel | None:
    """`ours` computing with the prefill kernels of `precision` ("auto": what an engine on this
    machine runs, `resolve_prefill`), or None where that is float32 (nothing new to check)."""
    from runtime.ops import resolve_prefill, select_ops

    cpu = torch.device("cpu")
    precision = resolve_prefill(precision, cpu, torch.float32, quantized, int8_group=int8_group)
    if precision == "float32":
        return None
    return ours.with_ops(select_ops(cpu, torch.float32, quantized=quantized, prefill=precision))


@torch.inference_mode()
def prefill_logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    """One forward over `ids` [T] whose every row computes as an engine's prompt rows do (the
    table's prefill GEMMs and attention) -> logits [T, V] fp32."""
    from runtime.attention_ref import PrefillKernelAttention

    hidden = model(ids, torch.arange(ids.shape[0]), PrefillKernelAttention(model.ops.prefill_attention), prompt=True)
    return model.logits(hidden)


def _compare(run: ReferenceRun, ours: LlamaModel, tol: Tolerance) -> dict[str, Any]:
    ids, seq, r = run.ids, run.seq, run.logits                            # [T], [T + n], [T + n, V]
    t1 = time.perf_counter()
    o = _engine_logits(ours, seq)                                         # [T + n, V]
    t2 = time.perf_counter()
    scale = max(1.0, r.abs().max().item())
    atol = tol.rel_logit * scale
    return {
        "num_tokens": int(ids.shape[0]),
        "num_positions": int(seq.shape[0]),
        "max_abs_logit": round(scale, 4),
        "max_abs_logit_diff": (o - r).abs().max().item(),
        "logit_tolerance": atol,
        "argmax_agreement": (o.argmax(-1) == r.argmax(-1)).float().mean().item(),
        "reference_s": round(run.seconds, 4),
        "engine_s": round(t2 - t1, 4),
        "greedy": _greedy_match(r, o, seq, int(ids.shape[0]), atol),
    }


def _greedy_match(r: torch.Tensor, o: torch.Tensor, seq: torch.Tensor, prompt_len: int,
                  tie: float) -> dict[str, Any]:
    """Does the engine pick transformers' next token at every generation step?

    `match` is "exact", "tie" (only disagreements where transformers' own margin is <= `tie`) or
    "differs". `engine` lists the engine's choice at each step, given transformers' context.
    """
    steps = range(prompt_len - 1, seq.shape[0] - 1)                   # logits at p choose token p + 1
    chosen, engine = seq[prompt_len:], o[list(steps)].argmax(-1)
    match = "exact"
    for p, want, got in zip(steps, chosen.tolist(), engine.tolist()):
        if want != got:
            match = "tie" if (r[p, want] - r[p, got]).item() <= tie and match != "differs" else "differs"
    return {"reference": chosen.tolist(), "engine": engine.tolist(), "match": match}


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
