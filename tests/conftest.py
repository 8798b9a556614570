"""Shared fixtures: tiny random configs, and the real default engine (built once per machine)."""
from __future__ import annotations

import os
from pathlib import Path

from runtime.threads import prepare_threads

prepare_threads()   # as every entry point does, before torch loads (a plain `pytest` run gets it too)

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ENGINE = Path(os.environ.get("LOOKAHEAD_TEST_ENGINE", ROOT / "engines" / "default"))


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """Tests set torch's thread count (the CPU kernels split their work by it); the suite's comes back after."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def one_thread():
    """torch on one thread for the test (`pytestmark = pytest.mark.usefixtures("one_thread")`): the CPU kernels'
    results do not depend on how their work is split; restore_torch_threads puts the count back."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_config():
    from runtime.config import ModelConfig
    return ModelConfig(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
                       max_position_embeddings=4096, rope_theta=10000.0, eos_token_ids=(1,))


@pytest.fixture(scope="session")
def default_engine_dir() -> Path:
    """The real default engine (SmolLM2-135M-Instruct), built when missing."""
    if not (DEFAULT_ENGINE / "engine.yaml").is_file():
        from builder import BuildConfig, build
        build(BuildConfig(model="default", output=str(DEFAULT_ENGINE)))
    return DEFAULT_ENGINE


@pytest.fixture(scope="session")
def default_engine(default_engine_dir):
    from runtime.engine import Engine
    return Engine.from_dir(default_engine_dir, max_batch_size=4, max_model_len=2048)
