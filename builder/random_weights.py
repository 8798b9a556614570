"""`--random-weights SHAPE`: an engine dir of random weights in a real model's shape, for timing.

No weights file is written: engine.yaml's `random_weights:` section is the recipe (shape, seed,
dtype, init), and `Engine.from_dir(dir, device=...)` generates the tensors directly on that device,
one at a time (runtime/model.py `random_weights`), so the Llama-3-8B shape (16 GB in bf16) never
passes through host memory. Nothing is verified (there is no source model), and engine.yaml says so.

The tokenizer is the default model's (or `--tokenizer DIR`; `--tokenizer bytes`, or the default when
the default model's package is not installed, e.g. on a machine without network: a built-in
byte-level tokenizer of 256 tokens, written with the `tokenizers` library alone). When its size
differs from the shape's vocab, engine.yaml's `tokenizer.token_ids` says `synthetic`: the ids mean nothing in particular
(the weights are random anyway), prompts may be given as token ids (any id < vocab_size), text
prompts tokenize to ids the tokenizer knows, and ids beyond it decode to no text.
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

from runtime.config import LookaheadConfig, ModelConfig
from runtime.engine_dir import REPORT, TOKENIZER_DIR, expected_shapes, write_manifest
from runtime.memory_plan import fmt_bytes

from .config import DEFAULT_MODEL, BuildConfig
from .default_model import MODULE as DEFAULT_MODEL_MODULE
from .errors import SourceError
from .gguf_cache import cached_hf_dir
from .output import staged_output
from .progress import Log, Stages
from .report import build_report_random, versions
from .result import BuildResult
from .shapes import shape_config
from .sources import checksum, resolve_source
from .tokenizer import save_tokenizer

# engine.yaml's default max_model_len (a run overrides it): the shape's context, capped where the
# dense KV of a batch at the full 128K would not fit any device.
MAX_MODEL_LEN_CAP = 32768
INIT = "normal_fan_in"
STAGES = ("shape", "tokenizer", "checksum")
BYTES_TOKENIZER = "bytes"


def num_parameters(cfg: ModelConfig) -> int:
    return sum(math.prod(s) for s in expected_shapes(cfg).values())


def build_random(config: BuildConfig, log: Log) -> BuildResult:
    """Write the engine dir `config.output` for `config.random_weights` (a recipe, no weights)."""
    stages = Stages(log, STAGES)
    with staged_output(config.output, config.force) as tmp:
        with stages("shape") as note:
            cfg = shape_config(config.random_weights)
            n = num_parameters(cfg)
            itemsize = 2 if config.dtype == "bfloat16" else 4
            note(f"{config.random_weights}: {n / 1e9:.2f}B parameters, {config.dtype} "
                 f"({fmt_bytes(n * itemsize)} generated at load on the engine's device; no weights file)")
        with stages("tokenizer") as note:
            src, where = _tokenizer_source(config, log)
            if src is None:
                tok = write_byte_tokenizer(tmp / TOKENIZER_DIR)
            else:
                tok = save_tokenizer(src, tmp / TOKENIZER_DIR, cfg.vocab_size, where)
            token_ids = "tokenizer" if tok["num_tokens"] == cfg.vocab_size else "synthetic"
            tokenizer = {"source": where, "num_tokens": tok["num_tokens"], "vocab_size": cfg.vocab_size,
                         "token_ids": token_ids}
            if token_ids == "synthetic":
                tokenizer["note"] = (f"the tokenizer has {tok['num_tokens']} tokens, the model {cfg.vocab_size}: "
                                     "token ids are synthetic; send token-id prompts (ids < vocab_size), "
                                     "ids the tokenizer lacks decode to no text")
            note(f"{where}: {tok['num_tokens']} tokens, vocab {cfg.vocab_size}, token ids {token_ids}")
        with stages("checksum"):
            recipe = {"shape": config.random_weights, "seed": config.seed, "dtype": config.dtype, "init": INIT,
                      "num_parameters": n,
                      "generated": "at load, on the engine's device, tensor by tensor (values depend on the "
                                   "device type's generator: CPU and CUDA differ)",
                      "verified": False,
                      "verification": "none: random weights have no source model to compare with"}
            report = build_report_random(config, recipe, tokenizer, stages.seconds)
            (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
            lookahead = LookaheadConfig(max_model_len=min(cfg.max_position_embeddings, MAX_MODEL_LEN_CAP), kv_dtype=config.kv_dtype)
            write_manifest(tmp, name=config.name, model=cfg, dtype=config.dtype, lookahead=lookahead,
                           source={"kind": "random", "shape": config.random_weights, "seed": config.seed},
                           versions=versions(), random_weights=recipe, tokenizer=tokenizer)
    log(f"built {config.output} in {stages.total:.1f}s (random weights: not verified)")
    return BuildResult(path=Path(config.output), report=report)


def write_byte_tokenizer(out_dir: Path) -> dict[str, Any]:
    """A byte-level tokenizer with exactly 256 tokens (one per byte, no merges) into `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n")
    return {"num_tokens": tok.get_vocab_size(), "class": "byte-level BPE (built in)", "chat_template": False}


def _tokenizer_source(config: BuildConfig, log: Log) -> tuple[Path | None, str]:
    """(dir to copy the tokenizer from, or None for the built-in byte tokenizer; its description)."""
    if config.tokenizer == BYTES_TOKENIZER:
        return None, "built-in byte-level tokenizer (256 tokens)"
    if config.tokenizer is None and importlib.util.find_spec(DEFAULT_MODEL_MODULE) is None:
        log(f"note: the default model ({DEFAULT_MODEL_MODULE}) is not installed: using the built-in byte-level "
            "tokenizer (pass --tokenizer DIR for another)")
        return None, "built-in byte-level tokenizer (256 tokens; the default model was not installed)"
    if config.tokenizer is not None:
        d = Path(config.tokenizer).expanduser()
        if not (d / "tokenizer.json").is_file():
            raise SourceError("has no tokenizer.json", field="tokenizer", value=config.tokenizer,
                              fix="pass a dir with tokenizer.json (+ tokenizer_config.json), e.g. an engine's "
                                  "tokenizer/")
        return d, str(d)
    source = resolve_source(DEFAULT_MODEL, log)
    sha = checksum(source)[source.path.name]
    return cached_hf_dir(source.path, sha, log), f"default model ({source.path.name})"
