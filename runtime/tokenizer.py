"""Tokenizer wrapper (the `tokenizers` library on tokenizer.json) with incremental detokenization.

The chat template comes from the engine dir, which anyone who can write the dir controls (the
manifest's checksums are not signed), so it is rendered in jinja2's immutable sandbox, as
transformers renders the templates it downloads: a template that reaches for Python internals
(`cycler.__init__.__globals__.os`, `''.__class__.__mro__`) fails with an EngineDirError instead
of running code.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from .errors import EngineDirError


def _one_line(e: BaseException, limit: int = 200) -> str:
    text = " ".join(f"{e.__class__.__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit] + "..."


class TextTokenizer:
    def __init__(self, tokenizer_dir: str | Path):
        d = Path(tokenizer_dir)
        path = d / "tokenizer.json"
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:   # the tokenizers library raises plain Exceptions for any bad file
            raise EngineDirError(f"{path} cannot be loaded by the tokenizers library ({_one_line(e)}): "
                                 "rebuild the engine") from None
        self._config_path = cfg_path = d / "tokenizer_config.json"
        self.config = _read_config(cfg_path) if cfg_path.is_file() else {}
        self.chat_template = _pick_template(self.config.get("chat_template"), cfg_path)
        self._template = None       # compiled on first use: jinja2 is only needed for chat prompts

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's exact piece of the text, so that `"".join(pieces)` is the decode of `ids`
        with special tokens kept and a piece's offset in that join is where its text starts (what
        completions `echo` lists as `tokens` and `text_offset`). A special token is its own text;
        the bytes of a UTF-8 character split over tokens go to the token that completes it, the
        others get "" (the last token takes whatever is left). Each piece is the decode of a short
        window (from the last token that completed a piece, for decoders that read the token before,
        e.g. SentencePiece's leading space) less the decode of the window's tokens before it: exact
        for decoders whose decode of more tokens extends that of fewer (byte-level BPE, SentencePiece)."""
        pieces: list[str] = []
        ctx = done = 0          # the window starts at ctx; tokens before `done` have their pieces
        before = ""             # the decode of ids[ctx:done]
        for i in range(len(ids)):
            text = self.decode(ids[ctx:i + 1], skip_special_tokens=False)
            if text.endswith("\ufffd") and i + 1 < len(ids):
                pieces.append("")               # an incomplete character: a later token completes it
                continue
            pieces.append(text[len(before):])
            ctx, done = done, i + 1
            before = self.decode(ids[ctx:done], skip_special_tokens=False)
        return pieces

    def apply_chat_template(self, user_text: "str | list[dict[str, str]]") -> str:
        """Render one user turn, or a conversation (a list of {"role", "content"} messages, e.g.
        earlier user and assistant turns then the new user turn), with the engine's chat
        template, ready for generation.

        Sandboxed (see the module docstring); any template error, a sandbox refusal included, is
        an EngineDirError naming `tokenizer_config.json: chat_template`."""
        if not self.chat_template:
            return user_text if isinstance(user_text, str) else "".join(m["content"] for m in user_text)
        import jinja2  # transformers' dependency
        try:
            if self._template is None:
                self._template = _sandbox().from_string(self.chat_template)
            messages = [{"role": "user", "content": user_text}] if isinstance(user_text, str) else user_text
            return self._template.render(messages=messages,
                                         add_generation_prompt=True,
                                         bos_token=self.config.get("bos_token", ""),
                                         eos_token=self.config.get("eos_token", ""))
        except jinja2.TemplateError as e:     # SecurityError, TemplateSyntaxError, UndefinedError, ...
            raise EngineDirError(f"{self._config_path}: chat_template cannot be rendered ({_one_line(e)}): "
                                 "rebuild the engine from a trusted model, or send raw prompts (--raw)") from None


def _read_config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise EngineDirError(f"{path} is not valid JSON ({_one_line(e)}): rebuild the engine") from None
    if not isinstance(cfg, dict):
        raise EngineDirError(f"{path} does not hold a JSON object: rebuild the engine")
    return cfg


def _pick_template(value: Any, cfg_path: Path) -> str | None:
    """The template text: a string, or (the Hugging Face list form) the entry named "default"."""
    if isinstance(value, list):
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    if value is not None and not isinstance(value, str):
        raise EngineDirError(f"{cfg_path}: chat_template must be a string, got a {type(value).__name__}: "
                             "rebuild the engine")
    return value


def _sandbox():
    """An immutable sandboxed environment set up as transformers' apply_chat_template sets its
    own (trim_blocks, lstrip_blocks, loop controls, raise_exception, a tojson that does not
    HTML-escape), so a template renders here as it does there."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class IncrementalDetokenizer:
    """Yields the text delta of each new token; holds back an incomplete UTF-8 tail ("\ufffd")."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self.tok.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        delta, self.text = full[len(self.text):], full
        return delta
