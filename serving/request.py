"""Triton request tensors -> a generation request; engine outputs -> response tensors.

The names follow Triton's vLLM and TensorRT-LLM backends (see triton_model_repo/README.md):

    text_input (BYTES [1], required)      stream, exclude_input_in_output (BOOL [1])
    max_tokens, top_k (INT [1])           temperature, top_p (FP32 [1])      seed (INT [1])
    stop (BYTES [n])                      sampling_parameters (BYTES [1], a JSON object)

Every problem a client can cause raises `RequestError` naming the field as the client sent it,
malformed JSON (too large, nested too deeply, a number out of range) included: a value the runtime
refuses (`SamplingParams`, the engine) names the runtime's field, which `GenerateRequest.fields`
maps to the request's (`prompt` -> `text_input`, `temperature` sent in `sampling_parameters` ->
`sampling_parameters.temperature`; the table is serving/fields.py, and `GenerateRequest.error`
applies it to errors the engine raises later). Integer inputs accept any integer width
and floats accept integers, so a client that picked INT64 for `top_k` is not refused over a detail.
A tensor input overrides the same key in `sampling_parameters`.

Sizes are bounded before any tokenizing (`RequestLimits`): a prompt whose UTF-8 bytes cannot fit
max_model_len tokens, a stop string no output could ever reach, more than MAX_STOP_STRINGS stop
strings, or a JSON document over MAX_JSON_BYTES is refused at once.
Pure numpy: `parse_request` takes a getter, so it runs without a server.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from runtime.errors import LookaheadError, RequestError
from runtime.sampling_params import SamplingParams

from .fields import TRITON_FIELDS, client_error

if TYPE_CHECKING:
    from runtime.engine import RequestOutput

Getter = Callable[[str], "np.ndarray | None"]

# SamplingParams field -> the kind of value it takes, derived from its type hints (one source of truth).
_KIND_OF_HINT = {int: "int", float: "float", bool: "bool", list[str]: "strings", int | None: "optional_int"}
SAMPLING_KINDS: dict[str, str] = {name: _KIND_OF_HINT[hint] for name, hint in
                                  typing.get_type_hints(SamplingParams).items()}
TENSOR_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed")   # scalar inputs, [1] each
MAX_JSON_BYTES = 64 * 1024           # sampling_parameters / request parameters: a few keys, not a document
MAX_STOP_STRINGS = 64
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
FP32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class RequestLimits:
    """What an engine can take, checked before tokenizing.

    `max_token_bytes`: the most UTF-8 bytes of text one token covers (`max_token_bytes()` of the
    engine's tokenizer; None: no bound known). Every token covers a run of the text, so a prompt of
    B bytes is at least B / max_token_bytes tokens, and one longer than
    (max_model_len - max_tokens) * max_token_bytes bytes can never fit: it is refused without
    being tokenized. The bound is safe, not tight (81 bytes a token for SmolLM2, whose longest
    token is 80 spaces and a newline, against ~4 for English), so prompts under it are tokenized
    and the engine checks their exact length.
    """

    max_model_len: int
    max_token_bytes: int | None

    @classmethod
    def for_engine(cls, engine: Any) -> "RequestLimits":
        return cls(engine.max_model_len, max_token_bytes(engine.tokenizer))

    def max_prompt_bytes(self, max_tokens: int) -> int | None:
        if self.max_token_bytes is None:
            return None
        return max(1, self.max_model_len - max_tokens) * self.max_token_bytes

    @property
    def max_stop_bytes(self) -> int | None:
        """Longer than any output can be: such a stop string never matches (and would hold the
        whole stream back, as a possible stop-string prefix)."""
        return None if self.max_token_bytes is None else self.max_model_len * self.max_token_bytes


def max_token_bytes(tokenizer: Any) -> int | None:
    """The most UTF-8 bytes of input text one token of `tokenizer` covers, or None when unbounded.

    `tokenizer`: a runtime TextTokenizer or a `tokenizers.Tokenizer`. A token covers at most the
    UTF-8 length of its vocabulary string: exactly its character count in a byte-level vocabulary
    (one character per byte), and for other schemes the string over-counts ("▁" for a space,
    "##", "<0x41>" for one byte). Added tokens count their content. Then:
    - an unknown token that can stand for a whole word or a fused run (WordLevel, WordPiece,
      Unigram or BPE with fuse_unk, all without byte fallback) makes the bound None;
    - one that stands for a single character counts 4 bytes;
    - a normalizer may shrink text (composition, stripping accents): the bound is taken 4x.
    """
    from tokenizers import decoders, models

    tok = getattr(tokenizer, "_tok", tokenizer)
    try:
        vocab = tok.get_vocab(with_added_tokens=False)
        added = tok.get_added_tokens_decoder()
    except AttributeError:
        return None
    byte_level = isinstance(tok.decoder, decoders.ByteLevel)
    longest = max((len(t) if byte_level else len(t.encode("utf-8")) for t in vocab), default=1)
    longest = max([longest, 1] + [len(a.content.encode("utf-8")) for a in added.values()])
    model = tok.model
    byte_fallback = byte_level or bool(getattr(model, "byte_fallback", False))
    if not byte_fallback:
        if isinstance(model, (models.WordLevel, models.WordPiece, models.Unigram)):
            return None
        if getattr(model, "unk_token", None):
            if getattr(model, "fuse_unk", False):
                return None
            longest = max(longest, 4)
    return longest * (4 if tok.normalizer is not None else 1)


@dataclass
class GenerateRequest:
    prompt: str
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    # runtime field -> the name this request sent it under (serving/fields.py's TRITON_FIELDS, then
    # `sampling_parameters.<key>` / `parameters.<key>` for the values that came from there)
    fields: dict[str, str] = dataclasses.field(default_factory=lambda: dict(TRITON_FIELDS))

    def error(self, error: LookaheadError) -> LookaheadError:
        """An error the runtime raised for this request (naming its own field), naming the
        request's field instead; same type, problem and fix."""
        return client_error(error, self.fields)


def parse_request(get: Getter, parameters: str | dict[str, Any] | None = None,
                  limits: RequestLimits | None = None) -> GenerateRequest:
    """Read and validate one request. `get(name)` returns the input's array, or None when absent.

    `parameters` are the request's parameters (JSON text or a dict): HTTP /generate turns every
    top-level key that is not an input into one, so an unknown key there is refused too.
    Precedence, lowest first: parameters, sampling_parameters, tensor inputs.
    `limits`: the engine's size bounds (`RequestLimits`), checked here; None checks none.
    """
    prompt, prompt_bytes = _text_input(get("text_input"))
    fields = dict(TRITON_FIELDS)
    values: dict[str, Any] = {}
    for source, doc in (("parameters", _request_parameters(parameters)),
                        ("sampling_parameters", _sampling_json(get("sampling_parameters")))):
        found = _sampling_dict(source, doc)
        values.update(found)
        fields.update({key: f"{source}.{key}" for key in found})
    for name in TENSOR_PARAMS:
        arr = get(name)
        if arr is not None:
            kind = SAMPLING_KINDS[name].removeprefix("optional_")
            values[name] = _convert(name, _scalar(name, arr, kind), kind)
            fields[name] = name
    if _flag(get, "return_logprobs") and values.get("logprobs") is None:
        values["logprobs"] = 0                  # vLLM's switch: the chosen tokens' log-probabilities
        fields["logprobs"] = "return_logprobs"
    stop = get("stop")
    if stop is not None:
        values["stop"] = _stop_strings(np.asarray(stop).reshape(-1), limits)
        fields["stop"] = "stop"
    elif "stop" in values:
        _check_stop(values["stop"], limits, fields["stop"])
    try:
        params = SamplingParams(**values)      # validates ranges; raises RequestError naming its field
    except RequestError as e:
        raise client_error(e, fields) from None
    if params.prompt_logprobs is not None:     # the Triton model has no output for them
        raise RequestError(fields.get("prompt_logprobs", "prompt_logprobs"), "are not returned by the Triton model",
                           "ask the OpenAI API for them (serve.sh start --frontend dynamo; /v1/completions with "
                           "echo: true and logprobs: k), or omit prompt_logprobs")
    _check_prompt_bytes(prompt_bytes, params.max_tokens, limits, fields["max_tokens"])
    return GenerateRequest(prompt, params, stream=_flag(get, "stream"),
                           exclude_input_in_output=_flag(get, "exclude_input_in_output"), fields=fields)


# A model input's datatype (config.pbtxt) -> how a JSON value of HTTP /generate becomes its tensor:
# (numpy dtype, the `_convert` kind, the integer's width in bits or None).
_JSON_INPUT = {"TYPE_STRING": (np.object_, "bytes", None), "TYPE_BOOL": (np.bool_, "bool", None),
               "TYPE_INT32": (np.int32, "int", 32), "TYPE_INT64": (np.int64, "int", 64),
               "TYPE_FP32": (np.float32, "float", None)}


def generate_json_inputs(doc: Any, input_types: dict[str, str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """An HTTP /generate body -> (the model's input arrays, the request parameters), mapped as
    tritonserver maps it: a top-level key naming an input (`input_types`: name -> its config's
    data_type) is that input, a value or a list of values; any other key is a request parameter.
    Unlike tritonserver 2.51, which wraps integers to the input's width and answers 500 to a value
    of the wrong JSON type, each value is typed and range-checked here with the same conversion
    `sampling_parameters` gets: RequestError naming the key. `parse_request(arrays.get, parameters)`
    then checks the request as the model will."""
    if not isinstance(doc, dict):
        raise RequestError("body", f"must be a JSON object of the model's inputs, got {_json_type(doc)}",
                           'send e.g. {"text_input": "Hello", "max_tokens": 16}')
    arrays, parameters = {}, {}
    for key, value in doc.items():
        if key in input_types:
            arrays[key] = _json_tensor(key, value, input_types[key])
        else:
            parameters[key] = _json_parameter(key, value)
    return arrays, parameters


def _json_tensor(name: str, value: Any, data_type: str) -> np.ndarray:
    if data_type not in _JSON_INPUT:                       # pragma: no cover - a config this module does not know
        raise RequestError(name, f"has datatype {data_type}, which /generate cannot fill", "send it over gRPC")
    dtype, kind, bits = _JSON_INPUT[data_type]
    values = _flat(value)
    if kind == "bytes":
        return np.array([_json_bytes(name, v) for v in values], dtype=np.object_)
    out = [_convert(name, v, kind) for v in values]
    for v, raw in zip(out, values):
        if bits == 32 and not -(1 << 31) <= v < 1 << 31:
            raise RequestError(name, f"must be a 32-bit integer (the input is INT32), got {_short(raw)}",
                               f"use a value in [{-(1 << 31)}, {(1 << 31) - 1}]")
        if kind == "float" and abs(v) > FP32_MAX:
            raise RequestError(name, f"must be a finite 32-bit float (the input is FP32), got {_short(raw)}",
                               "check the value")
    return np.array(out, dtype=dtype)


def _flat(value: Any) -> list[Any]:
    """A JSON value or (nested) list of values, flattened, as tritonserver reads an input's data."""
    if not isinstance(value, list):
        return [value]
    return [v for item in value for v in _flat(item)]


def _json_bytes(name: str, value: Any) -> bytes:
    if not isinstance(value, str):
        fix = "send the object as a JSON string (json.dumps)" if isinstance(value, dict) else "send text"
        raise RequestError(name, f"must be a string or a list of strings, got {_json_type(value)}", fix)
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(name, f"holds a lone UTF-16 surrogate ({value[e.start]!r} at offset {e.start}), which "
                                 "UTF-8 cannot encode", "send valid Unicode text") from None


def _json_parameter(key: str, value: Any) -> Any:
    """A request parameter is a number, a boolean or a string (as tritonserver's parameters are)."""
    if isinstance(value, (bool, int, float, str)):
        return value
    raise RequestError(f"parameters.{key}", f"must be a number, boolean or string, got {_json_type(value)}",
                       "send a sampling parameter as a plain value, or inside sampling_parameters")


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", type(None): "null", bool: "a boolean", str: "a string",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _text_input(arr: np.ndarray | None) -> tuple[str, int]:
    """(the prompt, its length in UTF-8 bytes)."""
    if arr is None:
        raise RequestError("text_input", "is missing", "send the prompt as a BYTES tensor of shape [1]")
    arr = np.asarray(arr)
    if arr.size != 1:
        raise RequestError("text_input", f"must hold exactly one prompt, got shape {list(arr.shape)}",
                           "send one request per prompt")
    text = _utf8("text_input", arr.reshape(-1)[0])
    raw = arr.reshape(-1)[0]
    return text, len(raw) if isinstance(raw, (bytes, np.bytes_)) else len(text.encode("utf-8"))


def _check_prompt_bytes(num_bytes: int, max_tokens: int, limits: RequestLimits | None,
                        max_tokens_name: str = "max_tokens") -> None:
    bound = None if limits is None else limits.max_prompt_bytes(max_tokens)
    if bound is not None and num_bytes > bound:
        raise RequestError(
            "text_input", f"is {num_bytes} bytes, more than max_model_len {limits.max_model_len} tokens can "
            f"hold with {max_tokens_name} {max_tokens} (at most {bound} bytes: a token of this engine's tokenizer "
            f"covers at most {limits.max_token_bytes})", f"shorten the prompt or lower {max_tokens_name}")


def _stop_strings(items: np.ndarray, limits: RequestLimits | None) -> list[str]:
    """The `stop` tensor's strings; counts and sizes are checked before anything is decoded."""
    if items.size > MAX_STOP_STRINGS:
        raise RequestError("stop", f"holds {items.size} strings, more than {MAX_STOP_STRINGS}",
                           "send fewer stop strings")
    bound = None if limits is None else limits.max_stop_bytes
    for b in items:
        if bound is not None and isinstance(b, (bytes, np.bytes_)) and len(b) > bound:
            raise RequestError("stop", f"holds a string of {len(b)} bytes, longer than any output of this "
                               f"engine can be ({bound} bytes)", "send shorter stop strings")
    return [_utf8("stop", b) for b in items]


def _check_stop(stop: list[str], limits: RequestLimits | None, name: str) -> None:
    """The same bounds for stop strings sent in JSON (already decoded)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(name, f"holds {len(stop)} strings, more than {MAX_STOP_STRINGS}",
                           "send fewer stop strings")
    bound = None if limits is None else limits.max_stop_bytes
    longest = max((len(s.encode("utf-8", "surrogatepass")) for s in stop), default=0)
    if bound is not None and longest > bound:
        raise RequestError(name, f"holds a string of {longest} bytes, longer than any output of this "
                           f"engine can be ({bound} bytes)", "send shorter stop strings")


def _utf8(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, np.bytes_)):
        raise RequestError(name, f"must be text (BYTES), got {type(value).__name__}", "send a UTF-8 string")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(name, f"is not valid UTF-8 (byte {value[e.start]:#04x} at offset {e.start})",
                           "encode the text as UTF-8") from None


def _scalar(name: str, arr: np.ndarray, kind: str) -> Any:
    arr = np.asarray(arr)
    if arr.size != 1:
        raise RequestError(name, f"must hold exactly one value, got shape {list(arr.shape)}", "send shape [1]")
    accepted, fix = {"int": ("iu", "send an INT32 or INT64 tensor"), "float": ("iuf", "send an FP32 tensor"),
                     "bool": ("b", "send a BOOL tensor")}[kind]
    if arr.dtype.kind not in accepted:
        raise RequestError(name, f"must be {kind}, got a tensor of dtype {arr.dtype}", fix)
    return arr.reshape(-1)[0].item()


def _flag(get: Getter, name: str) -> bool:
    arr = get(name)
    return False if arr is None else bool(_scalar(name, arr, "bool"))


def _request_parameters(parameters: str | dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(parameters, str):
        doc = _json_object("parameters", parameters) if parameters else {}
    else:
        doc = parameters or {}
    if not isinstance(doc, dict):
        raise RequestError("parameters", f"must be a JSON object, got {type(doc).__name__}",
                           "send request parameters as an object")
    # Triton's own request parameters (e.g. triton_enable_empty_final_response) are not sampling ones.
    return {k: v for k, v in doc.items() if not k.startswith("triton_")}


def _json_object(name: str, text: str) -> Any:
    """json.loads with every failure a RequestError naming `name`: a document over MAX_JSON_BYTES,
    invalid JSON, nesting deeper than the interpreter's recursion limit, a number with more digits
    than Python converts (ValueError)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_JSON_BYTES:
        raise RequestError(name, f"is {size} bytes of JSON, more than {MAX_JSON_BYTES}",
                           'send a small object such as {"max_tokens": 32}')
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(name, f"is not valid JSON ({e.msg} at position {e.pos})",
                           'send an object such as {"max_tokens": 32}') from None
    except RecursionError:
        raise RequestError(name, "nests JSON arrays or objects too deeply",
                           "send a flat object of sampling parameters") from None
    except ValueError as e:          # e.g. an integer literal of more than 4300 digits
        reason = str(e).split(":")[0].split(";")[0]
        raise RequestError(name, f"holds a value JSON cannot be read into ({reason})",
                           "send numbers of ordinary size") from None


def _sampling_dict(source: str, doc: dict[str, Any]) -> dict[str, Any]:
    """Check keys against SamplingParams' fields and coerce each value to its field's kind."""
    out = {}
    for key, value in doc.items():
        if key not in SAMPLING_KINDS:
            raise RequestError(f"{source}.{key}", "is not a known sampling parameter",
                               f"known: {', '.join(SAMPLING_KINDS)}")
        out[key] = _convert(f"{source}.{key}", value, SAMPLING_KINDS[key])
    return out


def _sampling_json(arr: np.ndarray | None) -> dict[str, Any]:
    """Parse the vLLM-style `sampling_parameters` JSON object (a BYTES tensor) into a dict."""
    if arr is None:
        return {}
    raw = _scalar_bytes(arr)
    if isinstance(raw, (bytes, np.bytes_)) and len(raw) > MAX_JSON_BYTES:      # before decoding it
        raise RequestError("sampling_parameters", f"is {len(raw)} bytes of JSON, more than {MAX_JSON_BYTES}",
                           'send a small object such as {"max_tokens": 32}')
    text = _utf8("sampling_parameters", raw)
    doc = _json_object("sampling_parameters", text) if text.strip() else {}
    if not isinstance(doc, dict):
        raise RequestError("sampling_parameters", f"must be a JSON object, got {type(doc).__name__}",
                           'e.g. {"temperature": 0.7}')
    return doc


def _scalar_bytes(arr: np.ndarray) -> Any:
    arr = np.asarray(arr)
    if arr.size != 1:
        raise RequestError("sampling_parameters", f"must hold one JSON object, got shape {list(arr.shape)}",
                           "send shape [1]")
    return arr.reshape(-1)[0]


def _convert(name: str, value: Any, kind: str) -> Any:
    """Coerce a JSON or tensor value to `kind`; vLLM clients often send numbers as strings ("0.7").
    Integers must fit 64 bits and floats must be finite (as a tensor input's would)."""
    if kind.startswith("optional_"):
        if value is None:
            return None
        kind = kind.removeprefix("optional_")
    out: Any = _INVALID
    try:
        out = _coerce(value, kind)
    except (ValueError, OverflowError):  # int("x"), int("9" * 5000), float(10 ** 400), int(inf)
        pass
    if out is _INVALID:
        raise RequestError(name, f"must be {'a list of strings' if kind == 'strings' else kind}, "
                           f"got {_short(value)}", "check the value's type")
    if kind == "int" and not INT64_MIN <= out <= INT64_MAX:
        raise RequestError(name, f"must be a 64-bit integer, got {_short(value)}",
                           f"use a value in [{INT64_MIN}, {INT64_MAX}]")
    if kind == "float" and not math.isfinite(out):
        raise RequestError(name, f"must be a finite number, got {_short(value)}", "check the value")
    return out


_INVALID = object()


def _coerce(value: Any, kind: str) -> Any:
    """`value` as `kind`, or _INVALID; may raise ValueError/OverflowError."""
    if kind == "bool":
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, (bool, int)) and value in (0, 1):
            return bool(value)
    elif kind == "int" and not isinstance(value, bool):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, (int, str)):
            return int(value)
    elif kind == "float" and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        return float(value)
    elif kind == "strings":
        values = [value] if isinstance(value, str) else value
        if isinstance(values, list) and all(isinstance(v, str) for v in values):
            return values
    return _INVALID


def _short(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: an error line must stay one short line."""
    try:
        text = repr(value)
    except ValueError:               # an int too long for repr (over 4300 digits)
        return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass
class ResponseStream:
    """The response side of one request: engine outputs in, response tensors out.

    Streaming: one response per engine output (one per generated token; its text may be empty while
    a multi-byte character or a possible stop string is incomplete). Otherwise one final response
    holding the whole text, prefixed by the prompt unless `exclude_input_in_output` (vLLM's default).

    With `n` > 1 (sampling_parameters.n) the per-choice outputs are `[n]` tensors, as in Triton's
    vLLM backend: `text_output`, `num_output_tokens`, `finish_reason` and `logprobs` hold one
    entry per choice (streaming: the choice that moved has its delta, the others "" and 0). A
    request's final response is the one that ends its last choice. `num_cached_tokens` (every
    response) is the prompt tokens whose KV came from the prefix cache when the request arrived
    (the least of its choices: the later ones find the blocks the first prefilled). `logprobs` (when asked
    for: sampling_parameters.logprobs = k, or return_logprobs) is a JSON list per choice, one
    entry per token: {"token_id", "token", "logprob", "top_logprobs": [{"token_id", "token",
    "logprob"}, ... k, most likely first]}.
    """

    request: GenerateRequest
    decode: Callable[[list[int]], str] | None = None
    _text: list[list[str]] = dataclasses.field(default_factory=list)
    _tokens: list[int] = dataclasses.field(default_factory=list)
    _logprobs: list[list[dict[str, Any]]] = dataclasses.field(default_factory=list)
    _finish: list[str] = dataclasses.field(default_factory=list)
    _cached: dict[int, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        n = self.n
        self._text = [[] for _ in range(n)]
        self._tokens = [0] * n
        self._logprobs = [[] for _ in range(n)]
        self._finish = [""] * n

    @property
    def n(self) -> int:
        return int(getattr(self.request.params, "n", 1) or 1)

    @property
    def wants_logprobs(self) -> bool:
        return getattr(self.request.params, "logprobs", None) is not None

    def on_output(self, out: RequestOutput) -> dict[str, np.ndarray] | None:
        """Tensors for the response to send now, or None (non-streaming and not finished yet)."""
        i = int(getattr(out, "index", 0) or 0)
        lps = self._logprob_entries(out) if self.wants_logprobs else None
        if out.finished:
            self._finish[i] = out.finish_reason or ""
        # the request's cached tokens: the least any choice reports (with n > 1 the later choices
        # find the blocks the first one prefilled)
        self._cached[i] = min(self._cached.get(i, 1 << 62), int(getattr(out, "num_cached_tokens", 0) or 0))
        cached = min(self._cached.values())
        done = bool(out.finished and getattr(out, "request_finished", True))
        if self.request.stream:
            texts, counts = [""] * self.n, [0] * self.n
            texts[i], counts[i] = out.delta_text, len(out.new_token_ids)
            logprobs = None
            if lps is not None:
                logprobs = [[] for _ in range(self.n)]
                logprobs[i] = lps
            return response_tensors(texts, out.num_prompt_tokens, counts, self._finish if done else None,
                                    num_cached_tokens=cached, logprobs=logprobs)
        self._text[i].append(out.delta_text)
        self._tokens[i] = out.num_output_tokens
        if lps is not None:
            self._logprobs[i].extend(lps)
        if not done:
            return None
        prefix = "" if self.request.exclude_input_in_output else self.request.prompt
        return response_tensors([prefix + "".join(t) for t in self._text], out.num_prompt_tokens, self._tokens,
                                self._finish, num_cached_tokens=cached,
                                logprobs=self._logprobs if self.wants_logprobs else None)

    def _logprob_entries(self, out: RequestOutput) -> list[dict[str, Any]]:
        def tok(tid: int) -> dict[str, Any]:
            return {"token_id": int(tid)} if self.decode is None else {"token_id": int(tid),
                                                                      "token": self.decode([int(tid)])}
        return [{**tok(t.token_id), "logprob": float(t.logprob),
                 "top_logprobs": [{**tok(tid), "logprob": float(lp)} for tid, lp in t.top]}
                for t in (getattr(out, "logprobs", None) or [])]


def response_tensors(text: str | list[str], num_input_tokens: int, num_output_tokens: int | list[int],
                     finish_reason: str | list[str] | None, *, num_cached_tokens: int | None = None,
                     logprobs: list[list[dict[str, Any]]] | None = None) -> dict[str, np.ndarray]:
    """One response's tensors; `text`, `num_output_tokens`, `finish_reason` and `logprobs` are one
    value or one per choice."""
    texts = [text] if isinstance(text, str) else list(text)
    counts = [num_output_tokens] if isinstance(num_output_tokens, int) else list(num_output_tokens)
    out = {"text_output": np.array([t.encode("utf-8") for t in texts], dtype=np.object_),
           "num_input_tokens": np.array([num_input_tokens], dtype=np.int32),
           "num_output_tokens": np.array(counts, dtype=np.int32)}
    if num_cached_tokens is not None:
        out["num_cached_tokens"] = np.array([num_cached_tokens], dtype=np.int32)
    if finish_reason is not None:
        reasons = [finish_reason] if isinstance(finish_reason, str) else list(finish_reason)
        out["finish_reason"] = np.array([r.encode() for r in reasons], dtype=np.object_)
    if logprobs is not None:
        out["logprobs"] = np.array([json.dumps(lp).encode() for lp in logprobs], dtype=np.object_)
    return out
