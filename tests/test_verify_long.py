"""The long-position check (builder/verify_long.py) on a tiny random qwen2 model with a 16K context:
a prompt of essays several chunks long, both sides chunked; a fault that only long positions show;
when it is skipped; its option's bounds."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from builder import BuildConfig, build
from builder import verify_long
from builder.cli import main
from builder.errors import VerifyError
from builder.verify import _engine_logits, _load_engine
from builder.verify_long import LONG_CONTEXT, LongPlan
from runtime import rope
from runtime.engine_dir import load_manifest

from builder_fixtures import write_checkpoint, write_text_tokenizer

LONG = 2 * verify_long.CHUNK + 30        # three chunks; the last 64 rows straddle the last two


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def essays() -> list[str]:
    from bench.longctx_data import essays_available, load_essays

    if not essays_available():
        pytest.skip("no essays installed (make data)")
    return load_essays()


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory, essays) -> Path:
    """A tiny qwen2 (q/k/v biases, GQA 4/2) whose context is the long check's threshold."""
    path = write_checkpoint(tmp_path_factory.mktemp("long") / "qwen2", "qwen2", seed=5,
                            max_position_embeddings=LONG_CONTEXT, rope_theta=1e6)
    write_text_tokenizer(path, essays[:3])
    return path


def quiet(**kw):
    return build(BuildConfig(**kw), log=lambda line: None)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_long_positions_are_verified_chunked(long_ckpt, tmp_path, quantize):
    result = quiet(model=str(long_ckpt), output=tmp_path / "e", quantize=quantize, group_size=32, long_verify_tokens=LONG)
    long = result.report["verification"]["long"]
    assert long["checked"] and (long["num_tokens"], long["rows"], long["chunk"]) == (LONG, 64, verify_long.CHUNK)
    assert long["text"].endswith("Paul Graham essays") and long["argmax_agreement"] >= (0.85 if quantize else 1.0)
    assert long["rel_logit_diff"] < (0.1 if quantize else 1e-4)
    assert abs(long["nll"]["engine"] - long["nll"]["reference"]) < (0.1 if quantize else 1e-4)
    if quantize:
        kept = load_manifest(tmp_path / "e").quantization["verification"]["long"]
        assert kept["checked"] and kept["num_tokens"] == LONG


def test_chunked_tails_equal_one_full_forward(long_ckpt, tmp_path, essays, monkeypatch):
    """Either side over its cache, chunk by chunk, gives the last rows of one uncached forward."""
    quiet(model=str(long_ckpt), output=tmp_path / "e", verify=False)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(long_ckpt)
    ids, _ = verify_long.long_text_ids(tok, 700)
    monkeypatch.setattr(verify_long, "CHUNK", 96)                         # 8 chunks, the tail over two
    ref = AutoModelForCausalLM.from_pretrained(long_ckpt, dtype=torch.float32).eval()
    with torch.inference_mode():
        full_ref = ref(input_ids=ids[None]).logits[0, -64:]
    torch.testing.assert_close(verify_long.reference_tail_logits(ref, ids, 64), full_ref, rtol=1e-4, atol=1e-4)
    ours = _load_engine(tmp_path / "e", load_manifest(tmp_path / "e").model, torch.float32).with_positions(len(ids))
    torch.testing.assert_close(verify_long.engine_tail_logits(ours, ids, 64), _engine_logits(ours, ids)[-64:],
                               rtol=1e-4, atol=1e-4)


def test_a_fault_only_long_positions_show_fails_the_build(long_ckpt, tmp_path, monkeypatch):
    """RoPE tables that stop at position 511: the short prompts (< 100 positions) pass, the long one fails."""
    real = rope.RotaryEmbedding.tables
    monkeypatch.setattr(rope.RotaryEmbedding, "tables", lambda self, p: real(self, p.clamp(max=511)))
    quiet(model=str(long_ckpt), output=tmp_path / "short", long_verify=False)
    with pytest.raises(VerifyError, match=rf"long positions \({LONG} tokens, last 64 rows\): max \|Δlogit\|"):
        quiet(model=str(long_ckpt), output=tmp_path / "long", long_verify_tokens=LONG)
    assert not (tmp_path / "long").exists()


def test_when_the_check_is_skipped(long_ckpt, tmp_path):
    assert LongPlan.for_model(8192, True, 30000) == LongPlan(0, f"the model's context (8192) is below {LONG_CONTEXT}")
    assert LongPlan.for_model(32768, False, 30000).why == "--no-long-verify"
    assert LongPlan.for_model(20000, True, 30000) == LongPlan(20000)          # at most the context
    result = quiet(model=str(long_ckpt), output=tmp_path / "e", long_verify=False)
    assert result.report["verification"]["long"] == {"checked": False, "why": "--no-long-verify"}


def test_missing_essays_name_the_fix(long_ckpt, tmp_path, monkeypatch):
    import bench.longctx_data

    def missing():
        raise ModuleNotFoundError("no essays")
    monkeypatch.setattr(bench.longctx_data, "load_essays", missing)
    with pytest.raises(VerifyError, match=r"needs the Paul Graham essays.*make data.*--no-long-verify"):
        quiet(model=str(long_ckpt), output=tmp_path / "e", long_verify_tokens=LONG)


def test_the_length_option_is_checked(tmp_path, capsys):
    assert main(["--model", "default", "--output", str(tmp_path / "e"), "--long-verify-tokens", "10"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --long-verify-tokens 10: must be an integer >= 256 "
                                               "(or pass --no-long-verify to skip the check)")
