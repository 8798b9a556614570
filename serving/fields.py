"""The request's own names for the runtime's fields, and core errors reported under them.

The runtime names its fields as it knows them (runtime/errors.py): `prompt`, the `SamplingParams`
fields, `request_id`. Each front end calls some of them something else, and a client must read the
name it sent. The tables below are the only place those names meet:

| runtime field | Triton (KServe tensors, HTTP /generate) | OpenAI / Dynamo (/v1) |
|---|---|---|
| `prompt` | `text_input` | `prompt/messages` (completions send `prompt`, chat `messages`) |
| `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop` | the input of that name | the same name |
| `ignore_eos` | `sampling_parameters.ignore_eos` (no tensor input) | `ignore_eos` |
| `n`, `logprobs` | `sampling_parameters.n`, `sampling_parameters.logprobs` (no tensor inputs, as in Triton's vLLM backend) | `n`; `logprobs` (chat sends it as `top_logprobs`) |

A Triton request may also send a sampling field inside `sampling_parameters` or as a request
parameter; `serving.request.parse_request` records where each came from, so its errors name
`sampling_parameters.max_tokens` when that is what the client typed (`GenerateRequest.fields`).

`client_error(error, names)` is the error of the same type, problem and fix, naming the request's
field; an error whose field the table lacks (or that has none, a full queue) is returned as is.
"""
from __future__ import annotations

from typing import Mapping, TypeVar

from runtime.errors import LookaheadError

E = TypeVar("E", bound=LookaheadError)

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")

# runtime field -> the Triton model's request name (triton_model_repo/lookahead_llm/config.pbtxt.template)
TRITON_FIELDS: dict[str, str] = {"prompt": "text_input", **{f: f for f in SAMPLING_FIELDS},
                                 **{f: f"sampling_parameters.{f}" for f in ("ignore_eos", "n", "logprobs")}}

# runtime field -> the OpenAI request's name, as Dynamo's frontend receives it
OPENAI_FIELDS: dict[str, str] = {"prompt": "prompt/messages", **{f: f for f in SAMPLING_FIELDS},
                                 "ignore_eos": "ignore_eos", "n": "n", "logprobs": "logprobs"}


def client_error(error: E, names: Mapping[str, str]) -> E:
    """`error` naming the request's field instead of the runtime's (see the module docstring)."""
    field = getattr(error, "field", None)
    renamed = getattr(error, "renamed", None)
    if field is None or renamed is None or field not in names:
        return error
    return renamed(names[field])
