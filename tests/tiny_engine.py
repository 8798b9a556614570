"""Build tiny engine dirs from random weights (no checkpoint, no transformers) for fast tests."""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from runtime.config import LookaheadConfig, ModelConfig
from runtime.engine_dir import TOKENIZER_DIR, WEIGHTS, write_manifest
from runtime.model import LlamaModel

TINY = dict(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0)

# qwen3's per-head q/k RMSNorm with YaRN RoPE (factor 4 over a 1024-token original context): the
# architecture and scaling every path must apply (head_dim 32 with hidden 64 and 6 heads: q is
# wider than the residual stream)
QWEN3_YARN = dict(architecture="qwen3", head_dim=32,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer with exactly 256 tokens (one per byte), no merges."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def make_tiny_engine(path: Path, seed: int = 0, lookahead: LookaheadConfig | None = None,
                     **model_overrides) -> Path:
    cfg = ModelConfig(**{**TINY, **model_overrides})
    path.mkdir(parents=True, exist_ok=True)
    lookahead = lookahead or LookaheadConfig()
    model = LlamaModel.random(cfg, seed=seed, max_positions=lookahead.max_model_len)   # only its weights are saved
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / WEIGHTS))
    (path / TOKENIZER_DIR).mkdir(exist_ok=True)
    byte_tokenizer().save(str(path / TOKENIZER_DIR / "tokenizer.json"))
    write_manifest(path, name="tiny", model=cfg, dtype="float32", lookahead=lookahead,
                   source={"kind": "random", "seed": seed}, versions={})
    return path


# the small lookahead geometry the invariant tests use: 4-token blocks, an 8-token window, one sink
SMALL_LOOKAHEAD = dict(mode="lookahead", block_size=4, recent_window=8, num_sink_blocks=1)


def random_prompts(*lens: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """Token-id prompts of the given lengths, fresh random ids (seeded)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
