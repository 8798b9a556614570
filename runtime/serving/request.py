"""Triton request tensors -> a generation request; engine outputs -> response tensors.

The names follow Triton's vLLM and TensorRT-LLM backends (see triton_model_repo/README.md):

    text_input (BYTES [1], required)      stream, exclude_input_in_output (BOOL [1])
    max_tokens, top_k (INT [1])           temperature, top_p (FP32 [1])      seed (INT [1])
    stop (BYTES [n])                      sampling_parameters (BYTES [1], a JSON object)

Every problem a client can cause raises `RequestError` naming the field. Integer inputs accept any
integer width and floats accept integers, so a client that picked INT64 for `top_k` is not refused
over a detail. A tensor input overrides the same key in `sampling_parameters`.
Pure numpy: `parse_request` takes a getter, so it runs without a server.
"""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..errors import RequestError
from ..sampling import SamplingParams

if TYPE_CHECKING:
    from ..engine import RequestOutput

Getter = Callable[[str], "np.ndarray | None"]

# SamplingParams field -> the kind of value it takes, derived from its type hints (one source of truth).
_KIND_OF_HINT = {int: "int", float: "float", bool: "bool", list[str]: "strings", int | None: "optional_int"}
SAMPLING_KINDS: dict[str, str] = {name: _KIND_OF_HINT[hint] for name, hint in
                                  typing.get_type_hints(SamplingParams).items()}
TENSOR_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed")   # scalar inputs, [1] each


@dataclass
class GenerateRequest:
    prompt: str
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False


def parse_request(get: Getter, parameters: str | dict[str, Any] | None = None) -> GenerateRequest:
    """Read and validate one request. `get(name)` returns the input's array, or None when absent.

    `parameters` are the request's parameters (JSON text or a dict): HTTP /generate turns every
    top-level key that is not an input into one, so an unknown key there is refused too.
    Precedence, lowest first: parameters, sampling_parameters, tensor inputs.
    """
    prompt = _text_input(get("text_input"))
    values = _sampling_dict("parameters", _request_parameters(parameters))
    values.update(_sampling_dict("sampling_parameters", _sampling_json(get("sampling_parameters"))))
    for name in TENSOR_PARAMS:
        arr = get(name)
        if arr is not None:
            kind = SAMPLING_KINDS[name].removeprefix("optional_")
            values[name] = _convert(name, _scalar(name, arr, kind), kind)
    stop = get("stop")
    if stop is not None:
        values["stop"] = [_utf8("stop", b) for b in np.asarray(stop).reshape(-1)]
    params = SamplingParams(**values)          # validates ranges; raises RequestError naming the field
    return GenerateRequest(prompt, params, stream=_flag(get, "stream"),
                           exclude_input_in_output=_flag(get, "exclude_input_in_output"))


def _text_input(arr: np.ndarray | None) -> str:
    if arr is None:
        raise RequestError("text_input", "is missing", "send the prompt as a BYTES tensor of shape [1]")
    arr = np.asarray(arr)
    if arr.size != 1:
        raise RequestError("text_input", f"must hold exactly one prompt, got shape {list(arr.shape)}",
                           "send one request per prompt")
    return _utf8("text_input", arr.reshape(-1)[0])


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
    doc = json.loads(parameters) if isinstance(parameters, str) and parameters else (parameters or {})
    # Triton's own request parameters (e.g. triton_enable_empty_final_response) are not sampling ones.
    return {k: v for k, v in doc.items() if not k.startswith("triton_")}


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
    text = _utf8("sampling_parameters", _scalar_bytes(arr))
    try:
        doc = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise RequestError("sampling_parameters", f"is not valid JSON ({e.msg} at position {e.pos})",
                           'send an object such as {"max_tokens": 32}') from None
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
    """Coerce a JSON or tensor value to `kind`; vLLM clients often send numbers as strings ("0.7")."""
    if kind.startswith("optional_"):
        if value is None:
            return None
        kind = kind.removeprefix("optional_")
    try:
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
    except ValueError:
        pass
    raise RequestError(name, f"must be {'a list of strings' if kind == 'strings' else kind}, got {value!r}",
                       "check the value's type")


@dataclass
class ResponseStream:
    """The response side of one request: engine outputs in, response tensors out.

    Streaming: one response per engine output (one per generated token; its text may be empty while
    a multi-byte character or a possible stop string is incomplete). Otherwise one final response
    holding the whole text, prefixed by the prompt unless `exclude_input_in_output` (vLLM's default).
    """

    request: GenerateRequest
    _text: list[str] = dataclasses.field(default_factory=list)

    def on_output(self, out: RequestOutput) -> dict[str, np.ndarray] | None:
        """Tensors for the response to send now, or None (non-streaming and not finished yet)."""
        if self.request.stream:
            return response_tensors(out.delta_text, out.num_prompt_tokens, len(out.new_token_ids),
                                    out.finish_reason)
        self._text.append(out.delta_text)
        if not out.finished:
            return None
        prefix = "" if self.request.exclude_input_in_output else self.request.prompt
        return response_tensors(prefix + "".join(self._text), out.num_prompt_tokens, out.num_output_tokens,
                                out.finish_reason)


def response_tensors(text: str, num_input_tokens: int, num_output_tokens: int,
                     finish_reason: str | None) -> dict[str, np.ndarray]:
    out = {"text_output": np.array([text.encode("utf-8")], dtype=np.object_),
           "num_input_tokens": np.array([num_input_tokens], dtype=np.int32),
           "num_output_tokens": np.array([num_output_tokens], dtype=np.int32)}
    if finish_reason is not None:
        out["finish_reason"] = np.array([finish_reason.encode()], dtype=np.object_)
    return out
