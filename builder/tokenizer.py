"""Copy the source's tokenizer into the engine dir as tokenizer.json + tokenizer_config.json."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import SourceError
from .quiet import quiet_transformers

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def save_tokenizer(src_dir: Path, out_dir: Path, vocab_size: int, where: str) -> dict[str, Any]:
    """Load the tokenizer of `src_dir` with transformers and save it to `out_dir`.

    Returns a summary for the build report. The chat template is also written into
    tokenizer_config.json (transformers 5 keeps it in a separate .jinja file), so a reader with only
    the `tokenizers` library and json finds it too.
    """
    from transformers import AutoTokenizer

    try:
        with quiet_transformers():
            tok = AutoTokenizer.from_pretrained(src_dir)
    except Exception as e:  # transformers raises OSError/ValueError/... for a missing or broken tokenizer
        raise SourceError(f"{where}: no usable tokenizer ({e.__class__.__name__}: {str(e).splitlines()[0][:160]})",
                          fix="a model dir needs tokenizer.json (or tokenizer.model) and tokenizer_config.json") from None
    beyond = _ids_beyond_vocab(tok, vocab_size, where)
    tok.save_pretrained(out_dir)
    if not (out_dir / "tokenizer.json").is_file():
        raise SourceError(f"{where}: the tokenizer has no fast (tokenizer.json) form",
                          fix="install `tokenizers` / `sentencepiece` so transformers can convert it")
    template = _inline_chat_template(out_dir)
    summary = {"num_tokens": len(tok), "class": type(tok).__name__, "chat_template": template is not None,
               "bos_token": tok.bos_token, "eos_token": tok.eos_token}
    if beyond:
        summary["warning"] = (f"special tokens {beyond} have ids >= vocab_size={vocab_size} (added by the "
                              "tokenizer, absent from the embedding): requests must not contain them")
    return summary


def _ids_beyond_vocab(tok: Any, vocab_size: int, where: str) -> dict[str, int]:
    """Added special tokens past the embedding matrix (transformers adds e.g. <|endoftext|> to some GGUF
    vocabularies) are reported; a regular token past it means config and tokenizer do not match."""
    added = {str(t): i for i, t in tok.added_tokens_decoder.items()}
    regular = {t: i for t, i in tok.get_vocab().items() if i >= vocab_size and t not in added}
    if regular:
        token, i = min(regular.items(), key=lambda kv: kv[1])
        raise SourceError(f"{where}: the tokenizer has token {token!r} with id {i} >= vocab_size={vocab_size}",
                          fix="config.json and the tokenizer belong to different models")
    return {t: i for t, i in added.items() if i >= vocab_size}


def _inline_chat_template(out_dir: Path) -> str | None:
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    template = cfg.get("chat_template")
    jinja = out_dir / CHAT_TEMPLATE_FILE
    if template is None and jinja.is_file():
        template = jinja.read_text()
        cfg["chat_template"] = template
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return template
