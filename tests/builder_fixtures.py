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


def write_text_tokenizer(path: Path, texts: list[str]) -> None:
    """Replace the tokenizer in `path` by a BPE one (< 128 tokens) trained on `texts`, so that real
    prose (the long-position check's essays) becomes varied tokens instead of [UNK]s."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIALS, limit_alphabet=70))
    tok.save(str(path / "tokenizer.json"))


def write_checkpoint(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random `arch` model (llama | qwen2 | mistral | qwen3) with its tokenizer into
    `path`; `overrides` are its config's (e.g. head_dim, rope_parameters)."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config}[arch]
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


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf stores q/k rows interleaved per head pair; this is its permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, hf_dir: Path) -> Path:
    """Write the tiny llama checkpoint in `hf_dir` as a float32 GGUF, the way llama.cpp converts one.

    The tokenizer is byte-level BPE with a few merges ("gpt2" in GGUF terms), padded to the vocab.
    """
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hf = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = _byte_level_tokens(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<") and len(t) > 1 else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for name, t in hf.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            module = rest.rsplit(".", 1)[0]
            if module == "self_attn.q_proj":
                t = _llama_cpp_permute(t, heads)
            elif module == "self_attn.k_proj":
                t = _llama_cpp_permute(t, kv_heads)
            gname = f"blk.{i}.{per_layer[module]}.weight"
        else:
            gname = names[name]
        w.add_tensor(gname, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


MERGES = ["Ġ t", "h e", "i n"]


def _byte_level_tokens(vocab_size: int) -> list[str]:
    from tokenizers import pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    chars = sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in map(str.split, MERGES)]
    pads = [f"<pad{i}>" for i in range(vocab_size - len(specials) - len(chars))]
    return specials + chars + pads
