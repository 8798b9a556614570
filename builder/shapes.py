"""The model shapes `--random-weights SHAPE` can build: `ModelConfig` fields from each model's config.json.

A module of its own so that `BuildConfig` can check a shape's name without importing the random-weights
builder (which imports `BuildConfig`).
"""
from __future__ import annotations

from typing import Any

from runtime.config import ModelConfig

QWEN3_8B = dict(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643, eos_token_ids=(151645, 151643))

SHAPES: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct: the default model's geometry
    "smollm2-135m": dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_ids=(2,)),
    # meta-llama/Llama-3.1-8B(-Instruct): Llama-3-8B's layers with the 128K llama3 RoPE scaling
    "llama3-8b": dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    # Qwen/Qwen3-8B: 36 layers, q/k RMSNorm per head (head_dim 128 = hidden / heads here), 40K context
    "qwen3-8b": dict(QWEN3_8B),
    # Qwen3-8B with the YaRN scaling its model card gives for 128K (what the papers run long contexts with)
    "qwen3-8b-yarn": dict(QWEN3_8B, max_position_embeddings=131072,
                          rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    # a tiny model with the default tokenizer's vocab: fast tests of the recipe path
    "tiny": dict(architecture="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
}


def shape_config(shape: str) -> ModelConfig:
    return ModelConfig(**SHAPES[shape])
