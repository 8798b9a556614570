"""GGUF -> a cached Hugging Face-style dir (fp32 safetensors + config.json + tokenizer).

Dequantizing a GGUF with transformers takes ~20 s and ~2 GB for the default model; the fp32 result
gives bit-identical logits and loads in ~3 s. So it is done once per GGUF (keyed by its sha256)
under `~/.cache/lookahead-kv/` (`LOOKAHEAD_KV_CACHE` overrides), and every later build, and the
verification reference, read the cached dir like any Hugging Face checkpoint.

transformers is used as the reader (config, tensor names, llama.cpp's q/k permutation undone, the
tokenizer), through the same `load_gguf_checkpoint` its `from_pretrained(gguf_file=...)` uses; calling
it directly avoids that path's requirement on `accelerate`.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from .checkpoint import CONFIG
from .errors import SourceError
from .hf_config import model_config_from_hf
from .quiet import quiet_transformers

CACHE_ENV = "LOOKAHEAD_KV_CACHE"
MARKER = "lookahead_kv_cache.json"   # written last: its presence means the dir is complete
CACHE_FILES = (CONFIG, "model.safetensors", "tokenizer.json", MARKER)


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lookahead-kv").expanduser()


def cached_hf_dir(gguf: Path, sha256: str, log: Callable[[str], None], root: Path | None = None) -> Path:
    """The Hugging Face-style dir for `gguf`, converting (atomically) on first use."""
    root = root or cache_root()
    target = root / sha256[:16]
    if _complete(target):
        return target
    log(f"converting {gguf.name} to fp32 safetensors in {target} (once per GGUF, ~30 s)")
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=root))
    except OSError as e:
        raise SourceError(f"cannot write the model cache {root} ({e.strerror})",
                          fix=f"set {CACHE_ENV} to a writable dir") from None
    try:
        _convert(gguf, tmp)
        (tmp / MARKER).write_text(json.dumps({"gguf": str(gguf), "sha256": sha256}, indent=1))
        if not _complete(target):
            shutil.rmtree(target, ignore_errors=True)   # an incomplete leftover, never a complete one
        try:
            os.replace(tmp, target)
        except OSError:
            if not _complete(target):                  # else a concurrent build won the race: fine
                raise
    except OSError as e:
        raise SourceError(f"cannot write the model cache {root} ({e.strerror or e})",
                          fix=f"free some space, or set {CACHE_ENV} to another dir") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(target: Path) -> bool:
    return all((target / f).is_file() for f in CACHE_FILES)


def _convert(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError:
        raise SourceError("this transformers version has no GGUF reader (load_gguf_checkpoint)",
                          fix="use a transformers release that has it (tested: 5.24), or pass a Hugging Face dir") from None

    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # transformers raises many types for an unreadable or unknown GGUF
        raise SourceError(f"{gguf}: transformers cannot read this GGUF ({_one_line(e)})",
                          fix="pass a GGUF of a llama, qwen2 or mistral model") from None
    model_config_from_hf(config.to_dict(), where=str(gguf))   # refuse before the slow part
    with torch.device("meta"):   # only the parameter names are needed, for the GGUF -> HF name map
        skeleton = AutoModelForCausalLM.from_config(config)
    try:
        # The one long loop of a build: transformers' own progress bar stays on for it.
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:
        raise SourceError(f"{gguf}: reading the GGUF failed ({_one_line(e)})",
                          fix="the file may be truncated or corrupt") from None
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save_pretrained(out)


def _one_line(e: Exception) -> str:
    return f"{e.__class__.__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
