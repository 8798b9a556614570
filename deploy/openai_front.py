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
        echo = doc.get("echo")
        if echo not in (None, False, True):
            raise HttpError(400, f"echo: must be true or false, got {_short(echo)} (omit it, or send true)", "echo")
        if echo and doc.get("stream"):
            raise HttpError(400, "echo: is served on non-streaming requests only (send stream: false, or omit echo)",
                            "echo")
        if echo and _num_prompts(doc.get("prompt")) != 1:
            raise HttpError(400, "echo: is served for one prompt a request (send the prompts one at a time)", "echo")


def _num_prompts(prompt: Any) -> int:
    """How many prompts a completions `prompt` holds: a string or a list of token ids is one; a
    list of strings or of id lists is one each."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_int(t) for t in prompt)):
        return 1
    return len(prompt) if isinstance(prompt, list) else 0


def _prompt_text(prompt: Any) -> str | None:
    """The text of a one-prompt `prompt` (None for token ids: the echo then joins the tokens' text)."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def echo_rewrite(req):
    """deploy.http_front's rewrite: completions `echo` (lm-eval's loglikelihood requests send
    echo: true, logprobs: k, max_tokens: 1). Dynamo 1.6.1's frontend asks the worker for the
    prompt's log-probabilities but does not put them, nor the prompt, into the answer; it passes
    the worker's `engine_data` on under `nvext` when asked. So the request goes on asking for it,
    and the answer's choices get the prompt in front: the text, and with `logprobs` the prompt's
    tokens, their log-probabilities (None for the first), top alternatives and text offsets, as
    OpenAI's and vLLM's completions return them. Returns the response transform, or None for any
    other request (which passes untouched)."""
    if req.method != "POST" or not req.body or req.path != COMPLETIONS:
        return None
    doc = json.loads(req.body)
    if not isinstance(doc, dict) or doc.get("echo") is not True:
        return None
    nvext = doc.get("nvext") if isinstance(doc.get("nvext"), dict) else {}
    fields = nvext.get("extra_fields") if isinstance(nvext.get("extra_fields"), list) else []
    keep_engine_data = "engine_data" in fields
    doc["nvext"] = {**nvext, "extra_fields": fields + ([] if keep_engine_data else ["engine_data"])}
    req.body = json.dumps(doc).encode()
    k, text = doc.get("logprobs"), _prompt_text(doc.get("prompt"))

    def transform(status: int, body: bytes) -> bytes:
        if status != 200:
            return body
        resp = json.loads(body)
        data = (resp.get("nvext") or {}).get("engine_data") or {}
        if not keep_engine_data and isinstance(resp.get("nvext"), dict):
            resp["nvext"].pop("engine_data", None)
            if not resp["nvext"]:
                resp.pop("nvext")
        ids, tokens, plp = data.get("prompt_token_ids"), data.get("prompt_tokens"), data.get("prompt_logprobs")
        if not ids or tokens is None or plp is None:
            raise ValueError("the worker sent no prompt log-probabilities for an echo request")
        for choice in resp.get("choices") or []:
            choice["text"] = (text if text is not None else "".join(tokens)) + (choice.get("text") or "")
            if k is not None:
                choice["logprobs"] = echo_logprobs(ids, tokens, plp, k, choice.get("logprobs"))
        return json.dumps(resp).encode()
    return transform


def echo_logprobs(ids: list[int], tokens: list[str], plp: list, k: int, out: dict | None) -> dict:
    """OpenAI completions `logprobs` for prompt + output: the prompt's entries from the worker's
    prompt_logprobs (per position None or {token id: {logprob, rank, decoded_token}}), then the
    output's as the frontend rendered them; text offsets over the whole."""
    out = out or {}
    lps: list = [None]
    tops: list = [None]
    for i in range(1, len(ids)):
        entries = plp[i] if i < len(plp) and plp[i] else {}
        own = entries.get(str(ids[i]), {})
        lps.append(own.get("logprob"))
        best = sorted(entries.items(), key=lambda e: e[1].get("rank") or 1 << 30)
        tops.append({e.get("decoded_token", tid): e["logprob"] for tid, e in best
                     if (e.get("rank") or 1 << 30) <= k or tid == str(ids[i])})
    all_tokens = list(tokens) + list(out.get("tokens") or [])
    offsets, at = [], 0
    for t in all_tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": all_tokens, "token_logprobs": lps + list(out.get("token_logprobs") or []),
            "top_logprobs": tops + list(out.get("top_logprobs") or []), "text_offset": offsets}


def check_openai_request(req) -> None:
    """deploy.http_front's check: the JSON body of a POST to the OpenAI completion routes."""
    if req.method != "POST" or not req.body:
        return
    if req.path not in (CHAT, COMPLETIONS):         # the normalised path (deploy/request_target.py)
        return
    check_openai_body(req.path, json.loads(req.body))      # http_front parsed it once already: it parses


def openai_error_body(status: int, message: str, field: str | None) -> bytes:
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": field, "code": status}}).encode()


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
