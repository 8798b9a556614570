"""Tiny random Hugging Face checkpoints (config.json + model.safetensors + tokenizer) for builder tests.

Weights are redrawn at unit scale (transformers initialises with std 0.02 and unit norms, which gives
near-zero logits and argmax ties); norms get random gains so that a swapped norm would show.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from builder.verify import PROMPTS

CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
SPECIALS = ["[UNK]", "<s>", "</s>"]
CORPUS = [*PROMPTS, "the quick brown fox jumps over the lazy dog", "hello world, this is a tiny tokenizer."]
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def write_tokenizer(path: Path, chat_template: bool = True) -> None:
    """A word-level tokenizer (< 128 tokens) trained on the verification prompts."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(vocab_size=120, special_tokens=SPECIALS))
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "bos_token": "<s>",
           "eos_token": "</s>"}
    if chat_template:
        cfg["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def write_checkpoint(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random `arch` model (llama | qwen2 | mistral) with its tokenizer into `path`."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "mistral": transformers.MistralConfig}[arch]
    config = config_cls(**{**TINY, **({"sliding_window": None} if arch == "mistral" else {}), **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _unit_scale(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


def _unit_scale(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def edit_config(path: Path, **changes) -> None:
    """Change config.json keys in place (None deletes the key)."""
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
