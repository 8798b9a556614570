"""What the OpenAI API (Dynamo's frontend) accepts that this engine cannot serve: refused by name, in front.

Dynamo 1.6.1's frontend, in Tokens mode, turns a request into token ids, stop conditions and
sampling/output options for the worker. Some OpenAI fields never reach a worker: `tools`,
`tool_choice`, `functions`, `logit_bias`, `suffix`, ... are accepted by the frontend and either
dropped or rendered into the prompt, and the answer then reads as if they had been honoured. A
worker cannot refuse what it does not see, so `dynamo_launch` puts `deploy.http_front` in front of
the frontend with `check_openai_request` as its check: such a field gets a 400 naming it before
the frontend sees the request. Fields that do reach the worker (penalties, `response_format` as
guided decoding, `n`, `logprobs`, ...) are checked there (serving/dynamo_worker.py); here only
their JSON types are, since the frontend's own message for a wrong type names no field
("invalid type: string "x", expected u8 at line 1 column 92").

Every refusal is one line, `<field>: <problem> (<fix>)`, in OpenAI's error shape
{"error": {"message", "type": "invalid_request_error", "param", "code": 400}}.
"""
from __future__ import annotations

import json
from typing import Any

from .http_front import HttpError

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

# field -> (the values that mean "off", why it is refused). A field absent or "off" passes.
_UNSERVED_CHAT = {
    "tools": ((None, []), "this engine has no tool calling; the model would answer as if no tools were sent"),
    "tool_choice": ((None, "none"), "this engine has no tool calling"),
    "parallel_tool_calls": ((None,), "this engine has no tool calling"),
    "functions": ((None, []), "this engine has no function calling"),
    "function_call": ((None, "none"), "this engine has no function calling"),
    "logit_bias": ((None, {}), "logit biases are not applied by this engine"),
    "audio": ((None,), "this engine produces text only"),
    "modalities": ((None, ["text"]), "this engine produces text only"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
}
_UNSERVED_COMPLETIONS = {
    "suffix": ((None, ""), "insertion (a suffix) is not supported"),
    "echo": ((None, False), "the prompt is not echoed and prompt log-probabilities are not returned"),
    "logit_bias": ((None, {}), "logit biases are not applied by this engine"),
}


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_openai_body(path: str, doc: Any) -> None:
    """Raise HttpError(400, naming the field) for a /v1/chat/completions or /v1/completions body
    asking for what this engine cannot serve, or with `n` / `logprobs` / `top_logprobs` of the
    wrong JSON type. Other paths and bodies pass."""
    if path not in (CHAT, COMPLETIONS) or not isinstance(doc, dict):
        return
    unserved = _UNSERVED_CHAT if path == CHAT else _UNSERVED_COMPLETIONS
    for field, (off, why) in unserved.items():
        if field in doc and doc[field] not in off:
            raise HttpError(400, f"{field}: is not supported ({why}) (omit {field})", field)
    n = doc.get("n")
    if n is not None and not _int(n):
        raise HttpError(400, f"n: must be an integer, got {_short(n)} (send 1..16, or omit it)", "n")
    if path == CHAT:
        if doc.get("logprobs") is not None and not isinstance(doc["logprobs"], bool):
            raise HttpError(400, f"logprobs: must be true or false, got {_short(doc['logprobs'])} "
                                 f"(send top_logprobs: k for k alternatives)", "logprobs")
        top = doc.get("top_logprobs")
        if top is not None and not _int(top):
            raise HttpError(400, f"top_logprobs: must be an integer, got {_short(top)} (send 0..20)",
                            "top_logprobs")
    else:
        lp = doc.get("logprobs")
        if lp is not None and not _int(lp):
            raise HttpError(400, f"logprobs: must be an integer, got {_short(lp)} (send 0..5)", "logprobs")


def check_openai_request(req) -> None:
    """deploy.http_front's check: the JSON body of a POST to the OpenAI completion routes."""
    if req.method != "POST" or not req.body:
        return
    path = req.target.split("?", 1)[0].rstrip("/")
    if path not in (CHAT, COMPLETIONS):
        return
    check_openai_body(path, json.loads(req.body))      # http_front parsed it once already: it parses


def openai_error_body(status: int, message: str, field: str | None) -> bytes:
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": field, "code": status}}).encode()


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
