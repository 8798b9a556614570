"""Tokenizer wrapper (the `tokenizers` library on tokenizer.json) with incremental detokenization."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    def __init__(self, tokenizer_dir: str | Path):
        d = Path(tokenizer_dir)
        self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template = self.config.get("chat_template")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, user_text: str) -> str:
        """Render one user turn with the engine's chat template (jinja2), ready for generation."""
        if not self.chat_template:
            return user_text
        import jinja2  # transformers' dependency; only needed for chat prompts
        tmpl = jinja2.Environment().from_string(self.chat_template)
        return tmpl.render(messages=[{"role": "user", "content": user_text}], add_generation_prompt=True,
                           bos_token=self.config.get("bos_token", ""), eos_token=self.config.get("eos_token", ""))


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
