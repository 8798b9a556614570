"""Hostile and corrupt engine dirs (issue 19): whoever can write an engine dir can also update its
manifest's checksums (they are not signed), so each case here is "resealed" first, and each must
fail in one typed line, never run code, read outside the dir, or allocate what a header claims."""
from __future__ import annotations

import json
import os
import struct
import time

import jinja2
import pytest
import torch
import yaml
from safetensors.torch import save_file

from runtime.config import LookaheadConfig, ModelConfig
from runtime.engine import Engine
from runtime.engine_dir import check_weights_header, expected_shapes, load_manifest, sha256_file
from runtime.errors import ConfigError, EngineDirError
from runtime.tokenizer import TextTokenizer
from tiny_engine import TINY, make_tiny_engine

# The default model's template (SmolLM2-135M-Instruct), as the builder inlines it
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture
def eng_dir(tmp_path):
    return make_tiny_engine(tmp_path / "e")


def manifest_doc(d):
    return yaml.safe_load((d / "engine.yaml").read_text())


def reseal(d, doc=None, add=()):
    """What an attacker with write access does: rewrite engine.yaml's checksums to match the
    files as they are now (plus the paths in `add`)."""
    doc = doc or manifest_doc(d)
    for rel in [*doc["files"], *add]:
        p = d / rel
        doc["files"][rel] = sha256_file(p) if p.is_file() else "0" * 64
    (d / "engine.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def one_line_error(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg and len(msg) < 600, msg
    return msg


# ---- chat templates run sandboxed ----------------------------------------------------------------

def hostile_templates(marker):
    templates = [
        "{{ cycler.__init__.__globals__.os.mkdir(MARK) }}",
        "{{ joiner.__init__.__globals__.os.popen('mkdir ' + MARK).read() }}",
        "{{ lipsum.__globals__['os'].mkdir(MARK) }}",
        "{{ self.__init__.__globals__.__builtins__.__import__('os').mkdir(MARK) }}",
        "{{ namespace.__init__.__globals__.os.mkdir(MARK) }}",
        "{{ (cycler|attr('__init__')).__globals__.os.mkdir(MARK) }}",
        "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
        "{{ c(['mkdir', MARK]).wait() }}{% endif %}{% endfor %}",
    ]
    return [t.replace("MARK", repr(str(marker))) for t in templates]


def write_template(d, template):
    (d / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))


def test_hostile_payloads_do_run_unsandboxed(tmp_path):
    """The payloads are real: under the old plain jinja2.Environment() each creates the marker."""
    marker = tmp_path / "pwned"
    for template in hostile_templates(marker)[:6]:
        jinja2.Environment().from_string(template).render()
        assert marker.exists(), template
        marker.rmdir()


@pytest.mark.parametrize("index", range(7))
def test_hostile_chat_template_runs_no_code(eng_dir, tmp_path, index):
    marker = tmp_path / "pwned"
    write_template(eng_dir, hostile_templates(marker)[index])
    reseal(eng_dir, add=["tokenizer/tokenizer_config.json"])
    with pytest.raises(EngineDirError) as e:
        Engine.from_dir(eng_dir, mode="dense")      # the load renders the template once
    msg = one_line_error(e)
    assert "tokenizer/tokenizer_config.json: chat_template" in msg and "SecurityError" in msg
    time.sleep(0.05)                        # a Popen would have been asynchronous
    assert not marker.exists()


def test_format_string_cannot_reach_globals(eng_dir):
    write_template(eng_dir, "{{ '{0.__init__.__globals__}'.format(cycler) }}")
    with pytest.raises(EngineDirError, match="SecurityError"):
        TextTokenizer(eng_dir / "tokenizer").apply_chat_template("hi")


@pytest.mark.parametrize("template,kind", [("{% if %}", "TemplateSyntaxError"),
                                           ("{{ raise_exception('no system role') }}", "no system role")])
def test_broken_template_is_a_one_line_error(eng_dir, template, kind):
    write_template(eng_dir, template)
    with pytest.raises(EngineDirError) as e:
        TextTokenizer(eng_dir / "tokenizer").apply_chat_template("hi")
    assert kind in one_line_error(e)


@pytest.mark.parametrize("text", ["Hello", "line1\nline2\n\n  {% raw %} {{ x }}", "", "ünïcödé 🚀\t tab"])
def test_default_template_renders_as_before(eng_dir, text):
    """Byte-identical to the old unsandboxed rendering (trim/lstrip_blocks as transformers sets them)."""
    write_template(eng_dir, SMOLLM2_TEMPLATE)
    before = jinja2.Environment().from_string(SMOLLM2_TEMPLATE).render(
        messages=[{"role": "user", "content": text}], add_generation_prompt=True, bos_token="", eos_token="")
    assert TextTokenizer(eng_dir / "tokenizer").apply_chat_template(text) == before
    assert before.endswith(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def test_corrupt_tokenizer_json_is_one_line(eng_dir):
    (eng_dir / "tokenizer" / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 7}}')
    reseal(eng_dir)
    with pytest.raises(EngineDirError) as e:
        Engine.from_dir(eng_dir)
    assert "tokenizer.json cannot be loaded" in one_line_error(e)


def test_corrupt_tokenizer_config_is_one_line(eng_dir):
    (eng_dir / "tokenizer" / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(EngineDirError) as e:
        TextTokenizer(eng_dir / "tokenizer")
    assert "tokenizer_config.json is not valid JSON" in one_line_error(e)


# ---- manifest paths stay inside the engine dir ------------------------------------------------------

def test_manifest_may_not_name_a_file_outside(eng_dir, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    doc = manifest_doc(eng_dir)
    doc["files"]["../secret.txt"] = sha256_file(secret)        # the right digest: old code read it fine
    (eng_dir / "engine.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(EngineDirError) as e:
        load_manifest(eng_dir)
    assert "'../secret.txt' points outside the engine dir" in one_line_error(e)


def test_manifest_may_not_name_an_absolute_path(eng_dir, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    doc = manifest_doc(eng_dir)
    doc["files"][str(secret)] = sha256_file(secret)
    (eng_dir / "engine.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(EngineDirError, match="points outside the engine dir"):
        load_manifest(eng_dir)


def test_paths_are_checked_before_any_file_is_read(eng_dir, monkeypatch):
    doc = manifest_doc(eng_dir)
    doc["files"] = {**doc["files"], "../../../../etc/passwd": "0" * 64}
    (eng_dir / "engine.yaml").write_text(yaml.safe_dump(doc))
    read = []
    monkeypatch.setattr("runtime.engine_dir.sha256_file", lambda p, *a: read.append(p) or "")
    with pytest.raises(EngineDirError, match="points outside"):
        load_manifest(eng_dir)
    assert read == []


def test_weights_symlinked_out_of_the_dir_are_refused(eng_dir, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(eng_dir / "weights.safetensors", outside)
    (eng_dir / "weights.safetensors").symlink_to(outside)       # same bytes: the checksum still matches
    with pytest.raises(EngineDirError) as e:
        Engine.from_dir(eng_dir)
    msg = one_line_error(e)
    assert "weights.safetensors is a symlink" in msg and "outside the engine dir" in msg


def test_tokenizer_dir_symlinked_out_is_refused(eng_dir, tmp_path):
    os.replace(eng_dir / "tokenizer", tmp_path / "tok")
    (eng_dir / "tokenizer").symlink_to(tmp_path / "tok")
    with pytest.raises(EngineDirError, match="tokenizer.json is a symlink .* outside the engine dir"):
        load_manifest(eng_dir)


def test_symlink_inside_the_dir_is_fine(eng_dir):
    os.replace(eng_dir / "weights.safetensors", eng_dir / "weights-v1.safetensors")
    (eng_dir / "weights.safetensors").symlink_to("weights-v1.safetensors")
    reseal(eng_dir, add=["weights-v1.safetensors"])
    assert load_manifest(eng_dir).model.num_layers == 2


def test_unlisted_tokenizer_config_is_refused(eng_dir):
    """TextTokenizer reads it (the chat template) whether or not the manifest lists it."""
    write_template(eng_dir, SMOLLM2_TEMPLATE)
    with pytest.raises(EngineDirError, match="tokenizer_config.json is not listed"):
        load_manifest(eng_dir)


def test_files_must_be_a_mapping(eng_dir):
    doc = manifest_doc(eng_dir)
    doc["files"] = list(doc["files"])
    (eng_dir / "engine.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(EngineDirError, match="files must map relative paths"):
        load_manifest(eng_dir)


# ---- the weights' header matches the model, read before any weight -----------------------------

def tiny_tensors(cfg=None, dtype=torch.float32):
    cfg = cfg or ModelConfig(**TINY)
    return {name: torch.zeros(shape, dtype=dtype) for name, shape in expected_shapes(cfg).items()}


def write_weights(d, tensors):
    save_file(tensors, str(d / "weights.safetensors"))
    reseal(d)


def raw_weights(d, header: dict, data: bytes):
    blob = json.dumps(header).encode()
    (d / "weights.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    reseal(d)


def header_error(d) -> str:
    with pytest.raises(EngineDirError) as e:
        Engine.from_dir(d)
    return one_line_error(e)


def test_missing_tensor(eng_dir):
    t = tiny_tensors()
    del t["layers.1.w2.weight"]
    write_weights(eng_dir, t)
    assert "tensor layers.1.w2.weight is missing" in header_error(eng_dir)


def test_wrong_shape(eng_dir):
    t = tiny_tensors()
    t["layers.0.wo.weight"] = torch.zeros(64, 95)
    write_weights(eng_dir, t)
    assert "tensor layers.0.wo.weight has shape [64, 95]" in header_error(eng_dir)


def test_wrong_dtype(eng_dir):
    write_weights(eng_dir, tiny_tensors(dtype=torch.float16))
    assert "is 'F16', engine.yaml says dtype float32" in header_error(eng_dir)


def test_extra_tensor(eng_dir):
    write_weights(eng_dir, {**tiny_tensors(), "layers.2.wo.weight": torch.zeros(64, 96)})
    assert "tensor 'layers.2.wo.weight' is not part of engine.yaml's model" in header_error(eng_dir)


def test_header_claiming_a_huge_shape_allocates_nothing(eng_dir):
    header = {name: {"dtype": "F32", "shape": list(shape), "data_offsets": [0, 0]}
              for name, shape in expected_shapes(ModelConfig(**TINY)).items()}
    header["embed_tokens.weight"] = {"dtype": "F32", "shape": [10 ** 12, 64], "data_offsets": [0, 4 * 64 * 10 ** 12]}
    raw_weights(eng_dir, header, b"\0" * 64)
    t0 = time.perf_counter()
    assert "tensor embed_tokens.weight has shape [1000000000000, 64]" in header_error(eng_dir)
    assert time.perf_counter() - t0 < 5


def test_header_length_past_the_end_of_the_file(eng_dir):
    (eng_dir / "weights.safetensors").write_bytes(struct.pack("<Q", 10 ** 15) + b"{}")
    reseal(eng_dir)
    assert "header claims 1000000000000000 bytes" in header_error(eng_dir)


def test_file_shorter_than_the_length_prefix(eng_dir):
    (eng_dir / "weights.safetensors").write_bytes(b"\x01\x02")
    reseal(eng_dir)
    assert "is truncated" in header_error(eng_dir)


def test_truncated_file(eng_dir):
    p = eng_dir / "weights.safetensors"
    p.write_bytes(p.read_bytes()[:-1000])
    reseal(eng_dir)
    assert "past the end of the file" in header_error(eng_dir)


def test_header_not_json(eng_dir):
    (eng_dir / "weights.safetensors").write_bytes(struct.pack("<Q", 4) + b"\xff{[x" + b"\0" * 16)
    reseal(eng_dir)
    assert "header is not valid JSON" in header_error(eng_dir)


def test_overlapping_offsets(eng_dir):
    cfg = ModelConfig(**TINY)
    header, end = {}, 0
    for name, shape in expected_shapes(cfg).items():
        n = 4 * torch.Size(shape).numel()
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [end, end + n]}
        end += n
    first, second = list(header)[:2]
    n0 = header[first]["data_offsets"][1]
    header[second]["data_offsets"] = [n0 - 4, header[second]["data_offsets"][1] - 4]
    raw_weights(eng_dir, header, b"\0" * end)
    assert "where" in header_error(eng_dir)


def test_a_good_header_passes(eng_dir):
    m = load_manifest(eng_dir)
    check_weights_header(eng_dir / "weights.safetensors", m.model, m.dtype)


# ---- engine.yaml values are type- and range-checked ---------------------------------------------

@pytest.mark.parametrize("section,field,value,expect", [
    ("lookahead", "max_batch_size", "8", "max_batch_size: must be an integer"),
    ("lookahead", "top_k", True, "top_k: must be an integer"),
    ("lookahead", "fetch_ratio", ".nan", "fetch_ratio: must be a finite number"),
    ("lookahead", "block_size", 1048576, "block_size: must be in [1, 4096]"),
    ("lookahead", "max_model_len", 10 ** 9, "max_model_len: must be in"),
    ("lookahead", "recent_window", 10 ** 9, "recent_window: must be in"),
    ("model", "num_layers", 100000000, "num_layers: must be in [1, 1024]"),
    ("model", "vocab_size", 10 ** 9, "vocab_size: must be in"),
    ("model", "hidden_size", 64.0, "hidden_size: must be an integer"),
    ("model", "rms_norm_eps", "1e-5", "rms_norm_eps: must be a finite number"),
    ("model", "tie_word_embeddings", "yes", "tie_word_embeddings: must be true or false"),
    ("model", "eos_token_ids", ["2"], "eos_token_ids: must be a list of token ids"),
])
def test_engine_yaml_values_are_checked(eng_dir, section, field, value, expect):
    doc = manifest_doc(eng_dir)
    doc[section][field] = float("nan") if value == ".nan" else value
    (eng_dir / "engine.yaml").write_text(yaml.safe_dump(doc))
    t0 = time.perf_counter()
    with pytest.raises(EngineDirError) as e:
        Engine.from_dir(eng_dir)
    assert expect in one_line_error(e)
    assert time.perf_counter() - t0 < 5


def test_missing_model_field_is_named(eng_dir):
    doc = manifest_doc(eng_dir)
    del doc["model"]["head_dim"]
    (eng_dir / "engine.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(EngineDirError, match="model.head_dim: is missing"):
        load_manifest(eng_dir)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_batch_size="8"), "max_batch_size"), (dict(prefill_chunk=0), "prefill_chunk"),
    (dict(prefetch_lead=1.5), "prefetch_lead"), (dict(num_sink_blocks=-1), "num_sink_blocks"),
    (dict(resync_after=False), "resync_after"), (dict(fetch_ratio=float("inf")), "fetch_ratio"),
    (dict(device_budget_bytes="1GB"), "device_budget_bytes"), (dict(top_k=10 ** 7), "top_k"),
])
def test_overrides_are_checked_too(kwargs, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        LookaheadConfig().replace(**kwargs)


def test_quoted_int_says_how_to_fix_it():
    with pytest.raises(ConfigError, match="without quotes"):
        LookaheadConfig(max_batch_size="8")


# ---- issue 41: every file any process reads is listed and inside the dir --------------------------

def test_unlisted_chat_template_linked_out_is_never_read(eng_dir, tmp_path):
    """The pen test's dir: tokenizer/chat_template.jinja links to a secret outside, is left out of
    engine.yaml's files, and the config holds no template; the Dynamo worker used to hand the
    linked text to its frontend as the chat template."""
    from serving.dynamo_worker import make_model_dir

    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0 SECRET")
    (eng_dir / "tokenizer" / "chat_template.jinja").symlink_to(secret)
    for listed in (False, True):
        if listed:
            reseal(eng_dir, add=["tokenizer/chat_template.jinja"])      # with the right digest
        for read in (load_manifest, lambda d: make_model_dir(d, tmp_path / "model")):
            with pytest.raises(EngineDirError) as e:
                read(eng_dir)
            msg = one_line_error(e)
            assert "tokenizer/chat_template.jinja is a symlink" in msg and "outside the engine dir" in msg
    assert not (tmp_path / "model").exists()


def test_engine_file_refuses_what_the_manifest_does_not_list(eng_dir):
    from runtime.engine_dir import engine_file

    m = load_manifest(eng_dir)
    assert engine_file(m, "tokenizer/tokenizer.json") == eng_dir / "tokenizer" / "tokenizer.json"
    assert engine_file(m, "tokenizer/chat_template.jinja") is None                  # absent: nothing to read
    (eng_dir / "tokenizer" / "chat_template.jinja").write_text("{{ 'added later' }}")
    with pytest.raises(EngineDirError, match="chat_template.jinja is not listed"):
        engine_file(m, "tokenizer/chat_template.jinja")
    with pytest.raises(EngineDirError, match="chat_template.jinja is not listed"):
        load_manifest(eng_dir)
    with pytest.raises(EngineDirError, match="points outside the engine dir"):
        engine_file(m, "../e/engine.yaml")


def test_the_runtime_renders_the_template_the_frontend_gets(eng_dir, tmp_path):
    """A listed chat_template.jinja (transformers 5's place for it) is the template of both."""
    from serving.dynamo_worker import make_model_dir

    (eng_dir / "tokenizer" / "chat_template.jinja").write_text("<{{ messages[0]['content'] }}>")
    reseal(eng_dir, add=["tokenizer/chat_template.jinja"])
    tok = TextTokenizer.from_engine(load_manifest(eng_dir))
    assert tok.apply_chat_template("hi") == "<hi>"
    out = json.loads((make_model_dir(eng_dir, tmp_path / "m", tokenizer=tok) / "tokenizer_config.json").read_text())
    assert out["chat_template"] == tok.chat_template


# ---- engine.yaml is bounded before it is expanded ---------------------------------------------------

def billion_laughs(levels: int) -> str:
    """`name:` as nested aliases, 10 ** levels "lol"s from a few hundred bytes (the pen test used
    more levels; str() of this one alone is ~7 MB)."""
    lines = ['a0: &a0 "lol"'] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\nname: *a{levels}\n"


def write_yaml_text(d, text):
    (d / "engine.yaml").write_text(text)


def test_yaml_aliases_are_refused(eng_dir):
    doc = manifest_doc(eng_dir)
    del doc["name"]
    bomb = billion_laughs(6)
    assert len(bomb) < 1024
    write_yaml_text(eng_dir, bomb.replace("\nname:", "\n" + yaml.safe_dump(doc, sort_keys=False) + "name:"))
    with pytest.raises(EngineDirError) as e:
        load_manifest(eng_dir)
    assert "line 1: YAML anchors and aliases (&name, *name) are not allowed" in one_line_error(e)


def test_an_oversized_engine_yaml_is_refused_unread(eng_dir):
    text = (eng_dir / "engine.yaml").read_text()
    write_yaml_text(eng_dir, text + "# " + "x" * (1 << 20) + "\n")
    with pytest.raises(EngineDirError, match="engine.yaml is over 1 MiB"):
        load_manifest(eng_dir)


@pytest.mark.parametrize("field,value,expect", [
    ("name", "x" * 300, "name: must be a string of 1 to 256 printable characters"),
    ("name", ["a", "b"], "name: must be a string of 1 to 256"),
    ("name", "two\nlines", "name: must be a string"),
    ("source", {"path": "p" * 5000}, "source.path: is a string of 5000 characters, over 4096"),
    ("versions", {"v" * 5000: "1"}, "versions: is a string of 5000 characters"),
])
def test_strings_are_typed_and_bounded(eng_dir, field, value, expect):
    doc = manifest_doc(eng_dir)
    doc[field] = value
    write_yaml_text(eng_dir, yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(EngineDirError) as e:
        load_manifest(eng_dir)
    assert expect in one_line_error(e)


def test_a_digest_must_be_a_sha256(eng_dir):
    doc = manifest_doc(eng_dir)
    doc["files"]["weights.safetensors"] = "x" * 64
    write_yaml_text(eng_dir, yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(EngineDirError, match="files must map relative paths to sha256 digests"):
        load_manifest(eng_dir, verify_checksums=False)


@pytest.mark.parametrize("section,key,expect", [
    (None, "quantisation", "quantisation: is not a known field (did you mean 'quantization'? known: dtype, "),
    ("model", "num_layer", "model.num_layer: is not a known field (did you mean 'num_layers'?"),
    ("lookahead", "topk", "lookahead.topk: is not a known field (did you mean 'top_k'?"),
])
def test_unknown_keys_are_refused_with_a_suggestion(eng_dir, section, key, expect):
    doc = manifest_doc(eng_dir)
    (doc[section] if section else doc)[key] = 1
    write_yaml_text(eng_dir, yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(EngineDirError) as e:
        load_manifest(eng_dir)
    assert expect in one_line_error(e)


# ---- the tokenizer fits the model's vocabulary ------------------------------------------------------

def test_tokenizer_ids_past_the_vocab_are_refused_at_load(tmp_path):
    d = make_tiny_engine(tmp_path / "e", vocab_size=200)         # the byte tokenizer has 256 ids
    with pytest.raises(EngineDirError) as e:
        Engine.from_dir(d)
    msg = one_line_error(e)
    assert "tokenizer.json: the tokenizer has 56 token ids past the model's vocabulary (ids up to 255; " \
           "engine.yaml's model.vocab_size is 200)" in msg


def test_added_tokens_past_the_vocab(eng_dir):
    """A few added special tokens past the vocabulary (a GGUF's <|endoftext|>: the builder warns, a
    request holding one is refused) load; a vocabulary's worth of added tokens does not."""
    from tiny_engine import byte_tokenizer

    path = eng_dir / "tokenizer" / "tokenizer.json"
    tok = byte_tokenizer()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    reseal(eng_dir)
    assert TextTokenizer.from_engine(load_manifest(eng_dir)).encode("<|endoftext|>") == [256]
    tok.add_tokens([f"tok{i}" for i in range(300)])
    tok.save(str(path))
    reseal(eng_dir)
    with pytest.raises(EngineDirError, match=r"has 301 token ids past .*ids up to 556; .*vocab_size is 256"):
        TextTokenizer.from_engine(load_manifest(eng_dir))


# ---- chat templates render under a budget -----------------------------------------------------------

SMALL = dict(cpu_seconds=1, memory_bytes=256 << 20, max_chars=100_000)


@pytest.mark.parametrize("template,expect", [
    # 10 ** 9 iterations: over a minute unbudgeted (the pen test's 10 ** 10: hours)
    ("{% for i in range(100000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
     "ran past its CPU budget of 1 s"),
    ("{{ 'x' * 400000000 }}", "ran past its memory budget of 256 MiB"),
    ("{% for i in range(1000) %}{{ 'x' * 1000 }}{% endfor %}", "output ran past its budget of 100000 characters"),
])
def test_a_template_past_its_budget_is_a_typed_error(eng_dir, template, expect):
    from runtime.chat_template import RenderBudget

    write_template(eng_dir, template)
    tok = TextTokenizer(eng_dir / "tokenizer", budget=RenderBudget(**SMALL))
    with pytest.raises(EngineDirError) as e:
        tok.apply_chat_template("hi")
    msg = one_line_error(e)
    assert "tokenizer/tokenizer_config.json: chat_template cannot be rendered" in msg and expect in msg
    write_template(eng_dir, SMOLLM2_TEMPLATE)           # the helper restarts: the next render works
    tok = TextTokenizer(eng_dir / "tokenizer", budget=RenderBudget(**SMALL))
    assert tok.apply_chat_template("hi").endswith("<|im_start|>assistant\n")


def test_a_template_that_cannot_finish_is_refused_at_load(eng_dir, monkeypatch):
    """The engine renders its template once at load: the pen test's 3 GB string (default budget)
    and an endless loop (a 1 s budget here) fail there, naming the template, for the CLI, the
    Triton model and the Dynamo worker alike; the Dynamo launcher checks it before starting any."""
    from deploy import dynamo_launch
    from runtime import chat_template

    write_template(eng_dir, "{{ 'x' * 3000000000 }}")
    reseal(eng_dir, add=["tokenizer/tokenizer_config.json"])
    with pytest.raises(EngineDirError) as e:
        Engine.from_dir(eng_dir)
    assert "tokenizer_config.json: chat_template cannot be rendered (it ran past its memory budget" \
        in one_line_error(e)
    monkeypatch.setattr(chat_template, "DEFAULT_BUDGET", chat_template.RenderBudget(cpu_seconds=1))
    write_template(eng_dir, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    reseal(eng_dir)
    with pytest.raises(dynamo_launch.LaunchError, match="chat_template cannot be rendered .*CPU budget of 1 s"):
        dynamo_launch.check_engine(eng_dir, None)
