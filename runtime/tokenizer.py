"""Tokenizer wrapper (the `tokenizers` library on tokenizer.json) with incremental detokenization.

An engine's tokenizer (`TextTokenizer.from_engine`) reads its files through
`engine_dir.engine_file` (listed in engine.yaml, inside the dir), refuses a tokenizer with ids past
the model's vocabulary, and renders its chat template once at load (runtime/chat_template.py: in
jinja2's sandbox, in a helper process under a CPU, memory and output budget).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from tokenizers import Tokenizer

from .chat_template import ChatTemplate, RenderBudget, find_chat_template, one_line
from .errors import EngineDirError

# Special tokens a tokenizer may add past the model's vocabulary (a GGUF conversion adds e.g.
# <|endoftext|>; the builder warns, and a request holding one is refused): a few, never a vocabulary.
MAX_ADDED_PAST_VOCAB = 256


class TextTokenizer:
    """tokenizer.json (+ tokenizer_config.json and the chat template, when there are) of
    `tokenizer_dir`. vocab_size: the model's; ids past it are refused (`check_vocab`). locate(name):
    the path to read the file `name` from, or None when there is none (default: the file in
    tokenizer_dir, if any); `from_engine` reads an engine dir's through engine_dir.engine_file."""

    def __init__(self, tokenizer_dir: str | Path, *, vocab_size: int | None = None,
                 locate: Callable[[str], Path | None] | None = None, budget: RenderBudget | None = None):
        d = Path(tokenizer_dir)
        locate = locate or (lambda name: d / name if (d / name).is_file() else None)
        path = locate("tokenizer.json") or d / "tokenizer.json"
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:   # the tokenizers library raises plain Exceptions for any bad file
            raise EngineDirError(f"{path} cannot be loaded by the tokenizers library ({one_line(e)}): "
                                 "rebuild the engine") from None
        if vocab_size is not None:
            check_vocab(self._tok, vocab_size, path)
        cfg_path = locate("tokenizer_config.json")
        self.config = _read_config(cfg_path) if cfg_path is not None else {}
        self.template: ChatTemplate | None = find_chat_template(
            self.config, cfg_path or d / "tokenizer_config.json", locate, budget=budget,
            bos_token=self.config.get("bos_token", ""), eos_token=self.config.get("eos_token", ""))

    @classmethod
    def from_engine(cls, manifest: Any, budget: RenderBudget | None = None) -> "TextTokenizer":
        """The tokenizer of a loaded engine dir (`engine_dir.Manifest`), its chat template checked
        by one render (ChatTemplate.check)."""
        from .engine_dir import TOKENIZER_DIR, engine_file

        tok = cls(manifest.path / TOKENIZER_DIR, vocab_size=manifest.model.vocab_size, budget=budget,
                  locate=lambda name: engine_file(manifest, f"{TOKENIZER_DIR}/{name}"))
        if tok.template is not None:
            tok.template.check()
        return tok

    @property
    def chat_template(self) -> str | None:
        return self.template.text if self.template is not None else None

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

        Sandboxed and budgeted (runtime/chat_template.py); any failure, a sandbox refusal or an
        exhausted budget included, is an EngineDirError naming the template."""
        if self.template is None:
            return user_text if isinstance(user_text, str) else "".join(m["content"] for m in user_text)
        messages = [{"role": "user", "content": user_text}] if isinstance(user_text, str) else user_text
        return self.template.render(messages)


def check_vocab(tok: Tokenizer, vocab_size: int, path: Path) -> None:
    """Every id of `tok` indexes the model's embedding (< vocab_size), but for at most
    MAX_ADDED_PAST_VOCAB special tokens added on top of the vocabulary."""
    regular = tok.get_vocab(with_added_tokens=False).values()
    added = tok.get_added_tokens_decoder()
    past = [i for i in regular if i >= vocab_size]
    past_added = [i for i, t in added.items() if i >= vocab_size]
    if past or len(past_added) > MAX_ADDED_PAST_VOCAB or any(not added[i].special for i in past_added):
        top = max([*past, *past_added])
        raise EngineDirError(f"{path}: the tokenizer has {len(past) + len(past_added)} token ids past the model's "
                             f"vocabulary (ids up to {top}; engine.yaml's model.vocab_size is {vocab_size}): the "
                             "tokenizer and the weights belong to different models; rebuild the engine")


def _read_config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise EngineDirError(f"{path} is not valid JSON ({one_line(e)}): rebuild the engine") from None
    if not isinstance(cfg, dict):
        raise EngineDirError(f"{path} does not hold a JSON object: rebuild the engine")
    return cfg


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
