"""Reading a Hugging Face model dir: config.json, generation_config.json and *.safetensors.

Every failure becomes a `SourceError` naming the file, so a truncated download or a hand-edited
header is reported as such instead of as a library traceback.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .errors import SourceError

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_json(path: Path, required: bool = True) -> dict[str, Any] | None:
    """Parse a JSON object file; None when absent and not `required`."""
    if not path.is_file():
        if required:
            raise SourceError(f"{path} is missing", fix="a Hugging Face model dir needs config.json")
        return None
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SourceError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise SourceError(f"{path} does not hold a JSON object")
    return doc


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a model dir: the shards its index names, else every *.safetensors."""
    index = read_json(model_dir / SAFETENSORS_INDEX, required=False)
    if index is not None:
        names = sorted(set((index.get("weight_map") or {}).values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise SourceError(f"{model_dir / missing[0]} is missing ({SAFETENSORS_INDEX} lists it)",
                              fix="the download is incomplete; fetch every shard")
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{model_dir} has no *.safetensors weights",
                          fix="export the checkpoint with save_pretrained(safe_serialization=True)")
    return files


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the model dir, by their Hugging Face names.

    Raises
    ------
    SourceError
        A file is truncated or its header is corrupt, or two shards hold the same tensor.
    """
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        for name, t in _read_file(f).items():
            if name in tensors:
                raise SourceError(f"{f}: tensor {name} also appears in another shard")
            tensors[name] = t
    return tensors


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own SafetensorError (an Exception) for bad files
        reason = str(e).split("\n")[0][:200]
        raise SourceError(f"{path} is not a readable safetensors file ({reason})",
                          fix="the file is truncated or corrupt: download or export it again") from None
